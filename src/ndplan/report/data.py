"""From a result (estimate, search or balance, as plain dicts) to what the report draws.

Every figure, in HTML or matplotlib, is drawn from the dict :func:`prepare` returns, so the
two outputs agree. Inputs are plain dicts, lists and numpy arrays (a ``--json`` output read
back, or the same built in process); objects with a ``to_dict()`` (``MemoryReport``) and
:class:`ndplan.schedule.ScheduleResult` are accepted too. Everything here is in bytes and
seconds; the renderers convert to GiB for people.

Keys read (aliases in brackets; all optional, a missing part leaves its figure out):

* memory: ``stages`` (list of per-stage dicts as ``MemoryReport.to_dict()`` gives), at the top
  level or under ``memory`` / ``best`` / ``baseline`` / ``before`` / ``after`` / ``balanced``;
  ``capacity_bytes`` [``memory_limit_bytes``, ``limit_bytes``].
* step time: ``perf`` [``time``, ``step_time``, or the top level]: ``{"step_s", "tokens_per_s",
  "mfu", "hfu", "breakdown": {"compute", "comm_exposed": {"tp", ...}, "bubble", "optimizer"}}``.
* timeline: ``timeline`` [``schedule_result``]: :func:`schedule_to_dict`'s shape; without it,
  the schedule of ``strategy`` is simulated.
* search: ``rows`` [``top``, ``ranked``, ``results``]: ranked dicts; ``candidates``
  [``all_candidates``, ``points``, ``cloud``; or ``candidates_time_s`` with
  ``candidates_peak_bytes`` as in ``SearchResult``]: ``{"step_s": [...], "peak_bytes": [...],
  "n_total": N}`` (``n_total`` when the arrays are already thinned, see :func:`candidate_cloud`),
  a list of ``(step_s, peak_bytes)`` pairs, a list of dicts or an ``[n, 2]`` array; ``pareto``
  [``pareto_front``, ``front``]: indices into the candidates, or points as pairs / row dicts.
  Without candidates the scatter shows the Pareto rows and the ranked rows alone.
* cautions: ``caveats`` (what the memory model is known to miss for the strategy, as ``ndplan
  estimate --json`` writes them), ``caveats`` of the step time (under ``perf`` / ``time``), or
  of the search's first row (its winner): listed as the report's cautions, each once.
* rows may carry the step-time parts flat, as ``ndplan search`` writes them (``compute_s``,
  ``tp_s`` ... ``bubble_s``, ``optimizer_s``; ``stage_forward_s``, ``stage_backward_s``,
  ``stage_weight_grad_s``, ``p2p_s`` for the timeline) or nested as ``breakdown``.
"""

from __future__ import annotations

import dataclasses
import math
import platform
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np

from ndplan.errors import NdplanError

MEMORY_CATEGORY_KEYS = ("params", "grads", "optimizer", "activations", "comm", "transient")
MEMORY_SOURCE_KEYS = ("memory", "best", "baseline", "before", "after", "given", "balanced")
MEMORY_SOURCE_NAMES = {"best": "#1 ranked", "given": "as given"}
PERF_KEYS = ("perf", "time", "step_time")
ROW_KEYS = ("rows", "top", "ranked", "results")
CANDIDATE_KEYS = ("candidates", "all_candidates", "points", "cloud")
PARETO_KEYS = ("pareto", "pareto_front", "front")
LIMIT_KEYS = ("memory_limit_bytes", "capacity_bytes", "limit_bytes")
COMM_DIMS = ("tp", "cp", "ep", "dp", "offload", "pp")

#: Table columns shown first, in this order, when a row has them.
ROW_PRIORITY = (
    "rank", "dp", "tp", "pp", "cp", "ep", "etp", "vpp", "schedule", "zero", "fsdp", "recompute", "recompute_modules",
    "offload_modules", "offload_layers", "offload_optimizer_states", "optimizer_offload", "micro_batch_size", "mbs", "num_micro_batches", "seq_length", "peak_bytes", "step_s",
    "tokens_per_s", "tokens_per_s_per_device", "mfu", "hfu",
)


# ------------------------------------------------------------------ small helpers
def as_dict(obj: Any) -> dict[str, Any]:
    """A result as a plain dict (``to_dict()`` / ``model_dump()`` objects are converted)."""
    if isinstance(obj, Mapping):
        return dict(obj)
    for method in ("to_dict", "model_dump"):
        if hasattr(obj, method):
            value = getattr(obj, method)()
            if isinstance(value, Mapping):
                out: dict[str, Any] = {}
                # a MemoryReport: add what `ndplan estimate --json` adds around to_dict()
                model, device, strategy = (getattr(obj, k, None) for k in ("model", "device", "strategy"))
                if getattr(model, "name", None):
                    out["model"] = model.name  # type: ignore[union-attr]
                if getattr(device, "name", None):
                    out["hardware"] = device.name  # type: ignore[union-attr]
                if hasattr(strategy, "model_dump"):
                    out["strategy"] = strategy.model_dump(mode="json")  # type: ignore[union-attr]
                return {**out, **value}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # e.g. SearchResult: fields as they are
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise NdplanError(f"a report needs a result dict (estimate, search or balance), got {type(obj).__name__}")


def finite(value: Any) -> float | None:
    """A float, or None for what is not a finite number (None, NaN, inf, text)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _first(data: Mapping[str, Any], keys: Iterable[str]) -> Any:
    for key in keys:
        if key in data and data[key] is not None:
            return data[key]
    return None


def jsonable(value: Any) -> Any:
    """Plain JSON types only: numpy scalars/arrays converted, NaN and inf as None."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(float(value)) else None
    if value is None or isinstance(value, str):
        return value
    if hasattr(value, "model_dump"):
        return jsonable(value.model_dump(mode="json"))
    return str(value)


def strategy_short(strategy: Mapping[str, Any]) -> str:
    """'dp8 tp4 pp2 vpp2 interleaved zero1 recompute=selective mbs1 m16' (a row's own ``label`` if it has one)."""
    if isinstance(strategy.get("label"), str) and strategy["label"]:
        return str(strategy["label"])
    parts = []
    for key in ("dp", "tp", "pp", "cp", "ep", "vpp"):
        value = strategy.get(key)
        if value is not None and (value != 1 or key in ("dp", "tp", "pp")):
            parts.append(f"{key}{value}")
    if strategy.get("etp") not in (None, 0, strategy.get("tp")):
        parts.append(f"etp{strategy['etp']}")
    if strategy.get("sequence_parallel"):
        parts.append("sp")
    schedule = strategy.get("schedule")
    if schedule and (int(strategy.get("pp") or 1) > 1 or schedule != "1f1b"):
        parts.append(str(schedule))
    if strategy.get("fsdp"):
        parts.append("fsdp")
    elif strategy.get("zero"):
        parts.append(f"zero{strategy['zero']}")
    if strategy.get("recompute") not in (None, "none"):
        parts.append(f"recompute={strategy['recompute']}")
    offload = strategy.get("offload_modules")
    if offload:
        parts.append(f"offload={offload if isinstance(offload, str) else '+'.join(offload)}")
    if strategy.get("offload_layers"):
        parts.append(f"offload-layers{strategy['offload_layers']}")
    if strategy.get("optimizer_offload"):
        parts.append("optimizer-cpu")
    if strategy.get("offload_optimizer_states"):
        parts.append("optimizer-states-host")
    mbs = strategy.get("micro_batch_size", strategy.get("mbs"))
    if mbs is not None:
        parts.append(f"mbs{mbs}")
    m = strategy.get("num_micro_batches")
    if m is not None:
        runs = int(strategy.get("pipeline_runs") or 1)
        parts.append(f"m{m}" + (f"x{runs}" if runs > 1 else ""))
    return " ".join(parts)


# ------------------------------------------------------------------ memory
def _check_strategy(fields: Mapping[str, Any]) -> None:
    """A result's strategy must be one (a report of junk degrees drew a 'tpabc' header)."""
    from pydantic import ValidationError

    from ndplan.model.hf import first_validation_error
    from ndplan.strategy import Strategy

    try:
        Strategy(**{k: v for k, v in fields.items() if k != "precision" or isinstance(v, (str, Mapping))})
    except ValidationError as error:
        raise NdplanError(f"the result's strategy is not one: {first_validation_error(error)}") from None
    except TypeError as error:
        raise NdplanError(f"the result's strategy is not one: {error}") from None


def _plain_bytes(value: Any) -> bool:
    """Whether ``value`` is a byte count a report can draw: a finite number, >= 0 (a category
    may read below zero only by rounding), below an exabyte."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and -1e6 < value < 1e18)


#: A stage's figures the memory charts draw: at least one must be given.
_STAGE_FIGURES = ("peak_bytes", "allocated_bytes", "reserved_bytes", *(f"{k}_bytes" for k in MEMORY_CATEGORY_KEYS))


def memory_stages(stages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per stage: the category stack and the layer-kind stack, each summing to the peak.

    Categories: params, grads, optimizer, activations, comm, transient; then the optimizer-step
    temporaries where that phase sets the allocated peak (allocated above the other six), then
    overhead = peak - allocated. Layer kinds: ``by_layer_kind`` (static + activations of each
    kind), ``other`` for what the kinds leave unattributed, ``buffers`` = comm + transient, then
    the same optimizer-step and overhead terms.
    """
    out = []
    for index, stage in enumerate(stages):
        if not isinstance(stage, Mapping):  # null or a number for a stage: named, not an AttributeError
            raise NdplanError(f"stages[{index}] must be a mapping of a stage's figures, got "
                              f"{'null' if stage is None else type(stage).__name__}")
        for key, value in stage.items():
            # A figure the input states must be one: junk read as 0 drew a page of zeros.
            if key.endswith("_bytes") and value is not None and not _plain_bytes(value):
                raise NdplanError(f"stage {stage.get('stage', index)}: {key} must be a number of bytes >= 0, "
                                  f"got {value!r}")
        for key in ("layers", "stage"):
            count = stage.get(key)
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise NdplanError(f"stage {index}: {key} must be a whole number >= 0, got {count!r}")
        if not any(finite(stage.get(key)) is not None for key in _STAGE_FIGURES):
            # nothing to draw: a page of 0.00 GiB bars read as an estimate of nothing
            raise NdplanError(f"stage {stage.get('stage', index)} has no memory figure ("
                              f"{', '.join(_STAGE_FIGURES[:3])} or a category's bytes)")
        cats = {k: finite(stage.get(f"{k}_bytes")) or 0.0 for k in MEMORY_CATEGORY_KEYS}
        base = sum(cats.values())
        peak = finite(stage.get("peak_bytes"))
        allocated = finite(stage.get("allocated_bytes"))
        reserved = finite(stage.get("reserved_bytes"))
        categories: dict[str, float] = {}
        kinds: dict[str, float] = {}
        if base <= 0:
            total = peak if peak is not None else (reserved if reserved is not None else allocated) or 0.0
            categories["unbroken"] = total
            kinds["unbroken"] = total
        else:
            forward_backward = finite(stage.get("forward_backward_bytes"))
            # The optimizer step sets the stage's peak where allocated exceeds the forward/backward
            # peak: activations, buffers and transients are gone by then and every gradient made,
            # so the bar stacks parameters, gradients, states and the step's temporaries.
            step_sets_peak = forward_backward is not None and allocated is not None and allocated > forward_backward
            if step_sets_peak:
                for key in ("activations", "comm", "transient"):
                    cats[key] = 0.0
                base = sum(cats.values())
            elif forward_backward is not None and base > forward_backward:
                # Gradients not made yet at the forward/backward peak (one micro-batch, a deferred
                # FSDP reduce) are in the grads category but not in the peak: the bar shows those made.
                cut = min(base - forward_backward, cats["grads"])
                cats["grads"] -= cut
                base -= cut
            alloc = allocated if allocated is not None else base
            step_extra = max(0.0, alloc - base)
            overhead = finite(stage.get("overhead_bytes"))
            if overhead is None:
                overhead = (peak - alloc) if peak is not None else 0.0
            overhead = max(0.0, overhead)
            total = base + step_extra + overhead
            categories = {**cats, "optimizer_step": step_extra, "overhead": overhead}
            kind_key = "static_by_layer_kind" if step_sets_peak and "static_by_layer_kind" in stage else "by_layer_kind"
            by_kind = {str(k): finite(v) or 0.0 for k, v in (stage.get(kind_key) or {}).items()}
            state = cats["params"] + cats["grads"] + cats["optimizer"] + cats["activations"]
            if sum(by_kind.values()) > state > 0:  # the kinds' gradients include those not made yet
                scale = state / sum(by_kind.values())
                by_kind = {k: v * scale for k, v in by_kind.items()}
            other = state - sum(by_kind.values())
            if other > max(1.0, 1e-6 * state):
                by_kind["other"] = other
            kinds = {**by_kind, "buffers": cats["comm"] + cats["transient"], "optimizer_step": step_extra,
                     "overhead": overhead}
        out.append({
            "stage": int(stage.get("stage", index)),
            "layers": stage.get("layers"),
            "peak_bytes": peak if peak is not None else total,
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
            # pinned host memory of offloaded activations and optimizer: beside the device figures,
            # not in them (a result written before host_bytes: its activations alone)
            "host_activation_bytes": finite(stage.get("host_activation_bytes")) or 0.0,
            "host_bytes": finite(stage.get("host_bytes")) or finite(stage.get("host_activation_bytes")) or 0.0,
            "categories": {k: v for k, v in categories.items() if v > 0},
            "kinds": {k: v for k, v in kinds.items() if v > 0},
        })
    return out


def shows_something(result: Mapping[str, Any]) -> bool:
    """Whether a result holds anything a report shows: per-stage memory (its own or under a
    ``MEMORY_SOURCE_KEYS`` entry), ranked rows, candidates, or a model's strategy (a balanced
    plan: the report draws its schedule)."""
    if _first(result, ROW_KEYS) is not None or _first(result, CANDIDATE_KEYS) is not None:
        return True
    if isinstance(result.get("strategy"), Mapping) and result.get("model"):
        return True
    return bool(_memory_sources(result, []))


def _memory_sources(result: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    sources: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(result.get("stages"), list) and result["stages"]:
        sources.append(("", result))
    for key in MEMORY_SOURCE_KEYS:
        value = result.get(key)
        if isinstance(value, Mapping) and isinstance(value.get("stages"), list) and value["stages"]:
            sources.append((MEMORY_SOURCE_NAMES.get(key, key), value))
    if not sources and rows:
        best = rows[0]
        if isinstance(best.get("stages"), list) and best["stages"] and isinstance(best["stages"][0], Mapping):
            sources.append(("#1 ranked", best))
        else:
            per_stage = _per_stage_peaks(best)
            if per_stage:
                sources.append(("#1 ranked", {"stages": [{"stage": i, "peak_bytes": v}
                                                             for i, v in enumerate(per_stage)]}))
    return sources


def _per_stage_peaks(row: Mapping[str, Any]) -> list[float] | None:
    for key, value in row.items():
        if "peak" in key and isinstance(value, (list, tuple, np.ndarray)) and len(value):
            values = [finite(v) for v in value]
            if all(v is not None for v in values):
                return [float(v) for v in values if v is not None]
    return None


def memory_limit(result: Mapping[str, Any]) -> float | None:
    """The memory limit a result states (its own, else a memory source's), in bytes."""
    for key in LIMIT_KEYS:
        value = result.get(key)
        if value is not None and not (_plain_bytes(value) and value > 0):
            raise NdplanError(f"{key} must be a number of bytes > 0, got {value!r}")
    limit = finite(_first(result, LIMIT_KEYS))
    if limit is None:
        for key in MEMORY_SOURCE_KEYS:
            value = result.get(key)
            if isinstance(value, Mapping):
                limit = finite(_first(value, LIMIT_KEYS))
                if limit is not None:
                    break
    return limit


# ------------------------------------------------------------------ step time
def perf_segments(perf: Mapping[str, Any]) -> dict[str, float]:
    """Step-time breakdown as flat segments: compute, tp, cp, ep, dp, pp, bubble, optimizer, ..."""
    breakdown = perf.get("breakdown") or {}
    segments: dict[str, float] = {}
    compute = finite(breakdown.get("compute"))
    if compute is not None:
        segments["compute"] = compute
    comm = breakdown.get("comm_exposed")
    if isinstance(comm, Mapping):
        for dim, value in comm.items():
            number = finite(value)
            if number is not None:
                key = str(dim) if dim in COMM_DIMS else "comm_other"
                segments[key] = segments.get(key, 0.0) + number
    else:
        number = finite(comm)
        if number is not None:
            segments["comm_other"] = number
    for key in ("bubble", "optimizer"):
        number = finite(breakdown.get(key))
        if number is not None:
            segments[key] = number
    for key, value in breakdown.items():
        if key not in ("compute", "comm_exposed", "bubble", "optimizer"):
            number = finite(value)
            if number is not None and number > 0:
                segments["other"] = segments.get("other", 0.0) + number
    step = finite(perf.get("step_s"))
    if step is not None and segments:
        residual = step - sum(segments.values())
        if residual > 0.005 * step:
            segments["other"] = segments.get("other", 0.0) + residual
    return {k: v for k, v in segments.items() if v > 0}


def find_perf(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """The step-time report in a result or a row: nested (``breakdown``) or flat (``compute_s`` ...)."""
    perf = _first(result, PERF_KEYS)
    if isinstance(perf, Mapping) and ("step_s" in perf or "breakdown" in perf):
        where = next((f"{key}." for key in PERF_KEYS if result.get(key) is perf), "")
        return _with_breakdown(perf, where)
    if "step_s" in result and (isinstance(result.get("breakdown"), Mapping) or "compute_s" in result):
        return _with_breakdown(result)
    return None


def _with_breakdown(perf: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    step = perf.get("step_s")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))):
        # a quoted "1.2" was a TypeError traceback where the page formats it
        raise NdplanError(f"{where}step_s must be a number of seconds, got {step!r}")
    out = dict(perf)
    if not isinstance(out.get("breakdown"), Mapping) and "compute_s" in out:
        out["breakdown"] = {
            "compute": out.get("compute_s"),
            "comm_exposed": {d: out[f"{d}_s"] for d in COMM_DIMS if f"{d}_s" in out},
            "bubble": out.get("bubble_s"),
            "optimizer": out.get("optimizer_s"),
        }
    return out


DURATION_KEYS = ("stage_forward_s", "stage_backward_s", "stage_weight_grad_s")


def _durations(source: Mapping[str, Any] | None) -> dict[str, float] | None:
    """Per-micro-batch seconds of the bottleneck stage (forward, backward, weight grad, p2p), if given."""
    if source is None:
        return None
    for where in (source, source.get("details")):
        if isinstance(where, Mapping) and all(finite(where.get(k)) is not None for k in DURATION_KEYS):
            out = {k: float(where[k]) for k in DURATION_KEYS}
            out["p2p_s"] = finite(where.get("p2p_s")) or 0.0
            return out
    return None


# ------------------------------------------------------------------ timeline
def schedule_to_dict(schedule: Any) -> dict[str, Any]:
    """A :class:`ScheduleResult` (or its dict) as plain lists: stages of parallel op arrays.

    ``{"schedule", "pp", "vpp", "num_micro_batches", "seq_chunks", "makespan_s",
    "bubble_fraction", "stages": [{"kind": ["F", ...], "micro_batch", "chunk", "seq_chunk",
    "step", "start_s", "end_s"}, ...]}`` with stage 0 first. A dict may also give each stage
    as a list of op dicts, or ``ops`` instead of ``stages``.
    """
    if isinstance(schedule, Mapping):
        src = dict(schedule)
        raw_stages = src.get("stages", src.get("ops")) or []
        stages = [_stage_arrays(st) for st in raw_stages]
    else:
        src = {k: getattr(schedule, k) for k in ("schedule", "pp", "vpp", "num_micro_batches", "seq_chunks",
                                                  "makespan_s", "bubble_fraction")}
        stages = [_stage_arrays(st) for st in schedule.ops]
    ends = [max(st["end_s"]) for st in stages if st["end_s"]]
    makespan = finite(src.get("makespan_s"))
    if makespan is None:
        makespan = max(ends) if ends else 0.0
    busy = []
    for st in stages:
        seen: set[tuple[float, float]] = set()
        total = 0.0
        for t0, t1 in zip(st["start_s"], st["end_s"], strict=True):
            if (t0, t1) not in seen:  # ops run as one step share start and end: count once
                seen.add((t0, t1))
                total += t1 - t0
        busy.append(total)
    bubble = finite(src.get("bubble_fraction"))
    if bubble is None and makespan > 0 and stages:
        bubble = 1.0 - sum(busy) / (len(stages) * makespan)
    vpp = int(src.get("vpp") or max((max(st["chunk"], default=0) for st in stages), default=0) + 1)
    return {
        "schedule": str(src.get("schedule") or "?"),
        "pp": int(src.get("pp") or len(stages)),
        "vpp": vpp,
        "num_micro_batches": int(src.get("num_micro_batches") or
                                 (max((max(st["micro_batch"], default=-1) for st in stages), default=-1) + 1)),
        "seq_chunks": int(src.get("seq_chunks") or 1),
        "makespan_s": float(makespan),
        "bubble_fraction": float(bubble or 0.0),
        "busy_s": busy,
        "stages": stages,
    }


def _stage_arrays(stage: Any) -> dict[str, list[Any]]:
    names = ("kind", "micro_batch", "chunk", "seq_chunk", "step", "start_s", "end_s")
    if isinstance(stage, Mapping):
        cols = {k: list(np.asarray(stage[k]).tolist()) for k in names if k in stage}
    elif isinstance(stage, (list, tuple)) and (not stage or isinstance(stage[0], Mapping)):
        cols = {k: [op[k] for op in stage] for k in names if stage and k in stage[0]}
    else:  # StageOps
        cols = {k: np.asarray(getattr(stage, k)).tolist() for k in names if hasattr(stage, k)}
    n = len(cols.get("kind", []))
    for key in ("kind", "micro_batch", "start_s", "end_s"):
        if len(cols.get(key, [])) != n:
            raise NdplanError(f"timeline stage: '{key}' missing or of a different length than 'kind'")
    letters = ("F", "B", "W")
    cols["kind"] = [letters[int(k)] if not isinstance(k, str) else k.upper() for k in cols["kind"]]
    cols.setdefault("chunk", [0] * n)
    cols.setdefault("seq_chunk", [0] * n)
    if "step" not in cols:  # ops with equal start and end on a stage ran as one step
        step, prev = -1, None
        cols["step"] = []
        for t0, t1 in zip(cols["start_s"], cols["end_s"], strict=True):
            if (t0, t1) != prev:
                step += 1
                prev = (t0, t1)
            cols["step"].append(step)
    return {k: [int(v) for v in cols[k]] if k in ("micro_batch", "chunk", "seq_chunk", "step")
            else [float(v) for v in cols[k]] if k in ("start_s", "end_s") else cols[k] for k in names}


def simulate_timeline(strategy: Mapping[str, Any], compute_s: float | None = None,
                      durations: Mapping[str, float] | None = None,
                      chunk_seconds: Mapping[str, Any] | None = None, sends_waited: bool = False) -> dict[str, Any]:
    """Simulate one run of the strategy's pipeline schedule (a step runs it ``pipeline_runs`` times).

    With ``chunk_seconds`` (the step-time model's seconds per micro-batch of each stage's chunks,
    ``forward``, ``backward``, ``weight_grad`` as [pp][vpp] lists: ``TimeReport.chunk_seconds``)
    each chunk runs at its own times, as the step time's simulation ran them, with the p2p of
    ``durations``: seconds (``how`` = "chunks"), none where the runtime waits for its sends
    (``sends_waited``: the chunk seconds hold them, ``TimeReport.sends_waited``). Else, with ``durations`` (the step-time model's
    per-micro-batch seconds of the bottleneck stage: ``stage_forward_s``, ``stage_backward_s``,
    ``stage_weight_grad_s``, ``p2p_s``) every stage runs at those times, split evenly over its
    chunks: seconds (``how`` = "durations").
    Otherwise F:B:W = 1:1:1 where the schedule splits the backward, F:B = 1:2 elsewhere; with
    ``compute_s`` (compute seconds per step on the busiest device) scaled so the busiest stage
    computes that long (seconds, ``how`` = "scaled"), else in units of one forward of one
    micro-batch on one chunk (``how`` = "ratios").
    """
    from ndplan.schedule import simulate

    schedule = str(strategy.get("schedule") or "1f1b")
    pp = int(strategy.get("pp") or 1)
    vpp = int(strategy.get("vpp") or 1)
    m = int(strategy.get("num_micro_batches") or 1)
    seq_chunks = int(strategy.get("seq_chunks") or 1)
    # One run of the schedule: a step that runs it several times computes compute_s over them all.
    runs = int(strategy.get("pipeline_runs") or 1)
    compute_s = None if compute_s is None else compute_s / runs
    parts = [np.asarray(chunk_seconds.get(name, ()), dtype=float) for name in ("forward", "backward", "weight_grad")] \
        if isinstance(chunk_seconds, Mapping) else []
    if parts and all(part.shape == (pp, vpp) for part in parts):
        sim = schedule_to_dict(simulate(
            schedule, pp, vpp, m, seq_chunks=seq_chunks, forward_s=parts[0], backward_s=parts[1],
            weight_grad_s=parts[2], p2p_s=0.0 if sends_waited else float((durations or {}).get("p2p_s", 0.0)),
            overlap_f_and_b=False,  # as the step time's simulation runs it
        ))
        sim["unit"] = "s"
        sim["how"] = "chunks"
        sim["sends_waited"] = sends_waited
        sim["pipeline_runs"] = runs
        return sim
    if durations is not None:
        sim = schedule_to_dict(simulate(
            schedule, pp, vpp, m, seq_chunks=seq_chunks, forward_s=durations["stage_forward_s"] / vpp,
            backward_s=durations["stage_backward_s"] / vpp, weight_grad_s=durations["stage_weight_grad_s"] / vpp,
            p2p_s=float(durations.get("p2p_s", 0.0)),
        ))
        sim["unit"] = "s"
        sim["how"] = "durations"
        sim["pipeline_runs"] = runs
        return sim
    sim = schedule_to_dict(simulate(schedule, pp, vpp, m, seq_chunks=seq_chunks))
    busiest = max(sim["busy_s"]) if sim["busy_s"] else 0.0
    if compute_s is not None and compute_s > 0 and busiest > 0:
        scale = compute_s / busiest
        for st in sim["stages"]:
            st["start_s"] = [t * scale for t in st["start_s"]]
            st["end_s"] = [t * scale for t in st["end_s"]]
        sim["makespan_s"] *= scale
        sim["busy_s"] = [b * scale for b in sim["busy_s"]]
        sim["unit"] = "s"
        sim["how"] = "scaled"
    else:
        sim["unit"] = "forward"
        sim["how"] = "ratios"
    sim["pipeline_runs"] = runs
    return sim


# ------------------------------------------------------------------ search
def pareto_front(step_s: np.ndarray, peak_bytes: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated points (minimise both), by increasing peak memory.

    A point is on the front when no other point is at least as good in both and better in one;
    of exact duplicates the first is kept.
    """
    step = np.asarray(step_s, dtype=np.float64)
    peak = np.asarray(peak_bytes, dtype=np.float64)
    ok = np.flatnonzero(np.isfinite(step) & np.isfinite(peak))
    if not len(ok):
        return np.zeros(0, dtype=np.int64)
    order = ok[np.lexsort((ok, step[ok], peak[ok]))]  # by peak, then step, then index
    s = step[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], s[:-1])))
    return order[s < best_before].astype(np.int64)


def downsample(
    x: np.ndarray, y: np.ndarray, max_points: int, keep: np.ndarray | None = None, *, logx: bool = False,
    logy: bool = False,
) -> np.ndarray:
    """At most ``max_points`` indices that draw like all points; ``keep`` is always included.

    The plane is cut into a grid (in log space on a log axis); each occupied cell keeps its
    point with the least y (the fastest), so the lower envelope and outliers survive and dense
    regions thin out. The grid is refined as far as the budget allows.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    keep = np.unique(np.asarray(keep if keep is not None else [], dtype=np.int64))
    mask = np.isfinite(x) & np.isfinite(y)
    if logx:
        mask &= x > 0
    if logy:
        mask &= y > 0
    ok = np.flatnonzero(mask)
    if len(ok) + len(keep) <= max_points:
        return np.union1d(ok, keep)
    budget = max(max_points - len(keep), 1)
    gx = np.log10(x[ok]) if logx else x[ok]
    gy = np.log10(y[ok]) if logy else y[ok]

    def unit(v: np.ndarray) -> np.ndarray:
        span = float(v.max() - v.min())
        return (v - v.min()) / span if span > 0 else np.zeros_like(v)

    ux, uy = unit(gx), unit(gy)
    order = np.argsort(y[ok], kind="stable")  # fastest first, so np.unique keeps each cell's fastest

    def thin(cells: int) -> np.ndarray:
        ix = np.minimum((ux * cells).astype(np.int64), cells - 1)
        iy = np.minimum((uy * cells).astype(np.int64), cells - 1)
        _, first = np.unique((ix * cells + iy)[order], return_index=True)
        return ok[order[first]]

    # the finest grid whose occupied cells fit the budget (occupancy grows with the grid)
    lo, hi = 1, max(2, int(math.sqrt(len(ok))) * 4)
    best = thin(lo)
    for _ in range(24):
        if hi - lo <= max(1, lo // 50):
            break
        mid = (lo + hi) // 2
        picked = thin(mid)
        if len(picked) <= budget:
            lo, best = mid, picked
        else:
            hi = mid
    return np.union1d(best, keep)


def candidate_cloud(step_s: Any, peak_bytes: Any, max_points: int = 20000) -> dict[str, Any]:
    """All candidates thinned for a saved result: ``{"step_s", "peak_bytes", "n_total"}``.

    The Pareto front is kept exactly and the rest thinned as the report draws it, so a search
    can save its whole trade-off in a few hundred KiB of JSON (``"candidates"``).
    """
    step = np.asarray(step_s, dtype=np.float64).ravel()
    peak = np.asarray(peak_bytes, dtype=np.float64).ravel()
    keep = downsample(peak, step, max_points, pareto_front(step, peak))
    return {"step_s": step[keep].tolist(), "peak_bytes": [round(float(v)) for v in peak[keep]],
            "n_total": int(len(step))}


def candidate_arrays(value: Any) -> tuple[np.ndarray, np.ndarray]:
    """(step_s, peak_bytes) arrays from any of the accepted candidate shapes."""
    if isinstance(value, Mapping):
        step = value.get("step_s")
        peak = value.get("peak_bytes")
        if step is None or peak is None:
            raise NdplanError("candidates: expected 'step_s' and 'peak_bytes' arrays")
        s, p = np.asarray(step, dtype=np.float64).ravel(), np.asarray(peak, dtype=np.float64).ravel()
    elif len(value) and isinstance(value[0], Mapping):
        s = np.array([finite(v.get("step_s")) for v in value], dtype=np.float64)
        p = np.array([finite(v.get("peak_bytes")) for v in value], dtype=np.float64)
    else:
        arr = np.asarray(value, dtype=np.float64)
        if arr.size == 0:
            return np.zeros(0), np.zeros(0)
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise NdplanError("candidates: expected (step_s, peak_bytes) pairs")
        s, p = arr[:, 0], arr[:, 1]
    if len(s) != len(p):
        raise NdplanError(f"candidates: {len(s)} step times but {len(p)} peak sizes")
    return s, p


#: Row keys left out of the table (still in the raw result): internals of the time model.
ROW_HIDDEN = frozenset({
    "label", "breakdown", "stages", "model_flops", "hardware_flops", "stage_forward_s", "stage_backward_s",
    "stage_weight_grad_s", "bottleneck_stage", "dp_step_s", "p2p_s", "optimizer_update_s", "makespan_s",
})
#: Same setting under two names: the first is kept.
ROW_ALIASES = {"micro_batch_size": "mbs", "sequence_parallel": "sp"}


#: A ranked row's figures the page formats as numbers (headline tiles, table cells).
_ROW_NUMBERS = ("step_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "hfu", "peak_bytes")


def _rows_name(data: Mapping[str, Any]) -> str:
    """The name the result gives its ranked rows (``ranked`` for a search), for messages."""
    return next((key for key in ROW_KEYS if data.get(key) is not None), "rows")


def flatten_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """One level of nesting lifted into columns (``degrees``/``strategy``); settings a row already
    has at the top level are not repeated; breakdowns and per-stage lists of dicts left out."""
    flat: dict[str, Any] = {}
    nested: dict[str, Any] = {}
    for key, value in row.items():
        if key in ("breakdown", "stages"):
            continue
        if isinstance(value, Mapping):
            for sub, item in value.items():
                if isinstance(item, Mapping):
                    if "name" in item:
                        nested.setdefault(str(sub), item["name"])
                    continue
                if isinstance(item, (list, tuple)) and len(item) > 64:
                    continue
                nested.setdefault(str(sub), jsonable(item))
        elif isinstance(value, (list, tuple, np.ndarray)):
            if len(value) <= 64:
                flat[key] = jsonable(value)
        else:
            flat[key] = jsonable(value)
    for key, value in nested.items():
        alias = ROW_ALIASES.get(key)
        if key not in flat and not (alias and alias in flat):
            flat[key] = value
            flat.setdefault("_nested", []).append(key)
    return flat


def row_peak(flat: Mapping[str, Any]) -> float | None:
    peak = finite(flat.get("peak_bytes"))
    if peak is not None:
        return peak
    for key, value in flat.items():
        if "peak" in key and isinstance(value, list) and value:
            numbers = [finite(v) for v in value]
            if all(n is not None for n in numbers):
                return max(n for n in numbers if n is not None)
    return None


def search_data(result: Mapping[str, Any], rows: list[dict[str, Any]], max_points: int,
                limit: float | None) -> dict[str, Any] | None:
    """Scatter data: downsampled candidates, the exact Pareto front, the top rows, the limit."""
    value = _first(result, CANDIDATE_KEYS)
    if value is None and result.get("candidates_time_s") is not None and result.get("candidates_peak_bytes") is not None:
        value = {"step_s": result["candidates_time_s"], "peak_bytes": result["candidates_peak_bytes"]}
    front_value = _first(result, PARETO_KEYS)
    if front_value is not None and not len(front_value):
        front_value = None  # an empty front given: compute it from the candidates
    if not isinstance(value, (Mapping, list, tuple, np.ndarray)):
        if not isinstance(front_value, (list, tuple)) or not front_value or not isinstance(front_value[0], Mapping):
            return None
        value = []  # only the front and the ranked rows are known
    step, peak = candidate_arrays(value)
    n_total = len(step)
    if isinstance(value, Mapping) and finite(value.get("n_total")) is not None:
        n_total = max(n_total, int(value["n_total"]))
    evaluated = result.get("evaluated")
    if isinstance(evaluated, int) and not isinstance(evaluated, bool):
        n_total = max(n_total, evaluated)  # `ndplan search`: valid candidates priced
    valid = np.isfinite(step) & np.isfinite(peak)
    if front_value is None:
        front_idx = pareto_front(step, peak)
        fx, fy = peak[front_idx], step[front_idx]
    elif len(front_value) and not isinstance(front_value[0], (Mapping, list, tuple, np.ndarray)) \
            and float(front_value[0]).is_integer():
        front_idx = np.asarray(front_value, dtype=np.int64)
        if len(front_idx) and (front_idx.min() < 0 or front_idx.max() >= n_total):
            raise NdplanError("pareto: an index is outside the candidates")
        fx, fy = peak[front_idx], step[front_idx]
    else:
        fs, fp = candidate_arrays(front_value)
        front_idx = np.zeros(0, dtype=np.int64)
        fx, fy = fp, fs
    order = np.argsort(fx, kind="stable")
    fx, fy = fx[order], fy[order]
    positive = valid & (step > 0) & (peak > 0)
    all_peak = np.concatenate([peak[positive], fx[fx > 0]])
    all_step = np.concatenate([step[positive], fy[fy > 0]])
    logx = bool(len(all_peak) and all_peak.max() / all_peak.min() > 12)
    logy = bool(len(all_step) and all_step.max() / all_step.min() > 12)
    shown = downsample(peak, step, max_points, front_idx, logx=logx, logy=logy)
    shown = shown[np.isfinite(step[shown]) & np.isfinite(peak[shown])]
    feasible: int | None = int(np.sum(valid & (peak <= limit))) if limit is not None else int(valid.sum())
    if n_total > len(step):  # thinned or partial: only the result's own count is right
        fitting = result.get("fitting")
        feasible = fitting if isinstance(fitting, int) and not isinstance(fitting, bool) else None
    top = []
    for rank, row in enumerate(rows[:10], start=1):
        t = finite(row.get("step_s"))
        b = row_peak(row)
        if t is not None and b is not None:
            top.append({"rank": int(row.get("rank", rank)), "step_s": t, "peak_bytes": b})
    return {
        "n_total": n_total,
        "n_given": int(len(step)),
        "n_dropped": int(len(step) - valid.sum()),
        "n_feasible": feasible,
        "n_shown": int(len(shown)),
        "step_s": step[shown],
        "peak_bytes": peak[shown],
        "front_step_s": fy,
        "front_peak_bytes": fx,
        "top": top,
        "limit_bytes": limit,
        "logx": logx,
        "logy": logy,
    }


# ------------------------------------------------------------------ everything
def detect_kind(result: Mapping[str, Any]) -> str:
    kind = result.get("kind") or result.get("command")
    if isinstance(kind, str) and kind:
        return kind
    if _first(result, ROW_KEYS) is not None or _first(result, CANDIDATE_KEYS) is not None:
        return "search"
    if "balance" in result or "balanced" in result or "baseline" in result:
        return "balance"
    return "estimate"


def _name(value: Any) -> str | None:
    if isinstance(value, Mapping):
        name = value.get("name")
        return str(name) if name is not None else None
    return None if value is None else str(value)


#: Options an estimate's JSON records beside runtime and attention, which `ndplan estimate` flags set.
REPRODUCED_OPTIONS = ("include_overhead", "loss_parallel", "loss_upcast", "moe_imbalance", "moe_capacity_factor",
                      "selective_policy", "modules", "experts_outside_fsdp", "gradient_accumulation_fusion",
                      "census_records")


def prepare(result: Any, *, top: int = 50, max_points: int = 4000, title: str | None = None,
            simulate_schedule: bool = True) -> dict[str, Any]:
    """Everything the report shows, from one result. See the module docstring for the keys."""
    from ndplan import __version__

    data = as_dict(result)
    kind = detect_kind(data)
    raw_rows = _first(data, ROW_KEYS) or []
    if not isinstance(raw_rows, list):
        raise NdplanError("search rows must be a list of dicts")
    rows = [dict(r) for r in raw_rows if isinstance(r, Mapping)][: max(top, 0)]
    for i, row in enumerate(rows):
        for key in _ROW_NUMBERS:
            # the page formats these as numbers: a quoted "3.5" was a TypeError traceback
            value = row.get(key)
            if key == "peak_bytes" and isinstance(value, list):  # per stage: the table shows the largest
                continue
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise NdplanError(f"{_rows_name(data)}[{i}]: {key} must be a number, got {value!r}")
    flat_rows = [flatten_row(r) for r in rows]
    for i, flat in enumerate(flat_rows, start=1):
        flat.setdefault("rank", i)
    limit = memory_limit(data)
    strategy = data.get("strategy") if isinstance(data.get("strategy"), Mapping) else None
    if strategy is not None:
        _check_strategy(strategy)
    balanced = data.get("balanced")
    if kind == "balance" and isinstance(balanced, Mapping) and isinstance(balanced.get("strategy"), Mapping):
        # A balance result is reported (timeline, step, reproduce line) as its balanced settings.
        strategy = balanced["strategy"]
    best_strategy: Mapping[str, Any] | None = strategy
    if best_strategy is None and flat_rows:
        best_strategy = flat_rows[0]

    memory = []
    for name, source in _memory_sources(data, rows):
        memory.append({
            "name": name,
            # the limit a search or balance ran under, else what the source states (the device's)
            "capacity_bytes": finite(data.get("memory_limit_bytes")) or finite(_first(source, LIMIT_KEYS)) or limit,
            "stages": memory_stages(source["stages"]),
            # one device's share of its node's host memory, where the source states it
            "host_capacity_bytes": finite(source.get("host_capacity_bytes")),
        })
    if kind == "balance":
        # The headline is the plan the step, throughput, timeline and Reproduce line are: the
        # balanced settings (the verdict, even where it keeps the strategy as given, says so apart).
        memory.sort(key=lambda entry: entry["name"] != "balanced")

    perf_bars = []
    perf = (find_perf(balanced) if kind == "balance" and isinstance(balanced, Mapping) else None) or find_perf(data)
    if perf is not None:
        segments = perf_segments(perf)
        if segments:
            perf_bars.append({"label": strategy_short(strategy) if strategy else "this strategy",
                              "segments": segments, "step_s": finite(perf.get("step_s"))})
    for i, (row, flat) in enumerate(zip(rows, flat_rows, strict=True)):
        if i >= 10:
            break
        row_perf = find_perf(row) or (row if isinstance(row.get("breakdown"), Mapping) else None)
        if row_perf is not None:
            segments = perf_segments(row_perf)
            if segments:
                perf_bars.append({"label": f"#{flat['rank']} {strategy_short(flat)}", "segments": segments,
                                  "step_s": finite(row_perf.get("step_s"))})

    timeline = None
    timeline_note = ""
    raw_timeline = _first(data, ("timeline", "schedule_result"))
    if raw_timeline is not None:
        timeline = schedule_to_dict(raw_timeline)
        timeline.setdefault("unit", str(raw_timeline.get("unit", "s")) if isinstance(raw_timeline, Mapping) else "s")
    elif simulate_schedule and best_strategy is not None and best_strategy.get("num_micro_batches"):
        source_perf = perf if strategy is not None else (find_perf(rows[0]) if rows else None)
        compute = finite((source_perf.get("breakdown") or {}).get("compute")) if source_perf else None
        durations = _durations(source_perf) or (_durations(rows[0]) if rows and strategy is None else None)
        chunks = source_perf.get("chunk_seconds") if isinstance(source_perf, Mapping) else None
        try:
            timeline = simulate_timeline(best_strategy, compute, durations, chunks,
                                         bool(source_perf.get("sends_waited")) if isinstance(source_perf, Mapping) else False)
        except NdplanError as error:
            timeline_note = f"no timeline: {error}"
    if timeline is not None:
        timeline["label"] = strategy_short(best_strategy) if best_strategy else timeline["schedule"]
        timeline["simulated"] = raw_timeline is None

    search = search_data(data, flat_rows, max_points, limit)

    inputs = {
        "model": _name(data.get("model")),
        "hardware": _name(data.get("hardware")),
        "devices": data.get("devices"),
        "strategy": jsonable(strategy) if strategy else None,
        "runtime": data.get("runtime"),
        "attention": data.get("attention"),
        **{key: data[key] for key in REPRODUCED_OPTIONS if data.get(key) is not None},
    }
    if isinstance(data.get("time"), Mapping) and isinstance(data["time"].get("overlap"), Mapping):
        inputs["overlap"] = dict(data["time"]["overlap"])
    skip = {"stages", "strategy", "model", "hardware", "devices", "runtime", "attention", "timeline", "notes",
            "report_notes",
            "schedule_result", *ROW_KEYS, *CANDIDATE_KEYS, *PARETO_KEYS, *PERF_KEYS, *MEMORY_SOURCE_KEYS}
    extra = {k: jsonable(v) for k, v in data.items() if k not in skip and not isinstance(v, (list, dict))}
    settings = {k: jsonable(v) for k, v in data.items()
                if k not in skip and isinstance(v, dict) and len(str(v)) < 4000}
    model_detail = data.get("model") if isinstance(data.get("model"), Mapping) else None
    hardware_detail = data.get("hardware") if isinstance(data.get("hardware"), Mapping) else None

    if title is None:
        where = inputs["hardware"] or "?"
        if inputs["devices"]:
            where = f"{inputs['devices']}× {where}"
        title = f"{inputs['model'] or 'ndplan'} on {where}"
    return {
        "kind": kind,
        "title": title,
        "version": __version__,
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "inputs": inputs,
        "model_detail": jsonable(model_detail) if model_detail else None,
        "hardware_detail": jsonable(hardware_detail) if hardware_detail else None,
        "result_scalars": extra,
        "result_settings": settings,
        "strategy_short": strategy_short(strategy) if strategy else (
            strategy_short(flat_rows[0]) if flat_rows else ""),
        "fits": data.get("fits"),
        "peak_bytes": finite(data.get("peak_bytes")),
        "peak_stage": data.get("peak_stage"),
        "limit_bytes": limit,
        # search and balance state the limit they ran under (--memory-limit, else the device's)
        "user_limit": finite(data.get("memory_limit_bytes")) is not None,
        "memory": memory,
        "perf": jsonable(perf) if perf else None,
        "perf_bars": perf_bars,
        "timeline": timeline,
        "timeline_note": timeline_note,
        "search": search,
        "rows": flat_rows,
        "n_rows_total": len(raw_rows),
        "notes": [str(n) for key in ("notes", "report_notes") if isinstance(data.get(key), list)
                  for n in data[key]] + _unfused_notes(perf),
        "cautions": cautions(data, perf, rows),
    }


def _unfused_notes(perf: Mapping[str, Any] | None) -> list[str]:
    """Why the step prices the launch's weight-gradient adds apart, where it does."""
    from ndplan.perf.accumulation import unfused_note

    return [unfused_note(str(perf["unfused_why"]))] if perf and perf.get("unfused_why") else []


def cautions(data: Mapping[str, Any], perf: Mapping[str, Any] | None, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the estimators are known to miss for the reported strategy, each once: the memory
    model's (``caveats``), the step time's (``perf``'s), or for a search its winner's (the first
    row's, memory and step time together)."""
    found: list[str] = []
    for source in (data, perf or {}, rows[0] if rows else {}):
        listed = source.get("caveats")
        if isinstance(listed, list):
            found += [str(item) for item in listed]
    return list(dict.fromkeys(found))
