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
import sys
import time
from typing import Any

import numpy as np
from equivalence import record_or_compare

from ndplan.hardware import get_device
from ndplan.memory import MemoryOptions
from ndplan.model import get_preset
from ndplan.search import default_space, run_search
from ndplan.strategy import get_precision

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("path", help="pickle of the cases' answers")
    args = parser.parse_args()
    record_or_compare(args.action, args.path, answers(), "cases")

if __name__ == "__main__":
    main()
