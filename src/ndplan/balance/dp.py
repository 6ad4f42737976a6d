"""Exact balancing by dynamic programming, when every physical stage holds one virtual stage.

With one chunk per stage (vpp = 1) a plan splits the layer sequence into V contiguous segments,
segment v on virtual stage v, and a stage's memory and time depend on its own segment only.
Given the segments, each stage should run the recompute mix of least time that fits (the step
time Σ_s T_s + (m − 1)·max_s T_s grows with every T_s, and stages share no memory), so a
segment has one cost, in seconds per micro-batch:

    t(v, a, b) = least time of layers [a, b) on virtual stage v that fits, +inf if none fits

(``_StageModel``, exact), and the problem is, over splits 0 = p_0 < p_1 < … < p_V = L,

    min  Σ_v t_v + (m − 1)·max_v t_v,    t_v = t(v, p_v, p_{v+1}).

Why ``_search`` is exact. For a threshold Z let S(Z) be the least Σ_v t_v over splits whose
every segment costs ≤ Z (a min-sum DP over the segments of cost ≤ Z); S does not increase with
Z. The optimal split, of bottleneck M, has sum ≥ S(M), so S(M) + (m − 1)·M ≤ OPT; and the split
reaching S(Z) has bottleneck ≤ Z, so OPT ≤ S(Z) + (m − 1)·Z for every Z. Hence

    OPT = min over Z of  S(Z) + (m − 1)·Z,

where Z ranges over the finite segment costs (the optimal bottleneck is one of them), at least
Z* (the least bottleneck, a min-max DP) and below (best so far − S(∞)) / (m − 1), since no
larger Z can do better. Between two thresholds Z_i < Z_j no candidate can beat
S(Z_j) + (m − 1)·Z_{i+1} (S does not increase), which prunes a bisection over the sorted
candidates; in practice a handful of DP passes settle it. Each pass sums a split's costs in
stage order whatever Z is, so S is monotone in floating point too.

The heuristic (``window``) keeps only segments of about L / V layers (wider while its plan
recomputes with a stage at the window's edge, ``problem.window_binds``) and runs two passes: the
least bottleneck Z*, then the least sum under it, S(Z*); it returns that split or the uniform
one (which is in the window) if uniform is better, so it is never slower than uniform. With
nothing in the window fitting it falls back to the exact search, so it finds a plan whenever
one exists. The exact search starts from the heuristic's plan, whose step time bounds how many
layers a stage of the optimum can hold (``solve_dp``), so that long segments are never costed.

Cost: the stage table is a few vectorised array operations over (stage, layer counts, options
enumerated); each DP pass is V array operations over [segment lengths, end layer]. No MILP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import copy
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, combinations, product
from typing import Protocol

import numpy as np

from ndplan.balance.problem import BalanceProblem, Plan, PlanCost, evaluate, heuristic_windows, window_binds

_CHUNK = 1 << 18  # cells (queries × minor splits × tails) per vectorised batch: bounds temporary memory
_ROUNDING = 1e-9  # a quotient this close above an integer may be that integer rounded up
_PRUNE_FROM = 64  # minor splits of one kind beyond which the dominated ones are dropped


def one_chunk_per_stage(problem: BalanceProblem) -> bool:
    """Every physical stage holds exactly one virtual stage (no interleaving): the DP applies."""
    return sorted(np.asarray(problem.stage_of).tolist()) == list(range(problem.pp))


@lru_cache(maxsize=256)
def _compositions(total: int, parts: int) -> np.ndarray:
    """[count, parts] every way to write ``total`` as an ordered sum of ``parts`` non-negative
    ints (read-only; cached, it depends on the two integers only)."""
    rows = [(*c, total - sum(c)) for c in product(range(total + 1), repeat=parts - 1) if sum(c) <= total]
    out = np.array(rows, dtype=np.int64).reshape(len(rows), parts)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=256)
def _at_most(limit: int, parts: int) -> np.ndarray:
    """[count, parts] non-negative ints with sum ≤ ``limit`` (read-only, cached)."""
    rows = [c for c in product(range(limit + 1), repeat=parts) if sum(c) <= limit]
    out = np.array(rows, dtype=np.int64).reshape(len(rows), parts)
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class _Best:
    """The least-time recompute of each stage query, and how it is reached."""

    time: np.ndarray  # [Q] seconds per micro-batch, embedding/head included; +inf if nothing fits
    plain: np.ndarray  # [Q] bool: every layer "none", no transient (case A)
    split: np.ndarray  # [Q] index into the minor splits of the query's minor counts
    tail: np.ndarray  # [Q] index into the major kind's tail counts
    k: np.ndarray  # [Q] major layers on option q (the closed form's k)


class _StageModel:
    """Least-time recompute of one virtual stage given how many layers of each kind it holds.

    Stage v with n_g layers of kind g: option r of kind g costs t[g, r] seconds and
    μ[v, g, r] = static[g, r] + in_flight[v]·activation[g, r] bytes per layer. Choose counts
    n[g, r] ≥ 0 with Σ_r n[g, r] = n_g minimising Σ n[g, r]·t[g, r] subject to

        Σ n[g, r]·μ[v, g, r] ≤ budget_v − transient_v·[some layer recomputes],
        budget_v = limit − fixed[s] − (embedding / head bytes on v).

    Two cases, the better one wins: (A) every layer "none", against budget_v; (B) the transient
    charged and every option allowed (an all-"none" mix here is never better than A). In B the
    minor kinds (all but the most numerous, the major one) enumerate their splits; the major
    kind enumerates its counts on the options other than a pair (p, q) with t_q ≥ t_p (the
    "tail"), and its n' remaining layers take p except the fewest k on q that fit, since more
    on q only adds time:

        x = budget − (bytes of the minor split and the tail) − n'·μ_p   (bytes to spare)
        k = 0 if x ≥ 0;  ⌈x / (μ_q − μ_p)⌉ if x < 0 and μ_q < μ_p (infeasible if k > n');
        infeasible if x < 0 and μ_q ≥ μ_p.

    The closed form replaces one enumerated dimension, so a stage costs O(splits · n^(R − 2))
    cells (R options; O(splits · n) for none/selective/full) and all stages are a few
    vectorised array operations. Minor splits that another split of the same kind beats on
    every count are dropped when there are many (``_minor_splits``).
    """

    def __init__(self, problem: BalanceProblem) -> None:
        # Major kind last: the closed form handles it, so the enumerated minor splits stay few.
        order = {kind: problem.layer_kinds.count(kind) for kind in set(problem.layer_kinds)}
        self.kinds = tuple(sorted(order, key=lambda k: (order[k], k)))
        options = problem.options
        V = problem.num_virtual_stages
        in_flight = problem.in_flight_of_virtual().astype(float)
        costs = [[problem.costs[(kind, option)] for option in options] for kind in self.kinds]
        self.time = np.array([[c.time_s for c in row] for row in costs])  # [G, R]
        static = np.array([[c.static_bytes for c in row] for row in costs])
        activation = np.array([[c.activation_bytes for c in row] for row in costs])
        self.memory = static[None] + in_flight[:, None, None] * activation[None]  # [V, G, R]
        # What recomputing layers adds per layer on their stage (``BalanceProblem.layer_extra``).
        self.extra = None if not problem.has_layer_extra else problem.layer_extra(self.kinds)
        if self.extra is not None:
            self.memory = self.memory + self.extra[np.asarray(problem.stage_of).astype(int)]
        self.static, self.activation = static, activation
        self.none = options.index("none") if "none" in options else None
        self.recomputes = np.array([option != "none" for option in options])
        stages = np.asarray(problem.stage_of).astype(int)
        fixed = np.asarray(problem.fixed_bytes, dtype=float)[stages]
        self.base_time = np.zeros(V)
        extra_bytes = np.zeros(V)
        for v, extra in ((0, problem.first_extra), (V - 1, problem.last_extra)):
            self.base_time[v] += extra.time_s
            extra_bytes[v] += extra.static_bytes + in_flight[v] * extra.activation_bytes
        transient = (np.zeros(V) if problem.recompute_transient_bytes is None
                     else np.asarray(problem.recompute_transient_bytes, dtype=float)[stages])
        self.budget = problem.memory_limit_bytes - fixed - extra_bytes  # [V]
        # The optimizer step's room per virtual stage and each kind's bytes there: a query over
        # it costs +inf whatever its recompute (``solve``).
        room = problem.step_room()
        self.step_room = None if room is None else room[stages]
        self.step_bytes = problem.step_bytes_of(self.kinds)
        self.budget_rc = self.budget - transient
        self.p = int(np.argmin(self.time[-1]))  # fastest option of the major kind
        self._derive()
        # Options with bytes of their own, once on a stage where they run
        # (``BalanceProblem.option_charges``): one case per set of them allowed (with "none"),
        # its bytes charged and the other options' layers priced out of reach; the best case of
        # each query wins (a set charged but not all run only costs more than its own case).
        # This model is the case of every option; ``cases`` the others.
        self.cases: list[_StageModel] = []
        self.charged = problem.has_option_charges  # no minor split dominates another across cases
        if self.charged:
            charges = problem.option_charges()[stages]  # [V, R]
            recomputing = [r for r, option in enumerate(options) if option != "none"]
            self.budget_rc = self.budget_rc - charges[:, recomputing].sum(axis=1)
            # Out of reach: more than any budget, small enough that sums keep their bytes exact.
            out_of_reach = 16.0 * (float(np.abs(self.memory).max()) + float(np.abs(self.budget).max()) + 1.0)
            # An option whose bytes are nothing on every stage costs nothing to allow: cases
            # differ only in the options with bytes (one of two at most, as ``build`` gives them).
            costly = [r for r in recomputing if bool(np.any(charges[:, r] != 0))]
            for size in range(len(costly)):
                for kept in combinations(costly, size):
                    allowed = [r for r in recomputing if r not in costly or r in kept]
                    if not allowed:
                        continue
                    case = copy(self)
                    case.cases = []
                    banned = [r for r in recomputing if r not in allowed]
                    case.memory = self.memory.copy()
                    case.memory[:, :, banned] = out_of_reach
                    case.budget_rc = self.budget - transient - charges[:, list(allowed)].sum(axis=1)
                    case._derive()
                    self.cases.append(case)

    def _derive(self) -> None:
        """The kernel's constants from ``memory`` and the options' seconds (``__init__``; a
        case's model derives its own from its memory)."""
        options_count = self.memory.shape[2]
        others = [r for r in range(options_count) if r != self.p]
        self.q = others[0] if others else self.p  # a single option: q = p and k is 0
        self.tail_options = others[1:]
        # Per-stage constants of the kernel, so that a batch only gathers them by stage.
        major_memory = self.memory[:, -1]  # [V, R]
        self.mu_p, self.mu_q = major_memory[:, self.p], major_memory[:, self.q]
        self.d_mu = self.mu_q - self.mu_p
        self.divisor = np.where(self.d_mu < 0, self.d_mu, -np.inf)  # −inf: no division by zero, k = 0
        self.mu_tail = major_memory[:, self.tail_options]  # [V, R − 2]
        self.t_p, self.d_t = float(self.time[-1, self.p]), float(self.time[-1, self.q] - self.time[-1, self.p])
        self.t_tail = self.time[-1, self.tail_options]
        self.minor_time = self.time[:-1].reshape(-1)  # [(G − 1)·R]
        self.minor_memory = self.memory[:, :-1].reshape(self.memory.shape[0], -1, 1)  # [V, (G − 1)·R, 1]
        if self.none is not None:
            self.plain_minor_time = self.time[:-1, self.none]
            self.plain_minor_memory = self.memory[:, :-1, self.none]  # [V, G − 1]
            self.plain_time, self.plain_memory = float(self.time[-1, self.none]), major_memory[:, self.none]

    def _minor_splits(self, row: tuple[int, ...]) -> np.ndarray:
        """[splits, G − 1, R]: the ways to spread each minor kind's layers over the options, but
        those another split of the same kind beats everywhere (no more time, static and
        activation bytes, so no more bytes on any stage, and recomputing no more often: the
        transient too)."""
        R = self.memory.shape[2]
        if not row:
            return np.zeros((1, 0, R), dtype=np.int64)
        if len(row) == 1:
            return self._undominated(0, row[0])[:, None, :]
        parts = [self._undominated(g, c) for g, c in enumerate(row)]
        return np.array([np.stack(combo) for combo in product(*parts)]).reshape(-1, len(row), R)

    def _undominated(self, g: int, count: int) -> np.ndarray:
        """[splits, R] of ``count`` layers of minor kind g, dominated splits dropped when there
        are many (a few are cheaper to keep than to sort)."""
        splits = _compositions(count, self.memory.shape[2])
        if len(splits) <= _PRUNE_FROM or self.extra is not None or self.charged:  # per-stage bytes: no split dominates everywhere
            return splits
        time, static, activation = splits @ self.time[g], splits @ self.static[g], splits @ self.activation[g]
        if np.ptp(self.static[g]) == 0:  # the usual case: every split holds the same static bytes
            static = np.zeros(len(splits))  # (their float sums may differ in the last bit)
        recomputes = (splits @ self.recomputes) > 0
        # Within a group of equal (recomputes, static bytes), in order of time, a split survives
        # if its activation bytes are below every faster one's; the groups are sorted apart and
        # shifted below each other so that one running minimum serves them all.
        order = np.lexsort((activation, time, static, recomputes))
        group = np.cumsum(np.concatenate([[0], (np.diff(static[order]) != 0) | (np.diff(recomputes[order]) != 0)]))
        key = activation[order] - group * (np.ptp(activation) + 1.0)
        keep = np.concatenate([[True], key[1:] < np.minimum.accumulate(key)[:-1]])
        return splits[np.sort(order[keep])]

    def solve(self, stage: np.ndarray, rows: np.ndarray, row: np.ndarray, low: int, N: int
              ) -> tuple[_Best, list[np.ndarray], np.ndarray]:
        """Least-time recompute of P·N stage queries: for each pair i, virtual stage ``stage[i]``
        holding ``rows[row[i]]`` layers of the minor kinds ([C, G − 1]), and each major count
        n = low … low + N − 1; query i·N + (n − low).

        Returns the optimum per query, each row's minor splits ([S_c, G − 1, R] layer counts per
        kind and option) and the major kind's tail counts ([K, R − 2]).
        """
        found, splits, tails = self._solve(stage, rows, row, low, N)
        for case in self.cases:  # options' own bytes: each set of them allowed, the best wins
            other = case._solve(stage, rows, row, low, N)[0]
            better = other.time < found.time
            found = _Best(np.where(better, other.time, found.time), np.where(better, other.plain, found.plain),
                          np.where(better, other.split, found.split), np.where(better, other.tail, found.tail),
                          np.where(better, other.k, found.k))
        if self.step_room is not None:  # stages whose layers overflow the optimizer step never fit
            held = (rows[row] @ self.step_bytes[:-1])[:, None] + np.arange(low, low + N)[None, :] * self.step_bytes[-1]
            found.time[(held > self.step_room[stage][:, None]).reshape(-1)] = np.inf
        return found, splits, tails

    def _solve(self, stage: np.ndarray, rows: np.ndarray, row: np.ndarray, low: int, N: int
               ) -> tuple[_Best, list[np.ndarray], np.ndarray]:
        """``solve`` under the forward/backward memory only."""
        needed = set(row.tolist())  # rows no pair uses need no splits
        splits = [self._minor_splits(tuple(int(c) for c in r)) if i in needed else np.zeros((0,))
                  for i, r in enumerate(rows)]
        tails = _at_most(low + N - 1, len(self.tail_options))
        n = np.arange(low, low + N)
        rest = n[:, None] - tails.sum(axis=1)  # [N, K] major layers on p or q
        extra_time = rest * self.t_p + tails @ self.t_tail  # [N, K] their seconds, all on p
        width = np.array([len(splits[c]) for c in row])  # minor splits per pair
        K = len(tails)
        # Batches of whole pairs under _CHUNK cells (pairs × splits × major counts × tails); a
        # pair too big on its own is cut along its major counts.
        cells = np.cumsum(width) * (N * K)
        if cells[-1] <= _CHUNK:  # one batch: the usual case
            found = self._batch(stage, [splits[c] for c in row], width, rows[row], n, tails, rest, extra_time)
            return _Best(*(x.reshape(-1) for x in found)), splits, tails
        P = len(stage)
        out = (np.empty((P, N)), np.empty((P, N), bool), *(np.empty((P, N), np.int64) for _ in range(3)))
        first = 0
        while first < P:
            done = int(cells[first - 1]) if first else 0
            last = max(first + 1, int(np.searchsorted(cells, done + _CHUNK, side="right")))
            batch = np.arange(first, last)
            step = max(1, _CHUNK // (int(width[batch].sum()) * K))
            for low_n in range(0, N, step):
                part = slice(low_n, low_n + step)
                found = self._batch(stage[batch], [splits[c] for c in row[batch]], width[batch], rows[row[batch]],
                                    n[part], tails, rest[part], extra_time[part])
                for target, values in zip(out, found, strict=True):
                    target[first:last, part] = values
            first = last
        return _Best(*(x.reshape(-1) for x in out)), splits, tails

    def _batch(self, stage: np.ndarray, splits: list[np.ndarray], width: np.ndarray, minors: np.ndarray,
               n: np.ndarray, tails: np.ndarray, rest: np.ndarray, extra_time: np.ndarray) -> tuple[np.ndarray, ...]:
        """Pairs of one batch, their minor splits flattened into candidates ("pair-splits");
        arrays broadcast to [candidate, major count, tail] (class docstring). Results are
        [pair, major count]."""
        P, N, K = len(stage), len(n), len(tails)
        many = minors.shape[1] > 0 and bool((width > 1).any())
        of = np.repeat(np.arange(P), width) if many else np.arange(P)  # pair of each candidate
        C = len(of)
        # Virtual stage of each candidate; a slice when they are all stages in order (one layer
        # kind), which spares the gathers.
        at: np.ndarray | slice = slice(None) if not many and P == self.memory.shape[0] and bool(
            (stage == np.arange(P)).all()) else stage[of]
        of_pair = slice(None) if isinstance(at, slice) else stage
        # Tails lead, so that the reductions over them are fast elementwise ones across slabs.
        # Bytes to spare (x) and seconds, before the layers on q: [K, candidates, N].
        spare = (self.budget_rc[at][None, :, None] - rest.T[:, None, :] * self.mu_p[at][None, :, None]
                 - (tails @ self.mu_tail[at].T)[:, :, None])
        time = extra_time.T[:, None, :]
        if minors.shape[1]:
            counts = np.concatenate(splits).reshape(C, -1)  # [candidates, (G − 1)·R]
            spare = spare - (counts * self.minor_memory[at, :, 0]).sum(axis=1)[None, :, None]
            time = time + (counts @ self.minor_time)[None, :, None]
        d_mu = self.d_mu[at][None, :, None]
        k = np.maximum(np.ceil(spare / self.divisor[at][None, :, None] - _ROUNDING), 0.0)
        k += spare - k * d_mu < 0  # the quotient rounded down: one more
        fits = (k <= rest.T[:, None, :]) & (spare - k * d_mu >= 0)
        total = np.where(fits, time + k * self.d_t, np.inf)  # [K, candidates, N]
        tail = total.argmin(axis=0)  # [candidates, N]
        least = total.min(axis=0)
        chosen_k = k.reshape(K, -1)[tail.reshape(-1), np.arange(C * N)].reshape(C, N)
        if many:  # the best candidate of each pair: segmented minimum over its splits
            offsets = np.concatenate([[0], np.cumsum(width)[:-1]])
            pair_least = np.minimum.reduceat(least, offsets, axis=0)  # [P, N]
            index = np.where(least == pair_least[of], np.arange(len(of))[:, None], len(of))
            pick = np.minimum.reduceat(index, offsets, axis=0)  # first candidate reaching it
            split = pick - offsets[:, None]
            tail, chosen_k, least = tail[pick, np.arange(N)], chosen_k[pick, np.arange(N)], pair_least
        else:
            split = np.zeros((P, N), dtype=np.int64)
        # Case A: no layer recomputes, no transient.
        plain = np.zeros((P, N), bool)
        if self.none is not None:
            plain_time = n * self.plain_time
            plain_memory = n * self.plain_memory[of_pair][:, None]  # [P, N]
            if minors.shape[1]:
                plain_time = plain_time + (minors @ self.plain_minor_time)[:, None]
                plain_memory = plain_memory + (minors * self.plain_minor_memory[of_pair]).sum(axis=1)[:, None]
            plain = (plain_memory <= self.budget[of_pair][:, None]) & (plain_time <= least)
            least = np.where(plain, plain_time, least)
        return least + self.base_time[of_pair][:, None], plain, split, tail, chosen_k.astype(np.int64)


@dataclass(frozen=True)
class _Segments:
    """The segments [b − ℓ_j, b) each virtual stage v can hold in a complete split, and their costs."""

    lengths: np.ndarray  # [J] allowed layer counts per virtual stage, ascending and contiguous
    start: np.ndarray  # [J, L + 1] b − ℓ_j, clipped to 0
    cost: np.ndarray  # [V, J, L + 1] t(v, b − ℓ_j, b) in seconds; +inf where unreachable or nothing fits
    best: _Best  # per stage query: pair (virtual stage, minor row) i and major count n at i·N + n − low
    splits: list[np.ndarray]  # per row of minor counts, see _StageModel.solve
    tails: np.ndarray  # [K, R − 2]
    low: int
    N: int
    where: np.ndarray  # [segments] flat index into cost of each reachable segment, ascending
    query: np.ndarray | None  # [segments] its stage query (None with one kind: v·N + ℓ − low)
    row: np.ndarray | None  # [segments] its row of minor counts (None with one kind: row 0)

    def queries(self, counts: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """Stage query and minor row of each virtual stage's segment in a split."""
        V, J, ends = len(counts), len(self.lengths), self.cost.shape[2]
        j = np.asarray(counts) - int(self.lengths[0])
        if self.query is None or self.row is None:
            return (np.arange(V) * self.N + np.asarray(counts) - self.low).tolist(), [0] * V
        at = np.searchsorted(self.where, (np.arange(V) * J + j) * ends + np.cumsum(counts))
        return self.query[at].tolist(), self.row[at].tolist()


def _segments(model: _StageModel, problem: BalanceProblem, lengths: np.ndarray) -> _Segments | None:
    """Cost every segment some complete split can use (None if no split of these lengths exists).

    With lengths ℓ_min..ℓ_max, k stages hold any total in [k·ℓ_min, k·ℓ_max], so virtual stage v
    can end at b in [low_v, high_v] = [max((v+1)·ℓ_min, L − (V−1−v)·ℓ_max),
    min((v+1)·ℓ_max, L − (V−1−v)·ℓ_min)], and its segments of length ℓ end in
    [max(low_v, low_{v−1} + ℓ), min(high_v, high_{v−1} + ℓ)] (low_{−1} = high_{−1} = 0);
    the others cost +inf. A segment's cost depends on v and on how many layers of each kind
    it holds, not on where it is: the stage problems are solved once per (v, minor counts,
    major count) and gathered.
    """
    L, V, J = problem.num_layers, problem.num_virtual_stages, len(lengths)
    shortest, longest = int(lengths[0]), int(lengths[-1])
    done = np.arange(1, V + 1)
    low = np.maximum(done * shortest, L - (V - done) * longest)
    high = np.minimum(done * longest, L - (V - done) * shortest)
    if (low > high).any():
        return None
    first = np.maximum(low[:, None], np.concatenate([[0], low[:-1]])[:, None] + lengths)  # [V, J] first end
    last = np.minimum(high[:, None], np.concatenate([[0], high[:-1]])[:, None] + lengths)
    ends = np.maximum(last - first + 1, 0).reshape(-1)  # [V·J] how many ends each (v, j) reaches
    # Every reachable (v, j, b), as flat indices into [V, J, L + 1]: b runs from first to last.
    where = np.repeat(np.arange(V * J) * (L + 1) + first.reshape(-1) - np.cumsum(ends) + ends, ends)
    where += np.arange(len(where))
    start = np.maximum(np.arange(L + 1) - lengths[:, None], 0)  # [J, L + 1]
    cost = np.full(V * J * (L + 1), np.inf)
    G = len(model.kinds)
    if G == 1:  # one kind: a segment holds ℓ layers of it wherever it ends
        best, splits, tails = model.solve(np.arange(V), np.zeros((1, 0), dtype=np.int64), np.zeros(V, dtype=np.int64),
                                          shortest, J)
        cost[where] = np.repeat(best.time, ends)  # queries are (v, ℓ) in the order of the (v, j)
        return _Segments(lengths, start, cost.reshape(V, J, L + 1), best, splits, tails, shortest, J, where, None, None)
    index = {kind: g for g, kind in enumerate(model.kinds)}
    kinds = np.array([index[k] for k in problem.layer_kinds])
    prefix = np.zeros((G, L + 1), dtype=np.int64)  # layers of each kind before b
    prefix[:, 1:] = np.cumsum(kinds[None, :] == np.arange(G)[:, None], axis=1)
    stage_j, b = np.divmod(where, L + 1)
    stage, j = np.divmod(stage_j, J)
    a = b - lengths[j]
    minor = prefix[:-1, b] - prefix[:-1, a]  # [G − 1, segments] layers of each minor kind
    major = lengths[j] - minor.sum(axis=0)
    # Distinct minor-count vectors (one integer key each), and each segment's row among them.
    radix = (L + 1) ** np.arange(G - 1)
    key = minor[0] if G == 2 else radix @ minor
    if (L + 1) ** (G - 1) <= 1 << 20:  # a dense lookup is cheaper than sorting
        present = np.zeros((L + 1) ** (G - 1), bool)
        present[key] = True
        keys, row = np.flatnonzero(present), (np.cumsum(present) - 1)[key]
    else:
        keys, row = np.unique(key, return_inverse=True)
        row = row.reshape(-1)
    rows = (keys[:, None] // radix[None, :]) % (L + 1)
    # Queries: each (virtual stage, minor row) pair some segment has, times every major count
    # in range; segments that differ only in position share their query.
    low_major = int(major.min())
    N = int(major.max()) - low_major + 1
    pair = np.zeros((V, len(rows)), dtype=np.int64)
    pair[stage, row] = 1
    pair_stage, pair_row = np.nonzero(pair)
    pair[pair_stage, pair_row] = np.arange(len(pair_stage))
    best, splits, tails = model.solve(pair_stage, rows, pair_row, low_major, N)
    query = pair[stage, row] * N + major - low_major
    cost[where] = best.time[query]
    return _Segments(lengths, start, cost.reshape(V, J, L + 1), best, splits, tails, low_major, N, where, query, row)


class SplitTable(Protocol):
    """What the split DPs read: ``start`` [J, P] the position a segment of the j-th length ending
    at each position starts from (clipped to 0), ``cost`` [V, J, P] its seconds on each virtual
    stage (+inf where unreachable or nothing fits), ``lengths`` [J] how far each length moves
    the position. Positions run from 0 (nothing placed) to P − 1 (everything placed)."""

    @property
    def start(self) -> np.ndarray: ...
    @property
    def cost(self) -> np.ndarray: ...
    @property
    def lengths(self) -> np.ndarray: ...


@dataclass(frozen=True)
class Table:
    """A ``SplitTable`` built directly (the chunked and prefixed DPs). ``thresholds``, where the
    builder has them: the table's finite costs as a set (``threshold_search`` takes no more),
    cheaper than masking the whole [V, J, P] table for them."""

    start: np.ndarray
    cost: np.ndarray
    lengths: np.ndarray
    thresholds: np.ndarray | None = None


@dataclass(frozen=True)
class StagedTable:
    """A split table whose stages need not share their positions: stage v moves from position
    ``starts[v][j, p]`` of stage v − 1's positions (``positions`` of them before stage 0,
    starting from 0) to its own position p, at ``costs[v][j, p]`` seconds (+inf where it cannot),
    and records ``lengths[v][j]`` in the split. The last stage's last position is everything
    placed. ``thresholds``: the finite costs a bottleneck may take (``threshold_search``'s
    candidates; a table may list costs of steps it leaves out, so that the search's candidates,
    and hence its answer among equal splits, stay those of the full table it stands for).
    ``more_thresholds``: where given, the finite costs of further left-out steps, computed only
    if the search needs them (``threshold_search``). ``flat_costs``: where the builder has it,
    every stage's costs laid end to end (``costs`` in order, each reshaped), which spares
    ``min_sums`` joining them."""

    positions: int
    starts: tuple[np.ndarray, ...]
    costs: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray, ...]
    thresholds: np.ndarray
    more_thresholds: Callable[[], np.ndarray] | None = None
    flat_costs: np.ndarray | None = None


@dataclass(frozen=True)
class TotalsTable:
    """A split table whose step costs depend on the stage and its layers only, not on where the
    step starts (the one-kind chunked DP, ``ndplan.balance.chunks``): stage v holding
    ``lengths[j]`` layers costs ``cost[v, j]`` seconds (+inf where nothing fits), from position
    b − lengths[j] ≥ 0 to b, positions 0 … ``L``. The DP of the ``Table`` with cost[v, j, b] =
    cost[v, j] where b ≥ lengths[j] (+inf elsewhere) and start b − lengths[j]: the same values,
    sums in the same order and the same argmins, without building or masking that
    [V, J, L + 1] table (``_totals_pass``). ``lengths``: consecutive integers, rising.
    ``thresholds``: its finite costs, as a set."""

    cost: np.ndarray
    lengths: np.ndarray
    L: int
    thresholds: np.ndarray


AnyTable = SplitTable | StagedTable | TotalsTable


def _totals_pass(table: TotalsTable, costs: np.ndarray, combine: np.ufunc) -> tuple[np.ndarray, np.ndarray]:
    """The forward pass of the DP over a ``TotalsTable``, for n bounds at once: ``costs``
    [V, J, n] each bound's stage costs (masked), ``combine`` np.add (min-sum) or np.maximum
    (min-max). Returns [V + 1, n, L + 1] each stage's values over ends b (row 0: before any
    stage) and [V, J, n, L + 1] each step's candidate value (the walk back reads its argmins).

    The values are kept with ``pad`` = the longest step's +inf cells before position 0, so that
    a step longer than its end reads +inf, as in the ``Table``. Stage v's candidates are then
    one strided view of row v (step j to end b reads pad + b − lengths[j]: lengths are
    consecutive, so j moves one cell back), combined with the costs into the candidates and
    reduced over the steps into row v + 1: two calls per stage for every bound, no gather."""
    lengths, L = table.lengths, table.L
    V, J, n = costs.shape
    shortest, longest = int(lengths[0]), int(lengths[-1])
    pad, P = longest, L + 1
    values = np.full((V + 1, n, pad + P), np.inf)
    values[0, :, pad] = 0.0
    item = values.itemsize
    # starts[v, j, k, b] = values[v, k, pad + b − lengths[j]]: a view, nothing copied.
    starts = np.ndarray((V, J, n, P), values.dtype, values, (pad - shortest) * item,
                        (values.strides[0], -item, values.strides[1], item))
    candidates = np.empty((V, J, n, P))
    steps = costs[..., None]  # [V, J, n, 1]
    ends = values[1:, :, pad:]  # [V, n, P] each stage's values, written in place
    for v in range(V):
        combine(starts[v], steps[v], out=candidates[v])
        np.minimum.reduce(candidates[v], axis=0, out=ends[v])
    return values[:, :, pad:], candidates


def _totals_split(table: TotalsTable, candidates: np.ndarray, costs: list[list[float]]) -> tuple[float, tuple[int, ...]]:
    """The bottleneck and layers per stage of the split ending at L in one bound's pass of
    ``_totals_pass`` (``candidates`` [V, J, L + 1], ``costs`` [V][J] its masked stage costs),
    walked back along the argmins, as ``min_sum`` does on a ``Table``."""
    lengths = table.lengths.tolist()
    counts: list[int] = []
    b, bottleneck = table.L, 0.0
    for v in range(len(costs) - 1, -1, -1):
        j = int(candidates[v, :, b].argmin())
        counts.append(lengths[j])
        bottleneck = max(bottleneck, costs[v][j])
        b -= lengths[j]
    return bottleneck, tuple(reversed(counts))


def _positions(table: AnyTable) -> int:
    """How many positions precede stage 0 (position 0: nothing placed)."""
    if isinstance(table, TotalsTable):
        return table.L + 1
    return table.positions if isinstance(table, StagedTable) else table.start.shape[1]


def _finite_costs(table: AnyTable) -> np.ndarray:
    """The finite costs of a table, as a set (repeats and order may differ between tables)."""
    if isinstance(table, (StagedTable, TotalsTable)):
        return table.thresholds
    if isinstance(table, Table) and table.thresholds is not None:
        return table.thresholds
    return table.cost[np.isfinite(table.cost)]


def _min_max(seg: _Segments) -> float:
    """Z*, the least bottleneck max_v t_v over all splits (+inf if none fits)."""
    if seg.query is None:  # one layer kind: t depends on (v, ℓ) only
        table = seg.best.time.reshape(-1, len(seg.lengths))  # [V, J]
        if bool((table[:, 1:] >= table[:, :-1]).all()):
            return _min_max_monotone(table, int(seg.lengths[0]), seg.start.shape[1] - 1)
    return min_max(seg)


def min_max(table: AnyTable) -> float:
    """Z* by the min-max DP over a table's positions (+inf if no split fits)."""
    if isinstance(table, TotalsTable):
        values, _ = _totals_pass(table, table.cost[:, :, None], np.maximum)
        return float(values[-1, 0, -1])
    best = np.empty(_positions(table))  # over ends b: least bottleneck of v stages ending at b
    best.fill(np.inf)  # (empty and fill: a third of np.full's overhead, which is most of its cost here)
    best[0] = 0.0
    if isinstance(table, StagedTable):
        for start, cost in zip(table.starts, table.costs, strict=True):
            reached = best.take(start)
            best = np.minimum.reduce(np.maximum(reached, cost, out=reached), axis=0)  # in place: no allocation
    else:
        for cost in table.cost:
            best = np.minimum.reduce(np.maximum(best.take(table.start), cost), axis=0)
    return float(best[-1])


def _min_max_monotone(table: np.ndarray, shortest: int, L: int) -> float:
    """Z* when t(v, ℓ) = table[v, ℓ − shortest] never decreases with ℓ (one layer kind: one
    more layer never saves time), without a DP: under a threshold Z stage v may hold
    shortest … shortest + n_v(Z) − 1 layers, n_v(Z) = #{ℓ : t(v, ℓ) ≤ Z}, so a split exists iff
    every n_v(Z) ≥ 1 and Σ_v (shortest + n_v(Z) − 1) ≥ L (V·shortest ≤ L holds for the lengths
    ``solve_dp`` uses). Z* is the least segment cost that passes.

    Both conditions grow with Z, and each is one order statistic of the costs: every n_v ≥ 1
    from the largest of the stages' least costs on, and Σ_v n_v (the costs ≤ Z, all stages
    together) ≥ need = L − V·(shortest − 1) from the need-th least cost on. So Z* is the larger
    of the two, a cost itself: no [thresholds, V, J] comparison."""
    V = table.shape[0]
    every_stage = float(table.min(axis=1).max())  # the least Z with every n_v ≥ 1
    need = L - V * (shortest - 1)
    if need <= 0:
        return every_stage
    finite = table[np.isfinite(table)]
    if need > len(finite) or not np.isfinite(every_stage):
        return float("inf")
    return max(every_stage, float(np.partition(finite, need - 1)[need - 1]))


def min_sum(seg: AnyTable, bound: float) -> tuple[float, float, tuple[int, ...]]:
    """S(bound), the least Σ_v t_v over splits with every t_v ≤ bound: (sum, the split's
    bottleneck, layers per virtual stage); sum is +inf if no split qualifies."""
    if isinstance(seg, TotalsTable):
        (total,), split = min_sums(seg, (bound,))
        return (total, *split(0)) if np.isfinite(total) else (float("inf"), float("inf"), ())
    staged = isinstance(seg, StagedTable)
    starts: Sequence[np.ndarray]
    costs: Sequence[np.ndarray] | np.ndarray
    if isinstance(seg, StagedTable):
        starts = seg.starts
        costs = seg.costs if bound == np.inf else [np.where(c <= bound, c, np.inf) for c in seg.costs]
    else:
        starts = (seg.start,) * len(seg.cost)
        costs = seg.cost if bound == np.inf else np.where(seg.cost <= bound, seg.cost, np.inf)
    best = np.full(_positions(seg), np.inf)  # over ends b: least sum of v stages ending at b
    best[0] = 0.0
    totals = []
    for start, cost in zip(starts, costs, strict=True):
        total = best.take(start) + cost  # [J, L + 1]
        totals.append(total)
        best = np.minimum.reduce(total, axis=0)
    if not np.isfinite(best[-1]):
        return float("inf"), float("inf"), ()
    counts, b, bottleneck = [], len(best) - 1, 0.0
    for v in range(len(totals) - 1, -1, -1):  # walk back along the argmins
        j = int(totals[v][:, b].argmin())
        length = int(seg.lengths[v][j] if staged else seg.lengths[j])
        counts.append(length)
        bottleneck = max(bottleneck, float(costs[v][j, b]))
        # A finite step starts at its position less its length (a staged table says where).
        b = int(starts[v][j, b]) if staged else b - length
    return float(best[-1]), bottleneck, tuple(reversed(counts))


def min_sums(seg: AnyTable, bounds: Sequence[float]
             ) -> tuple[list[float], Callable[[int], tuple[float, tuple[int, ...]]]]:
    """``min_sum`` for each of ``bounds``, in one pass over the stages: the bounds' tables are
    stacked on a trailing axis, so that each stage is a few array operations for all of them
    (the same sums in the same order as one at a time). Faster than one at a time on staged
    tables of a few stages; slower on plain tables of many. Returns the sums (+inf where no
    split qualifies) and ``split(k)``, the bottleneck and layers per virtual stage of the k-th
    bound's split (where its sum is finite), walked back only for the bounds a caller asks."""
    if isinstance(seg, TotalsTable):
        # c ≤ +inf always: an unbounded column keeps the costs as they are.
        limit = np.asarray(bounds, dtype=float)
        masked = np.where(seg.cost[:, :, None] <= limit, seg.cost[:, :, None], np.inf)  # [V, J, n]
        values, candidates = _totals_pass(seg, masked, np.add)
        return values[-1, :, -1].tolist(), lambda k: _totals_split(seg, candidates[:, :, k], masked[:, :, k].tolist())
    staged = isinstance(seg, StagedTable)
    # The bounds run along the last axis: each stage's gather and least are then over whole
    # rows of positions, and its costs a contiguous block of the masked ones.
    starts: Sequence[np.ndarray]
    costs: Sequence[np.ndarray]
    if isinstance(seg, StagedTable):
        starts = seg.starts
        # Every stage's costs masked at once, laid end to end: a mask per stage costs more.
        flat = seg.flat_costs if seg.flat_costs is not None else np.concatenate([c.reshape(-1) for c in seg.costs])
        masked = np.empty((flat.size, len(bounds)))  # [Σ J·P, n]
        for k, bound in enumerate(bounds):
            # c ≤ +inf always: an unbounded column is the costs as they are, a copy and not a mask.
            masked[:, k] = flat if bound == np.inf else np.where(flat <= bound, flat, np.inf)
        ends = list(accumulate(c.size for c in seg.costs))
        costs = [masked[end - c.size:end].reshape(*c.shape, -1) for end, c in zip(ends, seg.costs, strict=True)]
    else:
        starts = (seg.start,) * len(seg.cost)
        limit = np.asarray(bounds, dtype=float)  # [n]
        stacked = np.where(seg.cost[..., None] <= limit, seg.cost[..., None], np.inf)  # [V, J, P, n]
        costs = list(stacked)
    best = np.empty((_positions(seg), len(bounds)))  # over ends b: least sum of v stages ending at b
    best.fill(np.inf)
    best[0] = 0.0
    totals = []
    for start, cost in zip(starts, costs, strict=True):
        total = best.take(start, axis=0)
        total += cost  # [J, P, n], in place: no allocation
        totals.append(total)
        best = np.minimum.reduce(total, axis=0)

    def split(k: int) -> tuple[float, tuple[int, ...]]:
        counts: list[int] = []
        b, bottleneck = best.shape[0] - 1, 0.0
        for v in range(len(totals) - 1, -1, -1):  # walk back along the argmins
            # One column at a time (an argmin over the steps' axis of whole tables copies them
            # first), its first least found in a list: cheaper than argmin on a few steps.
            column = totals[v][:, b, k].tolist()
            j = column.index(min(column))
            length = seg.lengths[v].item(j) if staged else int(seg.lengths[j])
            counts.append(length)
            bottleneck = max(bottleneck, costs[v].item(j, b, k))
            # A finite step starts at its position less its length (a staged table says where).
            b = starts[v].item(j, b) if staged else b - length
        return bottleneck, tuple(reversed(counts))

    return best[-1].tolist(), split


def _split_costs(seg: _Segments, counts: tuple[int, ...]) -> np.ndarray:
    """[V] t_v of a split whose every count is in ``seg.lengths``."""
    return seg.cost[np.arange(len(counts)), np.asarray(counts) - seg.lengths[0], np.cumsum(counts)]


def _search(seg: _Segments, num_micro_batches: int, uniform: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """The split minimising Σ_v t_v + (m − 1)·max_v t_v (module docstring), or None if none fits.

    With ``uniform`` (the heuristic), two DP passes only: Z* and S(Z*); the answer is the better
    of that split and ``uniform``.
    """
    weight = num_micro_batches - 1
    if uniform is not None:
        z_star = _min_max(seg)
        if not np.isfinite(z_star):
            return None
        total, bottleneck, counts = min_sum(seg, z_star)
        costs = _split_costs(seg, uniform)
        if np.all(np.isfinite(costs)) and costs.sum() + weight * costs.max() < total + weight * bottleneck:
            return uniform
        return counts
    return threshold_search(seg, weight, _min_max(seg))


def threshold_search(seg: AnyTable, weight: float, z_star: float) -> tuple[int, ...] | None:
    """The split minimising Σ_v t_v + weight·max_v t_v exactly (module docstring, with m − 1 =
    ``weight``), given Z*, the least bottleneck; None if no split fits."""
    # S(∞), a lower bound on every split's sum, and S(Z*) (in one pass on a staged or totals table).
    if isinstance(seg, (StagedTable, TotalsTable)):
        (least, total), split = min_sums(seg, (np.inf, z_star))
        if not np.isfinite(least):
            return None
        if weight == 0:
            return split(0)[1]
        # S(Z*)'s split has bottleneck Z* exactly (its costs are ≤ Z*, and no split's bottleneck
        # is less), and S(∞)'s, of bottleneck ≥ Z*, can beat it only with a smaller sum: that
        # one is walked back only then.
        best, best_counts = total + weight * z_star, split(1)[1]
        if least < total:
            top, free = split(0)
            if least + weight * top < best:
                best, best_counts = least + weight * top, free
    else:
        (least, top, free), (total, bottleneck, best_counts) = min_sum(seg, np.inf), min_sum(seg, z_star)
        if not np.isfinite(least):
            return None
        if weight == 0:
            return free
        best = total + weight * bottleneck
        if least + weight * top < best:
            best, best_counts = least + weight * top, free
    # Thresholds that could still win: segment costs in (Z*, (best − S(∞)) / (m − 1)).
    cap = (best - least) / weight
    finite = _finite_costs(seg)
    candidates = finite[(finite > z_star) & (finite < cap)]
    if not len(candidates):  # the usual case: Z* or S(∞)'s split is the answer
        return best_counts
    if isinstance(seg, StagedTable) and seg.more_thresholds is not None:
        # A left-out step's cost Z, as a threshold, repeats the largest one the table has below
        # it (or Z*): the same masked table, the same split, no better than that one. So it
        # changes nothing where the table's own costs leave no candidate, and otherwise only
        # which of equal splits is found: then the search takes them, as the full table would.
        finite = np.concatenate([finite, seg.more_thresholds()])
        candidates = finite[(finite > z_star) & (finite < cap)]
    candidates = np.unique(candidates)
    # Intervals (i, j) of candidate indices with S(candidates[j]) known (i = −1 stands for Z*,
    # j = len for S(∞)); nothing strictly inside beats S_j + (m − 1)·candidates[i + 1].
    pending = [(-1, len(candidates), least)]
    while pending:
        i, j, s_j = pending.pop()
        if j - i <= 1 or s_j + weight * candidates[i + 1] >= best:
            continue
        mid = (i + j) // 2
        total, bottleneck, counts = min_sum(seg, float(candidates[mid]))
        if total + weight * bottleneck < best:
            best, best_counts = total + weight * bottleneck, counts
        pending += [(i, mid, total), (mid, j, s_j)]
    return best_counts


def _plan(problem: BalanceProblem, model: _StageModel, seg: _Segments, counts: tuple[int, ...]) -> Plan:
    """Each layer's option for a split, from the stage queries' optima (inside a virtual stage
    the order of a kind's layers changes neither memory nor time: options go in
    ``problem.options`` order)."""
    options = problem.options
    recompute = ["none"] * problem.num_layers
    queries, rows = seg.queries(counts)
    best = seg.best
    plain, split, tail, on_q = (x[queries].tolist() for x in (best.plain, best.split, best.tail, best.k))
    tails = seg.tails[tail].tolist()
    b = 0
    for v, count in enumerate(counts):
        a, b = b, b + count
        if plain[v]:  # case A: every layer "none"
            continue
        per_kind = {kind: seg.splits[rows[v]][split[v], g].tolist() for g, kind in enumerate(model.kinds[:-1])}
        major = [0] * len(options)
        for r, c in zip(model.tail_options, tails[v], strict=True):
            major[r] += c
        on_p = seg.low + queries[v] % seg.N - on_q[v] - sum(major)
        major[model.q] += on_q[v]
        major[model.p] += on_p
        per_kind[model.kinds[-1]] = major
        layers = range(a, b) if len(per_kind) == 1 else None
        for kind, option_counts in per_kind.items():
            members = layers if layers is not None else [i for i in range(a, b) if problem.layer_kinds[i] == kind]
            position = 0
            for option, n in zip(options, option_counts, strict=True):
                for layer in members[position:position + n]:
                    recompute[layer] = option
                position += n
    return Plan(counts, tuple(recompute))


WINDOW = 2  # the heuristic's virtual stages hold ⌊L/V⌋ − 2 … ⌈L/V⌉ + 2 layers


def solve_dp(problem: BalanceProblem, window: int | None = None) -> tuple[Plan, PlanCost] | None:
    """The optimal plan when every physical stage holds one virtual stage (``one_chunk_per_stage``),
    or None if no plan fits.

    ``window`` (the heuristic): only virtual stages of ⌊L/V⌋ − window to ⌈L/V⌉ + window layers
    and two DP passes (module docstring); the exact search if nothing there fits.

    The exact search first runs the heuristic: its step time U bounds the optimum's bottleneck,
    M ≤ (U − T_lb) / (m − 1), where T_lb = Σ_layers min_option time + embedding and head ≤ the
    optimum's Σ_v t_v. A stage costs at least its layers' least times, so no stage of the
    optimum holds more layers than the longest run whose least times add up to that bound:
    only shorter segments are costed, which keeps the table small (the heuristic's split is
    among them too, so the search still compares it).
    """
    if not one_chunk_per_stage(problem):
        raise ValueError("solve_dp needs one virtual stage per physical stage")
    L, V = problem.num_layers, problem.num_virtual_stages
    if L < V:
        return None
    model = _StageModel(problem)
    heuristic = _windowed(problem, model, WINDOW if window is None else window)
    if window is not None and heuristic is not None:
        return heuristic
    longest = L - V + 1
    if heuristic is not None and problem.num_micro_batches > 1:
        longest = min(longest, _longest_useful(problem, model, heuristic[1].step_s))
    seg = _segments(model, problem, np.arange(1, longest + 1))
    counts = None if seg is None else _search(seg, problem.num_micro_batches)
    if seg is None or counts is None:
        return heuristic
    plan = _plan(problem, model, seg, counts)
    return plan, evaluate(problem, plan)


def _windowed(problem: BalanceProblem, model: _StageModel, window: int) -> tuple[Plan, PlanCost] | None:
    """The heuristic's plan (module docstring), or None if no split of its lengths fits. The
    window widens (``heuristic_windows``) while its plan recomputes with a stage at an edge
    (``window_binds``): a faster plan may lie just outside it."""
    L, V = problem.num_layers, problem.num_virtual_stages
    base, extra = divmod(L, V)
    found = None
    for width in heuristic_windows(window):
        low, high = max(1, L // V - width), min(L - V + 1, -(-L // V) + width)
        seg = _segments(model, problem, np.arange(low, high + 1))
        counts = None if seg is None else _search(
            seg, problem.num_micro_batches, tuple(base + (1 if v < extra else 0) for v in range(V)))
        if seg is None or counts is None:
            return found
        plan = _plan(problem, model, seg, counts)
        found = (plan, evaluate(problem, plan))
        if (low, high) == (1, L - V + 1) or not window_binds(problem, plan, low, high):
            break
    return found


def _longest_useful(problem: BalanceProblem, model: _StageModel, incumbent_s: float) -> int:
    """The most layers a virtual stage of an optimal plan can hold, given a plan of step time
    ``incumbent_s`` (``solve_dp``'s docstring); at least 1."""
    least = model.time.min(axis=1)  # [G] seconds per layer, whatever fits
    index = {kind: g for g, kind in enumerate(model.kinds)}
    per_layer = least[[index[k] for k in problem.layer_kinds]]
    floor = float(per_layer.sum() + model.base_time.sum())  # T_lb
    bound = (incumbent_s - floor) / (problem.num_micro_batches - 1)
    bound = bound * (1 + 1e-9) + 1e-12  # rounding: never cut the optimum's segments
    prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
    L = len(per_layer)
    run = np.arange(1, L + 1)
    # Least time of any ℓ consecutive layers, for every ℓ: min over a of prefix[a + ℓ] − prefix[a].
    ends = np.arange(L + 1)[None, :] + run[:, None]  # [L, L + 1]
    window_time = np.where(ends <= L, prefix[np.minimum(ends, L)] - prefix[None, :], np.inf).min(axis=1)
    fits = np.flatnonzero(window_time + float(model.base_time.min()) <= bound)
    return int(fits[-1]) + 1 if len(fits) else 1
