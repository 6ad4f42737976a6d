"""Exact balancing of a pipeline with several chunks per stage when every layer is of one kind.

Interleaved 1F1B (and ZB-V, DualPipeV) run v chunks per stage; the composed step
(m − 1/v)·max_s T_s + (1/v)·Σ_s T_s holds for plans whose chunks on a stage are within one layer
of each other (``ndplan.balance.problem``). With one layer kind, where a layer sits does not
change its costs, so such a plan is given by each stage's total T_s: its chunks' loads (layers,
plus the embedding's or head's ``end_units``) as even as they go (``_chunk_layers``). Which
chunks of equal load get one layer more changes memory only, and the least is when they are
the chunks holding the fewest micro-batches in flight (a layer's bytes grow with its chunk's
in-flight count). So the plan is a split of L into pp
stage totals, and a stage's cost depends on (stage, total) alone: the split DP of
``ndplan.balance.dp`` over totals (``threshold_search``, weight m·v − 1, the composed step
times v), exact over every plan with even chunks and dealt options (below).

A stage's options are dealt to its chunks in turn (``dealt_chunks``), so each option's layers
spread evenly and chunk times stay even: piling full recompute on the chunk of most micro-
batches in flight (least bytes) made the simulated step of a DeepSeek-V3 plan 18% longer than
composed. Time then depends only on how many layers run each option, N_r, and bytes on N_r
through prefix sums of the dealt slots' in-flight weights, so a stage's cost, the least time
that fits, enumerates every (N_r) with Σ_r N_r = T (``_stage_costs``); exact over such plans.
A recompute option switches the stage's transient on, and its own bytes
(``BalanceProblem.option_charges``); the dealt slots also say how many layers of each option
each chunk holds, which prices a stage's largest chunk sum (``BalanceProblem.chunk_term``).

The heuristic (``window``) only costs totals within ⌊L/pp⌋ − v … ⌈L/pp⌉ + v (one layer per chunk);
it widens that window (doubling, then every total) while its plan recomputes and a stage sits at
an edge (``problem.window_binds``), and falls back to every total when nothing there fits.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ndplan.balance.dp import TotalsTable, _at_most, _min_max_monotone, min_max, threshold_search
from ndplan.balance.problem import (
    BalanceProblem,
    Plan,
    PlanCost,
    cost_columns,
    cost_index,
    end_units,
    evaluate_codes,
    even_chunks,
    heuristic_windows,
    stage_bases,
    uniform_counts,
    window_binds,
)
from ndplan.balance.rounds import uniform_candidates

WINDOW = 1  # the heuristic's stage totals: within one layer per chunk of uniform


def one_layer_kind(problem: BalanceProblem) -> bool:
    return len(set(problem.layer_kinds)) == 1


def _chunk_layers(problem: BalanceProblem, totals: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """[pp, J, v] layers of each local chunk for each stage total, the loads (layers plus
    ``end_units``) as even as they go: every chunk one layer, then each further layer to the
    chunk of least load, ties to the one of fewest micro-batches in flight (water filling).
    ``order``: [pp, v] each stage's chunks fewest in flight first (a stable argsort), where the
    caller has it."""
    pp, v = problem.pp, problem.chunks_per_stage
    if order is None:
        flight = np.zeros((pp, v))
        flight[problem.stage_of, problem.chunk_of] = problem.in_flight_of_virtual()
        order = np.argsort(flight, axis=1, kind="stable")  # [pp, v] fewest in flight first
    units = np.zeros((pp, v), dtype=np.int64)
    units[problem.stage_of, problem.chunk_of] = end_units(problem)
    start = units + 1  # [pp, v] loads with one layer each
    more = totals - v  # [J] layers left to place
    # Raising every load to level λ takes filled(λ) = Σ_c max(0, λ − start_c) layers; the
    # highest λ within reach, then the rest one each to chunks at that level.
    levels = np.arange(int(start.max()) + int(totals.max()) + 1)
    filled = np.maximum(levels[None, None, :] - start[:, :, None], 0).sum(axis=1)  # [pp, Λ]
    level = (filled[:, None, :] <= more[None, :, None]).sum(axis=2) - 1  # [pp, J] the highest λ within reach
    stage = np.arange(pp)[:, None]  # index grids: plain fancy indexing is cheaper than take_along_axis
    rest = more[None, :] - filled[stage, level]  # [pp, J]
    loads = np.maximum(start[:, None, :], level[:, :, None])  # [pp, J, v]
    at_level = start[:, None, :] <= level[:, :, None]
    rank = np.empty_like(order)
    rank[stage, order] = np.arange(v)  # chunk's place in that order
    # Place of each chunk among the chunks at level, in that order.
    cell = (stage[:, :, None], np.arange(len(totals))[None, :, None])
    sorted_at_level = at_level[(*cell, order[:, None, :])]
    place = np.cumsum(sorted_at_level, axis=2)[(*cell, rank[:, None, :])]
    loads = loads + (at_level & (place <= rest[:, :, None]))
    return loads - units[:, None, :]


@lru_cache(maxsize=256)
def _mixes(low: int, high: int, options: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every way to run T layers on the options, for every T in low … high, grouped by T:
    [K, options] layers per option, [K] T − low of each, and the first row of each T
    (read-only; cached, it depends on the three integers only)."""
    mixes = _at_most(high, options)
    total = mixes.sum(axis=1)
    order = np.argsort(total, kind="stable")
    mixes, total = mixes[order], total[order]
    keep = total >= low
    mixes, j_of = mixes[keep], total[keep] - low
    starts = np.searchsorted(j_of, np.arange(high - low + 1))
    for array in (mixes, j_of, starts):
        array.flags.writeable = False
    return mixes, j_of, starts


def dealt_chunks(capacity: np.ndarray, flight: np.ndarray) -> np.ndarray:
    """The chunk of each slot when a stage deals its layers to its chunks in turn, fewest in
    flight first, skipping chunks already full (``capacity`` [v] layers each): [Σ capacity].
    Options go to the slots in order, those holding most activation first, so each option's
    layers spread over the chunks within one of each other (as Megatron recomputes the same
    layers in every chunk) and chunk times stay even; the remainders fall on the chunks of
    fewest micro-batches in flight."""
    order = np.argsort(flight, kind="stable")
    active = np.arange(int(capacity.max(initial=0)))[:, None] < capacity[order][None, :]  # [turn, v]
    return np.broadcast_to(order, active.shape)[active]


def _dealt_prefix(layers: np.ndarray, flight: np.ndarray, most: int) -> np.ndarray:
    """[pp, J, most + 1]: Σ of the in-flight weights of the first k dealt slots (``dealt_chunks``)
    of each stage holding ``layers`` [pp, J, v] per chunk, ``most`` the most layers of a stage."""
    return _dealt_slots(layers, flight, most)[0]


def _dealt_slots(layers: np.ndarray, flight: np.ndarray, most: int, order: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_dealt_prefix``, with what places each slot: [pp, J, most] the k-th dealt slot's position
    t·v + i in the deal (turn t, i-th chunk fewest in flight first), [pp, J, v] the layers of
    those chunks in that order, and [pp, v] that order. After k + 1 slots, the i-th chunk
    holds min(capacity_i, t + [i ≤ i_k]) of them (``rounds._dealt_mixes`` deals with that).
    ``order``: that order, ``flight``'s stable argsort per row, where the caller has it. Past a
    row's own layers the sums mean nothing (no mix deals that many slots)."""
    order = np.argsort(flight, axis=1, kind="stable") if order is None else order  # [pp, v]
    pp, J, v = layers.shape
    stage = np.arange(pp)[:, None]  # index grids: plain fancy indexing is cheaper than take_along_axis
    capacity = layers[stage[:, :, None], np.arange(J)[None, :, None], order[:, None, :]]  # [pp, J, v]
    turns = int(capacity.max(initial=0))
    idle = capacity[:, :, None, :] <= np.arange(turns)[:, None]  # [pp, J, turn, v] no slot of the chunk in that turn
    first = idle.reshape(pp, J, -1).argsort(axis=2, kind="stable")[:, :, :most]  # positions of the dealt slots in turn
    # The dealt slots' weights, summed in deal order: the running sums over every position
    # (idle ones adding zero) at the dealt ones, without the masked [pp, J, turn, v] table.
    dealt = flight[stage, order].take(first % v + v * stage[:, :, None])  # [pp, J, most]
    out = np.zeros((pp, J, most + 1))
    np.cumsum(dealt, axis=2, out=out[:, :, 1:])
    return out, first, capacity, order


def _stage_costs(problem: BalanceProblem, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[pp, J] least seconds per micro-batch of each stage holding each total (+inf if nothing
    fits), [pp, J, R] the layers on each option reaching it (module docstring), and [pp, J, v]
    the layers of each chunk (``_chunk_layers``)."""
    kind = problem.layer_kinds[0]
    options = problem.options
    R, pp, v = len(options), problem.pp, problem.chunks_per_stage
    cost = [problem.costs[(kind, option)] for option in options]
    time = np.array([c.time_s for c in cost])
    static = np.array([c.static_bytes for c in cost])
    activation = np.array([c.activation_bytes for c in cost])
    recomputes = np.array([option != "none" for option in options])
    by_activation = np.argsort(-activation, kind="stable")  # options that hold most go first
    flight = np.zeros((pp, v))
    flight[problem.stage_of, problem.chunk_of] = problem.in_flight_of_virtual()
    base_bytes, base_time, transient = stage_bases(problem)
    order = np.argsort(flight, axis=1, kind="stable")  # [pp, v] chunks fewest in flight first, for both below
    layers = _chunk_layers(problem, totals, order)  # [pp, J, v]
    # A hair under the limit (80 bytes of 80 GB), so evaluate's own float sums never land over it.
    limit = problem.memory_limit_bytes * (1 - 1e-9)
    mixes, j_of, starts = _mixes(int(totals[0]), int(totals[-1]), R)
    slots, first, capacity, _ = _dealt_slots(layers, flight, int(totals.max()), order)  # [pp, J, S + 1] in-flight weight of the first k slots, ...
    # Σ_r act_r·(P(end_r) − P(end_{r−1})) = Σ_{r<R} P(end_r)·(act_r − act_{r+1}) + P(T)·act_R,
    # options in falling activation order, P the slot-weight prefix: R − 1 gathers, not 2·R.
    ends = np.cumsum(mixes[:, by_activation[:-1]], axis=1)  # [K, R − 1] slots used after each option
    falling = activation[by_activation]
    steps = falling[:-1] - falling[1:]
    held_all = slots[:, j_of, totals[j_of]] * falling[-1]  # every slot at the last option's bytes
    if R == 1:  # one option (activation offload beside interleaving leaves "none" alone)
        act_bytes = held_all
    elif R - 1 < 8:  # the sum over options term by term: what .sum(axis=2) adds, in its order, without a gather of [pp, K, R − 1]
        act_bytes = slots[:, j_of, ends[:, 0]] * steps[0]  # [pp, K]
        for r in range(1, R - 1):
            act_bytes = act_bytes + slots[:, j_of, ends[:, r]] * steps[r]
        act_bytes += held_all
    else:  # numpy sums eight terms or more pairwise
        act_bytes = (slots[:, j_of[:, None], ends] * steps).sum(axis=2)
        act_bytes += held_all
    memory = base_bytes[:, None] + (mixes @ static)[None] + act_bytes
    if problem.has_layer_extra:  # what recomputing adds per layer on each stage
        memory = memory + (mixes @ problem.layer_extra([kind])[:, 0, :].T).T
    memory = memory + np.where((mixes @ recomputes) > 0, transient[:, None], 0.0)
    if problem.has_option_charges:  # each option's own bytes, once where the mix runs it
        memory = memory + problem.option_charges() @ (mixes > 0).T
    if problem.has_chunk_terms:  # the largest chunk sum of the dealt options, once
        memory = memory + _dealt_chunk_terms(problem, kind, first, capacity, order, mixes, j_of, by_activation)
    seconds = np.where(memory <= limit, base_time[:, None] + (mixes @ time)[None], np.inf)  # [pp, K]
    least = np.minimum.reduceat(seconds, starts, axis=1)  # [pp, J]
    # The first mix of each total reaching its least time.
    first = np.where(seconds == least[:, j_of], np.arange(len(j_of))[None], len(j_of))
    best = np.minimum.reduceat(first, starts, axis=1)  # [pp, J]
    chosen = mixes[np.minimum(best, len(j_of) - 1)]  # [pp, J, R]
    room = problem.step_room()
    if room is not None:  # a total whose layers overflow the optimizer step never fits
        least = np.where(totals[None, :] * problem.step_bytes_of([kind])[0] > room[:, None], np.inf, least)
    return least, chosen, layers


def _dealt_chunk_terms(problem: BalanceProblem, kind: str, first: np.ndarray, capacity: np.ndarray,
                       order: np.ndarray, mixes: np.ndarray, j_of: np.ndarray, by_activation: np.ndarray) -> np.ndarray:
    """[pp, K] what each stage holds for its largest chunk sum (``BalanceProblem.chunk_term``)
    under each mix [K, R] of the totals ``j_of`` indexes, its options dealt to the chunks
    (``dealt_chunks``: options most bytes first, ``by_activation``). ``first`` [pp, J, S] each
    dealt slot's place t·v + i and ``capacity`` [pp, J, v] each chunk's layers, chunks fewest in
    flight first (``order``; ``_dealt_slots``): after k slots, the k-th at (t, i_k), the i-th
    chunk holds min(capacity_i, t + [i ≤ i_k]) of them, and an option takes the slots between
    the options dealt before it and itself."""
    pp, v = problem.pp, problem.chunks_per_stage
    table = problem.chunk_bytes([kind])[:, :, 0, :]  # [pp, v, R]
    in_order = table[np.arange(pp)[:, None], order]  # [pp, v, R], chunks fewest in flight first
    ordered = mixes[:, by_activation]  # [K, R] options most bytes first, as dealt
    ends = np.cumsum(ordered, axis=1)
    held = [np.take(capacity[:, :, i], j_of, axis=1) for i in range(v)]  # per chunk [pp, K]
    # The k-th slot's place at k (k = 0: place −1, turn −1 and the last chunk: no slot dealt).
    J, S = first.shape[1:]
    places = np.empty((pp, J * (S + 1)), dtype=first.dtype)
    places.reshape(pp, J, S + 1)[:, :, 0] = -1
    places.reshape(pp, J, S + 1)[:, :, 1:] = first
    row = j_of * (S + 1)

    def dealt(k: np.ndarray) -> list[np.ndarray]:  # per chunk [pp, K]: of the first k[K] slots, those it holds
        turn, place = np.divmod(places[:, row + k], v)
        return [np.minimum(held[i], turn + (place >= i)) for i in range(v)]

    sums = [np.zeros((pp, len(mixes))) for _ in range(v)]
    last = len(by_activation) - 1
    for q, r in enumerate(by_activation.tolist()):
        if in_order[..., r].any():
            after = held if q == last else dealt(ends[:, q])  # the last option ends at every slot
            before = dealt(ends[:, q] - ordered[:, q])
            for i in range(v):
                sums[i] += (after[i] - before[i]) * in_order[:, i, r, None]
    largest = sums[0]
    for i in range(1, v):
        np.maximum(largest, sums[i], out=largest)
    return np.maximum(largest - problem.chunk_offset[:, None], 0.0)


def _plan(problem: BalanceProblem, layers: np.ndarray, mixes: np.ndarray) -> tuple[Plan, np.ndarray]:
    """Layers per virtual stage and each layer's option, dealt to a stage's chunks
    (``dealt_chunks``), from each stage's layers per chunk [pp, v] and option counts [pp, R];
    and [L] each layer's option as its index in ``problem.options``."""
    v = problem.chunks_per_stage
    activation = np.array([problem.costs[(problem.layer_kinds[0], o)].activation_bytes for o in problem.options])
    by_activation = np.argsort(-activation, kind="stable")
    pp = problem.pp
    stage = np.arange(pp)
    flight = np.zeros((pp, v))
    flight[problem.stage_of, problem.chunk_of] = problem.in_flight_of_virtual()
    R = len(problem.options)
    # Every stage's slots at once: the chunk of each (dealt_chunks, turn by turn) and the option
    # of each (options holding most bytes first), as [pp, S] tables, S the most layers of a stage.
    order = np.argsort(flight, axis=1, kind="stable")
    capacity = layers[stage[:, None], order]
    active = np.arange(int(capacity.max()))[None, :, None] < capacity[:, None, :]  # [pp, turn, v]
    slot_chunk = np.broadcast_to(order[:, None, :], active.shape)[active]  # stage-major, in turn
    slot_stage = np.broadcast_to(stage[:, None, None], active.shape)[active]
    counts = mixes[:, by_activation]  # [pp, R] layers per option, most bytes first
    slot_option = np.repeat(np.broadcast_to(by_activation, counts.shape).reshape(-1), counts.reshape(-1))
    held = np.zeros((pp, v, R), dtype=np.int64)  # [stage, chunk, option] layers
    np.add.at(held, (slot_stage, slot_chunk, slot_option), 1)
    per_virtual = held[problem.stage_of, problem.chunk_of]  # [V, R]
    # Inside a chunk the order of its layers' options changes nothing: option order.
    options = np.repeat(np.tile(np.arange(R), problem.num_virtual_stages), per_virtual.reshape(-1))
    plan = Plan(tuple(per_virtual.sum(axis=1).tolist()), tuple(map(problem.options.__getitem__, options.tolist())))
    return plan, options


def solve_chunks(problem: BalanceProblem, window: int | None = None) -> tuple[Plan, PlanCost] | None:
    """The best plan with even chunks (module docstring), or the uniform placement if that is
    faster (``rounds.uniform_candidates``); None if none fits. With ``window``, only stage
    totals near uniform (the heuristic), all of them if nothing there fits."""
    if not one_layer_kind(problem):
        raise ValueError("solve_chunks needs every layer of one kind")
    L, pp, v = problem.num_layers, problem.pp, problem.chunks_per_stage
    if L < pp * v:
        return None
    shortest, longest = v, L - (pp - 1) * v
    found = None
    if window is not None:
        # Near uniform first, wider while the window binds (``window_binds``), every total if
        # nothing near fits.
        for width in heuristic_windows(window):
            low, high = max(shortest, L // pp - width * v), min(longest, -(-L // pp) + width * v)
            found = _solve(problem, np.arange(low, high + 1))
            if (low, high) == (shortest, longest):
                break
            if found is None:
                found = _solve(problem, np.arange(shortest, longest + 1))
                break
            if not window_binds(problem, found[0], low, high):
                break
        else:
            wider = _solve(problem, np.arange(shortest, longest + 1))
            found = wider if found is None or (wider is not None and wider[1].step_s < found[1].step_s) else found
    else:
        found = _solve(problem, np.arange(shortest, longest + 1))
    # A uniform placement with even loads is among the plans the DP weighs (its totals are in
    # any window, and its chunk split at best the DP's); one with a heavy head chunk is not.
    uniform = uniform_counts(problem)
    candidates = [] if even_chunks(problem, uniform) else uniform_candidates(problem)
    candidates += [found] if found is not None else []
    return min(candidates, key=lambda c: c[1].step_s) if candidates else None


def _solve(problem: BalanceProblem, totals: np.ndarray) -> tuple[Plan, PlanCost] | None:
    L, pp = problem.num_layers, problem.pp
    least, chosen, chunk_layers = _stage_costs(problem, totals)  # [pp, J], [pp, J, R], [pp, J, v]
    # A stage's cost depends on its total alone, wherever it starts: the DP shifts the previous
    # stage's values by each total (``TotalsTable``) instead of a [pp, J, L + 1] table.
    table = TotalsTable(least, totals, L, least[np.isfinite(least)])
    # Stage costs that never fall as totals grow (the usual case) give Z* without a DP pass.
    monotone = bool((least[:, 1:] >= least[:, :-1]).all())
    z_star = _min_max_monotone(least, int(totals[0]), L) if monotone else min_max(table)
    if not np.isfinite(z_star):
        return None
    split = threshold_search(table, problem.num_micro_batches * problem.chunks_per_stage - 1, z_star)
    if split is None:
        return None
    index = np.asarray(split) - totals[0]
    plan, option = _plan(problem, chunk_layers[np.arange(pp), index], chosen[np.arange(pp), index])
    # ``evaluate`` of the plan, with each layer's entry of ``problem.costs`` from its option index.
    entry = cost_index(problem)
    codes = np.array([entry[(problem.layer_kinds[0], o)] for o in problem.options])[option]
    return plan, evaluate_codes(problem, plan.stage_layers, cost_columns(problem), codes)


__all__ = ["one_layer_kind", "solve_chunks"]
