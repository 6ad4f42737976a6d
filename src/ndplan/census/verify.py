"""Compare ndplan's memory estimate with a measurement of the same step, category by category.

The estimate is ``ndplan.memory.stages`` with the PyTorch runtime profile and
``MemoryOptions(include_overhead=False)``: *allocated* bytes, what ``ndplan.census.measure_step``
measures on fake tensors (no CUDA context, NCCL buffers, allocator slack or math-library workspace).
A real run's measurement (``ndplan measure --backend cuda``, a cluster's
``torch.cuda.max_memory_allocated``) is compared with the allocated bytes plus the runtime's
workspaces. Where a measurement has ``reserved_bytes`` (a real run's ``torch.cuda.max_memory_reserved``),
it is compared with the estimate's reserved bytes (allocated times the profile's allocator slack).
A fake step's ``replayed_reserved_bytes`` (the caching allocator replayed over its allocations,
``ndplan.census.allocator``) is shown beside that estimate too, but not checked: a simulation.

Error is ``(estimate - measured) / measured``: positive when ndplan over-estimates. Pure Python:
comparing with a measured JSON file needs neither torch nor transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from ndplan.census.measure_step import trimmed_spec
from ndplan.census.measurement import StepMeasurement
from ndplan.errors import NdplanError
from ndplan.model.spec import ModelSpec

if TYPE_CHECKING:
    from ndplan.memory import MemoryOptions

#: (row key, label) in display order. Categories first, then the two phase peaks and the peak.
ROWS: tuple[tuple[str, str], ...] = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optimizer", "optimizer states"),
    ("activations", "activations"),
    ("comm", "communication buffers"),
    ("transient", "rest of fwd/bwd peak"),
    ("optimizer_step", "temporaries (optimizer step)"),
    ("forward_backward_peak", "forward/backward peak"),
    ("optimizer_step_peak", "optimizer-step peak"),
    ("allocated", "peak allocated"),
    ("reserved", "peak reserved"),
    ("replayed_reserved", "peak reserved, allocator replayed"),
)


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    estimate: float
    measured: float | None
    at_peak: float | None = None
    #: The estimate's own composition at its forward/backward peak, where it differs from
    #: ``estimate``: gradients less those not made yet, and the working set alone as the rest.
    estimate_at_peak: float | None = None

    @property
    def error_pct(self) -> float | None:
        if self.measured is None:
            return None
        if self.measured == 0:
            return 0.0 if self.estimate == 0 else float("inf")
        return (self.estimate - self.measured) / self.measured * 100.0

    def to_dict(self) -> dict[str, Any]:
        err = self.error_pct
        return {
            "key": self.key, "label": self.label, "estimate_bytes": round(self.estimate),
            "measured_bytes": None if self.measured is None else round(self.measured),
            "measured_at_peak_bytes": None if self.at_peak is None else round(self.at_peak),
            "estimate_at_peak_bytes": None if self.estimate_at_peak is None else round(self.estimate_at_peak),
            "error_pct": None if err is None or err == float("inf") else round(err, 3),
        }


@dataclass(frozen=True)
class StageComparison:
    stage: int
    layers: int
    measured_ranks: int
    rows: tuple[Row, ...]

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    @property
    def checked(self) -> tuple[Row, ...]:
        """The totals the tolerance applies to: peak allocated, and peak reserved when measured."""
        return tuple(r for r in self.rows if r.key in ("allocated", "reserved") and r.measured is not None)


@dataclass(frozen=True)
class Verification:
    model: ModelSpec
    measurement: StepMeasurement
    stages: tuple[StageComparison, ...]

    @property
    def compared(self) -> tuple[StageComparison, ...]:
        return tuple(s for s in self.stages if s.measured_ranks)

    def worst(self) -> Row | None:
        """The checked total with the largest |error| over the measured stages."""
        rows = [r for s in self.compared for r in s.checked]
        return max(rows, key=lambda r: abs(r.error_pct or 0.0)) if rows else None

    def peak_row(self) -> tuple[int, Row] | None:
        """(stage, row) of the measured stage with the largest measured peak allocated."""
        best: tuple[int, Row] | None = None
        for s in self.compared:
            row = s.row("allocated")
            if row is not None and row.measured is not None and (best is None or row.measured > (best[1].measured or 0)):
                best = (s.stage, row)
        return best

    def within(self, tolerance_pct: float) -> bool:
        return all(abs(r.error_pct or 0.0) <= tolerance_pct for s in self.compared for r in s.checked)

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst()
        return {
            "model": self.model.name,
            "num_layers": self.model.num_layers,
            "strategy": self.measurement.strategy.model_dump(mode="json", exclude_defaults=True)
            | {"precision": self.measurement.strategy.precision.name},
            "measurement_source": self.measurement.source,
            "worst_error_pct": None if worst is None or worst.error_pct is None or math.isinf(worst.error_pct)
            else round(worst.error_pct, 3),
            "stages": [
                {"stage": s.stage, "layers": s.layers, "measured_ranks": s.measured_ranks,
                 "rows": [r.to_dict() for r in s.rows]}
                for s in self.stages
            ],
        }


def estimator_spec(spec: ModelSpec, measurement: StepMeasurement) -> ModelSpec:
    """The model the measurement ran: trimmed to its ``num_layers`` (MTP dropped) when given."""
    if measurement.num_layers is None or measurement.num_layers == spec.num_layers and not spec.mtp_depth:
        return spec
    if measurement.num_layers > spec.num_layers:  # a file's field, not the --layers flag trimmed_spec names
        raise NdplanError(f"the measurement's 'num_layers' {measurement.num_layers} exceeds {spec.name}'s "
                          f"{spec.num_layers} layers")
    return trimmed_spec(spec, measurement.num_layers)


def verify(spec: ModelSpec, measurement: StepMeasurement, *, census: tuple[Any, ...] = (),
           runtime: str = "pytorch", options: MemoryOptions | None = None) -> Verification:
    """Estimate ``measurement``'s model and strategy and pair every stage's figures with it:
    with ``runtime`` and the measurement's attention kernel, or as ``options`` say (a launch
    config's runtime, attention and loss)."""
    from ndplan.memory import MemoryOptions, estimate

    model = estimator_spec(spec, measurement)
    strategy = measurement.strategy
    if options is None:
        attention: Literal["sdpa", "eager"] = "eager" if measurement.attention == "eager" else "sdpa"
        # The step kept what its selective policy kept (a measured step's provenance says which).
        policy = measurement.provenance.get("selective_policy")
        options = MemoryOptions(runtime=runtime, attention=attention,
                                selective_policy=policy if isinstance(policy, str) and not census else None,
                                loss_parallel=measurement.provenance.get("loss_parallel") is True or None)
    allocated = estimate(model, strategy, None, replace(options, include_overhead=False, census=census))
    with_overhead = estimate(model, strategy, None, replace(options, include_overhead=True, census=census))
    for r in measurement.ranks:
        if r.stage >= strategy.pp:
            raise NdplanError(f"verify: measured stage {r.stage} does not exist with pp={strategy.pp}")
    stages = []
    # A real run's allocator also holds the math libraries' workspaces, which fake tensors never
    # see: it is compared with the estimate that counts them (the overhead's allocated figures).
    basis = allocated if measurement.on_fake_tensors else with_overhead
    for st, st_over in zip(basis.stages, with_overhead.stages, strict=True):
        ranks = measurement.stage_ranks(st.stage)
        peak_rank = max(ranks, key=lambda r: r.allocated_bytes) if ranks else None
        reserved = [r.reserved_bytes for r in ranks if r.reserved_bytes is not None]
        replayed = [r.replayed_reserved_bytes for r in ranks if r.replayed_reserved_bytes is not None]
        estimates = {
            "params": st.params_bytes,
            "grads": st.grads_bytes,
            "optimizer": st.optimizer_bytes,
            "activations": st.activations_bytes,
            "comm": st.comm_bytes,
            # The rest of the forward/backward peak, as measured: the working set less what does
            # not exist yet at that moment (gradients the backward has not made), so it may be < 0.
            "transient": st.forward_backward_bytes - st.static_bytes - st.activations_bytes - st.comm_bytes,
            "optimizer_step": st.optimizer_step_bytes,
            "forward_backward_peak": st.forward_backward_bytes,
            "optimizer_step_peak": st.step_peak_bytes,
            "allocated": st.allocated_bytes,
            "reserved": st_over.reserved_bytes,
            # A fake step's reserved peak, replayed through the caching allocator with the cuBLAS
            # workspace: the estimate with its overhead is the pair (shown, not checked).
            "replayed_reserved": st_over.reserved_bytes,
        }
        measured: dict[str, float | None] = dict.fromkeys(estimates)
        at_peak: dict[str, float | None] = dict.fromkeys(estimates)
        if peak_rank is not None:
            for key, value in peak_rank.categories.items():
                if key in measured:
                    measured[key] = float(value)
            for key, value in (peak_rank.at_forward_backward_peak or peak_rank.at_peak).items():
                if key in at_peak:
                    at_peak[key] = float(value)
            measured["forward_backward_peak"] = _opt(peak_rank.forward_backward_peak_bytes)
            measured["optimizer_step_peak"] = _opt(peak_rank.optimizer_step_peak_bytes)
            measured["allocated"] = float(peak_rank.allocated_bytes)
            at_peak["forward_backward_peak"] = _opt(peak_rank.forward_backward_peak_bytes)
            measured["reserved"] = float(max(reserved)) if reserved else None
            measured["replayed_reserved"] = float(max(replayed)) if replayed else None
        # At its forward/backward peak the estimate holds the gradients made by then and, beside
        # the held activations, the working set (``transient``): the pair to the measured column.
        estimate_at_peak: dict[str, float | None] = {"grads": st.grads_bytes - st.unmade_bytes,
                                                     "transient": st.transient_bytes}
        rows = tuple(
            Row(key, label, float(estimates[key]), measured[key], at_peak[key], estimate_at_peak.get(key))
            for key, label in ROWS
            if key not in ("reserved", "replayed_reserved") or measured[key] is not None
        )
        stages.append(StageComparison(st.stage, st.layers, len(ranks), rows))
    return Verification(model, measurement, tuple(stages))


def _opt(value: int | None) -> float | None:
    return None if value is None else float(value)


__all__ = ["ROWS", "Row", "StageComparison", "Verification", "estimator_spec", "verify"]
