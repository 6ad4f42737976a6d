"""MemoryReport: one strategy's per-stage memory, with its breakdown and the formulas behind it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ndplan.errors import NdplanError
from ndplan.hardware import Device
from ndplan.memory.activations import (
    CENSUS_SELECTIVE_POLICY,
    applicable_modules,
    applicable_offload_modules,
    layer_activations,
)
from ndplan.memory.buffers import ring_exchange
from ndplan.memory.host import host_memory, offloaded_per_micro_batch
from ndplan.memory.layer_offload import held_away
from ndplan.memory.options import MemoryOptions
from ndplan.memory.result import ACTIVATION_KINDS, STATIC_KINDS, StageMemory
from ndplan.memory.shape import recomputed_layers
from ndplan.memory.stages import stage_memory
from ndplan.memory.static import (
    experts_out_of_fsdp,
    layer_elements,
    linear_weight_elements,
    optimizer_on_device,
    shard_groups,
    sharding_factors,
)
from ndplan.memory.terms import ddp_bucket_width, fp8_weight_cache_width, whole_embedding_grad_extra
from ndplan.model.spec import MlpKind, ModelSpec
from ndplan.placement import Placement, place_layers
from ndplan.schedule import SPLIT_BACKWARD, in_flight
from ndplan.strategy import Strategy, StrategyBatch
from ndplan.strategy.rules import validate_strategy
from ndplan.units import format_bytes


@dataclass(frozen=True)
class ChunkReport:
    """One virtual stage (model chunk) of a stage: its layers, what one micro-batch of its layers
    keeps for backward (under recompute of N layers, the first N keep what recompute keeps and
    the others every activation), and how many micro-batches of it the schedule holds at once
    at its peak."""

    chunk: int
    model_chunk: int
    dense_layers: int
    moe_layers: int
    layer_static_bytes: float
    activation_bytes_per_micro_batch: float
    peak_in_flight: float
    #: what activation offload keeps in host memory per micro-batch (not in the device figures)
    offloaded_bytes_per_micro_batch: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk": self.chunk, "model_chunk": self.model_chunk, "dense_layers": self.dense_layers,
            "moe_layers": self.moe_layers, "layer_static_bytes": round(self.layer_static_bytes),
            "activation_bytes_per_micro_batch": round(self.activation_bytes_per_micro_batch),
            "offloaded_bytes_per_micro_batch": round(self.offloaded_bytes_per_micro_batch),
            "peak_in_flight": self.peak_in_flight,
        }


@dataclass(frozen=True)
class StageReport:
    stage: int
    layers: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    comm_bytes: float
    transient_bytes: float
    optimizer_step_bytes: float
    forward_backward_bytes: float
    allocated_bytes: float
    reserved_bytes: float
    peak_bytes: float
    static_by_kind: dict[str, float]
    activations_by_kind: dict[str, float]
    chunks: tuple[ChunkReport, ...] = ()
    #: pinned host memory at the stage's peak (``memory.host``): offloaded activations (Σ over its
    #: chunks of peak in-flight micro-batches × offloaded bytes per micro-batch, the layer Megatron
    #: keeps on the device counted too: over by at most one layer's worth) and an offloaded optimizer
    host_activation_bytes: float = 0.0
    host_optimizer_bytes: float = 0.0

    @property
    def host_bytes(self) -> float:
        return self.host_activation_bytes + self.host_optimizer_bytes

    @property
    def static_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def step_peak_bytes(self) -> float:
        """The optimizer step's peak: static + its temporaries (allocated is the larger of it and
        the forward/backward peak)."""
        return self.static_bytes + self.optimizer_step_bytes

    @property
    def unmade_bytes(self) -> float:
        """What the categories count but the forward/backward peak's moment lacks: gradients the
        backward has not made (one micro-batch, a deferred FSDP reduce) and activations already
        freed (an FSDP unit's moment after a micro-batch's loss or later layers): the categories'
        sum less that peak."""
        return max(0.0, self.static_bytes + self.activations_bytes + self.comm_bytes + self.transient_bytes
                   - self.forward_backward_bytes)

    @property
    def overhead_bytes(self) -> float:
        return self.peak_bytes - self.allocated_bytes

    def to_dict(self) -> dict[str, Any]:
        by_kind = {k: self.static_by_kind.get(k, 0.0) + self.activations_by_kind.get(k, 0.0)
                   for k in dict.fromkeys([*STATIC_KINDS, *ACTIVATION_KINDS])}
        return {
            "stage": self.stage,
            "layers": self.layers,
            "peak_bytes": round(self.peak_bytes),
            "allocated_bytes": round(self.allocated_bytes),
            "reserved_bytes": round(self.reserved_bytes),
            "params_bytes": round(self.params_bytes),
            "grads_bytes": round(self.grads_bytes),
            "optimizer_bytes": round(self.optimizer_bytes),
            "activations_bytes": round(self.activations_bytes),
            "comm_bytes": round(self.comm_bytes),
            "transient_bytes": round(self.transient_bytes),
            "optimizer_step_bytes": round(self.optimizer_step_bytes),
            "forward_backward_bytes": round(self.forward_backward_bytes),
            "overhead_bytes": round(self.overhead_bytes),
            "host_activation_bytes": round(self.host_activation_bytes),
            "host_optimizer_bytes": round(self.host_optimizer_bytes),
            "host_bytes": round(self.host_bytes),
            "by_layer_kind": {k: round(v) for k, v in by_kind.items() if v},
            "static_by_layer_kind": {k: round(v) for k, v in self.static_by_kind.items() if v},
            "activations_by_layer_kind": {k: round(v) for k, v in self.activations_by_kind.items() if v},
            "chunks": [c.to_dict() for c in self.chunks],
        }


@dataclass(frozen=True)
class MemoryReport:
    model: ModelSpec
    strategy: Strategy
    device: Device | None
    options: MemoryOptions
    stages: tuple[StageReport, ...]

    @property
    def caveats(self) -> list[str]:
        """Where measurements say this estimate is not to be trusted as it stands."""
        return known_gaps(self.strategy, self.options, self.model)

    @property
    def peak_stage(self) -> int:
        return max(self.stages, key=lambda s: s.peak_bytes).stage

    @property
    def peak_bytes(self) -> float:
        return max(s.peak_bytes for s in self.stages)

    @property
    def capacity_bytes(self) -> int | None:
        return self.device.memory_bytes if self.device else None

    @property
    def fits(self) -> bool | None:
        return None if self.device is None else self.peak_bytes <= self.device.memory_bytes

    @property
    def host_peak_bytes(self) -> float:
        """The most pinned host memory one device's process fills (its stage's, bytes)."""
        return max(s.host_bytes for s in self.stages)

    @property
    def host_capacity_bytes(self) -> float | None:
        """One device's share of its node's host memory (``Device.host_memory_bytes``), or None."""
        return self.device.host_memory_bytes if self.device else None

    @property
    def fits_host(self) -> bool | None:
        """Whether the host memory the offloads fill fits the device's share of its node's: True
        where nothing is offloaded, None where the device states no host memory."""
        if not self.host_peak_bytes:
            return True
        capacity = self.host_capacity_bytes
        return None if capacity is None else self.host_peak_bytes <= capacity

    def to_dict(self) -> dict[str, Any]:
        """Every stage's figures and breakdown as JSON-ready data (what --json prints)."""
        return {
            "peak_bytes": round(self.peak_bytes),
            "peak_stage": self.peak_stage,
            "fits": self.fits,
            "capacity_bytes": self.capacity_bytes,
            "host_peak_bytes": round(self.host_peak_bytes),
            "host_capacity_bytes": None if self.host_capacity_bytes is None else round(self.host_capacity_bytes),
            "fits_host": self.fits_host,
            "runtime": self.options.runtime,
            "attention": self.options.attention,
            # The other options the figures depend on, so that a report can say how to reproduce them.
            "include_overhead": self.options.include_overhead,
            "loss_parallel": self.options.loss_parallel,
            "loss_upcast": self.options.loss_upcast,
            "moe_imbalance": self.options.moe_imbalance,
            "moe_capacity_factor": self.options.moe_capacity_factor,
            "selective_policy": self.options.selective_policy,
            "modules": self.options.modules,
            "experts_outside_fsdp": self.options.experts_outside_fsdp,
            "gradient_accumulation_fusion": self.options.gradient_accumulation_fusion,
            "census_records": len(self.options.census),
            "stages": [s.to_dict() for s in self.stages],
            "caveats": self.caveats,
        }

    def _whole_embedding_grad_term(self, stage: StageReport) -> str:
        """The grads line's extra term where the runtime accumulates the embedding's gradient
        whole (``terms.whole_embedding_grad_extra``, on the embedding's stage)."""
        s = self.strategy
        # (a tied table shared with the head there: where the term applies, without ZeRO-3, a
        # tied pair is one table wherever its two ends sit on one stage)
        shared = self.model.tie_word_embeddings and any(
            c.model_chunk == s.pp * s.vpp - 1 for c in self.stages[0].chunks)
        elements = float(whole_embedding_grad_extra(self.model, self.options.profile, s.tp, s.zero, s.micro_batches_per_step,
                                                    shared_with_head=shared))
        if stage.stage != 0 or not elements:
            return ""
        extra = elements * s.precision.grad_bytes
        return (f" + the whole embedding gradient's other shards (vocab·h·(1 − 1/tp) × {s.precision.grad_bytes} B "
                f"= {format_bytes(extra)}: a second micro-batch's gradient leaves DTensor's accumulated one unsharded)")

    def _fp8_weight_cache_term(self) -> str:
        """The params line's extra term where the runtime keeps fp8 copies of the linear weights."""
        precision = self.strategy.precision
        width = float(fp8_weight_cache_width(self.options.profile, precision, self.strategy.zero))
        if precision.fp8_params and self.strategy.zero < 3:
            copies = width + precision.param_bytes
            held = "the 1-byte weight and its transposed copy" if copies >= 2 else "the 1-byte weight"
            if not width:
                return f" (linear weights kept in fp8: {held}, the {copies:g} B counted)"
            return f" + linear weight elements × {width:+g} B (linear weights kept in fp8: {held}, {copies:g} B an element)"
        if not width:
            return ""
        return (f" + the linears' fp8 weight copies kept across micro-batches (linear weight elements × {width:g} B: "
                "row-wise and transposed)")

    def _experts_outside_term(self) -> str:
        """The grads line's note where the routed experts stay out of FSDP (``experts_outside_fsdp``
        with their shard group of one rank): their gradients at the parameters' width, and no unit
        buffer of theirs in comm."""
        s = self.strategy
        _, expert_shards = shard_groups(s.dp, s.cp, s.tp, s.ep, s.etp, s.shard_group)
        if not (self.model.is_moe and experts_out_of_fsdp(self.options.experts_outside_fsdp, s.zero, expert_shards)):
            return ""
        return (f" (the routed experts out of FSDP, their shard group one rank: their gradients at "
                f"{s.precision.param_bytes} B, no gathered copy or unsharded gradient of theirs in comm)")

    def _shards_on_host_term(self) -> str:
        """The params and grads lines' note where FSDP2's CPU offload keeps the shards on the host."""
        s = self.strategy
        if s.optimizer_offload and s.zero == 3 and self.options.profile.kernels.get("fsdp_cpu_offload"):
            return " → on pinned host memory with the optimizer states (FSDP2's CPU offload)"
        return ""

    def _ddp_bucket_term(self) -> str:
        """The comm line's term where a DDP reducer keeps buckets beside the gradients."""
        s = self.strategy
        width = float(ddp_bucket_width(self.options.profile, s.precision.grad_bytes, s.zero, s.dp, s.cp))
        if not width:
            return ""
        return f" + DDP's reducer buckets (elements × {width:g} B, a copy of the gradients, kept)"

    def _allgather_term(self) -> str:
        """The comm line's terms of Megatron's allgather token dispatcher, where it is priced."""
        s = self.strategy
        if self.options.moe_dispatcher != "allgather" or not self.model.is_moe or s.etp * s.ep == 1:
            return ""
        return (f"; EP dispatch is the allgather dispatcher's: the G = (b·s/c)/t·etp·ep tokens of the etp×ep "
                f"group un-permuted, cast to fp32 and reduce-scattered, G·h·({s.precision.activation_bytes:g}+4) + "
                f"(b·s/c)/t·h·4, and its persistent global buffer G·h·{s.precision.activation_bytes:g}, kept")

    def _torch_ring_term(self) -> str:
        """The comm line's term of torch's ring, where the runtime all-gathers (``buffers._cp_buffers``)."""
        s = self.strategy
        if s.cp == 1 or s.cp_kind == "ulysses" or ring_exchange(self.options) != "allgather":
            return ""
        return (f"; CP K/V is torch's ring (the {self.options.runtime} profile's ring_exchange allgather): K and V "
                f"all-gathered from cp={s.cp} ranks at the query heads' width with their contiguous copy, and the "
                f"fp32 gradients of Q, K and V accumulated, received and sent on, "
                f"((c + 1)·{s.precision.activation_bytes:g} + 16)·(q_w + o_w)·T/t + 4·q_w·T/t")

    def _kv_allgather_term(self) -> str:
        """The comm line's term of all-gather context parallelism (``buffers._cp_buffers``)."""
        s = self.strategy
        if s.cp == 1 or s.cp_kind != "allgather":
            return ""
        return (f"; CP K/V is all-gathered (cp_kind allgather): the backward holds the gathered keys and values, "
                f"their zero-filled gradients, the two attention calls' gradients over their ranges and a reordered "
                f"copy of one, ((3c + 1/2)·(k_w + v_w) + c·max(k_w, v_w))·T/t·{s.precision.activation_bytes:g} with "
                f"c = {s.cp}")

    def _deferred_fsdp_reduce(self) -> bool:
        """Whether the runtime holds unsharded gradients to the step's end (FSDP under a pipeline
        of several virtual stages, as ``stages`` prices it)."""
        s = self.strategy
        return bool(s.zero == 3 and self.options.profile.pipeline_defers_fsdp_reduce and s.pp * s.vpp > 1)

    def explain(self) -> list[str]:
        """Each term of the peak stage with its formula and values."""
        s = self.strategy
        p = s.precision
        stage = self.stages[self.peak_stage]
        tokens = s.micro_batch_size * s.seq_length / s.cp
        shards = "dp·cp" if not s.shard_group else "shard_group"
        if self.model.is_moe:  # experts replicate over the ranks of their EP·ETP group
            shards += "; experts / dp·cp·tp/(ep·etp)" if not s.shard_group else "; experts / shard_group·tp/(ep·etp)"
        workspace = self.options.profile.overhead.get("workspace_bytes", 0.0) if self.options.include_overhead else 0.0
        lines = [
            f"stage {stage.stage} of {s.pp} holds {stage.layers} decoder layers; tokens per micro-batch per rank "
            f"= mbs·seq/cp = {s.micro_batch_size}·{s.seq_length}/{s.cp} = {tokens:,.0f}",
            f"params     = Σ elements/tp (experts /(ep·etp)) × {p.param_bytes} B"
            + (f" / {shards} (ZeRO-3)" if s.zero >= 3 else "") + self._fp8_weight_cache_term()
            + self._shards_on_host_term() + f" = {format_bytes(stage.params_bytes)}",
            f"grads      = elements × {p.grad_bytes} B" + (f" / {shards} (ZeRO≥2)" if s.zero >= 2 else "")
            + self._whole_embedding_grad_term(stage) + self._shards_on_host_term() + self._experts_outside_term()
            + f" = {format_bytes(stage.grads_bytes)}"
            + (" (made by the step's end reduce-scatter: the pipeline defers FSDP's reduce, so until then each "
               "chunk keeps its unsharded gradient, counted in comm)"
               if self._deferred_fsdp_reduce() and s.pipeline_runs == 1 else
               f" (made by each pipeline run's end reduce-scatter, so held from the second of {s.pipeline_runs} runs "
               "on, beside the unsharded gradients each run accumulates again, counted in comm)"
               if self._deferred_fsdp_reduce() else
               f" (held from the second of {s.pipeline_runs} pipeline runs on: the first made them)"
               if s.pipeline_runs > 1 and self.options.profile.grads_created_in_backward else ""),
            f"optimizer  = elements × ({p.optimizer_states}·{p.optimizer_state_bytes} + {p.master_weight_bytes}) B"
            + (f" / {shards} (ZeRO≥1)" if s.zero >= 1 else "")
            + (f" → {'' if s.optimizer_offload_fraction == 1.0 else f'{s.optimizer_offload_fraction:g} of it '}"
               f"offloaded to pinned host memory, elements × ({p.optimizer_states}·{p.optimizer_state_bytes} + "
               f"2·{p.master_weight_bytes or p.param_bytes}) B (states, the weight the CPU step updates and its "
               f"gradient) = {format_bytes(stage.host_optimizer_bytes)} there"
               + ("" if s.optimizer_offload_fraction == 1.0 else "; the rest on the device")
               if s.optimizer_offload else
               " (on pinned host memory through the forward and backward, --offload-optimizer-states: on the device "
               "at the optimizer step alone)" if s.offload_optimizer_states else "")
            + f" = {format_bytes(stage.optimizer_bytes)}",
            f"activations = max over the {s.schedule} timeline of Σ in-flight micro-batches × bytes/token × tokens "
            f"({self.options.runtime} profile"
            + (", Transformer Engine's norms and weighted experts" if self.options.modules == "te" else "")
            + f", {self.options.attention} attention, recompute {s.recompute}) "
            f"= {format_bytes(stage.activations_bytes)}",
        ]
        for kind, value in stage.activations_by_kind.items():
            if value:
                lines.append(f"    {kind:<10} {format_bytes(value)}")
        if s.offload_modules:
            lines.append(
                f"    offload ({' '.join(s.offload_modules)}): what those modules save goes to pinned host memory "
                f"after the forward and back before the backward; held there at this peak: "
                f"{format_bytes(stage.host_activation_bytes)}; two layers' worth stay on the device "
                f"(the next backward's last layer, one reload ahead), counted in the transient")
        if s.offload_layers:
            lines.append(
                f"    offload of the first {s.offload_layers} layers (--cpu-offloading-num-layers): everything they save "
                f"goes to pinned host memory each micro-batch ({format_bytes(stage.host_activation_bytes)} at this peak); "
                f"all but the last of them are off the device at the backward's start, one reloaded at once")
        lines += [
            "comm       = FSDP unit buffers at the stage's worst moment (gathered and prefetched parameters, "
            "unsharded gradients, reduce input) + PP send/recv and receive buffers + max(SP gather, CP K/V, "
            "EP dispatch)" + self._torch_ring_term() + self._kv_allgather_term() + self._ddp_bucket_term() + self._allgather_term()
            + f" = {format_bytes(stage.comm_bytes)}",
            f"transient  = the worst working set beside them: one layer's backward (+ recompute rebuild; "
            f"where the s² scores are materialised, eager or SDPA's math path, its attention backward: the "
            f"probabilities' gradient, softmax's gradient and CUDA's temporary product), the "
            f"logits around the loss, a new gradient being accumulated, FSDP's unit moments, or (PyTorch, "
            f"split backward, full recompute) a weight-gradient step's rebuilt copies, per layer groups × "
            f"unread bytes = {format_bytes(stage.transient_bytes)}",
            f"fwd/bwd    = static + activations + comm + transient − not yet created "
            f"({format_bytes(stage.unmade_bytes)}: gradients the backward has not made, activations "
            f"it has freed" + (", optimizer states waiting on the host" if s.offload_optimizer_states else "")
            + ", at that moment) "
            f"= {format_bytes(stage.forward_backward_bytes)}",
            f"allocated  = max(fwd/bwd, optimizer-step peak {format_bytes(stage.step_peak_bytes)} = static"
            f" + optimizer step {format_bytes(stage.optimizer_step_bytes)}) = {format_bytes(stage.allocated_bytes)}",
            *([f"             (transient and the optimizer step each hold the math libraries' workspaces, "
               f"{format_bytes(workspace)}: cuBLAS/cuBLASLt, allocated at the first matmul and kept)"]
              if workspace else []),
            f"reserved   = allocated × (1 + allocator slack) = {format_bytes(stage.reserved_bytes)}",
            f"peak       = reserved + runtime context + communicator buffers = {format_bytes(stage.peak_bytes)}",
        ]
        if stage.host_bytes:
            capacity = self.host_capacity_bytes
            lines.append(
                f"host       = offloaded activations (Σ chunks peak in-flight × moved per micro-batch) "
                f"{format_bytes(stage.host_activation_bytes)} + offloaded optimizer {format_bytes(stage.host_optimizer_bytes)}"
                f" = {format_bytes(stage.host_bytes)} of pinned host memory, not on the device"
                + (f"; the device's share of its node's host memory: {format_bytes(capacity)}" if capacity else
                   "; the device states no host memory (--host-memory)"))
        return lines


def check_moe_imbalance(model: ModelSpec, strategy: Strategy, options: MemoryOptions) -> None:
    """Refuse a ``moe_imbalance`` routing cannot produce: each token's k copies go to k distinct
    experts, at most min(k, E/ep) of them on one rank of the ep that share the tokens, so the
    busiest rank holds at most ep·min(k, E/ep)/k balanced shares (1 without EP)."""
    if not model.is_moe:
        return
    k, experts = model.num_experts_per_tok, model.num_experts
    most = strategy.ep * min(k, experts // strategy.ep) / k
    if options.moe_imbalance > most * (1 + 1e-9):
        local = experts // strategy.ep
        reason = (f"with ep=1 every rank holds all {experts} experts, so routing loads every rank alike (at most 1)"
                  if strategy.ep == 1 else
                  f"with ep={strategy.ep} and top-{k} of {experts} experts the busiest rank holds at most "
                  f"{most:g}× a balanced share (every token's copies on its {local} expert{'s' * (local > 1)})")
        raise NdplanError(f"moe_imbalance {options.moe_imbalance:g} is more than routing can put on one rank: {reason}")


def check_options(options: object) -> None:
    """An NdplanError unless ``options`` is a MemoryOptions or None: the entry points take it
    (a runtime name given there raised AttributeError deep inside)."""
    if options is not None and not isinstance(options, MemoryOptions):
        raise NdplanError(f"options must be a MemoryOptions (e.g. MemoryOptions(runtime='megatron')), "
                          f"got {type(options).__name__}")


def estimate(
    model: ModelSpec | str,
    strategy: Strategy,
    hardware: Device | str | None = None,
    options: MemoryOptions | None = None,
    *,
    num_devices: int | None = None,
) -> MemoryReport:
    """Per-stage memory of one strategy (validated first; every broken rule is reported).
    ``model`` and ``hardware`` may be given by name (a preset or a file path)."""
    from ndplan.hardware import as_device
    from ndplan.model import as_model

    model = as_model(model)
    hardware = None if hardware is None else as_device(hardware, "hardware")
    if not isinstance(strategy, Strategy):
        raise NdplanError(f"estimate needs a Strategy, got {type(strategy).__name__}")
    check_options(options)
    validate_strategy(strategy, model, num_devices)
    options = options or MemoryOptions()
    check_moe_imbalance(model, strategy, options)
    check_kv_heads(model, strategy, options)
    memory: StageMemory = stage_memory(
        model, StrategyBatch.of(strategy), options, breakdown=True, stage_layers=strategy.stage_layers
    )
    assert memory.by_kind is not None
    placement = place_layers(
        model, strategy.pp, strategy.vpp, strategy.schedule, strategy.stage_layers,
        embedding_as_layer=strategy.embedding_as_layer, output_as_layer=strategy.output_as_layer,
    )
    layers_per_stage = np.bincount(placement.stage_of, weights=placement.layers, minlength=strategy.pp)
    chunks = _chunk_reports(model, strategy, options, placement)
    host = host_memory(model, StrategyBatch.of(strategy), options, stage_layers=strategy.stage_layers)
    stages = []
    for s in range(strategy.pp):
        stages.append(StageReport(
            stage=s,
            layers=int(layers_per_stage[s]),
            params_bytes=float(memory.params[0, s]),
            grads_bytes=float(memory.grads[0, s]),
            optimizer_bytes=float(memory.optimizer[0, s]),
            activations_bytes=float(memory.activations[0, s]),
            comm_bytes=float(memory.comm[0, s]),
            transient_bytes=float(memory.transient[0, s]),
            optimizer_step_bytes=float(memory.optimizer_step[0, s]),
            forward_backward_bytes=float(memory.forward_backward[0, s]),
            allocated_bytes=float(memory.allocated[0, s]),
            reserved_bytes=float(memory.reserved[0, s]),
            peak_bytes=float(memory.device[0, s]),
            static_by_kind={k: float(v[0, s]) for k, v in memory.by_kind["static"].items()},
            activations_by_kind={k: float(v[0, s]) for k, v in memory.by_kind["activations"].items()},
            chunks=tuple(c for c in chunks if placement.stage_of[c.model_chunk] == s),
            host_activation_bytes=float(host.activations[0, s]),
            host_optimizer_bytes=float(host.optimizer[0, s]),
        ))
    return MemoryReport(model, strategy, hardware, options, tuple(stages))


def check_kv_heads(model: ModelSpec, strategy: Strategy, options: MemoryOptions) -> None:
    """Refuse more TP ranks than KV heads under a runtime whose profile does not run them
    (``RuntimeProfile.tp_above_kv_heads``; the search counts them not runnable)."""
    kv_heads = model.split_kv_heads
    if strategy.tp > kv_heads and not options.profile.tp_above_kv_heads:
        raise NdplanError(f"tp={strategy.tp} is above {model.name}'s {kv_heads} KV heads, which the {options.runtime} "
                          "runtime does not run (its tensor-parallel plans split whole heads): use tp <= "
                          f"{kv_heads}, or price it under runtime 'megatron', which gathers the QKV output and keeps "
                          "one KV head a rank")


#: The device fractions ``known_gaps`` asks to leave free: the pytorch runtime's FSDP (published
#: runs measured up to 1.20x the estimate), a Megatron MoE priced with balanced routing (1.6-5.6%
#: low against Megatron's tests).
FSDP_HEADROOM, BALANCED_MOE_HEADROOM = 0.30, 0.06


def headroom(strategy: Strategy, options: MemoryOptions, model: ModelSpec | None = None) -> float:
    """The fraction of the device ``known_gaps`` asks to leave free for this strategy (0: none)."""
    if options.runtime == "pytorch" and strategy.fsdp:
        return FSDP_HEADROOM
    if options.runtime == "megatron" and model is not None and model.is_moe and options.moe_imbalance == 1.0:
        return BALANCED_MOE_HEADROOM
    return 0.0


def _uneven_linear_stages(model: ModelSpec, strategy: Strategy) -> str:
    """The stages whose Gated DeltaNet share differs from the model's, as "stage 0 holds 2 of 6"
    (empty where every stage holds the model's share)."""
    placement = place_layers(
        model, strategy.pp, strategy.vpp, strategy.schedule, strategy.stage_layers,
        embedding_as_layer=strategy.embedding_as_layer, output_as_layer=strategy.output_as_layer,
    )
    linear = np.array([span == "linear" for span in model.layer_attention_spans], dtype=float)
    starts = np.concatenate([[0], np.cumsum(placement.layers)[:-1]]).astype(int)
    held = np.zeros(strategy.pp)
    layers = np.zeros(strategy.pp)
    for virtual, (start, count) in enumerate(zip(starts.tolist(), placement.layers.astype(int).tolist(), strict=True)):
        held[placement.stage_of[virtual]] += linear[start:start + count].sum()
        layers[placement.stage_of[virtual]] += count
    share = model.linear_share()
    off = [f"stage {stage} holds {held[stage]:.0f} of {layers[stage]:.0f}" for stage in range(strategy.pp)
           if abs(held[stage] - share * layers[stage]) > 1e-9]
    return ", ".join(off)


def known_gaps(strategy: Strategy, options: MemoryOptions, model: ModelSpec | None = None) -> list[str]:
    """Measured misses of the estimator for this kind of strategy (docs/accuracy.md), and what
    it prices unmeasured, so that a user sees them beside the number rather than in a document."""
    gaps = []
    if options.census and strategy.recompute == "selective" and options.recompute_policy != CENSUS_SELECTIVE_POLICY:
        gaps.append(f"the census measured torch's keep-every-matmul selective recompute; this runtime's "
                    f"({options.recompute_policy}) is priced by the formulas")
    if options.census and strategy.tp > 1:
        # layer_activations' census_applies: its TP-2 run has no SP, and splits experts as the heads.
        other = ["sequence parallelism"] if strategy.sequence_parallel else []
        if model is not None and model.is_moe and strategy.etp not in (0, strategy.tp):
            other.append(f"experts split {strategy.etp}-way, not with the {strategy.tp}-way heads")
        if other:
            gaps.append(f"this strategy shards its layers otherwise than the census's TP-2 run did ({'; '.join(other)}): "
                        "the formulas price its layers, not the census (the output's census still applies)")
    if options.census and model is not None and options.compiled_layers(model):
        gaps.append("the census measured eager layers: where it prices them (--census), torch.compile's smaller "
                    "saved set (--compile) is not priced, an upper bound")
    if strategy.offload_layers:
        gaps.append("layer offload (--cpu-offloading-num-layers) is priced from Transformer Engine's code, not yet checked "
                    "against a measured run: every tensor the offloaded layers save moves (Transformer Engine 2.5-2.9 "
                    "moves only what its modules flag, which leaves a MoE layer's router and permutation tensors on the "
                    "device), and one offloaded layer more than Transformer Engine 2.10 keeps is held at the peak; "
                    "the copies' HBM traffic is not priced in time (docs/memory.md)")
    if strategy.offload_modules:
        gaps.append("activation offload is priced from Megatron-Core's code (what each module saves, two layers kept on "
                    "the device, copies at 0.8 of the host link's rate), not yet checked against a measured run "
                    "(docs/time.md)")
    if model is not None:
        gaps += _inert_settings(strategy, options, model)
    if strategy.pp > 1 and strategy.schedule not in options.profile.schedules:
        gaps.append(f"the {options.runtime} runtime does not run the {strategy.schedule} schedule (it runs "
                    f"{', '.join(options.profile.schedules)}): priced as a what-if, which the search does not recommend")
    split = strategy.schedule in SPLIT_BACKWARD
    if options.runtime == "pytorch" and split and strategy.recompute == "selective":
        gaps.append("PyTorch cannot run this: selective activation checkpointing with a split backward "
                    "raises 'backward an extra time' in torch.distributed.pipelining (measured, torch 2.13)")
    if (options.runtime == "pytorch" and strategy.schedule == "zbv" and strategy.pp > 1
            and (strategy.zero == 3 or strategy.fsdp) and strategy.reshard_after_forward):
        gaps.append("torch.distributed.pipelining's ZB-V drops weight gradients under FSDP2 resharding after forward "
                    "(measured on its fake-tensor step, torch 2.13): a unit resharded when a micro-batch's "
                    "input-gradient step starts is not among the stage's parameters then, and that micro-batch's "
                    "weight gradients are never made (llama-3.1-8b, pp2, 4 micro-batches: one decoder layer of the "
                    "first stage got no gradient, the second stage's only from its last micro-batches). Such a "
                    "step holds less than this estimate, which prices whole gradients (its second stage: 7.57 GiB "
                    "measured, 10.17 estimated), and trains on wrong ones: run it with --no-reshard "
                    "(reshard_after_forward off), which the estimate matches within 1.6%")
    if options.runtime == "pytorch" and split and strategy.recompute == "full":
        gaps.append("with full recompute, torch.distributed.pipelining's weight-gradient step rebuilds each layer "
                    "once per parameter group and keeps the copies until later groups are done; the estimate "
                    "prices them from the layer's parameter groups and saved tensors, and 32 measured stages "
                    "of ZB-V and DualPipeV fall within -1.9...+2.2%, but new layer structures (module orders) "
                    "can break it: check yours with `ndplan verify` (docs/accuracy.md); the step time counts "
                    "those rebuilds too (a forward of the layer per parameter group, 9-15 per layer and "
                    "micro-batch), from FLOPs, not yet checked against a measured run")
    masks = options.attention == "sdpa" and "sdpa_masked" in options.profile.blocks
    sliding, layers = model.sliding_layers() if model is not None else (0, 0)
    if masks and model is not None and sliding and strategy.seq_length >= model.sliding_window:
        if sliding < layers and strategy.pp > 1:
            gaps.append("the SDPA mask of sliding-window layers is priced at the mean over the model's layers, not "
                        "per stage: a stage holding more than its share of sliding layers is under-estimated "
                        "(Qwen2.5-7B sliding from layer 14, pp2, 16k tokens, 4 micro-batches: its second stage by "
                        "about 4.8 GiB), one holding fewer over-estimated (under recompute, its checkpoints are "
                        "charged the boolean mask whether or not its layers slide)")
    if model is not None and options.runtime == "megatron":
        unmeasured = _unmeasured_megatron_parts(model)
        if unmeasured:
            gaps.append(f"Megatron-Core's {' and '.join(unmeasured)} are priced from its code, not yet checked against "
                        "a measured run (the pytorch runtime's are, by the census)")
    kv_heads = model.split_kv_heads if model is not None else None
    if kv_heads is not None and strategy.tp > kv_heads and options.profile.tp_above_kv_heads:
        gaps.append(f"tp={strategy.tp} is above the model's {kv_heads} KV heads: each rank gathers the QKV output "
                    "and keeps one KV head (Megatron-Core's attention.py), priced from its code, not yet checked "
                    "against a measured run")
    if (model is not None and options.runtime == "megatron" and model.attention_output_gate
            and model.linear_share() < 1.0 and kv_heads is not None and strategy.tp >= kv_heads):
        whole = "the gathered output, every head's" if strategy.tp > kv_heads else "the rank's whole output"
        gaps.append(f"with one query group a rank or less (tp={strategy.tp}, {kv_heads} KV heads) the attention "
                    f"output gate is a view of the fused QKV projection's output and may keep it alive ({whole}) "
                    "until the backward: not priced")
    if model is not None and model.has_linear_attention and strategy.pp > 1:
        uneven = _uneven_linear_stages(model, strategy)
        if uneven:
            gaps.append("Gated DeltaNet and softmax attention layers are priced at the model's mix on every layer "
                        f"({model.linear_layers()[0]} of {model.num_layers} Gated DeltaNet), not per stage: "
                        f"{uneven} (their parameters, activations and time differ; stages of whole groups of the "
                        "model's pattern are exact)")
    # (the figures of docs/accuracy_time.md's two-sided memory table, whose band
    # tests/test_perf_calibrate.py pins: a change that moves them must move these words too)
    free = headroom(strategy, options, model)
    if free == FSDP_HEADROOM:
        gaps.append("for torchtitan's published FSDP runs (8B to 405B with TP, PP and CP, 8 to 512 H100s and 64 "
                    "H200s) this model estimates 5-17% less than their measured peak reserved memory, median 11% (the "
                    "measured peak is up to 1.20x the estimate; docs/accuracy_time.md: for the 8B and 70B rows the "
                    "caching allocator's fragmentation, which a fixed slack does not follow): leave 30% of the device "
                    "free, or measure one "
                    "step on fake tensors (`ndplan verify`, on a CPU: its allocator replay counts the fragmentation)")
    if free == BALANCED_MOE_HEADROOM:
        gaps.append("against Megatron-LM's own MoE tests the estimate reads 1.6-5.6% low (the routing of a real run "
                    "loads some experts more; docs/accuracy_megatron.md): treat a plan within ~6% of the limit as "
                    "unverified, or price uneven routing with --moe-imbalance")
    return gaps


def _unmeasured_megatron_parts(model: ModelSpec) -> list[str]:
    """What the megatron profile prices of this model from Megatron-Core's code alone (its
    functional tests measure none of it)."""
    parts = []
    if model.has_linear_attention:
        parts.append("Gated DeltaNet layers (what gated_delta_net.py, fla's l2norm and chunked delta rule and "
                     "causal-conv1d keep)")
    if model.attention_output_gate and model.linear_share() < 1.0:
        parts.append("attention output gate (attention.py)")
    if model.is_moe and model.num_shared_experts and model.shared_expert_gate:
        parts.append("shared-expert gate (moe/shared_experts.py)")
    return parts


def _inert_settings(strategy: Strategy, options: MemoryOptions, model: ModelSpec) -> list[str]:
    """Settings given that change nothing for this model and strategy (said, since a user who
    set them expects them priced)."""
    out = []
    moved_nothing = [m for m in strategy.offload_modules if m not in applicable_offload_modules(model)]
    if moved_nothing:
        out.append(f"offload modules {' '.join(moved_nothing)} move nothing in {model.name}: "
                   + "; ".join(dict.fromkeys(_IDLE_REASONS[m] for m in moved_nothing)))
    idle = [m for m in strategy.recompute_modules if m not in applicable_modules(model)]
    if idle and strategy.recompute == "selective":
        out.append(f"recompute modules {' '.join(idle)} re-run nothing in {model.name} (its layers have no such "
                   f"module: {', '.join(applicable_modules(model))} apply)")
    if options.moe_imbalance != 1.0 and not model.is_moe:
        out.append(f"a MoE imbalance of {options.moe_imbalance:g} (--moe-imbalance, or the efficiency profile's) "
                   f"changes nothing: {model.name} has no experts")
    if options.moe_capacity_factor is not None and not model.is_moe:
        out.append(f"a capacity factor of {options.moe_capacity_factor:g} (--moe-capacity-factor) changes nothing: "
                   f"{model.name} has no experts")
    if not strategy.reshard_after_forward and not (strategy.zero == 3 or strategy.fsdp):
        out.append("reshard_after_forward off (--no-reshard) changes nothing without FSDP/ZeRO-3 sharded parameters")
    return out


_IDLE_REASONS = {
    "attn_norm": "its attention norm is fused into the QKV linear (offload qkv_linear instead)",
    "mlp_norm": "a dense MLP's norm is fused into its first linear, and it has no MoE layer",
    "expert_fc1": "it has no routed experts",
    "moe_act": "it has no routed experts",
}


def _chunk_reports(model: ModelSpec, strategy: Strategy, options: MemoryOptions, placement: Placement) -> list[ChunkReport]:
    """Per virtual stage: layer counts, the layers' static bytes, activations per micro-batch
    (same formulas as ``stage_memory``), and the schedule's peak count of held micro-batches."""
    batch = StrategyBatch.of(strategy)
    acts = layer_activations(model, batch, options)
    elements = layer_elements(model, batch.tp.astype(float), batch.ep.astype(float), batch.etp.astype(float))
    shards = sharding_factors(batch.dp, batch.cp, batch.tp, batch.ep, batch.etp, batch.zero, batch.shard_group)
    p = strategy.precision
    optimizer = float(optimizer_on_device(strategy.optimizer_offload, strategy.optimizer_offload_fraction)) * p.optimizer_bytes
    linear = linear_weight_elements(model, batch.tp.astype(float), batch.ep.astype(float), batch.etp.astype(float))
    cache_width = fp8_weight_cache_width(options.profile, p, batch.zero)
    buckets = ddp_bucket_width(options.profile, p.grad_bytes, batch.zero, batch.dp, batch.cp)
    # (the experts AutoModel leaves out of FSDP keep their gradients at the parameters' width)
    outside = experts_out_of_fsdp(options.experts_outside_fsdp, strategy.zero, shards.expert_data_shards)
    expert_grad = np.where(outside, p.param_bytes, p.grad_bytes)

    def layer_static(kind: MlpKind) -> float:
        non_expert = elements.non_expert[kind] * (p.param_bytes / shards.params + p.grad_bytes / shards.grads
                                                  + optimizer / shards.optimizer)
        expert = elements.expert[kind] * (p.param_bytes / shards.expert_params + expert_grad / shards.expert_grads
                                          + optimizer / shards.expert_optimizer)
        buffers = (elements.non_expert[kind] + elements.expert[kind]) * buckets
        return float((non_expert + expert + sum(linear[kind].values()) * cache_width + buffers)[0])

    tokens = strategy.micro_batch_size * strategy.seq_length / strategy.cp
    # A chunk keeps t · Σ_kinds (plain layers · full bytes + recomputed layers · kept bytes) per
    # micro-batch, as stage_memory holds it: under recompute_layers = N only each chunk's first N
    # layers are recomputed (``recomputed_layers``, the one definition of which), the rest keep
    # every activation.
    plain_dense, plain_moe, recomputed_dense, recomputed_moe = (counts[0] for counts in recomputed_layers(
        ~batch.is_("recompute", "none"), batch.recompute_layers, placement.dense_layers, placement.moe_layers))
    full = {k: float(acts.full[k][0]) for k in ("dense", "moe")}
    kept = {k: float(acts.recomputed[k][0]) for k in ("dense", "moe")}
    per_chunk = tokens * (plain_dense * full["dense"] + plain_moe * full["moe"]
                          + recomputed_dense * kept["dense"] + recomputed_moe * kept["moe"])
    # Layer offload (no pipeline: one chunk): its first layers' activations, all of them, move;
    # all but one of those layers' are off the device at the peak (memory.layer_offload).
    away_dense, away_moe = (float(v[0]) for v in held_away(model, batch.offload_layers))
    per_chunk = per_chunk - tokens * np.array([away_dense * full["dense"] + away_moe * full["moe"]]
                                              + [0.0] * (len(per_chunk) - 1))
    moved = offloaded_per_micro_batch(model, batch, acts, placement)[0]
    flight = in_flight(strategy.schedule, strategy.pp, strategy.vpp, strategy.num_micro_batches, strategy.seq_chunks)
    out = []
    for v in range(placement.num_virtual_stages):
        dense, moe = int(placement.dense_layers[v]), int(placement.moe_layers[v])
        stage, chunk = int(placement.stage_of[v]), int(placement.chunk_of[v])
        out.append(ChunkReport(
            chunk=chunk, model_chunk=v, dense_layers=dense, moe_layers=moe,
            layer_static_bytes=dense * layer_static("dense") + moe * layer_static("moe"),
            activation_bytes_per_micro_batch=float(per_chunk[v]),
            peak_in_flight=float(flight.peak[stage, chunk]),
            offloaded_bytes_per_micro_batch=float(moved[v]),
        ))
    return out
