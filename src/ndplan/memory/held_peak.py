"""The held-activation peak of every stage: the frontier's rows weighted by each chunk's bytes
per micro-batch, and by what else appears during the step (gradients, weight-gradient steps,
hand-overs), maximised over the rows; priced in blocks of strategies, once per stage pattern that
can lead. Also the held peak's split by layer kind, at the moment each stage peaks.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import numpy as np

from ndplan.arrays import unique
from ndplan.memory.activations import LayerActivations
from ndplan.memory.frontier import frontier, frontier_columns
from ndplan.model.spec import ModelSpec
from ndplan.placement import Placement


def _runs_of(values: np.ndarray) -> Iterator[tuple[int, slice | np.ndarray]]:
    """(value, rows) for each distinct value: slices when ``values`` is sorted (the batch path
    sorts each group by micro-batch count), index arrays otherwise."""
    values = np.asarray(values).ravel()
    if len(values) and np.all(values[1:] >= values[:-1]):
        starts = np.concatenate([[0], np.flatnonzero(values[1:] != values[:-1]) + 1, [len(values)]])
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            yield int(values[a]), slice(int(a), int(b))
        return
    for value in np.unique(values):
        yield int(value), np.flatnonzero(values == value)


#: The frontier products run over blocks of strategies, of at most this many multiply-adds
#: (rows × columns × strategies) each: a matrix product this small stays on the calling thread
#: (OpenBLAS spreads a GEMM over threads above 4·65536, which on a busy machine wait for cores,
#: for work a single core does in microseconds), and its [rows, block] result stays in cache.
_PRODUCT_BLOCK = 1 << 18


def _blocks(subset: slice | np.ndarray, step: int) -> Iterator[slice | np.ndarray]:
    """``subset`` (a slice or an index array) in consecutive pieces of at most ``step``."""
    if isinstance(subset, slice):
        start, stop, _ = subset.indices(subset.stop)
        if stop - start <= step:
            yield subset
            return
        for a in range(start, stop, step):
            yield slice(a, min(a + step, stop))
        return
    for a in range(0, len(subset), step):
        yield subset[a:a + step]


def held_peak(
    schedule: str, pp: int, vpp: int, seq_chunks: int, micro_batches: np.ndarray,
    weights: list[np.ndarray | None], extra: list[np.ndarray | None] | None, pattern_of: np.ndarray | None = None,
    *, keep_rows: bool = False, held_read: np.ndarray | None = None, stages: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per stage, stage-major [pp, n]: the peak over the schedule of the held activations, and of
    the held activations plus what else appears during the step.

    ``weights`` are the bytes of one micro-batch behind each of the frontier's first 2·vpp
    columns, one [n, pp] array per column (held until B per chunk, then held until W per chunk;
    None where zero), or [n, P] per stage pattern where ``pattern_of`` [pp] gives each stage's
    pattern; ``extra`` those of its further columns (each chunk's gradients, and under a
    V schedule the tensors handed over at its turn), or None where nothing appears, and then the
    second result is the first. A stage's peak is max over its frontier rows of
    Σ_c weight_c · row_c. With ``keep_rows``, per strategy and stage the frontier row of the
    activation peak. Strategies are priced per distinct micro-batch count, whose schedule
    simulation they share. ``held_read`` [n] (bool; None: all): the strategies whose first
    result is read where there is ``extra``; elsewhere it may hold anything (a run of one
    micro-batch count none of whose strategies reads it skips one pass over its [rows,
    strategies] values).
    ``stages`` (ascending; None: all): the stages priced, one row each, in that order."""
    n = len(micro_batches)
    held, grown = _priced_columns(weights, extra)
    # Stage-major [pp, columns, n]: per stage, (rows × columns) @ (columns × strategies) gives
    # every row's value in a [rows, n] block whose maximum runs over the leading axis.
    held_weights = _stage_major([w for w in weights if w is not None], pp, n)
    extra_weights = _stage_major([w for w in extra or () if w is not None], pp, n)
    # (Every stage's row is written below: one run of micro-batch counts covers the strategies.)
    priced = list(range(pp)) if stages is None else stages.tolist()
    peak = np.empty((len(priced), n))
    with_extra = np.empty((len(priced), n)) if extra is not None else peak
    chosen: np.ndarray | None = None
    for m, subset in _runs_of(micro_batches):
        stage_rows = frontier_columns(schedule, pp, vpp, int(m), seq_chunks, held, grown)
        # Whether the run's first results are read (then written for all its strategies, which
        # those not read may hold): decided once per run, not per stage and block.
        read_here = extra is None or held_read is None or bool(held_read[subset].any())
        if keep_rows and chosen is None:
            chosen = np.zeros((n, pp, frontier(schedule, pp, vpp, int(m), seq_chunks)[0].shape[1]))
        for row, s in enumerate(priced):
            held_rows, grown_rows, row_index = stage_rows[s]
            p = s if pattern_of is None else pattern_of[s]
            step = max(1, _PRODUCT_BLOCK // (held_rows.shape[0] * max(held_rows.shape[1], grown_rows.shape[1], 1)))
            for block in _blocks(subset, step):
                if len(held_rows) == 1 and isinstance(block, slice) and not keep_rows:
                    # One frontier row (most micro-batch counts, past the warm-up): its value is
                    # the peak, the products written in place (the same sum: v + g = g + v).
                    _product(held_rows, held_weights[p][:, block], out=peak[row:row + 1, block])
                    if extra is not None:
                        _product(grown_rows, extra_weights[p][:, block], out=with_extra[row:row + 1, block])
                        with_extra[row, block] += peak[row, block]
                    continue
                values = _product(held_rows, held_weights[p][:, block])
                if read_here:
                    _store_max(values, peak[row], block)
                if keep_rows and chosen is not None:
                    chosen[block, s] = frontier(schedule, pp, vpp, int(m), seq_chunks)[s][row_index[np.argmax(values, axis=0)]]
                if extra is not None:
                    values += _product(grown_rows, extra_weights[p][:, block])
                    _store_max(values, with_extra[row], block)
    return peak, with_extra, chosen


def _priced_columns(
    weights: list[np.ndarray | None], extra: list[np.ndarray | None] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The frontier columns ``held_peak`` prices: (held, grown), those with weights."""
    return (tuple(c for c, w in enumerate(weights) if w is not None),
            tuple(len(weights) + c for c, w in enumerate(extra or ()) if w is not None))


def pattern_leaders(
    schedule: str, pp: int, vpp: int, seq_chunks: int, micro_batches: np.ndarray,
    weights: list[np.ndarray | None], extra: list[np.ndarray | None] | None, pattern_of: np.ndarray,
) -> np.ndarray | None:
    """The stages (ascending) whose device totals can be a strategy's peak, or None where that
    is every stage: a stage whose frontier an earlier stage of its pattern dominates for every
    micro-batch count of ``micro_batches`` is never the (first) peak stage.

    Two stages of one pattern differ only in their held peaks (``GroupShape``), and every
    figure after the held peak is a sum, maximum or positive scaling of it with the pattern's
    terms, each monotone in it as rounded; so a stage whose held peaks (with and without the
    extra columns) are at most an earlier stage's has at most its device total, and the first
    stage of the peak is never it. Its held peaks are at most the earlier stage's where each of
    its frontier rows is at most one of the earlier stage's in every column, the weights being
    non-negative, and the products computed as the same monotone roundings: one column held and
    at most one grown (1F1B, GPipe, Seq1F1B: an elementwise product each, and their sum; a
    matrix product of a few columns may sum another way for another number of rows); with more
    columns, where the frontiers are equal (the same products). Those are the stages of the
    deep pipelines' interior patterns: 1F1B's 32 stages price as 5."""
    held, grown = _priced_columns(weights, extra)
    leaders = _leading_stages(schedule, pp, vpp, seq_chunks, tuple(unique(micro_batches).tolist()), held, grown,
                              tuple(pattern_of.tolist()))
    return None if len(leaders) == pp else leaders


@lru_cache(maxsize=4096)
def _leading_stages(
    schedule: str, pp: int, vpp: int, seq_chunks: int, micro_batches: tuple[int, ...], held: tuple[int, ...],
    grown: tuple[int, ...], pattern_of: tuple[int, ...],
) -> np.ndarray:
    """``pattern_leaders`` of the distinct micro-batch counts ``micro_batches`` (cached: a
    search prices the same groups block after block)."""
    needed = np.zeros(pp, dtype=bool)
    for m in micro_batches:
        needed |= _leading_stages_at(schedule, pp, vpp, seq_chunks, m, held, grown, pattern_of)
    leaders = np.flatnonzero(needed)
    leaders.flags.writeable = False
    return leaders


@lru_cache(maxsize=8192)
def _leading_stages_at(
    schedule: str, pp: int, vpp: int, seq_chunks: int, m: int, held: tuple[int, ...], grown: tuple[int, ...],
    pattern_of: tuple[int, ...],
) -> np.ndarray:
    """[pp] bool: the stages no earlier stage of their pattern dominates at ``m`` micro-batches."""
    stage_rows = frontier_columns(schedule, pp, vpp, m, seq_chunks, held, grown)
    elementwise = len(held) <= 1 and len(grown) <= 1
    # A few rows of a few columns a stage: compared as Python lists, not by numpy calls.
    rows = [np.concatenate([held_rows, grown_rows], axis=1).tolist() for held_rows, grown_rows, _ in stage_rows]
    leaders: dict[int, list[int]] = {}  # pattern -> its stages kept so far
    needed = np.zeros(pp, dtype=bool)
    for t, pattern in enumerate(pattern_of):
        # (Dominance is transitive: a stage dominated by a dropped one is by a kept one too.)
        dominated = any(_rows_dominated(rows[t], rows[s]) if elementwise else rows[t] == rows[s]
                        for s in leaders.get(pattern, ()))
        if not dominated:
            leaders.setdefault(pattern, []).append(t)
            needed[t] = True
    return needed


def _rows_dominated(rows: list[list[float]], by: list[list[float]]) -> bool:
    """Whether each row of ``rows`` is at most one of ``by`` in every column."""
    return all(any(all(a <= b for a, b in zip(row, other, strict=True)) for other in by) for row in rows)


def _product(rows: np.ndarray, columns: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """rows @ columns ([r, k] @ [k, n]), into ``out`` where given. With k = 1 (1F1B and GPipe:
    one column held, one grown) the outer product, broadcast: the same products, each rounded
    once, faster than the matrix product's kernel for so few rows (a DeepSeek-V3 search's
    held_peak calls: 66-68 ms -> 57-59 ms)."""
    if rows.shape[1] == 1:
        return np.multiply(rows, columns, out=out)
    return np.matmul(rows, columns, out=out)


def _store_max(values: np.ndarray, row: np.ndarray, block: slice | np.ndarray) -> None:
    """row[block] = the maximum of each column of ``values``: written in place where ``block`` is
    a slice (``row[block]`` is a view), scattered where it is an index array (``row[block]`` is
    then a copy, which ``out=`` would fill and drop: the strategies of a batch not sorted by
    micro-batch count lost their held peak that way)."""
    if isinstance(block, slice):
        values.max(axis=0, out=row[block])
    else:
        row[block] = values.max(axis=0)


def _stage_major(columns: list[np.ndarray], pp: int, n: int) -> np.ndarray:
    """[pp, len(columns), n] from [n, pp] arrays: one column-major array's transpose as a view
    (no copy), several stacked."""
    if not columns:
        return np.zeros((pp, 0, n))
    if len(columns) == 1 and columns[0].flags.f_contiguous:
        return columns[0].T[:, None, :]
    return np.stack([w.T for w in columns], axis=1)


def activation_kinds(
    kinds: dict[str, dict[str, np.ndarray]], index: np.ndarray, pp: int, vpp: int, placement: Placement,
    chosen: np.ndarray, t: np.ndarray, acts: LayerActivations, plain_dense, plain_moe, recomputed_dense, recomputed_moe, per_virtual, per_w_virtual,
    model: ModelSpec,
) -> None:
    """Split the held peak by layer kind, at the instant of each stage's peak."""
    dense, moe = acts.dense_blocks, acts.moe_blocks
    # A recomputed layer by the blocks it keeps (selective recompute keeps most of each), the
    # checkpoint's own input under 'recompute' (all a fully recomputed layer keeps).
    kept_dense, kept_moe = acts.dense_recomputed_blocks, acts.moe_recomputed_blocks
    per_kind_virtual = {
        "attention": t * (plain_dense * dense["attention"][:, None] + plain_moe * moe["attention"][:, None]
                          + recomputed_dense * kept_dense["attention"][:, None]
                          + recomputed_moe * kept_moe["attention"][:, None]),
        "norm": t * (plain_dense * dense["norm"][:, None] + plain_moe * moe["norm"][:, None]
                     + recomputed_dense * kept_dense["norm"][:, None] + recomputed_moe * kept_moe["norm"][:, None]),
        "mlp": t * (plain_dense * dense["mlp"][:, None] + recomputed_dense * kept_dense["mlp"][:, None]),
        "moe": t * (plain_moe * moe["moe"][:, None] + recomputed_moe * kept_moe["moe"][:, None]),
        "recompute": t * (recomputed_dense * kept_dense["recompute"][:, None]
                          + recomputed_moe * kept_moe["recompute"][:, None])
        + per_virtual["checkpoint_mask"] - per_virtual["received_checkpoint"],
        "embedding": per_virtual["embedding"],
        "output": per_virtual["output"],
        "mtp": per_virtual["mtp"],
        "pipeline": per_virtual["pipeline"],
    }
    n = t.shape[0]
    for s in range(pp):
        held_b, held_w = chosen[:, s, :vpp], chosen[:, s, vpp:2 * vpp]
        chunks = np.flatnonzero(placement.stage_of == s)
        for kind, values in per_kind_virtual.items():
            amount = np.zeros(n)
            for v in chunks:
                amount += held_b[:, placement.chunk_of[v]] * values[:, v]
            kinds["activations"][kind][index, s] += amount
        w_amount = np.zeros(n)
        for v in chunks:
            w_amount += held_w[:, placement.chunk_of[v]] * per_w_virtual[:, v]
        # What waits for W (linear inputs and output gradients) is mostly MLP/expert tensors.
        kinds["activations"]["moe" if model.is_moe else "mlp"][index, s] += w_amount
