"""Strategy: every parallel dimension and execution choice of one training run.

Field constraints that need no context (a degree is positive) are checked here; the rules that
relate a strategy to a model or a cluster live in ``rules.py`` and are written once over arrays.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ndplan.strategy.precision import PRECISION_PRESETS, PrecisionPolicy, get_precision

Schedule = Literal["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "gpipe", "seq1f1b"]
CpKind = Literal["ring", "ulysses", "hybrid", "allgather"]
Recompute = Literal["none", "selective", "full"]
RecomputeModule = Literal["core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts"]
OffloadModule = Literal["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]

SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "gpipe", "seq1f1b")
#: Context-parallel kinds: ring attention (K/V blocks passed around the ring under the attention
#: steps), Ulysses (all-to-alls between sequence and head shards), hybrid (Ulysses inside, a ring
#: across), allgather (the whole K/V gathered before attention, exposed, and its gradient
#: reduce-scattered after: Transformer Engine's and MindSpeed's AttnFuncWithCPAndKVAllGather,
#: Megatron's --cp-comm-type allgather). Their codes in a StrategyBatch are these positions.
CP_KINDS: tuple[str, ...] = ("ring", "ulysses", "hybrid", "allgather")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
#: Megatron-Core's ``--recompute-modules`` (``TransformerConfig.recompute_modules``), in its order.
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts")
#: Megatron-Core's ``--offload-modules`` (fine-grained activation offloading), in its order; its
#: ``fused_group_mlp`` (Transformer Engine's op fuser) is not modelled.
OFFLOAD_MODULES: tuple[str, ...] = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
#: Schedules Megatron-Core runs fine-grained activation offloading under.
OFFLOAD_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved")

#: Schedules that place more than one model chunk on a stage.
VIRTUAL_SCHEDULES: tuple[str, ...] = ("interleaved", "zbv", "dualpipev")

# Upper bounds of the integer fields. The formulas run on int64 arrays (StrategyBatch): a value
# past 2^63 does not convert, and products such as dp·micro_batch_size·num_micro_batches or
# global_batch_size·seq_length would wrap into silently wrong (even negative) figures. The bounds
# are far above any real run and keep every such product below 2^63.
#: Parallel degrees, chunk counts and layer counts: 2^20, a million devices.
MAX_DEGREE = 2**20
#: Tokens per sequence: 2^24, sixteen million.
MAX_SEQ_LENGTH = 2**24
#: Sequences in a global batch (and so in a micro-batch, micro-batches and runs): 2^30, a billion;
#: with MAX_SEQ_LENGTH a step's tokens stay at most 2^54.
MAX_SEQUENCES = 2**30


def canonical_modules(names: Iterable[str]) -> tuple[str, ...]:
    """One spelling per module set, Megatron's order without repeats, so that equal sets are
    equal strategies (names outside ``RECOMPUTE_MODULES`` are dropped: validate them first)."""
    given = set(names)
    return tuple(m for m in RECOMPUTE_MODULES if m in given)


def canonical_offload(names: Iterable[str]) -> tuple[str, ...]:
    """One spelling per offload set, Megatron's order without repeats (names outside
    ``OFFLOAD_MODULES`` are dropped: validate them first)."""
    given = set(names)
    return tuple(m for m in OFFLOAD_MODULES if m in given)


def layer_offload_conflict(layers: int, pp: int, recompute: str, offload_modules: tuple[str, ...]) -> str:
    """Why Megatron-Core refuses to offload ``layers`` whole layers' activations
    (TransformerConfig.__post_init__), or ''."""
    if not layers:
        return ""
    if pp > 1:
        return (f"offload_layers={layers} with pp={pp}: Megatron-Core has no support for pipeline parallelism with "
                "CPU offloading (--cpu-offloading-num-layers)")
    if recompute != "none":
        return (f"offload_layers={layers} with recompute '{recompute}': Megatron-Core's CPU offloading does not work "
                "when activation recomputation is enabled")
    if offload_modules:
        return (f"offload_layers={layers} with offload_modules {' '.join(offload_modules)}: Megatron-Core runs "
                "fine-grained activation offloading or layer offloading (--cpu-offloading-num-layers), not both")
    return ""


def optimizer_state_offload_conflict(offload_states: bool, zero: int, fsdp: bool, optimizer_offload: bool) -> str:
    """Why the optimizer states cannot wait on the host between steps (Megatron-Core's
    --offload-optimizer-states, MindSpeed's --swap-optimizer: both on the distributed
    optimizer), or ''."""
    if not offload_states:
        return ""
    if optimizer_offload:
        return ("offload_optimizer_states with optimizer_offload: the states either wait on the host for a step on the "
                "device (--offload-optimizer-states) or stay there for a step on the CPU (--optimizer-cpu-offload), "
                "not both")
    if zero != 1 or fsdp:
        return (f"offload_optimizer_states with zero={zero}{' and fsdp' if fsdp else ''}: it works on Megatron's "
                "distributed optimizer (--use-distributed-optimizer: zero 1; Megatron-FSDP, zero 2 and 3, has no "
                "such offload)")
    return ""


def offload_conflict(offload: tuple[str, ...], recompute: str, recompute_modules: tuple[str, ...], schedule: str) -> str:
    """Why Megatron-Core would not run (or would silently not do) this activation offload, or ''."""
    if not offload:
        return ""
    named = " ".join(offload)
    if schedule not in OFFLOAD_SCHEDULES:
        return (f"offload_modules {named}: Megatron-Core offloads activations under the schedules "
                f"{', '.join(OFFLOAD_SCHEDULES)}, not '{schedule}'")
    if recompute == "full":
        return (f"offload_modules {named}: full recompute keeps only each layer's input, so there is nothing to offload; "
                "use recompute 'none' or 'selective'")
    if "attn_proj" in offload and "core_attn" not in offload:
        return "offload_modules attn_proj needs core_attn too (its input is the attention core's output; Megatron-Core's rule)"
    if "core_attn" in offload and recompute == "selective" and (not recompute_modules or "core_attn" in recompute_modules):
        return ("offload_modules core_attn: the attention core is recomputed (recompute_modules core_attn, Megatron's default "
                "selective policy), and Megatron-Core then skips its offload; recompute other modules or drop core_attn")
    if recompute == "selective" and "moe" in recompute_modules and {"expert_fc1", "moe_act"} & set(offload):
        return ("offload_modules expert_fc1/moe_act cannot go with recompute_modules moe (Megatron-Core refuses the pair); "
                "recompute moe_act instead")
    return ""


class Strategy(BaseModel):
    """One parallel training configuration.

    Degrees: ``dp`` data, ``tp`` tensor, ``pp`` pipeline, ``cp`` context; the world is
    dp·tp·pp·cp. Experts are laid out over the same dp·tp·cp ranks of a stage ("MoE parallel
    folding"): ``ep`` expert-parallel and ``etp`` expert-tensor-parallel (default: tp).
    Batch: ``global_batch_size`` = dp · ``micro_batch_size`` · ``num_micro_batches`` ·
    ``pipeline_runs`` sequences of ``seq_length`` tokens: the pipeline schedule runs
    ``pipeline_runs`` times a step, each run over ``num_micro_batches`` micro-batches (gradient
    accumulation outside the schedule, as torchtitan and NeMo AutoModel do with a pipeline; Megatron
    schedules every micro-batch of a step in one run: 1). ``zero`` is the ZeRO stage over the dp·cp ranks (1: optimizer states,
    2: + gradients, 3: + parameters; Megatron's distributed optimizer is ZeRO-1); ``fsdp`` says the
    sharding is torch FSDP, and ``shard_group`` limits it to groups of that many ranks (HSDP).
    ``recompute_layers`` limits full/selective recompute to that many layers per (virtual) stage.
    ``recompute_modules`` names what selective recompute re-runs, as Megatron-Core's
    ``--recompute-modules`` (``RECOMPUTE_MODULES``); empty means the runtime's own selective policy
    (Megatron: the attention core; torchtitan: its per-op policy). ``offload_modules`` names the
    modules whose saved activations Megatron-Core copies to host memory in the forward and reloads
    for the backward (``--fine-grained-activation-offloading --offload-modules``, ``OFFLOAD_MODULES``).
    ``offload_layers`` copies every saved activation of that many decoder layers, the first ones,
    instead (``--cpu-offloading-num-layers``; Megatron-Core runs it without a pipeline, without
    recompute and without fine-grained offload). ``optimizer_offload`` keeps the optimizer states
    and master weights on the host for a step on the CPU (``--optimizer-cpu-offload``), of
    ``optimizer_offload_fraction`` of the rank's parameters (``--optimizer-offload-fraction``:
    Megatron-Core's HybridDeviceOptimizer updates the rest on the device, beside the CPU);
    ``offload_optimizer_states`` keeps them there only through the forward and backward and brings
    them back for a step on the device (Megatron-Core's ``--offload-optimizer-states``,
    MindSpeed's ``--swap-optimizer``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    tp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    pp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    cp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    cp_kind: CpKind = "ring"
    ulysses_degree: int = Field(default=1, ge=1, le=MAX_DEGREE, description="Ulysses part of a hybrid CP group")
    ep: int = Field(default=1, ge=1, le=MAX_DEGREE)
    etp: int = Field(default=0, ge=0, le=MAX_DEGREE, description="expert tensor parallel; 0 means the same as tp")
    sequence_parallel: bool = False
    vpp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    schedule: Schedule = "1f1b"
    seq_chunks: int = Field(default=1, ge=1, le=MAX_DEGREE, description="Seq1F1B: sub-sequences per micro-batch")
    stage_layers: tuple[int, ...] | None = Field(
        default=None, description="decoder layers per virtual stage, in model order (pp·vpp entries)"
    )
    embedding_as_layer: bool = False
    output_as_layer: bool = False

    zero: int = Field(default=0, ge=0, le=3)
    fsdp: bool = False
    shard_group: int = Field(default=0, ge=0, le=MAX_DEGREE, description="HSDP shard-group size; 0 means all dp·cp ranks")
    reshard_after_forward: bool = True
    optimizer_offload: bool = False
    optimizer_offload_fraction: float = Field(
        default=1.0, gt=0.0, le=1.0, allow_inf_nan=False,
        description="share of the rank's parameters whose optimizer runs on the CPU under optimizer_offload "
                    "(Megatron-Core's --optimizer-offload-fraction); the rest is updated on the device")
    offload_optimizer_states: bool = False

    recompute: Recompute = "none"
    recompute_layers: int = Field(default=0, ge=0, le=MAX_DEGREE, description="layers per (virtual) stage recomputed; 0 means all")
    recompute_modules: tuple[RecomputeModule, ...] = Field(
        default=(), description="modules selective recompute re-runs (Megatron-Core); empty: the runtime's policy")
    offload_modules: tuple[OffloadModule, ...] = Field(
        default=(), description="modules whose saved activations go to host memory (Megatron-Core's --offload-modules)")
    offload_layers: int = Field(
        default=0, ge=0, le=MAX_DEGREE,
        description="first decoder layers whose saved activations go to host memory (Megatron-Core's "
                    "--cpu-offloading-num-layers); 0: none")

    micro_batch_size: int = Field(default=1, ge=1, le=MAX_SEQUENCES)
    num_micro_batches: int = Field(default=1, ge=1, le=MAX_SEQUENCES, description="micro-batches per pipeline run")
    pipeline_runs: int = Field(default=1, ge=1, le=MAX_SEQUENCES,
                               description="pipeline schedule runs per step (accumulated)")
    global_batch_size: int = Field(default=0, ge=0, le=MAX_SEQUENCES,
                                   description="0: dp·micro_batch_size·num_micro_batches·pipeline_runs")
    seq_length: int = Field(default=4096, ge=1, le=MAX_SEQ_LENGTH)

    precision: PrecisionPolicy = PRECISION_PRESETS["megatron-bf16"]

    @field_validator("precision", mode="before")
    @classmethod
    def _named_precision(cls, value: Any) -> Any:
        return get_precision(value) if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if not data.get("etp"):
            data["etp"] = data.get("tp", 1)
        if not data.get("global_batch_size"):
            try:
                product = (
                    int(data.get("dp", 1)) * int(data.get("micro_batch_size", 1)) * int(data.get("num_micro_batches", 1))
                    * int(data.get("pipeline_runs", 1))
                )
            except (TypeError, ValueError):
                pass  # the field validators name the bad value
            else:
                if product <= MAX_SEQUENCES:  # else _batch_bounded names the factors, not a field never given
                    data["global_batch_size"] = product
        return data

    @field_validator("recompute_modules", "offload_modules", mode="before")
    @classmethod
    def _one_module(cls, value: Any) -> Any:
        """One name is a set of one module: a str is a sequence too, which validated as its
        characters ("unknown recompute module 'c'")."""
        return (value,) if isinstance(value, str) else value

    @field_validator("recompute_modules", mode="after")
    @classmethod
    def _canonical_modules(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return canonical_modules(value)

    @field_validator("offload_modules", mode="after")
    @classmethod
    def _canonical_offload(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return canonical_offload(value)

    @model_validator(mode="after")
    def _batch_bounded(self) -> Strategy:
        # Each factor is bounded by its field; their product is the global batch, bounded too.
        product = self.dp * self.micro_batch_size * self.num_micro_batches * self.pipeline_runs
        if product > MAX_SEQUENCES:
            raise ValueError(
                f"dp·micro_batch_size·num_micro_batches·pipeline_runs = {self.dp}·{self.micro_batch_size}·"
                f"{self.num_micro_batches}·{self.pipeline_runs} = {product} sequences a step; at most "
                f"{MAX_SEQUENCES} (2^30) are allowed")
        return self

    @model_validator(mode="after")
    def _modules_need_selective(self) -> Strategy:
        if self.recompute_modules and self.recompute != "selective":
            raise ValueError(f"recompute_modules {' '.join(self.recompute_modules)} needs recompute 'selective', "
                             f"not '{self.recompute}'")
        problem = offload_conflict(self.offload_modules, self.recompute, self.recompute_modules, self.schedule)
        if problem:
            raise ValueError(problem)
        problem = layer_offload_conflict(self.offload_layers, self.pp, self.recompute, self.offload_modules)
        if problem:
            raise ValueError(problem)
        problem = optimizer_state_offload_conflict(self.offload_optimizer_states, self.zero, self.fsdp,
                                                   self.optimizer_offload)
        if problem:
            raise ValueError(problem)
        if self.optimizer_offload_fraction < 1.0 and not self.optimizer_offload:
            raise ValueError(f"optimizer_offload_fraction {self.optimizer_offload_fraction:g} without optimizer_offload: "
                             "it is the share of the optimizer that --optimizer-cpu-offload moves to the CPU")
        return self

    def with_recompute(self, recompute: str, recompute_layers: int = 0, modules: tuple[str, ...] | None = None) -> Strategy:
        """The same strategy under another recompute setting; recompute modules (``modules``, else
        its own) only where it recomputes selectively (they mean nothing otherwise)."""
        modules = (self.recompute_modules if modules is None else modules) if recompute == "selective" else ()
        return self.model_copy(update={"recompute": recompute, "recompute_layers": recompute_layers,
                                       "recompute_modules": Strategy(recompute="selective", recompute_modules=modules)
                                       .recompute_modules if modules else ()})

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def ulysses_ranks(self) -> int:
        """Ranks of the Ulysses all-to-all group: cp under 'ulysses', ulysses_degree under
        'hybrid', 1 under the kinds that run none (``StrategyBatch.ulysses_ranks``)."""
        return self.cp if self.cp_kind == "ulysses" else self.ulysses_degree if self.cp_kind == "hybrid" else 1

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches a pipeline rank runs per step, over all its pipeline runs."""
        return self.num_micro_batches * self.pipeline_runs

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_length

    def short(self) -> str:
        """A compact label, e.g. 'dp4 tp2 pp2 sp mbs1 m8 1f1b'."""
        parts = [f"dp{self.dp}", f"tp{self.tp}"]
        if self.sequence_parallel:
            parts.append("sp")
        parts += [f"pp{self.pp}"] + ([f"vpp{self.vpp}"] if self.vpp > 1 else [])
        if self.cp > 1:
            parts.append(f"cp{self.cp}-{self.cp_kind}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        if self.zero:
            parts.append(("fsdp" if self.fsdp else "zero") + str(self.zero))
        # Seq1F1B's chunks per sequence: seq1f1b/4 splits each sequence in four
        # m8x2: two pipeline runs of eight micro-batches each per step
        parts += [f"mbs{self.micro_batch_size}",
                  f"m{self.num_micro_batches}" + (f"x{self.pipeline_runs}" if self.pipeline_runs > 1 else ""),
                  self.schedule + (f"/{self.seq_chunks}" if self.seq_chunks > 1 else "")]
        if self.recompute != "none":
            # rc-full:2 recomputes the first two layers of each virtual stage
            parts.append(f"rc-{self.recompute}" + (f"({'+'.join(self.recompute_modules)})" if self.recompute_modules else "")
                         + (f":{self.recompute_layers}" if self.recompute_layers else ""))
        if self.offload_modules:
            parts.append(f"offload({'+'.join(self.offload_modules)})")
        if self.offload_layers:
            parts.append(f"offload-layers{self.offload_layers}")
        if self.optimizer_offload:
            parts.append("optimizer-cpu" + (f"{self.optimizer_offload_fraction:g}"
                                            if self.optimizer_offload_fraction < 1.0 else ""))
        if self.offload_optimizer_states:
            parts.append("optimizer-states-host")
        return " ".join(parts)
