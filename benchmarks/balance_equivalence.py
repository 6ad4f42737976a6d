"""Check that a change to the balancing solvers returns the same plans: record, then compare.

    .venv/bin/python benchmarks/balance_equivalence.py record answers.pkl [--top N] [--exact]
    .venv/bin/python benchmarks/balance_equivalence.py compare answers.pkl

``record`` builds many balancing problems and stores them with ``solve_heuristic``'s answer to
each (and, with ``--exact``, ``solve_exact``'s where it is a DP: the MILP is too slow to run
on all of them). The problems come from ``run_search``'s ``--top`` fastest strategies of each
model with each pipeline schedule (1F1B, interleaved, ZB-V, DualPipeV) and a few pp fixed, each balanced
under the device's memory and 0.8, 0.6 and 0.45 of it, so that recompute and infeasibility
(nothing fits) are exercised. Every problem whose layers are a leading run of dense layers
before MoE ones is also stored with its kinds rearranged (a dense layer every fourth), so that
the periodic-plan heuristic (``ndplan.balance.rounds``) runs too.

``compare`` solves the stored problems again with the code now imported and reports every
answer that differs: a plan's ``stage_layers`` or ``recompute``, ``PlanCost.step_s`` beyond
1e-12 relative, or a plan where there was none (or the reverse). It exits 1 if any differs.
The problems are stored, so the comparison does not depend on the search or the estimator.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import sys
import time
from itertools import product
from typing import Any

from ndplan.balance import build_problem, exact_method, solve_exact, solve_heuristic
from ndplan.balance.problem import BalanceProblem
from ndplan.hardware import Cluster, get_device
from ndplan.model import get_preset
from ndplan.perf import step_time_batch
from ndplan.search import default_space, run_search
from ndplan.strategy import Strategy, get_precision

# (model, devices, global batch, pipeline sizes): DeepSeek-V3 and V2-Lite have leading dense
# layers (``ndplan.balance.prefix``), the others one layer kind (``ndplan.balance.chunks``).
MODELS = (
    ("deepseek-v3", 4096, 4096, (4, 8, 16)), ("deepseek-v2-lite", 64, 512, (2, 4, 8)),
    ("llama-3.1-405b", 16384, 2048, (8, 16)), ("llama-3.1-70b", 1024, 1024, (4, 8)),
    ("qwen3-30b-a3b", 256, 1024, (4, 8)), ("mixtral-8x7b", 256, 1024, (4, 8)),
)
SCHEDULES = ("1f1b", "interleaved", "zbv", "dualpipev")
LIMITS = (1.0, 0.8, 0.6, 0.45)  # of the device's memory
STEP_RTOL = 1e-12

Answer = tuple[tuple[int, ...], tuple[str, ...], float] | None


def _answer(found: Any) -> Answer:
    """What must not change: layers per virtual stage, recompute per layer, composed step."""
    return None if found is None else (found[0].stage_layers, found[0].recompute, found[1].step_s)


def _rearranged(problem: BalanceProblem) -> BalanceProblem | None:
    """The problem with a dense layer every fourth (the rest MoE), or None if it has one kind."""
    kinds = set(problem.layer_kinds)
    if len(kinds) < 2:
        return None
    layer_kinds = tuple("dense" if i % 4 == 0 else "moe" for i in range(problem.num_layers))
    return dataclasses.replace(problem, layer_kinds=layer_kinds)


def build_problems(top: int) -> list[tuple[str, BalanceProblem]]:
    """(label, problem) for every model, schedule, searched strategy and memory limit."""
    device = get_device("h100-sxm")
    precision = get_precision("megatron-bf16")
    out: list[tuple[str, BalanceProblem]] = []
    for name, devices, gbs, pipelines in MODELS:
        model = get_preset(name)
        cluster = Cluster(device=device, num_devices=devices)
        for schedule, pp in product(SCHEDULES, pipelines):
            fixed: dict[str, int | str] = {"schedule": schedule, "pp": pp}
            space = default_space(model, device, devices, gbs, 4096, precision, fixed=fixed)
            rows = run_search(model, device, space, step_time_batch, top=top).ranked[:top]
            for rank, row in enumerate(rows):
                strategy = Strategy(**row["strategy"], precision=precision)
                for fraction in LIMITS:
                    problem = build_problem(model, strategy, cluster, fraction * device.memory_bytes)
                    label = f"{name} {schedule} #{rank} {strategy.short()} x{fraction}"
                    out.append((label, problem))
                    if (other := _rearranged(problem)) is not None:
                        out.append((label + " rearranged", other))
            print(f"{name} {schedule} pp{pp}: {len(rows)} strategies, {len(out)} problems so far", file=sys.stderr)
    return out


def solve_all(problems: list[tuple[str, BalanceProblem]], exact: bool) -> tuple[list[Answer], list[Answer | str]]:
    """The heuristic's answers and (``exact``) the exact DP's, "milp" where that is the MILP."""
    heuristic, exact_answers = [], []
    started = time.perf_counter()
    for _, problem in problems:
        heuristic.append(_answer(solve_heuristic(problem)))
    print(f"heuristic: {len(problems)} problems in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if exact:
        started = time.perf_counter()
        for _, problem in problems:
            exact_answers.append(_answer(solve_exact(problem)) if exact_method(problem) == "dp" else "milp")
        print(f"exact: {len(problems)} problems in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return heuristic, exact_answers


def _same(before: Answer | str, after: Answer | str) -> bool:
    if before is None or after is None or isinstance(before, str) or isinstance(after, str):
        return before == after
    return before[:2] == after[:2] and abs(before[2] - after[2]) <= STEP_RTOL * abs(before[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("path", help="pickle of the problems and their answers")
    parser.add_argument("--top", type=int, default=4, help="strategies per model, schedule and pp (record)")
    parser.add_argument("--exact", action="store_true", help="also record solve_exact where it is a DP (record)")
    args = parser.parse_args()
    if args.action == "record":
        problems = build_problems(args.top)
        heuristic, exact = solve_all(problems, args.exact)
        with open(args.path, "wb") as file:
            pickle.dump({"problems": problems, "heuristic": heuristic, "exact": exact}, file)
        none = sum(answer is None for answer in heuristic)
        print(f"recorded {len(problems)} problems ({none} where nothing fits) to {args.path}")
        return
    with open(args.path, "rb") as file:
        stored = pickle.load(file)
    problems = stored["problems"]
    heuristic, exact = solve_all(problems, bool(stored["exact"]))
    differ = 0
    for which, before, after in (("heuristic", stored["heuristic"], heuristic), ("exact", stored["exact"], exact)):
        if which == "exact" and not before:
            continue  # recorded without --exact
        for (label, _), old, new in zip(problems, before, after, strict=True):
            if not _same(old, new):
                differ += 1
                old_s = "none" if old is None else old if isinstance(old, str) else f"{old[2]:.9f} s"
                new_s = "none" if new is None else new if isinstance(new, str) else f"{new[2]:.9f} s"
                print(f"DIFFERS ({which}) {label}: {old_s} -> {new_s}")
    print(f"{len(problems)} problems: {differ} answers differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
