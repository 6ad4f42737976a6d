"""Measure the memory of one whole training step with PyTorch itself, without using any memory.

``measure_step`` builds a depth-trimmed model with the real transformers modeling code on CPU
under ``FakeTensorMode`` (tensors have shapes, dtypes and storages but no data), parallelizes it
the way PyTorch-native trainers do (FSDP2 ``fully_shard``, DTensor tensor parallelism,
``torch.distributed.pipelining`` schedules) on a fake process group of the requested world size,
and runs one complete step (forward, backward, AdamW step) of one rank per pipeline stage under
``torch.distributed._tools`` ``MemTracker`` / ``FSDPMemTracker``, which see every tensor
storage the step creates and free. The result, per measured rank: the peak of live tensor bytes
and what it is made of (parameters, gradients, optimizer states, activations, communication
buffers, temporaries).

What is measured and what is not (docs/accuracy.md says it at length):

* measured: every tensor storage PyTorch allocates on the rank, at the moment it is allocated
  and freed, by the real modeling, FSDP2, DTensor, pipelining and optimizer code; so the peak is
  what ``torch.cuda.max_memory_allocated`` would report, up to the caching allocator's rounding
  of each block to 512 bytes (the fake device is the CPU: exact bytes are counted).
* not seen: the CUDA context, NCCL's buffers, workspaces CUDA kernels take besides their
  outputs (cuBLAS, flash-attention backward's fp32 accumulator: a fake kernel allocates only its
  outputs), and anything allocated outside PyTorch's allocator. ``ndplan verify`` therefore
  compares the estimator's *allocated* figures (``MemoryOptions(include_overhead=False)``) with
  this measurement.
* replayed, not measured: the caching allocator's reserved segments. Every allocation and free
  the tracker sees goes through ``ndplan.census.allocator`` (a pool per stream: the compute
  stream's and FSDP2's all-gather and reduce-scatter streams', torch.cpu's stand-ins), with cuBLAS's
  workspace at the first GEMM and CUDA softmax's backward product where it runs:
  ``RankMemory.replayed_reserved_bytes``, within -1.5% to +2.9% of ``max_memory_reserved`` in
  28 one-GPU steps on an H200 (docs/accuracy_cuda.md). The replay starts from the tracked
  step's own state (parameters and optimizer states laid out as the tracker first sees them),
  not from a real run's history of building and warm-up steps.
* the other ranks of the fake group do not exist: collectives and point-to-point transfers
  complete at once, so the measurement shows one rank's memory with perfect overlap (no
  communication kept waiting by a slow peer). Every dp and tp rank of a stage holds the same
  shapes; one rank per pipeline stage is measured.

The step measured is a steady-state step: optimizer states already exist (a warm-up step
creates them before tracking starts), gradients start as ``None`` and end as ``None``
(``zero_grad(set_to_none=True)``).

torch and transformers are imported lazily: this module works without them, and its result
type and JSON format (``ndplan.census.measurement``) need neither (``ndplan verify --measured``
reads files measured elsewhere).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from ndplan.census.allocator import CachingAllocator
from ndplan.census.measurement import CATEGORIES, FAKE_SOURCE, RankMemory, StepMeasurement
from ndplan.errors import NdplanError
from ndplan.strategy import Strategy

#: Precision policies a PyTorch eager step can run as: bf16 weights/grads/AdamW states
#: (``bf16-pure``), everything fp32 (``fp32``), or FSDP2 mixed precision with fp32 sharded
#: weights, bf16 compute and fp32 gradient reduction (``fsdp-bf16``, needs FSDP).
MEASURABLE_PRECISIONS = ("bf16-pure", "fp32", "fsdp-bf16")

#: ndplan schedule name -> torch.distributed.pipelining schedule class.
SCHEDULE_CLASSES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}

#: Tracker reference types (``_MemRefType`` / ``_FSDPRefType`` values) -> category.
_REFTYPE_CATEGORY = {
    "Parameter": "params",
    "Buffer": "params",
    "Sharded Param": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Other": "activations",
    "Unsharded Param": "comm",
    "Unsharded Grad": "comm",
    "All Gather": "comm",
    "Reduce Scatter": "comm",
    "Temp": "transient",
}


# --------------------------------------------------------------------------------------------------
# what can be measured


def check_measurable(strategy: Strategy, num_layers: int, hf_config: dict[str, Any] | None = None) -> None:
    """Refuse, in one line each, what this measurement does not implement."""
    s = strategy
    problems: list[str] = []
    if s.precision.name not in MEASURABLE_PRECISIONS:
        problems.append(
            f"precision {s.precision.name!r} is not a PyTorch eager recipe; measure one of "
            f"{', '.join(MEASURABLE_PRECISIONS)} (--precision)"
        )
    if s.precision.name == "fsdp-bf16" and s.zero != 3:
        problems.append("precision 'fsdp-bf16' is FSDP2 mixed precision: it needs --fsdp")
    if s.zero not in (0, 3):
        problems.append(f"zero={s.zero}: only FSDP2 (zero 3, --fsdp) or no sharding (zero 0) is measured")
    if s.dp > 1 and s.zero != 3:
        problems.append("dp > 1 without FSDP (DDP) is not measured: give --fsdp")
    if s.cp > 1:
        problems.append("context parallelism is not measured")
    if s.ep > 1:
        problems.append("expert parallelism is not measured")
    if s.sequence_parallel and s.tp == 1:
        problems.append("sequence parallelism shards over tensor-parallel ranks: give --tp > 1")
    if s.optimizer_offload:
        problems.append("optimizer offload is not measured")
    if s.shard_group:
        problems.append("HSDP (shard_group) is not measured")
    if s.pp > 1 and s.num_micro_batches < s.pp:
        # torch.distributed.pipelining's schedules refuse it (at the first stage, mid-run).
        problems.append(f"pp={s.pp} runs at least one micro-batch per stage: give --num-micro-batches >= {s.pp} "
                        f"(got {s.num_micro_batches})")
    if s.pipeline_runs > 1 and s.pp == 1:
        problems.append(f"pipeline_runs={s.pipeline_runs} needs a pipeline (pp > 1); without one give "
                        f"num_micro_batches={s.micro_batches_per_step}")
    if s.recompute_layers:
        problems.append("recompute_layers is not measured (recompute applies to every layer)")
    if s.embedding_as_layer or s.output_as_layer:
        problems.append("embedding_as_layer/output_as_layer placements are not measured")
    if s.pp > 1 and s.schedule not in SCHEDULE_CLASSES:
        problems.append(
            f"schedule {s.schedule!r} has no torch.distributed.pipelining counterpart here; measured: "
            f"{', '.join(SCHEDULE_CLASSES)}"
        )
    if s.pp * s.vpp > num_layers:
        problems.append(f"pp·vpp = {s.pp * s.vpp} virtual stages need at least that many layers, got --layers {num_layers}")
    if s.stage_layers is not None and sum(s.stage_layers) != num_layers:
        problems.append(f"stage_layers {s.stage_layers} do not add up to {num_layers} layers")
    if hf_config is not None and s.tp > 1 and _is_moe_config(hf_config):
        problems.append("tensor parallelism of MoE experts is not measured (dense models only with --tp)")
    if problems:
        raise NdplanError("measure: " + "; ".join(problems))


def _is_moe_config(cfg: dict[str, Any]) -> bool:
    return any(cfg.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"))


def trimmed_hf_config(hf_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The config with ``num_hidden_layers = num_layers`` and per-layer lists cut to match.

    Layer kinds are kept as the full model has them for its first ``num_layers`` layers (e.g.
    DeepSeek-V3's first three dense layers). Multi-token prediction is not part of the
    transformers model, so it is dropped (``num_nextn_predict_layers = 0``).
    """
    if not isinstance(num_layers, int) or num_layers < 1:
        raise NdplanError(f"measure: --layers must be a positive integer, got {num_layers!r}")
    full = hf_config.get("num_hidden_layers")
    if isinstance(full, int) and num_layers > full:
        raise NdplanError(f"measure: --layers {num_layers} exceeds the model's {full} layers")
    cfg = dict(hf_config)
    cfg["num_hidden_layers"] = num_layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    if isinstance(cfg.get("mlp_only_layers"), list):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < num_layers]
    if cfg.get("num_nextn_predict_layers"):
        cfg["num_nextn_predict_layers"] = 0
    return cfg


def trimmed_spec(spec: Any, num_layers: int) -> Any:
    """The ModelSpec of the depth-trimmed model the measurement runs (no MTP: transformers has none)."""
    if num_layers > spec.num_layers:
        raise NdplanError(f"measure: --layers {num_layers} exceeds the model's {spec.num_layers} layers")
    return spec.model_copy(update={
        "num_layers": num_layers,
        "layer_mlp_kinds": tuple(spec.layer_mlp_kinds[:num_layers]),
        "layer_attention_spans": tuple(spec.layer_attention_spans[:num_layers]),
        "mtp_depth": 0,
    })


def virtual_stage_layers(strategy: Strategy, num_layers: int) -> tuple[int, ...]:
    """Decoder layers per virtual stage, as the estimator places them (``ndplan.placement``)."""
    if strategy.stage_layers is not None:
        return tuple(strategy.stage_layers)
    from ndplan.placement import uniform_layer_counts

    return uniform_layer_counts(num_layers, strategy.pp * strategy.vpp)


def stage_to_rank(strategy: Strategy) -> dict[int, int]:
    """Virtual stage -> pipeline rank, as torch.distributed.pipelining assigns them (loop or V)."""
    n = strategy.pp * strategy.vpp
    if strategy.pp == 1:
        return {v: 0 for v in range(n)}
    mapping: dict[int, int] = {}
    if strategy.schedule in ("zbv", "dualpipev"):
        rank = 0
        for v in range(n):
            mapping[v] = rank
            if (v + 1) % strategy.pp == 0:
                continue
            rank += 1 if (v // strategy.pp) % 2 == 0 else -1
    else:
        for v in range(n):
            mapping[v] = v % strategy.pp
    return mapping


# --------------------------------------------------------------------------------------------------
# the measurement


def checked_step_config(hf_config: dict[str, Any], strategy: Strategy, num_layers: int, attention: str,
                        experts: str) -> dict[str, Any]:
    """The config trimmed to ``num_layers``, once the inputs of a measured step are checked."""
    from ndplan.census.measure import ATTENTIONS, EXPERTS

    if not isinstance(hf_config, dict):
        raise NdplanError("measure: hf_config must be a dict (a Hugging Face config.json)")
    if attention not in ATTENTIONS:
        raise NdplanError(f"measure: attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if experts not in EXPERTS:
        raise NdplanError(f"measure: experts must be one of {', '.join(EXPERTS)}, got {experts!r}")
    cfg = trimmed_hf_config(hf_config, num_layers)
    check_measurable(strategy, num_layers, cfg)
    return cfg


def step_model_name(hf_config: dict[str, Any], name: str | None) -> str:
    return str(name or hf_config.get("name") or hf_config.get("_name_or_path") or hf_config.get("model_type"))


def measure_step(
    hf_config: dict[str, Any],
    strategy: Strategy,
    *,
    num_layers: int,
    attention: str = "sdpa",
    experts: str = "grouped_mm",
    name: str | None = None,
    stages: Sequence[int] | None = None,
    timeline: bool = False,
    selective_policy: str | None = None,
    loss_parallel: bool = False,
) -> StepMeasurement:
    """Measure one training step of ``hf_config`` trimmed to ``num_layers`` decoder layers under
    ``strategy``: one rank per pipeline stage (all stages, or those in ``stages``). With
    ``timeline``, each rank also records what was live as the step went (``RankMemory.timeline``).
    ``selective_policy`` (with selective recompute): what each layer keeps, ``keep-matmuls``
    (the default: every matmul's and the attention kernel's outputs) or ``torchtitan-op``
    (torchtitan's per-op policy: every second matmul's and the attention kernel's). With
    ``loss_parallel`` (tensor parallelism) the LM head's logits stay sharded over the vocabulary
    and the loss runs on them under ``torch.distributed.tensor.parallel.loss_parallel``, as
    torchtitan trains with TP."""
    from ndplan.census.measure import _require_torch

    if loss_parallel and strategy.tp == 1:
        raise NdplanError("measure: loss parallelism shards the logits over tensor-parallel ranks: give --tp > 1")

    check_selective_policy(strategy, selective_policy)
    cfg = checked_step_config(hf_config, strategy, num_layers, attention, experts)
    wanted = sorted(set(stages)) if stages is not None else list(range(strategy.pp))
    if not wanted or any(not 0 <= s < strategy.pp for s in wanted):
        raise NdplanError(f"measure: stages must be in 0..{strategy.pp - 1}, got {list(stages or [])}")
    torch, transformers = _require_torch()
    t0 = time.perf_counter()
    model_name = step_model_name(hf_config, name)
    notes: list[str] = []
    ranks = []
    for stage in wanted:
        ranks.append(_measure_rank(cfg, strategy, stage, attention=attention, experts=experts, notes=notes,
                                   timeline=timeline, selective_policy=selective_policy,
                                   loss_parallel=loss_parallel))
    elapsed = time.perf_counter() - t0
    notes.append(f"measurement took {elapsed:.1f} s")
    return StepMeasurement(
        model=model_name,
        strategy=strategy,
        ranks=tuple(ranks),
        num_layers=num_layers,
        attention=attention,
        source=FAKE_SOURCE,
        notes=tuple(dict.fromkeys(notes)),
        provenance={
            "experts": experts,
            "device": "cpu (fake tensors: exact bytes, no 512-byte block rounding)",
            "torch_version": str(torch.__version__),
            "transformers_version": str(transformers.__version__),
            **({"selective_policy": selective_policy} if selective_policy else {}),
            **({"loss_parallel": True} if loss_parallel else {}),
        },
    )


#: What a measured step's selective recompute can keep (``measure_step``'s ``selective_policy``).
SELECTIVE_POLICIES = ("keep-matmuls", "torchtitan-op")


def check_selective_policy(strategy: Strategy, policy: str | None) -> None:
    """A policy is one of ``SELECTIVE_POLICIES`` and comes with selective recompute."""
    if policy is None:
        return
    if policy not in SELECTIVE_POLICIES:
        raise NdplanError(f"measure: selective policy must be one of {', '.join(SELECTIVE_POLICIES)}, got {policy!r}")
    if strategy.recompute != "selective":
        raise NdplanError(f"measure: a selective policy ({policy}) goes with --recompute selective, "
                          f"not {strategy.recompute}")


# ---- torch side: everything below imports torch lazily ---------------------------------------------

_SUSPEND = [0]  # > 0 while DTensor computes output metadata (not memory the step allocates)


@contextlib.contextmanager
def _patched(E: Any, notes: list[str]) -> Iterator[None]:
    """Patches a fake single-process step needs; each is undone on exit.

    * transformers checks ``position_ids`` for packed sequences by reading their values; fake
      tensors have none, so it would build a full ``[b, 1, s, s]`` mask. The step feeds one
      unpacked sequence per row (``arange`` positions), for which the check answers "not packed":
      that answer is given directly.
    * DeviceMesh keeps its rank layout in small integer tensors: those are built outside the fake
      mode (they are bookkeeping, not model memory).
    * DTensor propagates output shapes by running each op on global-shape fake tensors in the
      active fake mode; the tracker must not count those (``_SUSPEND``).
    * torch.distributed.pipelining's warm-up "vote" reads a received integer with ``.item()``;
      the stages here are given static shapes, so the vote's answer (static) is set directly.
    * MLA attention runs the memory-efficient SDPA kernel a GPU would (``gpu_sdpa_kernels``).
    """
    import transformers.masking_utils as masking
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import schedules as pp_schedules
    from torch.distributed.pipelining.stage import InferenceMode
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, value: Any) -> None:
        saved.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)))
        setattr(owner, attr, value)

    patch(masking, "find_packed_sequence_indices", lambda position_ids: None)

    mesh_init = DeviceMesh.__init__
    mesh_prop = DeviceMesh.__dict__["mesh"]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    def mesh(self: Any) -> Any:
        with unset_fake_temporarily():
            return mesh_prop.fget(self)

    patch(DeviceMesh, "__init__", init)
    patch(DeviceMesh, "mesh", property(mesh))

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate_untracked(self: Any, op_schema: Any) -> Any:
        _SUSPEND[0] += 1
        try:
            return propagate(self, op_schema)
        finally:
            _SUSPEND[0] -= 1

    patch(ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate_untracked)

    def warmup(self: Any, stages: Any, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    patch(pp_schedules._PipelineSchedule, "_warmup_p2p", warmup)

    emulated: list[str] = []
    try:
        with E.gpu_kernels(emulated), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
        notes.extend(dict.fromkeys(emulated))


def _reset_dtensor_caches() -> None:
    """DTensor caches sharding decisions and redistribution plans keyed by meshes; a mesh of the
    next measured rank can hash like one of the last (same shape and names) while its process
    groups are new. Start every rank with empty caches."""
    import torch
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    prop = DTensor._op_dispatcher.sharding_propagator
    for cached in (prop.propagate_op_sharding, type(prop)._propagate_tensor_meta_cached,
                   _redistribute._gen_transform_infos, _collective_utils.MeshTopoInfo.build_from_mesh):
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
    _redistribute.clear_redistribute_planner_cache()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ dispatch fast path's cache
        clear_native()


def _tracker_class(fsdp: bool) -> Any:
    """MemTracker (or FSDPMemTracker) that also records per-phase peaks and category maxima,
    ignores DTensor's shape propagation, and accepts a root module called once per micro-batch."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from ndplan.memory.profile import get_profile

    base: Any = FSDPMemTracker if fsdp else MemTracker
    aten = torch.ops.aten
    gemms = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm}
    # What a real step's allocator holds beside the tensors: the pytorch profile's measured figure.
    workspace_bytes = int(get_profile("pytorch").overhead.get("workspace_bytes", 0))

    class StepTracker(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any) -> None:
            # The caching allocator's segments, replayed from every allocation and free the tracker
            # sees (ndplan.census.allocator); the math libraries' workspace joins at the first GEMM.
            self.allocator = CachingAllocator()
            self.allocation_keys = itertools.count()
            self.workspace_allocated = False
            # Streams by number, the compute stream 0: FSDP2 makes its collectives' buffers on
            # streams of its own (torch.cpu's stand-ins here), and the allocator keeps a pool for each.
            self.streams: dict[int, int] = {id(torch.cpu.current_stream()): 0}
            # Every allocation (key, bytes, the op that made it) and free (key, 0, ""), in order:
            # what was live at the peak, by op (``peak_blocks``).
            self.events: list[tuple[int, int, str]] = []
            self.current_op = ""
            self.phase = "setup"
            self.phase_start: dict[str, dict[str, int]] = {}
            self.phase_peak: dict[str, tuple[int, dict[str, int]]] = {}
            self.phase_max: dict[str, dict[str, int]] = {}
            self.held_max: dict[str, int] = {}
            self.in_backward = False
            self.timeline: list[tuple[str, bool, dict[str, int]]] | None = None
            super().__init__(*args)
            self._mod_tracker._fw_pre_hook = functools.partial(_fw_pre_hook, self._mod_tracker)
            self._mod_tracker._fw_post_hook = functools.partial(_fw_post_hook, self._mod_tracker)

        def current(self) -> dict[str, int]:
            snap: dict[str, int] = {}
            for dev_snap in self._curr_mem_snap.values():
                for key, value in dev_snap.items():
                    name = key.value if hasattr(key, "value") else str(key)
                    snap[name] = snap.get(name, 0) + int(value)
            snap.setdefault("Total", 0)
            return snap

        def begin(self, phase: str) -> None:
            self.phase = phase
            self.phase_start[phase] = self.current()
            self.note()

        def note(self) -> None:
            snap = self.current()
            total = snap["Total"]
            best = self.phase_peak.get(self.phase)
            if best is None or total > best[0]:
                self.phase_peak[self.phase] = (total, snap)
            maxima = self.phase_max.setdefault(self.phase, {})
            split = categorize(snap)
            for category, value in split.items():
                if value > maxima.get(category, -1):
                    maxima[category] = value
            if self.timeline is not None:
                # Every move of 1 MiB or more, and every new peak of the phase (so the timeline's
                # maximum is the measured peak).
                last = self.timeline[-1] if self.timeline else None
                new_peak = best is None or total > best[0]
                if last is None or last[0] != self.phase or new_peak or abs(last[2]["total"] - total) >= 1 << 20:
                    self.timeline.append((self.phase, self.in_backward, {**split, "total": total}))

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            self.note()

        def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
            super()._update_snap(u_type, winfo, *args, **kwargs)
            if u_type.name in ("ADD", "DEL", "SIZE"):
                self._replay(winfo, u_type.name == "DEL")
            self.note()

        def _replay(self, winfo: Any, freed: bool) -> None:
            """A storage allocated, freed or resized (FSDP's ``resize_``: a free and a new
            allocation), as the caching allocator is asked."""
            key = getattr(winfo, "ndplan_allocation", None)
            if key is not None and self.allocator.live(key):
                self.allocator.free(key)
                self.events.append((key, 0, ""))
            if not freed and winfo.mem_consumed > 0:
                winfo.ndplan_allocation = next(self.allocation_keys)
                stream = self.streams.setdefault(id(torch.cpu.current_stream()), len(self.streams))
                self.allocator.malloc(winfo.ndplan_allocation, winfo.mem_consumed, stream)
                # (outside an op: what the tracker registered, named by its kind)
                kind = str(getattr(winfo.reftype, "name", winfo.reftype)).lower()
                label = self.current_op or _STATE_KINDS.get(kind, kind)
                self.events.append((winfo.ndplan_allocation, winfo.mem_consumed, label))

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if _SUSPEND[0]:
                return func(*args, **(kwargs or {}))
            backward = torch._C._current_graph_task_id() != -1
            if backward and not self.in_backward:
                # A backward begins: what forward left alive is what the step holds for backward.
                held = categorize(self.current())["activations"]
                self.held_max[self.phase] = max(self.held_max.get(self.phase, 0), held)
            self.in_backward = backward
            if not self.workspace_allocated and func.overloadpacket in gemms and workspace_bytes:
                self.workspace_allocated = True  # cuBLAS's and cuBLASLt's, kept from the first GEMM on
                self.allocator.malloc("workspace", workspace_bytes)
            outer_op = self.current_op
            self.current_op = str(func.overloadpacket).split(".")[-1] + (" (backward)" if backward else "")
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.current_op = outer_op
            if func.overloadpacket is aten._softmax_backward_data:
                # CUDA's softmax backward keeps a product of its output's size in fp32 beside the
                # output while it runs (docs/accuracy_cuda.md); a fake kernel does not allocate it.
                self.allocator.malloc("softmax product", 4 * out.numel())
                self.allocator.free("softmax product")
            return out

        # A root module called again in forward (next micro-batch) starts its module stats afresh
        # instead of raising "multiple iterative calls": only the global totals are used here.
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                self.memory_tracking.pop(module)
            super()._pre_fw_hook(module, inputs)

        def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw:
                    self.memory_tracking.pop(fsdp_mod)
                return inner(*args, **kwargs)

            return wrapper

    return StepTracker


def _fw_pre_hook(tracker: Any, mod: Any, inputs: Any) -> None:
    """``ModTracker._fw_pre_hook`` without its gradient hooks.

    ModTracker marks each module's backward with multi-grad hooks on its inputs and outputs. Those
    hooks hold the autograd nodes, and a node holds its saved tensors while the graph is retained:
    under the zero-bubble schedules' split backward (input gradients with ``retain_graph``, weight
    gradients later) they kept activations alive that the real step frees, and a multi-grad hook
    on a leaf input cannot run inside ``torch.autograd.grad`` at all. Only the module names of
    backward depend on them (per-module snapshots, unused here); forward bookkeeping, the
    recompute (activation-checkpoint) detection and every memory total do not.
    """
    import weakref

    name = tracker._get_mod_name(mod)
    tracker._get_append_fn(weakref.ref(mod), name, False)()
    if tracker._user_pre_fw_hook is not None:
        tracker._user_pre_fw_hook(mod, inputs)


def _fw_post_hook(tracker: Any, mod: Any, inputs: Any, outputs: Any) -> None:
    """``ModTracker._fw_post_hook`` without its gradient hooks (see ``_fw_pre_hook``)."""
    import weakref

    name = tracker._get_mod_name(mod)
    if tracker._user_post_fw_hook is not None:
        tracker._user_post_fw_hook(mod, inputs, outputs)
    tracker._get_pop_fn(weakref.ref(mod), name, False)()


def categorize(snapshot: dict[str, int]) -> dict[str, int]:
    """Tracker reference types -> the estimator's categories (optimizer_step is derived apart)."""
    out = dict.fromkeys(CATEGORIES[:-1], 0)
    for key, value in snapshot.items():
        category = _REFTYPE_CATEGORY.get(key)
        if category is not None:
            out[category] += int(value)
    return out


def _param_dtype(torch: Any, strategy: Strategy) -> Any:
    return torch.float32 if strategy.precision.name in ("fp32", "fsdp-bf16") else torch.bfloat16


def _build_model(E: Any, torch: Any, cfg: dict[str, Any], attention: str, experts: str, dtype: Any,
                 keep: set[str] | None) -> Any:
    """The trimmed causal-LM on the meta device; the modules named in ``keep`` (all if None) get fake
    CPU parameters in ``dtype`` (those transformers keeps in fp32 stay fp32)."""
    config = E.make_config(cfg, attention=attention, experts=experts)
    model = E.build_meta_model(config)
    fp32 = E.keep_fp32_patterns(model, dtype)
    for mod_name, module in model.named_modules():
        if keep is None and mod_name == "":
            E.materialize(module, dtype, "", fp32)
            break
        if keep is not None and mod_name in keep:
            E.materialize(module, dtype, mod_name, fp32)
    # A pipeline stage that holds only one end of a tied pair keeps its own copy (the other end's
    # table is not materialised here, and tying to it would hand the head a meta tensor).
    both_ends = keep is None or {"model.embed_tokens", "lm_head"} <= keep
    if getattr(config, "tie_word_embeddings", False) and both_ends:
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out_emb is not None and in_emb is not None:
            out_emb.weight = in_emb.weight
    model.train()
    return model


def _layers(model: Any) -> Any:
    return model.model.layers


def _tp_plan(model: Any, layer_ids: Sequence[int], first: bool, last: bool, sp: bool = False,
             loss_parallel: bool = False) -> dict[str, Any]:
    """torchtitan's Llama plan on transformers module names: column-parallel q/k/v, gate/up;
    row-parallel o/down; vocabulary-parallel embedding and LM head, whose logits are gathered
    whole unless ``loss_parallel``. With ``sp`` (sequence parallelism) the residual stream stays
    sharded over the sequence between the blocks: the norms run on their shard, each block's input
    is all-gathered and o/down reduce-scatter their output back to sequence shards. With
    ``loss_parallel`` the logits stay sharded over the vocabulary (a DTensor the loss takes)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    stream = Shard(1) if sp else Replicate()  # the residual stream's layout between the blocks
    plan: dict[str, Any] = {}
    if first:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if last:
        if sp:
            plan["model.norm"] = SequenceParallel()
        plan["lm_head"] = (ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
                           if loss_parallel else
                           ColwiseParallel(input_layouts=stream, output_layouts=Replicate(), use_local_output=True))
    for i in layer_ids:
        layer = _layers(model)[i]
        for sub, style in (("self_attn.q_proj", "col"), ("self_attn.k_proj", "col"), ("self_attn.v_proj", "col"),
                           ("self_attn.o_proj", "row"), ("mlp.gate_proj", "col"), ("mlp.up_proj", "col"),
                           ("mlp.down_proj", "row")):
            if layer.get_submodule(sub) is None:  # pragma: no cover - get_submodule raises
                continue
            plan[f"model.layers.{i}.{sub}"] = ColwiseParallel() if style == "col" else RowwiseParallel(
                output_layouts=stream)
        if sp:
            plan[f"model.layers.{i}.input_layernorm"] = SequenceParallel()
            plan[f"model.layers.{i}.post_attention_layernorm"] = SequenceParallel()
            plan[f"model.layers.{i}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True)
            plan[f"model.layers.{i}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    return plan


def _check_tp_modules(model: Any, layer_ids: Sequence[int]) -> None:
    for i in layer_ids:
        names = {n for n, _ in _layers(model)[i].named_modules()}
        missing = [n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") if n not in names]
        if missing:
            raise NdplanError(f"measure: tensor parallelism needs llama-style modules; layer {i} lacks {', '.join(missing)}")
        attention = _layers(model)[i].self_attn
        for norm, projection in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
            weight = getattr(getattr(attention, norm, None), "weight", None)
            width = getattr(attention, projection).out_features
            if weight is not None and weight.numel() == width != getattr(attention, "head_dim", width):
                # a norm over the whole projection needs its statistic over every TP rank's heads,
                # which no tensor-parallel plan for these modules computes
                raise NdplanError(f"measure: tensor parallelism of q/k norms over the whole projection (layer {i}'s "
                                  f"{norm}, {weight.numel()} wide) is not measured; measure with --tp 1")


def _wrap_recompute(model: Any, layer_ids: Sequence[int], policy: str, E: Any,
                    selective_policy: str | None = None) -> None:
    """Full: ``checkpoint_wrapper`` around each decoder layer (non-reentrant). Selective: the same
    with the census's selective policy (keep matmul and attention outputs, recompute the rest), or
    torchtitan's per-op one (``selective_policy`` 'torchtitan-op')."""
    if policy == "none":
        return
    import functools

    import torch.utils.checkpoint as tc
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    kwargs: dict[str, Any] = {"preserve_rng_state": False}
    if policy == "selective" and selective_policy == "torchtitan-op":
        kwargs["context_fn"] = E._op_sac_contexts  # a fresh policy per call: its matmul count restarts
    elif policy == "selective":
        kwargs["context_fn"] = functools.partial(tc.create_selective_checkpoint_contexts, E._selective_policy)
    layers = _layers(model)
    for i in layer_ids:
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)


def _fully_shard(torch: Any, strategy: Strategy, mesh: Any, root: Any, embed: Any, layers: Sequence[Any],
                 head: Sequence[Any], tied: bool) -> None:
    """FSDP2 as torchtitan applies it: the embedding, each decoder layer, and [final norm, LM head]
    are their own groups ([norm, head] not resharded after forward: backward needs them at once),
    then the root. A tied embedding/head pair is one group with the final norm, [embedding, norm,
    head], not resharded after forward (torchtitan and accelerate group them so; PyTorch refuses a
    shared parameter in two groups)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if strategy.precision.name == "fsdp-bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = strategy.reshard_after_forward
    if embed is not None and not tied:
        fully_shard(embed, reshard_after_forward=reshard, **kwargs)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    if head:
        fully_shard([embed, *head] if tied else list(head), reshard_after_forward=False, **kwargs)
    fully_shard(root, **kwargs)


def _make_stage_module(E: Any, torch: Any, model: Any, layer_ids: Sequence[int], first: bool, last: bool,
                       seq: int) -> Any:
    """One pipeline stage: [embedding] + its decoder layers + [final norm + LM head], calling the
    model's own submodules as its forward does (rotary embedding, causal mask, layer kwargs), the
    positions and mask those of the whole ``seq`` tokens (under sequence parallelism a rank's
    hidden states hold a shard of them)."""
    nn: Any = torch.nn
    base = model.model
    config = model.config

    class Stage(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = base.embed_tokens if first else None
            self.layers = nn.ModuleList([base.layers[i] for i in layer_ids])
            self.norm = base.norm if last else None
            self.lm_head = model.lm_head if last else None
            self.rotary_emb = getattr(base, "rotary_emb", None)

        def forward(self, x: Any) -> Any:
            embed: Any = self.embed_tokens
            h = embed(x) if embed is not None else x
            # (a zero-width stand-in of the whole sequence: only its shape and dtype are read)
            whole = h if h.shape[1] == seq else h.new_empty((h.shape[0], seq, 0))
            extra = E.position_inputs(model, config, whole)
            sliding = E.sliding_inputs(model, config, whole)  # as the model's own forward hands them out
            for layer in self.layers:
                h = E.call_layer_fn(layer, sliding if sliding is not None and E.layer_slides(layer, config)
                                    else extra)(h)
            head: Any = self.lm_head
            norm: Any = self.norm
            if head is not None:
                h = head(norm(h))
            return h

    return Stage()


def _measure_rank(cfg: dict[str, Any], strategy: Strategy, stage: int, *, attention: str, experts: str,
                  notes: list[str], timeline: bool = False, selective_policy: str | None = None,
                  loss_parallel: bool = False) -> RankMemory:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ndplan.census import _engine as E

    s = strategy
    world = s.pp * s.dp * s.tp
    rank = stage * s.dp * s.tp  # pp outermost, then dp, then tp: dp rank 0, tp rank 0 of the stage
    counts = virtual_stage_layers(s, int(cfg["num_hidden_layers"]))
    owner = stage_to_rank(s)
    mine = [v for v in range(s.pp * s.vpp) if owner[v] == stage]
    starts = [sum(counts[:v]) for v in range(len(counts))]
    chunk_layers = {v: list(range(starts[v], starts[v] + counts[v])) for v in mine}
    layer_ids = [i for v in mine for i in chunk_layers[v]]
    n_virtual = s.pp * s.vpp
    holds_first = 0 in mine
    holds_last = (n_virtual - 1) in mine
    fsdp = s.zero == 3
    dtype = _param_dtype(torch, s)

    if dist.is_initialized():
        dist.destroy_process_group()
    _reset_dtensor_caches()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        with _patched(E, notes):
            mesh = init_device_mesh("cpu", (s.pp, s.dp, s.tp), mesh_dim_names=("pp", "dp", "tp"))
            pp_mesh, dp_mesh, tp_mesh = mesh["pp"], mesh["dp"], mesh["tp"]
            pp_group = pp_mesh.get_group() if s.pp > 1 else None
            with E.FakeTensorMode():
                return _run_rank(E, torch, cfg, s, stage, rank, mine, chunk_layers, layer_ids, holds_first,
                                 holds_last, fsdp, dtype, attention, experts, dp_mesh, tp_mesh, pp_group, notes,
                                 timeline, selective_policy, loss_parallel)
    except NdplanError:
        raise
    except Exception as error:  # a modeling or parallelism path the fake step cannot run
        msg = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise NdplanError(f"measure: stage {stage} failed: {type(error).__name__}: {msg}") from error
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        E.collect()


def _run_rank(E: Any, torch: Any, cfg: dict[str, Any], s: Strategy, stage: int, rank: int, mine: list[int],
              chunk_layers: dict[int, list[int]], layer_ids: list[int], holds_first: bool, holds_last: bool,
              fsdp: bool, dtype: Any, attention: str, experts: str, dp_mesh: Any, tp_mesh: Any, pp_group: Any,
              notes: list[str], timeline: bool = False, selective_policy: str | None = None,
              loss_parallel: bool = False) -> RankMemory:
    pipelined = s.pp > 1
    keep: set[str] | None = None
    if pipelined:
        keep = {f"model.layers.{i}" for i in layer_ids} | {"model.rotary_emb"}
        if holds_first:
            keep.add("model.embed_tokens")
        if holds_last:
            keep |= {"model.norm", "lm_head"}
    model = _build_model(E, torch, cfg, attention, experts, dtype, keep)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if pipelined and tied and not (holds_first and holds_last):
        notes.append("tied embedding and LM head on different stages: each stage holds its own copy")
    if s.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        _check_tp_modules(model, layer_ids)
        parallelize_module(model, tp_mesh, _tp_plan(model, layer_ids, holds_first, holds_last,
                                                     bool(s.sequence_parallel), loss_parallel))
        if tied and holds_first and holds_last:
            # parallelize_module gives each module its own sharded Parameter, which unties the
            # pair (two tables, two gradients); both are Shard(0) over the vocabulary, so the head
            # takes the embedding's again, as a tied model must train.
            model.lm_head.weight = model.model.embed_tokens.weight
    _wrap_recompute(model, layer_ids, s.recompute, E, selective_policy)
    layers = _layers(model)
    b, seq, m = s.micro_batch_size, s.seq_length, s.num_micro_batches

    # Under sequence parallelism the model's own forward would take its positions and mask from the
    # embedding's sequence shard: the step runs the stage module, which takes them from the whole
    # sequence.
    whole_model = not pipelined and not s.sequence_parallel and not loss_parallel
    if whole_model:
        if fsdp:
            _fully_shard(torch, s, dp_mesh, model, model.model.embed_tokens, list(layers),
                         [model.model.norm, model.lm_head], tied)
        params = list(model.parameters())
        roots = [model]
    else:
        modules = []
        for v in mine:
            first, last = v == 0, v == s.pp * s.vpp - 1
            module = _make_stage_module(E, torch, model, chunk_layers[v], first, last, seq)
            if fsdp:
                _fully_shard(torch, s, dp_mesh, module, module.embed_tokens,
                             list(module.layers), [module.norm, module.lm_head] if last else [], tied and first and last)
            modules.append(module)
        params = [p for module in modules for p in module.parameters()]
        roots = modules

    optimizer = torch.optim.AdamW(_param_groups(params), lr=1e-4, foreach=True)
    _warm_up_optimizer(torch, params, optimizer)

    tracker_cls = _tracker_class(fsdp)
    if fsdp:
        tracker = tracker_cls(roots[0], optimizer)
        if len(roots) > 1:
            tracker._root_mod = torch.nn.ModuleList(roots)
    else:
        tracker = tracker_cls()
        tracker.track_external(*roots, optimizer)

    tracker.timeline = [] if timeline else None
    schedule: Any = None  # kept through the optimizer step: a training loop keeps its stages' buffers
    from torch.distributed.tensor.parallel import loss_parallel as sharded_loss

    # (the loss and its backward on vocabulary-sharded logits, as torchtitan's train step runs them)
    loss_context = sharded_loss if loss_parallel else contextlib.nullcontext
    with tracker, loss_context():
        tracker.begin("forward_backward")
        if whole_model:
            for _ in range(m):
                ids = torch.zeros(b, seq, dtype=torch.long)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                del loss, ids
        elif not pipelined:  # one stage module: the model's forward, positions from the whole sequence
            loss_fn = _causal_lm_loss(model)
            for _ in range(m):
                ids = torch.zeros(b, seq, dtype=torch.long)
                loss = loss_fn(modules[0](ids), ids)
                loss.backward()
                del loss, ids
        else:
            schedule = _schedule(torch, s, modules, mine, model, pp_group, holds_first)
            inputs = torch.zeros(b * m, seq, dtype=torch.long) if holds_first else None
            target = torch.zeros(b * m, seq, dtype=torch.long) if holds_last else None
            kwargs: dict[str, Any] = {"return_outputs": False}
            if target is not None:
                kwargs["target"] = target
            # A step of several pipeline runs (gradient accumulation outside the schedule, as
            # torchtitan's train step): the same schedule again, adding to the same gradients.
            for _ in range(s.pipeline_runs):
                if inputs is not None:
                    schedule.step(inputs, **kwargs)
                else:
                    schedule.step(**kwargs)
            del inputs, target, kwargs
        E.collect()
        tracker.begin("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker.note()
    del schedule

    return _rank_memory(tracker, stage, rank, len(layer_ids), mine)


def _param_groups(params: list[Any]) -> list[dict[str, Any]]:
    """One AdamW group, or two where DTensor (tensor-parallel) and plain parameters mix (TP without
    FSDP leaves norms plain): a foreach kernel cannot take both kinds in one call."""
    from torch.distributed.tensor import DTensor

    dtensors = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (dtensors, plain) if group]


def _warm_up_optimizer(torch: Any, params: list[Any], optimizer: Any) -> None:
    """Create AdamW's states as a previous step would have (zero gradients, one step)."""
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _causal_lm_loss(model: Any) -> Any:
    """(logits, labels) -> the loss the causal-LM model's forward computes from them (the logits
    soft-capped first where the model caps them: Gemma 2)."""
    import torch

    loss_function, vocab = model.loss_function, int(model.config.vocab_size)
    softcap = getattr(model.config, "final_logit_softcapping", None)

    def loss_fn(logits: Any, labels: Any) -> Any:
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return loss_function(logits=logits, labels=labels, vocab_size=vocab)

    return loss_fn


def _schedule(torch: Any, s: Strategy, modules: list[Any], mine: list[int], model: Any, group: Any,
              holds_first: bool) -> Any:
    """The torch.distributed.pipelining schedule of this rank, its stages built with static shapes."""
    from torch.distributed import pipelining

    h = int(model.config.hidden_size)
    b, seq = s.micro_batch_size, s.seq_length
    shard = seq // s.tp if s.sequence_parallel else seq  # the tokens a rank's stages hand on
    act_dtype = torch.float32 if s.precision.name == "fp32" else torch.bfloat16
    n_virtual = s.pp * s.vpp
    vocab = int(model.config.vocab_size)
    stages = []
    for module, v in zip(modules, mine, strict=True):
        if v == 0:
            example_in: Any = torch.zeros(b, seq, dtype=torch.long)
        else:
            example_in = torch.empty(b, shard, h, dtype=act_dtype).requires_grad_(True)
        if v == n_virtual - 1:
            example_out: Any = torch.empty(b, seq, vocab, dtype=act_dtype).requires_grad_(True)
        else:
            example_out = torch.empty(b, shard, h, dtype=act_dtype).requires_grad_(True)
        stages.append(pipelining.PipelineStage(
            module, v, n_virtual, torch.device("cpu"), input_args=(example_in,), output_args=(example_out,),
            group=group,
        ))
        del example_in, example_out
    loss_fn = _causal_lm_loss(model)
    cls = getattr(pipelining, SCHEDULE_CLASSES[s.schedule])
    if s.vpp == 1 and s.schedule in ("1f1b", "gpipe"):
        return cls(stages[0], s.num_micro_batches, loss_fn=loss_fn)
    return cls(stages, s.num_micro_batches, loss_fn=loss_fn)


def _rank_memory(tracker: Any, stage: int, rank: int, layers: int, mine: list[int]) -> RankMemory:
    """Per-category figures with the estimator's meanings (see ``RankMemory``)."""
    fb_total, fb_snap = tracker.phase_peak["forward_backward"]
    opt_total, _ = tracker.phase_peak["optimizer"]
    total, snap = max(tracker.phase_peak.values(), key=lambda item: item[0])
    start = categorize(tracker.phase_start["forward_backward"])
    fb_max = tracker.phase_max["forward_backward"]
    # Gradients as the optimizer step finds them: all of them, accumulated. (While a micro-batch's
    # gradient is added into an existing one, both exist for a moment: that is working set.)
    grads = categorize(tracker.phase_start["optimizer"])["grads"]
    held = tracker.held_max.get("forward_backward", 0)
    comm = fb_max.get("comm", 0)
    categories = {
        "params": start["params"],
        "grads": grads,
        "optimizer": start["optimizer"],
        "activations": held,
        "comm": comm,
        # The rest of the forward/backward peak: what the estimator calls transient. Negative
        # when the other categories' maxima do not coincide with the peak (e.g. gradients still
        # partial when it happens).
        "transient": fb_total - start["params"] - start["optimizer"] - grads - held - comm,
        "optimizer_step": max(0, opt_total - tracker.phase_start["optimizer"]["Total"]),
    }
    return RankMemory(
        stage=stage,
        rank=rank,
        allocated_bytes=int(total),
        replayed_reserved_bytes=tracker.allocator.peak_reserved_bytes,
        layers=layers,
        virtual_stages=tuple(mine),
        forward_backward_peak_bytes=int(fb_total),
        optimizer_step_peak_bytes=int(opt_total),
        categories=categories,
        at_peak=categorize(snap),
        tracker_at_peak={k: v for k, v in snap.items() if k != "Total" and v},
        at_forward_backward_peak=categorize(fb_snap),
        category_maxima={k: int(v) for k, v in fb_max.items()},
        timeline=tuple(tracker.timeline or ()),
        peak_blocks=peak_blocks(tracker.events),
    )


#: The tracker's kinds of the state registered before the step, as ``peak_blocks`` names them.
_STATE_KINDS = {"param": "parameters", "opt": "optimizer states", "buffer": "buffers", "grad": "gradients",
                "sharded_param": "parameters (FSDP shards)", "sharded_grad": "gradients (FSDP shards)"}


def peak_blocks(events: Sequence[tuple[int, int, str]]) -> tuple[tuple[str, int, int], ...]:
    """(op, count, bytes each) of the blocks live at the largest total of ``events`` (allocations
    (key, bytes, op) and frees (key, 0, "")), largest total first: which op made the peak."""
    live: dict[int, int] = {}
    total = best = 0
    at = -1
    for index, (key, size, _) in enumerate(events):
        total += size if size else -live.pop(key, 0)
        if size:
            live[key] = size
        if total > best:
            best, at = total, index
    blocks: dict[int, tuple[str, int]] = {}
    for key, size, op in events[:at + 1]:
        if size:
            blocks[key] = (op, size)
        else:
            blocks.pop(key, None)
    counts: dict[tuple[str, int], int] = {}
    for op, size in blocks.values():
        counts[(op, size)] = counts.get((op, size), 0) + 1
    return tuple(sorted(((op, n, size) for (op, size), n in counts.items()), key=lambda b: -b[1] * b[2]))


__all__ = [
    "MEASURABLE_PRECISIONS",
    "SCHEDULE_CLASSES",
    "SELECTIVE_POLICIES",
    "check_selective_policy",
    "categorize",
    "check_measurable",
    "measure_step",
    "stage_to_rank",
    "trimmed_hf_config",
    "trimmed_spec",
    "virtual_stage_layers",
]
