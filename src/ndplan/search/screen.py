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

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from ndplan.search.space import BLOCK_ORDER, DIMENSIONS, FIELD_DIMENSIONS, SearchSpace
from ndplan.strategy.batch import StrategyBatch

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
    #: The survivors' candidate indices and their batch, in the block's order.
    index: np.ndarray
    batch: StrategyBatch


def screened_blocks(space: SearchSpace, checks: Sequence[Check], block_size: int) -> Iterator[ScreenedBlock]:
    """The blocks of ``space.blocks(block_size)`` (the same candidates, in the same order), each
    with the candidates no check rejects and, per reason, how many others each was the first to
    reject: ``space.duplicates``, then ``checks`` in order."""
    passed = len(checks) + 1  # the code of a candidate that every check lets through
    code_type = np.uint8 if passed <= np.iinfo(np.uint8).max else np.uint16
    for digits in space.parts():
        sizes = [len(digits[name]) for name in BLOCK_ORDER]
        total = prod(sizes)
        tables = _first_rejections(space, digits, checks, code_type)
        nobody = space.batch_at({name: digits[name][:1] for name in DIMENSIONS}).take(slice(0, 0))
        # Blocks are cut from the product in BLOCK_ORDER: each is covered by whole slots of the
        # fastest dimensions, the first ``lead`` dimensions (a slot's) at most a block long.
        lead = next(k for k in range(len(sizes) + 1) if prod(sizes[k:]) <= block_size)
        slot = prod(sizes[lead:])
        for start in range(0, total, block_size):
            stop = min(start + block_size, total)
            slots = np.arange(start // slot, (stop - 1) // slot + 1)
            slot_digits = np.unravel_index(slots, sizes[:lead]) if lead else ()
            first = np.full((len(slots), *sizes[lead:]), passed, dtype=code_type)
            for table in tables:
                np.minimum(first, _slot_rows(table, slot_digits, lead), out=first)
            head, tail = start - slots[0] * slot, stop - slots[0] * slot
            rejected = np.bincount(first.reshape(-1)[head:tail], minlength=passed + 1)[:passed]
            alive = first == passed
            alive.reshape(-1)[:head] = False
            alive.reshape(-1)[tail:] = False
            position = np.nonzero(alive)  # per survivor, its slot and its trailing dimensions' digits
            if not len(position[0]):
                yield ScreenedBlock(stop - start, rejected, np.zeros(0, dtype=np.int64), nobody)
                continue
            at: dict[str, Any] = {}
            for axis, name in enumerate(BLOCK_ORDER):
                where = slot_digits[axis][position[0]] if axis < lead else position[axis - lead + 1]
                at[name] = digits[name][where] if sizes[axis] > 1 else np.full(len(where), digits[name][0])
            index = np.ravel_multi_index(tuple(at[name] for name in DIMENSIONS), space.sizes)
            yield ScreenedBlock(stop - start, rejected, index, space.batch_at(at))


def _slot_rows(table: np.ndarray, slot_digits: tuple[np.ndarray, ...], lead: int) -> np.ndarray:
    """``table`` (over the BLOCK_ORDER axes, of size 1 where it does not vary) at the slots
    whose digits in the first ``lead`` dimensions are ``slot_digits``: [slots or 1, rest]."""
    if all(table.shape[axis] == 1 for axis in range(lead)):
        return table[(0,) * lead][np.newaxis]
    return table[tuple(slot_digits[axis] if table.shape[axis] > 1 else 0 for axis in range(lead))]


def _first_rejections(space: SearchSpace, digits: dict[str, np.ndarray], checks: Sequence[Check],
                      code_type: type) -> list[np.ndarray]:
    """Tables whose minimum at a candidate is the first reason it is rejected by (0: a duplicate,
    i: ``checks[i - 1]``; len(checks) + 1: none), each over the BLOCK_ORDER axes of one part of
    the space (``digits``), of size 1 along the dimensions it does not depend on."""
    passed = len(checks) + 1
    varied = {name for name in BLOCK_ORDER if len(digits[name]) > 1}
    groups: list[tuple[set[str], np.ndarray]] = []

    def charge(dims: set[str], table: np.ndarray) -> None:
        """Fold ``table`` (over ``dims``) into a group whose dimensions hold its, or gather it
        with every group whose dimensions it holds."""
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

    for term in space.duplicate_terms():
        holds = np.ones([1] * len(BLOCK_ORDER), dtype=bool)
        for name, values in term.items():
            holds = holds & _along(BLOCK_ORDER.index(name), values[digits[name]])
        charge(set(term) & varied, np.where(holds, code_type(0), code_type(passed)))

    anyone = space.batch_at({name: digits[name][:1] for name in DIMENSIONS})
    for code, check in enumerate(checks, start=1):
        dims = {dim for field in fields_read(check, anyone) for dim in FIELD_DIMENSIONS.get(field, ())} & varied
        shape = [len(digits[name]) if name in dims else 1 for name in BLOCK_ORDER]
        grid = np.indices(shape).reshape(len(shape), -1)
        batch = space.batch_at({name: digits[name][grid[axis]] for axis, name in enumerate(BLOCK_ORDER)})
        holds = np.broadcast_to(check(batch), (len(batch),)).reshape(shape)
        charge(dims, np.where(holds, code_type(passed), code_type(code)))
    return [table for _, table in groups]


def _along(axis: int, values: np.ndarray) -> np.ndarray:
    """``values`` laid along ``axis`` of the BLOCK_ORDER axes."""
    shape = [1] * len(BLOCK_ORDER)
    shape[axis] = len(values)
    return values.reshape(shape)


def fields_read(check: Check, batch: StrategyBatch) -> set[str]:
    """The array fields of ``batch`` that ``check`` reads (directly, through properties or
    through ``is_`` and ``is_in``) when run on it."""
    recorder = _ReadRecorder(**{name: getattr(batch, name) for name in batch.array_fields()},
                             precision=batch.precision, recompute_modules=batch.recompute_modules,
                             offload_modules=batch.offload_modules)
    object.__setattr__(recorder, "read", set())
    check(recorder)
    return set(object.__getattribute__(recorder, "read"))


_ARRAY_FIELDS = frozenset(StrategyBatch.array_fields())


class _ReadRecorder(StrategyBatch):
    """A batch that notes in ``read`` the name of each array field looked up on it."""

    def __getattribute__(self, name: str) -> Any:
        if name in _ARRAY_FIELDS:
            object.__getattribute__(self, "read").add(name)
        return object.__getattribute__(self, name)
