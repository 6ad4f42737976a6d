"""Per-stage op orders for each pipeline schedule.

Each builder fills, for every stage, the ordered steps that stage runs (see
:mod:`ndplan.schedule.ops`). Orders follow the published algorithms; each builder names the
source it follows. The simulator only needs the order: times come from dependencies.

The orders are built as arrays, not op by op: the strategy search asks for a few hundred
schedules of up to tens of thousands of ops each, the first time in a process. Closed-form
orders (1F1B and its variants) are written with numpy; the zero-bubble ones (ZB-H1, ZB-V,
DualPipeV) as repeated rounds of (kind, chunk) steps whose micro-batches are numbered
afterwards (:class:`_Steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import chain, pairwise

import numpy as np
from numpy.typing import NDArray

from ndplan.schedule.ops import B, F, Step, W, validate

_Slot = tuple[int, int]
"""(kind, local chunk) of an op whose micro-batch is not yet numbered."""

F0, B0, W0 = (F, 0), (B, 0), (W, 0)
F1, B1, W1 = (F, 1), (B, 1), (W, 1)


def _readonly(values: NDArray[np.int64]) -> NDArray[np.int64]:
    values.setflags(write=False)  # half the cost of flags.writeable = False: a search sets ~9,000
    return values


class StagePlan:
    """One stage's ops in execution order, as read-only parallel integer arrays.

    kind (0=F, 1=B, 2=W), micro_batch, chunk (local), seq_chunk: one entry per op.
    step: index of the step each op belongs to (ops of a step are adjacent).
    step_len: number of ops in each step.
    """

    __slots__ = ("kind", "micro_batch", "chunk", "seq_chunk", "step", "step_len")

    def __init__(
        self, kind: NDArray[np.int64], micro_batch: NDArray[np.int64], chunk: NDArray[np.int64] | None = None,
        seq_chunk: NDArray[np.int64] | None = None, step_len: NDArray[np.int64] | None = None,
        step: NDArray[np.int64] | None = None,
    ) -> None:
        """From int64 arrays the plan then holds read-only: ``chunk`` and ``seq_chunk`` 0 where not
        given, ``step_len`` one op per step, ``step`` that of ``step_len`` (given where the
        caller has it already)."""
        n = len(kind)
        self.kind = _readonly(kind)
        self.micro_batch = _readonly(micro_batch)
        self.chunk = _readonly(np.zeros(n, dtype=np.int64) if chunk is None else chunk)
        self.seq_chunk = _readonly(np.zeros(n, dtype=np.int64) if seq_chunk is None else seq_chunk)
        if step_len is None:
            step_len = np.ones(n, dtype=np.int64)
            step = np.arange(n, dtype=np.int64)
        elif step is None:
            step = np.repeat(np.arange(len(step_len), dtype=np.int64), step_len)
        self.step_len = _readonly(step_len)
        self.step = _readonly(step)

    def __len__(self) -> int:
        return len(self.kind)

    def steps(self) -> list[Step]:
        """The steps as tuples of (kind, micro_batch, chunk, seq_chunk) ops (for inspection)."""
        ops = list(
            zip(
                self.kind.tolist(),
                self.micro_batch.tolist(),
                self.chunk.tolist(),
                self.seq_chunk.tolist(),
                strict=True,
            )
        )
        out = []
        at = 0
        for n in self.step_len.tolist():
            out.append(tuple(ops[at : at + n]))
            at += n
        return out


class _Steps:
    """One stage's steps laid out as (kind, chunk) ops, their micro-batches numbered later.

    The zero-bubble schedules run each chunk's forwards, its backwards and its weight gradients
    each in micro-batch order, so an op's micro-batch follows from the order of kinds and chunks
    alone (:func:`_plans` numbers them). A builder then only lays out that order, most of it as
    a few rounds repeated: no Python work per op.
    """

    __slots__ = ("rounds",)

    def __init__(self) -> None:
        #: (count, steps): ``count`` rounds of the steps, each a tuple of (kind, chunk) ops.
        self.rounds: list[tuple[int, tuple[tuple[_Slot, ...], ...]]] = []

    def steps(self, count: int, *steps: Sequence[_Slot]) -> None:
        """Append ``count`` rounds of ``steps`` (none where ``count`` <= 0); a step is a sequence
        of ops run as one unit, ordered F, B, W."""
        if count > 0:
            self.rounds.append((count, tuple(map(tuple, steps))))

    def ops(self, count: int, *ops: _Slot) -> None:
        """Append ``count`` rounds of ``ops``, each op a step of its own."""
        if count > 0:
            # zip of one sequence: each op as a step of one, without a generator's cost per op
            self.rounds.append((count, tuple(zip(ops))))


def _plans(stages: list[_Steps], micro_batches: int | None = None) -> list[StagePlan]:
    """The stages' plans, their micro-batches numbered: each op's is the number of earlier ops
    of its kind on its chunk and stage. Where ``micro_batches`` is given, less the ops of
    micro-batches from it on (and the steps they leave empty).

    All stages are expanded and numbered together, in arrays each stage's plan holds views of:
    a plan of many stages costs a few numpy calls, not a few per stage or per op."""
    # Each distinct round once in a table of ops (kind, chunk) and one of step lengths; the
    # stages' rounds are then runs of table entries, repeated.
    table: dict[tuple[tuple[_Slot, ...], ...], int] = {}
    runs = [(s, count, table.setdefault(steps, len(table))) for s, o in enumerate(stages) for count, steps in o.rounds]
    slots = [[op for step in steps for op in step] for steps in table]
    lengths = [[len(step) for step in steps] for steps in table]
    run_stage, count, pattern = (np.array(column, dtype=np.int64).reshape(-1) for column in zip(*runs, strict=True))
    if micro_batches is not None:
        count = _rounds_needed(run_stage, count, pattern, slots, micro_batches)
    op_index = _runs(count, pattern, [len(ops) for ops in slots])
    # Kinds and chunks each taken from a table of its own: contiguous, so each stage's are views.
    kind, chunk = (np.array(column, dtype=np.int64).reshape(-1)[op_index]
                   for column in zip(*(op for ops in slots for op in ops), strict=True))
    if all(n == 1 for steps in lengths for n in steps):  # every step one op (all but DualPipeV)
        step_len, step = np.ones(len(kind), dtype=np.int64), np.arange(len(kind), dtype=np.int64)
    else:
        step_len = np.array([n for steps in lengths for n in steps], dtype=np.int64)[
            _runs(count, pattern, [len(n) for n in lengths])]
        step = np.repeat(np.arange(len(step_len), dtype=np.int64), step_len)  # across the stages
    stage = np.repeat(run_stage, count * np.array([len(ops) for ops in slots], dtype=np.int64)[pattern])
    micro_batch = _rank_in_group((stage * 3 + kind) * (int(chunk.max(initial=0)) + 1) + chunk)
    if micro_batches is not None and np.any(micro_batch >= micro_batches):
        keep = micro_batch < micro_batches
        kind, chunk, micro_batch, stage, step = kind[keep], chunk[keep], micro_batch[keep], stage[keep], step[keep]
        step_len = np.bincount(step, minlength=len(step_len))
        step_len = step_len[step_len > 0]
        step = np.cumsum(np.concatenate([[0], step[1:] != step[:-1]]), dtype=np.int64)
    op_at = np.searchsorted(stage, np.arange(len(stages) + 1)).tolist()  # each stage's first op
    step_at = [0, *(step[op_at[1:-1]] if len(step) else np.zeros(len(stages) - 1, np.int64)).tolist(), len(step_len)]
    # Each stage's steps numbered from 0, and no sub-sequences: arrays of all the stages' ops, of
    # which each plan holds views.
    local_step = step - np.repeat(step_at[:-1], np.diff(op_at))
    seq_chunk = np.zeros(len(kind), dtype=np.int64)
    return [
        StagePlan(kind[a:b], micro_batch[a:b], chunk[a:b], seq_chunk[a:b], step_len[first:last], local_step[a:b])
        for a, b, first, last in zip(op_at[:-1], op_at[1:], step_at[:-1], step_at[1:], strict=True)
    ]


def _rounds_needed(run_stage: NDArray[np.int64], count: NDArray[np.int64], pattern: NDArray[np.int64],
                   slots: list[list[_Slot]], micro_batches: int) -> NDArray[np.int64]:
    """Each run's ``count`` cut to the rounds that hold an op of a micro-batch below
    ``micro_batches``: the rounds until every (kind, chunk) of the run's pattern has that many
    ops on the stage (the runs are stage after stage). The rounds cut hold only ops that
    ``_plans`` would drop, and the ops kept keep their numbers (each is numbered by the ops of
    its kind and chunk before it, all kept). A ZB-V order laid out for 2·pp - 1 micro-batches
    and run with fewer (the search's frontiers ask pp 32 with 1 to 32) then expands and numbers
    the ops it keeps, not 63 micro-batches' worth: a few small arrays per run, not per op."""
    chunks = 1 + max((chunk for ops in slots for _, chunk in ops), default=0)
    per_round = np.zeros((len(slots), 3 * chunks), dtype=np.int64)  # [pattern, kind·chunks + chunk] ops a round
    for p, ops in enumerate(slots):
        for kind, chunk in ops:
            per_round[p, kind * chunks + chunk] += 1
    per_round = per_round[pattern]
    in_runs = count[:, None] * per_round
    before = np.cumsum(in_runs, axis=0) - in_runs  # the ops of each kind and chunk before each run
    before -= before[np.searchsorted(run_stage, run_stage)]  # ... on its stage
    # Per kind and chunk the pattern has, the rounds until it has micro_batches ops (ceil).
    rounds = np.where(per_round > 0, -((before - micro_batches) // np.maximum(per_round, 1)), 0)
    needed: NDArray[np.int64] = np.minimum(count, rounds.max(axis=1, initial=0).clip(0))
    return needed


def _runs(count: NDArray[np.int64], pattern: NDArray[np.int64], sizes: list[int]) -> NDArray[np.int64]:
    """Indices into a table of patterns laid end to end (pattern p has ``sizes[p]`` entries):
    run i is ``count[i]`` times pattern ``pattern[i]``, the runs one after another."""
    size = np.array(sizes, dtype=np.int64)[pattern]
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)[pattern]
    # Per repetition of a pattern (a few ops each): its size and the shift from its place in
    # the output to its pattern's place in the table; then one pass over the output.
    size, shift = np.repeat(size, count), np.repeat(first, count)
    shift -= np.cumsum(size) - size
    index: NDArray[np.int64] = np.repeat(shift, size) + np.arange(int(size.sum()), dtype=np.int64)
    return index


def _rank_in_group(group: NDArray[np.int64]) -> NDArray[np.int64]:
    """Each entry's index among the entries of its group (equal values, non-negative), in array
    order."""
    # Each group's entries together, in array order. Group codes that fit 16 bits (one per
    # stage, kind and chunk: always, in practice) are sorted as such: numpy sorts those by
    # radix, several times faster than a 64-bit stable sort.
    narrow = group.astype(np.uint16) if int(group.max(initial=0)) < (1 << 16) else group
    order = np.argsort(narrow, kind="stable")
    grouped = group[order]
    starts = np.flatnonzero(np.concatenate([[True], grouped[1:] != grouped[:-1]]))
    rank = np.empty_like(group)
    rank[order] = np.arange(len(group), dtype=np.int64) - np.repeat(starts, np.diff([*starts, len(group)]))
    return rank


def _gpipe(pp: int, m: int) -> list[StagePlan]:
    # GPipe (torch.distributed.pipelining.ScheduleGPipe): all forwards, then all backwards
    # in micro-batch order. Every stage holds all m activations at the turn.
    return [
        StagePlan(np.repeat(np.array([F, B], dtype=np.int64), m), np.tile(np.arange(m, dtype=np.int64), 2))
        for _ in range(pp)
    ]


def _warm_up_then_alternate(warm: NDArray[np.int64], total: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(kinds, units), [stages, 2·total] each, of the 1F1B order over ``total`` units on stages
    of ``warm`` [stages] warm-up forwards each: the warm-up forwards, then F of unit warm + i
    beside B of unit i while forwards remain, then the remaining backwards.

    Every stage at once, by position p in its order (q = p - warm): a warm-up F of unit p, then
    alternately F of warm + q/2 and B of (q - 1)/2, then in the last ``warm`` positions B of
    p - total. One array for all stages, not a few numpy calls per stage: a search builds a few
    hundred such schedules of up to 64 stages."""
    position = np.arange(2 * total, dtype=np.int64)[None, :]
    warm = warm[:, None]
    q = position - warm
    half, odd = np.divmod(q, 2)
    in_warm_up, in_tail = q < 0, position >= 2 * total - warm
    kinds = np.where(in_warm_up, F, np.where(in_tail | (odd == 1), B, F)).astype(np.int64)
    units = np.where(in_warm_up, position, np.where(in_tail, position - total, np.where(odd == 1, half, warm + half)))
    return kinds, units.astype(np.int64)


def _one_f_one_b(pp: int, m: int) -> list[StagePlan]:
    # PipeDream-flush / Megatron forward_backward_pipelining_without_interleaving:
    # stage s runs pp-s-1 warm-up forwards, then alternates F and B, then drains the Bs.
    kinds, units = _warm_up_then_alternate(np.minimum(pp - 1 - np.arange(pp, dtype=np.int64), m), m)
    return [StagePlan(kinds[s], units[s]) for s in range(pp)]


def _zb_h1(pp: int, m: int) -> list[StagePlan]:
    # ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3), in the form of
    # torch.distributed.pipelining's ZB1P builder with one chunk per rank: the 1F1B order of
    # F and B (so the same activation peak), with each W run right after a B but lagging
    # s backwards behind on stage s. Late stages, which idle at the tail of 1F1B, thus push
    # their Ws into that tail; stage 0 keeps each W next to its B.
    stages = [_Steps() for _ in range(pp)]
    for s, o in enumerate(stages):
        warm = min(pp - s - 1, m)
        o.ops(warm, F0)
        # Round i (of m) runs the F of micro-batch warm + i while forwards remain (i < m - warm),
        # the B of i, and from round s on the W of i - s: rounds alike between those two cuts.
        last_f, first_w = m - warm, min(s, m)
        for start, stop in pairwise(sorted({0, last_f, first_w, m})):
            o.ops(stop - start, *([F0] if start < last_f else []), B0, *([W0] if start >= first_w else []))
        o.ops(min(s, m), W0)  # the Ws still lagging
    return _plans(stages)


def _interleaved(pp: int, vpp: int, m: int) -> list[StagePlan]:
    # Megatron-LM forward_backward_pipelining_with_interleaving (micro-batch group size pp):
    # the k-th forward of a rank runs local chunk (k // pp) % vpp on micro-batch
    # (k // (pp*vpp)) * pp + k % pp; the k-th backward runs the mirrored chunk vpp-1-c on the
    # same micro-batch. Warm-up = min(m*vpp, (pp-rank-1)*2 + (vpp-1)*pp) forwards, then
    # 1F1B (forward k+warmup, backward k), then the remaining backwards.
    total = m * vpp
    group, within = np.divmod(np.arange(total, dtype=np.int64), pp * vpp)
    mbs = group * pp + within % pp
    chunks = within // pp
    kinds, units = _warm_up_then_alternate(
        np.minimum(total, (pp - 1 - np.arange(pp, dtype=np.int64)) * 2 + (vpp - 1) * pp), total)
    chunk = np.where(kinds == F, chunks[units], vpp - 1 - chunks[units])
    micro_batch = mbs[units]
    return [StagePlan(kinds[s], micro_batch[s], chunk[s]) for s in range(pp)]


def _zbv(pp: int, m: int) -> list[StagePlan]:
    # ZB-V (Qi et al., sec. 6), following the handcrafted order that
    # torch.distributed.pipelining.ScheduleZBVZeroBubble builds. Chunk 0 = model chunk s
    # (down the V), chunk 1 = model chunk 2pp-1-s (back up). The order is laid out for
    # n = max(2pp-1, m) micro-batches and ops of micro-batches >= m are dropped, as there.
    n = max(2 * pp - 1, m)
    stages = [_Steps() for _ in range(pp)]
    for s, o in enumerate(stages):
        o.ops(2 * (pp - s) - 1, F0)
        o.ops(s, F1, F0)
        o.ops(pp - s, F1, B1, W1)
        # Steady state, while chunk 1's forwards trail chunk 0's or chunk 0 has forwards left
        # (n - pp rounds): an F0 while there are any, then B0 W0 F1 B1 W1.
        o.ops(n - 2 * pp + s + 1, F0, B0, W0, F1, B1, W1)
        o.ops(pp - s - 1, B0, W0, F1, B1, W1)
        # Cool-down: Bs first (they are on the critical path of earlier stages), Ws fill in.
        o.ops(s, B0, B1)
        o.ops(pp - s, B0, W0)
        o.ops(s, W1)
        o.ops(s, W0)
    return _plans(stages, micro_batches=m if m < n else None)


def _dualpipev(pp: int, m: int) -> list[StagePlan]:
    # DualPipeV, following DeepSeek's dualpipe/dualpipev.py DualPipeV.step() (steps 1-8).
    # Chunk 0 = model chunk s ("phase 0"), chunk 1 = model chunk 2pp-1-s ("phase 1").
    # A backward is "full" (B and W in one step) unless zero-bubble is on, in which case its
    # W goes to a FIFO and a later "weight chunk" step pops the oldest. The main phase runs a
    # forward of one chunk overlapped with the full backward of the other, as one step.
    stages = [_Steps() for _ in range(pp)]
    for s, o in enumerate(stages):
        o.ops((pp - s - 1) * 2, F0)  # 1: F0
        o.ops(s + 1, F0, F1)  # 2: F0 F1
        o.ops(pp - s - 1, B1, W1, F1)  # 3: B1 W1 F1 (zero bubble: the W is popped right away)
        overlapped = m - 2 * pp + s + 1  # 4: F0&B1, F1&B0 (m >= 2pp: at least once)
        if s == pp - 1:
            # DeepSeek: the last rank does not overlap this first pair, to cut the bubble.
            o.steps(1, [F0], [B1, W1], [F1, B0, W0])
            overlapped -= 1
        o.steps(overlapped, [F0, B1, W1], [F1, B0, W0])
        o.steps(pp - s - 1, [B1, W1], [F1, B0, W0])  # 5: B1, F1&B0
        # 6: B1 B0, zero bubble from the middle on (round (s+1)//2; on odd stages from its B1,
        # on even ones from its B0): a zero-bubble B leaves its W to the FIFO.
        middle = (s + 1) // 2
        o.steps(middle, [B1, W1], [B0, W0])
        if s % 2 == 1:
            o.ops(1, B1, B0)
            waiting = [W1, W0]
        else:
            o.steps(1, [B1, W1], [B0])
            waiting = [W0]
        o.ops(s - middle, B1, B0)
        waiting += [W1, W0] * (s - middle)
        # 7: W, B0 (zero bubble), pp-s-1 times: each W step pops the oldest waiting W and each B0
        # leaves its own at the back. 8: W steps pop the rest.
        waiting += [W0] * (pp - s - 1)
        o.ops(1, *chain.from_iterable((w, B0) for w in waiting[:pp - s - 1]))
        o.ops(1, *waiting[pp - s - 1:])
    return _plans(stages)


def _seq1f1b(pp: int, m: int, k: int) -> list[StagePlan]:
    # Seq1F1B (Sun et al. 2024), as sail-sg/zero-bubble-pipeline-parallelism builds it
    # (zerobubble/scheduler/seq1f1b.py): 1F1B over (micro-batch, sub-sequence) units with
    # warm-up min(pp - s - 2 + k, m*k); forwards in sub-sequence order, backwards in reverse
    # sub-sequence order within each micro-batch (causal attention: chunk j's K/V gradient
    # needs the later chunks' backward first).
    total = m * k
    kinds, units = _warm_up_then_alternate(np.minimum(pp - 2 + k - np.arange(pp, dtype=np.int64), total), total)
    micro_batch, sub = np.divmod(units, k)
    seq_chunk = np.where(kinds == F, sub, k - 1 - sub)
    return [StagePlan(kinds[s], micro_batch[s], seq_chunk=seq_chunk[s]) for s in range(pp)]


_BUILDERS: dict[str, Callable[[int, int, int, int], list[StagePlan]]] = {
    "gpipe": lambda pp, v, m, k: _gpipe(pp, m),
    "1f1b": lambda pp, v, m, k: _one_f_one_b(pp, m),
    "interleaved": lambda pp, v, m, k: _interleaved(pp, v, m),
    "zb-h1": lambda pp, v, m, k: _zb_h1(pp, m),
    "zbv": lambda pp, v, m, k: _zbv(pp, m),
    "dualpipev": lambda pp, v, m, k: _dualpipev(pp, m),
    "seq1f1b": lambda pp, v, m, k: _seq1f1b(pp, m, k),
}


@lru_cache(maxsize=256, typed=True)
def build_plan(
    schedule: str, pp: int, vpp: int, num_micro_batches: int, seq_chunks: int = 1
) -> tuple[StagePlan, ...]:
    """Per-stage op order of a schedule, validated (cached, so the result is read-only)."""
    validate(schedule, pp, vpp, num_micro_batches, seq_chunks)
    return tuple(_BUILDERS[schedule](pp, vpp, num_micro_batches, seq_chunks))
