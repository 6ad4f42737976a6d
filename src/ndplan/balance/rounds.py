"""Fast balancing when a stage holds several chunks (interleaved 1F1B, ZB-V, DualPipeV).

A stage's chunks should take about the same time (``ndplan.balance.problem``), so the heuristic
searches *periodic* plans: with L = v·R + r layers (0 ≤ r ≤ pp), the pp chunks of each round
(virtual stages c·pp … c·pp + pp − 1, run by the stages in round 0's order or, on V schedules,
its reverse) hold the same counts n_s, and the r leftover layers go one each to r stages in
the last round (the chunks that hold the fewest micro-batches in flight). Such a plan is given
by (n_s, e_s) per stage, e_s ∈ {0, 1}, Σ_s n_s = R, Σ_s e_s = r, and every stage's chunks are
within one layer of each other. Two values of R are tried, ⌊L/v⌋ and one less (so that a few
stages may hold one layer more than the others).

Used for models of several layer kinds (dense and MoE layers), whose kinds depend on where a
layer sits; with one kind ``ndplan.balance.chunks`` is exact over every even-chunk plan.

Walking round 0's stages in order, the layers before a stage (b of the R per round, and eb of
the r leftovers) fix where every one of its chunks starts, hence which layer kinds it holds.
So a stage's cost depends on (its position i, n, e, b, eb) alone and the split is a DP over
positions (b, eb), the same min-max and min-sum passes as the one-chunk DP of
``ndplan.balance.dp`` (Z*, then the least sum under it), with the objective
Σ_s T_s + (m·v − 1)·max_s T_s: the composed step (m − 1/v)·max + (1/v)·Σ times v.

A stage's cost is the least time of its layers that fits, by a greedy knapsack (``_Greedy``):
from every layer's fastest option, move layers along the lower convex hull of their options'
(bytes, seconds) in order of seconds added per byte saved until the stage fits. That is the
linear relaxation's optimum rounded up by at most one layer: never over memory, at most one
layer's step from the best mix. Counts per stage stay within ⌊R/pp⌋ − 2 … ⌈R/pp⌉ + 2 (each
one a layer in every chunk). The plan is then evened out inside each stage (``_even_out``:
the chunk holding the head gives layers to its stage's other chunks, as ``even_chunks``
counts the head as layers). The answer is the best of those plans and the uniform placement
(with one option on every layer, or each stage's least-time dealt recompute), so it is never
slower than uniform. Plans get each stage's least-time recompute with options dealt over its
chunks (``_exact_stages``), so chunk times stay even; the greedy only ranks placements.
"""

from __future__ import annotations

from functools import cached_property, lru_cache
from math import comb, prod
from typing import NamedTuple

import numpy as np

from ndplan.balance.dp import Table, _at_most, min_max, min_sum
from ndplan.balance.problem import (
    BalanceProblem,
    Plan,
    PlanCost,
    _reference_seconds,
    chunk_loads,
    cost_columns,
    cost_index,
    end_units,
    evaluate_codes,
    evaluate_codes_many,
    evaluation_constants,
    layer_units,
    load_spread,
    stage_bases,
    uniform_counts,
)

WINDOW = 2  # per-chunk counts n_s within ⌊R/pp⌋ − 2 … ⌈R/pp⌉ + 2
_ROUNDING = 1e-9  # a quotient this close above an integer may be that integer rounded up
_MARGIN = 1e-9  # of the limit (80 bytes of 80 GB), kept free against rounding
_PAIR = np.array([[0], [1]])  # ``_Greedy.solve``'s bytes saved and seconds added, gathered at once
_PAIR.flags.writeable = False


class _Loads(NamedTuple):
    """``_Greedy.loads``: each kind's ``layer_units``, ``load_weights`` ([L] every layer's units,
    [V] each virtual stage's ``end_units``), [pp, v] the latter per (stage, chunk), the
    ``load_spread``, [pp, v] the virtual stage of each (stage, chunk), and [pp, v] each chunk's
    place among its stage's, fewest micro-batches in flight first."""

    units: dict[str, float]
    weights: tuple[np.ndarray, np.ndarray]
    chunk_ends: np.ndarray
    spread: float
    virtual_at: np.ndarray
    flight_rank: np.ndarray


class _Greedy:
    """Least time of a stage's layers that fits, for many (stage, layer counts) queries at once.

    Layers of kind g in local chunk c of stage s under option r cost t[g, r] seconds and
    μ[s, c, g, r] = static[g, r] + in_flight[s, c]·activation[g, r] bytes. Two cases, the faster
    that fits wins: every layer "none" against the limit; or the stage's recompute transient
    charged and the greedy over the options' hulls (module docstring).
    """

    def __init__(self, problem: BalanceProblem) -> None:
        # [L] kind of each layer; for ``_plan_of``, [G, L + 1] layers of each kind before each
        # layer and [L] each layer's rank among its kind.
        self.kinds, self.codes, self.kind_before, self.kind_rank = _kind_tables(problem.layer_kinds)
        options = problem.options
        pp, v = problem.pp, problem.chunks_per_stage
        # For ``evaluate_codes``: each (kind, option)'s entry of ``problem.costs``, the entries'
        # columns and what evaluation takes from the problem.
        entry = cost_index(problem)
        self.cost_code = np.array([[entry[(kind, option)] for option in options] for kind in self.kinds])  # [G, R]
        self.cost_columns = cost_columns(problem)
        self.evaluation = evaluation_constants(problem)
        # [G, R] seconds, static and activation bytes: the columns gathered at once.
        self.time, static, activation = self.cost_columns[:3, self.cost_code]
        weight = problem.peak_in_flight.astype(float)  # [pp, v]: every chunk holds one virtual stage
        # [2, pp, v, G, R] each option's seconds (the same on every chunk) and bytes, in one array
        # so that one gather picks both (``per_group``).
        R = len(options)
        costs = np.empty((2, pp, v, len(self.kinds), R))
        time, memory = costs
        time[:] = self.time
        np.multiply(weight[:, :, None, None], activation, out=memory)
        memory += static  # static + in-flight bytes (float addition commutes exactly)
        # What recomputing adds per layer on each stage (``BalanceProblem.layer_extra``) [pp, G, R].
        self.extra = None if not problem.has_layer_extra else problem.layer_extra(self.kinds)
        if self.extra is not None:
            memory += self.extra[:, None]
        # A stage's largest chunk sum (``BalanceProblem.chunk_term``) is no sum over its layers:
        # the greedy ranks with each layer at its stage's largest chunk bytes over v (what the
        # largest chunk holds where the options are dealt evenly, the offset left out);
        # ``_dealt_mixes`` prices it exactly. [pp, v, G, R] (None: no chunk terms).
        self.chunk = problem.chunk_bytes(self.kinds) if problem.has_chunk_terms else None
        if self.chunk is not None:
            memory += self.chunk.max(axis=1, keepdims=True) / v
        self.memory = memory
        # For dealing options over chunks (``_dealt_mixes``): micro-batches in flight per chunk,
        # chunks fewest first, each kind's options most bytes first, and which recompute.
        self.flight, self.static, self.activation = weight, static, activation
        self.flight_order = weight.argsort(axis=1, kind="stable")  # [pp, v]
        self._problem = problem  # for ``loads``, computed where a solver weighs loads
        self.by_activation = (-activation).argsort(axis=1, kind="stable")  # [G, R]
        self.falling_activation = activation[np.arange(len(self.kinds))[:, None], self.by_activation]  # [G, R] in that order
        self.recomputes, self.head_recomputes, self.none = _option_flags(options)
        self.base_bytes, self.base_time, self.transient = stage_bases(problem, self.evaluation)
        # Each option's own bytes, once on a stage where it runs [pp, R] (None: nothing).
        self.charges = problem.option_charges() if problem.has_option_charges else None
        self.limit = problem.memory_limit_bytes
        # The optimizer step's room per stage and each kind's bytes there (``_step_mask``).
        self.step_room = problem.step_room(_MARGIN)
        self.step_bytes = problem.step_bytes_of(self.kinds)
        # Hull walk per (stage, chunk, kind): from the fastest option (least bytes among ties),
        # step to the option of least seconds per byte saved, while one saves bytes.
        order = np.lexsort((memory, time), axis=-1)
        self.start = order[..., 0].copy()  # [pp, v, G]
        steps = max(R - 1, 1)
        # The walk over flat (stage, chunk, kind) groups, gathering with flat indices.
        flat_time, flat_memory = costs.reshape(2, -1, R)
        row = np.arange(len(flat_memory)) * R  # flat index of each group's first option: flat ``take``s gather
        at = self.start.reshape(-1)
        self.step_option = np.empty((len(row), steps), dtype=np.int64)
        gain = np.zeros((2, len(row), steps))  # bytes saved and seconds added per layer moved
        slope = np.empty((len(row), steps))
        for h in range(steps):
            here = row + at
            saved = flat_memory.take(here)[:, None] - flat_memory
            added = flat_time - flat_time.take(here)[:, None]
            # Seconds added per byte saved, +inf where nothing is saved (those divisions are
            # skipped: no warnings to silence, which costs more than the division here).
            ratio = np.empty(saved.shape)
            ratio.fill(np.inf)  # (empty and fill: a third of np.full's overhead)
            np.divide(added, saved, out=ratio, where=saved > 0)
            best = ratio.argmin(axis=-1)
            chosen = row + best
            best_ratio = ratio.take(chosen)  # finite, or +inf where no option saves bytes
            moves = np.isfinite(best_ratio)
            at = np.where(moves, best, at)
            self.step_option[:, h] = at
            gain[0, :, h] = np.where(moves, saved.take(chosen), 0.0)
            gain[1, :, h] = np.where(moves, added.take(chosen), 0.0)
            slope[:, h] = best_ratio
        self.step_option = self.step_option.reshape(*self.start.shape, steps)  # [pp, v, G, steps]
        # The order in which a stage's (chunk, kind, step) moves are taken: by slope; a group's
        # steps have rising slopes (a convex hull), and the stable sort keeps them in order.
        self.order = slope.reshape(pp, -1).argsort(axis=1, kind="stable")  # [pp, moves]
        self.steps = steps
        self.move_group = self.order // steps  # [pp, moves] flat (chunk, kind) of each move, in order
        # What ``solve`` gathers per query, stacked so that one gather per table serves a batch,
        # stage last (queries run along the last axis): per stage [3, pp] (filled in place:
        # np.stack's own overhead is most of its cost at these sizes); per chunk and kind
        # [2 or 4, v·G, pp] seconds and bytes of its layers at their start option, and at "none";
        # per move [moves, 2, pp] bytes saved and seconds added per layer. Each of the latter is
        # one gather, of both quantities at once.
        self.per_stage = np.empty((3, pp))
        # A stage that recomputes pays the transient and, as the greedy does not track which
        # options it runs, every option's own bytes (at or over what it holds: a heuristic).
        recomputing = self.transient if self.charges is None else self.transient + self.charges.sum(axis=1)
        self.per_stage[0], self.per_stage[1], self.per_stage[2] = self.base_time, self.base_bytes + recomputing, self.base_bytes
        at_start = row + self.start.reshape(-1)
        picked = costs.reshape(2, -1).take(at_start if self.none is None else np.concatenate((at_start, row + self.none)), axis=1)
        self.per_group = picked.reshape(2, -1, pp, v * len(self.kinds)).transpose(1, 0, 3, 2).reshape(-1, v * len(self.kinds), pp)
        self.per_move = gain.reshape(2, pp, -1)[:, np.arange(pp)[:, None], self.order].transpose(2, 0, 1).copy()
        self.move_group_last = self.move_group.T.copy()  # [moves, pp]

    @cached_property
    def loads(self) -> _Loads:
        """What weighs chunk loads (``_even_out``, ``prefix._split``), once per problem."""
        problem = self._problem
        pp, v = problem.pp, problem.chunks_per_stage
        layer_s = _reference_seconds(problem)  # the unit of both, found once
        units = layer_units(problem, layer_s)
        ends = end_units(problem, layer_s)
        chunk_ends = np.zeros((pp, v))
        chunk_ends[problem.stage_of, problem.chunk_of] = ends
        virtual_at = np.zeros((pp, v), dtype=np.int64)
        virtual_at[problem.stage_of, problem.chunk_of] = np.arange(problem.num_virtual_stages)
        flight_rank = np.empty_like(self.flight_order)
        flight_rank[np.arange(pp)[:, None], self.flight_order] = np.arange(v)
        weights = (np.array([units[kind] for kind in self.kinds])[self.codes], ends)
        return _Loads(units, weights, chunk_ends, load_spread(problem, units), virtual_at, flight_rank)

    def solve(self, stage: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For queries (``stage`` [Q], ``counts`` [Q, v, G] layers per chunk and kind): least
        seconds per micro-batch (+inf if nothing fits), whether every layer runs "none" (no
        transient), the number of moves taken whole, and the layers of the last, partial move.

        Queries run along the last axis of every array, so that each step is one vectorised
        operation over all of them (gathers are flat ``take``s, and sums over the few chunks,
        kinds or moves add one slab at a time, in order)."""
        Q = len(stage)
        query = np.arange(Q)
        groups = counts.reshape(Q, -1).T.astype(float)  # [v·G, Q] layers of each chunk and kind
        base_time, base_rc, base_plain = self.per_stage.take(stage, axis=1)
        # Σ over chunks and kinds of layers × start seconds, start bytes (and all-"none" ones).
        sums = (groups * self.per_group.take(stage, axis=2)).sum(axis=1)  # [2 or 4, Q]
        time = base_time + sums[0]
        # Aim a hair under the limit, so that evaluate's own float sums never land just over it.
        limit = self.limit * (1 - _MARGIN)
        deficit = base_rc + sums[1] - limit
        layers = groups.take(self.move_group_last.take(stage, axis=1) * Q + query)  # [moves, Q] each move may take
        per_move = self.per_move.take(stage, axis=2)  # [moves, 2, Q] bytes saved, seconds added per layer
        steps = layers[:, None] * per_move
        moves = len(steps)
        # Running sums of bytes saved and seconds added along the moves, after none (a row of
        # zeros, so that the sums before each move are one gather) to all of them.
        running = np.empty((moves + 1, 2, Q))
        running[0] = 0.0
        np.cumsum(steps, axis=0, out=running[1:])
        short = deficit > 0  # over the limit with every layer at its fastest option
        # Moves taken whole: none where not short, as no running sum (≥ 0) is below the deficit.
        whole = (running[1:, 0] < deficit).sum(axis=0)
        fits = ~short | (whole < moves)
        whole = np.minimum(whole, moves - 1)
        before, spent = running.take((whole * 2 + _PAIR) * Q + query)
        unit, unit_time = per_move.take((whole * 2 + _PAIR) * Q + query)
        with np.errstate(divide="ignore", invalid="ignore"):
            partial = np.ceil(np.maximum(deficit - before, 0.0) / unit - _ROUNDING)
        partial = np.where(short & np.isfinite(partial), partial, 0.0)
        partial += short & (before + partial * unit < deficit)  # rounding: one more layer
        fits &= partial <= layers.take(whole * Q + query)
        greedy = time + spent + partial * unit_time
        np.putmask(greedy, ~fits, np.inf)  # in place: cheaper than np.where at these sizes
        if self.none is None:
            self._step_mask(greedy, stage, counts)
            return greedy, np.zeros(Q, dtype=bool), whole, partial.astype(np.int64)
        plain_bytes = base_plain + sums[3]
        plain_time = base_time + sums[2]
        plain = (plain_bytes <= limit) & (plain_time <= greedy)
        np.putmask(greedy, plain, plain_time)
        self._step_mask(greedy, stage, counts)
        return greedy, plain, whole, partial.astype(np.int64)

    def _step_mask(self, seconds: np.ndarray, stage: np.ndarray | slice, counts: np.ndarray) -> None:
        """+inf in place where a stage's layers (``counts`` [Q, v, G]) overflow the optimizer step."""
        if self.step_room is not None:
            np.putmask(seconds, counts.sum(axis=1) @ self.step_bytes > self.step_room[stage], np.inf)

    def options(self, stage: int, counts: np.ndarray, plain: bool, whole: int, partial: int) -> np.ndarray:
        """[v, G, R] layers of each chunk and kind on each option, from ``solve``'s answer for
        ``stage`` holding ``counts`` [v, G]."""
        v, G = counts.shape
        out = np.zeros((v, G, self.memory.shape[-1]), dtype=np.int64)
        if plain:
            out[..., self.none] = counts
            return out
        at = self.start[stage].copy()  # [v, G] option of the layers not moved yet
        moved = np.zeros((v, G), dtype=np.int64)  # layers of the partial move, on its option
        for rank, flat in enumerate(self.order[stage, : whole + 1].tolist()):
            group, h = divmod(flat, self.steps)
            c, g = divmod(group, G)
            if rank < whole:
                at[c, g] = self.step_option[stage, c, g, h]
            else:
                moved[c, g] = partial
                out[c, g, self.step_option[stage, c, g, h]] += partial
        chunk, kind = np.indices((v, G))
        np.add.at(out, (chunk, kind, at), counts - moved)
        return out


@lru_cache(maxsize=64)
def _kind_tables(layer_kinds: tuple[str, ...]) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    """``_Greedy``'s layer kinds (sorted), [L] each layer's kind, [G, L + 1] layers of each kind
    before each layer and [L] each layer's rank among its kind. Read-only; cached, as they depend
    on the model's layer kinds only, the same for every strategy a search weighs."""
    kinds = tuple(sorted(set(layer_kinds)))
    code_of = {kind: g for g, kind in enumerate(kinds)}
    L = len(layer_kinds)
    codes = np.fromiter(map(code_of.__getitem__, layer_kinds), np.int64, L)
    kind_before = np.zeros((len(kinds), L + 1), dtype=np.int64)
    np.cumsum(codes[None] == np.arange(len(kinds))[:, None], axis=1, out=kind_before[:, 1:])
    kind_rank = kind_before[codes, np.arange(L)]
    for array in (codes, kind_before, kind_rank):
        array.flags.writeable = False
    return kinds, codes, kind_before, kind_rank


@lru_cache(maxsize=16)
def _option_flags(options: tuple[str, ...]) -> tuple[np.ndarray, tuple[bool, ...], int | None]:
    """``_Greedy``'s [R] whether each option recomputes, the same but for the last option as
    ``_heads``' key, and the index of "none" (None if absent). Read-only; cached."""
    recomputes = np.array([option != "none" for option in options])
    recomputes.flags.writeable = False
    return recomputes, tuple(recomputes[:-1].tolist()), options.index("none") if "none" in options else None


def _round_orders(problem: BalanceProblem) -> list[bool] | None:
    """Per round, whether it runs round 0's stages forward (True) or reversed (False); None if
    some round does neither (no periodic plan then)."""
    pp, v = problem.pp, problem.chunks_per_stage
    first = np.asarray(problem.stage_of[:pp])
    out = []
    for c in range(v):
        stages = np.asarray(problem.stage_of[c * pp:(c + 1) * pp])
        if np.array_equal(stages, first):
            out.append(True)
        elif np.array_equal(stages, first[::-1]):
            out.append(False)
        else:
            return None
    return out


def _virtual_counts(problem: BalanceProblem, forward: list[bool], n: np.ndarray, e: np.ndarray) -> tuple[int, ...]:
    """Layers per virtual stage of the periodic plan (n_i, e_i) given per round-0 position i."""
    pp, v = problem.pp, problem.chunks_per_stage
    out = []
    for c in range(v):
        for k in range(pp):
            i = k if forward[c] else pp - 1 - k
            out.append(int(n[i]) + (int(e[i]) if c == v - 1 else 0))
    return tuple(out)


def _chunk_counts(problem: BalanceProblem, greedy: _Greedy, counts: tuple[int, ...] | np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """[pp, v, G] layers of each kind in each stage's local chunks for a placement, and [L] the
    virtual stage of each layer (``_plan_of`` uses both)."""
    G = len(greedy.kinds)
    virtual = np.arange(problem.num_virtual_stages).repeat(counts)
    held = np.bincount(virtual * G + greedy.codes, minlength=problem.num_virtual_stages * G).reshape(-1, G)
    out = np.zeros((problem.pp, problem.chunks_per_stage, G), dtype=np.int64)
    out[problem.stage_of, problem.chunk_of] = held
    return out, virtual


_EXACT_CELLS = 1 << 16  # mixes per stage beyond which a placement keeps the greedy's recompute
_BATCH_CELLS = 1 << 18  # mixes priced in one batch (stages padded to the largest), bounding temporary memory


def _exact_stages(problem: BalanceProblem, greedy: _Greedy, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[pp, v, G, R] layers of each chunk and kind on each option: per stage, the least-time mix
    that fits on the stage holding ``held[s]`` [v, G] layers, with each kind's options dealt to
    the chunks (``chunks.dealt_chunks``); and [pp] whether it was found, False where none fits
    (or the kinds' mixes are too many), whose rows mean nothing.

    Per kind, time depends on its option counts N_r only, and so do the bytes once dealt: every
    combination of the kinds' mixes is priced, with the stage's transient where any layer
    recomputes. Same answers as ``solve.dealt_knapsack``, vectorised: every stage at once
    (``_dealt_mixes``), or the stages holding as many layers of each kind together where
    padding all of them to the largest would price too many mixes.
    """
    R = len(problem.options)
    totals = held.sum(axis=1)  # [pp, G]
    # Mixes grow with the layers of each kind: where the most of each fit, every stage does.
    most = prod(comb(n + R - 1, R - 1) for n in totals.max(axis=0).tolist())
    if most <= _EXACT_CELLS and problem.pp * most <= _BATCH_CELLS:  # the usual case: every stage in one batch
        choice, seconds = _dealt_mixes(problem, greedy, slice(None), held)
        return choice, np.isfinite(seconds)
    choice = np.zeros((*held.shape, R), dtype=np.int64)
    found = np.zeros(problem.pp, dtype=bool)
    if most <= _EXACT_CELLS:
        priced = np.arange(problem.pp)
    else:
        sizes = np.prod([[comb(int(n) + R - 1, R - 1) for n in row] for row in totals.tolist()], axis=1)  # mixes per stage
        priced = np.flatnonzero(sizes <= _EXACT_CELLS)
    if not len(priced):
        return choice, found
    padded = len(priced) * (most if len(priced) == problem.pp else
                            prod(comb(n + R - 1, R - 1) for n in totals[priced].max(axis=0).tolist()))
    if padded <= _BATCH_CELLS:
        batches = [priced]
    else:
        signature = [tuple(row) for row in totals[priced].tolist()]
        batches = [priced[[i for i, s in enumerate(signature) if s == key]] for key in dict.fromkeys(signature)]
    for stages in batches:
        choice[stages], seconds = _dealt_mixes(problem, greedy, stages, held[stages])
        found[stages] = np.isfinite(seconds)
    return choice, found


@lru_cache(maxsize=16)
def _upper_ones(R: int) -> np.ndarray:
    """[R, R] integer ones on and above the diagonal: x @ it is x's running sum along its last
    axis, exactly (read-only; cached)."""
    out = np.triu(np.ones((R, R), dtype=np.int64))
    out.flags.writeable = False
    return out


@lru_cache(maxsize=256)
def _heads(limit: int, recomputes: tuple[bool, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_dealt_mixes``' counts of a kind on every option but the last, at most ``limit`` layers in
    all (``dp._at_most``): [K, R − 1] the counts, [K] their sum, and [K] whether a layer runs an
    option that recomputes (``recomputes`` per option). Read-only; cached, as they depend on the
    integers only."""
    heads = _at_most(limit, len(recomputes))
    layers = heads.sum(axis=1)
    recomputing: np.ndarray = np.any(heads[:, list(recomputes)] > 0, axis=1)
    for array in (layers, recomputing):
        array.flags.writeable = False
    return heads, layers, recomputing


def _dealt_mixes(problem: BalanceProblem, greedy: _Greedy, stages: np.ndarray | slice, counts: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``_exact_stages`` for S queries at once, stage ``stages[i]`` holding ``counts[i]`` [v, G]
    layers per chunk and kind: [S, v, G, R] the least-time dealt mix of each and [S] its seconds
    per micro-batch (+inf where none fits). ``stages``: a slice where they are every stage in
    order, which spares gathering the per-stage tables.

    Each kind's mixes are padded to the most layers a stage holds: a mix is its counts on the
    first R − 1 options (``dp._at_most``, in the order of ``dp._compositions``), the last
    option taking the rest, void where that is negative. The first least-time combination in
    that order wins, as in ``solve.dealt_knapsack``.
    """
    from ndplan.balance.chunks import _dealt_slots

    v, G = counts.shape[1:]
    R, S = len(problem.options), len(counts)
    limit = problem.memory_limit_bytes * (1 - _MARGIN)
    grid = (S,) + (1,) * G  # per stage, broadcast over every kind's mixes
    bytes_total: np.ndarray = greedy.base_bytes[stages].reshape(grid)
    kind_ordered, kind_times, kind_recomputes, kind_present, kind_chunks = [], [], [], [], []
    held = counts.sum(axis=1)  # [S, G] layers of each kind
    most_held = held.max(axis=0).tolist()  # [G] the most layers of each kind a stage holds
    # In-flight weight of the first k dealt slots of each kind, every stage and kind at once.
    slots, first, capacity, order = _dealt_slots(counts.transpose(0, 2, 1), greedy.flight[stages], max(most_held),
                                                 greedy.flight_order[stages])  # [S, G, most layers + 1], ...
    cell = np.arange(S * G).reshape(S, G, 1)  # flat (stage, kind), to index its row of ``slots`` and ``first``
    first_slot = cell[:, :, :, None] * slots.shape[2]  # [S, G, 1, 1] flat index of each stage's and kind's slots
    for g in range(G):
        heads, head_layers, head_recomputes = _heads(most_held[g], greedy.head_recomputes)  # [K, R − 1], [K], [K]
        rest = held[:, g, None] - head_layers  # [S, K] layers on the last option
        mixes = np.empty((S, len(heads), R), dtype=np.int64)
        mixes[:, :, :-1] = heads
        mixes[:, :, -1] = np.maximum(rest, 0)
        ordered = mixes.take(greedy.by_activation[g], axis=2)  # options most bytes first
        ends = ordered @ _upper_ones(R)  # [S, K, R] slots dealt after each option (a running sum; faster than cumsum here)
        last = first_slot[:, g] + ends
        weight = slots.take(last) - slots.take(last - ordered)  # [S, K, R]
        kind_bytes = mixes @ greedy.static[g] + weight @ greedy.falling_activation[g]
        if greedy.extra is not None:  # what recomputing adds per layer on each stage
            kind_bytes = kind_bytes + (mixes * greedy.extra[stages, g][:, None, :]).sum(axis=2)
        shape = (S,) + (1,) * g + (-1,) + (1,) * (G - 1 - g)
        np.putmask(kind_bytes, rest < 0, np.inf)  # a void mix holds +inf bytes: it never fits
        bytes_total = bytes_total + kind_bytes.reshape(shape)
        kind_times.append((mixes @ greedy.time[g]).reshape(shape))
        # Some layer recomputes: on one of the first R − 1 options (the same for every stage) or on the last.
        recomputing = head_recomputes | (rest > 0) if greedy.recomputes[-1] else np.broadcast_to(head_recomputes, rest.shape)
        kind_recomputes.append(recomputing.reshape(shape))
        if greedy.charges is not None:  # which options the mix runs, for their own bytes
            kind_present.append((mixes > 0).reshape(*shape, R))
        kind_ordered.append(ordered)
        if greedy.chunk is not None:  # each chunk's sum of the dealt options' chunk bytes
            in_order = greedy.chunk[stages, :, g][np.arange(S)[:, None], order]  # [S, v, R], chunks fewest in flight first
            dealt = np.zeros((S, first.shape[2] + 1, v), dtype=np.int64)  # of the first k slots, on the i-th chunk
            np.cumsum(first[:, g, :, None] % v == np.arange(v), axis=1, out=dealt[:, 1:])
            sums = np.zeros((S, len(heads), v))
            for q, r in enumerate(greedy.by_activation[g].tolist()):
                if in_order[..., r].any():
                    held_q = (dealt[np.arange(S)[:, None], ends[:, :, q]]
                              - dealt[np.arange(S)[:, None], ends[:, :, q] - ordered[:, :, q]])  # [S, K, v]
                    sums += held_q * in_order[:, None, :, r]
            kind_chunks.append(sums.reshape(*shape, v))
    time_total, any_recompute = kind_times[0], kind_recomputes[0]
    for g in range(1, G):
        time_total, any_recompute = time_total + kind_times[g], any_recompute | kind_recomputes[g]
    # The transient added in place where a layer recomputes (bytes_total is this call's own).
    memory = np.add(bytes_total, greedy.transient[stages].reshape(grid), out=bytes_total, where=any_recompute)
    if greedy.charges is not None:  # each option's own bytes where some kind's mix runs it
        present = kind_present[0]
        for g in range(1, G):
            present = present | kind_present[g]
        memory = memory + (present * greedy.charges[stages].reshape(*grid, R)).sum(axis=-1)
    if kind_chunks:  # the largest chunk sum over every kind's dealt layers, once
        sums = kind_chunks[0]
        for g in range(1, G):
            sums = sums + kind_chunks[g]
        offset = problem.chunk_offset[stages].reshape(grid)
        memory = memory + np.maximum(sums.max(axis=-1) - offset, 0.0)
    # time_total has every kind's axis (a sum of G ≥ 2 broadcast ones, or the one kind's own
    # array): +inf in place where the memory does not fit.
    np.putmask(time_total, memory > limit, np.inf)
    seconds = time_total.reshape(S, -1)
    mix = seconds.argmin(axis=1)
    best = np.unravel_index(mix, memory.shape[1:])  # per kind [S] its mix
    # Deal each stage's mix: options most bytes first, over the chunks' slots in turn
    # (``chunks.dealt_chunks``), every stage and kind at once. Option r takes the slots
    # [ends_r − n_r, ends_r); after k slots the i-th chunk (fewest in flight first) holds
    # min(capacity_i, t + [i ≤ i_k]) of them, (t, i_k) the turn and chunk of the k-th slot.
    stage = np.arange(S)
    chosen = np.empty((S, G, R), dtype=np.int64)  # the chosen mixes, options most bytes first
    for g in range(G):
        chosen[:, g] = kind_ordered[g][stage, best[g]]
    bounds = np.empty((2, S, G, R), dtype=np.int64)  # slots dealt before each option's first and after its last
    np.matmul(chosen, _upper_ones(R), out=bounds[1])
    np.subtract(bounds[1], chosen, out=bounds[0])
    most = first.shape[2]
    at = cell * most  # [S, G, 1] flat index of each stage's and kind's row of ``first``
    turn, place = np.divmod(first.take(at + np.maximum(bounds - 1, 0)), v) if most else (bounds, bounds)
    dealt = np.minimum(capacity[:, :, None, :], turn[..., None] + (np.arange(v) <= place[..., None]))
    dealt *= bounds[..., None] > 0  # [2, S, G, R, v] slots of the i-th chunk before each option's first and after its last
    choice = np.empty((S, v, G, R), dtype=np.int64)
    choice[stage[:, None, None, None], order[:, None, None, :], np.arange(G)[None, :, None, None],
           greedy.by_activation[None, :, :, None]] = dealt[1] - dealt[0]
    least = seconds[stage, mix] + greedy.base_time[stages]  # the least, at ``mix``
    greedy._step_mask(least, stages, counts)  # a stage overflowing the optimizer step: none fits
    return choice, least


class _Solved(NamedTuple):
    """The greedy's answers (``_Greedy.solve``) for a placement's stages, by stage: ``held``
    [pp, v, G] the layers per chunk and kind they answer, and ``answers`` its four [pp] arrays."""

    held: np.ndarray
    answers: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _plan_of(problem: BalanceProblem, greedy: _Greedy, counts: tuple[int, ...], exact: bool = True,
             solved: _Solved | None = None) -> tuple[Plan, PlanCost] | None:
    """A placement with each stage's least-time recompute that fits (``_exact_stages``; the
    greedy's where the mixes are too many or ``exact`` is False), evaluated; None if a stage
    cannot fit. ``solved``: the greedy's answers for the stages, if known (a DP solved them)."""
    sizes = np.asarray(counts)
    per_chunk, virtual = _chunk_counts(problem, greedy, sizes)
    # ``solve`` answers each query alone (every operation runs along the queries), so answers
    # from another batch are the ones it would give here, where they hold the same layers.
    # (A plain comparison: np.array_equal's own checks cost more than it here.)
    if solved is not None and solved.held.shape == per_chunk.shape and bool((solved.held == per_chunk).all()):
        time, plain, whole, partial = solved.answers
    else:
        time, plain, whole, partial = greedy.solve(np.arange(problem.pp), per_chunk)
    # The greedy charges a recomputing stage every option's own bytes and ranks chunk terms
    # roughly (``_Greedy``), so with either the exact recompute may fit where it does not.
    if not np.isfinite(time).all() and ((greedy.charges is None and greedy.chunk is None) or not exact):
        return None
    if exact:
        choice, found = _exact_stages(problem, greedy, per_chunk)  # [pp, v, G, R], [pp]
    else:
        choice, found = np.empty((*per_chunk.shape, len(problem.options)), dtype=np.int64), np.zeros(problem.pp, bool)
    if not (found | np.isfinite(time)).all():
        return None
    if not found.all():  # the greedy's recompute where the exact one is missing
        for s in np.flatnonzero(~found).tolist():
            choice[s] = greedy.options(s, per_chunk[s], bool(plain[s]), int(whole[s]), int(partial[s]))
    # Each layer takes, in model order within its chunk and kind, the options in turn: the
    # layer of rank k among its (virtual stage, kind) takes the first option whose running
    # count exceeds k (inside a chunk their order changes neither memory nor time).
    held = choice[problem.stage_of, problem.chunk_of]  # [V, G, R]
    # A virtual stage's layers are a run: a layer's rank in its (virtual stage, kind) is its
    # rank among its kind less the layers of its kind before the run (``_Greedy.kind_before``).
    first = (sizes.cumsum() - sizes).repeat(sizes)  # [L] first layer of each layer's virtual stage
    rank = greedy.kind_rank - greedy.kind_before.take(greedy.codes * (problem.num_layers + 1) + first)
    running = held.cumsum(axis=2)[virtual, greedy.codes]  # [L, R]
    option = (rank[:, None] >= running).sum(axis=1)
    plan = Plan(counts, tuple(map(problem.options.__getitem__, option.tolist())))
    cost = evaluate_codes(problem, sizes, greedy.cost_columns, greedy.cost_code[greedy.codes, option], greedy.evaluation)
    return (plan, cost) if cost.fits else None


def _periodic(problem: BalanceProblem, greedy: _Greedy, window: int, R: int) -> tuple[int, ...] | None:
    """The best periodic placement of R layers per round the DP finds (layers per virtual
    stage), or None."""
    forward = _round_orders(problem)
    pp, v, L = problem.pp, problem.chunks_per_stage, problem.num_layers
    r = L - v * R  # leftover layers, one each on r stages of the last round
    if forward is None or R < pp or not 0 <= r <= pp:
        return None
    low, high = max(1, R // pp - window), min(R - pp + 1, -(-R // pp) + window)
    n_values = np.arange(low, high + 1)
    extras = np.arange(min(r, 1) + 1)
    n_of = np.repeat(n_values, len(extras))  # lengths j ↔ (n, e)
    e_of = np.tile(extras, len(n_values))
    lengths = n_of * (r + 1) + e_of
    P = (R + 1) * (r + 1)
    position = np.arange(P)
    b_end, eb_end = np.divmod(position, r + 1)
    valid = (b_end[None] >= n_of[:, None]) & (eb_end[None] >= e_of[:, None])  # [J, P]
    start = np.where(valid, position[None] - lengths[:, None], 0)
    b, eb = b_end[None] - n_of[:, None], eb_end[None] - e_of[:, None]  # [J, P] before the stage
    G = len(greedy.kinds)
    prefix = np.zeros((G, L + 1), dtype=np.int64)  # layers of each kind before each position
    prefix[:, 1:] = np.cumsum(greedy.codes[None] == np.arange(G)[:, None], axis=1)
    cost = np.full((pp, len(lengths), P), np.inf)
    J_index, P_index = np.nonzero(valid)
    stages = np.asarray(problem.stage_of[:pp])
    # A round's chunk starts where the layers before the stage in that round end: the same for
    # every stage position, so each round's layers per kind are computed once per cell.
    held_by_round = np.zeros((v, len(J_index), G), dtype=np.int64)
    for c in range(v):
        last = c == v - 1
        held = n_of[J_index] + (e_of[J_index] if last else 0)
        before = b[J_index, P_index] + (eb[J_index, P_index] if last else 0)
        total = R + (r if last else 0)
        offset = c * R + (before if forward[c] else total - before - held)
        held_by_round[c] = (prefix[:, offset + held] - prefix[:, offset]).T
    counts = np.zeros((pp, len(J_index), v, G), dtype=np.int64)
    for i in range(pp):
        for c in range(v):
            chunk = int(problem.chunk_of[c * pp + (i if forward[c] else pp - 1 - i)])
            counts[i, :, chunk] = held_by_round[c]
    # Most cells hold the same layers as many others (only the few near a kind boundary
    # differ): solve each distinct (stage, layers per chunk and kind) once.
    queries = counts.reshape(-1, v * G)
    query_stage = np.repeat(stages, len(J_index))
    if float(pp) * float(L + 1) ** (v * G) < 2.0**62:  # one integer per query: a fast unique
        key = query_stage * (L + 1) ** (v * G) + queries @ ((L + 1) ** np.arange(v * G))
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(np.column_stack([query_stage, queries]), axis=0, return_index=True,
                                      return_inverse=True)
    time, *_ = greedy.solve(query_stage[first], queries[first].reshape(-1, v, G))
    cost[:, J_index, P_index] = time[inverse.reshape(-1)].reshape(pp, -1)
    table = Table(start, cost, lengths)
    z_star = min_max(table)
    if not np.isfinite(z_star):
        return None
    _, _, encoded = min_sum(table, z_star)
    if not encoded:
        return None
    n, e = np.divmod(np.asarray(encoded), r + 1)
    return _virtual_counts(problem, forward, n, e)


def _even_out(problem: BalanceProblem, greedy: _Greedy, counts: tuple[int, ...] | np.ndarray) -> tuple[int, ...]:
    """The placement with each stage's layers moved between its own chunks (same stage totals)
    until their loads are even (``even_chunks``): one layer at a time from the heaviest chunk
    that holds more than one to the lightest. A move shifts which kinds later chunks hold, so
    loads are recomputed after every move (a bounded number of them)."""
    out = np.array(counts, dtype=np.int64)
    spread, weights, chunk_of = greedy.loads.spread, greedy.loads.weights, greedy.loads.virtual_at  # weighed once per problem
    for _ in range(problem.num_layers * problem.pp):
        loads = chunk_loads(problem, out, weights)  # [pp, v]
        held = out[chunk_of]
        movable = (held > 1) & (loads > loads.min(axis=1, keepdims=True) + spread + 1e-9)
        if not movable.any():
            break
        stage = int(np.flatnonzero(movable.any(axis=1))[0])
        heaviest = int(np.argmax(np.where(movable[stage], loads[stage], -np.inf)))
        out[chunk_of[stage, heaviest]] -= 1
        out[chunk_of[stage, int(loads[stage].argmin())]] += 1
    return tuple(out.tolist())


def uniform_candidates(problem: BalanceProblem, greedy: _Greedy | None = None, *, mixed: bool = True
                       ) -> list[tuple[Plan, PlanCost]]:
    """The uniform placement (what frameworks run by default) with each recompute option on
    every layer, and (``mixed``) with each stage's least-time dealt recompute; those that fit."""
    greedy = greedy or _Greedy(problem)
    counts = uniform_counts(problem)
    # Every option at once: one evaluation of R plans of the same placement.
    costs = evaluate_codes_many(problem, counts, greedy.cost_columns, greedy.cost_code[greedy.codes].T, greedy.evaluation)
    found = [(Plan(counts, (option,) * problem.num_layers), cost)
             for option, cost in zip(problem.options, costs, strict=True) if cost.fits]
    if mixed:
        planned = _plan_of(problem, greedy, counts)
        found += [planned] if planned is not None else []
    return found


def solve_rounds(problem: BalanceProblem, window: int = WINDOW) -> tuple[Plan, PlanCost] | None:
    """The heuristic plan of a pipeline with several chunks per stage (module docstring): even
    chunks, or the uniform placement if that is faster; None only if neither fits."""
    greedy = _Greedy(problem)
    found = uniform_candidates(problem, greedy)
    per_round = problem.num_layers // problem.chunks_per_stage
    placements = [_periodic(problem, greedy, window, R) for R in (per_round, per_round - 1)]
    # The placements ranked by the greedy's (undealt) recompute; the best that fits once dealt.
    ranked = []
    for placement in dict.fromkeys(_even_out(problem, greedy, c) for c in placements if c is not None):
        estimate = _plan_of(problem, greedy, placement, exact=False)
        if estimate is not None:
            ranked.append((estimate[1].step_s, placement))
    for _, placement in sorted(ranked):
        planned = _plan_of(problem, greedy, placement)
        if planned is not None:
            found.append(planned)
            break
    return min(found, key=lambda f: f[1].step_s) if found else None


__all__ = ["solve_rounds", "uniform_candidates"]
