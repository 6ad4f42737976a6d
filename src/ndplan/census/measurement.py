"""A measured step's memory, and its JSON file (``ndplan.measured-memory``): per measured rank,
the peak of live tensor bytes and what it is made of, in the estimator's categories.

Written by ``ndplan measure --out`` (a fake-tensor step, ``measure_step``) or ``ndplan verify
--backend cuda`` (a real one), or by hand from a real cluster's ``torch.cuda.max_memory_allocated``
and ``max_memory_reserved``; read by ``ndplan verify --measured``. Needs neither torch nor
transformers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from ndplan.errors import NdplanError, parse_nested, read_text
from ndplan.strategy import Strategy

#: The schema of a measured-memory JSON file (written by ``ndplan measure --out``, or by hand from
#: a real cluster's ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``).
MEASURED_SCHEMA = "ndplan.measured-memory"
MEASURED_SCHEMA_VERSION = 1

#: ``StepMeasurement.source`` of a fake-tensor measurement.
FAKE_SOURCE = "ndplan measure: FakeTensorMode step on a fake process group, MemTracker/FSDPMemTracker"

#: Categories, with the estimator's names and meanings (see ``ndplan.memory.result``).
CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "transient", "optimizer_step")


@dataclass(frozen=True)
class RankMemory:
    """One rank's step, in bytes.

    ``allocated_bytes`` is the peak of live tensor bytes over the whole step (what
    ``torch.cuda.max_memory_allocated`` reports); ``reserved_bytes`` only comes from real runs.
    ``replayed_reserved_bytes`` is a fake-tensor step's: the reserved peak of PyTorch's CUDA
    caching allocator replayed over the step's allocations and frees, with the math libraries'
    workspace (``ndplan.census.allocator``, a pool per stream); a simulation, not a measurement.
    ``categories`` has the estimator's meanings:

    * ``params``, ``optimizer``: parameters (and buffers) and optimizer states held at the start
      of the step; ``grads``: the gradient bytes when the optimizer step begins (all of them);
    * ``activations``: what forward leaves alive for backward, the largest over the moments a
      backward begins (the held activations; the estimator's ``activations``);
    * ``comm``: the largest bytes of FSDP all-gather / reduce-scatter buffers and unsharded
      parameters and gradients during forward and backward;
    * ``transient``: the rest of the forward/backward peak (peak minus the categories above), so
      that the categories add up to ``forward_backward_peak_bytes`` as the estimator's do;
      negative when the maxima above do not coincide at the peak;
    * ``optimizer_step``: the optimizer step's temporaries (its peak over what was live when it
      began).

    ``at_peak`` splits ``allocated_bytes`` itself: what was live at the instant of the peak, by
    category (forward tensors count as activations, backward ones as temporaries);
    ``tracker_at_peak`` is the same by the tracker's own types; ``at_forward_backward_peak`` the
    split at the forward/backward peak; ``category_maxima`` is each category's own largest value
    during forward/backward.
    """

    stage: int
    allocated_bytes: int
    rank: int | None = None
    reserved_bytes: int | None = None
    replayed_reserved_bytes: int | None = None
    layers: int | None = None
    virtual_stages: tuple[int, ...] = ()
    forward_backward_peak_bytes: int | None = None
    optimizer_step_peak_bytes: int | None = None
    categories: dict[str, int] = field(default_factory=dict)
    at_peak: dict[str, int] = field(default_factory=dict)
    tracker_at_peak: dict[str, int] = field(default_factory=dict)
    at_forward_backward_peak: dict[str, int] = field(default_factory=dict)
    category_maxima: dict[str, int] = field(default_factory=dict)
    #: With ``measure_step(..., timeline=True)``: (phase, in backward, live bytes by category and
    #: "total") each time the live total moved by 1 MiB or more or reached a new peak. Not written
    #: to the JSON file.
    timeline: tuple[tuple[str, bool, dict[str, int]], ...] = ()
    #: A fake-tensor step's blocks live at its peak: (the op that allocated them, with
    #: " (backward)" in a backward, or the tracker's kind for state made before the step; how
    #: many; bytes each), largest total first. Not written to the JSON file.
    peak_blocks: tuple[tuple[str, int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "stage": self.stage, "allocated_bytes": self.allocated_bytes}
        if self.reserved_bytes is not None:
            out["reserved_bytes"] = self.reserved_bytes
        if self.replayed_reserved_bytes is not None:
            out["replayed_reserved_bytes"] = self.replayed_reserved_bytes
        if self.layers is not None:
            out["layers"] = self.layers
        if self.virtual_stages:
            out["virtual_stages"] = list(self.virtual_stages)
        for key in ("forward_backward_peak_bytes", "optimizer_step_peak_bytes"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        for key in ("categories", "at_peak", "tracker_at_peak", "at_forward_backward_peak", "category_maxima"):
            if getattr(self, key):
                out[key] = dict(getattr(self, key))
        return out


@dataclass(frozen=True)
class StepMeasurement:
    """A measured step: the model, the strategy and one ``RankMemory`` per measured rank."""

    model: str
    strategy: Strategy
    ranks: tuple[RankMemory, ...]
    num_layers: int | None = None
    attention: str = "sdpa"
    source: str = ""
    notes: tuple[str, ...] = ()
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def allocated_bytes(self) -> int:
        return max(r.allocated_bytes for r in self.ranks)

    @property
    def on_fake_tensors(self) -> bool:
        """Measured by ``measure_step``: only the tensors ops return, no math-library workspace."""
        return self.source == FAKE_SOURCE

    def stage_ranks(self, stage: int) -> list[RankMemory]:
        return [r for r in self.ranks if r.stage == stage]

    def to_dict(self) -> dict[str, Any]:
        strategy = self.strategy.model_dump(mode="json", exclude_defaults=True)
        strategy["precision"] = self.strategy.precision.name
        out: dict[str, Any] = {
            "schema": MEASURED_SCHEMA,
            "schema_version": MEASURED_SCHEMA_VERSION,
            "model": self.model,
        }
        if self.num_layers is not None:
            out["num_layers"] = self.num_layers
        out["strategy"] = strategy
        out["attention"] = self.attention
        if self.source:
            out["source"] = self.source
        out["ranks"] = [r.to_dict() for r in self.ranks]
        if self.notes:
            out["notes"] = list(self.notes)
        out.update(self.provenance)
        return out


def _int_field(entry: dict[str, Any], key: str, where: str, *, required: bool = False, bytes_: bool = True
               ) -> int | None:
    """A field of bytes (``bytes_``), or a count or index (rank, stage, layers: whole numbers)."""
    value = entry.get(key)
    if value is None:
        if required:
            raise NdplanError(f"{where}: missing '{key}'")
        return None
    kinds = (int, float) if bytes_ else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < 0 or not math.isfinite(value):
        what = "a non-negative number of bytes" if bytes_ else "a whole number >= 0"
        raise NdplanError(f"{where}: '{key}' must be {what}, got {value!r}")
    return int(value)


def _bytes_map(entry: dict[str, Any], key: str, where: str) -> dict[str, int]:
    """An object of byte counts by name (categories, what was live at a peak), each a finite number."""
    value = entry.get(key) or {}
    if not isinstance(value, dict):
        raise NdplanError(f"{where}: '{key}' must be an object of bytes by name, got {type(value).__name__}")
    counts = {}
    for name, count in value.items():
        # Signed: a category measured as the rest of a peak (transient) can come out below 0.
        if isinstance(count, bool) or not isinstance(count, (int, float)) or not math.isfinite(count):
            raise NdplanError(f"{where}: {key}: '{name}' must be a number of bytes, got {count!r}")
        counts[str(name)] = int(count)
    return counts


def _whole_numbers(entry: dict[str, Any], key: str, where: str) -> tuple[int, ...]:
    value = entry.get(key) or []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise NdplanError(f"{where}: '{key}' must be a list of whole numbers >= 0, got {value!r}")
    return tuple(value)


def measurement_from_dict(data: Any, source: str = "measured file", *, model: str | None = None,
                          strategy: Strategy | None = None) -> StepMeasurement:
    """Read the measured-memory JSON format (docs/accuracy.md); an NdplanError names the bad field.
    ``model`` and ``strategy``, where a launch config gave them, stand for the file's own (which
    must then leave them out: one source for each)."""
    if not isinstance(data, dict):
        raise NdplanError(f"{source}: expected a JSON object")
    schema = data.get("schema", MEASURED_SCHEMA)
    if schema != MEASURED_SCHEMA:
        raise NdplanError(f"{source}: 'schema' is {schema!r}, expected {MEASURED_SCHEMA!r}")
    version = data.get("schema_version", MEASURED_SCHEMA_VERSION)
    if isinstance(version, bool) or version != MEASURED_SCHEMA_VERSION:  # true == 1 in Python
        raise NdplanError(f"{source}: schema_version {version!r} is not supported (this ndplan reads {MEASURED_SCHEMA_VERSION})")
    if model is not None or strategy is not None:
        stated = [key for key in ("model", "strategy", "num_layers", "attention") if key in data]
        if stated:
            raise NdplanError(f"{source}: states '{stated[0]}', which the launch config (--from) gives: "
                              "leave it out of the file")
    else:
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise NdplanError(f"{source}: " + ("missing 'model'" if model is None else
                                               f"'model' must be a name or a path, got {model!r}")
                              + " (a preset name or a config.json path)")
        strategy = _strategy_from(data.get("strategy"), source)
    assert model is not None and strategy is not None
    # Ranks and stages that do not fit the strategy are its fault as much as theirs: name it.
    whose = f"the launch config's strategy ({strategy.short()})" if "strategy" not in data else \
        f"the file's 'strategy' ({strategy.short()})"
    num_layers = data.get("num_layers")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise NdplanError(f"{source}: 'num_layers' must be a positive integer, got {num_layers!r}")
    raw_ranks = data.get("ranks")
    if not isinstance(raw_ranks, list) or not raw_ranks:
        raise NdplanError(f"{source}: 'ranks' must be a non-empty list of {{stage or rank, allocated_bytes, reserved_bytes}}")
    per_stage = strategy.world_size // strategy.pp
    ranks: list[RankMemory] = []
    for i, entry in enumerate(raw_ranks):
        where = f"{source}: ranks[{i}]"
        if not isinstance(entry, dict):
            raise NdplanError(f"{where}: expected an object")
        rank = _int_field(entry, "rank", where, bytes_=False)
        stage = _int_field(entry, "stage", where, bytes_=False)
        if rank is not None and rank >= strategy.world_size:
            raise NdplanError(f"{where}: rank {rank} is not among the {strategy.world_size} ranks (dp·tp·pp·cp) of {whose}")
        if stage is None:
            if rank is None:
                raise NdplanError(f"{where}: give 'stage' (pipeline stage) or 'rank' (global rank)")
            stage = rank // per_stage  # pipeline-parallel ranks outermost (torchtitan, Megatron)
        if stage >= strategy.pp:
            raise NdplanError(f"{where}: stage {stage} does not exist with pp={strategy.pp}, {whose}")
        allocated = _int_field(entry, "allocated_bytes", where, required=True)
        assert allocated is not None
        if allocated == 0:  # a training step holds at least its parameters
            raise NdplanError(f"{where}: 'allocated_bytes' must be above 0 (a step holds its parameters at least)")
        reserved = _int_field(entry, "reserved_bytes", where)
        if reserved is not None and reserved < allocated:  # the allocator reserves what it hands out
            raise NdplanError(f"{where}: 'reserved_bytes' {reserved:,} is below 'allocated_bytes' {allocated:,}; "
                              "the caching allocator reserves at least what it allocated")
        ranks.append(RankMemory(
            stage=stage,
            rank=rank,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            replayed_reserved_bytes=_int_field(entry, "replayed_reserved_bytes", where),
            layers=_int_field(entry, "layers", where, bytes_=False),
            virtual_stages=_whole_numbers(entry, "virtual_stages", where),
            forward_backward_peak_bytes=_int_field(entry, "forward_backward_peak_bytes", where),
            optimizer_step_peak_bytes=_int_field(entry, "optimizer_step_peak_bytes", where),
            categories=_bytes_map(entry, "categories", where),
            at_peak=_bytes_map(entry, "at_peak", where),
            tracker_at_peak=_bytes_map(entry, "tracker_at_peak", where),
            at_forward_backward_peak=_bytes_map(entry, "at_forward_backward_peak", where),
            category_maxima=_bytes_map(entry, "category_maxima", where),
        ))
    from ndplan.memory.options import Attention

    attention = data.get("attention", "sdpa")
    if attention not in get_args(Attention):
        raise NdplanError(f"{source}: 'attention' must be one of {', '.join(get_args(Attention))} (the kernel the "
                          f"measured run used), got {attention!r}")
    known = {"schema", "schema_version", "model", "num_layers", "strategy", "attention", "source", "ranks", "notes"}
    provenance = {k: v for k, v in data.items() if k not in known}
    notes = data.get("notes") or ()
    if isinstance(notes, str):
        notes = (notes,)
    elif not isinstance(notes, (list, tuple)):  # notes: 1 was a TypeError traceback in verify
        raise NdplanError(f"{source}: 'notes' must be a list of text, got {notes!r}")
    return StepMeasurement(
        model=model, strategy=strategy, ranks=tuple(ranks), num_layers=num_layers,
        attention=attention, source=str(data.get("source", "")),
        notes=tuple(str(n) for n in notes), provenance=provenance,
    )


def _strategy_from(raw_strategy: Any, source: str) -> Strategy:
    if raw_strategy is None:
        raise NdplanError(f"{source}: missing 'strategy' (an object of Strategy fields: dp, tp, pp, ...)")
    if not isinstance(raw_strategy, dict):
        raise NdplanError(f"{source}: 'strategy' must be an object of Strategy fields (dp, tp, pp, ...), "
                          f"got {type(raw_strategy).__name__}")
    from pydantic import ValidationError

    from ndplan.model.hf import first_validation_error

    fields = dict(raw_strategy)
    if fields.get("fsdp") and "zero" not in fields:
        fields["zero"] = 3
    try:
        return Strategy(**fields)
    except ValidationError as error:
        raise NdplanError(f"{source}: strategy: {first_validation_error(error)}") from None


def load_measurement(path: str | Path, *, model: str | None = None, strategy: Strategy | None = None) -> StepMeasurement:
    p = Path(path)
    try:
        data = parse_nested(json.loads, read_text(p), p, "JSON")
    except OSError as error:
        raise NdplanError(f"{p}: cannot read: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise NdplanError(f"{p}:{error.lineno}: malformed JSON: {error.msg}") from None
    return measurement_from_dict(data, str(p), model=model, strategy=strategy)


def save_measurement(path: str | Path, measurement: StepMeasurement) -> None:
    Path(path).write_text(json.dumps(measurement.to_dict(), indent=2) + "\n", encoding="utf-8")


__all__ = [
    "CATEGORIES",
    "FAKE_SOURCE",
    "MEASURED_SCHEMA",
    "MEASURED_SCHEMA_VERSION",
    "RankMemory",
    "StepMeasurement",
    "load_measurement",
    "measurement_from_dict",
    "save_measurement",
]
