"""Activation counts held per stage and chunk, from a schedule's op order alone.

Rule: the activation of (micro-batch, chunk) is allocated at the end of its F and released
at the end of its B. In schedules that split the backward, the part W still needs (inputs
of the linear layers and their output gradients) stays from the end of B to the end of W;
it is counted apart (``held_until_w``) so the memory model can price it as a fraction.

Since a stage allocates and frees only at the boundaries of its own ops, and runs them in a
fixed order, the counts do not depend on durations: one pass over the order gives them.
Inside a DualPipeV step that overlaps a forward with a backward, the forward's allocation is
counted before the backward's release (the pair runs interleaved layer by layer, so both
are held at the peak).

Units: micro-batches of the stage's chunk. A Seq1F1B sub-sequence counts 1/seq_chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ndplan.errors import NdplanError
from ndplan.schedule.builders import StagePlan, build_plan
from ndplan.schedule.ops import SPLIT_BACKWARD, B, F, W, validate


def _frozen(arr: NDArray[np.float64]) -> NDArray[np.float64]:
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True)
class StageInFlight:
    """Held-activation series of one stage at every op boundary.

    Row 0 is before the first op, row i is right after the stage's i-th op (ops in
    execution order, as in ``ScheduleResult.ops[stage]``); columns are local chunks.
    Values are in micro-batches (floats: Seq1F1B sub-sequences count 1/seq_chunks).
    """

    held_until_b: NDArray[np.float64]
    held_until_w: NDArray[np.float64]
    #: 1 once the chunk's first weight gradient has been produced (its first W, or its first B
    #: where the backward is not split), 0 before: a runtime that creates gradients in the
    #: backward (``zero_grad(set_to_none=True)``) holds none before then.
    grads_ready: NDArray[np.float64]
    #: Micro-batches whose F (B) on the chunk has completed, so far (cumulative counts).
    forwards_done: NDArray[np.float64]
    backwards_done: NDArray[np.float64]
    #: 1 for the chunk whose weight-gradient step (a W apart from its B) starts at this boundary:
    #: the row plus what that step allocates while it runs is the state during it.
    starts_w: NDArray[np.float64]
    #: The same for the chunk's first such step, which creates its gradients as it runs.
    starts_first_w: NDArray[np.float64]
    #: Micro-batches whose B ran apart from its W on the chunk so far (cumulative): PyTorch's
    #: split backward leaves each one's input gradient on the chunk's input buffer until the
    #: next step clears it.
    inputs_kept: NDArray[np.float64]
    #: 1 from a weight-gradient step apart from its B until the chunk's next B, 0 elsewhere: the
    #: weight gradients that step made wait there for the backward's hook that accumulates them
    #: (FSDP2 under a deferred reduce runs it in the input-gradient step, before that step's W).
    grads_pending: NDArray[np.float64]


@dataclass(frozen=True)
class InFlight:
    """What the memory model needs from a schedule: how many activations a stage holds.

    groups: the op-boundary series stacked for the stages that run as many ops (in most
        schedules, all of them), ([stages, boundaries, chunks]), each with its stages' indices:
        for callers that process every stage at once.
    stages: the series per stage (views of the groups'), for weighting chunks of different sizes.
    """

    schedule: str
    pp: int
    vpp: int
    num_micro_batches: int
    seq_chunks: int
    groups: tuple[tuple[tuple[int, ...], StageInFlight], ...]

    # Made on first use: the strategy search reads the groups alone, and a few thousand stages'
    # seven views each were an eighth of what its schedules' counts cost.
    @cached_property
    def stages(self) -> tuple[StageInFlight, ...]:
        """Per stage, its op-boundary series (views of its group's)."""
        out: list[StageInFlight | None] = [None] * self.pp
        for members, group in self.groups:
            series = [getattr(group, name.name) for name in fields(StageInFlight)]
            for i, s in enumerate(members):
                out[s] = StageInFlight(*(array[i] for array in series))
        return tuple(st for st in out if st is not None)

    # The peaks are reduced on first use, not with the series: the strategy search reads the
    # series of a few hundred schedules (their memory frontiers) and none of these.
    @cached_property
    def peak(self) -> NDArray[np.float64]:
        """[pp, vpp] peak of held_until_b per stage and chunk (each chunk on its own)."""
        return self._peaks(lambda st: st.held_until_b.max(axis=1), (self.pp, self.vpp))

    @cached_property
    def peak_w(self) -> NDArray[np.float64]:
        """[pp, vpp] peak of held_until_w (activations past B, waiting for their W)."""
        return self._peaks(lambda st: st.held_until_w.max(axis=1), (self.pp, self.vpp))

    @cached_property
    def peak_total(self) -> NDArray[np.float64]:
        """[pp] peak over time of the sum across chunks of held_until_b (the chunks peak at
        different instants, so this can be less than peak.sum(axis=1))."""
        return self._peaks(lambda st: st.held_until_b.sum(axis=2).max(axis=1), (self.pp,))

    def _peaks(self, reduce: Callable[[StageInFlight], NDArray[np.float64]], shape: tuple[int, ...]) -> NDArray[np.float64]:
        """``reduce`` of each group's stacked series ([stages, ...] -> ``shape`` less its first
        axis), placed at its stages' rows of a read-only ``shape`` array."""
        out = np.zeros(shape)
        for members, group in self.groups:
            out[list(members)] = reduce(group)
        return _frozen(out)

    def peak_weighted(self, per_b: ArrayLike, per_w: ArrayLike = 0.0) -> NDArray[np.float64]:
        """Peak over time, per stage, of sum_c held_until_b*per_b[s, c] + held_until_w*per_w[s, c].

        ``per_b``/``per_w`` are the cost (say bytes) of one micro-batch's activation held
        until B, and of the part kept until W, for each stage and chunk; anything
        broadcastable to [pp, vpp]. Returns [pp] in the same unit.
        """
        shape = (self.pp, self.vpp)
        try:
            wb = np.broadcast_to(np.asarray(per_b, dtype=np.float64), shape)
            ww = np.broadcast_to(np.asarray(per_w, dtype=np.float64), shape)
        except ValueError as exc:
            raise NdplanError(f"activation weights must broadcast to [pp, vpp] = {list(shape)}") from exc
        out = np.empty(self.pp)
        for s, st in enumerate(self.stages):
            out[s] = float(np.max(st.held_until_b @ wb[s] + st.held_until_w @ ww[s]))
        return out


def in_flight(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int = 1) -> InFlight:
    """Held-activation counts of a schedule (cached: the strategy search asks many times).

    Arguments as in :func:`ndplan.schedule.simulate`; ``m`` is num_micro_batches.
    The result is shared between callers, so its arrays are read-only.
    """
    # One cache key however the caller spells the arguments (lru_cache keys on the call's
    # form, so f(x, 1) and f(x) would otherwise be two entries) and on plain ints.
    return _in_flight(schedule, *validate(schedule, pp, vpp, m, seq_chunks))


@lru_cache(maxsize=1024, typed=True)
def _in_flight(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> InFlight:
    plan = build_plan(schedule, pp, vpp, m, seq_chunks)
    split = schedule in SPLIT_BACKWARD
    groups = []
    # Stages that run as many ops are counted together, as one [stages, ops, chunks] array (in
    # most schedules every stage runs 2 or 3 ops per micro-batch and chunk: one array for all).
    # (Plain lists: a few dozen stages, where numpy's unique and flatnonzero cost more.)
    lengths = [len(st.kind) for st in plan]
    for n in sorted(set(lengths)):
        members = tuple(s for s, length in enumerate(lengths) if length == n)
        # Read-only once per series: each stage's rows are views of it, read-only as well.
        series = tuple(_frozen(array) for array in _stage_series([plan[s] for s in members], n, vpp, seq_chunks, split))
        groups.append((members, StageInFlight(*series)))
    return InFlight(schedule=schedule, pp=pp, vpp=vpp, num_micro_batches=m, seq_chunks=seq_chunks, groups=tuple(groups))


def _stage_series(
    plans: list[StagePlan], n: int, vpp: int, seq_chunks: int, split: bool,
) -> tuple[NDArray[np.float64], ...]:
    """For stages of ``n`` ops each, the series of ``StageInFlight`` (in its field order), each
    [stages, n + 1, vpp]: row 0 before the first op, row i after the i-th."""
    count = len(plans)
    # [stages, n] each: the stages' arrays laid end to end (np.stack's cost is several times
    # np.concatenate's on a schedule's few dozen short arrays).
    kind, chunk, step = (np.concatenate([getattr(st, name) for st in plans]).reshape(count, n)
                         for name in ("kind", "chunk", "step"))
    is_f = kind == F
    is_b = kind == B
    is_w = kind == W
    # A full backward (B and its W in one step, DualPipeV) frees everything at once:
    # nothing lingers between its B and W.
    b_with_w = np.zeros((count, n), dtype=bool)
    b_with_w[:, :-1] = is_b[:, :-1] & is_w[:, 1:] & (step[:, :-1] == step[:, 1:])
    w_with_b = np.zeros((count, n), dtype=bool)
    w_with_b[:, 1:] = b_with_w[:, :-1]
    # Each op's place (its stage, row i + 1 and chunk) in a flat [stages, n + 1, vpp] array, worked
    # out once: a fancy index of three broadcast arrays costs that per series.
    place = ((np.arange(count)[:, None] * (n + 1) + np.arange(1, n + 1)[None, :]) * vpp + chunk).ravel()

    def running(values: NDArray[np.bool_] | NDArray[np.int32]) -> NDArray[np.int32]:
        """Running total of each op's ``values`` (whole numbers) in its chunk, [stages, n + 1, vpp]:
        each op's value placed in its row and chunk, summed down the rows in place. In int32, not
        float64: the same whole numbers (a count is at most MAX_SIMULATED_PASSES), summed about
        five times as fast (an integer add waits on no float latency), then made floats once."""
        flat = np.zeros(count * (n + 1) * vpp, dtype=np.int32)
        flat[place] = values.ravel()
        out = flat.reshape(count, n + 1, vpp)
        return np.cumsum(out, axis=1, out=out)

    def in_micro_batches(total: NDArray[np.int32]) -> NDArray[np.float64]:
        """A running total of sub-sequence ops in micro-batches, as floats (x / 1 is x: whole
        micro-batches skip the division)."""
        return total / seq_chunks if seq_chunks != 1 else total.astype(np.float64)

    zeros = np.zeros((count, n + 1, vpp))
    forwards = running(is_f)
    backwards = running(is_b)
    # What is held until B is the forwards done less the backwards.
    held_b = in_micro_batches(forwards - backwards)
    # Where the backward is not split, nothing waits for a W and no W starts: zero throughout.
    held_w = in_micro_batches(running((is_b & ~b_with_w).astype(np.int32) - (is_w & ~w_with_b))) if split else zeros
    grads_ready = ((running(is_w) if split else backwards) > 0).astype(np.float64)
    forwards_done = in_micro_batches(forwards)
    backwards_done = in_micro_batches(backwards)
    starts_w = np.zeros((count, n + 1, vpp)) if split else zeros
    if split:
        at_stage, at_op = np.nonzero(is_w & ~w_with_b)
        starts_w[at_stage, at_op, chunk[at_stage, at_op]] = 1.0  # op i starts at boundary i
    starts_first_w = starts_w * (1.0 - grads_ready) if split else zeros
    inputs_kept = in_micro_batches(running((is_b & ~b_with_w).astype(np.int32))) if split else zeros
    grads_pending = _pending_after_w(is_w & ~w_with_b, is_b, place, count, n, vpp) if split else zeros
    return (held_b, held_w, grads_ready, forwards_done, backwards_done, starts_w, starts_first_w, inputs_kept,
            grads_pending)


def _pending_after_w(lone_w: NDArray[np.bool_], is_b: NDArray[np.bool_], place: NDArray[np.intp], count: int,
                     n: int, vpp: int) -> NDArray[np.float64]:
    """[stages, n + 1, vpp]: 1 from a W apart from its B until the end of the chunk's next B,
    0 elsewhere: a lone W marks its row 1, a B the row after its own 0 (its hook runs as it
    ends, so the boundary right after it still holds what it folds: that row is the state at
    the B's end), each mark carried down the rows to the chunk's next one. A W marks over a B's
    mark on the same row (the W comes after the hook). ``place``: each op's flat index, as
    ``_stage_series`` lays them out."""
    size = count * (n + 1) * vpp
    flat_marks = np.zeros(size)
    flat_has_mark = np.zeros(size, dtype=bool)
    # A B's mark one row down (one op later, the stage's next op): the rows are [stages, n + 1, vpp].
    b_place = place.reshape(count, n)[:, :-1][is_b[:, :-1]] + vpp
    flat_has_mark[b_place] = True
    w_place = place[lone_w.ravel()]
    flat_marks[w_place] = 1.0
    flat_has_mark[w_place] = True
    marks, has_mark = flat_marks.reshape(count, n + 1, vpp), flat_has_mark.reshape(count, n + 1, vpp)
    has_mark[:, 0, :] = True  # row 0: before any op, nothing pending (its mark is 0)
    # Each row's latest marked row at or above it, per stage and chunk.
    latest = np.maximum.accumulate(np.where(has_mark, np.arange(n + 1)[None, :, None], 0), axis=1)
    return np.take_along_axis(marks, latest, axis=1)
