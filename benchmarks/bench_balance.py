"""Balancing on searched strategies: step-time gain over uniform placement with full recompute,
and solver time per candidate (exact and heuristic).

    .venv/bin/python benchmarks/bench_balance.py [--repeats N] [--milp]

For each model the search (pp >= 2 fixed, so there is something to balance) picks the fastest
pipeline strategy that fits; the balancer then plans it under the device's memory.

Times are per candidate, the median of ``--repeats`` calls (default 50 for the heuristic, a
fifth of that for the exact solver), since the machine may be shared; the minimum is shown too.
The exact solver is the DP of ``ndplan.balance.dp`` (these strategies do not interleave);
``--milp`` also times scipy's MILP on the same problem and checks it finds the same step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ndplan.balance import balance, build_problem, exact_method, solve_exact, solve_heuristic, solve_milp
from ndplan.hardware import Cluster, get_device
from ndplan.model import get_preset
from ndplan.perf import step_time_batch
from ndplan.search import default_space, run_search
from ndplan.strategy import Strategy, get_precision

CASES = (("deepseek-v3", 4096, 4096, 8), ("llama-3.1-405b", 16384, 2048, 16))


def timed(solve: Callable[[], Any], repeats: int) -> tuple[Any, float, float]:
    """(the answer, median seconds, least seconds) over ``repeats`` calls."""
    seconds = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        found = solve()
        seconds.append(time.perf_counter() - start)
    return found, statistics.median(seconds), min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="heuristic calls timed per model (default 50)")
    parser.add_argument("--milp", action="store_true", help="also time scipy's MILP and compare its optimum")
    args = parser.parse_args()
    device = get_device("h100-sxm")
    precision = get_precision("megatron-bf16")
    for name, devices, gbs, pp in CASES:
        model = get_preset(name)
        space = default_space(model, device, devices, gbs, 4096, precision, fixed={"pp": pp, "schedule": "1f1b"})
        best = run_search(model, device, space, step_time_batch, top=1).best
        if best is None:
            print(f"{name}: nothing fits with pp={pp}")
            continue
        strategy = Strategy(**best["strategy"], precision=precision)
        cluster = Cluster(device=device, num_devices=devices)
        problem = build_problem(model, strategy, cluster, device.memory_bytes)
        exact, exact_s, exact_min = timed(partial(solve_exact, problem), max(1, args.repeats // 5))
        heuristic, heuristic_s, heuristic_min = timed(partial(solve_heuristic, problem), args.repeats)
        result = balance(model, strategy, cluster, device.memory_bytes)
        gap = (heuristic[1].step_s / exact[1].step_s - 1) if exact and heuristic else float("nan")
        print(f"{name:15s} {strategy.short()}")
        print(f"    uniform + full recompute {result.baseline[1].step_s:8.3f} s -> balanced {result.cost.step_s:8.3f} s "
              f"({100 * result.gain:5.1f}% faster); layers {list(result.plan.stage_layers)}")
        print(f"    solver per candidate: exact ({exact_method(problem)}) {exact_s * 1e3:.1f} ms "
              f"(min {exact_min * 1e3:.1f}), heuristic {heuristic_s * 1e3:.2f} ms (min {heuristic_min * 1e3:.2f}) "
              f"(gap to exact {100 * gap:+.2f}%)")
        if args.milp:
            milp, milp_s, _ = timed(partial(solve_milp, problem), 1)
            agrees = milp is not None and exact is not None and abs(milp[1].step_s / exact[1].step_s - 1) < 1e-6
            print(f"    scipy MILP {milp_s:.3f} s, step {milp[1].step_s if milp else float('nan'):.6f} s "
                  f"({'same optimum' if agrees else 'DIFFERS from the DP'})")


if __name__ == "__main__":
    main()
