"""``grouping.shape_groups``: the pipeline-shape groups of a batch, each group's rows by
micro-batch count, as ``StrategyBatch.groups`` and a stable sort per group give them."""

import numpy as np
import pytest

from ndplan.memory.fields import PIPELINE_SHAPE
from ndplan.memory.grouping import shape_groups
from ndplan.strategy.batch import StrategyBatch, radix_key


def _grouped_then_sorted(batch: StrategyBatch) -> list[tuple[tuple[int, ...], np.ndarray]]:
    return [(key, index[np.argsort(radix_key(batch.num_micro_batches[index]), kind="stable")])
            for key, index in batch.groups(PIPELINE_SHAPE)]


@pytest.mark.parametrize(("rows", "counts", "sorted_rows"), [
    (5000, 12, False),  # one radix sort of (group, count) pairs
    (5000, 12, True),  # a batch already in group order (batch.groups' runs)
    (40000, 3000, False),  # pairs past 16 bits: grouped, then sorted per group
])
def test_shape_groups_are_the_groups_sorted_by_micro_batch_count(rows, counts, sorted_rows):
    rng = np.random.default_rng(rows + counts)
    columns = {
        "schedule": rng.integers(0, 7, rows), "pp": rng.choice([1, 2, 4, 8, 16, 32], rows),
        "vpp": rng.integers(1, 5, rows), "seq_chunks": rng.choice([1, 2, 4], rows),
        "embedding_as_layer": rng.integers(0, 2, rows), "output_as_layer": rng.integers(0, 2, rows),
        "num_micro_batches": rng.integers(1, counts + 1, rows),
    }
    if sorted_rows:
        by_shape = np.lexsort([columns[name] for name in reversed(PIPELINE_SHAPE)])
        columns = {name: values[by_shape] for name, values in columns.items()}
    batch = StrategyBatch.from_columns(columns)
    groups, group_of = shape_groups(batch)
    expected = _grouped_then_sorted(batch)
    assert [key for key, _ in groups] == [key for key, _ in expected]
    for (_, rows_found), (_, rows_expected) in zip(groups, expected, strict=True):
        np.testing.assert_array_equal(rows_found, rows_expected)
    if group_of is not None:  # each strategy's group, numbered in the groups' order
        for g, (_, index) in enumerate(groups):
            assert (group_of[index] == g).all()
    assert (group_of is None) == (counts > 1000)
