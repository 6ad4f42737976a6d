"""Megatron-Core's layer offload (``--cpu-offloading-num-layers N``, ``Strategy.offload_layers``).

Transformer Engine's CPU offload context wraps each decoder layer of the block: in the forward
of every micro-batch the tensors the first N layers save for backward are copied to pinned host
memory on a side stream and their device copies freed; the backward reloads them ahead of their
layers. Megatron-Core runs it without a pipeline and without recompute (TransformerConfig).

What stays on the device at a micro-batch's peak (the start of its backward) depends on the
handler. Transformer Engine 2.5-2.9 (AsyncDoubleBufferGroupOffloadHandler, Megatron-Core
0.14-0.15's) frees each offloaded layer at the end of a window of about L/N layers and reloads
the last offloaded layer at the very start of the backward: L - N + 1 layers' activations at
the peak. Transformer Engine 2.10's handler frees layer i when layer L - N + i starts and
reloads it one window ahead of its backward: at most L - N. Both are priced as the first:
``held_away`` is the first N - 1 layers (one layer more than 2.10 holds, an upper bound).

What a layer moves: 2.10 every saved tensor but parameters; 2.5-2.9 those its modules flag
(Transformer Engine's linears' inputs and norm statistics, the attention's q, k, v, output and
softmax statistics, Megatron's SwiGLU input: all of a dense Megatron-Core layer's but dropout
masks; a MoE layer's router and permutation tensors stay). Priced as the whole layer
(``LayerActivations.full``); ``memory.report.known_gaps`` says what a MoE layer may keep.
"""

from __future__ import annotations

import numpy as np

from ndplan.model.spec import ModelSpec


def first_layers(model: ModelSpec, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dense, MoE) decoder layers among the model's first ``count`` (per row), in model order:
    a DeepSeek-like model's first dense layers are offloaded first."""
    moe = np.concatenate([[0], np.cumsum([kind == "moe" for kind in model.layer_mlp_kinds])])
    count = np.clip(np.asarray(count, dtype=np.int64), 0, model.num_layers)
    moe_first = moe[count]
    return (count - moe_first).astype(float), moe_first.astype(float)


def held_away(model: ModelSpec, offload_layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dense, MoE) layers whose activations are off the device at a micro-batch's peak: the
    first ``offload_layers`` - 1 (module docstring), none without offload."""
    return first_layers(model, np.maximum(np.asarray(offload_layers, dtype=np.int64) - 1, 0))
