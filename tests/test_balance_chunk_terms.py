"""A stage's largest chunk sum (``BalanceProblem.recompute_chunk_bytes`` less
``recompute_chunk_offset``, at least 0, once per stage): the weight-gradient step's rebuilt copies
under PyTorch's split backward, which the estimator takes at a stage's longest chunk. Every solver
prices it as ``evaluate`` does and the exact ones still equal brute force."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ndplan.balance import Plan, evaluate, solve_brute_force, solve_exact, solve_milp
from ndplan.balance.problem import BalanceProblem
from test_balance_dp import random_problem
from test_balance_rounds import (
    check_exact_dp_and_heuristic,
    check_exact_stages,
    check_knapsacks,
    chunked_problem,
)

GIB = 2**30


def with_chunk_terms(problem: BalanceProblem, seed: int, scale: float = 1.0) -> BalanceProblem:
    """``problem`` with random bytes per layer of each recomputing (kind, option) in each chunk,
    one chunk of the first stage at none (as the pipeline's first, whose W is a whole backward),
    and a random offset per stage."""
    rng = np.random.default_rng(seed + 13)
    pp, v = problem.pp, problem.chunks_per_stage
    table = {}
    for kind in sorted(set(problem.layer_kinds)):
        for option in problem.options:
            if option != "none":
                values = rng.uniform(0.0, 1.5, (pp, v)) * scale * GIB
                values[problem.stage_of[0], problem.chunk_of[0]] = 0.0
                table[kind, option] = values
    return replace(problem, recompute_chunk_bytes=table, recompute_chunk_offset=rng.uniform(0.0, 2.0, pp) * GIB)


def test_evaluate_holds_the_largest_chunk_sum_less_the_offset() -> None:
    """DualPipeV pp2: stage 0 holds virtual stages 0 and 3, stage 1 virtual 1 and 2. Full costs
    1 GiB a layer in every chunk, selective 0.25; offsets 0.5 and 3 GiB. Stage 0: chunk 0 two full
    and a selective (2.25), chunk 1 one full (1): 2.25 − 0.5; stage 1: 1 and 1.5, under 3: 0."""
    problem = chunked_problem(("dense",) * 8, 2, 2, 100, schedule="dualpipev")
    ones = np.ones((2, 2))
    problem = replace(problem, recompute_chunk_bytes={("dense", "full"): ones * GIB, ("dense", "selective"): ones * GIB / 4},
                      recompute_chunk_offset=np.array([0.5, 3.0]) * GIB)
    assert list(problem.stage_of) == [0, 1, 1, 0]
    plan = Plan((3, 2, 2, 1), ("full", "full", "selective", "full", "none", "none", "selective", "full"))
    without = evaluate(replace(problem, recompute_chunk_bytes=None), plan).stage_memory_bytes
    assert evaluate(problem, plan).stage_memory_bytes - without == pytest.approx([1.75 * GIB, 0.0])
    # The same plan in a batch of plans (the uniform candidates' pass) reads the same.
    from ndplan.balance.problem import cost_columns, cost_index, evaluate_codes_many
    index = cost_index(problem)
    codes = np.array([[index["dense", o] for o in plan.recompute]] * 2)
    many = evaluate_codes_many(problem, plan.stage_layers, cost_columns(problem), codes)
    assert many[1].stage_memory_bytes == pytest.approx(evaluate(problem, plan).stage_memory_bytes, rel=1e-12)


def test_one_chunk_per_stage_refuses_chunk_bytes() -> None:
    problem = random_problem(("dense",) * 6, 2, 100, seed=3)
    with pytest.raises(ValueError, match="several chunks per stage"):
        replace(problem, recompute_chunk_bytes={("dense", "full"): np.ones((2, 1)) * GIB})


@pytest.mark.parametrize("schedule", ["interleaved", "zbv", "dualpipev"])
@pytest.mark.parametrize("seed", range(6))
def test_chunk_dp_equals_brute_force_with_chunk_terms(schedule: str, seed: int) -> None:
    problems = (with_chunk_terms(chunked_problem(("dense",) * 8, 2, 2, limit, seed=seed, schedule=schedule,
                                                 shuffle=seed % 2 == 1), seed) for limit in (8, 12, 18))
    assert sum(check_exact_dp_and_heuristic(problem) is not None for problem in problems)  # a plan in one at least


@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
@pytest.mark.parametrize("seed", range(5))
def test_prefixed_solvers_equal_brute_force_with_chunk_terms(schedule: str, seed: int) -> None:
    """A leading run of dense layers before MoE ones (``balance.prefix``): the exact DP prices
    each step's dealt recompute with its chunk sums (``rounds._dealt_mixes``) and equals brute force."""
    from test_balance_prefix import prefixed_problem

    problems = (with_chunk_terms(prefixed_problem(8, 2, 1, schedule, 2, seed, limit, shuffle=seed % 2 == 1), seed)
                for limit in (10, 16, 24))
    assert sum(check_exact_dp_and_heuristic(problem) is not None for problem in problems)  # a plan in one at least


@pytest.mark.parametrize("kinds", [("dense",) * 8, ("dense", "moe") * 4])
@pytest.mark.parametrize("seed", range(6))
def test_rounds_exact_stages_equal_the_dealt_knapsack_with_chunk_terms(kinds: tuple[str, ...], seed: int) -> None:
    """The heuristic's exact recompute per stage (``rounds._exact_stages``) takes the least time
    that fits as ``solve.dealt_knapsack`` prices it, each stage's largest chunk sum included."""
    checked = 0
    for counts in ((2, 2, 2, 2), (3, 1, 2, 2)):
        for limit in (9, 12, 16):
            problem = with_chunk_terms(chunked_problem(kinds, 2, 2, limit, seed=seed, schedule="dualpipev",
                                                       shuffle=seed % 2 == 1), seed)
            checked += check_exact_stages(problem, counts)
    assert checked


def test_knapsacks_price_the_largest_chunk_sum() -> None:
    """The references: the best assignment's memory is what ``evaluate`` gives it."""
    checked = 0
    for seed in range(5):
        problem = with_chunk_terms(chunked_problem(("dense", "moe") * 4, 2, 2, 14, seed=seed, schedule="dualpipev"), seed)
        for counts in ((2, 2, 2, 2), (3, 1, 1, 3)):
            checked += check_knapsacks(problem, counts)
    assert checked


@pytest.mark.parametrize("seed", range(4))
def test_milp_prices_chunk_terms(seed: int) -> None:
    """Two kinds in no leading run: the MILP (options free per chunk, a relaxation of dealing
    them) is at or under the brute-force optimum and its plan fits by ``evaluate``; the exact
    answer (the MILP's placement re-dealt, or the heuristic's) fits and is no better than it."""
    kinds = ("dense", "moe", "moe", "dense", "moe", "moe", "dense", "moe")
    hits = 0
    for limit in (10, 14, 20):
        problem = with_chunk_terms(chunked_problem(kinds, 2, 2, limit, seed=seed, schedule="dualpipev",
                                                   shuffle=seed % 2 == 1), seed)
        brute, milp = solve_brute_force(problem), solve_milp(problem)
        if brute is None:
            continue
        hits += 1
        assert milp is not None and milp[1].fits
        assert milp[1].step_s <= brute[1].step_s * (1 + 1e-6)
        exact = solve_exact(problem)
        assert exact is not None and exact[1].fits and exact[1].step_s >= brute[1].step_s * (1 - 1e-9)
    assert hits
