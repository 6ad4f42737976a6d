"""ndplan.arrays.unique gives np.unique's results; the batch paths that use it import no numpy.ma;
``gathered`` gives the plain gather's integers."""

import subprocess
import sys

import numpy as np
import pytest

from ndplan.arrays import gathered, unique


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        np.zeros(0, dtype=np.int64),  # empty
        np.array([5]),
        np.array([3, 1, 3, 3, 2, 1, 0, 3]),  # ties, first occurrences not first in value order
        rng.integers(-50, 50, 10_000),  # many ties, negative values
        rng.permutation(100_000).astype(np.int64),  # all distinct
        np.round(rng.random(5000) * 20) / 4,  # floats with ties
        np.array([0.5, -0.0, 0.0, 1e300, -1e-300, 0.5, 2.5]),  # signed zeros compare equal
        np.array([[4, 2], [2, 9]]),  # 2-D: flattened, as np.unique without an axis
    ]


@pytest.mark.parametrize("values", _cases(), ids=lambda v: f"{v.dtype}[{v.size}]")
def test_unique_is_np_unique(values: np.ndarray) -> None:
    expected = np.unique(values)
    got = unique(values)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    for index, inverse in ((True, False), (False, True), (True, True)):
        want = np.unique(values, return_index=index, return_inverse=inverse)
        have = unique(values, return_index=index, return_inverse=inverse)
        assert len(have) == len(want) == 1 + index + inverse
        for a, b in zip(have, want, strict=True):
            assert a.dtype == b.dtype
            assert a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    distinct, first, inverse = unique(values, return_index=True, return_inverse=True)
    np.testing.assert_array_equal(distinct[inverse], values)  # the inverse rebuilds the values
    np.testing.assert_array_equal(values.reshape(-1)[first], distinct)


def test_unique_first_index_is_the_first_occurrence_of_each_value() -> None:
    values = np.array([7, 3, 7, 3, 3, 9, 7])
    distinct, first = unique(values, return_index=True)
    np.testing.assert_array_equal(distinct, [3, 7, 9])
    np.testing.assert_array_equal(first, [1, 0, 5])


def test_the_batch_paths_import_no_numpy_ma() -> None:
    # numpy 2's np.unique imports numpy.ma on its first call (values only): 6-14 ms of a process's
    # first search. Grouping a batch of runs, ranking, spreading rows and coding by sort use ours.
    code = """
import sys
import numpy as np
from ndplan.search.run import by_time_then_peak, evenly_spread
from ndplan.strategy.batch import StrategyBatch, dense_codes
assert "numpy.ma" not in sys.modules, "imported with ndplan"
batch = StrategyBatch.from_columns({"tp": [1, 1, 2, 2, 4], "pp": [2, 2, 1, 1, 8]})
groups = batch.groups(["tp", "pp"])
assert [(values, list(index)) for values, index in groups] == [((1, 2), [0, 1]), ((2, 1), [2, 3]), ((4, 8), [4])]
codes, count = dense_codes(np.array([5, 1 << 40, 5, 7]))  # too wide for a table: sorted
assert codes.tolist() == [0, 2, 0, 1] and count == 3
order = by_time_then_peak(np.array([2.0, 1.0, 2.0, 1.0]), np.array([5.0, 6.0, 4.0, 6.0]))
assert order.tolist() == [1, 3, 2, 0], order
assert evenly_spread(10, 4).tolist() == [0, 3, 6, 9]
print("numpy.ma" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]


def test_a_whole_search_imports_no_numpy_ma() -> None:
    # The memory frontiers, pipeline prices and DP figures a DeepSeek-V3 search asks for (MoE,
    # FSDP, every schedule) each took np.unique once: the first of them paid numpy.ma's import.
    code = """
import sys
from ndplan.hardware import get_device
from ndplan.model import get_preset
from ndplan.search import default_space, run_search
from ndplan.strategy import get_precision
device = get_device("h100-sxm")
model = get_preset("deepseek-v3")
result = run_search(model, device, default_space(model, device, 512, 1024, 4096, get_precision("megatron-bf16")))
print(result.fitting > 0, "numpy.ma" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


@pytest.mark.parametrize("widen", [True, False])
def test_gathered_is_the_plain_gather_with_its_integers(widen):
    rng = np.random.default_rng(3)
    order = rng.permutation(1000)
    for values in (rng.integers(-5, 3000, 1000), rng.integers(0, 2, 1000).astype(bool),
                   np.full(1000, 7, dtype=np.int64), rng.integers(1 << 40, 1 << 41, 1000)):
        got = gathered(values, order, widen=widen)
        np.testing.assert_array_equal(got, values[order])
        if values.dtype == np.int64 and widen:
            assert got.dtype == np.int64
    one = gathered(np.full(1000, 7, dtype=np.int64), order)
    assert one.strides == (0,) and not one.flags.writeable  # the one value broadcast, read-only
    narrow = gathered(rng.integers(0, 50, 1000), order, widen=False)
    assert narrow.dtype == np.int32  # left narrow where asked
    # codes with their range given: the same, read from the caller's bounds
    codes = rng.integers(0, 10, 1000)
    np.testing.assert_array_equal(gathered(codes, order, low=0, high=9, widen=widen), codes[order])
    # floats are gathered as they are (no rounding of their range into one value)
    halves = np.array([0.25, 0.75] * 500)
    np.testing.assert_array_equal(gathered(halves, order), halves[order])
