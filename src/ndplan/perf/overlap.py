"""Which communication hides behind computation: one documented switch per mechanism.

A hidden collective still costs its time, but on another stream; what the step pays is the
*exposed* part, max(0, comm - compute it can hide behind), or a floor that can never hide
(the last gradient bucket has no backward left to overlap with). Each switch says which
mechanism is on; the formulas live with the collectives they change (comm.py, layer.py, step.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ndplan.errors import NdplanError, did_you_mean


class OverlapConfig(BaseModel):
    """Overlap switches.

    dp_grad_reduce: the gradient all-reduce/reduce-scatter runs bucket by bucket during the
        backward of the last micro-batch (Megatron --overlap-grad-reduce, DDP buckets); only
        the time beyond that backward, and at least the last bucket, is exposed (the runtime's
        bucket: ``EfficiencyProfile.grad_buckets``; FSDP's unit, a layer).
    dp_param_gather: the distributed optimizer's parameter all-gather runs during the next
        step's first forward (Megatron --overlap-param-gather); same rule with the forward.
    fsdp_prefetch: FSDP/ZeRO-3 gathers layer i+1's parameters while layer i computes; per layer
        only max(0, gather - compute) is exposed (forward and backward alike).
    cp_ring: ring attention sends the next K/V block while the current one is computed; only
        max(0, ring traffic - cover) is exposed: in the forward (n-1)/n of the attention, n the
        ring's ranks (its n-1 sends each run under one of n equal steps, the last step has
        none), in the backward all of it (a send under each of its n steps).
    tp: tensor-parallel collectives overlap with the GEMMs they feed (Transformer Engine
        userbuffers / async TP); off by default, as in a plain launch. Of the backward's, those
        ``EfficiencyProfile.tp_overlap_backward`` names (a runtime's fact) hide.
    ep: expert all-to-all overlaps with other compute. None (default) means "on exactly under
        DualPipeV", whose overlapped F&B steps exist to hide it.
    ep_dispatch: how the expert all-to-all crosses nodes. 'all_to_all' (Megatron's alltoall
        dispatcher, NCCL): every routed copy of a token travels on its own, over the NIC when
        its expert is on another node. 'node_dedup' (DeepEP, HybridEP): a token routed to
        several experts on one node crosses the network once, to the GPU with the same local
        index there, and is fanned out over NVLink (the combine reduces on the node first, the
        mirror image); on a node it goes once to each rank that holds any of its experts,
        which copies it to them. With k distinct experts spread uniformly over the N nodes of an
        EP group a token reaches N·(1 - C(E - E/N, k)/C(E, k)) distinct nodes, (N-1)/N of them
        remote, and inside one scale-up domain the ranks D = g·(1 - C(E - E/g, k)/C(E, k)) of
        them: D/k of the all-to-all dispatcher's bytes.
    ep_node_limit: node-limited routing (DeepSeek-V3: each token's experts come from at most
        topk_group = 4 of n_group = 8 expert groups, one group per node when ep spans 8 nodes):
        a token reaches at most this many nodes, L·(1 - C(E·L/N - E/N, k)/C(E·L/N, k)) of them
        on average, with 'node_dedup' dispatch. None: no limit. Set it only when the routing
        groups align with nodes.
    ep_routing: where a token's k experts lie. 'uniform' (a trained router, or Megatron's
        --moe-router-force-load-balancing, which draws random scores): spread over the EP ranks
        at random. 'contiguous': k consecutive experts starting at a multiple of k (NeMo
        AutoModel's FakeBalancedGate, a benchmarking gate), so a token's copies land on
        max(1, k/(E/ep)) ranks and max(1, k/(E/ep·g)) nodes. Only the deduplicating dispatch
        ('node_dedup') sends fewer bytes for it; it ignores ``ep_node_limit``.
    ep_dispatch_fp8: the dispatch all-to-all carries tokens already quantised to fp8 (1 byte
        per element; DeepSeek-V3's framework quantises before dispatching). Off, tokens travel
        in the activation dtype and are quantised inside the expert GEMM, as in Megatron-Core
        (its all-to-all, DeepEP and HybridEP dispatchers all send bf16). The combine and the
        backward all-to-alls always move the activation dtype. Only for fp8 expert GEMMs (an
        fp8 precision); refused under bf16 (``layer.ep_dispatch_bytes``).
    dp_bucket_params: parameters per gradient bucket (Megatron's --ddp-bucket-size); None: the
        runtime's default (Megatron-Core max(40e6, 1e6·dp), PyTorch DDP its bucket_cap_mb).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp_grad_reduce: bool = True
    dp_param_gather: bool = True
    fsdp_prefetch: bool = True
    cp_ring: bool = True
    tp: bool = False
    ep: bool | None = None
    ep_dispatch: Literal["all_to_all", "node_dedup"] = "all_to_all"
    ep_node_limit: int | None = Field(default=None, ge=1)
    ep_routing: Literal["uniform", "contiguous"] = "uniform"
    ep_dispatch_fp8: bool = False
    dp_bucket_params: int | None = Field(default=None, ge=1)

    def describe(self) -> str:
        """One line naming what hides and what does not, as the estimate prints it."""
        on = [name for name, flag in (
            ("dp grad-reduce", self.dp_grad_reduce), ("dp param-gather", self.dp_param_gather),
            ("fsdp prefetch", self.fsdp_prefetch), ("cp ring", self.cp_ring), ("tp", self.tp)) if flag]
        if self.ep is None:
            on.append("ep under dualpipev")
        elif self.ep:
            on.append("ep")
        dispatch = self.ep_dispatch.replace("_", "-") + (", fp8" if self.ep_dispatch_fp8 else "") + (
            f", at most {self.ep_node_limit} nodes per token" if self.ep_node_limit else "") + (
            "" if self.ep_routing != "contiguous" else ", contiguous experts per token"
            if self.ep_dispatch == "node_dedup" else " (contiguous routing moves the same bytes through it)")
        return f"hidden: {', '.join(on) or 'nothing'}; expert dispatch {dispatch}"


#: Defaults per software stack. "megatron" is what Megatron-LM/NeMo recipes turn on by default
#: (grad-reduce and param-gather overlap; TP overlap is an opt-in flag); "torchtitan"/"fsdp"
#: is torch FSDP2 with prefetch and no DDP-style distributed optimizer; "plain" overlaps nothing.
OVERLAP_PRESETS: dict[str, OverlapConfig] = {
    "megatron": OverlapConfig(),
    "megatron-tp-overlap": OverlapConfig(tp=True),
    "torchtitan": OverlapConfig(),
    "deepspeed": OverlapConfig(dp_param_gather=False),
    "plain": OverlapConfig(
        dp_grad_reduce=False, dp_param_gather=False, fsdp_prefetch=False, cp_ring=False, tp=False, ep=False
    ),
}

#: Default software stack per device runtime (Device.runtime): CUDA and ROCm run Megatron-style
#: stacks; CANN runs MindSpeed, a Megatron port with the same overlap defaults.
_RUNTIME_DEFAULT = {"cuda": "megatron", "rocm": "megatron", "cann": "megatron"}


def default_overlap(runtime: str) -> OverlapConfig:
    """Overlap defaults for a device runtime ('cuda', 'rocm', 'cann')."""
    return OVERLAP_PRESETS[_RUNTIME_DEFAULT.get(runtime, "megatron")]


def get_overlap(name: str) -> OverlapConfig:
    key = name.lower()
    if key not in OVERLAP_PRESETS:
        raise NdplanError(f"unknown overlap preset '{name}'{did_you_mean(name, OVERLAP_PRESETS)}; "
                          f"known: {', '.join(OVERLAP_PRESETS)}")
    return OVERLAP_PRESETS[key]


#: How a user writes a switch on or off (the overlap switches, and the search's --fix sp=...).
ON_WORDS: tuple[str, ...] = ("1", "true", "yes", "on")
OFF_WORDS: tuple[str, ...] = ("0", "false", "no", "off")


def parse_overlap(spec: str | Mapping[str, Any] | OverlapConfig | None) -> OverlapConfig | None:
    """An OverlapConfig from what a user writes: a preset name, ``key=value`` pairs after an
    optional preset (``megatron,tp=on,ep_dispatch=node_dedup``), or a mapping of the same (a plan
    file's ``overlap:``; ``preset`` names the base). Unset keys keep the base's values, the
    ``megatron`` preset unless another is named. None stays None (the device runtime's defaults).
    """
    if spec is None or isinstance(spec, OverlapConfig):
        return spec
    if isinstance(spec, str):
        parts = [part.strip() for part in spec.split(",") if part.strip()]
        if not parts:
            raise NdplanError(f"overlap: empty setting; give a preset ({', '.join(OVERLAP_PRESETS)}) or key=value pairs")
        preset = parts.pop(0) if "=" not in parts[0] else "megatron"
        fields: dict[str, Any] = {}
        for part in parts:
            if "=" not in part:
                raise NdplanError(f"overlap: '{part}' is not key=value (only the first item may name a preset)")
            key, value = (x.strip() for x in part.split("=", 1))
            if key in fields:  # the last silently won; --fix refuses a repeat the same way
                raise NdplanError(f"overlap: '{key}' is given twice ({fields[key]} and {value}); give each switch once")
            fields[key] = value
        return _overlap_from(preset, fields)
    if isinstance(spec, Mapping):
        fields = dict(spec)
        return _overlap_from(str(fields.pop("preset", "megatron")), fields)
    raise NdplanError(f"overlap: expected a preset name, key=value pairs or a mapping, got {type(spec).__name__}")


def _overlap_from(preset: str, fields: dict[str, Any]) -> OverlapConfig:
    known = list(OverlapConfig.model_fields)
    values: dict[str, Any] = {}
    for key, value in fields.items():
        if key not in known:
            raise NdplanError(f"overlap: unknown switch '{key}'; known: {', '.join(known)}")
        values[key] = _overlap_value(key, value)
    try:
        return OverlapConfig(**{**get_overlap(preset).model_dump(), **values})
    except ValidationError as error:
        first = error.errors()[0]
        raise NdplanError(f"overlap: {first['loc'][0]}: {first['msg']}") from None


def _overlap_value(key: str, value: Any) -> Any:
    """Words a command line gives, as the field's type wants them ('on' → True, 'auto' → None)."""
    if not isinstance(value, str):
        return value
    word = value.strip().lower()
    if key == "ep" and word in {"auto", "none"}:
        return None
    if key in ("ep_node_limit", "dp_bucket_params"):
        if word in {"none", "0"} or (key == "dp_bucket_params" and word == "auto"):  # the runtime's bucket
            return None
        if not word.isdigit():
            what = "nodes" if key == "ep_node_limit" else "parameters"
            raise NdplanError(f"overlap: {key} must be a whole number of {what}, got '{value}'")
        return int(word)
    if key == "ep_dispatch":
        allowed = ("all_to_all", "node_dedup")
        word = word.replace("-", "_")
        if word not in allowed:
            raise NdplanError(f"overlap: ep_dispatch must be one of {', '.join(allowed)}, got '{value}'")
        return word
    if key == "ep_routing":
        routings = ("uniform", "contiguous")
        if word not in routings:
            raise NdplanError(f"overlap: ep_routing must be one of {', '.join(routings)}, got '{value}'")
        return word
    if word in ON_WORDS:
        return True
    if word in OFF_WORDS:
        return False
    extra = " or auto (on under dualpipev only)" if key == "ep" else ""
    raise NdplanError(f"overlap: {key} must be on or off{extra}, got '{value}'")
