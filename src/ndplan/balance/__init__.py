"""Pipeline stage balancing and recompute planning (exact DP or MILP, knapsack, heuristic)."""

from ndplan.balance.build import BalanceResult, balance, build_problem, build_problems, plan_strategy
from ndplan.balance.dp import solve_dp
from ndplan.balance.problem import (
    BalanceProblem,
    LayerCost,
    Plan,
    PlanCost,
    evaluate,
    even_chunks,
    simulated_step_s,
    uniform_plan,
)
from ndplan.balance.solve import (
    exact_method,
    knapsack,
    plan_for_counts,
    solve_brute_force,
    solve_exact,
    solve_heuristic,
    solve_milp,
    solve_milp_bounded,
)

__all__ = [
    "BalanceResult", "balance", "build_problem", "build_problems", "plan_strategy",
    "BalanceProblem", "LayerCost", "Plan", "PlanCost", "even_chunks", "evaluate", "exact_method", "knapsack",
    "plan_for_counts", "simulated_step_s", "solve_brute_force", "solve_dp", "solve_exact", "solve_heuristic",
    "solve_milp", "solve_milp_bounded", "uniform_plan",
]
