"""Communication buffers alive while a layer runs: the sequence-parallel gather, the
context-parallel K/V exchange (Ulysses: Q/K/V/O), the expert dispatch and combine (all-to-all or
allgather), and the pipeline's send and receive, in bytes per stage pattern.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ndplan.errors import NdplanError
from ndplan.memory.options import MemoryOptions
from ndplan.memory.profile import model_symbols
from ndplan.memory.shape import GroupShape, to_stages
from ndplan.memory.terms import routes_own_tokens
from ndplan.model.heads import KvRepeat, ulysses_kv_repeat
from ndplan.model.spec import ModelSpec
from ndplan.strategy.batch import StrategyBatch


def layer_buffers(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, op_tokens: np.ndarray,
                   tokens: np.ndarray, pp: int, has_moe: np.ndarray, sp_div: np.ndarray) -> np.ndarray:
    """[n, P] bytes: the communication buffers alive while a layer runs (the sequence-parallel
    gather or the context-parallel K/V (Ulysses: Q/K/V/O) exchange, the larger, or on a stage
    with MoE layers the expert all-to-all's, if larger), and the pipeline's send and receive.

    The gather, the all-to-all and the pipeline's buffers carry the tokens of one op
    (``op_tokens``, a Seq1F1B sub-sequence's: ``_per_op``); the context-parallel exchange those of
    the micro-batch (``tokens``): under Seq1F1B a sub-sequence's attention reads the K/V of the
    sub-sequences before it, the last one the whole micro-batch's (no Seq1F1B implementation runs
    context parallelism to say otherwise: MindSpeed lists it as unsupported). ``sp_div``: tp
    where the activations are sequence-sharded, else 1."""
    act_bytes = batch.precision.activation_bytes
    h = model.hidden_size
    gathered = batch.is_("cp_kind", "allgather") & (batch.cp > 1)
    if ring_exchange(options) == "allgather" and bool(gathered.any()):
        raise NdplanError("cp_kind allgather is Transformer Engine's and MindSpeed's all-gather attention (Megatron's "
                          f"--cp-comm-type allgather); runtime '{options.profile.name}' runs torch's ring attention, "
                          "which cp_kind ring prices (use runtime megatron)")
    sp_gather, ep_buffers = _exchange_buffers(model, batch, options, op_tokens)
    cp_buffers = _cp_buffers(model, batch, tokens, batch.is_("cp_kind", "ulysses"), ring_exchange(options), gathered,
                             options.ulysses_kv_repeat)
    # Per stage max(gather or exchange, all-to-all where the stage holds MoE layers) + the
    # pipeline's buffers: two columns, one with the all-to-all and one without, each stage a copy
    # of its own (the bytes are finite and >= +0, so a stage without MoE layers, whose all-to-all
    # counts 0, takes the gather or exchange as it is; and without a pipeline nothing is added).
    without_moe = np.maximum(sp_gather, cp_buffers, out=sp_gather)
    with_moe = np.maximum(without_moe, ep_buffers, out=ep_buffers) if has_moe.any() else None
    if pp > 1:
        pp_buffers = 2 * op_tokens  # (in place, factor by factor in the order written: the same roundings)
        pp_buffers *= h
        pp_buffers *= act_bytes
        pp_buffers /= sp_div
        without_moe += pp_buffers
        if with_moe is not None:
            with_moe += pp_buffers
    # Column by column (see _outer_sum): the buffers alive while a layer runs, and with them the
    # pipeline's (the first two terms of the communication sum in _evaluate_group).
    buffers = np.empty((len(batch), len(has_moe)), order="F")
    for column, moe_here in enumerate(has_moe.tolist()):
        buffers[:, column] = with_moe if moe_here else without_moe
    return buffers


def _exchange_buffers(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions,
                      tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n] bytes of two of the buffers alive while a layer runs: the sequence-parallel gather
    (tokens · h · activation bytes) and, where the experts are spread over several ranks, the
    all-to-all dispatch and combine buffers (2 · tokens · top-k · h · activation bytes · the
    routed-token factor)."""
    act_bytes = batch.precision.activation_bytes
    h = model.hidden_size
    # (Products worked out in place, factor by factor in the order written: the same roundings,
    # fewer [n] temporaries; times 0 where a buffer does not exist, 0.0 as np.where gives: the
    # bytes are finite and not negative.)
    sp_gather = tokens * h
    sp_gather *= act_bytes
    sp_gather *= batch.sequence_parallel > 0
    if options.moe_dispatcher == "allgather":
        return sp_gather, allgather_dispatch_bytes(model, batch, tokens)[1]
    # All-to-all dispatch and combine buffers exist only across an expert-parallel group.
    ep_buffers = 2 * tokens
    for factor in (model.num_experts_per_tok, h, act_bytes, options.routed_token_factor):
        ep_buffers *= factor
    ep_buffers *= batch.ep > 1
    return sp_gather, ep_buffers


#: Bytes per element of the allgather dispatcher's combine: MoEAllGatherTokenDispatcher casts
#: the un-permuted output to the routing probabilities' dtype before its reduce-scatter
#: (``hidden_states.to(self.local_probs.dtype)``), fp32 as the profile's router keeps them
#: (``router_logits``, ``permuted_probs``: 4 bytes), and back to the activation dtype after.
ALLGATHER_COMBINE_BYTES = 4


def allgather_dispatch_bytes(model: ModelSpec, batch: StrategyBatch, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n] bytes of Megatron-Core's allgather token dispatcher (MoEAllGatherTokenDispatcher) for
    ``tokens`` of one op (a micro-batch's, unsharded): (its persistent buffer, its working set).

    A rank routes its own r tokens (tokens / tp under SP, all without TP; ``routes_own_tokens``)
    and the dispatcher gathers the G = r·etp·ep tokens of the expert-TP x EP group
    (gather_from_sequence_parallel_region over tp_ep_group), whatever the routing:

    * the gathered hidden states go into Megatron's global memory buffer
      (``use_global_buffer=True``), allocated at the first MoE layer's forward and kept for
      the run: G·h·activation bytes, beside every other tensor (static);
    * the combine un-permutes the experts' output into G rows (G·h·activation bytes), casts
      them to fp32 (G·h·4) and reduce-scatters that to the r rows of the rank (r·h·4) before
      the cast back; the backward runs the same shapes mirrored (the gradient's fp32 all-gather
      into G rows and its cast), so the working set while a layer runs is
      G·h·(activation bytes + 4) + r·h·4.

    Both are 0 where the group is one rank (etp·ep = 1: no gather)."""
    act_bytes = batch.precision.activation_bytes
    h = model.hidden_size
    tp, etp, ep = batch.tp.astype(float), batch.etp.astype(float), batch.ep.astype(float)
    own = tokens / np.where(routes_own_tokens(batch.sequence_parallel, tp) & (tp > 1), tp, 1.0)
    gathered = own * etp * ep
    group = (etp * ep) > 1
    persistent = np.where(group, gathered * h * act_bytes, 0.0)
    working = np.where(group, gathered * h * (act_bytes + ALLGATHER_COMBINE_BYTES) + own * h * ALLGATHER_COMBINE_BYTES,
                       0.0)
    return persistent, working


def ring_exchange(options: MemoryOptions) -> str:
    """How the runtime's ring moves keys and values (its profile's ``ring_exchange`` kernel fact:
    'allgather' for torch's context parallelism; 'p2p', Transformer Engine's, where unstated)."""
    return str(options.profile.kernels.get("ring_exchange", "p2p"))


def _cp_buffers(model: ModelSpec, batch: StrategyBatch, tokens: np.ndarray, ulysses: Any,
                exchange: str = "p2p", gathered: Any = False, kv_repeat: KvRepeat = "needed") -> np.ndarray:
    """[n] bytes of the context-parallel exchange while a layer runs, per token times the
    activation bytes β / tp; 0 without context parallelism.

    * Transformer Engine's ring ('p2p'): the K,V block in flight and the one computed on,
      2 · (K + V) widths (/ KV heads, not tp, where tp exceeds them: a rank holds one head).
    * Ulysses (``ulysses``: bool, or per strategy): 2 · (Q + K + V + O), K and V as wide as Q and
      O where MindSpeed repeats a rank's KV heads first (``ulysses_kv_repeat``; so are the
      hybrid's ring blocks).
    * torch's ring (``exchange`` 'allgather', torch/distributed/tensor/experimental/_attention.py):
      its backward, the larger pass, holds the keys and values all-gathered from the ring's n
      ranks at the query heads' width (torchtitan repeats them to every head: K' = Q-width keys,
      V' = O-width values), n·(K' + V')·β, their contiguous copy (K' + V')·β, the fp32
      accumulators of the query's, keys' and values' gradients, 4·(Q + K' + V') bytes, and the
      fp32 key and value gradients received from the previous rank, their update and the
      concatenation sent on, 3 · 4·(K' + V') -> (n + 1)·β·(K' + V') + 4·Q + 16·(K' + V') bytes
      a token (the attention kernel's own gradients the profile's backward counts).
    * All-gather CP (``gathered``: bool, or per strategy; Transformer Engine's and MindSpeed's
      AttnFuncWithCPAndKVAllGather): its backward, the larger pass, holds the keys and values
      gathered from the c ranks and reordered, c·(K + V); their gradients zero-filled over the
      c·T gathered tokens, c·(K + V); the two attention calls' key and value gradients over
      their ranges, (c + 1/2)·(K + V) on every rank of the load-balanced split; and, as it
      reorders the gradients before their reduce-scatter, a second copy of the value's,
      c·max(K, V) -> ((3c + 1/2)·(K + V) + c·max(K, V))·β a token (/ KV heads, not tp, where tp
      exceeds them, as for the ring)."""
    widths = model_symbols(model)
    beta = batch.precision.activation_bytes
    # With more TP ranks than KV heads a rank holds one KV head whole (Megatron-Core), so K and V
    # divide by the KV heads, not tp; where MindSpeed repeats a rank's KV heads before a Ulysses
    # all-to-all (ulysses_kv_repeat: the hybrid's ring then passes them repeated too), they are
    # that much wider.
    above = np.asarray(batch.tp > model.split_kv_heads)
    kv_scale = ulysses_kv_repeat(model, batch.tp, batch.ulysses_ranks, kv_repeat)
    if above.any():
        kv_scale = kv_scale * np.where(above, batch.tp / model.split_kv_heads, 1.0)
    kv_per_token = 2 * (widths["k"] + widths["v"]) * kv_scale
    per_token = np.where(ulysses, 2 * (widths["q"] + widths["o"]) + kv_per_token, kv_per_token)
    exchange_bytes = per_token * tokens  # (in place below, as in _exchange_buffers)
    exchange_bytes *= beta
    if np.any(gathered):
        c = batch.cp.astype(float)
        kv, wider = widths["k"] + widths["v"], max(widths["k"], widths["v"])
        gathered_bytes = ((3.0 * c + 0.5) * kv + c * wider) * tokens * beta
        gathered_bytes *= np.where(above, batch.tp / model.split_kv_heads, 1.0)
        exchange_bytes = np.where(gathered, gathered_bytes, exchange_bytes)
    if exchange == "allgather":
        # torch's ring, in bytes a token (ring ranks n = cp, torch runs no Ulysses)
        wide = widths["q"] + widths["o"]  # K' + V'
        ring = ((batch.cp.astype(float) + 1.0) * beta + 16.0) * wide + 4.0 * widths["q"]
        exchange_bytes = np.where(ulysses | np.asarray(gathered), exchange_bytes, ring * tokens)
    exchange_bytes /= batch.tp.astype(float)
    exchange_bytes *= batch.cp > 1
    return exchange_bytes


def cp_kind_read(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, all_moe: np.ndarray) -> np.ndarray:
    """[n] bool: the strategies whose figures depend on their context-parallel kind, which the
    model reads in the layers' K and V where a Ulysses group of cp ranks would repeat the KV heads
    (``ulysses_kv_repeat``), and otherwise only in the buffers alive while a layer runs (``layer_buffers``): per stage
    max(sequence-parallel gather, context-parallel exchange, expert all-to-all where the stage
    holds MoE layers), the same bits whatever the kind without context parallelism, or where
    every kind's exchange is no larger than the larger other buffer on every stage
    (``all_moe`` [n]: every stage of the strategy's pipeline holds MoE layers; else the gather
    alone). The largest exchange is Ulysses' (Q and O on top of K and V per token: the same
    products of positive numbers, with a larger first factor, rounded, are no smaller than the
    ring's) or all-gather CP's, the larger of the two; where the runtime's ring all-gathers
    (torch's), that ring's too, if larger."""
    tokens = (batch.micro_batch_size * batch.seq_length).astype(float)
    tokens /= batch.cp.astype(float)
    # As layer_buffers reads them: the gather and the all-to-all per op (tokens / seq_chunks,
    # the same bits as _per_op's), the exchange per micro-batch.
    sp_gather, ep_buffers = _exchange_buffers(model, batch, options, tokens / batch.seq_chunks)
    when = options.ulysses_kv_repeat
    largest = np.maximum(_cp_buffers(model, batch, tokens, True, kv_repeat=when),
                         _cp_buffers(model, batch, tokens, False, gathered=True, kv_repeat=when))
    if ring_exchange(options) == "allgather":
        # torch's ring can hold more than Ulysses' exchange: the larger of the two kinds
        largest = np.maximum(largest, _cp_buffers(model, batch, tokens, False, "allgather"))
    ep_buffers *= all_moe
    floor = np.maximum(sp_gather, ep_buffers, out=sp_gather)
    # Where a Ulysses group of the strategy's cp ranks (the largest, under any kind) would repeat
    # its KV heads, that kind's layers keep wider K and V too (layer_activations).
    repeats = ulysses_kv_repeat(model, batch.tp, batch.cp, when) > 1
    return (batch.cp > 1) & (~(largest <= floor) | repeats)


def receive_buffers(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, shape: GroupShape,
                     tokens: np.ndarray, sp_div: np.ndarray) -> np.ndarray:
    """[n, P] bytes: the receive buffers torch.distributed.pipelining allocates up front, one per
    micro-batch, for the activations a later chunk receives and the gradients an earlier chunk
    receives; they stay for the whole step, the optimizer's included. Chunks next to each other
    on one rank (a V schedule's turn) hand tensors over directly: their up-front buffers are
    replaced by the tensors themselves. Zero for runtimes that keep no stage outputs. ``sp_div``:
    tp where the activations are sequence-sharded, else 1."""
    n, patterns = len(batch), len(shape.reps)
    virtual = len(shape.pattern_of) * shape.chunks.shape[1]
    if not (options.profile.pipeline_stage_output and virtual > 1):
        return np.zeros((n, patterns), order="F")
    directions = shape.receives_from_peer.astype(float) + shape.sends_to_peer
    one_receive = batch.num_micro_batches * tokens * model.hidden_size * batch.precision.activation_bytes / sp_div
    # Column by column (see _outer_sum): the same products, in passes over the strategies.
    receive_virtual = np.empty((n, len(directions)), order="F")
    for column, direction in enumerate(directions.tolist()):
        receive_virtual[:, column] = one_receive * direction
    return to_stages(receive_virtual, shape.chunks)
