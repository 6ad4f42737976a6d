"""The step-level dependency graph of a schedule, and the pass that times it.

A step starts when its stage has finished the previous step and every op in it has its
inputs:

* F of model chunk g needs F of chunk g-1 for the same micro-batch (and sub-sequence); for
  Seq1F1B also F of the previous sub-sequence on g.
* B of model chunk g needs B of chunk g+1, or its own F on the last model chunk; for Seq1F1B
  also B of the next sub-sequence on g.
* W needs its B (already satisfied when the B runs in the same step: a full backward).

An input made on another stage arrives ``p2p_s`` later (the latency of one transfer; link
contention is not modelled). As each stage's order is fixed, a step's start is
max(end of the stage's previous step, end of each input [+ p2p_s]): one pass that runs each
stage's steps in its order until one waits for an input not yet timed, O(steps). The graph
depends only on (schedule, pp, vpp, num_micro_batches, seq_chunks), so it is built once and
cached; each call with new durations costs one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ndplan.schedule.builders import build_plan
from ndplan.schedule.ops import B, F, W, model_chunk_table


@dataclass(frozen=True)
class Graph:
    """What each step waits for. Steps are numbered stage after stage.

    Index ``n`` is a sentinel step, done at time 0, that stands for "no input".
    prev: the stage's previous step. a, b: inputs that may come from another stage (xa, xb
    = 1.0 when they do, so they pay p2p_s); b is used only by DualPipeV's F&B pairs.
    c: a same-stage input (Seq1F1B sub-sequence order).
    """

    n: int
    offsets: list[int]
    prev: NDArray[np.int64]
    a: NDArray[np.int64]
    b: NDArray[np.int64]
    c: NDArray[np.int64]
    xa: NDArray[np.float64]
    xb: NDArray[np.float64]


def _op_inputs(
    kind: NDArray[np.int64],
    base: NDArray[np.int64],
    g: NDArray[np.int64],
    q: NDArray[np.int64],
    step: NDArray[np.int64],
    stage: NDArray[np.int64],
    stage_of: NDArray[np.int64],
    n_chunks: int,
    k: int,
) -> tuple[NDArray[np.int64], NDArray[np.bool_], NDArray[np.int64]]:
    """Per op, every stage's ops together: (input that may be remote, whether it is, same-stage
    input).

    Ops are named by ``base*3 + kind`` with base = (mb*G + g)*k + q; -1 means none. ``stage``
    is each op's stage, ``stage_of[g]`` the stage that runs model chunk g; ``step`` numbers the
    steps across the stages (so a stage's last step and the next one's first never match).
    """
    is_f = kind == F
    is_b = kind == B
    last = g == n_chunks - 1
    dep1 = np.where(is_f & (g > 0), (base - k) * 3 + F, -1)
    cross = is_f & (g > 0) & (stage_of[np.maximum(g - 1, 0)] != stage)
    dep1 = np.where(is_b, np.where(last, base * 3 + F, (base + k) * 3 + B), dep1)
    cross |= is_b & ~last & (stage_of[np.minimum(g + 1, n_chunks - 1)] != stage)
    # W waits for its B unless that B sits just before it in the same step.
    key = base * 3 + kind
    b_beside = np.zeros(len(kind), dtype=bool)
    b_beside[1:] = (step[1:] == step[:-1]) & (key[:-1] == base[1:] * 3 + B)
    dep1 = np.where((kind == W) & ~b_beside, base * 3 + B, dep1)
    dep2 = np.where(is_f & (q > 0), (base - 1) * 3 + F, -1)
    dep2 = np.where(is_b & (q < k - 1), (base + 1) * 3 + B, dep2)
    return dep1, cross, dep2


@lru_cache(maxsize=256, typed=True)
def build_graph(schedule: str, pp: int, vpp: int, m: int, k: int = 1) -> Graph:
    """The dependency graph of a schedule's steps (cached)."""
    plan = build_plan(schedule, pp, vpp, m, k)
    table = np.array(model_chunk_table(schedule, pp, vpp), dtype=np.int64)
    n_chunks = pp * vpp
    stage_of = np.empty(n_chunks, dtype=np.int64)
    for s in range(pp):
        stage_of[table[s]] = s

    # Every stage's ops at once, laid end to end (numpy's cost per call, not per op, is most of
    # a graph's: one set of calls rather than one per stage), steps numbered across the stages.
    step_counts = [len(st.step_len) for st in plan]
    offsets = np.cumsum([0, *step_counts]).tolist()
    op_counts = [len(st) for st in plan]
    stage = np.repeat(np.arange(pp), op_counts)
    kind, chunk, micro_batch, seq_chunk, step, step_len = (
        np.concatenate([getattr(st, name) for st in plan])
        for name in ("kind", "chunk", "micro_batch", "seq_chunk", "step", "step_len"))
    step = step + np.repeat(offsets[:-1], op_counts)
    g = table[stage, chunk]
    base = (micro_batch * n_chunks + g) * k + seq_chunk
    dep1, cross, dep2 = _op_inputs(kind, base, g, seq_chunk, step, stage, stage_of, n_chunks, k)
    n_ops = len(kind)
    n = offsets[-1]
    first = np.cumsum(step_len) - step_len  # each step's first op

    # Inputs as step numbers; an input of -1 reads the last slot, which holds the sentinel n.
    step_of_op = np.full(3 * m * n_chunks * k + 1, n, dtype=np.int64)
    step_of_op[base * 3 + kind] = step
    dep1_step = step_of_op[dep1]
    # A step has at most two ops with an input (DualPipeV's F&B pair; its third op, the W,
    # waits on the B beside it) and a same-stage input only when it has one op (Seq1F1B).
    second = np.minimum(first + 1, n_ops - 1)
    third = np.minimum(first + 2, n_ops - 1)
    if (
        np.any(step_len > 3)
        or np.any((step_len == 3) & (dep1[third] >= 0))
        or np.any((step_len > 1) & ((dep2[first] >= 0) | (dep2[second] >= 0)))
    ):
        raise RuntimeError("a pipeline schedule builder made a step of unexpected shape")
    has2 = step_len >= 2
    a = dep1_step[first]
    b = np.where(has2, dep1_step[second], n)
    c = step_of_op[dep2[first]]
    prev = np.arange(-1, n - 1)
    prev[np.array(offsets[:-1])] = n
    return Graph(
        n=n,
        offsets=offsets,
        prev=prev,
        a=a,
        b=b,
        c=c,
        xa=cross[first].astype(np.float64),
        xb=np.where(has2, cross[second], False).astype(np.float64),
    )


def _run_stages(
    offsets: list[int], a: list[int], da: list[float], d: list[float],
    bc: tuple[list[int], list[float], list[int]] | None = None,
) -> list[float]:
    """End of every step, and 0.0 for the sentinel (the last entry): a step ends ``d`` after the
    latest of its stage's previous step and its inputs a (+ ``da``), b (+ db) and c, ``bc`` =
    (b, db, c) given only where some step has input b or c.

    Every stage runs its steps in its own order until one waits for an input not yet timed, then
    parks on that input; timing the input wakes it. Each step is timed once, when its inputs
    are, so no topological order need be worked out first: one pass of plain list reads per
    step (the search's interleaved makespans time each graph once; an order found beforehand
    was a second pass as long). A stage left parked means the builder's order cannot run: that
    is a bug, so RuntimeError rather than NdplanError. The maxima are those of ``time_steps``'
    starts (of the same sums, so the ends are the same to the bit)."""
    pp = len(offsets) - 1
    n = offsets[-1]
    end = [-1.0] * n + [0.0]  # -1: not yet timed (an end is never negative)
    waiting: list[list[int] | None] = [None] * (n + 1)  # the stages parked on each step
    at = list(offsets[:-1])  # each stage's next step; a copy, as it advances
    clock = [0.0] * pp  # end of each stage's last timed step
    ready = list(range(pp))
    while ready:
        s = ready.pop()
        i, stop, t = at[s], offsets[s + 1], clock[s]
        if bc is None:
            while i < stop:
                r = end[a[i]]
                if r < 0.0:
                    blocker = a[i]
                    break
                r += da[i]
                t = (r if r > t else t) + d[i]
                end[i] = t
                woken = waiting[i]
                if woken is not None:
                    ready.extend(woken)
                i += 1
        else:
            b, db, c = bc
            while i < stop:
                r, rb, rc = end[a[i]], end[b[i]], end[c[i]]
                if r < 0.0 or rb < 0.0 or rc < 0.0:
                    blocker = a[i] if r < 0.0 else b[i] if rb < 0.0 else c[i]
                    break
                r += da[i]
                if r > t:
                    t = r
                rb += db[i]
                if rb > t:
                    t = rb
                t = (rc if rc > t else t) + d[i]
                end[i] = t
                woken = waiting[i]
                if woken is not None:
                    ready.extend(woken)
                i += 1
        if i < stop:
            parked = waiting[blocker]
            if parked is None:
                waiting[blocker] = [s]
            else:
                parked.append(s)
        at[s], clock[s] = i, t
    stuck = [(s, at[s] - offsets[s]) for s in range(pp) if at[s] < offsets[s + 1]]
    if stuck:
        raise RuntimeError(f"pipeline schedule deadlocks; (stage, step) stuck: {stuck[:4]}")
    return end


def _inputs_b_c(graph: Graph, p2p_s: float) -> tuple[list[int], list[float], list[int]] | None:
    """``_run_stages``' inputs b, their hops' seconds and c, as lists; None where no step has
    input b or c (most schedules)."""
    n = graph.n
    if not (np.any(graph.b != n) or np.any(graph.c != n)):
        return None
    return graph.b.tolist(), (graph.xb * p2p_s).tolist(), graph.c.tolist()


def step_ends(graph: Graph, step_s: NDArray[np.float64], p2p_s: float) -> list[float]:
    """End (seconds) of every step, given each step's duration ``step_s``, and 0.0 for the
    sentinel (the last entry): ``_run_stages``, one pass over the steps. A list: where only the
    makespan is read, its max() costs less than making it an array first."""
    return _run_stages(graph.offsets, graph.a.tolist(), (graph.xa * p2p_s).tolist(),
                       np.asarray(step_s, dtype=np.float64).tolist(), _inputs_b_c(graph, p2p_s))


def time_steps(
    graph: Graph, step_s: NDArray[np.float64], p2p_s: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Start and end (seconds) of every step, given each step's duration ``step_s``."""
    ends = np.array(step_ends(graph, step_s, p2p_s))
    # Starts from the same max as in the pass (not end - duration), so they are exact.
    start = np.maximum(ends[graph.prev], ends[graph.a] + graph.xa * p2p_s)
    start = np.maximum(start, ends[graph.b] + graph.xb * p2p_s)
    start = np.maximum(start, ends[graph.c])
    return start, ends[:graph.n]


@dataclass(frozen=True)
class Levels:
    """A graph's steps grouped by depth (a step's inputs all lie in earlier groups), and what a
    batch of strategies needs to time them: each op's [stage, local chunk, kind] slot and where
    each step's ops start in the op order (steps numbered as in ``Graph``).

    A batch's timeline keeps its rows in depth order (``order``: the groups one after another),
    so that a group reads and writes one slice of it rather than gathering and scattering rows;
    ``inputs`` holds, per group, that slice and its steps' inputs as rows of that timeline."""

    groups: tuple[NDArray[np.int64], ...]
    op_slot: NDArray[np.int64]
    step_first_op: NDArray[np.int64]
    #: the steps in depth order
    order: NDArray[np.int64]
    #: per group: its rows [lo, hi) of the depth-ordered timeline; the rows of its steps' previous
    #: step and input a (``Graph.prev``, ``Graph.a``; row n: the sentinel); the hop flags xa as
    #: a [steps, 1] mask, or True where every input a comes from another stage and None where none
    #: does; and (input b, its flags xb as a mask) and input c, each None where no step of the
    #: group has one
    inputs: tuple[tuple[int, int, NDArray[np.int64], NDArray[np.int64], NDArray[np.bool_] | bool | None,
                        tuple[NDArray[np.int64], NDArray[np.bool_]] | None, NDArray[np.int64] | None], ...]


def _level_inputs(graph: Graph, bounds: list[int], order: NDArray[np.int64]) -> tuple[Any, ...]:
    """``Levels.inputs`` of the depth groups ``order[bounds[i]:bounds[i + 1]]`` (see there).

    Every step's inputs are turned into rows once, in depth order, and each group's are slices
    (views) of those; which groups hop or have inputs b and c is reduced over every group at
    once. A search's groups number a few hundred per graph, where numpy's cost per call, not
    per step, was most of the work."""
    n = graph.n
    if n == 0:  # one empty group: nothing to read (no hop flag is unset)
        return ((0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), True, None, None),)
    row = np.empty(n + 1, dtype=np.int64)
    row[order] = np.arange(n)
    row[n] = n  # the sentinel keeps its row
    prev, a, b, c = (row[links[order]] for links in (graph.prev, graph.a, graph.b, graph.c))
    hops, b_hops = graph.xa[order] == 1.0, graph.xb[order] == 1.0
    starts = bounds[:-1]
    every_hop = np.logical_and.reduceat(hops, starts).tolist()
    any_hop = np.logical_or.reduceat(graph.xa[order] != 0.0, starts).tolist()
    has_b = np.logical_or.reduceat(b != n, starts).tolist()
    has_c = np.logical_or.reduceat(c != n, starts).tolist()
    hops, b_hops = hops[:, None], b_hops[:, None]
    return tuple(
        (lo, hi, prev[lo:hi], a[lo:hi], True if every else (hops[lo:hi] if some else None),
         (b[lo:hi], b_hops[lo:hi]) if with_b else None, c[lo:hi] if with_c else None)
        for lo, hi, every, some, with_b, with_c in zip(bounds[:-1], bounds[1:], every_hop, any_hop, has_b, has_c,
                                                       strict=True))


@lru_cache(maxsize=256, typed=True)
def build_levels(schedule: str, pp: int, vpp: int, m: int, k: int = 1) -> Levels:
    """The depth groups of ``build_graph(schedule, pp, vpp, m, k)`` (cached)."""
    graph = build_graph(schedule, pp, vpp, m, k)
    plan = build_plan(schedule, pp, vpp, m, k)
    n = graph.n
    # Each step one deeper than its deepest input (the sentinel's depth is 0): its end when
    # every step lasts 1 and no hop costs anything (whole numbers, exact as floats).
    depth = _run_stages(graph.offsets, graph.a.tolist(), [0.0] * n, [1.0] * n, _inputs_b_c(graph, 0.0))
    by_depth = np.array(depth[:n], dtype=np.int64)
    order = np.argsort(by_depth, kind="stable")
    bounds = [0, *(np.flatnonzero(np.diff(by_depth[order])) + 1).tolist(), n]
    slots, firsts, ops = [], [], 0
    for s, st in enumerate(plan):
        slots.append((s * vpp + st.chunk) * 3 + st.kind)
        firsts.append(ops + np.concatenate(([0], np.cumsum(st.step_len)[:-1])))
        ops += len(st)
    groups = tuple(order[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True))
    return Levels(groups=groups, op_slot=np.concatenate(slots), step_first_op=np.concatenate(firsts), order=order,
                  inputs=_level_inputs(graph, bounds, order))


def time_steps_batch(
    schedule: str, pp: int, vpp: int, m: int, k: int, op_s: NDArray[np.float64], p2p_s: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Makespan (seconds) of each of N strategies sharing one schedule shape, timed as
    ``time_steps`` times one: ``op_s`` [N, pp·vpp·3] holds each strategy's seconds per op of
    [stage, local chunk, kind F/B/W] (as the op runs: seq chunks and a whole backward already
    applied), ``p2p_s`` [N] its seconds per transfer. Every step of a depth group is timed at
    once, so the Python loop runs over depths (about 2·(m·vpp + pp)), not steps; strategies go
    in slices that keep the [steps, strategies] timeline near 32 MiB."""
    graph = build_graph(schedule, pp, vpp, m, k)
    levels = build_levels(schedule, pp, vpp, m, k)
    op_s = np.asarray(op_s, dtype=np.float64)
    p2p_all = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (op_s.shape[0],))
    makespan = np.zeros(op_s.shape[0])
    if graph.n == 0:
        return makespan
    one_op_steps = len(levels.op_slot) == graph.n
    # With one op a step, the ops' slots read in depth order give the timeline's rows directly.
    slot_by_depth = levels.op_slot[levels.order] if one_op_steps else None
    width = max(1, (32 << 20) // (8 * (graph.n + 1)))
    widest = max(stop - first for first, stop, *_ in levels.inputs)
    for lo in range(0, op_s.shape[0], width):
        part = slice(lo, lo + width)
        # [ops, strategies], contiguous. Most schedules run one op a step, and then the steps'
        # seconds are their ops' rows, which each depth group takes at its steps' slots; else
        # they are summed per step here, [steps in depth order, strategies] (a group's: a slice).
        by_op = np.ascontiguousarray(op_s[part].T)
        step_s = by_op if slot_by_depth is not None else np.add.reduceat(
            by_op[levels.op_slot], levels.step_first_op, axis=0)[levels.order]
        p2p = p2p_all[part][None, :]
        end = np.zeros((graph.n + 1, by_op.shape[1]))  # the last row is the sentinel, done at 0
        # A group's start times and one of its inputs, in two buffers reused by every group:
        # each input's rows are taken into one (np.take with out=, no temporaries; mode "clip"
        # writes out= directly, where "raise" buffers it: the rows are always in range) and the
        # start kept as their running maximum (1M DeepSeek-V3 strategies' 25 calls: 140 → 95 ms). A hop adds p2p where its flag is set, the same
        # sum as the flag (0 or 1) times p2p added (an end is never -0.0).
        start_buffer, input_buffer = np.empty((widest, by_op.shape[1])), np.empty((widest, by_op.shape[1]))
        for first, stop, prev, a, xa, b, c in levels.inputs:
            start, read = start_buffer[:stop - first], input_buffer[:stop - first]
            # an input made on another stage arrives p2p later (xa None: no step's is)
            np.take(end, a, axis=0, out=start, mode="clip")
            if xa is True:
                start += p2p
            elif xa is not None:
                np.add(start, p2p, out=start, where=xa)
            np.maximum(start, np.take(end, prev, axis=0, out=read, mode="clip"), out=start)
            if b is not None:
                np.take(end, b[0], axis=0, out=read, mode="clip")
                np.add(read, p2p, out=read, where=b[1])
                np.maximum(start, read, out=start)
            if c is not None:
                np.maximum(start, np.take(end, c, axis=0, out=read, mode="clip"), out=start)
            own = (step_s[first:stop] if slot_by_depth is None
                   else np.take(step_s, slot_by_depth[first:stop], axis=0, out=read, mode="clip"))
            np.add(start, own, out=end[first:stop])
        makespan[part] = end[:graph.n].max(axis=0)
    return makespan
