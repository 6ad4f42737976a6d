"""The optimizer step's peak in the balancer: every solver keeps it under the limit, the exact
ones still equal brute force, and built problems reproduce the estimator where it is the peak."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ndplan.balance import evaluate, solve_brute_force, solve_exact, solve_heuristic, uniform_plan
from ndplan.balance.dp import solve_dp
from ndplan.balance.solve import solve_milp
from ndplan.errors import NdplanError
from test_balance_dp import random_problem
from test_balance_rounds import check_exact_dp_and_heuristic, chunked_problem

GIB = 2**30


def with_step(problem, seed, spare_layers):
    """The problem with an optimizer step that binds: each stage's layers may weigh there as
    much as ⌈L/pp⌉ + its ``spare_layers`` of the heaviest kind."""
    rng = np.random.default_rng(seed)
    kinds = sorted(set(problem.layer_kinds))
    step_layer = {kind: problem.costs[(kind, "none")].static_bytes * rng.uniform(1.0, 1.6) for kind in kinds}
    heaviest = max(step_layer.values())
    room = heaviest * (-(-problem.num_layers // problem.pp) + np.asarray(spare_layers)[: problem.pp] + 0.5)
    return replace(problem, step_fixed_bytes=problem.memory_limit_bytes - room, step_layer_bytes=step_layer)


def assert_step_fits(problem, plan):
    """The plan's layers fit at the optimizer step, counted plainly."""
    held = np.zeros(problem.pp)
    layer = 0
    for virtual, count in enumerate(plan.stage_layers):
        for kind in problem.layer_kinds[layer:layer + count]:
            held[problem.stage_of[virtual]] += problem.step_layer_bytes[kind]
        layer += count
    assert np.all(problem.step_fixed_bytes + held <= problem.memory_limit_bytes)


spare = st.lists(st.integers(-1, 2), min_size=5, max_size=5)


@settings(max_examples=80, deadline=None)
@given(kinds=st.lists(st.sampled_from(["dense", "moe"]), min_size=3, max_size=9), pp=st.integers(2, 4),
       limit_gib=st.floats(4, 30), seed=st.integers(0, 10_000), m=st.sampled_from([1, 4, 16]), spare_layers=spare)
def test_dp_and_milp_keep_the_step_and_equal_brute_force(kinds, pp, limit_gib, seed, m, spare_layers):
    if len(kinds) < pp:
        return
    problem = with_step(random_problem(kinds, pp, limit_gib, seed=seed, m=m), seed, spare_layers)
    brute, exact, heuristic = solve_brute_force(problem), solve_dp(problem), solve_heuristic(problem)
    assert (brute is None) == (exact is None) == (heuristic is None)
    if brute is None:
        return
    assert exact[1].step_s == pytest.approx(brute[1].step_s, rel=1e-9)
    assert heuristic[1].step_s >= exact[1].step_s * (1 - 1e-9)
    for plan, cost in (exact, heuristic):
        assert cost.fits
        assert_step_fits(problem, plan)
    if len(kinds) <= 7:
        milp = solve_milp(problem)
        assert milp is not None and milp[1].step_s == pytest.approx(brute[1].step_s, rel=1e-6)
        assert_step_fits(problem, milp[0])


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(2, 3), vpp=st.integers(2, 3), extra=st.integers(0, 5), K=st.integers(0, 3),
       schedule=st.sampled_from(["interleaved", "zbv"]), seed=st.integers(0, 10_000), limit_gib=st.floats(3, 40),
       m=st.sampled_from([1, 4, 16]), spare_layers=spare)
def test_interleaved_solvers_keep_the_step_and_equal_brute_force(pp, vpp, extra, K, schedule, seed, limit_gib, m,
                                                                  spare_layers):
    """One layer kind (``chunks``) or a leading run of another (``prefix``), several chunks per
    stage: the exact DPs equal brute force with the step priced, the heuristics keep it."""
    vpp = vpp if schedule == "interleaved" else 2
    layers = pp * vpp + extra
    kinds = tuple("dense" if i < min(K, pp) else "moe" for i in range(layers))
    problem = with_step(chunked_problem(kinds, pp, vpp, limit_gib, seed=seed, schedule=schedule, m=m), seed,
                        spare_layers)
    found = check_exact_dp_and_heuristic(problem)
    if found is not None:
        for plan, _ in found:
            assert_step_fits(problem, plan)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), limit_gib=st.floats(6, 40), spare_layers=spare)
def test_periodic_heuristic_and_milp_keep_the_step(seed, limit_gib, spare_layers):
    """Kinds in no leading run, several chunks per stage (``rounds`` and the MILP)."""
    kinds = ("moe", "dense") * 6
    problem = with_step(chunked_problem(kinds, 2, 2, limit_gib, seed=seed), seed, spare_layers)
    for found in (solve_heuristic(problem), solve_exact(problem, time_limit_s=5.0)):
        if found is not None:
            assert found[1].fits
            assert_step_fits(problem, found[0])


def test_a_step_that_binds_moves_layers_off_a_stage():
    """Stage 0's optimizer step holds no more than two layers: the plan puts two there, though
    the forward/backward alone would have it hold more (its fixed bytes are least)."""
    problem = random_problem(("dense",) * 8, 2, 40, seed=3, transient=False)
    free = solve_dp(problem)
    layer = problem.costs[("dense", "none")].static_bytes
    step = replace(problem, step_fixed_bytes=np.array([40 * GIB - 2.5 * layer, 0.0]),
                   step_layer_bytes={"dense": layer})
    bound = solve_dp(step)
    assert free is not None and bound is not None
    assert bound[0].stage_layers[0] == 2 < free[0].stage_layers[0]
    assert evaluate(step, bound[0]).stage_memory_bytes[0] == pytest.approx(40 * GIB - 0.5 * layer)


def test_built_problem_reproduces_the_estimator_where_the_optimizer_step_is_the_peak():
    """PyTorch's update holds an fp32 temporary per parameter: with full recompute the optimizer
    step, not the forward/backward, is the peak of Qwen3-8B's end stages (pp4, no DP). The
    uniform plans equal the estimator, and the balanced plan's settings fit by the full
    estimator: the step's bytes move with the layers (before, held fixed, the balancer piled
    layers on a stage whose step then overflowed)."""
    from ndplan.balance import balance, build_problem
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions, estimate
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("qwen3-8b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=4)
    strategy = Strategy(pp=4, num_micro_batches=8, seq_length=2048)
    options = MemoryOptions(runtime="pytorch")
    limit = 47 * GIB
    problem = build_problem(model, strategy, cluster, limit, options)
    for option in ("none", "full"):
        cost = evaluate(problem, uniform_plan(problem, option))
        stages = estimate(model, strategy.with_recompute(option), cluster.device, options=options).stages
        np.testing.assert_allclose(cost.stage_memory_bytes, [s.peak_bytes for s in stages], rtol=1e-9)
    assert stages[0].step_peak_bytes == stages[0].allocated_bytes  # full recompute: the step is the peak
    result = balance(model, strategy, cluster, limit, options)
    assert result.cost.fits and float(result.estimated_stage_bytes.max()) <= limit
    # At 46 GiB the step holds at most 7 layers on an end stage (8: 47.3 GiB by the estimator)
    # and 10 on a middle one (11: 46.5 GiB): 34 of the 36 layers. Nothing fits, whatever the
    # recompute (the step held fixed, 7/11/11/7 was "fitting").
    with pytest.raises(NdplanError, match="no placement and recompute plan fits 46.00 GiB"):
        balance(model, strategy, cluster, 46 * GIB, options)


@pytest.mark.parametrize("kinds,vpp", [
    (("dense",) * 10, 1), (("dense",) * 10, 2), (("dense",) * 2 + ("moe",) * 8, 2), (("moe", "dense") * 5, 2),
])
def test_a_single_option_is_balanced_by_every_solver(kinds, vpp):
    """Activation offload beside interleaving leaves "none" as the only option (Megatron refuses
    selective recompute of what it offloads; full recompute leaves nothing to offload): every
    solver places the layers, none raises (the stage-total DP indexed an empty option axis)."""
    problem = replace(chunked_problem(kinds, 2, vpp, 40, seed=5), options=("none",))
    heuristic, exact = solve_heuristic(problem), solve_exact(problem, time_limit_s=5.0)
    assert heuristic is not None and exact is not None
    assert set(exact[0].recompute) == {"none"} and exact[1].step_s <= heuristic[1].step_s * (1 + 1e-9)
    if vpp == 1 or len(set(kinds)) == 1:
        brute = solve_brute_force(problem)
        assert brute is not None and exact[1].step_s == pytest.approx(brute[1].step_s, rel=1e-9)


def test_built_problem_places_layers_as_the_estimator_did():
    """With the embedding and head counted as layers (Megatron's account-for-embedding/loss), the
    estimator's uniform stages hold 9/10/9/8 layers of Qwen3-8B, not 9/9/9/9: the fixed bytes
    come off that placement, so the balancer's stages equal the estimator's for any placement
    (before, a plan 'fitting' 46.5 GiB had its last stage at 47.29 GiB by the estimator)."""
    from ndplan.balance import build_problem
    from ndplan.balance.build import plan_stage_bytes
    from ndplan.balance.problem import Plan
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("qwen3-8b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=4)
    options = MemoryOptions(runtime="pytorch")
    flagged = Strategy(pp=4, num_micro_batches=8, seq_length=2048, embedding_as_layer=True, output_as_layer=True)
    # A strategy's own uneven placement is where it starts, not what the fixed bytes come from
    # (the estimator priced the uniform one: taking them off 10/8/8/10 made them negative).
    uneven = Strategy(pp=4, num_micro_batches=8, seq_length=2048, stage_layers=(10, 8, 8, 10))
    for strategy in (flagged, uneven):
        problem = build_problem(model, strategy, cluster, 80 * GIB, options)
        for counts in ((9, 9, 9, 9), (8, 10, 11, 7), (7, 11, 11, 7)):
            for option in ("none", "full"):
                plan = Plan(counts, (option,) * 36)
                np.testing.assert_allclose(evaluate(problem, plan).stage_memory_bytes,
                                           plan_stage_bytes(model, strategy, plan, options), rtol=1e-9)


def test_a_step_that_cannot_bind_is_left_out():
    """Megatron's update keeps no temporaries: the step (static bytes) never exceeds the
    forward/backward, so the problem carries no step and the solvers skip its masks; PyTorch's
    fp32 temporary can make it the peak, so there it stays."""
    from ndplan.balance import build_problem
    from ndplan.balance.problem import step_never_binds
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model, strategy = get_preset("qwen3-8b"), Strategy(pp=4, num_micro_batches=8, seq_length=2048)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=4)
    megatron = build_problem(model, strategy, cluster, 80 * GIB, MemoryOptions(runtime="megatron"))
    pytorch = build_problem(model, strategy, cluster, 80 * GIB, MemoryOptions(runtime="pytorch"))
    assert megatron.step_fixed_bytes is None and megatron.step_layer_bytes is None
    assert pytorch.step_fixed_bytes is not None and not step_never_binds(pytorch)
    # The rule itself: a layer whose step bytes exceed what it holds through the backward binds.
    bound = with_step(random_problem(("dense",) * 8, 2, 40, seed=1), 1, [0, 0])
    assert not step_never_binds(bound)
    loose = replace(bound, step_fixed_bytes=np.zeros(2), step_layer_bytes={"dense": 0.0})
    assert step_never_binds(loose)
