"""How a batch of strategies is grouped for pricing: by pipeline shape (one radix sort), and within
a group the strategies alike in every field the memory model reads (``group_alike``), each priced once.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ndplan.memory.buffers import cp_kind_read
from ndplan.memory.fields import PIPELINE_SHAPE, STATE_FIELDS, UNREAD_FIELDS, state_field_columns
from ndplan.memory.options import MemoryOptions
from ndplan.memory.shape import GroupShape, group_shape
from ndplan.model.spec import ModelSpec
from ndplan.strategy.batch import CODES, StrategyBatch, dense_codes, distinct_columns, radix_key


def shape_groups(batch: StrategyBatch) -> tuple[list[tuple[tuple[int, ...], np.ndarray]], np.ndarray | None]:
    """``batch.groups(PIPELINE_SHAPE)`` (the groups in the order of their keys) with each group's
    rows in the order of their micro-batch counts (a stable sort: ascending within a count), and
    per strategy its group's number (None where the groups come from ``batch.groups``).

    One stable sort of every strategy by (its group's rank, its micro-batch count's rank), a
    radix sort where the pairs fit 16 bits, gives the same order as grouping and then sorting
    each group by count (1M mixed DeepSeek-V3 strategies, 55 groups of 12 counts: 43 -> 21 ms;
    Llama-3.1-405B's 561k: 31 -> 13 ms)."""
    columns = [getattr(batch, name) for name in PIPELINE_SHAPE]
    if len(batch):
        key = np.zeros(len(batch), dtype=np.int64)
        for column in columns:  # (as batch.groups packs them: the first field the most significant)
            key <<= max(int(column.max()).bit_length(), 1)
            key |= column
        group_of, group_count = dense_codes(key)
        counts, count_count = dense_codes(batch.num_micro_batches)
        if group_count * count_count <= 1 << 16:
            pair = group_of * count_count
            pair += counts
            order = np.argsort(radix_key(pair), kind="stable")
            sizes = np.bincount(pair, minlength=group_count * count_count).reshape(group_count, count_count).sum(axis=1)
            bounds = np.cumsum([0, *sizes.tolist()]).tolist()
            return [(tuple(int(column[order[a]]) for column in columns), order[a:b])
                    for a, b in itertools.pairwise(bounds)], group_of
    groups = batch.groups(PIPELINE_SHAPE)
    return [(key, index[np.argsort(radix_key(batch.num_micro_batches[index]), kind="stable")])
            for key, index in groups], None


def shape_signature(shape: GroupShape) -> tuple[Any, ...]:
    """What of a group's shape its static state reads, by value: the placement and the patterns."""
    arrays = (shape.placement.dense_layers, shape.placement.moe_layers, shape.placement.stage_of,
              shape.placement.chunk_of, shape.pattern_of, shape.used, shape.chunks, shape.dense, shape.moe,
              shape.first, shape.last)
    return tuple((array.dtype.str, array.shape, array.tobytes()) for array in arrays)


#: The fields ``group_alike`` gives ``distinct_columns`` first after STATE_FIELDS. Their order changes
#: how the kinds are numbered (not which strategies are alike) and how often the key of the
#: combinations so far is renumbered on the way: these few-valued fields, then the micro-batch
#: count, renumber it twice, the second time at 155k combinations, where the batch's own order
#: renumbered three times at up to 620k (1M mixed DeepSeek-V3 strategies: distinct_columns 47-49
#: -> 42 ms, the same kinds; Llama-3.1-405B's 561k: 23-25 -> 23 ms).
_KIND_FIELDS_FIRST = ("sequence_parallel", "recompute", "num_micro_batches", "micro_batch_size", "cp_kind", "seq_length")


def group_alike(
    model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, groups: list[tuple[tuple[int, ...], np.ndarray]],
    stage_layers: tuple[int, ...] | None, group_of: np.ndarray | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """Per strategy of ``batch`` (in the pipeline-shape ``groups``: (key, rows)), its combination
    of STATE_FIELDS (as ``batch.distinct`` numbers them); and (a row of each kind of strategies
    alike in every field the model reads, per strategy its kind), or None where fewer than one
    in twenty of the strategies is alike another (so few rows less would not pay for gathering
    the fields and the figures by the kinds).

    A kind is a combination of every field but UNREAD_FIELDS and the context-parallel kind, and
    of that where the model reads it (``cp_kind_read``): a search prices its candidates' step
    times in each kind of context parallelism, whose exchange is mostly not the largest buffer;
    a mixed batch holds strategies with and without ``fsdp`` (on 1M DeepSeek-V3 strategies,
    908k kinds with it, 863k without; 656k Llama-3.1-405B ones, 516k and 418k). Every figure
    of a strategy is a function of those fields, computed row by row: a row of each kind stands
    for the others, bit for bit. STATE_FIELDS come first, their combinations found on the way."""
    hands_over_enabled = bool(options.profile.pipeline_stage_output)
    # Per strategy its group's number: the groups come in the order of their keys (the
    # pipeline shape's values, the first field the most significant), so the numbers rank the
    # shapes as the six fields do, and a column of them numbers the combinations as those
    # fields would, with five columns' passes less (1M mixed DeepSeek-V3 strategies: ~4 ms).
    # (``group_of``: the groups' numbers where the caller has them.)
    keys = [key for key, _ in groups]
    in_key_order = all(a < b for a, b in itertools.pairwise(keys))
    numbered = group_of is None
    group_number = np.empty(len(batch), dtype=np.int64) if group_of is None else group_of
    all_moe_of = np.empty(len(groups), dtype=bool)
    for g, (key, rows) in enumerate(groups):
        shape = group_shape(model, CODES["schedule"][key[0]], key[1], key[2], stage_layers, bool(key[4]),
                             bool(key[5]), hands_over_enabled, True)
        all_moe_of[g] = bool((shape.moe_per_stage > 0).all())
        if numbered:
            group_number[rows] = g
    read = cp_kind_read(model, batch, options, all_moe_of[group_number])
    # The fields past STATE_FIELDS, in the order ``_KIND_FIELDS_FIRST`` leads with.
    others = {name: getattr(batch, name) for name in batch.array_fields()
              if name not in STATE_FIELDS and name not in UNREAD_FIELDS and name != "cp_kind"}
    others["cp_kind"] = np.where(read, batch.cp_kind, -1)
    others = {**{name: others.pop(name) for name in _KIND_FIELDS_FIRST}, **others}
    state_columns = state_field_columns(batch)
    if in_key_order:
        state_columns = [group_number, *state_columns[len(PIPELINE_SHAPE):]]
    rows, kinds, static_code = distinct_columns([*state_columns, *others.values()], len(batch),
                                                prefix=len(state_columns))
    assert static_code is not None
    return static_code, None if 20 * len(rows) > 19 * len(batch) else (rows, kinds)


def group_combinations(rows: np.ndarray, codes: np.ndarray, part: slice) -> tuple[np.ndarray, np.ndarray] | None:
    """``StrategyBatch.distinct``'s (a row of each combination, each row's combination) of the
    rows ``part`` alone, from those of the whole batch, whose combinations are numbered in the
    order of the fields' values: the pipeline shape, a group's key, comes first among
    STATE_FIELDS, so a group's combinations are one run of numbers, [low, high): checked, as
    every number of the run has its row in the group; None where that fails."""
    if part.start == part.stop:
        return None
    group_codes = codes[part]
    low, high = int(group_codes.min()), int(group_codes.max()) + 1
    group_rows = rows[low:high]
    if group_rows.min() < part.start or group_rows.max() >= part.stop:
        return None
    return group_rows - part.start, group_codes - low
