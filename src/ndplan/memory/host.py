"""Pinned host memory per pipeline stage: what activation offload and optimizer offload fill on
the CPU side, to be checked against the device's share of its node's host memory
(``Device.host_memory_bytes``).

Per stage, bytes:

* optimizer: for a step on the CPU (``Strategy.optimizer_offload``) the stage's optimizer shard
  elements × ``static_state.host_optimizer_width`` (states + the updated weight + its gradient:
  16 B with Adam and fp32 master weights); between steps (``Strategy.offload_optimizer_states``)
  the states and master weights the device frees (its optimizer bytes);
* activations: Σ over the stage's chunks of the schedule's peak count of that chunk's held
  micro-batches (``schedule.in_flight``) × what one micro-batch of the chunk moves to the host:
  tokens · (dense layers · moved per dense layer + MoE layers · moved per MoE layer) for
  fine-grained offload (``Strategy.offload_modules``, ``LayerActivations.offloaded``), and
  tokens · (the first N layers' whole bytes) on the first chunk for layer offload
  (``Strategy.offload_layers``, ``memory.layer_offload``). Each chunk at its own peak: an upper
  bound of the stage's peak where chunks peak at different moments (exact with one chunk).

Pinned host memory is not swapped out: what does not fit the node's memory fails to allocate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ndplan.memory.activations import LayerActivations, layer_activations
from ndplan.memory.fields import PIPELINE_SHAPE
from ndplan.memory.layer_offload import first_layers
from ndplan.memory.options import MemoryOptions
from ndplan.memory.shape import group_shape
from ndplan.memory.static_state import static_state
from ndplan.model.spec import ModelSpec
from ndplan.placement import Placement
from ndplan.schedule import in_flight
from ndplan.strategy.batch import CODES, StrategyBatch


@dataclass(frozen=True)
class HostMemory:
    """Arrays [strategies, max_pp] of pinned host bytes per stage (0 past a strategy's pp)."""

    optimizer: np.ndarray
    activations: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.optimizer + self.activations

    def peak(self) -> np.ndarray:
        """Per strategy: the largest stage total, bytes."""
        total = self.total
        return total.max(axis=1) if total.shape[1] else np.zeros(len(total))


def uses_host(batch: StrategyBatch) -> np.ndarray:
    """[n] bool: the strategies that put anything in host memory (an offloaded optimizer,
    offloaded modules or layers)."""
    return ((batch.optimizer_offload > 0) | (batch.offload_optimizer_states > 0) | (batch.offload_layers > 0)
            | bool(batch.offload_modules))


def host_memory(
    model: ModelSpec, batch: StrategyBatch, options: MemoryOptions | None = None,
    *, stage_layers: tuple[int, ...] | None = None,
) -> HostMemory:
    """Pinned host bytes per stage of every strategy in ``batch`` (module docstring);
    ``stage_layers`` as ``stage_memory`` takes it."""
    options = options or MemoryOptions()
    n = len(batch)
    max_pp = int(batch.pp.max()) if n else 0
    optimizer, activations = np.zeros((n, max_pp)), np.zeros((n, max_pp))
    using = np.flatnonzero(uses_host(batch))
    if not using.size:
        return HostMemory(optimizer, activations)
    batch_using = batch.take(using)
    hands_over_enabled = bool(options.profile.pipeline_stage_output)
    for key, index in batch_using.groups(PIPELINE_SHAPE):
        schedule_code, pp, vpp, seq_chunks, embedding_as_layer, output_as_layer = key
        schedule = CODES["schedule"][schedule_code]
        group = batch_using.take(index)
        rows = using[index]
        shape = group_shape(model, schedule, pp, vpp, stage_layers, bool(embedding_as_layer), bool(output_as_layer),
                            hands_over_enabled, False)
        static = static_state(model, group, options, shape, scores=False)
        optimizer[rows, :pp] = shape.expand(static.at(static.host_optimizer))
        activations[rows, :pp] = _offloaded_activations(model, group, options, shape.placement, schedule, pp, vpp,
                                                        seq_chunks)
    return HostMemory(optimizer, activations)


def _offloaded_activations(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, placement: Placement, schedule: str,
                           pp: int, vpp: int, seq_chunks: int) -> np.ndarray:
    """[n, pp]: Σ over each stage's chunks of peak held micro-batches × bytes one moves."""
    n = len(batch)
    out = np.zeros((n, pp))
    if not (bool(batch.offload_modules) or (batch.offload_layers > 0).any()):
        return out
    moved = offloaded_per_micro_batch(model, batch, layer_activations(model, batch, options), placement)
    for m in np.unique(batch.num_micro_batches).tolist():
        rows = np.flatnonzero(batch.num_micro_batches == m)
        peak = in_flight(schedule, pp, vpp, int(m), seq_chunks).peak
        for v in range(placement.num_virtual_stages):
            stage, chunk = int(placement.stage_of[v]), int(placement.chunk_of[v])
            out[rows, stage] += float(peak[stage, chunk]) * moved[rows, v]
    return out


def offloaded_per_micro_batch(model: ModelSpec, batch: StrategyBatch, acts: LayerActivations,
                              placement: Placement) -> np.ndarray:
    """[n, virtual stages]: bytes one micro-batch of each virtual stage moves to the host,
    tokens · (dense layers · moved per dense layer + MoE layers · moved per MoE layer), and on the
    first the first ``offload_layers`` layers' whole bytes (module docstring)."""
    tokens = (batch.micro_batch_size * batch.seq_length).astype(float) / batch.cp
    first_dense, first_moe = first_layers(model, batch.offload_layers)
    moved = tokens[:, None] * (np.multiply.outer(acts.offloaded["dense"], placement.dense_layers)
                               + np.multiply.outer(acts.offloaded["moe"], placement.moe_layers))
    moved[:, 0] += tokens * (first_dense * acts.full["dense"] + first_moe * acts.full["moe"])
    return moved
