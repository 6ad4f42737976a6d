"""The schedule's frontier: per pipeline stage, the micro-batches in flight per chunk at each
moment that can be the stage's peak of held memory.

A schedule is simulated once per (schedule, pp, vpp, micro-batches, seq_chunks), or read from a
closed form (1F1B), and reduced to the rows that no other row is >= in every column (the
skyline): the held peak is the largest of those rows weighted by each chunk's bytes.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ndplan.schedule import EVERY_BACKWARD_SPLIT, SPLIT_BACKWARD, V_SHAPE, in_flight


def steady_micro_batches(schedule: str, pp: int, vpp: int, m: int) -> int:
    """A micro-batch count with the same frontier (``_steady_frontier``) as ``m``.

    Past the warm-up, every schedule but GPipe and the V schedules repeats the same steady
    pattern, so the distinct rows of its activation counts, hence its frontier and peaks, stop
    changing with m: simulating fewer gives the same answer for less work, and searches whose
    micro-batch counts differ past it share one simulation. The frontier stops changing at
    m = pp + 1 in the 1F1B orders (1F1B, Seq1F1B: a second steady forward after each stage's
    first backward; Seq1F1B earlier, ceil(pp / seq_chunks) + 1) and 3·pp in the interleaved
    order (a multiple of pp, as interleaving requires), at every vpp: these counts are taken (a
    test checks them against the simulation of every count up to 4·pp·vpp). Where the backward
    is split (ZB-H1, the V schedules) the input gradients kept so far grow with every B, and in
    a V the hand-overs at the turn counted before the last stage's warm-up ends keep their count
    while the later ones grow, so the frontier never stops changing: m itself
    (``_steady_frontier`` derives it past 2·pp + 2 without simulating m)."""
    if schedule == "gpipe" or schedule in SPLIT_BACKWARD:
        return m
    cap = 3 * pp if schedule == "interleaved" else pp + 1
    return m if m <= cap else cap


def frontier(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> tuple[np.ndarray, ...]:
    """Per stage, the frontier rows of ``_steady_frontier`` for ``m`` micro-batches."""
    return _steady_frontier(schedule, pp, vpp, steady_micro_batches(schedule, pp, vpp, m), seq_chunks)


@lru_cache(maxsize=4096)
def _steady_frontier(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> tuple[np.ndarray, ...]:
    """Per stage, the op-boundary rows [held_until_b | held_until_w | grads_ready] (then, for
    schedules that split the backward, ``starts_w`` and ``starts_first_w`` per chunk: the row is
    the state while that chunk's (first) weight-gradient step runs, ``inputs_kept`` per
    chunk: the input gradients its B's left so far, and (ZB-V: ``EVERY_BACKWARD_SPLIT``)
    ``grads_pending`` per chunk: 1 from a W to the end of the chunk's next B; and for V schedules
    one more column, the
    hand-overs at the turn so far) that can be the maximum of a non-negative weighting: rows
    dominated by another row are dropped (usually most)."""
    if schedule == "gpipe":
        # GPipe runs every forward before any backward: each stage holds all m micro-batches, and
        # no gradient exists yet; after the first backward, m - 1 and the gradients.
        return tuple(np.array([[float(m), 0.0, 0.0], [float(m - 1), 0.0, 1.0]]) for _ in range(pp))
    if schedule == "1f1b":
        return _one_f_one_b_frontier(pp, m)
    if schedule in SPLIT_BACKWARD and m > 2 * pp + 3 and seq_chunks == 1:
        return _split_frontier_past_warm_up(schedule, pp, vpp, m)
    return _simulated_frontier(schedule, pp, vpp, m, seq_chunks)


def inputs_kept_at_end(schedule: str, pp: int, vpp: int, m: int) -> np.ndarray:
    """[pp, vpp] per stage and chunk, the input gradients a split backward's B's leave by the
    end of a run of ``m`` micro-batches (the frontier's ``inputs_kept`` columns, which only grow:
    their largest value stays a frontier row's)."""
    if schedule not in SPLIT_BACKWARD:
        return np.zeros((pp, vpp))
    return np.array([rows[:, 5 * vpp:6 * vpp].max(axis=0) for rows in frontier(schedule, pp, vpp, m, 1)])


def _split_frontier_past_warm_up(schedule: str, pp: int, vpp: int, m: int) -> tuple[np.ndarray, ...]:
    """A split-backward schedule's (ZB-H1's, ZB-V's, DualPipeV's) frontier at m > 2·pp + 3
    micro-batches, from those simulated at 2·pp + 1, one more and two more: from 2·pp + 1 on,
    each further micro-batch leaves every row as it is but for the counts that grow with the
    step (the input gradients kept, on the rows past the warm-up; a V's last stage's hand-overs,
    by two: its F's and its B's), which grow by the same amount each time (checked: the three
    counts' steps must agree, else m is simulated; a test checks the result against the
    simulation of every count up to 8·pp). The search's larger counts then cost no simulation
    of their own (ZB-V pp 16's frontiers at 4 to 128 micro-batches: 13 -> 10 ms); adding a
    fixed amount per micro-batch to every row instead, as a count past a cap once did, read the
    warm-up's rows too high (the last stage's peak with the first weight-gradient column
    weighted: 10.55 against 8.15)."""
    first = 2 * pp + 1
    at, after, next_after = (_steady_frontier(schedule, pp, vpp, first + k, 1) for k in range(3))
    if any(a.shape != b.shape or b.shape != c.shape for a, b, c in zip(at, after, next_after, strict=True)) or not all(
            np.array_equal(c - b, b - a) for a, b, c in zip(at, after, next_after, strict=True)):
        return _simulated_frontier(schedule, pp, vpp, m, 1)  # (the rows moved: simulated)
    return tuple(a + (m - first) * (b - a) for a, b in zip(at, after, strict=True))


def _simulated_frontier(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> tuple[np.ndarray, ...]:
    """``_steady_frontier`` from the schedule's simulated activation counts."""
    flight = in_flight(schedule, pp, vpp, m, seq_chunks)
    frontiers: list[np.ndarray] = [np.empty(0)] * pp
    # The stages with as many op boundaries (in most schedules, all of them) are done together.
    for members, group in flight.groups:
        counts = [group.held_until_b, group.held_until_w, group.grads_ready]  # [stages, boundaries, chunks]
        if schedule in SPLIT_BACKWARD:
            counts += [group.starts_w, group.starts_first_w, group.inputs_kept]
        if schedule in EVERY_BACKWARD_SPLIT:
            # (the other split schedules leave none pending: no column, a smaller skyline)
            counts.append(group.grads_pending)
        if schedule in V_SHAPE:
            # Hand-overs at the V's turn (the last stage: its first chunk's F hands the output
            # to its second, whose B hands the gradient back) so far, one column; zero on the
            # other stages, whose rows then stay dominated as before.
            handovers = np.zeros((*group.held_until_b.shape[:2], 1))
            if members[-1] == pp - 1:
                handovers[-1, :, 0] = group.forwards_done[-1, :, 0] + group.backwards_done[-1, :, 1]
            counts.append(handovers)
        # One skyline over every column, grads_ready's included (its weights, gradient bytes,
        # are non-negative like the rest): the rows that can be a maximum. Rows a neighbour
        # dominates go first, over every stage's series at once.
        boundaries = group.held_until_b.shape[1]
        kept = np.flatnonzero(_locally_undominated_columns([count[:, :, c] for count in counts
                                                             for c in range(count.shape[2])]))
        rows = np.concatenate([count.reshape(-1, count.shape[2])[kept] for count in counts], axis=1)
        for s, skyline in zip(members, _skylines(rows, kept // boundaries, len(members)), strict=True):
            frontiers[s] = skyline
    return tuple(frontiers)


def _one_f_one_b_frontier(pp: int, m: int) -> tuple[np.ndarray, ...]:
    """``_steady_frontier`` of 1F1B, in closed form (a test checks it against the simulation).

    Stage s runs w = min(pp - s - 1, m) warm-up forwards, then F and B alternately, then the
    remaining backwards: it holds k = min(pp - s, m) micro-batches after its last warm-up F and
    its first steady F, and k - 1 after each B. Where a second steady F follows the first B
    (m > pp - s), it holds k again with the gradients made: the one row [k, 0, 1] dominates
    every other. Otherwise the peak comes before any gradient and the first B leaves k - 1 with
    them: rows [k, 0, 0] and [k - 1, 0, 1] (two used columns: the first descending). Each a
    few microseconds rather than a simulation and a skyline (~0.4 ms apiece; DeepSeek-V3's
    search prices 18 such schedules, Llama-3.1-405B's 21)."""
    out = []
    for s in range(pp):
        k = float(min(pp - s, m))
        out.append(np.array([[k, 0.0, 1.0]]) if m > pp - s else np.array([[k, 0.0, 0.0], [k - 1.0, 0.0, 1.0]]))
    return tuple(out)


def _undominated(rows: np.ndarray) -> np.ndarray:
    """The rows of ``rows`` (a time series, one row per op boundary) that no other row is >= in
    every column (the skyline), with the all-zero columns kept so the width is unchanged."""
    kept = np.flatnonzero(_locally_undominated_columns([column[None, :] for column in rows.T]))
    return _skylines(rows[kept], np.zeros(len(kept), np.int64), 1)[0]


#: Weights of a row's columns in the sort key that brings equal rows together (any weights do,
#: repeated for wider rows: rows with equal keys are compared in full).
_GROUPING_WEIGHTS = np.random.default_rng(0).random(64)


def _skylines(rows: np.ndarray, stage: np.ndarray, stages: int) -> list[np.ndarray]:
    """Per stage, the skyline of its rows (``rows[stage == s]``, in time order): the distinct
    rows no other row of the stage is >= in every column, in lexicographic order, or by the first
    used column descending where at most two columns are used (not all zero).

    The stages are sorted and compared together, not one by one: a search asks for a few
    thousand stages' skylines, of a few dozen rows each, where numpy's cost per call would be
    most of the work."""
    # Equal rows together, by stage and a weighted sum (one sort key, not one per column); the
    # first of each run of equal rows kept: the distinct rows, a few twice where sums collide.
    order = np.lexsort((rows @ np.resize(_GROUPING_WEIGHTS, rows.shape[1]), stage))
    rows, stage = rows[order], stage[order]
    fresh = np.ones(len(rows), bool)
    fresh[1:] = (stage[1:] != stage[:-1]) | np.any(rows[1:] != rows[:-1], axis=1)
    rows, stage = rows[fresh], stage[fresh]
    # Distinct rows sorted by stage, then lexicographically (np.unique(axis=0) per stage).
    order = np.lexsort((*rows.T[::-1], stage))
    rows, stage = rows[order], stage[order]
    fresh = np.ones(len(rows), bool)
    fresh[1:] = (stage[1:] != stage[:-1]) | np.any(rows[1:] != rows[:-1], axis=1)
    rows, stage = rows[fresh], stage[fresh]
    # Most dominated rows are dominated by one of the next few in this order: dropped in O(rows)
    # first, they leave the O(rows²) comparison few rows (its maxima, which dominate the rest,
    # all stay).
    near = ~_dominated_by_next(rows, stage, 4)
    rows, stage = rows[near], stage[near]
    undominated = ~_dominated_in_stage(rows, np.searchsorted(stage, np.arange(stages + 1)).tolist())
    rows, stage = rows[undominated], stage[undominated]
    bounds = np.searchsorted(stage, np.arange(stages + 1)).tolist()
    # Every stage keeps a row (its largest stays), so no stage's run of rows is empty.
    used = np.count_nonzero(np.logical_or.reduceat(rows != 0, bounds[:-1], axis=0), axis=1).tolist()
    return [(rows[a:b] if count > 2 else rows[a:b][::-1]).copy()  # else the first used column descending
            for a, b, count in zip(bounds[:-1], bounds[1:], used, strict=True)]


def _locally_undominated_columns(columns: list[np.ndarray]) -> np.ndarray:
    """[stages, rows] mask of the rows not dominated by a neighbour in their stage's series,
    given column by column ([stages, rows] each): row i goes where row i + 1 is >= it in every
    column, or where row i - 1 is >= it in every column and > in one.

    The rows are a time series, one per op boundary, and an op changes few columns, so most rows
    fall here in O(rows) rather than the skyline's O(rows²). Every row dropped is at most its
    kept neighbour's (following drops, which point one way along a run: i <= i + 1 and
    i + 1 < i cannot both hold), so the distinct undominated rows all stay. Column by column on
    [stages, rows] arrays: numpy reduces a row's few columns slowly."""
    shape = columns[0].shape
    below_next = np.ones((shape[0], shape[1] - 1), bool)  # row i <= row i + 1 in every column
    at_least_next = below_next.copy()  # row i >= row i + 1 in every column
    above_next = np.zeros_like(below_next)  # row i > row i + 1 in some column
    for column in columns:
        this, after = column[:, :-1], column[:, 1:]
        below_next &= this <= after
        at_least_next &= this >= after
        above_next |= this > after
    kept = np.ones(shape, bool)
    kept[:, :-1] &= ~below_next
    kept[:, 1:] &= ~(at_least_next & above_next)
    return kept


def _dominated_by_next(rows: np.ndarray, stage: np.ndarray, reach: int) -> np.ndarray:
    """Whether one of the next ``reach`` rows, in the same stage, is >= each row in every column,
    for distinct rows (then it is > in one)."""
    dominated = np.zeros(len(rows), bool)
    for k in range(1, min(reach, len(rows) - 1) + 1):
        dominated[:-k] |= (stage[k:] == stage[:-k]) & np.all(rows[k:] >= rows[:-k], axis=1)
    return dominated


#: Entries of a [stages, width, width] comparison below which every stage is compared at once,
#: padded to the largest.
_PADDED_AT_ONCE = 1 << 16


def _dominated_in_stage(rows: np.ndarray, bounds: list[int]) -> np.ndarray:
    """Whether another row of the same stage is >= each row in every column, for distinct rows
    (then it is > in one) grouped by stage: stage s's rows are ``rows[bounds[s]:bounds[s + 1]]``.

    Stages of alike sizes (the same power of two, at most; all of them where the padded
    comparison is under ``_PADDED_AT_ONCE`` entries) are compared together, each padded to
    their largest with rows of -inf, which are >= no row: a few numpy calls for many stages,
    each comparing its rows with one another only."""
    dominated = np.zeros(len(rows), bool)
    columns = np.ascontiguousarray(rows.T)
    starts, sizes = np.array(bounds[:-1]), np.diff(bounds)
    # One class where even the padded comparison is small: numpy's cost per call, not the
    # padding's, is then most of the work (a search's frontiers: 21 -> 18 ms of skylines).
    size_class = (np.ceil(np.log2(sizes)).astype(np.int64) if len(sizes) * int(sizes.max()) ** 2 > _PADDED_AT_ONCE
                  else np.zeros(len(sizes), np.int64))
    for c in sorted(set(size_class.tolist())):
        members = np.flatnonzero(size_class == c)
        width = int(sizes[members].max())
        # Stages at a time so that a [stages, width, width] comparison stays within 4M entries.
        parts = -(-len(members) * width * width // (1 << 22))
        for part in np.array_split(members, parts) if parts > 1 else [members]:
            index = starts[part, None] + np.arange(width)  # [stages, width]
            real = np.arange(width) < sizes[part, None]
            padded = columns[:, np.where(real, index, 0)]  # [columns, stages, width]
            padded[:, ~real] = -np.inf
            at_least = np.ones((len(part), width, width), bool)  # [stage, j, i]: row j >= row i
            for column in padded:  # column by column: numpy reduces a row's few columns slowly
                at_least &= column[:, :, None] >= column[:, None, :]
            dominated[index[real]] = (np.count_nonzero(at_least, axis=1) > 1)[real]  # more than itself
    return dominated


def frontier_columns(
    schedule: str, pp: int, vpp: int, m: int, seq_chunks: int, held: tuple[int, ...], grown: tuple[int, ...],
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Per stage, its frontier rows restricted to the ``held`` columns and to the ``grown`` ones
    (contiguous: each is the left operand of a matmul per stage), and which rows of the frontier
    they are. Rows the unused columns alone kept (a weight-gradient step where nothing is priced
    for it) are dominated within the used ones and dropped: neither maximum can come from them.
    (Cached by ``_steady_frontier_columns``, keyed on the count that stands for ``m``.)"""
    return _steady_frontier_columns(schedule, pp, vpp, steady_micro_batches(schedule, pp, vpp, m), seq_chunks,
                                    held, grown)


@lru_cache(maxsize=4096)
def _steady_frontier_columns(
    schedule: str, pp: int, vpp: int, m: int, seq_chunks: int, held: tuple[int, ...], grown: tuple[int, ...],
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """``frontier_columns`` at a steady micro-batch count."""
    frontiers = _steady_frontier(schedule, pp, vpp, m, seq_chunks)
    priced = list(held) + list(grown)
    # Every stage's rows at once, split where a stage keeps them all: a few numpy calls per
    # frontier rather than a few per stage (each of a few rows, where the calls are the cost).
    bounds = np.cumsum([0, *(len(rows) for rows in frontiers)]).tolist()
    rows = np.concatenate(frontiers)
    # C-contiguous, as each stage's block is the left operand of its products (a matrix product's
    # sums may run in another order on another layout).
    held_rows, grown_rows = (np.ascontiguousarray(rows[:, part]) for part in (list(held), list(grown)))
    # Per stage, the columns something is held in but nothing is priced for (every stage
    # keeps a row, so no run of rows is empty).
    unused = np.logical_or.reduceat(rows != 0, bounds[:-1], axis=0)
    unused[:, priced] = False
    pruned = (unused.any(axis=1) & (np.diff(bounds) > 1)).tolist()
    out = []
    for a, b, prune in zip(bounds[:-1], bounds[1:], pruned, strict=True):
        if prune:
            index = _undominated_index(rows[a:b, priced])
            out.append((held_rows[a:b][index], grown_rows[a:b][index], index))
        else:
            out.append((held_rows[a:b], grown_rows[a:b], np.arange(b - a)))
    return tuple(out)


def _undominated_index(rows: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``rows`` that no other row is >= in every column and > in one
    (equal rows all stay: a maximum is the same whichever is taken)."""
    dominated = np.zeros(len(rows), bool)
    columns = np.ascontiguousarray(rows.T)
    for start in range(0, len(rows), 256):  # chunks bound the R x R comparison's memory
        block = slice(start, start + 256)
        # Column by column on [R, block] arrays: numpy reduces a short last axis slowly.
        at_least = np.ones((len(rows), min(256, len(rows) - start)), bool)
        above = np.zeros_like(at_least)
        for column in columns:
            at_least &= column[:, None] >= column[block]
            above |= column[:, None] > column[block]
        dominated[block] = np.any(at_least & above, axis=0)
    return np.flatnonzero(~dominated)
