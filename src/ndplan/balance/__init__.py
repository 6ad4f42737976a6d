"""Pipeline stage balancing and recompute planning (exact MILP, knapsack, heuristic)."""

from ndplan.balance.build import BalanceResult, balance, build_problem, plan_strategy
from ndplan.balance.problem import BalanceProblem, LayerCost, Plan, PlanCost, evaluate, uniform_plan
from ndplan.balance.solve import knapsack, plan_for_counts, solve_brute_force, solve_exact, solve_heuristic

__all__ = [
    "BalanceResult", "balance", "build_problem", "plan_strategy",
    "BalanceProblem", "LayerCost", "Plan", "PlanCost", "evaluate", "knapsack", "plan_for_counts",
    "solve_brute_force", "solve_exact", "solve_heuristic", "uniform_plan",
]
