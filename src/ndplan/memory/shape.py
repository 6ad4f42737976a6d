"""What a pipeline shape fixes (``GroupShape``): the layers' placement on virtual stages, the
distinct stage patterns that every term but the held peak is priced on, the per-chunk columns;
and the layers of each chunk that a recompute limit recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from ndplan.arrays import unique
from ndplan.model.spec import ModelSpec
from ndplan.placement import Placement, place_layers
from ndplan.schedule import V_SHAPE
from ndplan.schedule.unshard import ACTIVE_CHUNKS


def recomputed_layers(
    recompute_on: np.ndarray, recompute_layers: np.ndarray, dense_layers: np.ndarray, moe_layers: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per strategy and virtual stage [n, U]: (plain dense, plain MoE, recomputed dense,
    recomputed MoE) layer counts. Under recompute a chunk recomputes its first
    min(recompute_layers, its layers) layers (all of them where the limit is 0), dense ones first."""
    limit = np.where(recompute_layers > 0, recompute_layers, np.iinfo(np.int64).max)
    layer_counts = dense_layers + moe_layers
    recomputed = np.where(recompute_on[:, None], np.minimum(limit[:, None], layer_counts[None, :]), 0)
    recomputed_dense = np.minimum(recomputed, dense_layers[None, :])
    recomputed_moe = recomputed - recomputed_dense
    return dense_layers[None, :] - recomputed_dense, moe_layers[None, :] - recomputed_moe, recomputed_dense, recomputed_moe


@dataclass(frozen=True)
class GroupShape:
    """What a pipeline shape fixes, per distinct stage pattern.

    Two stages whose chunks hold the same layers, in the same roles (first or last virtual
    stage, receiving from or sending to a peer, handing over at a V's turn) have the same
    parameters, buffers, working set and per-micro-batch activations: only their place in the
    schedule (the held peak) differs. So every term but the held peak is computed once per
    pattern, on ``patterns`` columns, and expanded to the ``pp`` stages by ``pattern_of``.
    The virtual stages are likewise reduced to those the patterns' stages run (``used``, in
    model order: the first and the last virtual stage are always among them, first and last).

    Per virtual stage in ``used`` [U]: ``dense``/``moe`` layer counts, ``first``/``last``
    (0/1 floats), and the pipeline flags; per pattern [P]: ``chunks`` [P, vpp] (columns of
    ``used``), ``on_stage`` [P, U] (0/1), ``moe_per_stage``; ``turn``: the pattern of the last
    stage, where a V schedule turns.
    """

    placement: Placement
    full_on_stage: np.ndarray  # [pp, pp·vpp]
    reps: np.ndarray           # [P] a stage of each pattern (its first)
    pattern_of: np.ndarray     # [pp] the pattern of each stage
    used: np.ndarray           # [U] virtual stages the representatives run
    chunks: np.ndarray
    on_stage: np.ndarray
    dense: np.ndarray
    moe: np.ndarray
    first: np.ndarray
    last: np.ndarray
    receives_from_peer: np.ndarray
    sends_to_peer: np.ndarray
    hands_forward: np.ndarray
    hands_backward: np.ndarray
    moe_per_stage: np.ndarray
    turn: int

    @property
    def identity(self) -> bool:
        """Every stage is its own pattern (no expansion needed)."""
        return len(self.reps) == len(self.pattern_of)

    def expand(self, values: np.ndarray) -> np.ndarray:
        """[n, P] per pattern -> [n, pp] per stage (``values`` itself when nothing repeats)."""
        return values if self.identity else values[:, self.pattern_of]

    def by_stage(self, values: np.ndarray) -> np.ndarray:
        """[n, P] per pattern -> stage-major [pp, n] (a view where nothing repeats)."""
        return values.T if self.identity else np.ascontiguousarray(values.T)[self.pattern_of]

    def combine_by_stage(self, total: np.ndarray, values: np.ndarray, operation: np.ufunc = np.add) -> None:
        """``total`` (stage-major [pp, n]) = operation(``total``, ``values`` [n, P] per pattern):
        the figures of ``operation(total, by_stage(values))``, stage by stage, in place, without
        a [pp, n] temporary."""
        if self.identity:
            operation(total, values.T, out=total)
            return
        rows = np.ascontiguousarray(values.T)
        for stage, pattern in enumerate(self.pattern_of.tolist()):
            operation(total[stage], rows[pattern], out=total[stage])


@lru_cache(maxsize=1024)
def group_shape(
    model: ModelSpec, schedule: str, pp: int, vpp: int, stage_layers: tuple[int, ...] | None,
    embedding_as_layer: bool, output_as_layer: bool, hands_over_enabled: bool, distinct: bool,
) -> GroupShape:
    """The placement and its per-pattern constants (``distinct`` False: one pattern per stage,
    as the breakdown by kind needs every stage's own columns)."""
    placement = place_layers(
        model, pp, vpp, schedule, stage_layers, embedding_as_layer=embedding_as_layer, output_as_layer=output_as_layer,
    )
    virtual = pp * vpp
    full_on_stage = np.zeros((pp, virtual))
    full_on_stage[placement.stage_of, np.arange(virtual)] = 1.0
    table = _chunk_table(placement)
    # Virtual stage v receives activations from v - 1 (gradients from v + 1) over the network
    # only where that neighbour runs on another rank.
    receives_from_peer = np.zeros(virtual, dtype=bool)
    receives_from_peer[1:] = placement.stage_of[1:] != placement.stage_of[:-1]
    sends_to_peer = np.zeros(virtual, dtype=bool)
    sends_to_peer[:-1] = placement.stage_of[:-1] != placement.stage_of[1:]
    # At a V schedule's turn the chunk hands its output (and the next one its input gradient)
    # over on the same rank, by reference: the receiving side keeps that tensor until the step
    # ends, so it stays from that micro-batch's F (B) on.
    hands_over = hands_over_enabled and schedule in V_SHAPE and virtual > 1
    hands_forward = np.zeros(virtual, dtype=bool)
    hands_backward = np.zeros(virtual, dtype=bool)
    if hands_over:
        hands_forward[:-1] = ~sends_to_peer[:-1]
        hands_backward[1:] = ~receives_from_peer[1:]
    first = (np.arange(virtual) == 0).astype(float)
    last = (np.arange(virtual) == virtual - 1).astype(float)
    features = np.stack([placement.dense_layers, placement.moe_layers, first, last, receives_from_peer,
                         sends_to_peer, hands_forward, hands_backward], axis=1).astype(float)
    seen: dict[tuple[Any, ...], int] = {}
    pattern_of = np.empty(pp, dtype=np.intp)
    for s in range(pp):
        signature = (*features[table[s]].ravel().tolist(), s == pp - 1) if distinct else (s,)
        pattern_of[s] = seen.setdefault(signature, len(seen))
    reps = np.array([next(s for s in range(pp) if pattern_of[s] == p) for p in range(len(seen))], dtype=np.intp)
    used = unique(table[reps])
    chunks = np.searchsorted(used, table[reps])
    on_stage = np.zeros((len(reps), len(used)))
    on_stage[np.repeat(np.arange(len(reps)), vpp), chunks.ravel()] = 1.0
    moe = placement.moe_layers[used]
    for array in (full_on_stage, pattern_of, reps, used, chunks, on_stage):
        array.flags.writeable = False
    return GroupShape(
        placement=placement, full_on_stage=full_on_stage, reps=reps, pattern_of=pattern_of, used=used,
        chunks=chunks, on_stage=on_stage, dense=placement.dense_layers[used], moe=moe,
        first=first[used], last=last[used], receives_from_peer=receives_from_peer[used],
        sends_to_peer=sends_to_peer[used], hands_forward=hands_forward[used],
        hands_backward=hands_backward[used], moe_per_stage=on_stage @ moe, turn=int(pattern_of[pp - 1]),
    )


def _chunk_table(placement: Placement) -> np.ndarray:
    """[pp, vpp]: the virtual stage that runs as chunk c of stage s."""
    table = np.empty((int(placement.stage_of.max()) + 1, int(placement.chunk_of.max()) + 1), dtype=np.int64)
    table[placement.stage_of, placement.chunk_of] = np.arange(len(placement.stage_of))
    return table


def chunk_column(values: np.ndarray, chunks: np.ndarray, c: int) -> np.ndarray:
    """Per stage [n, pp], the value [n, pp·vpp] of its chunk c (``values`` itself where the
    virtual stages are the stages in order: one chunk each)."""
    if chunks.shape[1] == 1 and np.array_equal(chunks[:, 0], np.arange(len(chunks))):
        return values
    return values[:, chunks[:, c]]


def largest_chunks(values: np.ndarray, chunks: np.ndarray, vpp: int, count: int = ACTIVE_CHUNKS) -> np.ndarray:
    """Per stage [n, pp], the sum of its ``count`` largest chunks' values [n, pp·vpp]: what
    torch.distributed.pipelining keeps gathered at once of a rank's FSDP chunks (schedule.unshard)."""
    per_chunk = np.stack([chunk_column(values, chunks, c) for c in range(vpp)], axis=-1)
    return np.sort(per_chunk, axis=-1)[..., -count:].sum(axis=-1)


def to_stages(values: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """Per stage [n, pp], the sum of its chunks' values [n, pp·vpp] (``chunks`` from
    ``_chunk_table``; may be ``values`` itself: do not write to it)."""
    total = chunk_column(values, chunks, 0)
    for c in range(1, chunks.shape[1]):
        total = total + values[:, chunks[:, c]]
    return total
