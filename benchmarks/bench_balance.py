"""Balancing on searched strategies: step-time gain over uniform placement with full recompute,
and solver time per candidate (exact and heuristic).

    .venv/bin/python benchmarks/bench_balance.py [--repeats N] [--milp]

For each model the search picks the fastest strategy that fits, over every dimension (a V
schedule on these clusters), then with pp fixed and 1F1B, then interleaved 1F1B; the balancer
then plans it under the device's memory.

Times are per candidate, the median of ``--repeats`` calls (default 50 for the heuristic, a
fifth of that for the exact solver), since the machine may be shared; the minimum is shown too.
The exact solver is a DP (``ndplan.balance.dp`` with one chunk per stage, ``ndplan.balance.chunks``
with several and one layer kind, ``ndplan.balance.prefix`` with several and a leading run of
another kind, as DeepSeek-V3's dense layers) or, for other mixes of layer kinds, the MILP: its
line then gives HiGHS' proven lower bound, so the heuristic's gap to the optimum is bounded even
when HiGHS stops at its time limit. ``--milp`` also times the MILP where a DP is exact and
compares its plan's step (with several chunks per stage it frees options per chunk and returns
its own recompute, so it may land above the DP's; below would be a DP bug).

Each plan's composed step (the formula every solver optimises) is checked against the pipeline
simulator (``simulated_step_s``), and the gain is shown in both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ndplan.balance import (
    balance,
    build_problem,
    exact_method,
    simulated_step_s,
    solve_exact,
    solve_heuristic,
    solve_milp,
    solve_milp_bounded,
)
from ndplan.hardware import Cluster, get_device
from ndplan.model import get_preset
from ndplan.perf import step_time_batch
from ndplan.search import default_space, run_search
from ndplan.strategy import Strategy, get_precision

# (model, devices, gbs, fixed dimensions): the search's overall best first, then pp fixed with
# 1F1B and with interleaving, so that every kind of pipeline is balanced.
CASES = (
    ("deepseek-v3", 4096, 4096, {}), ("llama-3.1-405b", 16384, 2048, {}),
    ("deepseek-v3", 4096, 4096, {"pp": 8, "schedule": "1f1b"}), ("llama-3.1-405b", 16384, 2048, {"pp": 16, "schedule": "1f1b"}),
    ("deepseek-v3", 4096, 4096, {"pp": 8, "schedule": "interleaved"}),
    ("llama-3.1-405b", 16384, 2048, {"pp": 16, "schedule": "interleaved"}),
)


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
    parser.add_argument("--milp-seconds", type=float, default=60.0,
                        help="HiGHS' time limit where the MILP is the exact solver (default 60)")
    args = parser.parse_args()
    device = get_device("h100-sxm")
    precision = get_precision("megatron-bf16")
    for name, devices, gbs, fixed in CASES:
        model = get_preset(name)
        space = default_space(model, device, devices, gbs, 4096, precision, fixed=fixed)
        best = run_search(model, device, space, step_time_batch, top=1).best
        if best is None:
            print(f"{name}: nothing fits with {fixed}")
            continue
        strategy = Strategy(**best["strategy"], precision=precision)
        cluster = Cluster(device=device, num_devices=devices)
        problem = build_problem(model, strategy, cluster, device.memory_bytes)
        method = exact_method(problem)
        exact_repeats = 1 if method == "milp" else max(1, args.repeats // 5)
        exact, exact_s, exact_min = timed(partial(solve_exact, problem), exact_repeats)
        heuristic, heuristic_s, heuristic_min = timed(partial(solve_heuristic, problem), args.repeats)
        result = balance(model, strategy, cluster, device.memory_bytes)
        gap = (heuristic[1].step_s / exact[1].step_s - 1) if exact and heuristic else float("nan")
        base_plan, base_cost = result.baseline
        simulated_base = simulated_step_s(problem, base_plan, strategy.schedule)
        simulated = simulated_step_s(problem, result.plan, strategy.schedule)
        print(f"{name:15s} {strategy.short()}  ({'searched best' if not fixed else 'best with ' + str(fixed)})")
        print(f"    uniform + full recompute {base_cost.step_s:8.3f} s -> balanced {result.cost.step_s:8.3f} s "
              f"({100 * result.gain:5.1f}% faster); simulated {simulated_base:8.3f} s -> {simulated:8.3f} s "
              f"({100 * (1 - simulated / simulated_base):5.1f}% faster; composed/simulated "
              f"{base_cost.step_s / simulated_base:.3f}, {result.cost.step_s / simulated:.3f})")
        print(f"    layers per virtual stage {list(result.plan.stage_layers)}")
        if result.settings is not None:  # the per-layer mix as one recompute setting (what --emit writes)
            one_plan, one_cost, one_simulated = result.settings
            print(f"    as one recompute setting: {one_cost.step_s:8.3f} s ({100 * (1 - one_cost.step_s / base_cost.step_s):5.1f}% "
                  f"faster); simulated {one_simulated:8.3f} s ({100 * (1 - one_simulated / simulated_base):5.1f}% faster)")
        print(f"    solver per candidate: exact ({method}) {exact_s * 1e3:.1f} ms "
              f"(min {exact_min * 1e3:.1f}), heuristic {heuristic_s * 1e3:.2f} ms (min {heuristic_min * 1e3:.2f}) "
              f"(gap to exact {100 * gap:+.2f}%)")
        if method == "milp":
            found, lower_bound = solve_milp_bounded(problem, args.milp_seconds)
            incumbent = f"{found[1].step_s:.4f} s" if found else "none"
            print(f"    HiGHS in {args.milp_seconds:.0f} s: best plan {incumbent}, proven lower bound {lower_bound:.4f} s; "
                  f"the heuristic ({heuristic[1].step_s:.4f} s) is at most "
                  f"{100 * (heuristic[1].step_s / lower_bound - 1):.2f}% from the optimum" if lower_bound > 0 else
                  f"    HiGHS in {args.milp_seconds:.0f} s: best plan {incumbent}, no lower bound yet")
        elif args.milp:
            milp, milp_s, _ = timed(partial(solve_milp, problem), 1)
            ratio = milp[1].step_s / exact[1].step_s - 1 if milp is not None and exact is not None else float("nan")
            verdict = ("same optimum" if abs(ratio) < 1e-6 else f"the DP's is {100 * ratio:.4f}% faster" if ratio > 0
                       else "DIFFERS: below the DP")
            print(f"    scipy MILP {milp_s:.3f} s, step {milp[1].step_s if milp else float('nan'):.6f} s ({verdict})")


if __name__ == "__main__":
    main()
