"""A leading run of another layer kind: the chunk split and the staged DP table of ``prefix``
give what their plain definitions give, and its exact DP equals brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ndplan.balance.dp import Table, min_max, threshold_search
from ndplan.balance.prefix import _layout, _split, _table, leading_run
from ndplan.balance.problem import end_units, layer_units
from ndplan.balance.rounds import _Greedy
from test_balance_rounds import check_exact_dp_and_heuristic, chunked_problem


def split_one_at_a_time(problem, stages, first_chunk, totals, deltas):
    """``_split`` by its definition: every chunk a layer, then each next layer to the chunk of
    least load, ties to the one of fewest micro-batches in flight, one layer at a time."""
    pp, v = problem.pp, problem.chunks_per_stage
    lead_unit = layer_units(problem)[problem.layer_kinds[0]]
    flight = np.zeros((pp, v))
    flight[problem.stage_of, problem.chunk_of] = problem.in_flight_of_virtual()
    ends = np.zeros((pp, v))
    ends[problem.stage_of, problem.chunk_of] = end_units(problem)
    out = np.zeros((pp, len(totals), len(deltas), v), dtype=np.int64)
    for i, stage in enumerate(stages.tolist()):
        rank = np.argsort(np.argsort(flight[stage], kind="stable"), kind="stable")
        for j, total in enumerate(totals.tolist()):
            for d, delta in enumerate(deltas.tolist()):
                load = ends[stage].astype(float)
                count = np.zeros(v, dtype=np.int64)
                load[first_chunk[i]] += delta * lead_unit
                count[first_chunk[i]] += delta
                for _ in range(total - delta):
                    key = [(count[c] > 0, load[c], rank[c]) for c in range(v)]
                    c = min(range(v), key=key.__getitem__)
                    out[i, j, d, c] += 1
                    count[c] += 1
                    load[c] += 1
    return out


def prefixed_problem(layers, pp, K, schedule, vpp, seed, limit_gib=40, m=8, shuffle=False):
    kinds = tuple("dense" if i < K else "moe" for i in range(layers))
    return chunked_problem(kinds, pp, vpp, limit_gib, seed=seed, schedule=schedule, shuffle=shuffle, m=m)


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(2, 5), vpp=st.integers(2, 4), extra=st.integers(0, 12), K=st.integers(1, 5),
       schedule=st.sampled_from(["interleaved", "zbv", "dualpipev"]), seed=st.integers(0, 1000))
def test_split_is_water_filling_one_layer_at_a_time(pp, vpp, extra, K, schedule, seed):
    vpp = vpp if schedule == "interleaved" else 2
    K = min(K, pp)
    problem = prefixed_problem(pp * vpp + extra, pp, K, schedule, vpp, seed)
    stages, first_chunk = np.asarray(problem.stage_of[:pp]), np.asarray(problem.chunk_of[:pp])
    totals, deltas = np.arange(vpp, problem.num_layers - (pp - 1) * vpp + 1), np.arange(K + 1)
    found = _split(problem, _Greedy(problem), stages, first_chunk, totals, deltas)
    assert np.array_equal(found, split_one_at_a_time(problem, stages, first_chunk, totals, deltas))
    assert (found.sum(axis=3) == np.maximum(totals[:, None] - deltas[None, :], 0)[None]).all()


def full_table(seconds, n0, totals, K, L):
    """The DP table over positions (b, a) for every stage (the staged table stands for it)."""
    pp, J = seconds.shape[:2]
    P = (L + 1) * (K + 1)
    b_end, a_end = np.divmod(np.arange(P), K + 1)
    step_total, step_lead = np.repeat(totals, K + 1), np.tile(np.arange(K + 1), J)
    lengths = step_total * (K + 1) + step_lead
    start = np.maximum(np.arange(P)[None] - lengths[:, None], 0)
    fits_before = (b_end[None] >= step_total[:, None]) & (a_end[None] >= step_lead[:, None])
    whole_chunk = (step_lead[None, :] == n0.reshape(pp, -1))[:, :, None]
    valid = fits_before[None] & (whole_chunk | (a_end == K)[None, None, :])
    return Table(start, np.where(valid, seconds.reshape(pp, -1)[:, :, None], np.inf), lengths)


@settings(max_examples=80, deadline=None)
@given(pp=st.integers(2, 6), vpp=st.integers(2, 4), extra=st.integers(0, 14), K=st.integers(1, 6),
       schedule=st.sampled_from(["interleaved", "zbv", "dualpipev"]), seed=st.integers(0, 1000),
       limit_gib=st.floats(4, 60), m=st.sampled_from([1, 2, 8]), ties=st.booleans())
def test_staged_table_gives_the_split_of_the_full_table(pp, vpp, extra, K, schedule, seed, limit_gib, m, ties):
    """After the first K stages the leading run is placed, so the staged table (later stages
    over b alone) has the full (b, a) table's least bottleneck and the same optimal split,
    equal splits included (``ties``: stage costs rounded so that many splits tie); so has it
    with the costs of steps the DP never takes left out, as thresholds on demand."""
    check_staged_table(pp, vpp, extra, K, schedule, seed, limit_gib, m, ties)


@pytest.mark.parametrize("pp,vpp,extra,K,schedule,seed,limit_gib,m,ties", [
    (4, 3, 7, 3, "zbv", 232, 29.0, 2, False), (5, 3, 4, 5, "interleaved", 454, 29.7, 2, False),
    (3, 4, 9, 1, "zbv", 926, 56.9, 1, True), (6, 2, 9, 4, "interleaved", 587, 43.1, 1, False),
])
def test_left_out_thresholds_asked_for_where_the_search_has_candidates(pp, vpp, extra, K, schedule, seed, limit_gib,
                                                                       m, ties):
    """Cases whose search has candidates, so that it asks for the left-out steps' thresholds."""
    assert check_staged_table(pp, vpp, extra, K, schedule, seed, limit_gib, m, ties)


def check_staged_table(pp, vpp, extra, K, schedule, seed, limit_gib, m, ties):
    """The staged table's split is the full table's, with or without the left-out steps' costs
    (``_placement``'s table); whether the search asked for their thresholds."""
    vpp = vpp if schedule == "interleaved" else 2
    K = min(K, pp)
    problem = prefixed_problem(pp * vpp + extra, pp, K, schedule, vpp, seed, limit_gib, m)
    assert leading_run(problem) == K
    L = problem.num_layers
    stages, first_chunk = np.asarray(problem.stage_of[:pp]), np.asarray(problem.chunk_of[:pp])
    totals, deltas = np.arange(vpp, L - (pp - 1) * vpp + 1), np.arange(K + 1)
    greedy = _Greedy(problem)
    rest = _split(problem, greedy, stages, first_chunk, totals, deltas)
    n0 = deltas[None, None, :] + np.take_along_axis(rest, first_chunk[:, None, None, None], axis=3)[..., 0]
    held = np.zeros((*rest.shape, 2), dtype=np.int64)
    held[..., 1] = rest
    position, j, delta = np.indices(rest.shape[:3])
    held[position, j, delta, first_chunk[:, None, None], 0] = delta
    seconds, *_ = greedy.solve(np.repeat(stages, rest.shape[1] * rest.shape[2]), held.reshape(-1, vpp, 2))
    seconds = seconds.reshape(rest.shape[:3])
    seconds[:, totals[:, None] - deltas[None, :] < vpp - (deltas[None, :] > 0)] = np.inf  # no room, as _placement
    if ties:
        seconds = np.round(seconds, 0)
    staged = _table(np.where(deltas == n0, seconds, np.inf), seconds, totals, K, L)
    full = full_table(seconds, n0, totals, K, L)
    # As _placement builds it: only the costs the DP reads, the others' thresholds on demand.
    used = _layout(int(totals[0]), len(totals), K, L, pp).used
    read = np.where(used, seconds, np.inf)
    asked = []
    lazy = _table(np.where(deltas == n0, read, np.inf), read, totals, K, L,
                  more_thresholds=lambda: asked.append(True) or seconds[~used & np.isfinite(seconds)])
    z_staged, z_full = min_max(staged), min_max(full)
    assert z_staged == z_full == min_max(lazy)
    if np.isfinite(z_full):
        weight = m * vpp - 1
        expected = threshold_search(full, weight, z_full)
        assert threshold_search(staged, weight, z_staged) == expected
        assert threshold_search(lazy, weight, z_staged) == expected
    return bool(asked)


@settings(max_examples=80, deadline=None)
@given(pp=st.integers(2, 3), vpp=st.integers(2, 3), extra=st.integers(0, 5), K=st.integers(1, 3),
       schedule=st.sampled_from(["interleaved", "zbv", "dualpipev"]), seed=st.integers(0, 10_000),
       limit_gib=st.floats(3, 40), m=st.sampled_from([1, 4, 16]), shuffle=st.booleans())
def test_prefixed_dp_equals_brute_force_over_even_chunks(pp, vpp, extra, K, schedule, seed, limit_gib, m, shuffle):
    """A leading run of another kind, several chunks per stage: the DP over stage totals and the
    run is exact (brute force over every even-chunk placement with the dealt knapsack per stage,
    and the uniform placement); the heuristic fits and is never better than it."""
    vpp = vpp if schedule == "interleaved" else 2
    K = min(K, pp)
    problem = prefixed_problem(pp * vpp + extra, pp, K, schedule, vpp, seed, limit_gib, m, shuffle)
    check_exact_dp_and_heuristic(problem)


def test_prefixed_dp_bound_keeps_the_optimum():
    """The heuristic's step bounds the stage totals the exact DP costs: with the bound lifted
    (every total up to L − (pp − 1)·v) it finds the same optimum."""
    from ndplan.balance import prefix

    problem = prefixed_problem(40, 4, 3, "interleaved", 2, seed=1, limit_gib=20, m=16)  # mixes all options
    bounded = prefix.solve_prefixed_exact(problem)
    assert bounded is not None
    assert prefix._longest_total(problem, 3, prefix.solve_prefixed(problem)[1].step_s) < 40 - 3 * 2
    original = prefix._longest_total
    try:
        prefix._longest_total = lambda problem, K, incumbent_s: problem.num_layers
        free = prefix.solve_prefixed_exact(problem)
    finally:
        prefix._longest_total = original
    assert free is not None and free[1].step_s == pytest.approx(bounded[1].step_s, rel=1e-12)
