"""Balancing with several chunks per stage when a few layers of one kind lead the model (dense
layers before MoE ones: DeepSeek-V3's first three, DeepSeek-V2-Lite's first one): a fast
heuristic and an exact DP.

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
layer stays a candidate (with a mix of options too, when the DP finds nothing). A heuristic: the
greedy's stage costs and the one even split per (T, δ) are not exact with two layer kinds.

``solve_prefixed_exact`` runs the same DP exactly: each step (T, δ) costs the least, over every
even chunk split, of the exact dealt recompute, with the stage totals bounded by the
heuristic's step (its docstring). Tens of milliseconds for DeepSeek-V3 pp8; tests hold it to
brute force.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from math import comb

import numpy as np

from ndplan.balance.chunks import WINDOW
from ndplan.balance.dp import StagedTable, _compositions, min_max, threshold_search
from ndplan.balance.problem import (
    BalanceProblem,
    Plan,
    PlanCost,
    end_units,
    even_chunks,
    layer_units,
    load_spread,
    uniform_counts,
)
from ndplan.balance.rounds import _dealt_mixes, _even_out, _Greedy, _plan_of, _Solved, uniform_candidates


def leading_run(problem: BalanceProblem) -> int | None:
    """K when the layers are K of one kind then only another, with 1 ≤ K ≤ pp; else None."""
    kinds = problem.layer_kinds
    K = next((i for i, kind in enumerate(kinds) if kind != kinds[0]), len(kinds))
    # kinds[K] is not kinds[0]: every one of it lies after K, and they are all of the rest if they fill it.
    if K == len(kinds) or K > problem.pp or kinds.count(kinds[K]) != len(kinds) - K:
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
        placed = _placement(problem, greedy, K, width)
        planned = None if placed is None else _plan_of(problem, greedy, _even_out(problem, greedy, placed[0]), solved=placed[1])
        if planned is not None:
            found.append(planned)
            break
    else:  # nothing near or far: the uniform placement with a mix of options may still fit
        found = uniform_candidates(problem, greedy)
    return min(found, key=lambda f: f[1].step_s) if found else None


def _placement(problem: BalanceProblem, greedy: _Greedy, K: int, window: int) -> tuple[np.ndarray, _Solved] | None:
    """[V] layers per virtual stage of the DP's split (module docstring) and the greedy's answers
    for its stages, or None if none fits."""
    L, pp, v = problem.num_layers, problem.pp, problem.chunks_per_stage
    if L < pp * v:
        return None
    shortest, longest = v, L - (pp - 1) * v
    totals = np.arange(max(shortest, L // pp - window * v), min(longest, -(-L // pp) + window * v) + 1)
    stages = np.asarray(problem.stage_of[:pp])  # round 0 runs stage stages[i] at position i
    first_chunk = np.asarray(problem.chunk_of[:pp])
    deltas = np.arange(K + 1)
    rest_layers = _split(problem, greedy, stages, first_chunk, totals, deltas)  # [pp, J, K + 1, v] of the rest kind
    position = np.arange(pp)
    # [pp, J, K + 1] the first chunk's layers of the rest kind: none where it holds the δ leading
    # layers only (n₀ = δ, the run goes on past it).
    first_rest = rest_layers[position, :, :, first_chunk]
    lead, rest = greedy.kinds.index(problem.layer_kinds[0]), greedy.kinds.index(problem.layer_kinds[-1])
    # Queries (position, total, δ): the rest kind as split, δ leading layers in the first chunk.
    held = np.zeros((*rest_layers.shape, len(greedy.kinds)), dtype=np.int64)
    held[..., rest] = rest_layers
    held[position, :, :, first_chunk, lead] = deltas
    # The queries the DP reads; the others' costs are thresholds only, solved if the search asks.
    queries = _queries(int(totals[0]), len(totals), K, L, pp, v)
    seconds = np.empty(queries.asked.shape)
    seconds.fill(np.inf)
    answers = greedy.solve(stages[queries.asked_at], held[queries.asked])
    seconds[queries.asked] = answers[0]

    def left_out() -> np.ndarray:
        found = greedy.solve(stages[queries.left_at], held[queries.left])[0] if len(queries.left_at) else np.empty(0)
        return found[np.isfinite(found)]

    table = _table(np.where(first_rest == 0, seconds, np.inf), seconds, totals, K, L, whole_in_ended=True,  # δ = n₀
                   more_thresholds=left_out)
    z_star = min_max(table)
    if not np.isfinite(z_star):
        return None
    split = threshold_search(table, problem.num_micro_batches * v - 1, z_star)
    if split is None:
        return None
    total, leading = np.divmod(np.asarray(split), K + 1)
    chosen = (position, total - int(totals[0]), leading)
    # The chosen queries' answers, by stage (round 0 holds each stage once).
    query = queries.index[chosen]
    by_stage = stages.argsort()
    held_by_stage = held[chosen][by_stage]  # [stage, local chunk, kind] layers
    solved = _Solved(held_by_stage, tuple(a[query[by_stage]] for a in answers))
    layers = held_by_stage.sum(axis=2)  # [stage, local chunk], every kind
    return layers[problem.stage_of, problem.chunk_of], solved


@dataclass(frozen=True)
class _Queries:
    """``_placement``'s greedy queries (round-0 position, total, δ), [pp, J, K + 1]: ``asked``
    those with room (δ leading layers fit and leave a layer for every other chunk) whose cost
    the DP reads (``_Layout.used``), ``left`` those with room it never reads, the position of
    each of either in C order (``asked_at``, ``left_at``), and ``index`` each asked query's place
    among them."""

    asked: np.ndarray
    left: np.ndarray
    asked_at: np.ndarray
    left_at: np.ndarray
    index: np.ndarray


@lru_cache(maxsize=256)
def _queries(low: int, J: int, K: int, L: int, pp: int, v: int) -> _Queries:
    """``_Queries`` for totals low … low + J − 1 (read-only; cached, it depends on the integers only)."""
    totals, deltas = np.arange(low, low + J), np.arange(K + 1)
    room = totals[:, None] - deltas[None, :] >= v - (deltas[None, :] > 0)  # [J, K + 1]
    used = _layout(low, J, K, L, pp).used
    asked, left = room & used, room & ~used
    out = _Queries(asked, left, asked.nonzero()[0], left.nonzero()[0], np.cumsum(asked).reshape(asked.shape) - 1)
    for array in (out.asked, out.left, out.asked_at, out.left_at, out.index):
        array.flags.writeable = False
    return out


def _table(whole: np.ndarray, ended: np.ndarray, totals: np.ndarray, K: int, L: int, whole_in_ended: bool = False,
           more_thresholds: Callable[[], np.ndarray] | None = None) -> StagedTable:
    """The DP over positions (b, a) of the module docstring, from each stage's cost [pp, J, K + 1]
    of a step (T, δ) where the leading run goes on past its first chunk (``whole``: δ = n₀, so
    a < K after it) and where it has ended (``ended``: a = K after it); +inf where none fits.
    The steps and positions depend on the integers alone (``_layout``): the costs are gathered
    into them. The thresholds are every finite stage cost, as the full (b, a) table holds each
    (the search takes them as a set: with ``whole_in_ended``, every finite ``whole`` cost is
    also an ``ended`` one, and those suffice), and ``more_thresholds``' where the costs leave
    out steps the DP never takes (``StagedTable``)."""
    layout = _layout(int(totals[0]), len(totals), K, L, whole.shape[0])
    values = np.concatenate([whole.reshape(-1), ended.reshape(-1), [np.inf]])
    # One gather for every stage, then each stage's view: cheaper than a gather per stage.
    flat = values[layout.flat_sources]
    ends = accumulate(source.size for source in layout.sources)
    costs = tuple(flat[end - source.size:end].reshape(source.shape) for end, source in zip(ends, layout.sources, strict=True))
    finite = ended[np.isfinite(ended)]
    if not whole_in_ended:
        finite = np.concatenate([finite, whole[np.isfinite(whole)]])
    return StagedTable(1, layout.starts, costs, layout.lengths, finite, more_thresholds, flat_costs=flat)


@dataclass(frozen=True)
class _Layout:
    """``_table``'s steps and positions per stage: ``starts`` [J_i, P_i] the previous stage's
    position each step to each position starts from, ``sources`` [J_i, P_i] where its cost lies
    in [whole, ended, +inf] flattened (``flat_sources``: all of them laid end to end), ``lengths``
    [J_i] the step each row records, and ``used`` [pp, J, K + 1] the (stage, total, δ) costs any
    step reads, of ``whole`` or ``ended``."""

    starts: tuple[np.ndarray, ...]
    sources: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray, ...]
    used: np.ndarray
    flat_sources: np.ndarray


@lru_cache(maxsize=256)
def _layout(low: int, J: int, K: int, L: int, pp: int) -> _Layout:
    """``_table``'s layout for totals low … low + J − 1 (read-only; cached, it depends on the
    integers only).

    Positions (b, a) are encoded b·(K + 1) + a and a step (T, δ) moves one by T·(K + 1) + δ. While
    leading layers remain, every stage takes at least one (its first chunk holds a layer, and
    δ = 0 is a step only once the run has ended: a = K), so after the first K stages a = K on
    every split: the later stages take δ = 0 steps only and run over b alone, a table (K + 1)²
    times smaller with the same splits. The early stages keep only the positions they can reach
    and the steps they can take (every other cell of the full table is +inf whatever the costs,
    so the DP's values and choices stay the full table's): a step from a < K takes δ ≥ 1
    leading layers (``whole`` where a + δ < K, ``ended`` where a + δ = K), one from a = K takes
    δ = 0 (``ended``). The last stage ends at (L, K), everything placed."""
    early = min(K, pp)
    P = (L + 1) * (K + 1)
    total = np.repeat(np.arange(low, low + J), K + 1)  # per step (T, δ), in the order j·(K + 1) + δ
    delta = np.tile(np.arange(K + 1), J)
    length = total * (K + 1) + delta
    whole_at = np.arange(J * (K + 1))  # flat index of stage 0's (j, δ) cost in ``whole``
    ended_at = pp * J * (K + 1) + whole_at
    void = 2 * pp * J * (K + 1)  # the +inf at the end
    starts, sources, lengths = [], [], []
    before = np.zeros(1, dtype=np.int64)  # encoded positions before the stage: nothing placed
    for i in range(early):
        a = before % (K + 1)
        end = before[None, :] + length[:, None]  # [steps, positions before]
        led = a[None, :] + delta[:, None]  # a after the step
        valid = np.where(a[None, :] < K, (delta[:, None] >= 1) & (led <= K), delta[:, None] == 0) & (end < P)
        if i == pp - 1:  # the last stage: only everything placed
            valid &= end == P - 1
        # A stage that can reach nothing keeps one void step to one position.
        ends = np.unique(end[valid]) if valid.any() else np.array([P - 1])
        rows = np.flatnonzero(valid.any(axis=1)) if valid.any() else np.array([0])
        step, origin = np.nonzero(valid[rows])
        row = rows[step]
        column = np.searchsorted(ends, end[row, origin])
        start = np.zeros((len(rows), len(ends)), dtype=np.int64)
        start[step, column] = origin
        source = np.full((len(rows), len(ends)), void)
        offset = i * J * (K + 1)
        source[step, column] = np.where(led[row, origin] == K, ended_at[row], whole_at[row]) + offset
        starts.append(start)
        sources.append(source)
        lengths.append(length[rows])
        before = ends
    if pp > early:  # positions b, the leading run placed
        totals = np.arange(low, low + J)
        b = np.arange(L + 1)
        later_start = np.maximum(b[None] - totals[:, None], 0)  # [J, L + 1]
        reachable = b[None] >= totals[:, None]
        ended_delta0 = pp * J * (K + 1) + np.arange(J) * (K + 1)  # flat index of stage 0's (j, δ = 0) cost
        # The first later stage enters from the last early stage's positions (b, K).
        entry = np.searchsorted(before, later_start * (K + 1) + K)
        known = reachable & (entry < len(before))
        known[known] = before[entry[known]] == (later_start * (K + 1) + K)[known]
        for i in range(early, pp):
            offset = i * J * (K + 1)
            open_ = known if i == early else reachable
            starts.append(np.where(known, entry, 0) if i == early else later_start)
            sources.append(np.where(open_, ended_delta0[:, None] + offset, void))
            lengths.append(totals * (K + 1))
    read = np.zeros(void + 1, dtype=bool)
    read[np.concatenate([source.reshape(-1) for source in sources])] = True
    used = (read[:pp * J * (K + 1)] | read[pp * J * (K + 1):void]).reshape(pp, J, K + 1)
    starts, sources = _completing_only(starts, sources, void)
    flat_sources = np.concatenate([source.reshape(-1) for source in sources])
    for array in (*starts, *sources, *lengths, used, flat_sources):
        array.flags.writeable = False
    return _Layout(tuple(starts), tuple(sources), tuple(lengths), used, flat_sources)


def _completing_only(starts: list[np.ndarray], sources: list[np.ndarray], void: int
                     ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``_layout``'s stages keeping only the positions from which the stages after can still
    reach everything placed (the last stage's last position), found walking back over the
    steps that have a cost. The others lie on no split; a step with a cost to a kept position
    starts from a kept one, and the rest start from dropped ones at +inf (void) as before: the
    values and argmins at every kept position, hence every split and its costs, stay the full
    table's, over fewer cells. A stage that keeps none keeps its first position (nothing fits)."""
    keep = [np.zeros(source.shape[1], dtype=bool) for source in sources]
    keep[-1][-1] = True
    for i in range(len(sources) - 1, 0, -1):
        stepped = (sources[i] != void) & keep[i][None, :]
        keep[i - 1][starts[i][stepped]] = True
        if not keep[i - 1].any():
            keep[i - 1][0] = True
    kept_starts, kept_sources = [starts[0][:, keep[0]]], [sources[0][:, keep[0]]]
    for i in range(1, len(sources)):
        start, source = starts[i][:, keep[i]], sources[i][:, keep[i]]
        from_kept = keep[i - 1][start]
        renumbered = np.cumsum(keep[i - 1]) - 1  # each kept position's index among the kept
        kept_starts.append(np.where(from_kept, renumbered[start], 0))
        kept_sources.append(np.where(from_kept, source, void))
    return kept_starts, kept_sources


def _split(problem: BalanceProblem, greedy: _Greedy, stages: np.ndarray, first_chunk: np.ndarray, totals: np.ndarray,
           deltas: np.ndarray) -> np.ndarray:
    """[pp, J, K + 1, v] layers of the rest kind in each chunk of the stage at each round-0
    position holding T layers, δ of them leading ones in its first chunk: every chunk a layer,
    then each next layer to the chunk of least load (``chunk_loads``: leading layers weigh
    their kind's seconds), ties to the one of fewest micro-batches in flight (``greedy``: the
    loads' weights and the chunks' order in flight, computed once per problem)."""
    pp, v = problem.pp, problem.chunks_per_stage
    lead_unit = greedy.loads.units[problem.layer_kinds[0]]
    is_first = np.arange(v)[None, :] == first_chunk[:, None]  # [pp, v]
    shape = (pp, len(deltas), v)  # [position, δ, chunk]
    # (times a mask rather than np.where: the same +0.0 off the first chunk, the loads being ≥ 0)
    load = greedy.loads.chunk_ends[stages][:, None, :] + deltas[None, :, None] * lead_unit * is_first[:, None, :]
    empty = ~is_first[:, None, :] | (deltas[None, :, None] == 0)  # [pp, K + 1, v] holds no layer yet
    # Placing one layer at a time on the least key (load, then fewest in flight by a tiny
    # tie-break, empty chunks first) takes, of every chunk's run of keys for its 1st, 2nd, …
    # layer (rising: each adds 1 to its load), the least keys overall: sorted, they give the
    # order in which chunks receive layers, whatever T (T − δ of them are taken). The keys are
    # summed as that loop would (+1 at a time), so that they compare alike.
    turns = max(int(totals.max(initial=0)), 1)
    steps = np.empty((*shape, turns))
    steps.fill(1.0)
    steps[..., 0] = load
    rank = greedy.loads.flight_rank[stages][:, None, :, None] * 1e-6
    key = steps.cumsum(axis=3) + rank  # [pp, K + 1, v, turn]
    key[..., 0] -= 1e9 * empty  # a chunk's first layer, where it holds none yet, comes first
    order = key.reshape(pp, len(deltas), v * turns).argsort(axis=2, kind="stable")  # ties to the lower chunk
    # [v, pp, K + 1, step] layers of each chunk once the step is placed, for the first ``turns``
    # steps only: no stage places more. (Chunks lead: every operation then runs along rows of
    # steps, where chunks last would make it one short row of v per cell.)
    placed_in = order[..., :turns] // turns  # [pp, K + 1, step] the chunk each step places a layer in
    given = (np.arange(v)[:, None, None, None] == placed_in).cumsum(axis=3)
    left = totals[:, None] - deltas[None, :]  # [J, K + 1] rest layers to place (≤ turns)
    rest = given[:, :, deltas[None, :], np.maximum(left, 1) - 1]  # [v, pp, J, K + 1]
    return (rest * (left > 0)).transpose(1, 2, 3, 0)  # none placed where there is none to place




def solve_prefixed_exact(problem: BalanceProblem) -> tuple[Plan, PlanCost] | None:
    """The best plan with even chunks (``even_chunks``) and each stage's options dealt over its
    chunks, or the uniform placement if that is faster; None if none fits. Exact: the same
    optimum as ``solve.solve_brute_force`` (with the uniform placement).

    The DP of the heuristic over positions (b, a), with exact stage costs: a step (T, δ) of the
    stage at round-0 position i costs the least time, over every chunk split n (n_c ≥ 1 layers,
    Σ n = T, δ of the leading kind first in its first chunk) with even loads, of the least-time
    dealt recompute that fits (``rounds._dealt_mixes``); ``whole`` where the run goes on past
    the chunk (n₀ = δ), ``ended`` where it ends in it (n₀ ≥ δ). Every plan with even chunks is
    such a split of steps at no less cost, and the DP's split, with each step's least split n,
    is a plan of exactly its cost, so ``threshold_search``'s optimum is the plans'.

    Stage totals are bounded as in ``dp.solve_dp``: the heuristic's step U caps the largest
    stage time of any better plan at M = (U − S_min/v) / (m − 1/v) (S_min: every layer at its
    fastest option, plus the embedding and head), and a stage of T layers takes at least the
    T least layer times, so longer stages are never costed.
    """
    K = leading_run(problem)
    if K is None:
        raise ValueError("solve_prefixed_exact needs a leading run of at most pp layers of one kind")
    heuristic = solve_prefixed(problem)
    L, pp, v = problem.num_layers, problem.pp, problem.chunks_per_stage
    if L < pp * v:
        return heuristic
    longest = L - (pp - 1) * v
    if heuristic is not None:
        longest = min(longest, _longest_total(problem, K, heuristic[1].step_s))
    totals = np.arange(v, max(longest, v) + 1)
    greedy = _Greedy(problem)
    whole, ended, split_of = _exact_costs(problem, greedy, K, totals)
    found = [heuristic] if heuristic is not None else []
    table = _table(whole, ended, totals, K, L)
    z_star = min_max(table)
    split = threshold_search(table, problem.num_micro_batches * v - 1, z_star) if np.isfinite(z_star) else None
    if split:
        stages = np.asarray(problem.stage_of[:pp])
        per_chunk = np.zeros((pp, v), dtype=np.int64)  # [position, local chunk] layers
        placed = 0
        for i, step in enumerate(split):
            total, leading = divmod(int(step), K + 1)
            placed += leading
            per_chunk[i] = split_of[int(placed == K), i, total - int(totals[0]), leading]
        position_of = {int(stage): i for i, stage in enumerate(stages.tolist())}
        counts = tuple(int(per_chunk[position_of[int(problem.stage_of[virtual])], problem.chunk_of[virtual]])
                       for virtual in range(problem.num_virtual_stages))
        # Each stage's least dealt recompute again (the DP kept costs, not mixes); exact but for
        # stages of over 2^16 mixes (about 110 layers), which keep the greedy's.
        planned = _plan_of(problem, greedy, counts)
        found += [planned] if planned is not None else []
    uniform = uniform_counts(problem)
    found += [] if even_chunks(problem, uniform) else uniform_candidates(problem, greedy)
    return min(found, key=lambda f: f[1].step_s) if found else None


def _longest_total(problem: BalanceProblem, K: int, incumbent_s: float) -> int:
    """The most layers a stage of a plan faster than ``incumbent_s`` can hold
    (``solve_prefixed_exact``'s docstring); at least v."""
    v, m = problem.chunks_per_stage, problem.num_micro_batches
    kinds = problem.layer_kinds
    least = {kind: min(problem.costs[(kind, option)].time_s for option in problem.options) for kind in set(kinds)}
    floor = sum(least[kind] for kind in kinds) + problem.first_extra.time_s + problem.last_extra.time_s  # S_min
    bound = (incumbent_s - floor / v) / (m - 1 / v)
    bound = bound * (1 + 1e-9) + 1e-12  # rounding: never cut the optimum's stages
    lead, rest = least[kinds[0]], least[kinds[-1]]
    T = np.arange(problem.num_layers + 1)
    fastest = np.minimum(T, K) * min(lead, rest) + np.maximum(T - K, 0) * rest  # the T least layer times
    fits = np.flatnonzero(fastest <= bound)
    return max(int(fits[-1]) if len(fits) else 0, v)


_EXACT_BATCH = 1 << 18  # mixes priced at once by _exact_costs, bounding temporary memory


def _exact_costs(problem: BalanceProblem, greedy: _Greedy, K: int, totals: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``solve_prefixed_exact``'s step costs: ``whole`` and ``ended`` [pp, J, K + 1] seconds per
    micro-batch (+inf where no even split fits), and [2, pp, J, K + 1, v] the least split n of
    each (index 0 whole, 1 ended)."""
    pp, v = problem.pp, problem.chunks_per_stage
    stages, first_chunk = np.asarray(problem.stage_of[:pp]), np.asarray(problem.chunk_of[:pp])
    lead, rest = greedy.kinds.index(problem.layer_kinds[0]), greedy.kinds.index(problem.layer_kinds[-1])
    units = layer_units(problem)
    lead_unit, rest_unit = units[problem.layer_kinds[0]], units[problem.layer_kinds[-1]]
    ends = np.zeros((pp, v))
    ends[problem.stage_of, problem.chunk_of] = end_units(problem)
    spread = load_spread(problem)
    # Every split of every total into v chunks of at least one layer: [N, v], and its total.
    splits = np.concatenate([_compositions(int(T) - v, v) + 1 for T in totals])
    total_of = splits.sum(axis=1)
    J = len(totals)
    whole = np.full((pp, J, K + 1), np.inf)
    ended = np.full((pp, J, K + 1), np.inf)
    split_of = np.zeros((2, pp, J, K + 1, v), dtype=np.int64)
    for i in range(pp):
        f = int(first_chunk[i])
        for delta in range(K + 1):
            # Chunk loads as ``chunk_loads`` weighs them: δ leading layers in the first chunk.
            loads = splits * rest_unit + ends[stages[i]]
            loads[:, f] += delta * (lead_unit - rest_unit)
            even = ((loads <= loads.min(axis=1, keepdims=True) + spread + 1e-9) | (splits == 1)).all(axis=1)
            keep = np.flatnonzero(even & (splits[:, f] >= delta))
            if not len(keep):
                continue
            held = np.zeros((len(keep), v, len(greedy.kinds)), dtype=np.int64)
            held[:, :, rest] = splits[keep]
            held[:, f, rest] -= delta
            held[:, f, lead] += delta
            seconds = _priced(problem, greedy, np.full(len(keep), int(stages[i])), held)
            j = total_of[keep] - int(totals[0])
            for which, target, allowed in ((0, whole, splits[keep, f] == delta), (1, ended, np.ones(len(keep), bool))):
                cost = np.where(allowed, seconds, np.inf)
                # The least cost of each total: sort by (total, cost), first of each total.
                order = np.lexsort((cost, j))
                first = order[np.r_[True, j[order][1:] != j[order][:-1]]]
                target[i, j[first], delta] = cost[first]
                split_of[which, i, j[first], delta] = splits[keep[first]]
    return whole, ended, split_of


def _priced(problem: BalanceProblem, greedy: _Greedy, stages: np.ndarray, held: np.ndarray) -> np.ndarray:
    """[Q] ``rounds._dealt_mixes`` seconds of stage ``stages[q]`` holding ``held[q]`` [v, G],
    in batches of at most ``_EXACT_BATCH`` mixes."""
    R = len(problem.options)
    per_query = np.prod([comb(int(n) + R - 1, R - 1) for n in held.sum(axis=1).max(axis=0)])
    size = max(1, _EXACT_BATCH // max(int(per_query), 1))
    return np.concatenate([_dealt_mixes(problem, greedy, stages[q:q + size], held[q:q + size])[1]
                           for q in range(0, len(stages), size)])


__all__ = ["leading_run", "solve_prefixed", "solve_prefixed_exact"]
