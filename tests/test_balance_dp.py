"""The exact DP (no interleaving) against brute force and the MILP; the heuristic's guarantees."""

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
    solve_dp,
    solve_heuristic,
    solve_milp,
    uniform_plan,
)
from ndplan.balance.dp import _segments, _StageModel
from ndplan.balance.solve import HEURISTIC_WINDOW

GIB = 2**30


def random_problem(kinds, pp, limit_gib, *, seed=0, m=8, options=("none", "selective", "full"), vpp=1,
                   transient=True, shuffle_costs=False, vary_static=False):
    """Random costs; with ``shuffle_costs`` the options are not ordered by time or memory, with
    ``vary_static`` their static bytes differ too (as offloading would)."""
    rng = np.random.default_rng(seed)
    costs = {}
    for kind in sorted(set(kinds)):
        base_t, act, static = rng.uniform(1, 2), rng.uniform(0.5, 1.5) * GIB, rng.uniform(0.3, 1.0) * GIB
        for i, option in enumerate(options):
            if shuffle_costs:
                time, activation = base_t * rng.uniform(0.9, 1.5), act * rng.uniform(0.02, 1.2)
            else:
                time, activation = base_t * (1 + 0.15 * i * i), act * 0.45**i
            costs[(kind, option)] = LayerCost(time, activation, static * (rng.uniform(0.6, 1.0) if vary_static else 1.0))
    virtual = pp * vpp
    return BalanceProblem(
        layer_kinds=tuple(kinds), options=tuple(options), costs=costs,
        stage_of=np.array([v % pp for v in range(virtual)]), chunk_of=np.array([v // pp for v in range(virtual)]),
        peak_in_flight=np.array([[max(1, pp - s) for _ in range(vpp)] for s in range(pp)], dtype=float),
        num_micro_batches=m, first_extra=LayerCost(0.3, 0.1 * GIB, 1.0 * GIB),
        last_extra=LayerCost(rng.uniform(0.5, 3.0), 1.0 * GIB, 1.0 * GIB),
        fixed_bytes=rng.uniform(0.3, 1.0, pp) * GIB, memory_limit_bytes=limit_gib * GIB,
        recompute_transient_bytes=rng.uniform(0.1, 0.6, pp) * GIB if transient else None,
    )


kinds_strategy = st.lists(st.sampled_from(["dense", "moe"]), min_size=3, max_size=10)


@settings(max_examples=120, deadline=None)
@given(kinds=kinds_strategy, pp=st.integers(1, 4), limit_gib=st.floats(3, 30), seed=st.integers(0, 10_000),
       m=st.sampled_from([1, 2, 8, 64]), shuffle=st.booleans(), transient=st.booleans(), vary=st.booleans())
def test_dp_equals_brute_force(kinds, pp, limit_gib, seed, m, shuffle, transient, vary):
    if len(kinds) < pp:
        return
    problem = random_problem(kinds, pp, limit_gib, seed=seed, m=m, shuffle_costs=shuffle, transient=transient,
                             vary_static=vary)
    assert exact_method(problem) == "dp"
    brute, exact = solve_brute_force(problem), solve_dp(problem)
    assert (brute is None) == (exact is None)
    if exact is not None:
        assert exact[1].fits and np.all(exact[1].stage_memory_bytes <= problem.memory_limit_bytes)
        assert exact[1].step_s == pytest.approx(brute[1].step_s, rel=1e-9)
        assert sum(exact[0].stage_layers) == len(kinds) and min(exact[0].stage_layers) >= 1


@pytest.mark.parametrize("options", [("none",), ("none", "full"), ("full", "none", "selective"),
                                     ("none", "selective", "full", "offload")])
@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_for_other_option_sets(options, seed):
    kinds = ("dense", "moe", "moe", "dense", "moe", "moe", "moe", "moe")
    for limit in (6, 9, 14):
        problem = random_problem(kinds, 3, limit, seed=seed, options=options, shuffle_costs=seed % 2 == 1)
        brute, exact = solve_brute_force(problem), solve_dp(problem)
        assert (brute is None) == (exact is None)
        if exact is not None:
            assert exact[1].fits
            assert exact[1].step_s == pytest.approx(brute[1].step_s, rel=1e-9)


@pytest.mark.parametrize("kinds,pp,limit,m", [
    (("dense",) * 40, 8, 16, 32),
    (("dense",) * 3 + ("moe",) * 27, 6, 14, 16),
    (("moe",) * 25, 5, 12, 4),
    (("dense", "moe") * 12, 4, 22, 8),  # interleaved kinds: segments mix both all along
])
def test_dp_equals_milp_on_larger_problems(kinds, pp, limit, m):
    """scipy's MILP (HiGHS) as an independent cross-check where brute force is out of reach."""
    for seed in range(3):
        problem = random_problem(kinds, pp, limit, seed=seed, m=m)
        milp, exact = solve_milp(problem, time_limit_s=60), solve_dp(problem)
        assert (milp is None) == (exact is None)
        if exact is not None:
            assert exact[1].fits
            assert exact[1].step_s == pytest.approx(milp[1].step_s, rel=1e-6)  # HiGHS' own tolerance


@settings(max_examples=60, deadline=None)
@given(kinds=kinds_strategy, pp=st.integers(1, 4), limit_gib=st.floats(3, 30), seed=st.integers(0, 10_000),
       shuffle=st.booleans())
def test_stage_costs_equal_the_reference_knapsack(kinds, pp, limit_gib, seed, shuffle):
    """Every segment's cost in the DP is the least stage time ``knapsack`` finds (+inf: none fits)."""
    if len(kinds) < pp:
        return
    problem = random_problem(kinds, pp, limit_gib, seed=seed, shuffle_costs=shuffle)
    L, V = len(kinds), pp
    seg = _segments(_StageModel(problem), problem, np.arange(1, L - V + 2))
    assert seg is not None
    for v in range(V):
        for length in range(1, L - V + 2):
            for b in range(v + length, L - (V - 1 - v) + 1):
                if (v == 0 and b != length) or (v == V - 1 and b != L):
                    continue  # the first stage starts at layer 0, the last ends at L
                # Segment [b − length, b) on v; one layer on each other stage but the ones next to it.
                before = [1] * v
                if v:
                    before[-1] = b - length - (v - 1)
                after = [1] * (V - 1 - v)
                if after:
                    after[0] = L - b - (V - 2 - v)
                reference = knapsack(problem, (*before, length, *after), v)
                cost = seg.cost[v, length - 1, b]
                if reference is None:
                    assert cost == np.inf
                else:
                    assert cost == pytest.approx(reference[1], rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(kinds=kinds_strategy, pp=st.integers(1, 4), limit_gib=st.floats(3, 30), seed=st.integers(0, 10_000),
       m=st.sampled_from([1, 8, 64]), shuffle=st.booleans())
def test_heuristic_fits_and_is_never_slower_than_uniform(kinds, pp, limit_gib, seed, m, shuffle):
    if len(kinds) < pp:
        return
    problem = random_problem(kinds, pp, limit_gib, seed=seed, m=m, shuffle_costs=shuffle)
    found, exact = solve_heuristic(problem), solve_dp(problem)
    assert (found is None) == (exact is None)  # finds a plan whenever one exists
    if found is None:
        return
    plan, cost = found
    assert cost.fits and np.all(cost.stage_memory_bytes <= problem.memory_limit_bytes)
    assert cost.step_s >= exact[1].step_s - 1e-9
    uniform = plan_for_counts(problem, uniform_plan(problem, "none").stage_layers)
    if uniform is not None:  # uniform placement with its best recompute per stage
        assert cost.step_s <= evaluate(problem, uniform).step_s + 1e-9


def test_heuristic_falls_back_to_the_full_search_outside_its_window():
    """A heavy head on the last stage: every plan that fits puts far fewer layers there than
    L / V, outside the heuristic's window, so it must fall back to the full search."""
    problem = random_problem(("dense",) * 48, 4, 20, seed=3)
    problem = BalanceProblem(**{**problem.__dict__, "last_extra": LayerCost(0.5, 1.0 * GIB, 12.0 * GIB)})
    exact = solve_dp(problem)
    assert exact is not None and exact[0].stage_layers[-1] < 48 // 4 - HEURISTIC_WINDOW
    found = solve_heuristic(problem)
    assert found is not None and found[1].fits and found[1].step_s == pytest.approx(exact[1].step_s, rel=1e-12)


def test_dp_refuses_interleaved_problems():
    with pytest.raises(ValueError, match="one virtual stage per physical stage"):
        solve_dp(random_problem(("dense",) * 8, 2, 12, vpp=2))


def test_more_stages_than_layers_has_no_plan():
    problem = random_problem(("dense",) * 3, 4, 30)
    assert solve_dp(problem) is None and solve_heuristic(problem) is None


def test_evaluate_rejects_a_plan_of_the_wrong_size():
    problem = random_problem(("dense",) * 6, 2, 30)
    with pytest.raises(ValueError, match="places 5 layers"):
        evaluate(problem, Plan((2, 3), ("none",) * 5))


def test_memory_exactly_at_the_limit_fits_with_the_fewest_recomputed_layers():
    """Binary-exact bytes: 4 layers of 2 GiB under 7 GiB need exactly two selective layers
    (8 − 2 × 0.5 = 7); the closed form must neither round that up to three nor call it over."""
    costs = {("dense", "none"): LayerCost(1.0, 1.0 * GIB, 1.0 * GIB),
             ("dense", "selective"): LayerCost(1.25, 0.5 * GIB, 1.0 * GIB),
             ("dense", "full"): LayerCost(1.5, 0.25 * GIB, 1.0 * GIB)}
    problem = BalanceProblem(
        layer_kinds=("dense",) * 8, options=("none", "selective", "full"), costs=costs,
        stage_of=np.array([0, 1]), chunk_of=np.array([0, 0]), peak_in_flight=np.ones((2, 1)), num_micro_batches=4,
        first_extra=LayerCost(0.0, 0.0, 0.0), last_extra=LayerCost(0.0, 0.0, 0.0), fixed_bytes=np.zeros(2),
        memory_limit_bytes=7.0 * GIB,
    )
    exact, brute = solve_dp(problem), solve_brute_force(problem)
    assert exact is not None and brute is not None
    assert exact[0].stage_layers == (4, 4) and exact[0].recompute.count("selective") == 4
    assert exact[1].fits and exact[1].stage_memory_bytes.max() == 7.0 * GIB
    assert exact[1].step_s == brute[1].step_s


def test_batches_cut_under_the_cell_budget_give_the_same_plan(monkeypatch):
    """A tiny cell budget forces one stage query pair per batch: same answer as one batch."""
    from ndplan.balance import dp

    for kinds in (("dense",) * 14, ("dense", "moe") * 7, ("dense",) * 3 + ("moe",) * 11):
        problem = random_problem(kinds, 3, 20, seed=5, m=16)
        whole = solve_dp(problem)
        monkeypatch.setattr(dp, "_CHUNK", 1)
        cut = solve_dp(problem)
        monkeypatch.undo()
        assert whole is not None and cut is not None
        assert cut[0] == whole[0] and cut[1].step_s == whole[1].step_s


@pytest.mark.parametrize("m", [2, 8, 64])
def test_exact_search_pruned_by_the_heuristic_keeps_the_optimum(m):
    """Kinds interleaved all along (the costly case for the stage table): the pruned exact
    search equals the MILP."""
    problem = random_problem(("dense", "moe") * 15, 5, 24, seed=11, m=m)
    exact, milp = solve_dp(problem), solve_milp(problem, time_limit_s=120)
    assert exact is not None and milp is not None
    assert exact[1].step_s == pytest.approx(milp[1].step_s, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(kinds=kinds_strategy, pp=st.integers(1, 3), limit_gib=st.floats(3, 30), seed=st.integers(0, 10_000),
       shuffle=st.booleans(), m=st.sampled_from([1, 8]), vary=st.booleans())
def test_dropping_dominated_minor_splits_keeps_the_optimum(kinds, pp, limit_gib, seed, shuffle, m, vary):
    """With every minor split list pruned (normally only long ones are), still brute force's optimum."""
    from ndplan.balance import dp

    if len(kinds) < pp:
        return
    problem = random_problem(kinds, pp, limit_gib, seed=seed, m=m, shuffle_costs=shuffle, vary_static=vary)
    brute = solve_brute_force(problem)
    previous = dp._PRUNE_FROM
    dp._PRUNE_FROM = 0
    try:
        exact = solve_dp(problem)
    finally:
        dp._PRUNE_FROM = previous
    assert (brute is None) == (exact is None)
    if exact is not None:
        assert exact[1].fits and exact[1].step_s == pytest.approx(brute[1].step_s, rel=1e-9)


@pytest.mark.parametrize("vary_static", [False, True])
def test_undominated_splits_are_a_pareto_front(vary_static):
    """Every dropped split is matched or beaten on time, static and activation bytes by a kept
    one that recomputes exactly when it does; no kept split is beaten so (among splits of
    equal static bytes, which is all of them unless the options' static bytes differ)."""
    problem = random_problem(("dense",) * 2 + ("moe",) * 20, 2, 30, seed=4, shuffle_costs=True,
                             vary_static=vary_static)
    model = _StageModel(problem)
    g = model.kinds.index("dense")
    for count in (12, 20):  # over _PRUNE_FROM splits
        every = np.array([s for s in np.ndindex(*(count + 1,) * 3) if sum(s) == count])
        kept = model._undominated(g, count)
        assert len(every) > 64 and len(kept) <= len(every)
        def measures(splits):
            return np.stack([splits @ model.time[g], splits @ model.static[g], splits @ model.activation[g]], axis=1)
        flag_all, flag_kept = (every @ model.recomputes) > 0, (kept @ model.recomputes) > 0
        m_all, m_kept = measures(every), measures(kept)
        slack = 1e-12 * np.abs(m_all).max(axis=0)  # sums of equal bytes may differ in the last bit
        for measure, flag in zip(m_all, flag_all, strict=True):
            assert np.any(np.all(m_kept <= measure + slack, axis=1) & (flag_kept == flag))
        for i, (measure, flag) in enumerate(zip(m_kept, flag_kept, strict=True)):
            beaten = (np.all(m_all <= measure + slack, axis=1) & np.any(m_all < measure - slack, axis=1)
                      & (flag_all == flag) & (np.abs(m_all[:, 1] - measure[1]) <= slack[1]))
            assert not beaten.any(), i


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(2, 24), pp=st.integers(1, 6), limit_gib=st.floats(3, 40), seed=st.integers(0, 10_000),
       shuffle=st.booleans(), window=st.sampled_from([None, 1, 2]))
def test_least_bottleneck_without_a_dp_equals_the_dp(layers, pp, limit_gib, seed, shuffle, window):
    """One layer kind: Z* by counting the lengths under each threshold equals the min-max DP."""
    from ndplan.balance import dp

    if layers < pp:
        return
    problem = random_problem(("dense",) * layers, pp, limit_gib, seed=seed, shuffle_costs=shuffle)
    L, V = layers, pp
    lengths = (np.arange(1, L - V + 2) if window is None
               else np.arange(max(1, L // V - window), min(L - V + 1, -(-L // V) + window) + 1))
    seg = _segments(_StageModel(problem), problem, lengths)
    if seg is None:
        return
    assert seg.query is None  # the one-kind layout, where the shortcut applies
    by_dp = dp._min_max(dp._Segments(**{**seg.__dict__, "query": np.zeros(1, dtype=np.int64)}))
    assert dp._min_max(seg) == by_dp


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31 - 1), st.integers(0, 40))
def test_totals_table_gives_the_plain_tables_answers(V, shortest, J, seed, weight):
    """``TotalsTable`` (costs by stage and length, wherever the step starts) runs the same DP as
    the ``Table`` it stands for: the same Z*, sums, splits and threshold search, ties included
    (costs drawn from a few values, some +inf)."""
    from ndplan.balance.dp import Table, TotalsTable, min_max, min_sum, threshold_search

    rng = np.random.default_rng(seed)
    lengths = np.arange(shortest, shortest + J)
    L = int(rng.integers(V * shortest, V * (shortest + J - 1) + 2))
    cost = rng.choice([0.5, 1.0, 1.5, 2.0, 0.1 + 0.2, 0.3, np.inf], size=(V, J))
    position = np.arange(L + 1)
    start = np.maximum(position[None] - lengths[:, None], 0)
    plain = Table(start, np.where(position[None, None] >= lengths[None, :, None], cost[:, :, None], np.inf), lengths,
                  cost[np.isfinite(cost)])
    totals = TotalsTable(cost, lengths, L, cost[np.isfinite(cost)])
    z_star = min_max(plain)
    assert min_max(totals) == z_star
    for bound in (np.inf, z_star, 1.0):
        assert min_sum(totals, bound) == min_sum(plain, bound)
    if np.isfinite(z_star):
        assert threshold_search(totals, weight, z_star) == threshold_search(plain, weight, z_star)
