"""Balancing on searched strategies: step-time gain over uniform placement with full recompute,
and solver time per candidate (exact MILP and heuristic).

    .venv/bin/python benchmarks/bench_balance.py

For each model the search (pp >= 2 fixed, so there is something to balance) picks the fastest
pipeline strategy that fits; the balancer then plans it under the device's memory.
"""

from __future__ import annotations

import time

from ndplan.balance import balance, build_problem, solve_exact, solve_heuristic
from ndplan.hardware import Cluster, get_device
from ndplan.model import get_preset
from ndplan.perf import step_time_batch
from ndplan.search import default_space, run_search
from ndplan.strategy import Strategy, get_precision

CASES = (("deepseek-v3", 4096, 4096, 8), ("llama-3.1-405b", 16384, 2048, 16))


def main() -> None:
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
        start = time.perf_counter()
        exact = solve_exact(problem)
        exact_s = time.perf_counter() - start
        start = time.perf_counter()
        repeats = 20
        for _ in range(repeats):
            heuristic = solve_heuristic(problem)
        heuristic_s = (time.perf_counter() - start) / repeats
        result = balance(model, strategy, cluster, device.memory_bytes)
        gap = (heuristic[1].step_s / exact[1].step_s - 1) if exact and heuristic else float("nan")
        print(f"{name:15s} {strategy.short()}")
        print(f"    uniform + full recompute {result.baseline[1].step_s:8.3f} s -> balanced {result.cost.step_s:8.3f} s "
              f"({100 * result.gain:5.1f}% faster); layers {list(result.plan.stage_layers)}")
        print(f"    solver per candidate: MILP {exact_s:.3f} s, heuristic {heuristic_s * 1e3:.1f} ms "
              f"(gap to MILP {100 * gap:+.2f}%)")


if __name__ == "__main__":
    main()
