"""Fast balancing with several chunks per stage when a few layers of one kind lead the model
(dense layers before MoE ones: DeepSeek-V3's first three, DeepSeek-V2-Lite's first one).

Plans are given, as in ``ndplan.balance.chunks``, by each stage's total T with its chunks'
loads as even as they go (``_split``; a leading layer weighs its kind's seconds). Where a layer
sits now matters, but only for the K leading layers,
and they all fall in the first round of chunks (virtual stages 0 … pp − 1, one per stage, K ≤ pp
and every chunk holds a layer): walking the stages in that order, a stage's first chunk takes
δ = min(n₀, K − a) of them, where n₀ is the layers of that chunk and a those already placed
(n₀ depends on δ, as the cheap leading layers make room for more of the others).
So a stage's cost depends on (stage, T, δ) and the DP runs over positions (b, a), b layers and
a ≤ K leading layers placed, with steps (T, δ): from (b − T, a − δ) to (b, a), valid where
δ = n₀ (and a ≤ K) or δ < n₀ and a = K (the leading run ended inside the chunk). The DP is
``threshold_search`` over the stage costs of the greedy knapsack (``rounds._Greedy``); the
chosen placement is evened out where the split misjudged a load (``rounds._even_out``) and
gets each stage's least-time dealt recompute; the uniform placement with one option on every
layer stays a candidate (with a mix of options too, when the DP finds nothing). A heuristic: the greedy's stage costs and the even split are not exact with two
layer kinds (``solve_exact`` runs the MILP).
"""

from __future__ import annotations

import numpy as np

from ndplan.balance.chunks import WINDOW
from ndplan.balance.dp import StagedTable, min_max, threshold_search
from ndplan.balance.problem import BalanceProblem, Plan, PlanCost, end_units, layer_units
from ndplan.balance.rounds import _even_out, _Greedy, _plan_of, uniform_candidates


def leading_run(problem: BalanceProblem) -> int | None:
    """K when the layers are K of one kind then only another, with 1 ≤ K ≤ pp; else None."""
    kinds = problem.layer_kinds
    K = next((i for i, kind in enumerate(kinds) if kind != kinds[0]), len(kinds))
    if K == len(kinds) or any(kind != kinds[K] for kind in kinds[K:]) or K > problem.pp:
        return None
    return K


def solve_prefixed(problem: BalanceProblem, window: int = WINDOW) -> tuple[Plan, PlanCost] | None:
    """The heuristic plan (module docstring), or None if neither it nor a uniform plan fits."""
    K = leading_run(problem)
    if K is None:
        raise ValueError("solve_prefixed needs a leading run of at most pp layers of one kind")
    greedy = _Greedy(problem)
    found = uniform_candidates(problem, greedy, mixed=False)
    for width in (window, problem.num_layers):  # near uniform first; every total if nothing fits
        counts = _placement(problem, greedy, K, width)
        planned = None if counts is None else _plan_of(problem, greedy, _even_out(problem, counts))
        if planned is not None:
            found.append(planned)
            break
    else:  # nothing near or far: the uniform placement with a mix of options may still fit
        found = uniform_candidates(problem, greedy)
    return min(found, key=lambda f: f[1].step_s) if found else None


def _placement(problem: BalanceProblem, greedy: _Greedy, K: int, window: int) -> tuple[int, ...] | None:
    """Layers per virtual stage of the DP's split (module docstring), or None if none fits."""
    L, pp, v = problem.num_layers, problem.pp, problem.chunks_per_stage
    if L < pp * v:
        return None
    shortest, longest = v, L - (pp - 1) * v
    totals = np.arange(max(shortest, L // pp - window * v), min(longest, -(-L // pp) + window * v) + 1)
    stages = np.asarray(problem.stage_of[:pp])  # round 0 runs stage stages[i] at position i
    first_chunk = np.asarray(problem.chunk_of[:pp])
    deltas = np.arange(K + 1)
    rest_layers = _split(problem, stages, first_chunk, totals, deltas)  # [pp, J, K + 1, v] of the rest kind
    n0 = deltas[None, None, :] + np.take_along_axis(rest_layers, first_chunk[:, None, None, None], axis=3)[..., 0]
    lead, rest = greedy.kinds.index(problem.layer_kinds[0]), greedy.kinds.index(problem.layer_kinds[-1])
    # Queries (position, total, δ): the rest kind as split, δ leading layers in the first chunk.
    held = np.zeros((*rest_layers.shape, len(greedy.kinds)), dtype=np.int64)
    held[..., rest] = rest_layers
    position, j, delta = np.indices(rest_layers.shape[:3])
    held[position, j, delta, first_chunk[:, None, None], lead] = delta
    # δ leading layers fit, and leave a layer for every other chunk.
    room = totals[:, None] - deltas[None, :] >= v - (deltas[None, :] > 0)  # [J, K + 1]
    possible = np.broadcast_to(room[None], rest_layers.shape[:3])
    seconds = np.full(possible.shape, np.inf)
    index = np.nonzero(possible)
    seconds[index], *_ = greedy.solve(stages[index[0]], held[index])
    table = _table(seconds, n0, totals, K, L)
    z_star = min_max(table)
    if not np.isfinite(z_star):
        return None
    split = threshold_search(table, problem.num_micro_batches * v - 1, z_star)
    if split is None:
        return None
    per_chunk = np.zeros((pp, v), dtype=np.int64)  # [position, local chunk] layers
    for i, step in enumerate(split):
        total, leading = divmod(int(step), K + 1)
        per_chunk[i] = rest_layers[i, total - int(totals[0]), leading]
        per_chunk[i, first_chunk[i]] += leading
    position_of = {int(stage): i for i, stage in enumerate(stages)}
    return tuple(int(per_chunk[position_of[int(problem.stage_of[virtual])], problem.chunk_of[virtual]])
                 for virtual in range(problem.num_virtual_stages))


def _table(seconds: np.ndarray, n0: np.ndarray, totals: np.ndarray, K: int, L: int) -> StagedTable:
    """The DP over positions (b, a) of the module docstring, from the stage costs ``seconds``
    [pp, J, K + 1] and the layers ``n0`` [pp, J, K + 1] of each first chunk.

    Positions (b, a) are encoded b·(K + 1) + a and a step (T, δ) moves one by T·(K + 1) + δ. While
    leading layers remain, every stage takes at least one (its first chunk holds a layer, and
    δ = 0 is a step only once the run has ended), so after the first K stages a = K on every
    split: the later stages take δ = 0 steps only and run over b alone, a table (K + 1)² times
    smaller with the same splits. The thresholds are every finite stage cost, as the full
    (b, a) table holds each at (L, K)."""
    pp, J = seconds.shape[:2]
    early = min(K, pp)
    P = (L + 1) * (K + 1)
    b_end, a_end = np.divmod(np.arange(P), K + 1)
    deltas = np.arange(K + 1)
    step_total = np.repeat(totals, K + 1)
    step_lead = np.tile(deltas, J)
    lengths = step_total * (K + 1) + step_lead  # [J·(K + 1)]
    start = np.maximum(np.arange(P)[None] - lengths[:, None], 0)
    fits_before = (b_end[None] >= step_total[:, None]) & (a_end[None] >= step_lead[:, None])  # [J', P]
    whole_chunk = (step_lead[None, :] == n0[:early].reshape(early, -1))[:, :, None]  # [early, J', 1]: the run fills the chunk
    run_ended = (a_end == K)[None, None, :]
    valid = fits_before[None] & (whole_chunk | run_ended)
    cost = np.where(valid, seconds[:early].reshape(early, -1)[:, :, None], np.inf)  # [early, J', P]
    starts, costs, steps = [start] * early, list(cost), [lengths] * early
    if pp > early:  # positions b, the leading run placed
        b = np.arange(L + 1)
        later_start = np.maximum(b[None] - totals[:, None], 0)  # [J, L + 1]
        later = np.where(b[None, None] >= totals[None, :, None], seconds[early:, :, :1], np.inf)  # [pp − early, J, L + 1]
        starts += [later_start * (K + 1) + K] + [later_start] * (pp - early - 1)
        costs += list(later)
        steps += [totals * (K + 1)] * (pp - early)
    return StagedTable(P, tuple(starts), tuple(costs), tuple(steps), seconds[np.isfinite(seconds)])


def _split(problem: BalanceProblem, stages: np.ndarray, first_chunk: np.ndarray, totals: np.ndarray,
           deltas: np.ndarray) -> np.ndarray:
    """[pp, J, K + 1, v] layers of the rest kind in each chunk of the stage at each round-0
    position holding T layers, δ of them leading ones in its first chunk: every chunk a layer,
    then each next layer to the chunk of least load (``chunk_loads``: leading layers weigh
    their kind's seconds), ties to the one of fewest micro-batches in flight."""
    pp, v = problem.pp, problem.chunks_per_stage
    units = layer_units(problem)
    lead_unit = units[problem.layer_kinds[0]]
    flight = np.zeros((pp, v))
    flight[problem.stage_of, problem.chunk_of] = problem.in_flight_of_virtual()
    ends = np.zeros((pp, v))
    ends[problem.stage_of, problem.chunk_of] = end_units(problem)
    is_first = np.arange(v)[None, :] == first_chunk[:, None]  # [pp, v]
    shape = (pp, len(deltas), v)  # [position, δ, chunk]
    load = np.broadcast_to((ends[stages] + 0.0)[:, None, :], shape).copy()
    load += np.where(is_first[:, None, :], deltas[None, :, None] * lead_unit, 0.0)
    empty = ~is_first[:, None, :] | (deltas[None, :, None] == 0)  # [pp, K + 1, v] holds no layer yet
    # Placing one layer at a time on the least key (load, then fewest in flight by a tiny
    # tie-break, empty chunks first) takes, of every chunk's run of keys for its 1st, 2nd, …
    # layer (rising: each adds 1 to its load), the least keys overall: sorted, they give the
    # order in which chunks receive layers, whatever T (T − δ of them are taken). The keys are
    # summed as that loop would (+1 at a time), so that they compare alike.
    turns = max(int(totals.max(initial=0)), 1)
    steps = np.ones((*shape, turns))
    steps[..., 0] = load
    rank = np.argsort(np.argsort(flight[stages], axis=1, kind="stable"), axis=1)[:, None, :, None] * 1e-6
    key = np.cumsum(steps, axis=3) + rank  # [pp, K + 1, v, turn]
    key[..., 0] -= 1e9 * empty  # a chunk's first layer, where it holds none yet, comes first
    order = np.argsort(key.reshape(pp, len(deltas), v * turns), axis=2, kind="stable")  # ties to the lower chunk
    receives = order // turns == np.arange(v)[:, None, None, None]  # [v, pp, K + 1, step]: chunk of each step
    given = np.zeros((pp, len(deltas), v * turns + 1, v), dtype=np.int64)  # layers per chunk after each step
    given[:, :, 1:] = np.cumsum(receives, axis=3).transpose(1, 2, 3, 0)
    left = np.clip(totals[:, None] - deltas[None, :], 0, v * turns)  # [J, K + 1] rest layers to place
    rest = given[:, np.arange(len(deltas))[None, :], left]  # [pp, J, K + 1, v]
    return rest


__all__ = ["leading_run", "solve_prefixed"]
