"""Integer codes for distinct values and rows: how the batch path prices each thing once.

A search batch of a million strategies holds only thousands of distinct layer configurations
and a few dozen stage layouts. These helpers turn columns into dense codes 0..k-1 so that a
price is computed per distinct value and gathered back. Small ranges use a presence table
(linear time, no sort), which is what keeps the deduplication cheap.
"""

from __future__ import annotations

import numpy as np

from ndplan.strategy.batch import dense_codes as ranks

Array = np.ndarray

#: ``row_codes`` re-densifies its packed key before it would span this many values, or twice
#: the rows where that is more (up to ``_TABLE_MAX``): a presence table over the key costs
#: O(span), so it may grow with the rows, and each re-densification is a pass over them.
_TABLE = 1 << 16
_TABLE_MAX = 1 << 20


def dense_codes(values: Array) -> tuple[Array, int]:
    """(codes, k): codes 0..k-1 of the distinct values of an integer array, in increasing value
    order (``ndplan.strategy.batch.dense_codes``)."""
    return ranks(np.asarray(values, dtype=np.int64))


def first_of_codes(codes: Array, count: int) -> Array:
    """Index of the first row holding each code 0..count-1."""
    first = np.empty(count, dtype=np.int64)
    first[codes[::-1]] = np.arange(len(codes) - 1, -1, -1)
    return first


def row_codes(columns: list[Array]) -> tuple[Array, int]:
    """(codes, k) of the distinct rows of several non-negative integer (or integral float)
    columns, numbered in the rows' lexicographic order. Columns are packed into one integer key
    (small values and booleans are their own codes), re-densified whenever the key would
    outgrow a presence table; whenever that happens, the codes are the same (ranks of the
    packed rows)."""
    rows = len(columns[0])
    table = max(_TABLE, min(_TABLE_MAX, 2 * rows))
    key = np.zeros(rows, dtype=np.int64)
    span = 1  # the key lies in [0, span): dense_codes is told so rather than scanning for it
    for column in columns:
        column = np.asarray(column)
        if column.dtype.kind == "b":  # its own code: no conversion, no scan for its range
            codes, count = column, 2
        else:
            if column.dtype.kind == "f":
                column = column.astype(np.int64)
            top = int(column.max(initial=0))
            if 0 <= top < 64 and column.min(initial=0) >= 0:
                codes, count = column, top + 1
            else:
                codes, count = dense_codes(column)
        if span * count >= table:
            key, span = ranks(key, 0, span - 1)
        key *= count  # in place: key is this function's own (zeros, or dense_codes' result)
        key += codes
        span *= count
    return ranks(key, 0, span - 1)
