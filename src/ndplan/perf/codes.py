"""Integer codes for distinct values and rows: how the batch path prices each thing once.

A search batch of a million strategies holds only thousands of distinct layer configurations
and a few dozen stage layouts. These helpers turn columns into dense codes 0..k-1 so that a
price is computed per distinct value and gathered back. Small ranges use a presence table
(linear time, no sort), which is what keeps the deduplication cheap.
"""

from __future__ import annotations

import numpy as np

from ndplan.strategy.batch import combination_codes
from ndplan.strategy.batch import dense_codes as ranks

Array = np.ndarray


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
    """(codes, k) of the distinct rows of several non-negative integer (boolean, or integral
    float) columns, numbered in the rows' lexicographic order: ``distinct_columns``' numbering
    (``combination_codes``), whose packing into one integer key this shares rather than repeats."""
    integers = [column.astype(np.int64) if column.dtype.kind == "f" else column for column in map(np.asarray, columns)]
    codes, count, _ = combination_codes(integers, len(integers[0]))
    return codes, count
