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
CpKind = Literal["ring", "ulysses", "hybrid"]
Recompute = Literal["none", "selective", "full"]
RecomputeModule = Literal["core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts"]

SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "gpipe", "seq1f1b")
CP_KINDS: tuple[str, ...] = ("ring", "ulysses", "hybrid")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
#: Megatron-Core's ``--recompute-modules`` (``TransformerConfig.recompute_modules``), in its order.
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts")

#: Schedules that place more than one model chunk on a stage.
VIRTUAL_SCHEDULES: tuple[str, ...] = ("interleaved", "zbv", "dualpipev")


def canonical_modules(names: Iterable[str]) -> tuple[str, ...]:
    """One spelling per module set, Megatron's order without repeats, so that equal sets are
    equal strategies (names outside ``RECOMPUTE_MODULES`` are dropped: validate them first)."""
    given = set(names)
    return tuple(m for m in RECOMPUTE_MODULES if m in given)


class Strategy(BaseModel):
    """One parallel training configuration.

    Degrees: ``dp`` data, ``tp`` tensor, ``pp`` pipeline, ``cp`` context; the world is
    dp·tp·pp·cp. Experts are laid out over the same dp·tp·cp ranks of a stage ("MoE parallel
    folding"): ``ep`` expert-parallel and ``etp`` expert-tensor-parallel (default: tp).
    Batch: ``global_batch_size`` = dp · ``micro_batch_size`` · ``num_micro_batches`` sequences of
    ``seq_length`` tokens. ``zero`` is the ZeRO stage over the dp·cp ranks (1: optimizer states,
    2: + gradients, 3: + parameters; Megatron's distributed optimizer is ZeRO-1); ``fsdp`` says the
    sharding is torch FSDP, and ``shard_group`` limits it to groups of that many ranks (HSDP).
    ``recompute_layers`` limits full/selective recompute to that many layers per (virtual) stage.
    ``recompute_modules`` names what selective recompute re-runs, as Megatron-Core's
    ``--recompute-modules`` (``RECOMPUTE_MODULES``); empty means the runtime's own selective policy
    (Megatron: the attention core; torchtitan: its per-op policy).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(default=1, ge=1)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    cp_kind: CpKind = "ring"
    ulysses_degree: int = Field(default=1, ge=1, description="Ulysses part of a hybrid CP group")
    ep: int = Field(default=1, ge=1)
    etp: int = Field(default=0, ge=0, description="expert tensor parallel; 0 means the same as tp")
    sequence_parallel: bool = False
    vpp: int = Field(default=1, ge=1)
    schedule: Schedule = "1f1b"
    seq_chunks: int = Field(default=1, ge=1, description="Seq1F1B: sub-sequences per micro-batch")
    stage_layers: tuple[int, ...] | None = Field(
        default=None, description="decoder layers per virtual stage, in model order (pp·vpp entries)"
    )
    embedding_as_layer: bool = False
    output_as_layer: bool = False

    zero: int = Field(default=0, ge=0, le=3)
    fsdp: bool = False
    shard_group: int = Field(default=0, ge=0, description="HSDP shard-group size; 0 means all dp·cp ranks")
    reshard_after_forward: bool = True
    optimizer_offload: bool = False

    recompute: Recompute = "none"
    recompute_layers: int = Field(default=0, ge=0, description="layers per stage recomputed; 0 means all")
    recompute_modules: tuple[RecomputeModule, ...] = Field(
        default=(), description="modules selective recompute re-runs (Megatron-Core); empty: the runtime's policy")

    micro_batch_size: int = Field(default=1, ge=1)
    num_micro_batches: int = Field(default=1, ge=1)
    global_batch_size: int = Field(default=0, ge=0, description="0: dp·micro_batch_size·num_micro_batches")
    seq_length: int = Field(default=4096, ge=1)

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
                data["global_batch_size"] = (
                    int(data.get("dp", 1)) * int(data.get("micro_batch_size", 1)) * int(data.get("num_micro_batches", 1))
                )
            except (TypeError, ValueError):
                pass  # the field validators name the bad value
        return data

    @field_validator("recompute_modules", mode="after")
    @classmethod
    def _canonical_modules(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return canonical_modules(value)

    @model_validator(mode="after")
    def _modules_need_selective(self) -> Strategy:
        if self.recompute_modules and self.recompute != "selective":
            raise ValueError(f"recompute_modules {' '.join(self.recompute_modules)} needs recompute 'selective', "
                             f"not '{self.recompute}'")
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
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

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
        parts += [f"mbs{self.micro_batch_size}", f"m{self.num_micro_batches}", self.schedule]
        if self.recompute != "none":
            # rc-full:2 recomputes the first two layers of each virtual stage
            parts.append(f"rc-{self.recompute}" + (f"({'+'.join(self.recompute_modules)})" if self.recompute_modules else "")
                         + (f":{self.recompute_layers}" if self.recompute_layers else ""))
        return " ".join(parts)
