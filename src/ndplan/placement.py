"""Which decoder layers (and the embedding, output head and MTP) each pipeline stage holds.

A *virtual stage* is one model chunk: there are pp·vpp of them, numbered in forward order.
``model_chunk_table`` (from the schedule module) says which stage and local chunk runs each one.
Memory and time both read the placement from here, so they always agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ndplan.model.spec import ModelSpec
from ndplan.schedule import model_chunk_table


@dataclass(frozen=True)
class Placement:
    """Layers of each virtual stage, in model order.

    ``dense_layers[v]``/``moe_layers[v]``: decoder layers of each MLP kind in virtual stage v.
    The embedding sits in virtual stage 0; the final norm, output head and loss, and the MTP
    modules in the last one. ``stage_of[v]``, ``chunk_of[v]``: where virtual stage v runs.
    """

    dense_layers: np.ndarray
    moe_layers: np.ndarray
    stage_of: np.ndarray
    chunk_of: np.ndarray

    @property
    def layers(self) -> np.ndarray:
        return self.dense_layers + self.moe_layers

    @property
    def num_virtual_stages(self) -> int:
        return int(self.layers.shape[0])


def uniform_layer_counts(
    num_layers: int, num_virtual_stages: int, *, embedding_as_layer: bool = False, output_as_layer: bool = False
) -> tuple[int, ...]:
    """Spread layers evenly; the remainder goes one each to the first virtual stages (as torchtitan
    does). With ``embedding_as_layer``/``output_as_layer`` the embedding and the output head
    take a layer's share of the first/last stage (Megatron's
    ``account_for_embedding/loss_in_pipeline_split``)."""
    units = num_layers + int(embedding_as_layer) + int(output_as_layer)
    base, extra = divmod(units, num_virtual_stages)
    counts = [base + (1 if v < extra else 0) for v in range(num_virtual_stages)]
    if embedding_as_layer:
        counts[0] -= 1
    if output_as_layer:
        counts[-1] -= 1
    if min(counts) < 0:
        counts = [max(c, 0) for c in counts]  # the rules reject such strategies; stay well-defined
    return tuple(counts)


@lru_cache(maxsize=4096)
def _placement(
    kinds: tuple[str, ...], counts: tuple[int, ...], schedule: str, pp: int, vpp: int
) -> Placement:
    boundaries = np.concatenate([[0], np.cumsum(counts)])
    is_moe = np.array([k == "moe" for k in kinds], dtype=np.int64)
    moe_before = np.concatenate([[0], np.cumsum(is_moe)])
    moe = moe_before[np.minimum(boundaries[1:], len(kinds))] - moe_before[np.minimum(boundaries[:-1], len(kinds))]
    dense = np.asarray(counts) - moe
    table = model_chunk_table(schedule, pp, vpp)
    stage_of = np.empty(pp * vpp, dtype=np.int64)
    chunk_of = np.empty(pp * vpp, dtype=np.int64)
    for stage, chunks in enumerate(table):
        for local, virtual in enumerate(chunks):
            stage_of[virtual] = stage
            chunk_of[virtual] = local
    for array in (dense, moe, stage_of, chunk_of):
        array.flags.writeable = False
    return Placement(dense, moe, stage_of, chunk_of)


def place_layers(
    model: ModelSpec,
    pp: int,
    vpp: int,
    schedule: str,
    stage_layers: tuple[int, ...] | None = None,
    *,
    embedding_as_layer: bool = False,
    output_as_layer: bool = False,
) -> Placement:
    """The placement of a model over pp·vpp virtual stages (cached; arrays are read-only)."""
    counts = stage_layers or uniform_layer_counts(
        model.num_layers, pp * vpp, embedding_as_layer=embedding_as_layer, output_as_layer=output_as_layer
    )
    return _placement(model.layer_mlp_kinds, tuple(counts), schedule, pp, vpp)
