"""Several chunks per stage: the periodic-plan heuristic, its greedy knapsack, and the MILP."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ndplan.balance import (
    BalanceProblem,
    LayerCost,
    Plan,
    evaluate,
    exact_method,
    knapsack,
    plan_for_counts,
    solve_brute_force,
    solve_exact,
    solve_heuristic,
    solve_milp_bounded,
    uniform_plan,
)
from ndplan.balance.problem import composed_step_s, end_units, even_chunks
from ndplan.balance.rounds import _Greedy, _plan_of, solve_rounds
from ndplan.balance.solve import dealt_knapsack
from ndplan.schedule import model_chunk_table

GIB = 2**30


def chunked_problem(kinds, pp, vpp, limit_gib, *, seed=0, m=8, schedule="interleaved", shuffle=False):
    """Random costs on an interleaved or V-shaped pipeline; chunks hold fewer micro-batches in
    flight the later they run, as in the schedules."""
    rng = np.random.default_rng(seed)
    costs = {}
    for kind in sorted(set(kinds)):
        base_t, act, static = rng.uniform(1, 2), rng.uniform(0.5, 1.5) * GIB, rng.uniform(0.3, 1.0) * GIB
        for i, option in enumerate(("none", "selective", "full")):
            if shuffle:
                time, activation = base_t * rng.uniform(0.9, 1.5), act * rng.uniform(0.02, 1.2)
            else:
                time, activation = base_t * (1 + 0.15 * i * i), act * 0.45**i
            costs[(kind, option)] = LayerCost(time, activation, static)
    table = model_chunk_table(schedule, pp, vpp)
    stage_of = np.empty(pp * vpp, dtype=np.int64)
    chunk_of = np.empty(pp * vpp, dtype=np.int64)
    for s, chunks in enumerate(table):
        for c, virtual in enumerate(chunks):
            stage_of[virtual], chunk_of[virtual] = s, c
    flight = np.array([[pp - s + (vpp - 1 - c) * pp for c in range(vpp)] for s in range(pp)], dtype=float)
    return BalanceProblem(
        layer_kinds=tuple(kinds), options=("none", "selective", "full"), costs=costs,
        stage_of=stage_of, chunk_of=chunk_of, peak_in_flight=flight, num_micro_batches=m,
        first_extra=LayerCost(0.3, 0.1 * GIB, 1.0 * GIB), last_extra=LayerCost(rng.uniform(0.5, 3.0), 1.0 * GIB, 1.0 * GIB),
        fixed_bytes=rng.uniform(0.3, 1.0, pp) * GIB, memory_limit_bytes=limit_gib * GIB,
        recompute_transient_bytes=rng.uniform(0.1, 0.6, pp) * GIB,
    )


def best_admissible(problem):
    """The optimum the solvers aim at: every even-chunk placement (brute force) and the uniform
    placement, each with the exact knapsack per stage; None if nothing fits."""
    found = [f for f in (solve_brute_force(problem),) if f is not None]
    uniform = plan_for_counts(problem, uniform_plan(problem, "none").stage_layers)
    if uniform is not None:
        found.append((uniform, evaluate(problem, uniform)))
    return min(found, key=lambda f: f[1].step_s) if found else None


def is_uniform(problem, plan):
    return plan.stage_layers == uniform_plan(problem, "none").stage_layers


def check_exact_stages(problem, counts) -> int:
    """The heuristic's exact recompute per stage (``rounds._exact_stages``) on the placement
    ``counts`` (layers per virtual stage) against ``solve.dealt_knapsack``: a plan where and only
    where the reference finds one, at its time. Returns how many stages had one."""
    from ndplan.balance.rounds import _exact_stages, _Greedy
    from ndplan.balance.solve import dealt_knapsack

    greedy = _Greedy(problem)
    held = np.zeros((problem.pp, problem.chunks_per_stage, len(greedy.kinds)), dtype=np.int64)
    layer = 0
    for virtual, count in enumerate(counts):
        for kind in problem.layer_kinds[layer:layer + count]:
            held[problem.stage_of[virtual], problem.chunk_of[virtual], greedy.kinds.index(kind)] += 1
        layer += count
    mixes, found = _exact_stages(problem, greedy, held)
    checked = 0
    for stage in range(problem.pp):
        reference = dealt_knapsack(problem, counts, stage)
        assert bool(found[stage]) == (reference is not None)
        if reference is not None:
            checked += 1
            seconds = greedy.base_time[stage] + float((mixes[stage].sum(axis=0) * greedy.time).sum())
            assert seconds == pytest.approx(reference[1], rel=1e-12)
    return checked


def check_knapsacks(problem, counts) -> int:
    """The per-stage references (``solve.knapsack`` and ``dealt_knapsack``) on the placement
    ``counts``: each best assignment's memory is what ``evaluate`` gives its plan. Returns how
    many assignments were found."""
    from ndplan.balance import Plan, evaluate
    from ndplan.balance.solve import dealt_knapsack, knapsack

    checked = 0
    for stage in range(problem.pp):
        for solve_stage in (knapsack, dealt_knapsack):
            found = solve_stage(problem, counts, stage)
            if found is None:
                continue
            assignment, _, memory = found
            recompute = ["none"] * problem.num_layers
            for layer, option in assignment.items():
                recompute[layer] = option
            checked += 1
            assert memory == pytest.approx(
                evaluate(problem, Plan(tuple(counts), tuple(recompute))).stage_memory_bytes[stage], rel=1e-12)
    return checked


def check_exact_dp_and_heuristic(problem):
    """The exact DP equals the brute-force optimum (even chunks, or the uniform placement) and
    the heuristic fits and is never better than it: (exact, heuristic), or None if nothing fits."""
    assert exact_method(problem) == "dp"
    best, exact = best_admissible(problem), solve_exact(problem)
    assert (best is None) == (exact is None)
    if exact is None:
        assert solve_heuristic(problem) is None
        return None
    assert exact[1].fits and (even_chunks(problem, exact[0].stage_layers) or is_uniform(problem, exact[0]))
    assert exact[1].step_s == pytest.approx(best[1].step_s, rel=1e-9)
    found = solve_heuristic(problem)
    assert found is not None and found[1].fits and found[1].step_s >= exact[1].step_s * (1 - 1e-9)
    return exact, found


def test_composed_step_is_the_interleaved_bubble():
    """(m − 1/v)·max + (1/v)·Σ: for equal stages, m·T + (pp − 1)·T/v, the textbook interleaved step."""
    problem = chunked_problem(("dense",) * 8, 2, 2, 100)
    assert composed_step_s(problem, np.array([3.0, 3.0])) == pytest.approx(8 * 3.0 + 1 * 3.0 / 2)
    one_chunk = chunked_problem(("dense",) * 8, 2, 1, 100)
    assert composed_step_s(one_chunk, np.array([3.0, 2.0])) == pytest.approx(5.0 + 7 * 3.0)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv", "dualpipev"])
def test_simulated_step_is_no_shorter_than_a_stages_work(schedule):
    """A stage computes one thing at a time: the simulated step is at least m times its time
    per micro-batch. DualPipeV was simulated with a forward and a backward overlapped as
    max(F, B+W) (compute hiding compute, which the step-time model refuses): 77% of the
    busiest stage's work on random chunk times, and on Llama-3.1-8B tp2 pp4 DualPipeV (m 64,
    under 31 GiB) 2.329 s for a plan whose busiest stage computes 3.34 s (``balance`` printed
    "the pipeline simulator gives 3.069 s → 2.329 s")."""
    from ndplan.balance import simulated_step_s

    problem = chunked_problem(("dense",) * 16, 4, 2, 1000, m=16, schedule=schedule, shuffle=True)
    for plan in (uniform_plan(problem, "none"), Plan((2, 2, 2, 2, 2, 2, 3, 1), ("full",) * 8 + ("none",) * 8)):
        work = problem.num_micro_batches * float(evaluate(problem, plan).stage_time_s.max())
        assert simulated_step_s(problem, plan, schedule) >= work * (1 - 1e-12)


def test_balance_simulates_dualpipev_without_overlapping_compute():
    from ndplan.balance import balance
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory.options import MemoryOptions
    from ndplan.strategy import Strategy

    strategy = Strategy(tp=2, pp=4, vpp=2, schedule="dualpipev", num_micro_batches=64)
    result = balance("llama-3.1-8b", strategy, Cluster(device=get_device("h100-sxm"), num_devices=8), 31 * GIB,
                     MemoryOptions(runtime="megatron"))
    for (_, cost), simulated in zip((result.baseline, (result.plan, result.cost)), result.simulated_s, strict=True):
        work = 64 * float(cost.stage_time_s.max())
        assert work * (1 - 1e-12) <= simulated <= cost.step_s * 1.05  # composed: within 5% above


def test_even_chunks():
    problem = chunked_problem(("dense",) * 12, 2, 3, 100)  # virtual stages 0, 2, 4 on stage 0
    problem = BalanceProblem(**{**problem.__dict__, "last_extra": LayerCost(0.0, 0.0, 0.0)})
    assert even_chunks(problem, (2, 2, 2, 2, 2, 2)) and even_chunks(problem, (2, 1, 3, 2, 2, 2))
    assert not even_chunks(problem, (1, 2, 3, 2, 2, 2))  # stage 0 holds 1, 3 and 2


def test_head_counts_as_layers_in_even_chunks():
    """A head as slow as two layers: the last chunk holds two layers fewer than its stage's
    others, or a single layer when they hold too few."""
    problem = chunked_problem(("dense",) * 12, 2, 2, 100)
    layer_s = problem.costs[("dense", "none")].time_s
    problem = BalanceProblem(**{**problem.__dict__, "last_extra": LayerCost(2 * layer_s, 0.0, 0.0),
                                "first_extra": LayerCost(0.1 * layer_s, 0.0, 0.0)})
    assert end_units(problem).tolist() == [0, 0, 0, 2]
    assert even_chunks(problem, (3, 4, 3, 2)) and not even_chunks(problem, (3, 3, 3, 3))
    assert not even_chunks(problem, (5, 5, 1, 1))  # stage 1 carries loads 5 and 3
    assert not even_chunks(problem, (4, 5, 1, 2))  # stage 0 carries 4 and 1
    small = chunked_problem(("dense",) * 4, 2, 2, 100)
    small = BalanceProblem(**{**small.__dict__, "last_extra": LayerCost(5 * layer_s, 0.0, 0.0)})
    assert even_chunks(small, (1, 1, 1, 1))  # the head's chunk cannot hold less than one layer
    # The exact DP puts two layers fewer on the head's chunk.
    plenty = BalanceProblem(**{**problem.__dict__, "memory_limit_bytes": 1e15})
    plan, _ = solve_exact(plenty)
    assert even_chunks(plenty, plan.stage_layers) and plan.stage_layers[3] <= plan.stage_layers[1] - 1


@settings(max_examples=80, deadline=None)
@given(layers=st.integers(2, 9), vpp=st.integers(2, 3), limit_gib=st.floats(4, 40), seed=st.integers(0, 10_000),
       shuffle=st.booleans(), moe_from=st.integers(0, 3))
def test_greedy_stage_cost_fits_and_is_close_to_the_exact_knapsack(layers, vpp, limit_gib, seed, shuffle, moe_from):
    """The greedy never breaks memory, and its time is at least the exact knapsack's and at most
    one move of one layer above it (the rounded-up linear relaxation)."""
    pp = 2
    kinds = tuple("dense" if i < moe_from else "moe" for i in range(layers * pp * vpp))
    problem = chunked_problem(kinds, pp, vpp, limit_gib, seed=seed, shuffle=shuffle)
    counts = uniform_plan(problem, "none").stage_layers
    greedy = _Greedy(problem)
    per_chunk = np.zeros((pp, vpp, len(greedy.kinds)), dtype=np.int64)
    for virtual, count in enumerate(counts):
        first = sum(counts[:virtual])
        for kind in kinds[first:first + count]:
            per_chunk[problem.stage_of[virtual], problem.chunk_of[virtual], greedy.kinds.index(kind)] += 1
    times, *_ = greedy.solve(np.arange(pp), per_chunk)
    move = max(abs(c.time_s - d.time_s) for c in problem.costs.values() for d in problem.costs.values())
    for stage in range(pp):
        exact = knapsack(problem, counts, stage)
        if exact is None:
            assert times[stage] == np.inf
        else:
            assert exact[1] - 1e-9 <= times[stage] <= exact[1] + move + 1e-9
    # The plan deals each kind's options over the chunks (even chunk times): each stage's least
    # time so dealt, as the layer-by-layer reference finds it.
    found = _plan_of(problem, greedy, counts)
    dealt = [dealt_knapsack(problem, counts, stage) for stage in range(pp)]
    if any(d is None for d in dealt):
        assert found is None
    else:
        assert found is not None and found[1].fits
        for stage in range(pp):
            assert found[1].stage_time_s[stage] == pytest.approx(dealt[stage][1], rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(4, 10), pp=st.integers(2, 3), limit_gib=st.floats(4, 40), seed=st.integers(0, 10_000),
       schedule=st.sampled_from(["interleaved", "zbv"]), moe_from=st.integers(0, 3), m=st.sampled_from([1, 4, 16]))
def test_heuristic_fits_keeps_chunks_even_and_beats_uniform(layers, pp, limit_gib, seed, schedule, moe_from, m):
    vpp = 2
    if layers < pp * vpp:
        return
    kinds = tuple("dense" if i < moe_from else "moe" for i in range(layers))
    problem = chunked_problem(kinds, pp, vpp, limit_gib, seed=seed, schedule=schedule, m=m)
    assert exact_method(problem) == ("dp" if moe_from <= pp else "milp")  # one kind, or a leading run
    found = solve_heuristic(problem)
    uniform = [evaluate(problem, uniform_plan(problem, o)) for o in problem.options]
    best = best_admissible(problem)
    if found is None:
        assert not any(u.fits for u in uniform) and best is None
        return
    plan, cost = found
    assert cost.fits and sum(plan.stage_layers) == layers and min(plan.stage_layers) >= 1
    assert even_chunks(problem, plan.stage_layers) or is_uniform(problem, plan)
    if any(u.fits for u in uniform):
        assert cost.step_s <= min(u.step_s for u in uniform if u.fits) + 1e-9
    assert best is not None and cost.step_s >= best[1].step_s - 1e-9


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kinds,limit", [(("dense",) * 8, 12), (("dense", "dense", "moe", "moe", "moe", "moe", "moe"), 10)])
def test_milp_relaxation_bounds_the_dealt_optimum(kinds, limit, seed, schedule):
    """The MILP frees options per chunk, a relaxation of dealing them: its optimum and HiGHS'
    bound lie at or below the dealt optimum brute force finds, and its plan keeps chunks even.
    The exact solver's answer is dealt, never slower than the heuristic's; where a DP is exact
    (one layer kind, or a leading run of another) it is the optimum."""
    problem = chunked_problem(kinds, 2, 2, limit, seed=seed, schedule=schedule)
    best, exact = best_admissible(problem), solve_exact(problem)
    milp, lower_bound = solve_milp_bounded(problem)
    assert (best is None) == (exact is None)
    if milp is not None:
        assert even_chunks(problem, milp[0].stage_layers)
        assert lower_bound <= milp[1].step_s * (1 + 1e-9)
    if best is None:
        return
    brute = solve_brute_force(problem)
    if brute is not None:
        assert milp is not None and milp[1].step_s <= brute[1].step_s * (1 + 1e-6)
        assert lower_bound <= brute[1].step_s * (1 + 1e-9)
    assert exact[1].fits and exact[1].step_s <= solve_heuristic(problem)[1].step_s + 1e-9
    assert exact[1].step_s >= best[1].step_s * (1 - 1e-9)  # dealt: never below the dealt optimum
    if exact_method(problem) == "dp":
        assert exact[1].step_s == pytest.approx(best[1].step_s, rel=1e-9)
    assert even_chunks(problem, exact[0].stage_layers) or is_uniform(problem, exact[0])


def test_periodic_plan_moves_layers_off_a_slow_last_stage():
    """Plenty of memory, a slow head on the last stage: the rounds DP (two layer kinds) moves
    layers off the last stage in every round, which uniform placement cannot."""
    problem = chunked_problem(("dense",) * 2 + ("moe",) * 22, 3, 2, 1000, seed=1)
    problem = BalanceProblem(**{**problem.__dict__, "last_extra": LayerCost(6.0, 0.0, 0.0)})
    plan, cost = solve_rounds(problem)
    counts = np.array(plan.stage_layers).reshape(2, 3)  # [round, stage]
    assert even_chunks(problem, plan.stage_layers) and counts[:, 2].sum() < counts[:, 0].sum()
    assert counts[1, 2] < counts[0, 2]  # the head's chunk gives layers to its stage's other chunk
    assert set(plan.recompute) == {"none"}
    assert cost.step_s < evaluate(problem, uniform_plan(problem, "none")).step_s


def test_leftover_layers_go_to_the_last_round():
    """L = v·R + r: the r leftover layers sit in the last round, so chunks stay even."""
    problem = chunked_problem(("dense",) + ("moe",) * 12, 3, 2, 1000, seed=2)
    plan, _ = solve_rounds(problem)
    assert sum(plan.stage_layers) == 13 and even_chunks(problem, plan.stage_layers)


def test_heuristic_matches_the_milp_closely_on_a_real_interleaved_model():
    from ndplan.balance import build_problem
    from ndplan.hardware import Cluster, get_device
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("llama-3.1-8b")
    strategy = Strategy(dp=4, tp=2, pp=4, vpp=2, schedule="interleaved", num_micro_batches=16, seq_length=8192,
                        recompute="full")
    device = get_device("h100-sxm")
    problem = build_problem(model, strategy, Cluster(device=device, num_devices=32), 40 * GIB)
    heuristic, exact = solve_heuristic(problem), solve_exact(problem, time_limit_s=30)
    assert heuristic is not None and exact is not None and heuristic[1].fits
    assert exact[1].step_s <= heuristic[1].step_s <= exact[1].step_s * 1.03
    assert heuristic[1].step_s < evaluate(problem, uniform_plan(problem, "full")).step_s


def test_plan_of_keeps_model_order_of_kinds():
    problem = chunked_problem(("dense", "dense", "moe", "moe", "moe", "moe", "moe", "moe"), 2, 2, 1000)
    plan, _ = _plan_of(problem, _Greedy(problem), (2, 2, 2, 2))
    assert isinstance(plan, Plan) and plan.recompute == ("none",) * 8


@settings(max_examples=80, deadline=None)
@given(layers=st.integers(4, 11), pp=st.integers(1, 3), vpp=st.integers(2, 3), limit_gib=st.floats(3, 40),
       seed=st.integers(0, 10_000), m=st.sampled_from([1, 4, 16]), shuffle=st.booleans(), v_shape=st.booleans())
def test_one_kind_dp_equals_brute_force_over_even_chunks(layers, pp, vpp, limit_gib, seed, m, shuffle, v_shape):
    """One layer kind, several chunks per stage: the DP over stage totals is exact (brute force
    over every even-chunk placement with the exact knapsack per stage); its window heuristic
    fits, is never better than it and never slower than uniform."""
    schedule = "zbv" if v_shape else "interleaved"
    if v_shape:
        vpp = 2
    if layers < pp * vpp:
        return
    problem = chunked_problem(("dense",) * layers, pp, vpp, limit_gib, seed=seed, m=m, schedule=schedule,
                              shuffle=shuffle)
    solved = check_exact_dp_and_heuristic(problem)
    if solved is None:
        return
    _, found = solved
    for option in problem.options:
        uniform = evaluate(problem, uniform_plan(problem, option))
        if uniform.fits:
            assert found[1].step_s <= uniform.step_s + 1e-9


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 8), (4, 2, 16), (4, 3, 8), (3, 4, 12)])
def test_composed_step_of_even_plans_follows_the_simulator(pp, vpp, m):
    """The plans the solvers return (even chunks, options dealt) compose within 8% of the
    pipeline simulator on interleaved 1F1B; a plan piling a stage's layers into one chunk does
    not, which is why the solvers keep chunks even."""
    from ndplan.balance import simulated_step_s

    kinds = ("dense",) * (pp * vpp * 3)
    for seed in range(3):
        problem = chunked_problem(kinds, pp, vpp, 1000, seed=seed, m=m)
        for plan, cost in (solve_heuristic(problem), solve_exact(problem)):
            assert even_chunks(problem, plan.stage_layers)
            assert cost.step_s == pytest.approx(simulated_step_s(problem, plan, "interleaved"), rel=0.08)
    problem = chunked_problem(kinds, pp, vpp, 1000, m=m)
    piled = [1] * (pp * vpp)
    piled[-pp:] = [1 + 2 * (vpp - 1) + 1] * pp  # the last round takes every layer the others gave up
    piled[-1] += len(kinds) - sum(piled)
    plan = Plan(tuple(piled), ("none",) * len(kinds))
    assert not even_chunks(problem, plan.stage_layers)
    assert evaluate(problem, plan).step_s < 0.9 * simulated_step_s(problem, plan, "interleaved")


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(4, 40), pp=st.integers(1, 4), vpp=st.integers(2, 4), limit_gib=st.floats(3, 60),
       seed=st.integers(0, 10_000), shuffle=st.booleans())
def test_one_kind_least_bottleneck_without_a_dp_equals_the_dp(layers, pp, vpp, limit_gib, seed, shuffle):
    """Stage costs that never fall with the total: Z* read off the costs equals the min-max DP's."""
    from ndplan.balance.chunks import _stage_costs
    from ndplan.balance.dp import Table, _min_max_monotone, min_max

    if layers < pp * vpp:
        return
    problem = chunked_problem(("dense",) * layers, pp, vpp, limit_gib, seed=seed, shuffle=shuffle)
    totals = np.arange(vpp, layers - (pp - 1) * vpp + 1)
    least = _stage_costs(problem, totals)[0]
    if not (least[:, 1:] >= least[:, :-1]).all():
        return
    position = np.arange(layers + 1)
    table = Table(np.maximum(position[None] - totals[:, None], 0),
                  np.where(position[None, None] >= totals[None, :, None], least[:, :, None], np.inf), totals)
    assert _min_max_monotone(least, int(totals[0]), layers) == min_max(table)
