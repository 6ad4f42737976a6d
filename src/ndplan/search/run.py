"""Run a search: enumerate, apply the rules as masks, price memory and time, rank, keep the front.

Every candidate has an index in the product space; ties in step time are broken by peak memory
and then by that index, so the ranking is deterministic and equal to a plain loop over the same
space with the single-strategy API (a test checks this).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from numbers import Integral
from typing import Any, Literal

import numpy as np

from ndplan.arrays import unique
from ndplan.errors import NdplanError
from ndplan.hardware import Cluster, Device
from ndplan.memory import MemoryOptions
from ndplan.memory.fields import STATIC_FIELDS
from ndplan.memory.host import host_memory, uses_host
from ndplan.memory.report import check_options, headroom, known_gaps
from ndplan.memory.stages import peak_memory, static_lower_bound
from ndplan.model.heads import ulysses_kv_repeat
from ndplan.model.spec import ModelSpec
from ndplan.perf.efficiency import device_family
from ndplan.perf.gaps import time_known_gaps
from ndplan.schedule import SPLIT_BACKWARD
from ndplan.search.screen import Check, PartFields, Places, screened_blocks
from ndplan.search.space import FIELD_DIMENSIONS, SearchSpace
from ndplan.strategy.batch import StrategyBatch
from ndplan.strategy.rules import RULES, Rule, RuleContext
from ndplan.strategy.strategy import Strategy
from ndplan.units import memory_limit

TimeFunction = Callable[[ModelSpec, StrategyBatch, Cluster], dict[str, np.ndarray]]
OVER_MEMORY = "over_memory_limit"
#: Candidates whose offloads fill more pinned host memory than the device's share of its node's
#: (``Device.host_memory_bytes``; ``memory.host``).
OVER_HOST_MEMORY = "over_host_memory"
DUPLICATE = "duplicate_candidate"
#: Combinations the memory options' runtime cannot execute (PyTorch: selective activation
#: checkpointing under a split backward raises "backward an extra time", measured).
NOT_RUNNABLE = "not_runnable_in_runtime"
#: Candidates whose expert parallelism cannot load a rank as unevenly as the memory options'
#: ``moe_imbalance`` says (``memory.report.check_moe_imbalance``: ep·min(k, E/ep)/k at most).
IMPOSSIBLE_IMBALANCE = "moe_imbalance_beyond_routing"


@dataclass
class SearchResult:
    """Ranked strategies that fit, why the others lost, and the (time, memory) trade-off."""

    space_size: int
    evaluated: int
    fitting: int
    rejected: dict[str, int]
    ranked: list[dict[str, Any]]
    pareto: list[dict[str, Any]]
    candidates_time_s: np.ndarray
    candidates_peak_bytes: np.ndarray
    memory_limit_bytes: int
    smallest_peak_bytes: float | None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: The candidate index of each entry of candidates_time_s / candidates_peak_bytes.
    candidates_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def best(self) -> dict[str, Any] | None:
        return self.ranked[0] if self.ranked else None


def schedule_cautions(strategy: Strategy, runtime: str, family: str) -> list[str]:
    """What to know before running ``strategy``'s pipeline schedule in ``runtime`` on a device of
    ``family``: the megatron runtime's DualPipeV is MindSpeed's (Ascend NPUs); Megatron-LM on
    GPUs has no such schedule, so a GPU plan with it is for a fork that adds one."""
    if runtime == "megatron" and strategy.pp > 1 and strategy.schedule == "dualpipev" and not family.startswith("davinci"):
        return ["DualPipeV under the megatron runtime is MindSpeed's schedule (--schedules-method dualpipev, on "
                "Ascend NPUs); Megatron-LM on GPUs has none: unless your Megatron runs it, search again with "
                "--fix schedule=interleaved (or 1f1b)"]
    return []


def _row(strategy: Strategy, index: int, peak: float, stage: int, time: dict[str, float],
         options: MemoryOptions | None = None, model: ModelSpec | None = None, family: str = "") -> dict[str, Any]:
    """One ranked strategy as the search lists it; ``family`` is the device's
    (``perf.efficiency.device_family``), which some step-time cautions depend on."""
    options = options or MemoryOptions()
    return {
        "candidate": int(index),
        "label": strategy.short(),
        "dp": strategy.dp, "tp": strategy.tp, "sp": strategy.sequence_parallel, "cp": strategy.cp,
        "cp_kind": strategy.cp_kind, "ep": strategy.ep, "etp": strategy.etp, "pp": strategy.pp,
        "vpp": strategy.vpp, "schedule": strategy.schedule, "seq_chunks": strategy.seq_chunks,
        "zero": strategy.zero, "fsdp": strategy.fsdp, "recompute": strategy.recompute,
        "recompute_modules": "+".join(strategy.recompute_modules),
        "offload_modules": "+".join(strategy.offload_modules), "offload_layers": strategy.offload_layers,
        "offload_optimizer_states": strategy.offload_optimizer_states, "optimizer_offload": strategy.optimizer_offload,
        "mbs": strategy.micro_batch_size, "num_micro_batches": strategy.num_micro_batches,
        "pipeline_runs": strategy.pipeline_runs,
        "peak_bytes": round(peak), "peak_stage": int(stage),
        **{k: float(v) for k, v in time.items()},
        "strategy": strategy.model_dump(mode="json", exclude={"precision"}),
        # What memory and step-time models are known to miss for a strategy of this kind.
        "caveats": known_gaps(strategy, options, model)
        + (time_known_gaps(model, strategy, options.runtime, family) if model is not None else [])
        + schedule_cautions(strategy, options.runtime, family),
        "headroom": headroom(strategy, options, model),
    }


def runtime_step_time(options: MemoryOptions | None = None) -> TimeFunction:
    """``ndplan.perf.step_time_batch`` for the runtime of ``options`` (``MemoryOptions.time_keywords``):
    where it rebuilds a checkpointed layer once per parameter group in a split backward's W (the
    ``pytorch`` profile), full recompute pays those forwards in time as in memory; selective
    recompute re-runs what its profile does not keep; ``options.overlap`` says what it hides."""
    from functools import partial

    from ndplan.perf import step_time_batch

    options = options or MemoryOptions()
    return partial(step_time_batch, **options.time_keywords())


def _step_times(times: Any, count: int) -> Mapping[str, Any]:
    """What a time function returned, where it is what ``run_search`` ranks by: a mapping with
    "step_s", one figure per candidate (a custom one returning {} raised KeyError 'step_s')."""
    if not isinstance(times, Mapping) or "step_s" not in times or np.shape(times["step_s"]) != (count,):
        got = f"keys {sorted(times)}" if isinstance(times, Mapping) else type(times).__name__
        raise NdplanError(f"time_function must return a dict of arrays with 'step_s' (seconds per strategy of the "
                          f"batch, {count} here), got {got}")
    return times


def _holds(batch: StrategyBatch, rule: Rule, context: RuleContext) -> np.ndarray:
    """``rule`` as a check of ``screened_blocks``."""
    return rule.holds(batch, context)


@dataclass(frozen=True)
class RuntimeLimit:
    """A combination a runtime cannot run: ``holds`` (a mask over a batch, True where it runs,
    given the schedules the runtime's profile has and the model, None where it is not known) and
    ``explain`` (why not, for one strategy of the model). ``runtime``: the runtime it applies to
    (None: every runtime, by its schedules). ``library``: whose code the limit is, where not the
    runtime's own on every device: "transformer_engine" (Megatron's attention on GPUs) or
    "mindspeed" (Megatron's on Ascend NPUs, MindSpeed's own); either binds only where the device
    is known."""

    runtime: str | None
    holds: Callable[[StrategyBatch, tuple[str, ...], ModelSpec | None], np.ndarray]
    explain: Callable[[Strategy, tuple[str, ...], str, ModelSpec | None], str]
    library: Literal["transformer_engine", "mindspeed"] | None = None

    def applies(self, runtime: str, family: str | None) -> bool:
        """Whether the limit binds ``runtime`` on a device of ``family`` (None: not known)."""
        if self.runtime is not None and self.runtime != runtime:
            return False
        if self.library is None:
            return True
        return family is not None and family.startswith("davinci") == (self.library == "mindspeed")


#: What ``_runnable`` refuses, each with its source.
RUNTIME_LIMITS: tuple[RuntimeLimit, ...] = (
    RuntimeLimit(
        None,
        lambda b, schedules, _: b.is_in("schedule", list(schedules)),
        lambda s, schedules, runtime, __: (f"the {runtime} runtime does not run the {s.schedule} schedule (it runs "
                                       f"{', '.join(schedules)})"),
    ),
    # Measured: torch.distributed.pipelining raises "backward an extra time" (memory.report).
    RuntimeLimit(
        "pytorch",
        lambda b, _, __: ~(b.is_in("schedule", sorted(SPLIT_BACKWARD)) & b.is_("recompute", "selective")),
        lambda s, _, runtime, __: (f"selective recompute with the split backward of '{s.schedule}': "
                               "torch.distributed.pipelining raises 'backward an extra time'"),
    ),
    # torch.distributed.pipelining's Schedule1F1B.__init__ raises "Number of microbatches (m) must
    # be greater than or equal to the number of stages (pp)"; Megatron's 1F1B runs fewer (its
    # warm-up is min(pp - rank - 1, m)), ScheduleGPipe has no such check.
    RuntimeLimit(
        "pytorch",
        lambda b, _, __: ~(b.is_("schedule", "1f1b") & (b.pp > 1) & (b.num_micro_batches < b.pp)),
        lambda s, _, runtime, __: (f"schedule '1f1b' with num_micro_batches={s.num_micro_batches} < pp={s.pp}: "
                               "torch.distributed.pipelining's Schedule1F1B needs at least one micro-batch per "
                               "stage"),
    ),
    # Megatron-Core's ModelParallelConfig raised "When using expert parallelism and tensor
    # parallelism, sequence parallelism must be used" (its newest release warns that training
    # must use it), and MoELayer.forward raises in training for any MoE layer under tensor
    # parallelism without it ("During training, performance may degrade if MoE and tensor
    # parallelism are enabled without also enabling sequence parallelism"), expert parallel or not.
    RuntimeLimit(
        "megatron",
        lambda b, _, model: ~(((b.ep > 1) | _has_experts(model)) & (b.tp > 1) & (b.sequence_parallel == 0)),
        lambda s, _, runtime, __: (f"ep={s.ep} with tp={s.tp} needs sequence_parallel: Megatron-Core's "
                               "ModelParallelConfig requires it for training beside expert and tensor "
                               "parallelism" if s.ep > 1 else
                               f"experts with tp={s.tp} need sequence_parallel: Megatron-Core's MoE layer "
                               "refuses to train under tensor parallelism without it (MoELayer.forward)"),
    ),
    # Megatron's Ulysses is --cp-comm-type a2a (a2a+p2p hybrid): its batch is cut into 2·cp chunks
    # as for the ring (get_batch_on_this_cp_rank), and Transformer Engine's A2A attention asserts
    # "Sequence length per GPU needs to be divisible by 2!" of the seq_length/cp tokens a rank holds.
    # MindSpeed's ulysses_cp_algo cuts the sequence into cp contiguous chunks
    # (_get_batch_on_this_cp_rank_in_ulysses_cp) and asserts only cp | seq_length (the rules').
    RuntimeLimit(
        "megatron",
        lambda b, _, __: (b.cp == 1) | b.is_("cp_kind", "ring") | (np.mod(b.seq_length, 2 * b.cp) == 0),
        lambda s, _, runtime, __: (f"{s.cp_kind} context parallelism under Megatron needs seq_length={s.seq_length} "
                               f"divisible by 2·cp = {2 * s.cp} (each rank's tokens in two chunks, as for the ring; "
                               "MindSpeed's ulysses_cp_algo on Ascend NPUs needs cp to divide it alone)"),
        library="transformer_engine",
    ),
    # All-gather CP is Transformer Engine's and MindSpeed's attention function; torch's context
    # parallelism runs a ring (whose K/V exchange the pytorch profile prices as its all-gather).
    RuntimeLimit(
        "pytorch",
        lambda b, _, __: ~b.is_("cp_kind", "allgather") | (b.cp == 1),
        lambda s, _, runtime, __: (f"cp_kind=allgather: the {runtime} runtime's context parallelism is torch's ring "
                               "attention (cp_kind ring prices its K/V all-gather); all-gather CP is Transformer "
                               "Engine's and MindSpeed's (Megatron's --cp-comm-type allgather)"),
    ),
    # Transformer Engine's context-parallel attention (attn_forward_func_with_cp) runs some
    # attention only under some of its kinds (``te_cp_kinds``).
    RuntimeLimit(
        "megatron",
        lambda b, _, model: (b.cp == 1) | b.is_in("cp_kind", list(te_cp_kinds(model)[0])),
        lambda s, _, runtime, model: _te_cp_refusal(s, model),
        library="transformer_engine",
    ),
    # Where a Ulysses group outnumbers a rank's KV heads, MindSpeed repeats them to the query heads
    # before the all-to-all (model.heads.ulysses_kv_repeat); Transformer Engine's all-to-all
    # attention scatters K and V as they are and asserts "The number of attention heads needs to
    # be divisible by CP size!" of them as of Q; torch's runtimes run no such repeat either.
    RuntimeLimit(
        "megatron",
        lambda b, _, model: ~_kv_heads_repeated(b, model),
        lambda s, _, runtime, model: _kv_repeat_refusal(s, model, "Transformer Engine's all-to-all attention "
                                                        "(--cp-comm-type a2a, a2a+p2p) asserts they divide"),
        library="transformer_engine",
    ),
    RuntimeLimit(
        "pytorch",
        lambda b, _, model: ~_kv_heads_repeated(b, model),
        lambda s, _, runtime, model: _kv_repeat_refusal(s, model, f"the {runtime} runtime repeats no KV heads "
                                                        "before its all-to-all"),
    ),
    # MindSpeed's context-parallel attention asserts no window (CPDotProductAttentionImpl: "Sliding
    # Window Attention is only supported by TEDotProductAttention!", and its Transformer Engine
    # path, kvallgather_cp_algo's, raises "... is not supported by MindSpeed!"); MindSpeed-LLM's
    # validation refuses CP where the window binds (seq_length > sliding_window: "Context parallel
    # does not support sliding_windows").
    RuntimeLimit(
        "megatron",
        lambda b, _, model: (b.cp == 1) | ~_window_binds(model, b.seq_length),
        lambda s, _, runtime, model: (
            f"cp={s.cp} on {model.name if model is not None else 'this model'}, whose sliding-window layers attend "
            f"the last {model.sliding_window if model is not None else 0:,} of seq_length={s.seq_length:,} tokens: "
            "MindSpeed's context-parallel attention runs no sliding window under any --context-parallel-algo "
            "(MindSpeed-LLM: 'Context parallel does not support sliding_windows'); train with cp=1 on Ascend NPUs"),
        library="mindspeed",
    ),
    # MindSpeed's hybrid_cp_algo (ContextParallelFeature.validate_args) asserts a ring of more than
    # one rank: cp / --ulysses-degree-in-cp > 1.
    RuntimeLimit(
        "megatron",
        lambda b, _, __: ~b.is_("cp_kind", "hybrid") | (b.cp == 1) | (b.ulysses_degree < b.cp),
        lambda s, _, runtime, __: (f"cp_kind hybrid with ulysses_degree={s.ulysses_degree} = cp: MindSpeed's "
                                   "hybrid_cp_algo needs a ring of two ranks at least (cp / --ulysses-degree-in-cp > "
                                   "1); that plan is cp_kind ulysses (ulysses_cp_algo)"),
        library="mindspeed",
    ),
    # validate_args: "--fp8-param-gather only supported with distributed optimizer, torch fsdp2,
    # megatron fsdp, or inference mode": fp8 weights need ZeRO (the optimizer re-quantises its shards).
    RuntimeLimit(
        "megatron",
        lambda b, _, __: np.full(len(b), not b.precision.fp8_params) | (b.zero > 0),
        lambda s, _, runtime, __: (f"precision {getattr(s.precision, 'name', s.precision)} (fp8 weights, "
                                   "--fp8-param-gather) with zero=0: Megatron-LM runs fp8 weights only with the "
                                   "distributed optimizer or FSDP (validate_args)"),
    ),
    # Megatron's add_bias_linear covers every linear but the QKV projection's own switch, and its
    # TransformerConfig asserts "Bias in Moe is only supported when ETP==1" for a MoE model with it on.
    RuntimeLimit(
        "megatron",
        lambda b, _, model: ~(_moe_with_biases(model) & (b.etp > 1)),
        lambda s, _, runtime, model: (
            f"etp={s.etp} on {model.name if model is not None else 'this model'}, whose linear layers have biases: "
            "Megatron-Core's TransformerConfig asserts 'Bias in Moe is only supported when ETP==1'"),
    ),
    # Layer offload is Megatron-Core's (--cpu-offloading-num-layers, the megatron profile's layer_offload).
    RuntimeLimit(
        "pytorch",
        lambda b, _, __: b.offload_layers == 0,
        lambda s, _, runtime, __: (f"offload_layers={s.offload_layers}: the {runtime} runtime has no layer offload "
                               "(Megatron-Core's --cpu-offloading-num-layers)"),
    ),
    # An optimizer on the CPU: Megatron-Core's HybridDeviceOptimizer goes through its precision-aware
    # distributed optimizer (OptimizerConfig asserts --use-distributed-optimizer); torchtitan's
    # enable_cpu_offload is FSDP2's CPUOffloadPolicy, which needs FSDP.
    RuntimeLimit(
        "megatron",
        lambda b, _, __: (b.optimizer_offload == 0) | ((b.zero == 1) & (b.fsdp == 0)),
        lambda s, _, runtime, __: (f"optimizer_offload with zero={s.zero}: Megatron-Core's --optimizer-cpu-offload runs "
                               "on its distributed optimizer (--use-distributed-optimizer, zero 1)"),
    ),
    RuntimeLimit(
        "pytorch",
        lambda b, _, __: (b.optimizer_offload == 0) | (b.zero == 3),
        lambda s, _, runtime, __: (f"optimizer_offload with zero={s.zero}: the {runtime} runtime's CPU offload is "
                               "FSDP2's (torchtitan's enable_cpu_offload), which needs FSDP (zero 3)"),
    ),
    # The optimizer states wait on the host between steps in Megatron-Core (--offload-optimizer-states)
    # and MindSpeed (--swap-optimizer): the megatron profile's optimizer_state_offload.
    RuntimeLimit(
        "pytorch",
        lambda b, _, __: b.offload_optimizer_states == 0,
        lambda s, _, runtime, __: (f"offload_optimizer_states: the {runtime} runtime has no such feature "
                               "(Megatron-Core's --offload-optimizer-states, MindSpeed's --swap-optimizer)"),
    ),
    # torchtitan's TP plan shards wq/wk/wv column-wise and views each rank's part as whole heads
    # (Attention.forward's view(bs, seqlen, -1, head_dim)): a rank needs one KV head at least;
    # Megatron-Core gathers the QKV output instead (strategy.rules, tp_divides_kv_heads).
    RuntimeLimit(
        "pytorch",
        lambda b, _, model: (b.tp <= _kv_heads(model)),
        lambda s, _, runtime, __: (f"tp={s.tp} above the model's KV heads: torch's tensor-parallel plans split whole "
                               "heads, so each rank needs one KV head at least (Megatron-Core gathers the QKV output "
                               "instead: price it under runtime 'megatron')"),
    ),
)


#: The context-parallel kinds by Megatron's --cp-comm-type names (Transformer Engine's, but its
#: all_gather).
_TE_CP_NAMES = {"ring": "p2p", "ulysses": "a2a", "hybrid": "a2a+p2p", "allgather": "allgather"}


def te_cp_kinds(model: ModelSpec | None) -> tuple[tuple[str, ...], list[str]]:
    """(the context-parallel kinds Transformer Engine runs ``model``'s attention under, why the
    others are left out). Its attn_forward_func_with_cp asserts sliding windows under a2a or
    all_gather (Megatron's allgather) alone, MLA (key and value heads of different widths)
    under p2p or a2a+p2p, and a softmax other than the vanilla one (gpt-oss's attention sinks)
    under a2a alone. Every kind where the model is not known."""
    kinds = set(_TE_CP_NAMES)
    reasons = []
    if model is not None and model.sliding_layers()[0]:
        kinds &= {"ulysses", "allgather"}
        reasons.append("sliding-window layers run under a2a or allgather alone")
    if model is not None and model.qk_head_dim != model.value_head_dim:
        kinds &= {"ring", "hybrid"}
        reasons.append("MLA (keys and values of different head widths) runs under p2p or a2a+p2p alone")
    if model is not None and model.attention_sinks:
        kinds &= {"ulysses"}
        reasons.append("attention sinks (a softmax other than the vanilla one) run under a2a alone")
    return tuple(kind for kind in _TE_CP_NAMES if kind in kinds), reasons


def _te_cp_refusal(strategy: Strategy, model: ModelSpec | None) -> str:
    """Why Transformer Engine refuses ``strategy``'s context-parallel kind for ``model``."""
    kinds, reasons = te_cp_kinds(model)
    runs = ", ".join(f"{kind} (--cp-comm-type {_TE_CP_NAMES[kind]})" for kind in kinds) or "none of its kinds"
    return (f"cp_kind {strategy.cp_kind} (--cp-comm-type {_TE_CP_NAMES[strategy.cp_kind]}) on "
            f"{model.name if model is not None else 'this model'}: Transformer Engine's context-parallel attention "
            f"refuses it ({'; '.join(reasons)}); it runs {runs}")


def _window_binds(model: ModelSpec | None, seq_length: np.ndarray) -> np.ndarray:
    """Where ``model`` has sliding-window layers whose window is shorter than the sequence (False
    throughout without a model)."""
    if model is None or not model.sliding_layers()[0]:
        return np.zeros(np.shape(seq_length), bool)
    return np.asarray(seq_length) > model.sliding_window


def _kv_heads_repeated(batch: StrategyBatch, model: ModelSpec | None) -> np.ndarray:
    """Where the strategy's Ulysses group outnumbers a rank's KV heads, so that they are repeated
    before its all-to-all (``ulysses_kv_repeat`` > 1); False throughout without a model."""
    if model is None or model.is_mla:
        return np.zeros(len(batch), bool)
    return np.broadcast_to(ulysses_kv_repeat(model, batch.tp, batch.ulysses_ranks) > 1, (len(batch),))


def _kv_repeat_refusal(strategy: Strategy, model: ModelSpec | None, whose: str) -> str:
    """Why a runtime without MindSpeed's KV-head repeat refuses ``strategy``'s Ulysses group."""
    kv = model.num_kv_heads if model is not None else 0
    per_rank = kv // min(strategy.tp, kv) if kv else 0
    ranks = strategy.ulysses_ranks
    return (f"cp_kind {strategy.cp_kind}: its {ranks} all-to-all ranks outnumber the {per_rank} KV head(s) a "
            f"tensor-parallel rank holds (tp={strategy.tp}, num_key_value_heads={kv}), so it cannot scatter whole "
            f"heads; {whose}; MindSpeed on Ascend NPUs repeats the KV heads to the query heads first. Use ring CP, "
            f"or tp·{'ulysses_degree' if strategy.cp_kind == 'hybrid' else 'cp'} dividing {kv}")


def _moe_with_biases(model: ModelSpec | None) -> bool:
    """Whether Megatron runs ``model``'s MoE layers with add_bias_linear on."""
    return model is not None and model.is_moe and model.biases_beyond_qkv


def _has_experts(model: ModelSpec | None) -> bool:
    return model is not None and model.is_moe


def _kv_heads(model: ModelSpec | None) -> float:
    """The KV heads a tensor-parallel split cuts (MLA: the query heads); inf without a model."""
    return float("inf") if model is None else float(model.split_kv_heads)


def _runnable(batch: StrategyBatch, schedules: list[str], runtime: str, model: ModelSpec | None = None,
              family: str | None = None) -> np.ndarray:
    """Where the runtime can run the strategy (``RUNTIME_LIMITS``): a schedule it has; under
    PyTorch no selective recompute in a split backward, 1F1B over a pipeline with at least one
    micro-batch per stage, and no more TP ranks than KV heads; under Megatron no expert
    parallelism, nor on a ``model`` with experts any tensor parallelism, without sequence
    parallelism, no fp8 weights without ZeRO, no expert TP beside linear biases; Transformer
    Engine's limits on a device ``family`` other than Ascend's, MindSpeed's on Ascend's (each
    limit's text in ``RUNTIME_LIMITS`` names its source)."""
    runnable = np.ones(len(batch), bool)
    for limit in RUNTIME_LIMITS:
        if limit.applies(runtime, family):
            runnable &= limit.holds(batch, tuple(schedules), model)
    return runnable


def runtime_refusals(strategy: Strategy, options: MemoryOptions | None = None,
                     model: ModelSpec | None = None, device: Device | None = None) -> list[str]:
    """Why the runtime of ``options`` cannot run ``strategy`` of ``model`` on ``device`` (what
    the search counts as ``NOT_RUNNABLE``), one reason per limit it breaks; [] where it runs. A
    schedule matters only with a pipeline (pp > 1); without the model, whether it has experts is
    told by expert parallelism alone, and its KV heads and windows limit nothing; without the
    device, neither do Transformer Engine's limits nor MindSpeed's."""
    options = options or MemoryOptions()
    schedules = tuple(options.profile.schedules)
    batch = StrategyBatch.of(strategy)
    family = device_family(device) if device is not None else None
    return [limit.explain(strategy, schedules, options.runtime, model) for limit in RUNTIME_LIMITS
            if limit.applies(options.runtime, family)
            and not (limit.runtime is None and strategy.pp == 1) and not limit.holds(batch, schedules, model)[0]]


def _zero_has_group(batch: StrategyBatch) -> np.ndarray:
    """Where ZeRO stage 1 or 2 has a group to shard over (dp·cp > 1): without one it is ZeRO 0
    under another name, every figure the same, charged as a duplicate of the ZeRO 0 candidate."""
    return np.asarray(~((batch.zero == 1) | (batch.zero == 2)) | (batch.dp * batch.cp > 1))


def _reaches_imbalance(batch: StrategyBatch, model: ModelSpec, imbalance: float) -> np.ndarray:
    """Where expert parallelism can load a rank as unevenly as ``imbalance`` (``IMPOSSIBLE_IMBALANCE``)."""
    k, experts = model.num_experts_per_tok, model.num_experts
    most = batch.ep * np.minimum(k, experts // batch.ep) / k
    return np.asarray(imbalance <= most * (1 + 1e-9))


def pareto_front(time_s: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats in both step time and peak memory,
    ordered by time."""
    return _front(by_time_then_peak(time_s, peak), peak)


def by_time_then_peak(time_s: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """The stable order by step time, then peak: ``np.lexsort((peak, time_s))``. One sort by
    time, and a second by (time, peak) over the points whose time another shares alone (few):
    a lexsort sorts every point by each key in turn. The first need not be stable (numpy's
    default sort is several times faster): the second orders the tied points by their position
    too."""
    order = np.argsort(time_s)
    sorted_time = time_s[order]
    same = sorted_time[1:] == sorted_time[:-1]
    same |= np.isnan(sorted_time[1:]) & np.isnan(sorted_time[:-1])  # NaNs sort last, as one run
    if same.any():
        # Positions of the runs of equal times, in order (each point equal to the one before or
        # after it); their points re-sorted by (time, peak) stay in their runs, which keep their
        # places, and ties in both keep their order.
        in_run = np.zeros(len(order), dtype=bool)
        in_run[:-1] = same
        in_run[1:] |= same
        runs = np.flatnonzero(in_run)
        members = order[runs]
        order[runs] = members[np.lexsort((members, peak[members], time_s[members]))]
    return order


def _front(order: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """The Pareto front from the points ordered by time, then peak: those whose peak is below
    every earlier one's."""
    best_peak = np.minimum.accumulate(peak[order])
    improves = np.concatenate([[True], peak[order][1:] < best_peak[:-1]])
    return order[improves]


#: The dimensions of a search whose values the fields of ``static_lower_bound`` depend on (the
#: others are the same for every candidate of a part of the space).
STATIC_DIMENSIONS = frozenset(dim for name in STATIC_FIELDS for dim in FIELD_DIMENSIONS.get(name, ()))


class _StaticBounds:
    """``static_lower_bound`` of a part's candidates, by place: a function of STATIC_FIELDS,
    so of the candidate's combination of STATIC_DIMENSIONS, priced once per combination the
    first time a candidate of it needs it and looked up after (the survivors of a block share
    combinations many at a time, and blocks share them with the next ones)."""

    def __init__(self, model: ModelSpec, options: MemoryOptions | None):
        self.model, self.options = model, options
        self.part: PartFields | None = None
        self.bound, self.known = np.zeros(0), np.zeros(0, dtype=bool)

    def at(self, part: PartFields, places: Places) -> np.ndarray:
        """The bound of the candidates at ``places`` in ``part``."""
        combination, count = part.combination(places, STATIC_DIMENSIONS)
        if part is not self.part:
            self.part, self.bound, self.known = part, np.zeros(count), np.zeros(count, dtype=bool)
        missing = ~self.known.take(combination)
        if missing.any():
            # One candidate of each combination not priced yet stands for it (any: they share
            # the fields the bound reads).
            stand_in = np.full(count, -1, dtype=np.int64)
            stand_in[combination[missing]] = np.flatnonzero(missing)
            new = np.flatnonzero(stand_in >= 0)
            self.bound[new] = static_lower_bound(self.model, part.batch(places.take(stand_in[new])), self.options,
                                                 distinct=True)
            self.known[new] = True
        return self.bound.take(combination)


def _smallest_peak(
    model: ModelSpec, space: SearchSpace, options: MemoryOptions | None, smallest: float,
    bounded_index: list[np.ndarray], bounded_lower: list[np.ndarray], block_size: int,
) -> float:
    """When nothing fits, the smallest peak over every valid candidate (users are told how far
    the best one is from fitting): those a lower bound rejected (the static bound, or the partial
    sum ``peak_memory`` stopped at) are priced in full where that bound is below the smallest
    peak seen."""
    if not bounded_index:
        return smallest
    index = np.concatenate(bounded_index)
    lower = np.concatenate(bounded_lower)
    for start in range(0, len(index), block_size):
        part = slice(start, start + block_size)
        worth = index[part][lower[part] < smallest]
        for _, batch in space.batches(worth):
            peak, _ = peak_memory(model, batch, options)
            smallest = min(smallest, float(peak.min()))
    return smallest


def run_search(
    model: ModelSpec | str,
    device: Device | str,
    space: SearchSpace,
    time_function: TimeFunction | None = None,
    *,
    memory_limit_bytes: int | str | None = None,
    options: MemoryOptions | None = None,
    top: int = 10,
    block_size: int = 1 << 18,
    progress: Callable[[int, int], None] | None = None,
) -> SearchResult:
    """Search ``space`` for the fastest strategies whose every stage fits ``memory_limit_bytes``
    (default: the device's memory). ``time_function`` prices a batch: {"step_s", ...} (default:
    ndplan's step-time model for the runtime of ``options``, ``runtime_step_time``)."""
    import time as clock

    from ndplan.hardware import as_device
    from ndplan.model import as_model

    model, device = as_model(model), as_device(device)
    if not isinstance(space, SearchSpace):
        raise NdplanError(f"space must be a SearchSpace (ndplan.search.default_space), got {type(space).__name__}")
    given_limit = None if memory_limit_bytes is None else memory_limit(
        memory_limit_bytes, "memory_limit_bytes", none_means="the device's memory")
    for name, count in (("top", top), ("block_size", block_size)):
        if isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
            raise NdplanError(f"{name} must be a whole number >= 1, got {count!r}")
    check_options(options)
    time_function = time_function or runtime_step_time(options)

    started = clock.perf_counter()
    limit = int(given_limit or device.memory_bytes)
    cluster = Cluster(device=device, num_devices=space.num_devices)
    family = device_family(device)
    context = RuleContext(model, space.num_devices)
    rejected = {DUPLICATE: 0} | {rule.name: 0 for rule in RULES} | {NOT_RUNNABLE: 0, OVER_MEMORY: 0}
    runtime = (options or MemoryOptions()).runtime
    profile = (options or MemoryOptions()).profile
    imbalance = (options or MemoryOptions()).moe_imbalance
    if model.is_moe and imbalance > 1.0:
        rejected[IMPOSSIBLE_IMBALANCE] = 0
    host_limit = device.host_memory_bytes
    if host_limit is not None and space.may_use_host:
        rejected[OVER_HOST_MEMORY] = 0
    kept_index, kept_time, kept_peak, kept_stage = [], [], [], []
    kept_extra: dict[str, list[np.ndarray]] = {}
    # Rejected by a lower bound of their peak (the static bound, or a partial sum of the full
    # model: ``peak_memory``'s limit), with that bound.
    bounded_index: list[np.ndarray] = []
    bounded_lower: list[np.ndarray] = []
    evaluated = 0
    smallest_peak = np.inf
    rejected[DUPLICATE] = done = space.unlisted_duplicates
    # The survivors of the rules and the static bound wait until a block's worth has gathered:
    # each pricing call has a fixed cost (layer prices, schedule frontiers per group), which
    # the few thousand survivors of one enumerated block would pay many times over.
    pending: list[tuple[np.ndarray, Places, PartFields]] = []  # (indices, places, their part)
    pending_count = 0
    waiting = 0  # candidates enumerated whose survivors wait in ``pending``: not done yet

    def price_pending() -> None:
        nonlocal pending_count, smallest_peak, waiting
        waiting = 0
        if not pending:
            return
        index_part = np.concatenate([index for index, _, _ in pending])
        # Built from the part's tables at once rather than gathered from each block's batch and joined.
        part = pending[0][2]
        places = Places.concat([places for _, places, _ in pending])
        survivors = part.batch(places)
        pending.clear()
        pending_count = 0
        # Those found over the limit part way through are priced no further: their peak is a
        # lower bound above the limit, their stage -1. Where nothing fits, the smallest peak is
        # then found among them as among those the static bound rejected (``_smallest_peak``).
        peak, stage = peak_memory(model, survivors, options, limit=limit)
        cut = stage < 0
        smallest_peak = min(smallest_peak, float(peak.min(initial=np.inf, where=~cut)))
        if cut.any():
            bounded_index.append(index_part[cut])
            bounded_lower.append(peak[cut])
        fits = peak <= limit
        rejected[OVER_MEMORY] += int(np.count_nonzero(~fits))
        if OVER_HOST_MEMORY in rejected:
            # Only those that offload fill host memory: priced for them alone (memory.host).
            offloading = np.flatnonzero(fits & uses_host(survivors))
            if offloading.size:
                host_peak = host_memory(model, survivors.take(offloading), options).peak()
                over = offloading[host_peak > host_limit]
                fits[over] = False
                rejected[OVER_HOST_MEMORY] += len(over)
        if fits.any():
            # Built again from the part's tables rather than gathered from the survivors' batch:
            # one gather per field from small tables instead of one from the survivors' columns.
            fitting = part.batch(places.take(fits))
            times = _step_times(time_function(model, fitting, cluster), len(fitting))
            kept_index.append(index_part[fits])
            kept_time.append(np.asarray(times["step_s"], dtype=float))
            kept_peak.append(peak[fits])
            kept_stage.append(stage[fits])
            for key, value in times.items():
                kept_extra.setdefault(key, []).append(np.asarray(value, dtype=float))

    # Each candidate is charged to the first reason it breaks: a duplicate, the rules in order,
    # then what the runtime cannot run and (for MoE models) the imbalance routing cannot reach.
    checks: list[Check] = [partial(_holds, rule=rule, context=context) for rule in RULES]
    reasons = [DUPLICATE, *(rule.name for rule in RULES), NOT_RUNNABLE]
    checks.append(partial(_runnable, schedules=list(profile.schedules), runtime=runtime, model=model, family=family))
    if 0 in space.zero and (1 in space.zero or 2 in space.zero):  # the ZeRO 0 candidate stands for them
        reasons.append(DUPLICATE)
        checks.append(_zero_has_group)
    if IMPOSSIBLE_IMBALANCE in rejected:
        reasons.append(IMPOSSIBLE_IMBALANCE)
        checks.append(partial(_reaches_imbalance, model=model, imbalance=imbalance))
    static_bounds = _StaticBounds(model, options)
    for block in screened_blocks(space, checks, block_size):
        for reason, count in zip(reasons, block.rejected.tolist(), strict=True):
            rejected[reason] += count
        index = block.index
        done += block.listed
        valid = index[:0]
        if len(index):
            # The static state alone (a lower bound of the peak) already rejects many; the full
            # memory model prices the rest. The fitting set is the same.
            lower = static_bounds.at(block.part, block.places)
            cannot = lower > limit
            evaluated += len(index)
            rejected[OVER_MEMORY] += int(np.count_nonzero(cannot))
            if cannot.any():
                bounded_index.append(index[cannot])
                bounded_lower.append(lower[cannot])
            valid = np.flatnonzero(~cannot)
        if len(valid):
            if pending and (pending[-1][2] is not block.part or pending_count + len(valid) > block_size):
                # A batch holds one part's candidates (one precision, one set of modules each), and
                # at most a block's worth.
                price_pending()
            pending.append((index[valid], block.places.take(valid), block.part))
            pending_count += len(valid)
        waiting = waiting + block.listed if pending else 0
        if pending_count >= block_size:
            price_pending()
        if progress:
            progress(done - waiting, space.size)
    price_pending()
    if progress:
        progress(done, space.size)
    if not kept_index:
        smallest_peak = _smallest_peak(model, space, options, smallest_peak, bounded_index, bounded_lower, block_size)
        return SearchResult(
            space_size=space.size, evaluated=evaluated, fitting=0, rejected=rejected, ranked=[], pareto=[],
            candidates_time_s=np.zeros(0), candidates_peak_bytes=np.zeros(0), memory_limit_bytes=limit,
            smallest_peak_bytes=None if not np.isfinite(smallest_peak) else smallest_peak,
            seconds=clock.perf_counter() - started,
        )
    # In candidate order, whatever order the blocks ran in (ties in the Pareto front and the
    # candidate arrays a report plots then come out as a plain loop over the space gives them).
    index_all = np.concatenate(kept_index)
    by_index = np.argsort(index_all)  # (indices are distinct: any sort is stable)
    index_all = index_all[by_index]
    time_all = np.concatenate(kept_time)[by_index]
    peak_all = np.concatenate(kept_peak)[by_index]
    order = by_time_then_peak(time_all, peak_all)  # ties in both by index: index_all ascends
    # The peak stage and the other time figures only for the rows shown, read from the pricing
    # call's arrays that hold them: joining each for every fitting candidate cost more than the
    # ranking (1.4 s for 1.7M candidates and ~20 figures; DeepSeek-V3's 239,305, ~5 ms).
    call_starts = np.cumsum([0, *(len(index) for index in kept_index)])

    def rows(positions: np.ndarray) -> list[dict[str, Any]]:
        strategies = space.strategies(index_all[positions])
        found = by_index[positions]  # where each lies among the pricing calls' candidates, in order
        call = np.searchsorted(call_starts, found, side="right") - 1
        at = found - call_starts[call]
        return [_row(strategy, int(index_all[p]), float(peak_all[p]), int(kept_stage[c][a]),
                     {k: v[c][a] for k, v in kept_extra.items()}, options, model, family)
                for strategy, p, c, a in zip(strategies, positions, call.tolist(), at.tolist(), strict=True)]

    front = _front(order, peak_all)
    shown = front[evenly_spread(len(front), PARETO_ROWS)]
    notes = [] if len(shown) == len(front) else [
        f"the Pareto front has {len(front):,} points; {len(shown)} are listed, evenly spread from the fastest to the "
        f"smallest peak"]
    return SearchResult(
        space_size=space.size, evaluated=evaluated, fitting=len(index_all), rejected=rejected,
        ranked=rows(order[:top]), pareto=rows(shown),
        candidates_time_s=time_all, candidates_peak_bytes=peak_all, candidates_index=index_all, memory_limit_bytes=limit,
        smallest_peak_bytes=float(smallest_peak), seconds=clock.perf_counter() - started, notes=notes,
    )


#: Pareto points a result lists at most (both ends always among them).
PARETO_ROWS = 200


def evenly_spread(n: int, k: int) -> np.ndarray:
    """Indices of at most ``k`` of ``n`` ordered items, evenly spread, the first and the last included."""
    if n <= k:
        return np.arange(n)
    return unique(np.round(np.linspace(0, n - 1, k)).astype(np.int64))
