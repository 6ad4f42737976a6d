"""Screen a search space's candidates block by block: duplicates and checks (the rules, what a
runtime can run) decided on the few values each depends on, columns built for the survivors alone.

A check is a function of a strategy batch's fields, and each field of a listed candidate is a
function of a few search dimensions (``FIELD_DIMENSIONS``: tp of tp alone, dp of tp, pp and
cp, ...). So a check's verdict on a block is its verdict on the product of the dimensions behind
the fields it reads (tens to thousands of combinations rather than a block's 2^18 candidates),
looked up by each candidate's position in the product. Every check's verdict is folded into one
code per candidate, the first check it breaks, as the search charges each candidate to the first
(in a table per group of dimensions, as few groups as the checks' dimensions nest in); a block's
candidates then cost a few passes over one byte each, and the batch columns are built only for
those that pass every check (in DeepSeek-V3's default space, 0.82M of 2.8M).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations
from math import prod
from typing import Any

import numpy as np

from ndplan.arrays import unique
from ndplan.search.space import BLOCK_ORDER, DIMENSIONS, FIELD_DIMENSIONS, SET_DIMENSIONS, SearchSpace
from ndplan.strategy.batch import StrategyBatch

_FIELDS = frozenset(field.name for field in dataclasses.fields(StrategyBatch))
#: The fields one value of which serves a whole batch (the precision, the module sets).
SHARED_FIELDS = _FIELDS - set(StrategyBatch.array_fields())

#: A condition on candidates: per strategy of a batch, True where it holds. It must read the
#: batch's fields only to compute with them element-wise (no branch on their values), so that
#: the fields it reads on one strategy are those it reads on any (``fields_read``).
Check = Callable[[StrategyBatch], np.ndarray]


@dataclass(frozen=True)
class ScreenedBlock:
    """A block of ``SearchSpace.blocks`` after screening."""

    #: Candidates the block lists.
    listed: int
    #: Per reason, the candidates charged to it: duplicates first, then each check in order.
    rejected: np.ndarray
    #: The survivors' candidate indices, in the block's order.
    index: np.ndarray
    #: The survivors' places in their part of the space, and that part's fields by place:
    #: ``part.batch(places.take(keep))`` equals ``batch.take(keep)``, built rather than gathered.
    places: Places
    part: PartFields

    @property
    def batch(self) -> StrategyBatch:
        """The survivors' batch (built on request: a search builds only the part of it that
        its static bound lets through, ``part.batch``)."""
        return self.part.batch(self.places)


@dataclass(frozen=True)
class Places:
    """Candidates' places in their part of a space (``PartFields``): a position there is
    ``row · part.inner_size + inner``. Split once per block (``PartFields.places``) and carried
    to the index, the static bound's combinations and the batches built from the part's tables,
    which each divided every position again (np.divmod: ~2 ms per 800K candidates each time)."""

    #: Per candidate, its row of the slower dimensions.
    row: np.ndarray
    #: Per candidate, its position in the product of the fastest dimensions.
    inner: np.ndarray

    def __len__(self) -> int:
        return len(self.row)

    def take(self, keep: np.ndarray) -> Places:
        """The places at ``keep`` (indices or a mask)."""
        return Places(self.row[keep], self.inner[keep])

    @staticmethod
    def concat(places: Sequence[Places]) -> Places:
        """``places`` one after another."""
        return Places(np.concatenate([p.row for p in places]), np.concatenate([p.inner for p in places]))


def screened_blocks(space: SearchSpace, checks: Sequence[Check], block_size: int) -> Iterator[ScreenedBlock]:
    """The blocks of ``space.blocks(block_size)`` (the same candidates, in the same order), each
    with the candidates no check rejects and, per reason, how many others each was the first to
    reject: ``space.duplicates``, then ``checks`` in order."""
    if space.size == 0:  # a value list left empty (a hand-built space): nothing to enumerate
        return
    passed = len(checks) + 1  # the code of a candidate that every check lets through
    tables = _Tables(space, checks)
    for digits in space.parts():
        sizes = [len(digits[name]) for name in BLOCK_ORDER]
        total = prod(sizes)
        first_rejections = tables.first_rejections(digits)
        reasons = _reasons(first_rejections, passed)
        fields = tables.fields(digits)
        # Blocks are cut from the product in BLOCK_ORDER: each is covered by whole slots of the
        # fastest dimensions, the first ``lead`` dimensions (a slot's) at most a block long.
        lead = next(k for k in range(len(sizes) + 1) if prod(sizes[k:]) <= block_size)
        slot = prod(sizes[lead:])
        for start in range(0, total, block_size):
            stop = min(start + block_size, total)
            slots = np.arange(start // slot, (stop - 1) // slot + 1)
            slot_digits = np.unravel_index(slots, sizes[:lead]) if lead else ()
            first = np.full((len(slots), *sizes[lead:]), passed, dtype=tables.code_type)
            for table in first_rejections:
                np.minimum(first, _slot_rows(table, slot_digits, lead), out=first)
            in_block = first.reshape(-1)[start - slots[0] * slot:stop - slots[0] * slot]
            rejected = np.zeros(passed, dtype=np.int64)
            for code in reasons:
                rejected[code] = np.count_nonzero(in_block == code)
            places = fields.places(start + np.flatnonzero(in_block == passed))  # the survivors'
            yield ScreenedBlock(stop - start, rejected, fields.index(places), places, fields)


def _reasons(first_rejections: list[np.ndarray], passed: int) -> list[int]:
    """The codes below ``passed`` that ``first_rejections``' tables hold: the only reasons a
    candidate of their part can be charged to (a few: 9 of the 36 reasons in DeepSeek-V3's
    default space). ``screened_blocks`` counts each over a block in one vectorised comparison:
    ``np.bincount`` over every code took 7.2 ms of the 2.8M candidates' 23 ms there, where runs
    of one code make a histogram's increments wait on each other; these counts take 1.6 ms."""
    if not first_rejections:
        return []
    held = unique(np.concatenate([table.ravel() for table in first_rejections]))
    return held[held < passed].tolist()


def _slot_rows(table: np.ndarray, slot_digits: tuple[np.ndarray, ...], lead: int) -> np.ndarray:
    """``table`` (over the BLOCK_ORDER axes, of size 1 where it does not vary) at the slots
    whose digits in the first ``lead`` dimensions are ``slot_digits``: [slots or 1, rest]."""
    if all(table.shape[axis] == 1 for axis in range(lead)):
        return table[(0,) * lead][np.newaxis]
    return table[tuple(slot_digits[axis] if table.shape[axis] > 1 else 0 for axis in range(lead))]


#: The most combinations a group of ``_Tables.first_rejections`` is joined up to.
JOINED_GROUP_LIMIT = 1 << 16


class _Tables:
    """What ``screened_blocks`` tabulates per part of a space, kept for the other parts that
    need the same: the parts differ only in their module sets and in the recompute values they
    list, which most checks and fields do not read."""

    def __init__(self, space: SearchSpace, checks: Sequence[Check]):
        self.space, self.checks = space, checks
        self.passed = len(checks) + 1
        self.code_type = np.uint8 if self.passed <= np.iinfo(np.uint8).max else np.uint16
        self._products: dict[tuple, StrategyBatch] = {}
        self._reads: dict[int, list[tuple[dict[str, Any], set[str]]]] = {}
        self._verdicts: dict[tuple, np.ndarray] = {}
        self._fields: dict[tuple, PartFields] = {}

    def product(self, digits: dict[str, np.ndarray], dims: set[str]) -> StrategyBatch:
        """The batch of every combination of the part's digits of ``dims``, in BLOCK_ORDER (the
        last fastest), the other dimensions at their first digit."""
        key = _key(digits, dims | set(SET_DIMENSIONS))
        if key not in self._products:
            shape = [len(digits[name]) if name in dims else 1 for name in BLOCK_ORDER]
            grid = np.indices(shape).reshape(len(shape), -1)
            self._products[key] = self.space.batch_at({name: digits[name][grid[axis]]
                                                       for axis, name in enumerate(BLOCK_ORDER)})
        return self._products[key]

    def fields(self, digits: dict[str, np.ndarray]) -> PartFields:
        """The part's ``PartFields``, but for the module sets those of a part with the same digits."""
        key = _key(digits, set(DIMENSIONS) - set(SET_DIMENSIONS))
        if key not in self._fields:
            self._fields[key] = PartFields(self, digits)
        return self._fields[key].for_sets(digits, self.product(digits, set()))

    def reads(self, code: int, digits: dict[str, np.ndarray]) -> set[str]:
        """The fields ``checks[code - 1]`` reads in the part (the same in every part where it
        finds the same values in the fields shared by a batch, where it reads any)."""
        probe = self.product(digits, set())
        for shared, fields in self._reads.setdefault(code, []):
            if all(getattr(probe, name) == value for name, value in shared.items()):
                return fields
        fields = fields_read(self.checks[code - 1], probe)
        shared = {name: getattr(probe, name) for name in fields & SHARED_FIELDS}
        self._reads[code].append((shared, fields))
        return fields

    def verdict(self, code: int, digits: dict[str, np.ndarray], varied: set[str]) -> tuple[set[str], np.ndarray]:
        """The dimensions ``checks[code - 1]`` depends on in the part, and over them (along the
        BLOCK_ORDER axes, size 1 along the others) where it holds."""
        reads = self.reads(code, digits)
        dims = {dim for field in reads for dim in FIELD_DIMENSIONS.get(field, ())} & varied
        probe = self.product(digits, set())  # one candidate of the part: its shared fields
        # A dimension left out of the key is one the check does not read, or one of a single
        # digit, the same in every part that reaches the key: parts differ only in their module
        # sets (shared fields, in the key where read) and in listing only the selective recompute
        # values after the first part, whose recompute then varies (so its key names recompute).
        key = (code, _key(digits, dims), tuple(getattr(probe, name) for name in sorted(reads & SHARED_FIELDS)))
        if key not in self._verdicts:
            batch = self.product(digits, dims)
            shape = [len(digits[name]) if name in dims else 1 for name in BLOCK_ORDER]
            self._verdicts[key] = np.broadcast_to(self.checks[code - 1](batch), (len(batch),)).reshape(shape)
        return dims, self._verdicts[key]

    def first_rejections(self, digits: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Tables whose minimum at a candidate of the part is the first reason it is rejected by
        (0: a duplicate, i: ``checks[i - 1]``; len(checks) + 1: none), each over the BLOCK_ORDER
        axes, of size 1 along the dimensions it does not depend on: one per group of dimensions,
        as few as the checks' dimensions nest in."""
        passed, code_type = self.passed, self.code_type
        varied = {name for name in BLOCK_ORDER if len(digits[name]) > 1}
        groups: list[tuple[set[str], np.ndarray]] = []

        def charge(dims: set[str], table: np.ndarray) -> None:
            """Fold ``table`` (over ``dims``) into a group whose dimensions hold its, or gather
            it with every group whose dimensions it holds."""
            if table.min() == passed:
                return
            for held, group in groups:
                if dims <= held:
                    np.minimum(group, table, out=group)
                    return
            apart = []
            for held, group in groups:
                if held <= dims:
                    table = np.minimum(table, group)
                else:
                    apart.append((held, group))
            groups[:] = [*apart, (dims, table)]

        for term in self.space.duplicate_terms():
            holds = np.ones([1] * len(BLOCK_ORDER), dtype=bool)
            for name, values in term.items():
                holds = holds & _along(BLOCK_ORDER.index(name), values[digits[name]])
            charge(set(term) & varied, np.where(holds, code_type(0), code_type(passed)))
        for code in range(1, passed):
            dims, holds = self.verdict(code, digits, varied)
            charge(dims, np.where(holds, code_type(passed), code_type(code)))
        # Each group costs a pass over every block: join the two whose joint table is smallest
        # while it stays small.
        while len(groups) > 1:
            size, i, j = min((prod(len(digits[name]) for name in groups[i][0] | groups[j][0]), i, j)
                             for i, j in combinations(range(len(groups)), 2))
            if size > JOINED_GROUP_LIMIT:
                break
            (dims_i, table_i), (dims_j, table_j) = groups[i], groups[j]
            groups[:] = [g for k, g in enumerate(groups) if k not in (i, j)] + [(dims_i | dims_j,
                                                                                 np.minimum(table_i, table_j))]
        return [table for _, table in groups]


def _key(digits: dict[str, np.ndarray], dims: set[str]) -> tuple:
    """The part's digits of ``dims``, as a key."""
    return tuple((name, digits[name].tobytes()) for name in BLOCK_ORDER if name in dims)


#: The most combinations of the fastest dimensions ``PartFields`` tabulates fields over.
INNER_LIMIT = 1 << 12


class PartFields:
    """The candidate index and every batch field of one part's candidates (``SearchSpace.parts``),
    tabulated, so that the survivors' fields cost a lookup or two each rather than digits and
    arithmetic. A position in the part splits into an outer row (of the slower dimensions of
    BLOCK_ORDER) and an inner position (of the fastest, INNER_LIMIT combinations at most). A
    field of dimensions on one side of the split is a table over that side; one of dimensions on
    both (num_micro_batches: tp, pp and cp outside, mbs inside) a table over the product of its
    own dimensions, found at an outer key plus an inner key."""

    def __init__(self, tables: _Tables, digits: dict[str, np.ndarray]):
        space = tables.space
        sizes = [len(digits[name]) for name in BLOCK_ORDER]
        split = next(k for k in range(len(sizes) + 1) if prod(sizes[k:]) <= INNER_LIMIT)
        self.inner_size = prod(sizes[split:])
        outer = np.unravel_index(np.arange(prod(sizes[:split])), sizes[:split]) if split else ()
        inner = np.unravel_index(np.arange(self.inner_size), sizes[split:])
        at = {name: outer[axis] if axis < split else inner[axis - split] for axis, name in enumerate(BLOCK_ORDER)}
        self.sizes, self.split, self.at = sizes, split, at
        self._combinations: dict[frozenset[str], tuple[np.ndarray, np.ndarray, int]] = {}
        # The index without the module sets' digits (the part's own, ``for_sets``).
        self.stride = dict(zip(DIMENSIONS, np.cumprod([1, *space.sizes[:0:-1]])[::-1], strict=True))
        stride = {name: 0 if name in SET_DIMENSIONS else self.stride[name] for name in DIMENSIONS}
        self.outer_index = sum((digits[name][at[name]] * stride[name] for name in BLOCK_ORDER[:split]),
                               np.zeros(len(outer[0]) if split else 1, dtype=np.int64))
        self.inner_index = sum((digits[name][at[name]] * stride[name] for name in BLOCK_ORDER[split:]),
                               np.zeros(self.inner_size, dtype=np.int64))
        varied = [axis for axis, size in enumerate(sizes) if size > 1]
        by_axes: dict[tuple[int, ...], list[str]] = {}
        for name in StrategyBatch.array_fields():
            dims = FIELD_DIMENSIONS.get(name, ())
            by_axes.setdefault(tuple(a for a in varied if BLOCK_ORDER[a] in dims), []).append(name)
        # Per field, one of: its value; its value by outer row; by inner position; by the key
        # of its own dimensions' product, the sum of a key by outer row and one by inner position.
        self.constants: dict[str, np.ndarray] = {}
        self.by_row: dict[str, np.ndarray] = {}
        self.by_inner: dict[str, np.ndarray] = {}
        self.by_key: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for axes, names in by_axes.items():
            probe = tables.product(digits, {BLOCK_ORDER[a] for a in axes})
            outer_key, inner_key, inner_count = self._split_keys(axes)
            for name in names:
                values = getattr(probe, name)
                if values.min() == values.max():
                    self.constants[name] = np.asarray(values[0], dtype=np.int64)
                elif not any(a >= split for a in axes):
                    self.by_row[name] = values[outer_key]
                elif not any(a < split for a in axes):
                    self.by_inner[name] = values[inner_key]
                else:
                    self.by_key[name] = (outer_key * inner_count, inner_key, values)
        self.shared: dict[str, Any] = {}

    def _split_keys(self, axes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Per outer row and per inner position, its combination of the digits along ``axes``
        (BLOCK_ORDER axes) on that side of the split, and the inner side's count of them: a
        candidate's combination over ``axes`` is outer_key[row] · count + inner_key[inner]."""
        sizes, split, at = self.sizes, self.split, self.at
        outer_axes, inner_axes = [a for a in axes if a < split], [a for a in axes if a >= split]
        outer_key = np.ravel_multi_index([at[BLOCK_ORDER[a]] for a in outer_axes], [sizes[a] for a in outer_axes])
        inner_key = np.ravel_multi_index([at[BLOCK_ORDER[a]] for a in inner_axes], [sizes[a] for a in inner_axes])
        return outer_key, inner_key, prod(sizes[a] for a in inner_axes)

    def for_sets(self, digits: dict[str, np.ndarray], batch: StrategyBatch) -> PartFields:
        """These tables for a part of the same digits but for the module sets: ``digits``'s,
        whose batches share the precision and the module sets of ``batch``."""
        other = copy.copy(self)
        other.outer_index = self.outer_index + sum(int(digits[name][0]) * self.stride[name] for name in SET_DIMENSIONS)
        other.shared = {name: getattr(batch, name) for name in SHARED_FIELDS}
        return other

    def places(self, position: np.ndarray) -> Places:
        """The places of the candidates at ``position`` in the part (a floor division and a
        product: numpy divides by one number faster than np.divmod gives both)."""
        row = position // self.inner_size
        return Places(row, position - row * self.inner_size)

    def index(self, places: Places) -> np.ndarray:
        """The candidate indices at ``places`` in the part."""
        return self.outer_index.take(places.row) + self.inner_index.take(places.inner)

    def combination(self, places: Places, dims: frozenset[str]) -> tuple[np.ndarray, int]:
        """Per candidate at ``places`` in the part, its combination of the part's digits of
        ``dims`` (its position in their product), and how many combinations there are: where
        two candidates share one, they share every field of those dimensions alone."""
        if dims not in self._combinations:
            axes = [axis for axis, name in enumerate(BLOCK_ORDER) if name in dims]
            outer_key, inner_key, inner_count = self._split_keys(axes)
            self._combinations[dims] = (np.broadcast_to(outer_key * inner_count, (len(self.outer_index),)),
                                        np.broadcast_to(inner_key, (self.inner_size,)),
                                        prod(self.sizes[a] for a in axes))
        outer_key, inner_key, count = self._combinations[dims]
        return outer_key.take(places.row) + inner_key.take(places.inner), count

    def batch(self, places: Places) -> StrategyBatch:
        """The batch of the candidates at ``places`` in the part."""
        row, inner = places.row, places.inner
        # A field the whole part holds at one value stays a read-only broadcast view (no memory
        # written per candidate; gathering or computing from it reads one cached value).
        arrays: dict[str, Any] = {name: np.broadcast_to(value, (len(places),)) for name, value in self.constants.items()}
        arrays |= {name: table.take(row) for name, table in self.by_row.items()}
        arrays |= {name: table.take(inner) for name, table in self.by_inner.items()}
        arrays |= {name: values.take(outer_key.take(row) + inner_key.take(inner))
                   for name, (outer_key, inner_key, values) in self.by_key.items()}
        return StrategyBatch(**arrays, **self.shared)


def _along(axis: int, values: np.ndarray) -> np.ndarray:
    """``values`` laid along ``axis`` of the BLOCK_ORDER axes."""
    shape = [1] * len(BLOCK_ORDER)
    shape[axis] = len(values)
    return values.reshape(shape)


def fields_read(check: Check, batch: StrategyBatch) -> set[str]:
    """The fields of ``batch`` that ``check`` reads (directly, through properties or through
    ``is_`` and ``is_in``) when run on it."""
    recorder = _ReadRecorder(**{name: getattr(batch, name) for name in batch.array_fields()},
                             precision=batch.precision, recompute_modules=batch.recompute_modules,
                             offload_modules=batch.offload_modules,
                             optimizer_offload_fraction=batch.optimizer_offload_fraction)
    object.__setattr__(recorder, "read", set())
    check(recorder)
    return set(object.__getattribute__(recorder, "read"))


class _ReadRecorder(StrategyBatch):
    """A batch that notes in ``read`` the name of each field looked up on it."""

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELDS:
            object.__getattribute__(self, "read").add(name)
        return object.__getattribute__(self, name)
