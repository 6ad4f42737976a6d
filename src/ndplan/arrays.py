"""Small array helpers the batch paths share (strategy batches, the memory and time models).

``gathered`` takes an integer column in another order through an int32 copy (half the cache
lines a random gather reads) or broadcasts its one value.

``unique`` stands in for ``np.unique`` on 1-D arrays: the same results, without the import of
``numpy.ma`` that numpy 2's ``np.unique`` makes on its first call in a process (its values-only
path asks ``np.ma.is_masked``: 6-14 ms once, paid inside the first search).
"""

from __future__ import annotations

from typing import Literal, overload

import numpy as np


@overload
def unique(values: np.ndarray, return_index: Literal[False] = ..., return_inverse: Literal[False] = ...) -> np.ndarray:
    ...


@overload
def unique(values: np.ndarray, return_index: Literal[True], return_inverse: Literal[False] = ...,
           ) -> tuple[np.ndarray, np.ndarray]:
    ...


@overload
def unique(values: np.ndarray, return_index: Literal[False] = ..., *, return_inverse: Literal[True],
           ) -> tuple[np.ndarray, np.ndarray]:
    ...


@overload
def unique(values: np.ndarray, return_index: Literal[True], return_inverse: Literal[True],
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ...


def unique(values: np.ndarray, return_index: bool = False, return_inverse: bool = False,
           ) -> np.ndarray | tuple[np.ndarray, ...]:
    """The sorted distinct values of ``values`` (flattened); with ``return_index`` the position of
    each one's first occurrence, with ``return_inverse`` per value the position of its distinct
    value (shaped as ``values``): ``np.unique``'s results for the same arguments, in the same
    order (values, index, inverse), for NaN-free data (``np.unique`` counts every NaN as one
    value; here each NaN is distinct, as NaN != NaN).

    One sort (a stable one where the first occurrences are asked for, as ``np.unique`` sorts)
    and a comparison of neighbours: as fast as ``np.unique``'s sorting path, which the indices
    take anyway."""
    flat = np.asarray(values).ravel()
    if return_index or return_inverse:
        order = np.argsort(flat, kind="stable" if return_index else "quicksort")
        ordered = flat[order]
    else:
        ordered = np.sort(flat)
    starts = np.empty(len(ordered), dtype=bool)  # where a value differs from the one before it
    starts[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    distinct = ordered[starts]
    if not (return_index or return_inverse):
        return distinct
    result = [distinct]
    if return_index:
        result.append(order[starts])
    if return_inverse:
        inverse = np.empty(len(flat), dtype=np.intp)
        inverse[order] = np.cumsum(starts) - 1
        result.append(inverse.reshape(np.shape(values)))  # numpy 2: the input's shape
    return tuple(result)


def gathered(values: np.ndarray, order: np.ndarray, *, low: int | None = None, high: int | None = None,
             widen: bool = True) -> np.ndarray:
    """``values[order]`` of an integer column: the one value broadcast (read-only) where it holds
    one; else, for int64 values that fit 32 bits, gathered from an int32 copy and, with
    ``widen``, made int64 again (the same integers either way; without it, left int32 for callers
    that read them as floats, codes or indices). ``low`` and ``high``: the values' least and
    largest, where the caller has them (codes: 0 and their count less one).

    A gather in another order reads each value from a cache line of its own: from int32, half
    the lines, for a copy, a widening and the least and largest that are passes in order (1M
    mixed DeepSeek-V3 strategies: the memory model's 12 fields 42-46 -> 24-26 ms; the step-time
    model's six columns, two of one value, 28.1 -> 11.5 ms)."""
    if not len(values) or values.dtype.kind not in "biu":  # (integers and booleans alone)
        return values.take(order)
    if low is None or high is None:
        low, high = int(values.min()), int(values.max())
    if low == high:
        return np.broadcast_to(values[:1], (len(order),))
    if values.dtype == np.int64 and -(1 << 31) <= low and high < 1 << 31:
        narrow = values.astype(np.int32).take(order)
        return narrow.astype(np.int64) if widen else narrow
    return values.take(order)




def one_value(values: np.ndarray) -> bool:
    """Whether every element of ``values`` (not empty) is the first, bit for bit (0.0 and -0.0
    differ: one stands for the other in no result)."""
    # The last element and every 997th before it first: one of them unlike the first answers for
    # the whole (a search's varying fields mostly show it there), at a thousandth of the passes.
    return _like_first(values[::-997], values[:1]) and _like_first(values, values[:1])




def _like_first(values: np.ndarray, first: np.ndarray) -> bool:
    """Whether every element of ``values`` is ``first``'s one, bit for bit."""
    same = values == first
    if values.dtype.kind == "f":
        same &= np.signbit(values) == np.signbit(first)
    return bool(same.all())
