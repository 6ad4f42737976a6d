"""Solvers for the balancing problem: exact DP or MILP, per-stage recompute knapsack, fast heuristic.

* ``knapsack``: for one physical stage with its layers fixed, the recompute counts per layer kind
  that minimise the stage's time while it fits. Layers of one kind are interchangeable, so it
  enumerates counts (a multiple-choice knapsack with identical items), exactly. The reference
  the fast solvers are tested against.
* ``solve_exact``: with one virtual stage per physical stage (no interleaving), the exact
  dynamic program of ``ndplan.balance.dp`` (milliseconds); with interleaved stages, whose
  chunks share a stage's memory, a mixed-integer program (``solve_milp``, scipy's HiGHS) over
  layer placement and recompute counts with linear memory constraints and the composed step
  time as objective.
* ``solve_heuristic``: without interleaving, the DP restricted to stages of about L / V layers
  (under a millisecond per candidate); with interleaving, uniform start, knapsack per stage,
  then single-layer moves between neighbouring virtual stages while they pay. Fast enough to
  run on every pipeline candidate of a search.
* ``solve_brute_force``: every placement with the exact knapsack per stage (tests only: given a
  placement, minimising every stage's time is optimal, since the objective grows with each).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product

import numpy as np

from ndplan.balance.dp import WINDOW as HEURISTIC_WINDOW
from ndplan.balance.dp import one_chunk_per_stage, solve_dp
from ndplan.balance.problem import BalanceProblem, Plan, PlanCost, evaluate


def _stage_layers(problem: BalanceProblem, counts: tuple[int, ...]) -> list[list[tuple[int, int]]]:
    """For each physical stage, (virtual stage, layer index) pairs of its layers."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(problem.pp)]
    layer = 0
    for v, count in enumerate(counts):
        for _ in range(count):
            out[int(problem.stage_of[v])].append((v, layer))
            layer += 1
    return out


def _splits(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """All ways to write n as an ordered sum of ``parts`` non-negative integers."""
    if parts == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _splits(n - first, parts - 1):
            yield (first, *rest)


def _recomputes(problem: BalanceProblem, split: tuple[int, ...]) -> bool:
    """Some layer of the split (counts per option) runs an option other than "none"."""
    return any(n and option != "none" for option, n in zip(problem.options, split, strict=True))


def knapsack(problem: BalanceProblem, counts: tuple[int, ...], stage: int) -> tuple[dict[int, str], float, float] | None:
    """Cheapest recompute assignment for ``stage`` under the memory limit: (option per layer,
    stage time, stage memory), or None if no assignment fits."""
    in_flight = problem.in_flight_of_virtual()
    members = _stage_layers(problem, counts)[stage]
    base_memory = float(problem.fixed_bytes[stage])
    base_time = 0.0
    for v, extra in ((0, problem.first_extra), (problem.num_virtual_stages - 1, problem.last_extra)):
        if int(problem.stage_of[v]) == stage:
            base_memory += extra.static_bytes + in_flight[v] * extra.activation_bytes
            base_time += extra.time_s
    # Group interchangeable layers: same kind and same in-flight weight (same chunk).
    groups: dict[tuple[str, float], list[int]] = {}
    for v, layer in members:
        groups.setdefault((problem.layer_kinds[layer], float(in_flight[v])), []).append(layer)
    fronts = []
    for (kind, weight), layers in groups.items():
        choices = []
        for split in _splits(len(layers), len(problem.options)):
            time = memory = 0.0
            for option, n in zip(problem.options, split, strict=True):
                cost = problem.costs[(kind, option)]
                time += n * cost.time_s
                memory += n * (cost.static_bytes + weight * cost.activation_bytes)
            choices.append((time, memory, split))
        choices.sort()
        # Keep the (time, memory) Pareto front of this group, separately for the splits that
        # recompute and those that do not: a split with no recompute avoids the stage's
        # transient, so one that recomputes must not prune it (nor the reverse).
        front = []
        for recomputing in (False, True):
            best_memory = np.inf
            for choice in choices:
                if _recomputes(problem, choice[2]) == recomputing and choice[1] < best_memory:
                    front.append(choice)
                    best_memory = choice[1]
        fronts.append((layers, front))
    best: tuple[float, float, tuple] | None = None
    for combo in product(*(front for _, front in fronts)):
        time = base_time + sum(c[0] for c in combo)
        memory = base_memory + sum(c[1] for c in combo)
        if any(_recomputes(problem, c[2]) for c in combo):
            memory += problem.recompute_transient(stage)
        if memory <= problem.memory_limit_bytes and (best is None or time < best[0]):
            best = (time, memory, combo)
    if best is None:
        return None
    assignment: dict[int, str] = {}
    for (layers, _), choice in zip(fronts, best[2], strict=True):
        position = 0
        for option, n in zip(problem.options, choice[2], strict=True):
            for layer in layers[position:position + n]:
                assignment[layer] = option
            position += n
    return assignment, best[0], best[1]


StageCache = dict[tuple[int, tuple[tuple[int, int], ...]], "tuple[dict[int, str], float, float] | None"]


def plan_for_counts(problem: BalanceProblem, counts: tuple[int, ...], cache: StageCache | None = None) -> Plan | None:
    """The best recompute for a placement (knapsack per stage), or None if a stage cannot fit.

    A stage's answer depends only on which layers it holds, so ``cache`` (keyed by the stage
    and its chunks' (first layer, count)) lets a search over placements re-solve only the
    stages a move changed.
    """
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    recompute = [""] * problem.num_layers
    for stage in range(problem.pp):
        key = (stage, tuple((int(starts[v]), int(counts[v])) for v in np.flatnonzero(problem.stage_of == stage)))
        if cache is not None and key in cache:
            solved = cache[key]
        else:
            solved = knapsack(problem, counts, stage)
            if cache is not None:
                cache[key] = solved
        if solved is None:
            return None
        for layer, option in solved[0].items():
            recompute[layer] = option
    return Plan(counts, tuple(recompute))


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered sums of ``parts`` positive integers."""
    for split in _splits(total - parts, parts):
        yield tuple(s + 1 for s in split)


def solve_brute_force(problem: BalanceProblem) -> tuple[Plan, PlanCost] | None:
    best: tuple[Plan, PlanCost] | None = None
    for counts in _compositions(problem.num_layers, problem.num_virtual_stages):
        plan = plan_for_counts(problem, counts)
        if plan is None:
            continue
        cost = evaluate(problem, plan)
        if best is None or cost.step_s < best[1].step_s - 1e-12:
            best = (plan, cost)
    return best


def solve_heuristic(problem: BalanceProblem, start: tuple[int, ...] | None = None) -> tuple[Plan, PlanCost] | None:
    """A good plan fast, never slower than uniform placement with its best recompute, and None
    only if no plan fits.

    Without interleaving (and no ``start``): the DP over stages of about L / V layers
    (``solve_dp`` with ``HEURISTIC_WINDOW``). Otherwise a local search: knapsack on the uniform
    placement (or ``start``), then move single layers between neighbouring virtual stages while
    the composed step time drops (or while the plan does not fit yet).
    """
    if start is None and one_chunk_per_stage(problem):
        return solve_dp(problem, window=HEURISTIC_WINDOW)
    base, extra = divmod(problem.num_layers, problem.num_virtual_stages)
    counts = start or tuple(base + (1 if v < extra else 0) for v in range(problem.num_virtual_stages))

    strongest = problem.options[-1]
    cache: StageCache = {}

    def score(c: tuple[int, ...]) -> tuple[tuple[int, float], Plan | None, PlanCost | None]:
        # Feasible plans rank by step time; infeasible placements by how far the strongest
        # recompute leaves them over the limit, so the search can walk out of infeasibility.
        plan = plan_for_counts(problem, c, cache)
        if plan is None:
            over = evaluate(problem, Plan(c, (strongest,) * problem.num_layers)).stage_memory_bytes
            return (1, float(np.max(over) - problem.memory_limit_bytes)), None, None
        cost = evaluate(problem, plan)
        return (0, cost.step_s), plan, cost

    current = score(counts)
    improved = True
    while improved:
        improved = False
        for v in range(problem.num_virtual_stages - 1):
            for delta in (1, -1):  # move a layer across the boundary between v and v+1
                c = list(counts)
                c[v] -= delta
                c[v + 1] += delta
                if min(c) < 1:
                    continue
                trial = score(tuple(c))
                if trial[0][0] < current[0][0] or (trial[0][0] == current[0][0] and trial[0][1] < current[0][1] - 1e-12):
                    counts, current, improved = tuple(c), trial, True
    if current[1] is None or current[2] is None:
        return None
    return current[1], current[2]


def exact_method(problem: BalanceProblem) -> str:
    """Which exact solver ``solve_exact`` runs on ``problem``: "dp" or "milp"."""
    return "dp" if one_chunk_per_stage(problem) else "milp"


def solve_exact(problem: BalanceProblem, time_limit_s: float = 10.0) -> tuple[Plan, PlanCost] | None:
    """The optimal plan, or None if none fits: the DP without interleaving (exact, see
    ``ndplan.balance.dp``), else the MILP (``solve_milp``).

    HiGHS stops at ``time_limit_s``; the answer is then the best of its incumbent and the
    heuristic's plan, so it is never worse than the heuristic.
    """
    if one_chunk_per_stage(problem):
        return solve_dp(problem)
    found = solve_milp(problem, time_limit_s)
    fallback = solve_heuristic(problem)
    candidates = [c for c in (found, fallback) if c is not None and c[1].fits]  # HiGHS' tolerance can overshoot
    return min(candidates, key=lambda c: c[1].step_s) if candidates else None


def solve_milp(problem: BalanceProblem, time_limit_s: float = 10.0) -> tuple[Plan, PlanCost] | None:
    """The MILP. Variables: y[l, v] (layer l on virtual stage v), k[v, g, r] (layers of kind g
    on v with option r), a[s] (stage s recomputes something), Z (the largest stage time). A
    model of one layer kind needs no y: the counts k place it. Optimal unless HiGHS hits
    ``time_limit_s`` (then its incumbent, or None); also the tests' cross-check of the DP.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    L, V, R = problem.num_layers, problem.num_virtual_stages, len(problem.options)
    kinds = sorted(set(problem.layer_kinds))
    G = len(kinds)
    homogeneous = G == 1
    in_flight = problem.in_flight_of_virtual()
    n_y, n_k = (0 if homogeneous else L * V), V * G * R
    P = problem.pp
    n = n_y + n_k + P + 1
    z = n - 1

    def any_recompute(stage: int) -> int:
        return n_y + n_k + stage

    def y(layer: int, v: int) -> int:
        return layer * V + v

    def k(v: int, g: int, r: int) -> int:
        return n_y + (v * G + g) * R + r

    rows: list[np.ndarray] = []
    lower: list[float] = []
    upper: list[float] = []

    def add(coefficients: dict[int, float], lo: float, hi: float) -> None:
        row = np.zeros(n)
        for index, value in coefficients.items():
            row[index] += value
        rows.append(row)
        lower.append(lo)
        upper.append(hi)

    if homogeneous:  # every virtual stage holds at least one layer; all layers are placed
        for v in range(V):
            add({k(v, 0, r): 1.0 for r in range(R)}, 1, L)
        add({k(v, 0, r): 1.0 for v in range(V) for r in range(R)}, L, L)
    else:
        for layer in range(L):  # each layer on exactly one virtual stage
            add({y(layer, v): 1.0 for v in range(V)}, 1, 1)
        position = {layer: {y(layer, v): float(v) for v in range(V)} for layer in range(L)}
        add(position[0], 0, 0)
        add(position[L - 1], V - 1, V - 1)
        for layer in range(L - 1):  # contiguous, in order, no empty virtual stage
            step = dict(position[layer + 1])
            for i, c in position[layer].items():
                step[i] = step.get(i, 0.0) - c
            add(step, 0, 1)
        for v in range(V):  # recompute counts of each kind add up to the kind's layers on v
            for g, kind in enumerate(kinds):
                coefficients = {k(v, g, r): 1.0 for r in range(R)}
                for layer in range(L):
                    if problem.layer_kinds[layer] == kind:
                        coefficients[y(layer, v)] = -1.0
                add(coefficients, 0, 0)
    objective = np.zeros(n)
    for s in range(problem.pp):
        memory: dict[int, float] = {}
        time: dict[int, float] = {z: -1.0}
        fixed_memory = float(problem.fixed_bytes[s])
        fixed_time = 0.0
        for virtual in (int(i) for i in np.flatnonzero(problem.stage_of == s)):
            for g, kind in enumerate(kinds):
                for r, option in enumerate(problem.options):
                    cost = problem.costs[(kind, option)]
                    memory[k(virtual, g, r)] = cost.static_bytes + in_flight[virtual] * cost.activation_bytes
                    time[k(virtual, g, r)] = cost.time_s
                    objective[k(virtual, g, r)] += cost.time_s
            for end, extra in ((0, problem.first_extra), (V - 1, problem.last_extra)):
                if virtual == end:
                    fixed_memory += extra.static_bytes + in_flight[virtual] * extra.activation_bytes
                    fixed_time += extra.time_s
        memory[any_recompute(s)] = problem.recompute_transient(s)
        # In GiB: rows of ~1e9 coefficients next to ~1 ones make HiGHS stop at suboptimal
        # "optimal" points (seen on 25-layer instances, 13 % off the DP's optimum).
        add({i: c / 2**30 for i, c in memory.items()}, -np.inf, (problem.memory_limit_bytes - fixed_memory) / 2**30)
        add(time, -np.inf, -fixed_time)
        for virtual in (int(i) for i in np.flatnonzero(problem.stage_of == s)):
            for g in range(G):
                for r, option in enumerate(problem.options):
                    if option != "none":  # a recomputed layer on s switches the stage's transient on
                        add({k(virtual, g, r): 1.0, any_recompute(s): -float(L)}, -np.inf, 0)
    objective[z] = problem.num_micro_batches - 1
    integrality = np.ones(n)
    integrality[z] = 0
    bounds = Bounds(np.zeros(n), np.concatenate([np.ones(n_y), np.full(n_k, L), np.ones(P), [np.inf]]))
    result = milp(
        objective, constraints=LinearConstraint(np.array(rows), lower, upper), integrality=integrality,
        bounds=bounds, options={"time_limit": time_limit_s},
    )
    if result.x is None:
        return None
    x = np.round(result.x).astype(int)
    if homogeneous:
        counts = tuple(int(sum(x[k(v, 0, r)] for r in range(R))) for v in range(V))
    else:
        counts = tuple(int(x[[y(layer, v) for layer in range(L)]].sum()) for v in range(V))
    # Hand each layer of a kind on v the options in the MILP's counts (the order inside a
    # virtual stage does not change memory or time).
    recompute = [""] * L
    layer = 0
    for v, count in enumerate(counts):
        members = list(range(layer, layer + count))
        for g, kind in enumerate(kinds):
            of_kind = [m for m in members if problem.layer_kinds[m] == kind]
            position_in_kind = 0
            for r, option in enumerate(problem.options):
                for m in of_kind[position_in_kind:position_in_kind + x[k(v, g, r)]]:
                    recompute[m] = option
                position_in_kind += int(x[k(v, g, r)])
        layer += count
    plan = Plan(counts, tuple(recompute))
    return plan, evaluate(problem, plan)
