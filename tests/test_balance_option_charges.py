"""Recompute options with bytes of their own, once on a stage where they run
(``BalanceProblem.recompute_option_bytes``): every solver prices them as ``evaluate`` does and
the exact ones still equal brute force."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ndplan.balance import Plan, evaluate, solve_brute_force, solve_dp, solve_heuristic, solve_milp
from ndplan.balance.solve import knapsack
from test_balance_dp import random_problem
from test_balance_rounds import (
    check_exact_dp_and_heuristic,
    check_exact_stages,
    check_knapsacks,
    chunked_problem,
)

GIB = 2**30


def charged(problem, seed, scale=1.0):
    """``problem`` with random bytes per recompute option, once per stage where it runs."""
    rng = np.random.default_rng(seed + 7)
    return replace(problem, recompute_option_bytes={
        option: rng.uniform(0.0, 2.0, problem.pp) * scale * GIB for option in problem.options if option != "none"})


def built_like(problem, seed):
    """As ``build`` gives them: per stage one option's constant above the other's, the smaller
    in the transient, so that the bytes of the options present are the max of their constants."""
    rng = np.random.default_rng(seed + 11)
    recomputing = [option for option in problem.options if option != "none"]
    top = rng.integers(len(recomputing), size=problem.pp)
    return replace(problem, recompute_option_bytes={
        option: np.where(top == r, rng.uniform(0.0, 2.0, problem.pp), 0.0) * GIB for r, option in enumerate(recomputing)})


def test_evaluate_charges_each_option_once_per_stage():
    """Stage 0 runs selective on two layers and full on one: the transient once, selective's and
    full's bytes once each; stage 1 runs none only: nothing."""
    problem = replace(random_problem(("dense",) * 6, 2, 100, seed=3), recompute_option_bytes={
        "selective": np.array([1.0, 10.0]) * GIB, "full": np.array([2.0, 20.0]) * GIB})
    plan = Plan((3, 3), ("selective", "full", "selective", "none", "none", "none"))
    without = evaluate(replace(problem, recompute_option_bytes=None), plan).stage_memory_bytes
    assert evaluate(problem, plan).stage_memory_bytes - without == pytest.approx([3.0 * GIB, 0.0])
    assert knapsack(problem, (3, 3), 0) is not None


@pytest.mark.parametrize("kinds", [("dense",) * 7, ("dense", "moe", "moe", "dense", "moe", "moe", "moe")])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("charging", ["charged", "built_like"])
def test_dp_and_milp_equal_brute_force_with_option_bytes(kinds, seed, charging):
    hits = 0
    for limit in (6, 9, 12, 16):
        problem = globals()[charging](random_problem(kinds, 3, limit, seed=seed, shuffle_costs=seed % 2 == 1), seed)
        brute, exact, milp = solve_brute_force(problem), solve_dp(problem), solve_milp(problem)
        assert (brute is None) == (exact is None) == (milp is None)
        if brute is None:
            continue
        hits += 1
        assert exact[1].fits and exact[1].step_s == pytest.approx(brute[1].step_s, rel=1e-9)
        assert milp[1].fits and milp[1].step_s == pytest.approx(brute[1].step_s, rel=1e-6)
        heuristic = solve_heuristic(problem)
        assert heuristic is not None and heuristic[1].fits and heuristic[1].step_s >= brute[1].step_s * (1 - 1e-9)
    assert hits


@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
@pytest.mark.parametrize("seed", range(6))
def test_chunked_solvers_equal_brute_force_with_option_bytes(schedule, seed):
    hits = 0
    for limit in (8, 12, 18):
        problem = charged(chunked_problem(("dense",) * 8, 2, 2, limit, seed=seed, schedule=schedule,
                                          shuffle=seed % 2 == 1), seed)
        hits += check_exact_dp_and_heuristic(problem) is not None
    assert hits


def test_knapsacks_price_the_options_present():
    """The references: the best assignment's memory is what ``evaluate`` gives it."""
    assert sum(check_knapsacks(charged(chunked_problem(("dense",) * 8, 2, 2, 14, seed=seed), seed), (2, 2, 2, 2))
               for seed in range(5))


@pytest.mark.parametrize("kinds", [("dense",) * 8, ("dense", "moe") * 4])
@pytest.mark.parametrize("seed", range(6))
def test_rounds_exact_stages_equal_the_dealt_knapsack_with_option_bytes(kinds, seed):
    """The heuristic's exact recompute per stage (``rounds._exact_stages``) takes the least time
    that fits as ``solve.dealt_knapsack`` prices it, the options' own bytes included."""
    checked = 0
    for limit in (9, 12, 16):
        problem = charged(chunked_problem(kinds, 2, 2, limit, seed=seed, shuffle=seed % 2 == 1), seed)
        checked += check_exact_stages(problem, (2, 2, 2, 2))
    assert checked


@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
@pytest.mark.parametrize("seed", range(5))
def test_prefixed_solvers_equal_brute_force_with_option_bytes(schedule, seed):
    """A leading run of dense layers before MoE ones (``balance.prefix``), options with bytes of
    their own: the exact DP still equals brute force, the heuristic fits."""
    from test_balance_prefix import prefixed_problem

    hits = 0
    for limit in (10, 16, 24):
        problem = built_like(prefixed_problem(8, 2, 1, schedule, 2, seed, limit, shuffle=seed % 2 == 1), seed)
        hits += check_exact_dp_and_heuristic(problem) is not None
    assert hits
