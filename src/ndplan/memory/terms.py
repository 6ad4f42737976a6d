"""Memory terms that the estimator shares with the balancer and the breakdown report: the fp8
weight cache, DDP's buckets, the whole embedding gradient a DTensor runtime makes, the head's
accumulated gradient, and where each rank routes its own tokens to the experts. Each is a
formula over numpy arrays or scalars, in bytes (or bytes per element where it says so).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ndplan.memory.profile import RuntimeProfile
from ndplan.memory.static import embedding_elements
from ndplan.model.spec import ModelSpec
from ndplan.strategy.precision import PrecisionPolicy


def routes_own_tokens(sequence_parallel: Any, tp: Any) -> np.ndarray:
    """Where each rank routes its own tokens to the experts (its sequence shard under SP, all of
    them without TP), which the dispatcher gathers over the expert-TP group: etp/tp of the
    sequence's routed tokens on a rank, through experts 1/etp wide. Elsewhere (TP without SP)
    every TP rank routes the tokens they all hold."""
    return ((np.asarray(sequence_parallel) > 0) & (np.asarray(tp) > 1)) | (np.asarray(tp) == 1)


def fp8_weight_cache_width(profile: RuntimeProfile, precision: PrecisionPolicy, zero: Any) -> np.ndarray:
    """Bytes per linear-weight element (``static.linear_weight_elements``) beside the
    ``param_bytes`` the parameters count: the quantised weight copies the runtime keeps across
    micro-batches under fp8 GEMMs (Transformer Engine's weight workspaces under Megatron:
    ``fp8_weight_cache_bytes``), whole on the rank whatever ZeRO-1/2 shards. Under fp8
    parameters (``precision.fp8_params``) the row-wise copy is the parameter itself: a linear
    weight element costs the copies' bytes alone (its own byte at least), so the width is that
    less ``param_bytes`` (Megatron: 2 - 2 = 0, a 1-byte weight and its 1-byte transpose; it was
    a 2-byte weight and 2 bytes of copies). Not priced under ZeRO-3, whose weights are gathered
    per use (there fp8 parameters' shards are priced at ``param_bytes``, a shard's byte over). Per ``zero``."""
    width = profile.fp8_weight_cache_bytes if precision.compute_dtype == "fp8" else 0.0
    if precision.fp8_params:
        width = max(width, 1.0) - precision.param_bytes
    return np.where(np.asarray(zero) < 3, width, 0.0)


def ddp_bucket_width(profile: RuntimeProfile, grad_bytes: float, zero: Any, dp: Any, cp: Any) -> np.ndarray:
    """Bytes per element of the buckets a DDP reducer keeps beside the gradients
    (``ddp_bucket_copies`` of them): replicas (dp·cp > 1) without ZeRO or FSDP; 0 elsewhere."""
    ddp = (np.asarray(zero) == 0) & (np.asarray(dp) * np.asarray(cp) > 1)
    return np.where(ddp, grad_bytes * profile.ddp_bucket_copies, 0.0)


def makes_whole_embedding_grad(profile: RuntimeProfile, tp: Any, zero: Any) -> Any:
    """Where the embedding's backward makes the whole [vocab, h] gradient before the rank's
    shard (DTensor's vocabulary-parallel embedding: ``tp_accumulates_whole_embedding_grad``,
    under TP and without ZeRO-3's sharded gradients); arrays or scalars."""
    return (np.asarray(tp) > 1) & (np.asarray(zero) < 3) & profile.tp_accumulates_whole_embedding_grad


def whole_embedding_grad_extra(model: ModelSpec, profile: RuntimeProfile, tp: Any, zero: Any, micro_batches: Any,
                               shared_with_head: Any = False) -> Any:
    """Gradient elements on the embedding's rank beyond its vocabulary shard: the kept gradient
    is the whole table, vocab·h·(1 − 1/tp), from the first micro-batch on (measured on fake
    tensors: one micro-batch's, tp 2, as two's; ``micro_batches`` is kept for the callers);
    0 elsewhere, and where the table is tied to an output head on the same rank
    (``shared_with_head``): the head's backward, which runs first, makes the accumulated gradient
    its vocabulary shard, and the embedding's whole gradient is added into it (measured on fake
    tensors, tp 2, one and two micro-batches: a tied Llama layer keeps the shard)."""
    del micro_batches
    return np.where(makes_whole_embedding_grad(profile, tp, zero) & ~np.asarray(shared_with_head, dtype=bool),
                    model.vocab_size * model.hidden_size - embedding_elements(model, tp), 0.0)


def dense_weight_accumulate(model: ModelSpec, activation_bytes: float, param_bytes: float, tokens: Any, tp: Any,
                            split: bool) -> Any:
    """Bytes beyond the static state and the held activations while a dense layer's backward
    makes a later micro-batch's MLP weight gradient, to be added to the kept one (a runtime whose
    autograd accumulates gradients), with T = ``tokens`` of the op, h = hidden, f = the dense
    MLP's width, a = activation bytes, p = parameter bytes:

        h·f/tp·p + T·f/tp·a          (a split backward's W: h·f/tp·p alone)

    the new [h, f/tp] gradient beside an f-wide activation gradient (the down projection's input
    gradient, computed just before its weight's; in the W of a split backward what it reads is
    kept for it, priced with what waits for W). Measured on fake tensors, the peak of a stage's
    backward at short sequences: llama-3.1-8b at 4,096 tokens (pp 2, its first stage: 112 + 112
    MiB), DeepSeek-V3's dense layers at 2,048 (pp 2: 252 + 72 MiB), llama-3.1-8b at 2,048 with one
    layer a stage (pp 4: 112 + 56 MiB and a 16 MiB h-wide gradient more)."""
    width = model.ffn_hidden_size / tp
    gradient = model.hidden_size * width * param_bytes
    return gradient if split else gradient + tokens * width * activation_bytes


def head_accumulate(model: ModelSpec, activation_bytes: float, head_gradient: Any, tokens: Any, tp: Any,
                    loss_held: Any) -> Any:
    """Bytes beyond the static state and the held activations while the head's backward makes a
    later micro-batch's weight gradient, to be added to the kept one (``head_gradient`` > 0: the
    runtime's autograd accumulates it), with T = ``tokens`` of the op, V = vocab, h = hidden,
    a = activation bytes, p = parameter bytes:

        head_gradient + T·(V/tp·a + 3·h·a) − loss_held,   head_gradient = V·h/tp·p

    the new [vocab/tp, h] weight gradient; the logits' gradient it is computed from (the head's
    vocabulary shard, a loss on whole logits too); two h-wide tensors (the head input's gradient
    among them) and the head's input, which ``loss_held`` (the micro-batch's ``output`` entries,
    T·(h·a + 4·V + 8) with the fp32 loss) counts and the weight gradient still reads; the rest of
    the loss's entries are freed by then. Measured on fake tensors (tests/test_verify.py), the
    last stage's peak at few tokens per vocabulary row: llama-3.1-8b at 256 tokens, tp 1, the
    1,002 MiB gradient, 63 MiB of the logits' gradient and 4 MiB h-wide beside 124 MiB held."""
    tokens_part = tokens * (model.vocab_size / tp * activation_bytes + 3 * model.hidden_size * activation_bytes)
    return np.where(head_gradient > 0, np.maximum(head_gradient + tokens_part - loss_held, 0.0), 0.0)
