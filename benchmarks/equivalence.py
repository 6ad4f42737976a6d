"""What the record/compare equivalence scripts share: a tolerant equality and the two actions.

Floats may differ by 1e-12 relative (RTOL; the environment variable NDPLAN_EQUIVALENCE_RTOL sets
another, 0 for bit-identity); everything else (integers, shapes, kinds, labels, keys) must be
equal. To record with older code, run these scripts with that code first on the path (each says
which ndplan it imported):

    git worktree add --detach /tmp/old <commit>
    PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/time_equivalence.py record before.pkl
    .venv/bin/python benchmarks/time_equivalence.py compare before.pkl
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RTOL = float(os.environ.get("NDPLAN_EQUIVALENCE_RTOL", "1e-12"))


def close(a: Any, b: Any) -> bool:
    """Equal, floats within RTOL relative (element-wise through arrays, sequences and dicts)."""
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
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return bool(a == b)


def record_or_compare(action: str, path: str, now: dict[str, Any], what: str) -> None:
    """``record``: store ``now`` at ``path``. ``compare``: report each stored entry that ``now``
    lacks or that differs (per key, one level down where entries are dicts) and exit 1 if any."""
    import ndplan

    # Which code priced them: a record made with the code it is compared with proves nothing.
    print(f"ndplan imported from {Path(ndplan.__file__).parent}")
    if action == "record":
        with open(path, "wb") as f:
            pickle.dump(now, f)
        print(f"recorded {len(now)} {what} to {path}")
        return
    with open(path, "rb") as f:
        before = pickle.load(f)
    differing = 0
    for label, expected in before.items():
        got = now.get(label)
        if got is None:
            print(f"{label}: missing")
            differing += 1
        elif isinstance(expected, dict):
            for key, value in expected.items():
                if not close(value, got.get(key)):
                    print(f"{label}: {key} differs")
                    differing += 1
        elif not close(expected, got):
            print(f"{label}: differs")
            differing += 1
    print(f"{len(before)} {what}, {differing} differences (relative tolerance {RTOL:g})")
    sys.exit(1 if differing else 0)


def array_figures_main(doc: str, figures: Callable[[int], dict[str, Any]], default_count: int) -> None:
    """The command line of a script whose ``figures(count)`` prices ``count`` strategies per model:
    ``record|compare PATH [--count N]``."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("path", help="pickle of the cases' figures")
    parser.add_argument("--count", type=int, default=default_count, help="strategies per model")
    args = parser.parse_args()
    record_or_compare(args.action, args.path, figures(args.count), "arrays")
