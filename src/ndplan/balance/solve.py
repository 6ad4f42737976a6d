"""Solvers for the balancing problem: exact DP or MILP, per-stage recompute knapsack, fast heuristic.

* ``knapsack``: for one physical stage with its layers fixed, the recompute counts per layer kind
  that minimise the stage's time while it fits. Layers of one kind are interchangeable, so it
  enumerates counts (a multiple-choice knapsack with identical items), exactly. The reference
  the fast solvers are tested against.
* ``solve_exact``: with one virtual stage per physical stage (no interleaving), the exact
  dynamic program of ``ndplan.balance.dp`` (milliseconds); with several chunks per stage and one
  layer kind, the exact DP over stage totals of ``ndplan.balance.chunks``, or with a leading run
  of another kind the exact DP over stage totals and that run of ``ndplan.balance.prefix``;
  else, as chunks
  share a stage's memory, a mixed-integer program (``solve_milp``, scipy's HiGHS) over layer
  placement and recompute counts with linear memory constraints, the composed step time as
  objective, and a stage's chunks within one layer of each other (``even_chunks``).
* ``solve_heuristic``: without interleaving, the DP restricted to stages of about L / V layers;
  with several chunks per stage, the same over stage totals (one layer kind, or a leading run
  of another: ``ndplan.balance.chunks``, ``ndplan.balance.prefix``) or the periodic-plan DP of
  ``ndplan.balance.rounds``. About a
  millisecond per candidate: fast enough to run on every pipeline candidate of a search.
* ``solve_brute_force``: every placement with even chunks, with the exact knapsack per stage
  (tests only: given a placement, minimising every stage's time is optimal, since the objective
  grows with each).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from itertools import permutations, product

import numpy as np

from ndplan.balance.chunks import WINDOW as CHUNKS_WINDOW
from ndplan.balance.chunks import one_layer_kind, solve_chunks
from ndplan.balance.dp import WINDOW as HEURISTIC_WINDOW
from ndplan.balance.dp import one_chunk_per_stage, solve_dp
from ndplan.balance.prefix import leading_run, solve_prefixed, solve_prefixed_exact
from ndplan.balance.problem import (
    BalanceProblem,
    Plan,
    PlanCost,
    cost_columns,
    cost_index,
    end_units,
    evaluate,
    evaluate_codes_many,
    even_chunks,
    layer_units,
    load_spread,
    stage_bases,
    uniform_counts,
)
from ndplan.balance.rounds import solve_rounds


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


def _step_fits(problem: BalanceProblem, members: list[tuple[int, int]], stage: int) -> bool:
    """The stage's layers (``_stage_layers``' pairs) fit at the optimizer step, whatever they
    recompute."""
    kinds = sorted(set(problem.layer_kinds))
    held = [sum(problem.layer_kinds[layer] == kind for _, layer in members) for kind in kinds]
    fits = problem.step_fits(np.array([stage]), np.array([held]), kinds)
    return fits is None or bool(fits[0])


def _present(split: tuple[int, ...]) -> tuple[bool, ...]:
    """Which options the split (counts per option) runs on some layer."""
    return tuple(n > 0 for n in split)


def knapsack(problem: BalanceProblem, counts: tuple[int, ...], stage: int) -> tuple[dict[int, str], float, float] | None:
    """Cheapest recompute assignment for ``stage`` under the memory limit: (option per layer,
    stage time, stage memory), or None if no assignment fits."""
    in_flight = problem.in_flight_of_virtual()
    members = _stage_layers(problem, counts)[stage]
    if not _step_fits(problem, members, stage):
        return None
    bases = stage_bases(problem)
    base_memory, base_time = float(bases[0][stage]), float(bases[1][stage])
    # Group interchangeable layers: same kind and same in-flight weight (same chunk); with chunk
    # terms, same chunk.
    chunked = problem.has_chunk_terms
    table = problem.chunk_bytes(sorted(set(problem.layer_kinds)))[stage] if chunked else None  # [v, G, R]
    groups: dict[tuple[str, float, int], list[int]] = {}
    for v, layer in members:
        groups.setdefault((problem.layer_kinds[layer], float(in_flight[v]), v if chunked else -1), []).append(layer)
    fronts = []
    for (kind, weight, _), layers in groups.items():
        choices = []
        extra = problem.layer_extra([kind])[stage, 0]  # [R] what recomputing adds per layer on the stage
        for split in _splits(len(layers), len(problem.options)):
            time = memory = 0.0
            for r, (option, n) in enumerate(zip(problem.options, split, strict=True)):
                cost = problem.costs[(kind, option)]
                time += n * cost.time_s
                memory += n * (cost.static_bytes + weight * cost.activation_bytes + float(extra[r]))
            choices.append((time, memory, split))
        choices.sort()
        # Keep the (time, memory) Pareto front of this group, separately for each set of
        # options the splits run: a split with no recompute avoids the stage's transient, and
        # one without an option that option's own bytes, so no other set may prune it.
        # (With chunk terms every split stays: its chunk's sum is no part of its memory here.)
        front = [] if not chunked else choices
        for present in dict.fromkeys(_present(choice[2]) for choice in choices) if not chunked else ():
            best_memory = np.inf
            for choice in choices:
                if _present(choice[2]) == present and choice[1] < best_memory:
                    front.append(choice)
                    best_memory = choice[1]
        fronts.append((layers, front))
    kinds = sorted(set(problem.layer_kinds))
    group_keys = list(groups)
    best: tuple[float, float, tuple] | None = None
    for combo in product(*(front for _, front in fronts)):
        time = base_time + sum(c[0] for c in combo)
        memory = base_memory + sum(c[1] for c in combo)
        memory += problem.recompute_charge(stage, [any(c[2][r] for c in combo) for r in range(len(problem.options))])
        if table is not None:  # the largest chunk sum, once
            sums: dict[int, float] = {}
            for (kind, _, virtual), choice in zip(group_keys, combo, strict=True):
                chunk = int(problem.chunk_of[virtual])
                sums[chunk] = sums.get(chunk, 0.0) + float(np.asarray(choice[2]) @ table[chunk, kinds.index(kind)])
            memory += float(problem.chunk_term(np.array([max(sums.values(), default=0.0)]), np.array([stage]))[0])
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


def dealt_knapsack(problem: BalanceProblem, counts: tuple[int, ...], stage: int
                   ) -> tuple[dict[int, str], float, float] | None:
    """As ``knapsack``, but each kind's options dealt to the stage's chunks in turn
    (``chunks.dealt_chunks``), the rule for stages of several chunks: every mix of option
    counts per kind, priced layer by layer. The reference the vectorised solvers are tested
    against."""
    from ndplan.balance.chunks import dealt_chunks

    in_flight = problem.in_flight_of_virtual()
    members = _stage_layers(problem, counts)[stage]
    if not _step_fits(problem, members, stage):
        return None
    bases = stage_bases(problem)
    base_memory, base_time = float(bases[0][stage]), float(bases[1][stage])
    chunks = np.flatnonzero(problem.stage_of == stage)  # virtual stages of this stage, by local chunk
    chunks = chunks[np.argsort(problem.chunk_of[chunks])]
    flight = in_flight[chunks]
    virtual_of = {layer: v for v, layer in members}
    per_kind = []  # (kind, layer of each dealt slot, in-flight weight of each slot)
    for kind in sorted({problem.layer_kinds[layer] for _, layer in members}):
        by_chunk = [[layer for v, layer in members if v == virtual and problem.layer_kinds[layer] == kind]
                    for virtual in chunks]
        dealt = dealt_chunks(np.array([len(c) for c in by_chunk]), flight)
        taken = [0] * len(chunks)
        slots = []
        for c in dealt.tolist():
            slots.append((by_chunk[c][taken[c]], float(flight[c])))
            taken[c] += 1
        per_kind.append((kind, slots))
    best: tuple[float, float, dict[int, str]] | None = None
    mixes = [list(_splits(len(slots), len(problem.options))) for _, slots in per_kind]
    table = problem.chunk_bytes([kind for kind, _ in per_kind])[stage] if problem.has_chunk_terms else None  # [v, G, R]
    for combo in product(*mixes):
        time, memory, assignment = base_time, base_memory, {}
        sums = np.zeros(problem.chunks_per_stage)  # each chunk's sum of its layers' chunk bytes
        for g, ((kind, slots), mix) in enumerate(zip(per_kind, combo, strict=True)):
            by_bytes = sorted(range(len(problem.options)), key=lambda r: -problem.costs[(kind, problem.options[r])].activation_bytes)
            queue = [r for r in by_bytes for _ in range(mix[r])]
            extra = problem.layer_extra([kind])[stage, 0]  # [R] what recomputing adds per layer on the stage
            for (layer, weight), r in zip(slots, queue, strict=True):
                cost = problem.costs[(kind, problem.options[r])]
                time += cost.time_s
                memory += cost.static_bytes + weight * cost.activation_bytes + float(extra[r])
                assignment[layer] = problem.options[r]
                if table is not None:
                    chunk = int(problem.chunk_of[virtual_of[layer]])
                    sums[chunk] += table[chunk, g, r]
        memory += problem.recompute_charge(stage, [any(mix[r] for mix in combo) for r in range(len(problem.options))])
        if table is not None:  # the largest chunk sum, once
            memory += float(problem.chunk_term(np.array([sums.max()]), np.array([stage]))[0])
        if memory <= problem.memory_limit_bytes and (best is None or time < best[0]):
            best = (time, memory, assignment)
    return None if best is None else (best[2], best[0], best[1])


def plan_for_counts(problem: BalanceProblem, counts: tuple[int, ...]) -> Plan | None:
    """The best recompute for a placement (``knapsack`` per stage; ``dealt_knapsack`` where
    stages hold several chunks), or None if a stage cannot fit."""
    solve_stage = knapsack if problem.chunks_per_stage == 1 else dealt_knapsack
    recompute = [""] * problem.num_layers
    for stage in range(problem.pp):
        solved = solve_stage(problem, counts, stage)
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
        if not even_chunks(problem, counts):
            continue
        plan = plan_for_counts(problem, counts)
        if plan is None:
            continue
        cost = evaluate(problem, plan)
        if best is None or cost.step_s < best[1].step_s - 1e-12:
            best = (plan, cost)
    return best


def solve_heuristic(problem: BalanceProblem) -> tuple[Plan, PlanCost] | None:
    """A good plan fast, never slower than uniform placement with one recompute option on every
    layer, and None only if no plan fits.

    One chunk per stage: the DP over stages of about L / V layers (``solve_dp`` with
    ``HEURISTIC_WINDOW``), which falls back to the exact DP when nothing there fits. Several
    chunks per stage: with one layer kind the DP over stage totals near uniform
    (``ndplan.balance.chunks``); with a short leading run of another kind (dense layers before
    MoE ones) the same DP tracking that run (``ndplan.balance.prefix``); else the periodic-plan
    DP with a greedy knapsack (``ndplan.balance.rounds``).
    """
    return with_uniform(problem, _heuristic(problem))


def _heuristic(problem: BalanceProblem) -> tuple[Plan, PlanCost] | None:
    if one_chunk_per_stage(problem):
        return solve_dp(problem, window=HEURISTIC_WINDOW)
    if one_layer_kind(problem):
        return solve_chunks(problem, window=CHUNKS_WINDOW)
    found = solve_prefixed(problem) if leading_run(problem) is not None else solve_rounds(problem)
    return found if found is not None else _milp_dealt(problem, FALLBACK_MILP_SECONDS, node_limit=FALLBACK_MILP_NODES)


def with_uniform(problem: BalanceProblem, found: tuple[Plan, PlanCost] | None) -> tuple[Plan, PlanCost] | None:
    """``found`` or the uniform placement under one recompute option on every layer, whichever
    is faster among those that fit by ``evaluate`` (ties to ``found``).

    One definition of "fits" for what a solver returns: ``evaluate``'s, memory ≤ the limit. The
    solvers search under the limit less a hair (``STEP_MARGIN``, ``chunks``' and ``rounds``'
    1e-9 of it) so that their float sums never land a plan just over it; a uniform plan whose
    peak is the limit itself (a limit set to a uniform plan's estimated peak) then fell outside
    their search: "no plan fits" though uniform full recompute fits (Llama-3.1-8B pp8 vpp4 at
    its uniform full-recompute peak), or a plan slower than a uniform one that fits. Checking
    the uniform plans by ``evaluate`` itself makes the promise hold whatever the margins."""
    best = found if found is not None and found[1].fits else None
    if problem.num_layers < problem.num_virtual_stages:  # a virtual stage would be empty
        return best
    counts = uniform_counts(problem)
    index = cost_index(problem)
    codes = np.array([[index[(kind, option)] for kind in problem.layer_kinds] for option in problem.options])
    # One pass for every option (the same sums as ``evaluate`` of each).
    costs = evaluate_codes_many(problem, counts, cost_columns(problem), codes)
    for option, cost in zip(problem.options, costs, strict=True):
        if cost.fits and (best is None or cost.step_s < best[1].step_s):
            best = (Plan(counts, (option,) * problem.num_layers), cost)
    return best


def exact_method(problem: BalanceProblem) -> str:
    """Which exact solver ``solve_exact`` runs on ``problem``: "dp" (one chunk per stage, one
    layer kind, or a leading run of another kind) or "milp"."""
    dp = one_chunk_per_stage(problem) or one_layer_kind(problem) or leading_run(problem) is not None
    return "dp" if dp else "milp"


def solve_exact(problem: BalanceProblem, time_limit_s: float = 10.0) -> tuple[Plan, PlanCost] | None:
    """The best plan, or None if none fits: the exact DP without interleaving
    (``ndplan.balance.dp``), with one layer kind (over even chunks with dealt options,
    ``ndplan.balance.chunks``) or with a leading run of another kind (the same,
    ``prefix.solve_prefixed_exact``); else the MILP's placement (``solve_milp``) with its
    recompute dealt, or the heuristic's plan if faster. The MILP is exact for its relaxation
    only (options free per chunk), and HiGHS stops at ``time_limit_s``: ``solve_milp_bounded``
    gives the bound that measures how far the answer can be from the optimum.
    """
    if one_chunk_per_stage(problem):
        return with_uniform(problem, solve_dp(problem))
    if one_layer_kind(problem):
        return with_uniform(problem, solve_chunks(problem))
    if leading_run(problem) is not None:
        return with_uniform(problem, solve_prefixed_exact(problem))
    fallback = solve_heuristic(problem)  # with the uniform plans that fit
    # The heuristic's step as a cutoff: HiGHS prunes every branch that cannot beat it.
    found = _milp_dealt(problem, time_limit_s, None if fallback is None else fallback[1].step_s)
    candidates = [c for c in (found, fallback) if c is not None and c[1].fits]
    return min(candidates, key=lambda c: c[1].step_s) if candidates else None


#: Where the heuristic's plans of several kinds all fail to fit, the MILP's placement, bounded by
#: the branch-and-bound nodes HiGHS explores, so that the same problem gets the same plan however
#: busy the machine (a time limit of 1 s gave DeepSeek-V2-Lite over pp 8 with ZB-V at 0.45 of its
#: memory 14.86 s on one run and 19.35 s on the next); the seconds only stop a root relaxation
#: that takes that long.
FALLBACK_MILP_NODES = 2000
FALLBACK_MILP_SECONDS = 10.0


def _milp_dealt(problem: BalanceProblem, time_limit_s: float, cutoff_s: float | None = None,
                node_limit: int | None = None) -> tuple[Plan, PlanCost] | None:
    """The MILP's placement with each stage's options dealt over its chunks (the MILP frees
    them per chunk), or None."""
    from ndplan.balance.rounds import _Greedy, _plan_of

    found = solve_milp_bounded(problem, time_limit_s, cutoff_s, node_limit)[0]
    return None if found is None else _plan_of(problem, _Greedy(problem), found[0].stage_layers)


def solve_milp(problem: BalanceProblem, time_limit_s: float = 10.0) -> tuple[Plan, PlanCost] | None:
    """The MILP's plan (``solve_milp_bounded``), or None."""
    return solve_milp_bounded(problem, time_limit_s)[0]


def solve_milp_bounded(problem: BalanceProblem, time_limit_s: float = 10.0, cutoff_s: float | None = None,
                       node_limit: int | None = None) -> tuple[tuple[Plan, PlanCost] | None, float]:
    """The MILP's plan (or None) and HiGHS' proven lower bound of the optimal step in seconds
    (the optimum itself when it finished within ``time_limit_s``), which measures how far any
    plan, the heuristic's included, can be from the optimum. With ``cutoff_s`` (a known plan's
    step) only plans faster than it are sought; if none exists the plan is None and the bound
    is ``cutoff_s`` itself: that plan is optimal.

    The MILP. Variables: k[v, g, r] (layers of kind g on v with option r), a[s] (stage s
    recomputes something), o[s, r] (stage s runs option r, where options hold bytes of their
    own once per stage: ``BalanceProblem.option_charges``), c[s] (GiB, where chunks hold bytes
    of their own: at least 0 and each chunk's sum less the offset, ``BalanceProblem.chunk_term``),
    Z (the largest stage time), and what places the kinds. Objective:
    (m − 1/v)·Z + (1/v)·Σ_s T_s (``problem.composed_step_s``); a stage's chunks carry loads
    within one of each other (``even_chunks``: layers weighed by kind, plus the embedding's or
    head's units; a binary per chunk lets it exceed when it holds a single layer). Options are
    free per chunk here, a relaxation of dealing them (``chunks.dealt_chunks``): the MILP's
    optimum and HiGHS' bound lie at or below the dealt optimum, and ``solve_exact`` deals the
    MILP placement's recompute afresh.
    Placing the kinds:

    * one kind: nothing, the counts k place it;
    * two runs (K layers of one kind, then the other, as dense-then-MoE models): the first
      kind's layers up to v are min(layers up to v, K), linearised with one binary b[v]:
      A_v ≤ C_v, A_v ≤ K, A_v ≥ C_v − L·b[v], A_v ≥ K − L·(1 − b[v]);
    * otherwise y[l, v] (layer l on virtual stage v), contiguous and in order.

    Optimal unless HiGHS hits ``time_limit_s`` or explores ``node_limit`` branch-and-bound nodes
    (then its incumbent, or None); also the tests' cross-check of the DP.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    L, V, R = problem.num_layers, problem.num_virtual_stages, len(problem.options)
    kinds = sorted(set(problem.layer_kinds))
    G = len(kinds)
    homogeneous = G == 1
    runs = 1 + sum(a != b for a, b in zip(problem.layer_kinds, problem.layer_kinds[1:], strict=False))
    two_runs = runs == 2
    in_flight = problem.in_flight_of_virtual()
    n_y, n_k = (0 if homogeneous or two_runs else L * V), V * G * R
    P = problem.pp
    v_chunks = problem.chunks_per_stage
    n_b = V if two_runs else 0
    units = end_units(problem)
    unit = [layer_units(problem).get(kind, 1.0) for kind in kinds]  # a layer's load by kind
    spread = load_spread(problem)
    relaxed = list(range(V)) if v_chunks > 1 else []  # chunks that may hold a single heavy layer
    charges = problem.option_charges()  # [pp, R] each option's bytes, once on a stage where it runs
    n_o = P * R if problem.has_option_charges else 0
    n_m = P if problem.has_chunk_terms else 0
    n = n_y + n_k + P + n_b + len(relaxed) + n_o + n_m + 1
    z = n - 1

    def boundary(v: int) -> int:
        return n_y + n_k + P + v

    def single(v: int) -> int:  # binary: chunk v holds a single layer (may exceed the others' load)
        return n_y + n_k + P + n_b + v

    def any_recompute(stage: int) -> int:
        return n_y + n_k + stage

    def runs_option(stage: int, r: int) -> int:  # binary: some layer on the stage runs option r
        return n_y + n_k + P + n_b + len(relaxed) + stage * R + r

    def chunk_term(stage: int) -> int:  # GiB: the stage's largest chunk sum less its offset, at least 0
        return n_y + n_k + P + n_b + len(relaxed) + n_o + stage

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

    if homogeneous or two_runs:  # every virtual stage holds at least one layer; all layers are placed
        for v in range(V):
            add({k(v, g, r): 1.0 for g in range(G) for r in range(R)}, 1, L)
        add({k(v, g, r): 1.0 for v in range(V) for g in range(G) for r in range(R)}, L, L)
    if two_runs:  # the first run's kind fills the first K layers: A_v = min(C_v, K)
        first = kinds.index(problem.layer_kinds[0])
        K = problem.layer_kinds.index(next(kind for kind in problem.layer_kinds if kind != problem.layer_kinds[0]))
        for v in range(V):
            upto = {k(u, g, r): 1.0 for u in range(v + 1) for g in range(G) for r in range(R)}  # C_v
            first_upto = {k(u, first, r): 1.0 for u in range(v + 1) for r in range(R)}  # A_v
            add({**first_upto, **{i: c - first_upto.get(i, 0.0) for i, c in upto.items()}}, 0, np.inf)  # C_v − A_v ≥ 0
            add(first_upto, -np.inf, K)
            add({**{i: first_upto.get(i, 0.0) - c for i, c in upto.items()}, boundary(v): float(L)}, 0, np.inf)
            add({**first_upto, boundary(v): -float(L)}, K - L, np.inf)
    elif not homogeneous:
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
    layer_extra = problem.layer_extra(kinds)  # [pp, G, R]
    chunk_table = problem.chunk_bytes(kinds)  # [pp, v, G, R]
    for s in range(problem.pp):
        memory: dict[int, float] = {}
        time: dict[int, float] = {z: -1.0}
        fixed_memory = float(problem.fixed_bytes[s])
        fixed_time = 0.0
        for virtual in (int(i) for i in np.flatnonzero(problem.stage_of == s)):
            for g, kind in enumerate(kinds):
                for r, option in enumerate(problem.options):
                    cost = problem.costs[(kind, option)]
                    memory[k(virtual, g, r)] = (cost.static_bytes + in_flight[virtual] * cost.activation_bytes
                                                + float(layer_extra[s, g, r]))
                    time[k(virtual, g, r)] = cost.time_s
                    objective[k(virtual, g, r)] += cost.time_s / v_chunks
            for end, extra in ((0, problem.first_extra), (V - 1, problem.last_extra)):
                if virtual == end:
                    fixed_memory += extra.static_bytes + in_flight[virtual] * extra.activation_bytes
                    fixed_time += extra.time_s
        memory[any_recompute(s)] = problem.recompute_transient(s)
        if n_o:
            for r in range(R):
                memory[runs_option(s, r)] = float(charges[s, r])
        if n_m:  # the largest chunk sum: at or over each chunk's, less the offset
            memory[chunk_term(s)] = 2.0**30
            for virtual in (int(i) for i in np.flatnonzero(problem.stage_of == s)):
                chunk = int(problem.chunk_of[virtual])
                add({**{k(virtual, g, r): float(chunk_table[s, chunk, g, r]) / 2**30 for g in range(G) for r in range(R)},
                     chunk_term(s): -1.0}, -np.inf, float(problem.chunk_offset[s]) / 2**30)
        # In GiB: rows of ~1e9 coefficients next to ~1 ones make HiGHS stop at suboptimal
        # "optimal" points (seen on 25-layer instances, 13 % off the DP's optimum).
        add({i: c / 2**30 for i, c in memory.items()}, -np.inf, (problem.memory_limit_bytes - fixed_memory) / 2**30)
        add(time, -np.inf, -fixed_time)
        room = problem.step_room()
        if room is not None:  # the optimizer step's peak: the stage's layers, whatever they recompute
            step_bytes = problem.step_bytes_of(kinds)
            add({k(virtual, g, r): step_bytes[g] / 2**30 for virtual in (int(i) for i in np.flatnonzero(problem.stage_of == s))
                 for g in range(G) for r in range(R)}, -np.inf, float(room[s]) / 2**30)
        for virtual in (int(i) for i in np.flatnonzero(problem.stage_of == s)):
            for g in range(G):
                for r, option in enumerate(problem.options):
                    if option != "none":  # a recomputed layer on s switches the stage's transient on
                        add({k(virtual, g, r): 1.0, any_recompute(s): -float(L)}, -np.inf, 0)
                        if n_o:  # and its option's own bytes
                            add({k(virtual, g, r): 1.0, runs_option(s, r): -float(L)}, -np.inf, 0)
    objective[z] = problem.num_micro_batches - 1 / v_chunks
    for s in range(problem.pp):  # a stage's chunk loads within one of each other (even_chunks)
        for a, b in permutations((int(i) for i in np.flatnonzero(problem.stage_of == s)), 2):
            # load_a − load_b ≤ spread, or a holds one layer: n_a ≤ 1 + L·(1 − single_a)
            row = {**{k(a, g, r): unit[g] for g in range(G) for r in range(R)},
                   **{k(b, g, r): -unit[g] for g in range(G) for r in range(R)},
                   single(a): -(L * max(unit) + float(units[a]))}
            add(row, -np.inf, spread - float(units[a]) + float(units[b]))
    for a in relaxed:
        add({**{k(a, g, r): 1.0 for g in range(G) for r in range(R)}, single(a): float(L)}, -np.inf, 1 + L)
    # The objective leaves out the embedding's and head's seconds, a constant (1/v)·(t_first + t_last).
    ends = (problem.first_extra.time_s + problem.last_extra.time_s) / v_chunks
    if cutoff_s is not None:
        add({i: c for i, c in enumerate(objective) if c}, -np.inf, cutoff_s - ends - 1e-9 * cutoff_s)
    integrality = np.ones(n)
    integrality[z] = 0
    integrality[n - 1 - n_m:n - 1] = 0  # the chunk terms are continuous
    bounds = Bounds(np.zeros(n), np.concatenate([np.ones(n_y), np.full(n_k, L), np.ones(P), np.ones(n_b),
                                                 np.ones(len(relaxed)), np.ones(n_o), np.full(n_m, np.inf), [np.inf]]))
    result = milp(
        objective, constraints=LinearConstraint(np.array(rows), lower, upper), integrality=integrality,
        bounds=bounds, options={"time_limit": time_limit_s, **({"node_limit": node_limit} if node_limit else {})},
    )
    dual = getattr(result, "mip_dual_bound", None)
    lower_bound = float(dual) + ends if dual is not None and np.isfinite(dual) else 0.0
    if cutoff_s is not None and result.status == 2:  # infeasible: nothing beats the cutoff
        return None, cutoff_s
    if result.x is None:
        return None, lower_bound
    x = np.round(result.x).astype(int)
    if homogeneous or two_runs:
        counts = tuple(int(sum(x[k(v, g, r)] for g in range(G) for r in range(R))) for v in range(V))
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
    return (plan, evaluate(problem, plan)), lower_bound


def least_peak_plan(problem: BalanceProblem, rel_tol: float = 1e-4) -> tuple[Plan, PlanCost] | None:
    """The plan of the least peak the solvers find, whatever the problem's limit: what a limit
    too small for every plan would have to be raised to. A plan's bytes do not depend on the
    limit, so whether a plan fits is monotone in it: bisection on the limit, from the least
    peak of the uniform plans (each option on every layer) down, each step the exact DP (or,
    where the exact solver is the MILP, the periodic-plan heuristic with the uniform plans, as
    the MILP takes seconds a call), until the interval is within ``rel_tol`` of its top. The
    returned cost is evaluated under the problem's own limit (so ``fits`` may be False).
    None where the model has fewer layers than virtual stages.

    Llama-3.1-8B tp2 pp4 at 28 GiB: no plan fits and uniform full recompute needs 30.46 GiB,
    but [8, 9, 9, 6] with mixed recompute fits 29 GiB; this finds 28.24 GiB."""
    if problem.num_layers < problem.num_virtual_stages:
        return None
    counts = uniform_counts(problem)
    index = cost_index(problem)
    codes = np.array([[index[(kind, option)] for kind in problem.layer_kinds] for option in problem.options])
    uniform = evaluate_codes_many(problem, counts, cost_columns(problem), codes)
    r = int(np.argmin([float(cost.stage_memory_bytes.max()) for cost in uniform]))
    best = (Plan(counts, (problem.options[r],) * problem.num_layers), uniform[r])
    high, low = float(uniform[r].stage_memory_bytes.max()), 0.0

    def solve(limited: BalanceProblem) -> tuple[Plan, PlanCost] | None:
        if exact_method(limited) == "dp":
            return solve_exact(limited)
        return with_uniform(limited, solve_rounds(limited))

    while high - low > rel_tol * high:
        middle = (low + high) / 2
        found = solve(replace(problem, memory_limit_bytes=middle))
        if found is None or not found[1].fits:
            low = middle
        else:
            best, high = found, float(found[1].stage_memory_bytes.max())
    return best[0], evaluate(problem, best[0])
