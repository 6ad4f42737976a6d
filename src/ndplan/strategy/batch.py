"""StrategyBatch: many strategies as a struct of numpy arrays, so one formula serves them all.

A single strategy is a batch of one. Categorical fields (schedule, cp_kind, recompute) are stored
as integer codes into the tuples of ``strategy.py``; booleans as 0/1. The precision policy and
the recompute modules are shared by the whole batch (a search varies neither). Per-strategy layer
placements (``stage_layers``) are not batched: a batch uses the uniform placement, and a placed
strategy is evaluated on its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ndplan.arrays import unique
from ndplan.strategy.precision import PRECISION_PRESETS, PrecisionPolicy
from ndplan.strategy.strategy import CP_KINDS, RECOMPUTES, SCHEDULES, Strategy

#: Categorical fields and their code tables.
CODES: dict[str, tuple[str, ...]] = {"schedule": SCHEDULES, "cp_kind": CP_KINDS, "recompute": RECOMPUTES}

IntArray = np.ndarray

#: Fields one value of which serves the whole batch.
_SHARED_FIELDS = ("precision", "recompute_modules", "offload_modules", "optimizer_offload_fraction")


@dataclass(frozen=True)
class StrategyBatch:
    """Parallel arrays, one entry per strategy; see ``Strategy`` for the meaning of each field."""

    dp: IntArray
    tp: IntArray
    pp: IntArray
    cp: IntArray
    cp_kind: IntArray
    ulysses_degree: IntArray
    ep: IntArray
    etp: IntArray
    sequence_parallel: IntArray
    vpp: IntArray
    schedule: IntArray
    seq_chunks: IntArray
    embedding_as_layer: IntArray
    output_as_layer: IntArray
    zero: IntArray
    fsdp: IntArray
    shard_group: IntArray
    reshard_after_forward: IntArray
    optimizer_offload: IntArray
    offload_optimizer_states: IntArray
    recompute: IntArray
    recompute_layers: IntArray
    offload_layers: IntArray
    micro_batch_size: IntArray
    num_micro_batches: IntArray
    pipeline_runs: IntArray
    global_batch_size: IntArray
    seq_length: IntArray
    precision: PrecisionPolicy = PRECISION_PRESETS["megatron-bf16"]
    #: ``Strategy.recompute_modules`` of every strategy of the batch that recomputes selectively.
    recompute_modules: tuple[str, ...] = ()
    #: ``Strategy.offload_modules``, the same for every strategy of the batch.
    offload_modules: tuple[str, ...] = ()
    #: ``Strategy.optimizer_offload_fraction`` of the strategies that offload the optimizer (the
    #: same for every one of them; 1.0 where none does).
    optimizer_offload_fraction: float = 1.0

    @classmethod
    def array_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name not in _SHARED_FIELDS)

    @classmethod
    def from_columns(
        cls, columns: dict[str, Any], precision: PrecisionPolicy | None = None, *, owned: bool = False,
        recompute_modules: tuple[str, ...] = (), offload_modules: tuple[str, ...] = (),
        optimizer_offload_fraction: float = 1.0,
    ) -> StrategyBatch:
        """Build from arrays (or scalars, broadcast); missing fields take Strategy's defaults,
        categorical fields may be given as names or codes. ``owned``: the caller hands its
        arrays over (it keeps no reference it writes to), so int64 arrays of the batch's length
        are kept rather than copied."""
        defaults = Strategy()
        size = max((np.size(v) for v in columns.values()), default=1)
        arrays: dict[str, IntArray] = {}
        for name in cls.array_fields():
            value = columns.get(name, getattr(defaults, name))
            if name in CODES:
                value = encode(name, value)
            if owned and isinstance(value, np.ndarray) and value.dtype == np.int64 and value.shape == (size,) \
                    and value.flags.c_contiguous:
                arrays[name] = value
            else:
                arrays[name] = np.broadcast_to(np.asarray(value, dtype=np.int64), (size,)).copy()
        if "etp" not in columns:
            arrays["etp"] = arrays["tp"].copy()
        else:
            arrays["etp"] = np.where(arrays["etp"] == 0, arrays["tp"], arrays["etp"])
        if "global_batch_size" not in columns:
            arrays["global_batch_size"] = (arrays["dp"] * arrays["micro_batch_size"] * arrays["num_micro_batches"]
                                           * arrays["pipeline_runs"])
        return cls(**arrays, precision=precision or defaults.precision, recompute_modules=tuple(recompute_modules),
                   offload_modules=tuple(offload_modules), optimizer_offload_fraction=float(optimizer_offload_fraction))

    @classmethod
    def of(cls, strategies: Strategy | Sequence[Strategy]) -> StrategyBatch:
        items = [strategies] if isinstance(strategies, Strategy) else list(strategies)
        if not items:
            raise ValueError("an empty list of strategies makes no batch")
        precision = items[0].precision
        if any(s.precision != precision for s in items):
            raise ValueError("a batch shares one precision policy")
        modules = next((s.recompute_modules for s in items if s.recompute_modules), ())
        if any(s.recompute_modules not in ((), modules) for s in items):
            raise ValueError("a batch shares one set of recompute modules")
        if modules and any(s.recompute == "selective" and not s.recompute_modules for s in items):
            raise ValueError("a batch's selective recompute is the same everywhere: with or without recompute modules")
        offload = items[0].offload_modules
        if any(s.offload_modules != offload for s in items):
            raise ValueError("a batch shares one set of offload modules")
        fractions = {s.optimizer_offload_fraction for s in items if s.optimizer_offload}
        if len(fractions) > 1:
            raise ValueError("a batch's offloaded optimizers share one optimizer_offload_fraction")
        columns = {name: [getattr(s, name) for s in items] for name in cls.array_fields()}
        return cls.from_columns(columns, precision, recompute_modules=modules, offload_modules=offload,
                                optimizer_offload_fraction=fractions.pop() if fractions else 1.0)

    @classmethod
    def concat(cls, batches: Sequence[StrategyBatch]) -> StrategyBatch:
        """The strategies of ``batches`` one after another (they share the batch-wide fields)."""
        if not batches:
            raise ValueError("concatenating no batches makes no batch")
        first = batches[0]
        shared = (first.precision, first.recompute_modules, first.offload_modules, first.optimizer_offload_fraction)
        if any((b.precision, b.recompute_modules, b.offload_modules, b.optimizer_offload_fraction) != shared
               for b in batches[1:]):
            raise ValueError("batches to concatenate share one precision policy, module sets and optimizer "
                             "offload fraction")
        if len(batches) == 1:
            return first
        return cls(**{n: np.concatenate([getattr(b, n) for b in batches]) for n in cls.array_fields()},
                   precision=first.precision, recompute_modules=first.recompute_modules,
                   offload_modules=first.offload_modules, optimizer_offload_fraction=first.optimizer_offload_fraction)

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    @property
    def micro_batches_per_step(self) -> IntArray:
        """Micro-batches a pipeline rank runs per step, over all its pipeline runs."""
        return self.num_micro_batches * self.pipeline_runs

    def take(self, index: IntArray | slice) -> StrategyBatch:
        """The strategies at ``index`` (an integer array, a boolean mask, or a slice: views)."""
        return StrategyBatch(**{n: getattr(self, n)[index] for n in self.array_fields()}, precision=self.precision,
                             recompute_modules=self.recompute_modules, offload_modules=self.offload_modules,
                             optimizer_offload_fraction=self.optimizer_offload_fraction)

    def row(self, i: int) -> Strategy:
        """Strategy ``i`` of the batch."""
        values: dict[str, Any] = {}
        for name in self.array_fields():
            value = int(getattr(self, name)[i])
            if name in CODES:
                values[name] = CODES[name][value]
            elif isinstance(Strategy.model_fields[name].default, bool):
                values[name] = bool(value)
            else:
                values[name] = value
        modules = self.recompute_modules if values["recompute"] == "selective" else ()
        fraction = self.optimizer_offload_fraction if values["optimizer_offload"] else 1.0
        return Strategy(**values, precision=self.precision, recompute_modules=modules, offload_modules=self.offload_modules,
                        optimizer_offload_fraction=fraction)

    def rows(self) -> Iterator[Strategy]:
        """Every strategy of the batch, in order."""
        return (self.row(i) for i in range(len(self)))

    def groups(self, names: Sequence[str]) -> list[tuple[tuple[int, ...], np.ndarray]]:
        """Split the batch by the values of ``names``: [(values, indices)], indices ascending.

        The fields are packed into one int64 key (each field's values < 2^bits) so that one
        sort groups millions of strategies; the search evaluates each group with shared work.
        """
        columns = [getattr(self, name) for name in names]
        key = np.zeros(len(self), dtype=np.int64)
        for column in columns:  # in place: no temporary the size of the batch per field
            key <<= max(int(column.max()).bit_length(), 1)
            key |= column
        changes = np.ones(len(key), dtype=bool)
        np.not_equal(key[1:], key[:-1], out=changes[1:])
        run_starts = np.flatnonzero(changes)
        # (Many more runs than keys can hold: not one run per key, and no need to look.)
        if len(run_starts) <= int(key.max()) + 1:
            run_keys = key[run_starts]
            by_key = np.argsort(run_keys)
            ordered = run_keys[by_key]
            if bool(np.all(ordered[1:] > ordered[:-1])):
                # Each group's strategies are one run (a search's batches run group by group):
                # the runs in the order of their keys are what the sort gives, without sorting.
                run_ends = np.append(run_starts[1:], len(key))
                return [(tuple(int(c[run_starts[r]]) for c in columns), np.arange(run_starts[r], run_ends[r]))
                        for r in by_key.tolist()]
        # A stable sort's order is unique; on keys of at most 16 bits numpy sorts by radix. The
        # keys' ranks (dense codes) sort alike, and fit 16 bits wherever the groups are fewer
        # than 65536 (1M mixed strategies: groups in 39-43 ms, against 89-94 ms sorting 17-bit keys).
        if key.max() >= 1 << 16:
            ranks, count = dense_codes(key)
            if count <= 1 << 16:
                key = ranks
        order = np.argsort(radix_key(key), kind="stable")
        sorted_key = key[order]
        starts = np.flatnonzero(np.diff(sorted_key, prepend=sorted_key[0] - 1))
        ends = np.append(starts[1:], len(order))
        return [
            (tuple(int(c[order[a]]) for c in columns), order[a:b])
            for a, b in zip(starts, ends, strict=True)
        ]

    def distinct(self, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The distinct combinations of the values of ``names``: (a row of each, and per row
        the index of its combination), so that a function of those fields alone is computed once
        per combination. Linear in the batch where each field's values span a small range (a
        search draws each from a few values): whenever the numbers of the combinations so far
        would outgrow a table about the batch's length, they are renumbered densely, in order,
        through one, rather than sorting the key the fields span together (millions of values for
        a dozen fields) at the end; by sorting otherwise, and once the combinations so far are
        too many for a renumbering to stay cheap (a million mixed strategies), by one sort at
        the end."""
        rows, codes, _ = distinct_columns([getattr(self, name) for name in names], len(self))
        return rows, codes

    @property
    def ulysses_ranks(self) -> np.ndarray:
        """Ranks of each strategy's Ulysses all-to-all group (``ulysses_ranks``)."""
        return ulysses_ranks(self.cp, self.cp_kind, self.ulysses_degree)

    def is_(self, name: str, label: str) -> np.ndarray:
        """Mask of strategies whose categorical field ``name`` equals ``label``."""
        return np.asarray(getattr(self, name) == CODES[name].index(label))

    def is_in(self, name: str, labels: Sequence[str]) -> np.ndarray:
        """Per strategy, whether its ``name`` field (a coded label: schedule, recompute, ...) is one of ``labels``."""
        return np.isin(getattr(self, name), [CODES[name].index(label) for label in labels])


def ulysses_ranks(cp: np.ndarray, cp_kind: np.ndarray, ulysses_degree: np.ndarray) -> np.ndarray:
    """Ranks of each strategy's Ulysses all-to-all group, from its coded fields: cp under
    'ulysses', ulysses_degree under 'hybrid', 1 under the kinds that run none (ring, allgather)."""
    kind = np.asarray(cp_kind)
    return np.where(kind == _ULYSSES_CODE, cp, np.where(kind == _HYBRID_CODE, ulysses_degree, 1))


_ULYSSES_CODE, _HYBRID_CODE = CP_KINDS.index("ulysses"), CP_KINDS.index("hybrid")


#: Field values spanning fewer than this many are coded by value in ``StrategyBatch.distinct``.
_SMALL_RANGE = 16
#: The largest key span ``distinct_columns`` renumbers through a presence table on the way.
_RENUMBERED_SPAN = 1 << 20
#: ``distinct_columns`` lets its key span this many times the rows (up to ``_RENUMBERED_SPAN``)
#: before it renumbers the key densely.
_SPAN_PER_ROW = 4


def distinct_columns(
    columns: Sequence[IntArray], n: int, prefix: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``StrategyBatch.distinct`` of integer ``columns`` (``n`` values each, the first the most
    significant): (a row of each combination, and per row the index of its combination, the
    combinations numbered in the order of their values); and with ``prefix``, per row the
    index of its combination of the first ``prefix`` columns alone (as ``distinct`` of those
    numbers them), found on the way."""
    codes, count, prefix_codes = combination_codes(columns, n, prefix)
    rows = np.zeros(count, dtype=np.int64)
    rows[codes] = np.arange(n)  # any row of a combination stands for it
    return rows, codes, prefix_codes


def combination_codes(
    columns: Sequence[IntArray], n: int, prefix: int = 0,
) -> tuple[np.ndarray, int, np.ndarray | None]:
    """``distinct_columns`` without a row of each combination: (per row the index of its
    combination, their count, and the prefix's as there), for callers that gather nothing by
    the combinations' rows (``row_codes``: a scatter of the batch's length less a call)."""
    if not n:
        return np.zeros(0, dtype=np.int64), 0, np.zeros(0, dtype=np.int64)
    # Each row's key is its combination's number so far (mixed radix, < span) plus ``base``, the
    # same for every row: a field of small values joins the key as it is rather than less its
    # smallest (key · count + value), whose sum ``base`` collects; the ranks are the same (1M
    # mixed strategies: a pass and a temporary less per field). None until a field varies.
    key: np.ndarray | None = None
    span = 1
    base = 0
    # A renumbering costs a pass over the rows and one over its table: a search's batches (70K-
    # 220K rows, 20-23 fields, 100K+ combinations) renumbered 5-7 times with the table at the
    # rows' count, 3 times at four times it (the 31 calls of DeepSeek-V3's search, from the
    # memory and time models: 52.9 -> 49.2 ms); a million rows renumber alike (2^20 either way).
    table_size = max(n, min(_SPAN_PER_ROW * n, _RENUMBERED_SPAN), 1 << 16)
    prefix_codes: np.ndarray | None = None
    for column, values in enumerate(columns):
        if prefix and column == prefix:
            prefix_codes, prefix_count = _key_codes(key, base, span, n)
            if key is not None:
                # The prefix's codes are the key renumbered densely: carried on from them, the key
                # spans fewer values, and the renumbering it would soon need comes later or never
                # (group_alike's 23 fields on both models' mixed batches: one renumbering less, 1-3 ms).
                key, span, base = prefix_codes.copy(), prefix_count, 0
        if values.strides == (0,):
            continue  # one value broadcast (a field a batch holds at one value): the key unchanged
        low, high = int(values.min()), int(values.max())
        if low == high:
            continue  # one value: one code, the key unchanged
        if 0 <= low and high < _SMALL_RANGE:
            # Codes by value rather than by rank: the same order of the combinations, a
            # few passes less (most fields: tp, cp, recompute, ...).
            codes, count, shift = values, high - low + 1, low
        elif high - low < _SMALL_RANGE:
            codes, count, shift = values - low, high - low + 1, 0
        else:
            codes, count = dense_codes(values, low, high)
            shift = 0
        # Renumbered only while the key's presence table stays small: past 2^20 values its
        # 8 MB of codes leave the cache, or the renumbering sorts (DeepSeek-V3's 1M mixed
        # strategies, 26 fields: three such renumberings and a sort at the end took 230 ms,
        # one sort at the end 150 ms). The key then grows (mixed radix) until it would overflow.
        if key is not None and ((span * count > table_size and span <= _RENUMBERED_SPAN)
                                or (base + span) * count + shift >= 1 << 62):
            key, span = dense_codes(key, base, base + span - 1)
            base = 0
        if key is None:
            key = codes.astype(np.int64, copy=codes is values)  # its own array, written in place below
        else:
            key *= count
            key += codes
        base = base * count + shift
        span *= count
    codes, count = _key_codes(key, base, span, n)
    if prefix and prefix_codes is None:  # (no columns past the prefix)
        prefix_codes = codes
    return codes, count, prefix_codes


def _key_codes(key: IntArray | None, base: int, span: int, n: int) -> tuple[np.ndarray, int]:
    """``dense_codes`` of ``distinct_columns``' key, whose values lie in [base, base + span)
    (None: every row alike, code 0)."""
    if key is None:
        return np.zeros(n, dtype=np.int64), 1
    return dense_codes(key, base, base + span - 1)


def dense_codes(values: IntArray, low: int | None = None, high: int | None = None) -> tuple[np.ndarray, int]:
    """Per value its rank among the distinct values (0, 1, ...) and their count (``low`` and
    ``high``: the values' smallest and largest, where the caller has them). A presence table
    over [low, high] where it is not much longer than the data (linear time, no sort), numbered
    where a value is present (a running sum over the whole table costs ~3x more); else a sort."""
    if not len(values):
        return np.zeros(0, dtype=np.int64), 0
    if low is None or high is None:
        low, high = int(values.min()), int(values.max())
    if high - low < max(1 << 20, 2 * len(values)):
        # The tables start at 0 where that at most doubles them: indexed by the values as they
        # are, a pass and a temporary less (sequence lengths, degrees, micro-batch counts). Not
        # below 0: a negative value would index the table from its end, as another value.
        start = 0 if 0 <= low <= high - low else low
        offset = values - start if start else values
        present = np.zeros(high - start + 1, dtype=bool)
        present[offset] = True
        distinct = np.flatnonzero(present)
        code_of = np.empty(high - start + 1, dtype=np.int64)  # entries never present are never read
        code_of[distinct] = np.arange(len(distinct))
        # take, not code_of[offset]: the same codes, and ~35% faster from a table that stays in
        # cache (1M values into 2,049 entries: 0.39 against 0.58 ms; alike from larger ones).
        return code_of.take(offset), len(distinct)
    if len(values) and (high - low).bit_length() + (len(values) - 1).bit_length() <= 63:
        return _ranks_by_packed_sort(values, low, high)
    distinct, codes = unique(values, return_inverse=True)
    return codes.astype(np.int64, copy=False), len(distinct)


def _ranks_by_packed_sort(values: IntArray, low: int, high: int) -> tuple[np.ndarray, int]:
    """``dense_codes`` by one sort of values alone: each value less ``low``, shifted left, with
    its row's index in the low bits (the caller checks that both fit 63 bits), so that the sorted
    keys carry their rows. Sorting plain integers takes numpy's vectorised sort, several times
    faster than the argsort and gather of ``unique`` (1M values, 864,885 distinct: ~9.5 ms
    against ~26 ms); the ranks are the same."""
    bits = (len(values) - 1).bit_length()
    keys = np.subtract(values, low, dtype=np.int64)
    keys <<= bits
    keys |= np.arange(len(values))
    keys.sort()
    order = keys & ((1 << bits) - 1)
    keys >>= bits  # the values less ``low``, in increasing order
    starts = np.empty(len(keys), dtype=bool)  # where a value differs from the one before it
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    ranks = np.cumsum(starts)
    ranks -= 1
    codes = np.empty(len(values), dtype=np.int64)
    codes[order] = ranks
    return codes, int(ranks[-1]) + 1


def radix_key(values: IntArray) -> np.ndarray:
    """``values`` as uint16 where they fit (the same stable sort order, sorted by radix), else as is."""
    if len(values) and values.min() >= 0 and values.max() < 1 << 16:
        return values.astype(np.uint16)
    return values


def encode(name: str, value: Any) -> Any:
    """Names to codes for a categorical field, element-wise; codes pass through."""
    table = CODES[name]
    if isinstance(value, str):
        return table.index(value)
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) and isinstance(value[0], str):
        return [table.index(v) for v in value]
    return value
