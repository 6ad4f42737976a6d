"""row_codes numbers distinct rows in their lexicographic order, however it packs them."""

import numpy as np
import pytest

from ndplan.perf.codes import first_of_codes, row_codes
from ndplan.strategy.batch import _ranks_by_packed_sort, combination_codes, dense_codes, distinct_columns


@pytest.mark.parametrize("rows", [0, 1, 7, 5000, 300_000])
def test_row_codes_are_the_ranks_of_the_rows(rows: int) -> None:
    rng = np.random.default_rng(rows)
    columns = [
        rng.integers(0, 3, rows),  # small: its own code
        rng.random(rows) < 0.5,  # boolean
        rng.choice([4096, 8192, 32768], rows).astype(np.float64),  # integral floats, far from 0
        rng.integers(-5, 5, rows),  # negative values
        rng.integers(0, 40, rows) * 1000,  # many distinct values: re-densifies the key
        rng.integers(0, 200, rows),
        np.zeros(rows, dtype=bool),  # a boolean never set
    ]
    codes, count = row_codes(columns)
    stacked = np.stack([np.asarray(c, dtype=np.int64) for c in columns], axis=1)
    distinct, inverse = np.unique(stacked, axis=0, return_inverse=True)
    assert count == len(distinct)
    np.testing.assert_array_equal(codes, inverse.reshape(-1))
    if rows:
        np.testing.assert_array_equal(stacked[first_of_codes(codes, count)], distinct)


@pytest.mark.parametrize("rows", [1, 3000, 200_000])
def test_distinct_columns_ranks_many_small_fields_far_from_zero(rows: int) -> None:
    # Small values join the key as they are and their smallest is carried beside it: thirty
    # fields of values 10..15 (6^30 combinations, past 2^62) renumber on the way, with that
    # carried sum large too; the ranks, and those of the first fields alone, are unchanged.
    rng = np.random.default_rng(rows)
    columns = [rng.integers(10, 16, rows) for _ in range(30)] + [rng.integers(0, 2, rows).astype(bool)]
    rows_of, codes, prefix_codes = distinct_columns(columns, rows, prefix=12)
    stacked = np.stack([np.asarray(c, dtype=np.int64) for c in columns], axis=1)
    distinct, inverse = np.unique(stacked, axis=0, return_inverse=True)
    np.testing.assert_array_equal(codes, inverse.reshape(-1))
    np.testing.assert_array_equal(stacked[rows_of], distinct)
    _, prefix_inverse = np.unique(stacked[:, :12], axis=0, return_inverse=True)
    np.testing.assert_array_equal(prefix_codes, prefix_inverse.reshape(-1))


@pytest.mark.parametrize("rows", [1, 2000])
def test_distinct_columns_skips_broadcast_columns_alike(rows: int) -> None:
    # A field a search part holds at one value comes as a broadcast view (stride 0): it changes
    # no code, here or as the prefix's last column, wherever it stands.
    rng = np.random.default_rng(rows)
    varying = [rng.integers(0, 5, rows), rng.integers(100, 4000, rows) * 7]
    constant = np.broadcast_to(np.int64(4096), (rows,))
    columns = [constant, varying[0], constant, varying[1], constant]
    _, codes, prefix_codes = distinct_columns(columns, rows, prefix=3)
    _, expected = np.unique(np.stack(varying, axis=1), axis=0, return_inverse=True)
    np.testing.assert_array_equal(codes, expected.reshape(-1))
    _, expected_prefix = np.unique(varying[0], return_inverse=True)
    np.testing.assert_array_equal(prefix_codes, expected_prefix)


@pytest.mark.parametrize(("rows", "high"), [(1, 1 << 40), (2, 3), (5000, 1 << 40), (300_000, 10_000_000)])
def test_dense_codes_by_packed_sort_are_the_ranks(rows: int, high: int) -> None:
    # Values too far apart for a presence table are ranked by one sort of (value, row) packed
    # into an integer: the ranks np.unique gives, for values far from zero and negative too.
    rng = np.random.default_rng(rows)
    values = rng.integers(-high, high, rows)
    low, top = int(values.min()), int(values.max())
    expected_distinct, expected = np.unique(values, return_inverse=True)
    codes, count = _ranks_by_packed_sort(values, low, top)
    np.testing.assert_array_equal(codes, expected)
    assert count == len(expected_distinct)
    assert dense_codes(values)[1] == count


def test_dense_codes_too_wide_to_pack_sorts_by_index() -> None:
    # Values spanning 2^62 leave no bits for the rows' indices: ranked by an argsort instead.
    values = np.array([1 << 62, -(1 << 62), 0, 1 << 62, 5])
    codes, count = dense_codes(values)
    assert codes.tolist() == [3, 0, 1, 3, 2] and count == 4


@pytest.mark.parametrize("rows", [1, 4000])
def test_distinct_columns_carry_on_from_the_prefix_codes(rows: int) -> None:
    # The key goes on from the prefix's dense codes (or from nothing, where every prefix field
    # holds one value): the prefix's codes are returned untouched by the fields after them.
    rng = np.random.default_rng(rows)
    for prefix_columns in ([rng.integers(0, 9, rows), rng.integers(0, 3000, rows)], [np.full(rows, 7)]):
        after = [rng.integers(0, 4, rows), rng.integers(-2, 900, rows)]
        _, codes, prefix_codes = distinct_columns([*prefix_columns, *after], rows, prefix=len(prefix_columns))
        stacked = np.stack([*prefix_columns, *after], axis=1)
        _, expected = np.unique(stacked, axis=0, return_inverse=True)
        np.testing.assert_array_equal(codes, expected.reshape(-1))
        _, expected_prefix = np.unique(stacked[:, :len(prefix_columns)], axis=0, return_inverse=True)
        np.testing.assert_array_equal(prefix_codes, expected_prefix.reshape(-1))


def test_dense_codes_of_nothing_over_a_wide_given_range() -> None:
    # A range given wider than any table, over no values: no codes, not a sort of nothing.
    codes, count = dense_codes(np.zeros(0, dtype=np.int64), 0, 1 << 30)
    assert codes.tolist() == [] and count == 0


def test_dense_codes_of_negative_values_close_to_zero() -> None:
    # A range from just below zero is not indexed from 0 (the table would read -1 as its last
    # entry: -1 and 899 one code): 902 wide, past the small ranges coded as they are.
    values = np.array([899, -1, 5, -2, 898, -1])
    codes, count = dense_codes(values)
    assert codes.tolist() == [4, 1, 2, 0, 3, 1] and count == 5


@pytest.mark.parametrize("rows", [0, 1, 3000])
def test_combination_codes_are_distinct_columns_without_rows(rows: int) -> None:
    # The codes, their count and the prefix's codes of distinct_columns, without its row of
    # each combination (which row_codes never read).
    rng = np.random.default_rng(rows)
    columns = [rng.integers(0, 3, rows), rng.integers(0, 5000, rows), rng.integers(-3, 3, rows)]
    codes, count, prefix_codes = combination_codes(columns, rows, prefix=2)
    rows_of, expected, expected_prefix = distinct_columns(columns, rows, prefix=2)
    np.testing.assert_array_equal(codes, expected)
    assert expected_prefix is not None and prefix_codes is not None
    np.testing.assert_array_equal(prefix_codes, expected_prefix)
    assert count == len(rows_of)
