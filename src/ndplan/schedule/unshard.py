"""How often a pipeline rank gathers its FSDP-sharded chunks in one run of a multi-chunk schedule.

torch.distributed.pipelining runs its multi-chunk schedules (interleaved 1F1B, ZB-V, DualPipeV)
from an action list into which it inserts FSDP's gathers (UNSHARD) and frees (RESHARD),
``_add_unshard_reshard``: before each compute action it keeps gathered the next few distinct
chunks that rank will run (three), gathering those it lacks and freeing the others. With at
most three chunks on a rank each is gathered once a run; with more, a chunk is freed when three
others come first and gathered again when its turn returns.

Counted here from the schedule's op order (``build_plan``) with the same policy; the largest
count over the pipeline's ranks, as the slowest rank sets the step.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ndplan.schedule.builders import build_plan
from ndplan.schedule.ops import validate

#: Chunks torch keeps gathered ahead (``_add_unshard_reshard``'s ``max_active_stages``).
ACTIVE_CHUNKS = 3


@lru_cache(maxsize=1024)
def chunk_gathers(schedule: str, pp: int, vpp: int, num_micro_batches: int, seq_chunks: int = 1,
                  active: int = ACTIVE_CHUNKS) -> int:
    """Gathers of one chunk's parameters per run, on the rank that gathers most: ``vpp`` where
    the chunks all stay gathered, more where ``vpp`` exceeds ``active``.

    Past its warm-up the interleaved order repeats every pp micro-batches (a forward and a
    backward on each of the rank's chunks, in the same order), and each repetition adds as many
    gathers: from 2·pp micro-batches on (as a test checks on a grid of shapes against the full
    order) the count is 2·pp's plus, per pp micro-batches more, the 3·pp count less 2·pp's. A
    search would otherwise build orders of thousands of micro-batches to count them; these two
    are orders its memory frontiers build already (3·pp: the interleaved steady count)."""
    pp, vpp, m, seq_chunks = validate(schedule, pp, vpp, num_micro_batches, seq_chunks)
    cap = 2 * pp
    if schedule == "interleaved" and m > cap and m % pp == 0:
        at_cap = _counted(schedule, pp, vpp, cap, seq_chunks, active)
        return at_cap + (m - cap) // pp * (_counted(schedule, pp, vpp, cap + pp, seq_chunks, active) - at_cap)
    return _counted(schedule, pp, vpp, m, seq_chunks, active)


@lru_cache(maxsize=1024)
def _counted(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int, active: int) -> int:
    """``chunk_gathers`` counted from the schedule's op order, rank by rank."""
    most = 0
    for plan in build_plan(schedule, pp, vpp, m, seq_chunks):
        chunks = np.asarray(plan.chunk)
        # Ops in a row on one chunk see the same chunks ahead: one stands for them all.
        changes = np.flatnonzero(chunks[1:] != chunks[:-1]) + 1
        most = max(most, _gathers(chunks[np.concatenate([[0], changes])].tolist(), active) if len(chunks) else 0)
    return most


def _gathers(chunks: list[int], active: int) -> int:
    """Gathers under the keep-the-next-``active``-chunks policy for one rank's chunk order.

    With U_i the first ``active`` distinct chunks from op i on (what is gathered while op i
    runs), U_i is chunks[i] followed by U_{i+1} without it, cut to ``active``. So U_{i+1} holds
    a chunk U_i lacks only where chunks[i] is not in a full U_{i+1}: U_i then drops U_{i+1}'s
    last chunk, which is gathered (again) after op i. The gathers are U_0's chunks plus one per
    such op, counted walking the order backwards."""
    if active < 1:
        return 0  # nothing is kept gathered, so nothing is counted (as U_i is empty)
    ahead: list[int] = []  # U_{i+1}, in order of first use
    count = 0
    for chunk in reversed(chunks):
        if chunk in ahead:
            ahead.remove(chunk)
        elif len(ahead) == active:
            ahead.pop()
            count += 1
        ahead.insert(0, chunk)
    return count + len(ahead)


__all__ = ["ACTIVE_CHUNKS", "chunk_gathers"]
