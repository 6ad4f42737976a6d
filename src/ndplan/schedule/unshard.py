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

from ndplan.schedule.builders import build_plan

#: Chunks torch keeps gathered ahead (``_add_unshard_reshard``'s ``max_active_stages``).
ACTIVE_CHUNKS = 3


@lru_cache(maxsize=1024)
def chunk_gathers(schedule: str, pp: int, vpp: int, num_micro_batches: int, seq_chunks: int = 1,
                  active: int = ACTIVE_CHUNKS) -> int:
    """Gathers of one chunk's parameters per run, on the rank that gathers most: ``vpp`` where
    the chunks all stay gathered, more where ``vpp`` exceeds ``active``."""
    most = 0
    for plan in build_plan(schedule, pp, vpp, num_micro_batches, seq_chunks):
        chunks = plan.chunk.tolist()
        # The distinct chunks from each position on, in order of first use: built backwards.
        upcoming: list[list[int]] = [[] for _ in chunks]
        ahead: list[int] = []
        for i in range(len(chunks) - 1, -1, -1):
            ahead = [chunks[i], *(c for c in ahead if c != chunks[i])][:active]
            upcoming[i] = ahead
        gathered: set[int] = set()
        count = 0
        for wanted in upcoming:
            gathered &= set(wanted)  # freed: not among the next chunks
            count += sum(1 for c in wanted if c not in gathered)
            gathered |= set(wanted)
        most = max(most, count)
    return most


__all__ = ["ACTIVE_CHUNKS", "chunk_gathers"]
