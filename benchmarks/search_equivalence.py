"""Check that a change to the search path returns the same results: record, then compare.

    .venv/bin/python benchmarks/search_equivalence.py record answers.pkl
    .venv/bin/python benchmarks/search_equivalence.py compare answers.pkl

``record`` runs ``run_search`` on a handful of cases and stores what a search answers: the
rejected counts per reason, how many were priced and fit, the fitting candidates' indices,
step times and peaks, the ranked labels, the Pareto front and the smallest peak. The cases are
the two of ``bench_search.py`` (DeepSeek-V3 on 4096 H100, Llama-3.1-405B on 16384), a small
dense model (Llama-3.1-8B on 64), a MoE model under a tight memory limit (Mixtral-8x7B on 256
at 24 GiB: most candidates are rejected by memory, and the bound and the full model both
decide), one where nothing fits (the smallest peak is then searched), each also with the
``megatron`` runtime profile besides the default ``pytorch`` one.

``compare`` runs the same cases with the code now imported and reports every difference:
counts and indices must be equal, floats within 1e-12 relative. It exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from typing import Any

import numpy as np

from ndplan.hardware import get_device
from ndplan.memory import MemoryOptions
from ndplan.model import get_preset
from ndplan.search import default_space, run_search
from ndplan.strategy import get_precision

RTOL = 1e-12
GIB = 1 << 30

# (model, devices, global batch, memory limit in GiB or None for the device's)
CASES: tuple[tuple[str, int, int, float | None], ...] = (
    ("deepseek-v3", 4096, 4096, None),
    ("llama-3.1-405b", 16384, 2048, None),
    ("llama-3.1-8b", 64, 256, None),
    ("mixtral-8x7b", 256, 1024, 24.0),
    ("llama-3.1-70b", 8, 64, 20.0),  # nothing fits: the smallest peak is searched for
)
RUNTIMES = ("pytorch", "megatron")


def answers() -> dict[str, dict[str, Any]]:
    """What each case's search answers, keyed by a label of the case."""
    device = get_device("h100-sxm")
    precision = get_precision("megatron-bf16")
    out: dict[str, dict[str, Any]] = {}
    for name, devices, gbs, limit_gib in CASES:
        model = get_preset(name)
        space = default_space(model, device, devices, gbs, 4096, precision)
        for runtime in RUNTIMES:
            label = f"{name} {devices} gbs{gbs} limit{limit_gib} {runtime}"
            started = time.process_time()
            limit = None if limit_gib is None else int(limit_gib * GIB)
            result = run_search(model, device, space, memory_limit_bytes=limit, options=MemoryOptions(runtime=runtime))
            print(f"{label}: {result.evaluated:,} priced, {result.fitting:,} fit, "
                  f"{time.process_time() - started:.2f} s CPU", file=sys.stderr)
            out[label] = {
                "space_size": result.space_size,
                "evaluated": result.evaluated,
                "fitting": result.fitting,
                "rejected": dict(result.rejected),
                "smallest_peak_bytes": result.smallest_peak_bytes,
                "candidates_index": np.asarray(result.candidates_index),
                "candidates_time_s": np.asarray(result.candidates_time_s),
                "candidates_peak_bytes": np.asarray(result.candidates_peak_bytes),
                "ranked": [(row["candidate"], row["label"], row["peak_bytes"], row["step_s"]) for row in result.ranked],
                "pareto": [(row["candidate"], row["label"], row["peak_bytes"], row["step_s"]) for row in result.pareto],
            }
    return out


def _close(a: Any, b: Any) -> bool:
    """Equal, floats within RTOL relative (element-wise for arrays and tuples)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype.kind != b.dtype.kind:
            return False
        if a.dtype.kind == "f":
            return bool(np.all((a == b) | (np.abs(a - b) <= RTOL * np.abs(a))))
        return bool(np.array_equal(a, b))
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        return a == b or abs(a - b) <= RTOL * abs(a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return bool(a == b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("path", help="pickle of the cases' answers")
    args = parser.parse_args()
    now = answers()
    if args.action == "record":
        with open(args.path, "wb") as f:
            pickle.dump(now, f)
        print(f"recorded {len(now)} cases to {args.path}")
        return
    with open(args.path, "rb") as f:
        before = pickle.load(f)
    differing = 0
    for label, expected in before.items():
        got = now.get(label)
        if got is None:
            print(f"{label}: missing")
            differing += 1
            continue
        for key, value in expected.items():
            if not _close(value, got.get(key)):
                print(f"{label}: {key} differs")
                differing += 1
    print(f"{len(before)} cases, {differing} differences")
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
