"""Vocabulary shared by the schedule builders, the simulator and the memory counter.

An *op* is one unit of pipeline work on one stage (one device of the pipeline group):

    (kind, micro_batch, chunk, seq_chunk)

* ``kind``: ``F`` (forward), ``B`` (backward; input-gradient part when the schedule splits
  the backward, the whole backward otherwise) or ``W`` (weight-gradient part, only in
  schedules that split the backward).
* ``micro_batch``: index in ``[0, num_micro_batches)``.
* ``chunk``: the *local* virtual chunk on the stage, in ``[0, vpp)``. Which slice of the
  model it holds depends on the placement, see :func:`model_chunk_table`.
* ``seq_chunk``: sub-sequence index in ``[0, seq_chunks)`` (always 0 except for Seq1F1B).

A *step* is a tuple of ops that a stage runs as one unit: normally one op, but DualPipeV
also runs a forward and a backward of different micro-batches overlapped, and runs some
backwards "full" (input and weight gradient in one go, modelled as a B and its W in the
same step). Ops inside a step are always ordered F, B, W.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, NamedTuple

from ndplan.errors import NdplanError

F, B, W = 0, 1, 2
KIND_NAMES = ("F", "B", "W")

#: Every schedule name :func:`ndplan.schedule.simulate` accepts, in a stable order.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "seq1f1b")

#: Schedules that split the backward into B (input grad) and W (weight grad).
SPLIT_BACKWARD: frozenset[str] = frozenset({"zb-h1", "zbv", "dualpipev"})

#: Split schedules whose every backward (on every stage but the first) torch.distributed.pipelining
#: runs as an input-gradient step and a later weight-gradient step: ZB-V (DualPipeV's steady state
#: runs whole backwards). The memory model tracks the weight gradients those W steps leave
#: pending for these alone (``StageInFlight.grads_pending``, a frontier column).
EVERY_BACKWARD_SPLIT: frozenset[str] = frozenset({"zbv"})

#: Schedules whose stage holds two model chunks folded in a V: chunk 0 = model chunk s going
#: down the pipeline, chunk 1 = model chunk 2*pp-1-s coming back up.
V_SHAPE: frozenset[str] = frozenset({"zbv", "dualpipev"})

#: Most micro-batch passes (num_micro_batches · seq_chunks · pp · vpp: a forward and a backward
#: of each on every stage's every chunk) one schedule is built and simulated for. The simulator
#: walks them op by op: `ndplan estimate` at 2^21 passes (1F1B, pp 32, 65,536 micro-batches)
#: took 9.5 s and 1.6 GB, at 2^20 5.2 s and 0.9 GB, at 2^19 (interleaved, pp 8, vpp 4) 2.2 s;
#: a billion did not finish. The cap holds pp 128 with vpp 8 and 2,048 micro-batches, or pp 64
#: with 32,768. A search prices its candidates in closed form (its memory frontiers simulate a
#: few pipeline depths); estimate, --balance and --emit simulate the strategy they price.
MAX_SIMULATED_PASSES = 2**21


def simulated_passes(num_micro_batches: Any, pp: Any, vpp: Any, seq_chunks: Any) -> Any:
    """Micro-batch passes one pipeline run's schedule is simulated for: m · seq_chunks · pp · vpp
    (scalars or numpy arrays alike); above ``MAX_SIMULATED_PASSES`` the simulator refuses it."""
    return num_micro_batches * seq_chunks * pp * vpp


class Op(NamedTuple):
    """One op with its simulated times (seconds from the start of the step)."""

    kind: str
    micro_batch: int
    chunk: int
    seq_chunk: int
    start_s: float
    end_s: float


RawOp = tuple[int, int, int, int]
"""(kind, micro_batch, chunk, seq_chunk) with kind as the int code F/B/W."""

Step = tuple[RawOp, ...]


def model_chunk_table(schedule: str, pp: int, vpp: int) -> list[list[int]]:
    """Global model-chunk index held by ``[stage][local chunk]``.

    Model chunks are numbered in forward order, 0 .. pp*vpp-1.
    Interleaved (Megatron): chunk c of stage s holds model chunk c*pp + s.
    V shape (ZB-V, DualPipeV): stage s holds model chunks s and 2*pp-1-s, so the last stage
    holds the two middle chunks and the first stage holds both ends of the model.
    """
    if schedule in V_SHAPE:
        return [[s, 2 * pp - 1 - s] for s in range(pp)]
    return [[c * pp + s for c in range(vpp)] for s in range(pp)]


def _is_int(value: object) -> bool:
    # numpy integers count; bools and floats (even 4.0) do not.
    return isinstance(value, Integral) and not isinstance(value, bool)


def validate(
    schedule: str, pp: int, vpp: int, num_micro_batches: int, seq_chunks: int
) -> tuple[int, int, int, int]:
    """Raise :class:`NdplanError` naming the rule an input breaks; else the sizes as plain ints.

    Plain ints matter: the caches key on them, and np.int64(4) must hit the entry of 4.
    """
    if schedule not in SCHEDULES:
        raise NdplanError(f"unknown pipeline schedule {schedule!r}; known schedules: {', '.join(SCHEDULES)}")
    for name, value in (
        ("pp", pp),
        ("vpp", vpp),
        ("num_micro_batches", num_micro_batches),
        ("seq_chunks", seq_chunks),
    ):
        if not _is_int(value):
            raise NdplanError(f"{name} must be an integer, got {value!r}")
    pp, vpp, num_micro_batches, seq_chunks = int(pp), int(vpp), int(num_micro_batches), int(seq_chunks)
    if pp < 1:
        raise NdplanError(f"pp must be >= 1, got {pp}")
    if num_micro_batches < 1:
        raise NdplanError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    if vpp < 1:
        raise NdplanError(f"vpp must be >= 1, got {vpp}")
    if seq_chunks < 1:
        raise NdplanError(
            f"seq_chunks must be >= 1 (seq1f1b splits each micro-batch into seq_chunks), got {seq_chunks}"
        )
    passes = simulated_passes(num_micro_batches, pp, vpp, seq_chunks)
    if passes > MAX_SIMULATED_PASSES:
        most = MAX_SIMULATED_PASSES // (seq_chunks * pp * vpp)
        shape = f"pp·vpp·seq_chunks = {pp}·{vpp}·{seq_chunks}"
        raise NdplanError(
            f"num_micro_batches={num_micro_batches}: the pipeline schedule is simulated op by op, for at most "
            f"{MAX_SIMULATED_PASSES} micro-batch passes (num_micro_batches·pp·vpp·seq_chunks), so at {shape} at most "
            f"{most} micro-batches per pipeline run; raise micro_batch_size or dp"
            + (", or split the step into pipeline_runs" if pp > 1 else ""))
    if seq_chunks != 1 and schedule != "seq1f1b":
        raise NdplanError(f"seq_chunks > 1 needs schedule 'seq1f1b'; {schedule!r} runs whole micro-batches")

    if schedule in V_SHAPE:
        if vpp != 2:
            raise NdplanError(
                f"{schedule} places two model chunks per stage in a V shape: vpp must be 2, got {vpp}"
            )
    elif schedule == "interleaved":
        if vpp < 2:
            raise NdplanError(
                f"interleaved needs vpp >= 2 model chunks per stage (use '1f1b' for vpp=1), got {vpp}"
            )
        # Megatron-LM's classic rule: micro-batches run in groups of pp per model chunk.
        # (Newer Megatron relaxes it with microbatch_group_size_per_vp_stage; we keep the rule
        # that gives the textbook schedule.)
        if num_micro_batches % pp != 0:
            raise NdplanError(
                f"interleaved needs num_micro_batches divisible by pp (Megatron rule): "
                f"{num_micro_batches} % {pp} != 0"
            )
    elif vpp != 1:
        raise NdplanError(f"{schedule} does not support virtual pipeline chunks: vpp must be 1, got {vpp}")

    if schedule == "dualpipev" and num_micro_batches < 2 * pp:
        # deepseek-ai/DualPipe, dualpipe/dualpipev.py, DualPipeV.step():
        #   assert num_chunks > 0 and num_chunks >= num_ranks * 2
        # (torch.distributed.pipelining.ScheduleDualPipeV asks the same: n_microbatches >= stages = 2*pp.)
        raise NdplanError(
            f"dualpipev needs num_micro_batches >= 2*pp (DeepSeek DualPipeV requirement): "
            f"{num_micro_batches} < {2 * pp}"
        )
    return pp, vpp, num_micro_batches, seq_chunks
