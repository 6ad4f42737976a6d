"""``simulate``: the timeline of one pipeline step, with the activation counts beside it.

Every stage runs its op order (:mod:`ndplan.schedule.builders`) one step at a time, a step
as soon as the stage is free and its inputs have arrived (:mod:`ndplan.schedule.graph`).
Times are in seconds from the start of the pipeline step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from numbers import Real

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ndplan.errors import NdplanError
from ndplan.schedule.builders import StagePlan, build_plan
from ndplan.schedule.graph import Graph, build_graph, step_ends, time_steps
from ndplan.schedule.memory import InFlight, StageInFlight, in_flight
from ndplan.schedule.ops import KIND_NAMES, SPLIT_BACKWARD, B, F, Op, model_chunk_table, validate


@dataclass(frozen=True)
class StageOps:
    """One stage's ops in execution order, as parallel arrays.

    kind: 0=F, 1=B, 2=W (see ``KIND_NAMES``); chunk is the local chunk on the stage.
    step: ops with the same step index ran as one unit (DualPipeV's overlapped F&B and its
        full backwards B+W); they share start_s and end_s.
    start_s, end_s: seconds from the start of the pipeline step.
    """

    kind: NDArray[np.int64]
    micro_batch: NDArray[np.int64]
    chunk: NDArray[np.int64]
    seq_chunk: NDArray[np.int64]
    step: NDArray[np.int64]
    start_s: NDArray[np.float64]
    end_s: NDArray[np.float64]

    def __len__(self) -> int:
        return len(self.kind)

    def __iter__(self) -> Iterator[Op]:
        for k, mb, c, q, t0, t1 in zip(
            self.kind.tolist(),
            self.micro_batch.tolist(),
            self.chunk.tolist(),
            self.seq_chunk.tolist(),
            self.start_s.tolist(),
            self.end_s.tolist(),
            strict=True,
        ):
            yield Op(KIND_NAMES[k], mb, c, q, t0, t1)


@dataclass(frozen=True)
class ScheduleResult:
    """Timeline and activation counts of one pipeline schedule.

    ops: per stage, the ops with their times (seconds).
    model_chunk: [pp, vpp] global model-chunk index (forward order) held by each local chunk.
    makespan_s: end of the last op (seconds; the pipeline starts at 0).
    busy_s: [pp] seconds each stage computes (overlapped steps counted once).
    bubble_fraction: 1 - sum(busy_s) / (pp * makespan_s).
    memory: the activation counts (see :class:`ndplan.schedule.memory.InFlight`).
    """

    schedule: str
    pp: int
    vpp: int
    num_micro_batches: int
    seq_chunks: int
    ops: tuple[StageOps, ...]
    model_chunk: NDArray[np.int64]
    makespan_s: float
    busy_s: NDArray[np.float64]
    bubble_fraction: float
    memory: InFlight

    @property
    def peak_in_flight(self) -> NDArray[np.float64]:
        """[pp, vpp] peak micro-batches whose activations a stage holds per chunk (until B)."""
        return self.memory.peak

    @property
    def peak_in_flight_w(self) -> NDArray[np.float64]:
        """[pp, vpp] peak micro-batches past B still holding what W needs (split schedules)."""
        return self.memory.peak_w

    @property
    def peak_in_flight_total(self) -> NDArray[np.float64]:
        """[pp] peak over time of the held count summed across a stage's chunks."""
        return self.memory.peak_total

    @property
    def peak_in_flight_stage(self) -> tuple[StageInFlight, ...]:
        """Per stage, the held counts at every op boundary (row i after op i; see boundary_times_s)."""
        return self.memory.stages

    def boundary_times_s(self, stage: int) -> NDArray[np.float64]:
        """Times (s) of the rows of ``peak_in_flight_stage[stage]``: 0, then each op's end."""
        return np.concatenate(([0.0], self.ops[stage].end_s))

    def iter_ops(self, stage: int) -> Iterator[Op]:
        """The stage's ops as :class:`Op` tuples (kind as 'F'/'B'/'W')."""
        return iter(self.ops[stage])


def simulate(
    schedule: str,
    pp: int,
    vpp: int,
    num_micro_batches: int,
    *,
    seq_chunks: int = 1,
    forward_s: ArrayLike | None = None,
    backward_s: ArrayLike | None = None,
    weight_grad_s: ArrayLike | None = None,
    p2p_s: float = 0.0,
    overlap_f_and_b: bool = True,
) -> ScheduleResult:
    """Simulate one pipeline step of ``schedule``: timeline, makespan, bubble, activation counts.

    Durations are seconds per op for one whole micro-batch on one stage's chunk, given as a
    number or anything broadcastable to [pp, vpp]:

    forward_s: F. Default 1.
    backward_s: B: the input-gradient part in schedules that split the backward
        (zb-h1, zbv, dualpipev), the whole backward otherwise. Default 1 when split, else 2.
    weight_grad_s: W, the weight-gradient part. Default 1 when split, else 0. In schedules
        that do not split, B runs the whole backward and lasts backward_s + weight_grad_s,
        so the same split figures can be passed to every schedule.
    p2p_s: seconds per activation or gradient transfer between stages (latency model).
    overlap_f_and_b: DualPipeV runs a forward and a full backward (B+W) overlapped as one
        step, lasting max(F, B+W) when True and F+B+W when False.

    Seq1F1B: each sub-sequence op lasts 1/seq_chunks of the micro-batch figure (the sequence
    is taken as split into chunks of equal cost).
    """
    pp, vpp, num_micro_batches, seq_chunks = validate(schedule, pp, vpp, num_micro_batches, seq_chunks)
    plan, graph, step_s, p2p = _timeline_inputs(schedule, pp, vpp, num_micro_batches, seq_chunks, forward_s, backward_s,
                                                weight_grad_s, p2p_s, overlap_f_and_b)
    starts, ends = time_steps(graph, step_s, p2p)

    stage_ops = []
    busy = np.zeros(pp)
    for s, st in enumerate(plan):
        t0 = starts[graph.offsets[s] : graph.offsets[s + 1]]
        t1 = ends[graph.offsets[s] : graph.offsets[s + 1]]
        busy[s] = float(np.sum(t1 - t0))
        stage_ops.append(
            StageOps(
                kind=st.kind,
                micro_batch=st.micro_batch,
                chunk=st.chunk,
                seq_chunk=st.seq_chunk,
                step=st.step,
                start_s=np.repeat(t0, st.step_len),
                end_s=np.repeat(t1, st.step_len),
            )
        )
    makespan = float(ends.max()) if len(ends) else 0.0
    bubble = 1.0 - float(busy.sum()) / (pp * makespan) if makespan > 0 else 0.0
    return ScheduleResult(
        schedule=schedule,
        pp=pp,
        vpp=vpp,
        num_micro_batches=num_micro_batches,
        seq_chunks=seq_chunks,
        ops=tuple(stage_ops),
        model_chunk=np.array(model_chunk_table(schedule, pp, vpp), dtype=np.int64),
        makespan_s=makespan,
        busy_s=busy,
        bubble_fraction=bubble,
        memory=in_flight(schedule, pp, vpp, num_micro_batches, seq_chunks),
    )


def simulated_makespan_s(
    schedule: str,
    pp: int,
    vpp: int,
    num_micro_batches: int,
    *,
    seq_chunks: int = 1,
    forward_s: ArrayLike | None = None,
    backward_s: ArrayLike | None = None,
    weight_grad_s: ArrayLike | None = None,
    p2p_s: float = 0.0,
    overlap_f_and_b: bool = True,
) -> float:
    """``simulate(...).makespan_s`` alone (arguments as there): the same timeline, without the
    per-stage ops and the activation counts, which cost more than the timing where only the
    makespan is read (the search's interleaved stalls: a schedule's activation counts are half
    of what ``simulate`` pays the first time it sees the schedule)."""
    pp, vpp, num_micro_batches, seq_chunks = validate(schedule, pp, vpp, num_micro_batches, seq_chunks)
    _, graph, step_s, p2p = _timeline_inputs(schedule, pp, vpp, num_micro_batches, seq_chunks, forward_s, backward_s,
                                             weight_grad_s, p2p_s, overlap_f_and_b)
    # The ends alone (not the starts, which only simulate reports); the sentinel's 0.0 among
    # them is the makespan of an empty timeline.
    return max(step_ends(graph, step_s, p2p))


def _timeline_inputs(
    schedule: str, pp: int, vpp: int, num_micro_batches: int, seq_chunks: int, forward_s: ArrayLike | None,
    backward_s: ArrayLike | None, weight_grad_s: ArrayLike | None, p2p_s: float, overlap_f_and_b: bool,
) -> tuple[tuple[StagePlan, ...], Graph, NDArray[np.float64], float]:
    """(plan, graph, seconds of every step, p2p seconds) of ``simulate``'s timeline, for
    validated sizes."""
    plan = build_plan(schedule, pp, vpp, num_micro_batches, seq_chunks)
    if isinstance(p2p_s, bool) or not (isinstance(p2p_s, Real) and np.isfinite(p2p_s) and p2p_s >= 0):
        raise NdplanError(f"p2p_s must be a finite number >= 0 seconds, got {p2p_s!r}")
    split = schedule in SPLIT_BACKWARD
    f = _durations("forward_s", forward_s, 1.0, pp, vpp)
    b = _durations("backward_s", backward_s, 1.0 if split else 2.0, pp, vpp)
    w = _durations("weight_grad_s", weight_grad_s, 1.0 if split else 0.0, pp, vpp)
    if not split:
        b = b + w  # B runs the whole backward
    f = f / seq_chunks
    b = b / seq_chunks

    graph = build_graph(schedule, pp, vpp, num_micro_batches, seq_chunks)
    return plan, graph, _step_seconds(plan, f, b, w, overlap_f_and_b), float(p2p_s)


def _durations(name: str, value: ArrayLike | None, default: float, pp: int, vpp: int) -> NDArray[np.float64]:
    """Broadcast a duration argument to a [pp, vpp] array, refusing negatives and NaN."""
    if value is None:
        return np.full((pp, vpp), default)
    try:
        arr = np.broadcast_to(np.asarray(value, dtype=np.float64), (pp, vpp))
    except (ValueError, TypeError) as exc:
        raise NdplanError(f"{name} must be a number or broadcast to [pp, vpp] = [{pp}, {vpp}]") from exc
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise NdplanError(f"{name} must be finite and >= 0 seconds")
    return arr


def _step_seconds(
    plan: tuple[StagePlan, ...], f: NDArray[np.float64], b: NDArray[np.float64], w: NDArray[np.float64], overlap: bool
) -> NDArray[np.float64]:
    """Seconds of every step, stage after stage (as the graph numbers them): the sum of its ops,
    or max(F, B+W) for an overlapped pair; f, b, w [pp, vpp]. Every stage's ops at once (one
    set of numpy calls, not one per stage: their cost, not the ops', is most of it)."""
    stage = np.repeat(np.arange(len(plan)), [len(st) for st in plan])
    kind, chunk, step_len = (np.concatenate([getattr(st, name) for st in plan]) for name in ("kind", "chunk", "step_len"))
    is_f = kind == F
    op_s = np.where(is_f, f[stage, chunk], np.where(kind == B, b[stage, chunk], w[stage, chunk]))
    first = np.cumsum(step_len) - step_len
    fwd = np.add.reduceat(np.where(is_f, op_s, 0.0), first)
    bwd = np.add.reduceat(np.where(is_f, 0.0, op_s), first)
    if not overlap:
        return fwd + bwd
    has_f = np.add.reduceat(is_f.astype(np.int64), first) > 0
    has_bw = np.add.reduceat((~is_f).astype(np.int64), first) > 0
    return np.where(has_f & has_bw, np.maximum(fwd, bwd), fwd + bwd)
