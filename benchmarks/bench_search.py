"""Full searches at scale on one core: candidates enumerated, priced and seconds.

    .venv/bin/python benchmarks/bench_search.py

DeepSeek-V3 (671B, MoE, MLA, MTP) on 4096 H100s with gbs 4096, seq 4096, and Llama-3.1-405B on
16384 H100s with gbs 2048, seq 4096, every dimension searched. Each is searched twice in this
process: the first search pays the pipeline simulations and layouts a process caches, the
second does not. Priced: every candidate the rules let through, whose memory was bounded or
priced (and, where it fits, its step time).
"""

from __future__ import annotations

import os
import time

# One core, as the target says: numpy must not fan out over threads (its matrix products do by
# default, and this process's CPU time then exceeds its wall time).
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

from ndplan.hardware import get_device  # noqa: E402
from ndplan.model import get_preset  # noqa: E402
from ndplan.search import default_space, run_search  # noqa: E402
from ndplan.strategy import get_precision  # noqa: E402

CASES = (("deepseek-v3", 4096, 4096), ("llama-3.1-405b", 16384, 2048))


def main() -> None:
    device = get_device("h100-sxm")
    for name, devices, gbs in CASES:
        model = get_preset(name)
        space = default_space(model, device, devices, gbs, 4096, get_precision("megatron-bf16"))
        for run in ("first", "again"):
            cpu = time.process_time()
            result = run_search(model, device, space)  # the step-time model of the default (pytorch) runtime
            cpu = time.process_time() - cpu
            print(f"{name:15s} {devices:>6} devices, {run}: {result.space_size:>10,} enumerated, {result.evaluated:>10,} "
                  f"priced, {result.fitting:>9,} fit, {result.seconds:6.2f} s ({result.evaluated / result.seconds:,.0f} "
                  f"priced/s; CPU {cpu:.2f} s)")
        best = result.best["label"] if result.best else "nothing fits"
        print(f"    best: {best}")


if __name__ == "__main__":
    main()
