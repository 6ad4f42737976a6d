"""Per-stage op orders for each pipeline schedule.

Each builder fills, for every stage, the ordered steps that stage runs (see
:mod:`ndplan.schedule.ops`). Orders follow the published algorithms; each builder names the
source it follows. The simulator only needs the order: times come from dependencies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from ndplan.schedule.ops import B, F, RawOp, Step, W, validate


class _Order:
    """Accumulates one stage's steps as flat columns (cheap to turn into arrays)."""

    __slots__ = ("kind", "mb", "chunk", "seq", "step_len")

    def __init__(self) -> None:
        self.kind: list[int] = []
        self.mb: list[int] = []
        self.chunk: list[int] = []
        self.seq: list[int] = []
        self.step_len: list[int] = []

    def op(self, kind: int, mb: int, chunk: int = 0, seq: int = 0) -> None:
        """Append a step made of one op."""
        self.kind.append(kind)
        self.mb.append(mb)
        self.chunk.append(chunk)
        self.seq.append(seq)
        self.step_len.append(1)

    def extend(self, kind: NDArray[np.int64], mb: NDArray[np.int64], seq: NDArray[np.int64] | None = None,
               chunk: NDArray[np.int64] | None = None) -> None:
        """Append one-op steps (on chunk 0 unless ``chunk`` says) from arrays (for orders
        written in closed form)."""
        self.kind.extend(kind.tolist())
        self.mb.extend(mb.tolist())
        self.chunk.extend([0] * len(kind) if chunk is None else chunk.tolist())
        self.seq.extend([0] * len(kind) if seq is None else seq.tolist())
        self.step_len.extend([1] * len(kind))

    def step(self, ops: Step) -> None:
        """Append a step of several ops run as one unit (ordered F, B, W)."""
        for kind, mb, chunk, seq in ops:
            self.kind.append(kind)
            self.mb.append(mb)
            self.chunk.append(chunk)
            self.seq.append(seq)
        self.step_len.append(len(ops))


def _gpipe(pp: int, m: int) -> list[_Order]:
    # GPipe (torch.distributed.pipelining.ScheduleGPipe): all forwards, then all backwards
    # in micro-batch order. Every stage holds all m activations at the turn.
    plan = []
    for _ in range(pp):
        o = _Order()
        o.extend(np.repeat(np.array([F, B], dtype=np.int64), m), np.tile(np.arange(m, dtype=np.int64), 2))
        plan.append(o)
    return plan


def _warm_up_then_alternate(warm: int, total: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(kinds, units) of ``warm`` forwards, then F of unit warm + i beside B of unit i while
    forwards remain, then the remaining backwards: the 1F1B order over ``total`` units."""
    steady = total - warm
    units = np.arange(total, dtype=np.int64)
    kinds = np.concatenate([np.full(warm, F), np.tile(np.array([F, B]), steady), np.full(warm, B)]).astype(np.int64)
    order = np.concatenate([units[:warm], np.stack([units[warm:], units[:steady]], axis=1).ravel(), units[steady:]])
    return kinds, order


def _one_f_one_b(pp: int, m: int) -> list[_Order]:
    # PipeDream-flush / Megatron forward_backward_pipelining_without_interleaving:
    # stage s runs pp-s-1 warm-up forwards, then alternates F and B, then drains the Bs.
    plan = []
    for s in range(pp):
        o = _Order()
        o.extend(*_warm_up_then_alternate(min(pp - s - 1, m), m))
        plan.append(o)
    return plan


def _zb_h1(pp: int, m: int) -> list[_Order]:
    # ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3), in the form of
    # torch.distributed.pipelining's ZB1P builder with one chunk per rank: the 1F1B order of
    # F and B (so the same activation peak), with each W run right after a B but lagging
    # s backwards behind on stage s. Late stages, which idle at the tail of 1F1B, thus push
    # their Ws into that tail; stage 0 keeps each W next to its B.
    plan = []
    for s in range(pp):
        o = _Order()
        warm = min(pp - s - 1, m)
        for i in range(warm):
            o.op(F, i)
        for i in range(m):
            if i < m - warm:
                o.op(F, warm + i)
            o.op(B, i)
            if i >= s:
                o.op(W, i - s)
        for i in range(max(m - s, 0), m):
            o.op(W, i)
        plan.append(o)
    return plan


def _interleaved(pp: int, vpp: int, m: int) -> list[_Order]:
    # Megatron-LM forward_backward_pipelining_with_interleaving (micro-batch group size pp):
    # the k-th forward of a rank runs local chunk (k // pp) % vpp on micro-batch
    # (k // (pp*vpp)) * pp + k % pp; the k-th backward runs the mirrored chunk vpp-1-c on the
    # same micro-batch. Warm-up = min(m*vpp, (pp-rank-1)*2 + (vpp-1)*pp) forwards, then
    # 1F1B (forward k+warmup, backward k), then the remaining backwards.
    total = m * vpp
    group, within = np.divmod(np.arange(total, dtype=np.int64), pp * vpp)
    mbs = group * pp + within % pp
    chunks = within // pp
    plan = []
    for s in range(pp):
        o = _Order()
        kinds, units = _warm_up_then_alternate(min(total, (pp - s - 1) * 2 + (vpp - 1) * pp), total)
        o.extend(kinds, mbs[units], chunk=np.where(kinds == F, chunks[units], vpp - 1 - chunks[units]))
        plan.append(o)
    return plan


def _zbv(pp: int, m: int) -> list[_Order]:
    # ZB-V (Qi et al., sec. 6), following the handcrafted order that
    # torch.distributed.pipelining.ScheduleZBVZeroBubble builds. Chunk 0 = model chunk s
    # (down the V), chunk 1 = model chunk 2pp-1-s (back up). The order is laid out for
    # n = max(2pp-1, m) micro-batches and ops of micro-batches >= m are dropped, as there.
    n = max(2 * pp - 1, m)
    plan = []
    for s in range(pp):
        order: list[RawOp] = []
        f = [0, 0]
        b = [0, 0]

        def fwd(c: int, order: list[RawOp] = order, f: list[int] = f) -> None:
            order.append((F, f[c], c, 0))
            f[c] += 1

        def bwd(c: int, with_w: bool, order: list[RawOp] = order, b: list[int] = b) -> None:
            order.append((B, b[c], c, 0))
            if with_w:
                order.append((W, b[c], c, 0))
            b[c] += 1

        for _ in range(2 * (pp - s) - 1):
            fwd(0)
        for _ in range(s):
            fwd(1)
            fwd(0)
        for _ in range(pp - s):
            fwd(1)
            bwd(1, True)
        while f[1] < f[0] or f[0] < n:
            if f[0] < n:
                fwd(0)
            bwd(0, True)
            fwd(1)
            bwd(1, True)
        # Cool-down: Bs first (they are on the critical path of earlier stages), Ws fill in.
        w = [b[0], b[1]]
        for _ in range(s):
            bwd(0, False)
            bwd(1, False)
        for _ in range(pp - s):
            bwd(0, False)
            order.append((W, w[0], 0, 0))
            w[0] += 1
        order.extend((W, i, 1, 0) for i in range(w[1], b[1]))
        order.extend((W, i, 0, 0) for i in range(w[0], b[0]))
        o = _Order()
        for kind, mb, c, q in order:
            if mb < m:
                o.op(kind, mb, c, q)
        plan.append(o)
    return plan


def _dualpipev(pp: int, m: int) -> list[_Order]:
    # DualPipeV, following DeepSeek's dualpipe/dualpipev.py DualPipeV.step() (steps 1-8).
    # Chunk 0 = model chunk s ("phase 0"), chunk 1 = model chunk 2pp-1-s ("phase 1").
    # A backward is "full" (B and W in one step) unless zero-bubble is on, in which case its
    # W goes to a FIFO and a later "weight chunk" step pops the oldest. The main phase runs a
    # forward of one chunk overlapped with the full backward of the other, as one step.
    plan = []
    for s in range(pp):
        o = _Order()
        f = [0, 0]
        b = [0, 0]
        pending: deque[RawOp] = deque()

        def fwd_op(c: int, f: list[int] = f) -> RawOp:
            f[c] += 1
            return (F, f[c] - 1, c, 0)

        def bwd_ops(c: int, zb: bool, b: list[int] = b, pending: deque[RawOp] = pending) -> Step:
            mb = b[c]
            b[c] += 1
            if zb:
                pending.append((W, mb, c, 0))
                return ((B, mb, c, 0),)
            return ((B, mb, c, 0), (W, mb, c, 0))

        def weight(o: _Order = o, pending: deque[RawOp] = pending) -> None:
            if pending:
                o.step((pending.popleft(),))

        def overlapped(fc: int, bc: int, o: _Order = o) -> None:
            o.step((fwd_op(fc), *bwd_ops(bc, zb=False)))

        for _ in range((pp - s - 1) * 2):  # 1: F0
            o.step((fwd_op(0),))
        for _ in range(s + 1):  # 2: F0 F1
            o.step((fwd_op(0),))
            o.step((fwd_op(1),))
        for _ in range(pp - s - 1):  # 3: B1 W1 F1 (zero bubble)
            o.step(bwd_ops(1, zb=True))
            weight()
            o.step((fwd_op(1),))
        for i in range(m - 2 * pp + s + 1):  # 4: F0&B1, F1&B0
            if i == 0 and s == pp - 1:
                # DeepSeek: the last rank does not overlap this first pair, to cut the bubble.
                o.step((fwd_op(0),))
                o.step(bwd_ops(1, zb=False))
            else:
                overlapped(0, 1)
            overlapped(1, 0)
        for _ in range(pp - s - 1):  # 5: B1, F1&B0
            o.step(bwd_ops(1, zb=False))
            overlapped(1, 0)
        zb = False
        for i in range(s + 1):  # 6: B1 B0, zero bubble from the middle on
            if i == (s + 1) // 2 and s % 2 == 1:
                zb = True
            o.step(bwd_ops(1, zb))
            if i == (s + 1) // 2 and s % 2 == 0:
                zb = True
            o.step(bwd_ops(0, zb))
        for _ in range(pp - s - 1):  # 7: W, B0 (zero bubble)
            weight()
            o.step(bwd_ops(0, zb=True))
        for _ in range(s + 1):  # 8: drain Ws
            weight()
        plan.append(o)
    return plan


def _seq1f1b(pp: int, m: int, k: int) -> list[_Order]:
    # Seq1F1B (Sun et al. 2024), as sail-sg/zero-bubble-pipeline-parallelism builds it
    # (zerobubble/scheduler/seq1f1b.py): 1F1B over (micro-batch, sub-sequence) units with
    # warm-up min(pp - s - 2 + k, m*k); forwards in sub-sequence order, backwards in reverse
    # sub-sequence order within each micro-batch (causal attention: chunk j's K/V gradient
    # needs the later chunks' backward first).
    total = m * k
    plan = []
    for s in range(pp):
        o = _Order()
        kinds, units = _warm_up_then_alternate(min(pp - s - 2 + k, total), total)
        o.extend(kinds, units // k, np.where(kinds == F, units % k, k - 1 - units % k))
        plan.append(o)
    return plan


_BUILDERS: dict[str, Callable[[int, int, int, int], list[_Order]]] = {
    "gpipe": lambda pp, v, m, k: _gpipe(pp, m),
    "1f1b": lambda pp, v, m, k: _one_f_one_b(pp, m),
    "interleaved": lambda pp, v, m, k: _interleaved(pp, v, m),
    "zb-h1": lambda pp, v, m, k: _zb_h1(pp, m),
    "zbv": lambda pp, v, m, k: _zbv(pp, m),
    "dualpipev": lambda pp, v, m, k: _dualpipev(pp, m),
    "seq1f1b": lambda pp, v, m, k: _seq1f1b(pp, m, k),
}


def _readonly(values: list[int]) -> NDArray[np.int64]:
    arr: NDArray[np.int64] = np.array(values, dtype=np.int64)
    arr.flags.writeable = False
    return arr


class StagePlan:
    """One stage's ops in execution order, as read-only parallel integer arrays.

    kind (0=F, 1=B, 2=W), micro_batch, chunk (local), seq_chunk: one entry per op.
    step: index of the step each op belongs to (ops of a step are adjacent).
    step_len: number of ops in each step.
    """

    __slots__ = ("kind", "micro_batch", "chunk", "seq_chunk", "step", "step_len")

    def __init__(self, order: _Order) -> None:
        self.kind = _readonly(order.kind)
        self.micro_batch = _readonly(order.mb)
        self.chunk = _readonly(order.chunk)
        self.seq_chunk = _readonly(order.seq)
        self.step_len = _readonly(order.step_len)
        step = np.repeat(np.arange(len(order.step_len), dtype=np.int64), self.step_len)
        step.flags.writeable = False
        self.step = step

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


@lru_cache(maxsize=256, typed=True)
def build_plan(
    schedule: str, pp: int, vpp: int, num_micro_batches: int, seq_chunks: int = 1
) -> tuple[StagePlan, ...]:
    """Per-stage op order of a schedule, validated (cached, so the result is read-only)."""
    validate(schedule, pp, vpp, num_micro_batches, seq_chunks)
    orders = _BUILDERS[schedule](pp, vpp, num_micro_batches, seq_chunks)
    return tuple(StagePlan(o) for o in orders)
