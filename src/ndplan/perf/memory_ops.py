"""Bytes that memory-bound kernels move, per device and micro-batch (forward pass).

These ops do a few FLOPs per element, so their time is bytes / (HBM bandwidth · efficiency).
Counts are elements read + written by the kernel, times the element width ``act_bytes``
(2 for bf16 activations) unless stated. The backward of an elementwise op reads its saved input
and the incoming gradient and writes one gradient: counted as 2× the forward bytes.

Tokens: T = (b·s)/c on the device; regions that sequence parallelism splits (norms, residual
adds, the final norm) see T_n = T/t with SP and T without it.

Per decoder layer, forward:
* n norms: read + write h each        -> 2·n·T_n·h (n = 2; 4 with sandwich norms)
* 2 residual adds: read 2, write 1     -> 6·T_n·h
* rotary on q and k: read + write      -> 2·T·(a + kv)·d_rope/t   (MLA: the rope part only)
* QK-norm, MLA latent norms            -> read + write their widths (the latent norms on T_n:
                                          MLA's down-projections take the sequence shard)
* attention output gate (Qwen3-Next, Qwen3.5): sigmoid (read, write) and product (read 2,
  write 1) -> 5·T·a·d/t; a Gated DeltaNet layer has no rotary, q/k norm or gate of these but its
  own (``linear_mixer_elements``); a kind mixing both takes each at its share of layers
* MLP activation: gated reads gate and up, writes one -> 3·T·f/t; plain 2·T·f/t
* MoE: permute (read + write) and un-permute + weighted combine (read 2, write 1) of the
  T·k/t routed copies of h -> 5·(T·k/t)·h; expert activations 3·(T·k/t)·f_e (gated).
  Router, per (token, expert) logit, ROUTER_BYTES_PER_LOGIT = 25 bytes: fp32 softmax/sigmoid
  and top-k (write logits 4, read 4 write 4, read 4), the dense [T, E] routing map (1) and
  masked probabilities (write 4, read 4 in the permute) Megatron's dispatcher builds, and the
  load-balancing loss's read of the scores (4). Permutation indices: per routed copy an int64
  row index written and read by permute and again by un-permute -> 32 bytes per copy.
  Chunk sort (Megatron's all-to-all dispatcher with ep > 1 and more than one local expert):
  what arrives is grouped by source rank, so the rows are re-sorted by local expert after the
  dispatch ("permutation 2", a gather: read + write) and sorted back before the combine ->
  4·R·h, R = (T·k/t)·etp rows received (etp ranks share each expert's tokens). DeepEP and
  HybridEP permute on arrival instead (no extra pass).
  Allgather dispatcher (Megatron's MoEAllGatherTokenDispatcher, etp·ep > 1): the combine
  un-permutes into the G = (T/t)·etp·ep gathered rows (zero-filled: write 2 per element), casts
  them to fp32 for the reduce-scatter (read 2, write 4) and the rank's T/t rows back (read 4,
  write 2) -> G·h·8 + (T/t)·h·6 bytes; no chunk sort.
Unfused attention (no FlashAttention): per score element b·(a/t)·(s/c)·s: GEMM writes scores 2,
softmax reads 2 writes 2 -> 6 bytes forward; attention dropout reads 2 writes 2 plus a 1-byte
mask -> 11.
Output head + loss: the vocab-parallel cross-entropy reads the bf16 logits, works in fp32
(write 4, read 4) -> 10 bytes per logit forward, 10 backward; final norm 2·T_n·h. A loss on
the logits' own dtype (``loss_upcast`` off) reads 2, writes 2, reads 2 -> 6. Soft-capped logits
(Gemma 2) add the division, tanh and product, each reading and writing one element -> 6·β.
Embedding: gather, read + write h per token forward; the backward scatter-adds into an fp32
gradient (read 2, read-modify-write 4 + 4) -> 10 bytes per element.
Routed experts' biases (gpt-oss), by ``EfficiencyProfile.expert_bias_add``, per element of a
projection's output (gate/up: R rows of w_1 = (2 if gated else 1)·f_e/etp; down: R rows of h;
R = (T·k/t)·etp received rows), β the activation width:
* 'fused': in the GEMM's epilogue, its gradient in the cast kernels (Transformer Engine's
  grouped linear) -> 0.
* 'repeat' (torchtitan's experts): the bias repeat_interleave'd to the rows (write β) and added
  (read 2β, write β) -> 4β forward; the backward sums the gradient per expert (read β) -> β.
  Both projections alike.
* 'split-cat' (NeMo AutoModel's DeepEP experts, ``_apply_bias``): the output split per expert,
  each piece added to its bias and the pieces concatenated. Gate/up: add (read β, write β), cat
  (read β, write β) -> 4β forward, the bias gradient's sum β backward. Down: the bias is
  weighted by the dispatcher's fp32 routing probabilities first, so the sum is fp32: b·p
  (write 4), t + b·p (read β + 4, write 4), cat (read 4, write 4), cast back (read 4, write β)
  -> 2β + 24 forward; backward: the cast's gradient up to fp32 (read β, write 4) and down again
  for t (read 4, write β), the gradients of b and p (each a product, read 4 write 4, and a sum,
  read 4) -> 2β + 32.
Attention sinks (gpt-oss), by ``EfficiencyProfile.sink_rescale``, per element of the attention
output (T·a·d_v/t): 'fused' in the attention kernel's softmax (cuDNN's learnable softmax offset)
-> 0. Otherwise the kernel returns its log-sum-exp and the output is rescaled by
sigmoid(lse - sink) after it: 'bf16' (torchtitan: the scale cast to the output's dtype first)
multiplies (read β, write β) -> 2β forward; the backward's two products, the output's gradient
(read β, write β) and the scale's (read 2β, write β, then its sum over the head width, read β)
-> 6β. 'fp32' (NeMo AutoModel's FlexAttention wrapper: the fp32 scale promotes the product):
multiply (read β, write 4), cast back (read 4, write β) -> 2β + 8 forward; backward: the cast's
gradient up (read β, write 4), the output's gradient (read 4, write 4) cast down (read 4,
write β), the scale's (read 4 + β, write 4, sum read 4) -> 3β + 28.
Ring attention's merges, by ``EfficiencyProfile.ring_merge``, over n > 1 ring steps: 'fused'
(not priced: Transformer Engine corrects the output in its own kernels); 'torch' (torch's
context parallelism, ``_templated_ring_attention``), on the busiest rank (the ring's last, whose
every step takes its whole query chunk), with O = T·(a/t)·d_v output elements, Q = T·(a/t)·d_qk
and K, V the key and value elements as torchtitan passes them (repeated to every query head:
T·(a/t)·d_qk and O). Forward: K and V made contiguous and, before each of the n - 1 sends,
concatenated (2β each time) -> n·2β·(K + V); each step's output cast to fp32 (β + 4), the n - 1
merges out - sigmoid(lse' - lse)·(out - out') in fp32 (three ops: 12 + 8 + 12 = 32), the result
cast back (4 + β) -> ((n + 1)(β + 4) + 32(n - 1))·O. Backward: fp32 zeros for the three gradients
(4 each), K and V contiguous and concatenated n times (n·2β), the first step's gradients added
into fp32 (8 + β), each later step's key and value gradients added into the first half of the
received fp32 buffers (half of 8 + β) and concatenated whole (8), the fp32 gradients concatenated
for each send (8, n times), the query gradient accumulated every step (8 + β), and the three cast
back at the end (4 + β) -> 4(Q + K + V) + n·2β(K + V) + (8 + β)(K + V) + (n - 1)(12 + β/2)(K + V)
+ 8n(K + V) + n(8 + β)Q + (4 + β)(Q + K + V).
All-gather context parallelism (``Strategy.cp_kind`` 'allgather': Transformer Engine's and
MindSpeed's AttnFuncWithCPAndKVAllGather), over c ranks, with KV = the K + V elements of the
rank's T tokens (KV heads' width, split as the layer's: ``kv_split``): the gathered c·KV
reordered into sequence order (index_select: read, write) before the two attention calls, each
call's output copied into place (read, write O) -> 2c·KV·β + 2·O·β forward. Backward: the
gather reordered again (2c·KV), dK and dV zero-filled over the c·T gathered tokens (c·KV), each
call's key and value gradients added into their range (read the range and the gradient, write
the range: 3 × the two ranges, (c + 1/2)·KV on every rank of the load-balanced split), the
result reordered back (2c·KV) before its reduce-scatter, and the query's gradients copied into
place (2·Q) -> ((8c + 3/2)·KV + 2·Q)·β.
MLA's query and key assembly, by ``EfficiencyProfile.mla_assembly``, beyond the rotary op above
(which reads and writes the rope parts), per token and local head (a/t of them; d_qk = d_nope +
d_rope, β the activation width):
* 'fused' (Megatron-Core's fused MLA RoPE kernels, core >= 0.13): the query is rotated in place;
  one kernel reads the key/value up-projection's output, a(d_nope + d_v), and writes the key,
  a(d_nope + d_rope), the rotated rope key given to every head, and the value, a·d_v; its
  backward reads the key's and value's gradients, a(d_qk + d_v), and writes the up-projection's,
  a(d_nope + d_v) (the rope key's summed over the heads in the same kernel)
  -> (2·d_nope + 2·d_v + d_rope)·β per head, forward and backward alike.
* 'cat' (torch.cat, as NeMo AutoModel's and torchtitan's DeepSeek-V3 and Megatron-Core without
  RoPE fusion build them): the query's two parts concatenated (read d_qk, write d_qk), the key's
  nope part and the rope key expanded to every head concatenated (read d_nope, write d_qk; the
  rope key read once per token, d_rope) -> (3·d_qk + d_nope)·β per head + d_rope·β per token
  forward; backward: split's backward concatenates the query's gradients (2·d_qk) and the key's
  nope part with the value's (2·d_nope + 2·d_v), the expand's backward sums the rope key's over
  the heads (read d_rope per head, write d_rope per token) -> (2·d_qk + 2·d_nope + 2·d_v +
  d_rope)·β per head + d_rope·β per token.
Head-major copies, where ``EfficiencyProfile.qkv_transpose`` says the runtime makes them (NeMo
AutoModel's sdpa and flex backends: q, k and v ``transpose(1, 2).contiguous()`` before the kernel,
its output back after it): read + write of every element of Q = T·(a/t)·d_qk, K = T·(g/t)·d_qk,
V = T·(g/t)·d_v and O = T·(a/t)·d_v (g the key/value heads, a under MLA) -> 2β(Q + K + V + O)
forward; the backward the same, since each gradient comes back as a transposed view that the next
kernel copies again (a GEMM's input rows, the reshape before the projection's backward).
MindSpeed's KV-head repeat before a Ulysses all-to-all whose group outnumbers a rank's KV heads
(``model.heads.ulysses_kv_repeat``, r times): repeat_interleave reads K and V and writes r copies,
the backward sums the copies' gradients -> β·T·(k + v)/kv_split·(1 + r) each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ndplan.model.spec import MlpKind, ModelSpec
from ndplan.perf.flops import Sharding, kv_split

Array = np.ndarray

#: Bytes per attention-score element of an unfused (materialised) softmax, forward, with
#: attention dropout and without.
UNFUSED_SCORE_BYTES = 11.0
UNFUSED_SCORE_BYTES_NO_DROPOUT = 6.0
#: Bytes per logit of the fp32 cross-entropy, forward (the backward moves the same).
LOSS_BYTES_PER_LOGIT = 10.0
#: The same without the upcast: read the logits, write and read their log-softmax, in bf16.
LOSS_BYTES_PER_LOGIT_NO_UPCAST = 6.0
#: Elements per logit that soft-capping moves (Gemma 2: c·tanh(logits/c)), forward: the division,
#: tanh and product each read one and write one (the backward's three the same, counted by the
#: loss's backward as its forward's bytes).
SOFTCAP_ELEMENTS = 6.0
#: Bytes per embedding element of the backward scatter-add into an fp32 gradient.
EMBEDDING_GRAD_BYTES = 10.0
#: Bytes per (token, expert) router element: softmax/top-k, routing map, probabilities, aux loss.
ROUTER_BYTES_PER_LOGIT = 25.0
#: Bytes per routed copy of the permutation's int64 row indices (permute and un-permute).
PERMUTE_INDEX_BYTES = 32.0
#: Elements per received row and hidden unit of the all-to-all dispatcher's chunk sort and
#: unsort (a gather each: read + write).
CHUNK_SORT_PASSES = 4.0
#: Bytes per element of the allgather dispatcher's combine over the gathered rows (zero fill 2,
#: fp32 cast read 2 + write 4) and over the rank's own rows (cast back: read 4, write 2).
ALLGATHER_GATHERED_BYTES = 8.0
ALLGATHER_OWN_BYTES = 6.0


#: Bytes per element of a routed expert projection's output that its bias add moves, by
#: ``EfficiencyProfile.expert_bias_add`` (module docstring): for (gate/up, down), (forward,
#: backward), each (bytes per activation byte β, fixed bytes).
EXPERT_BIAS_BYTES: dict[str, tuple[tuple[tuple[float, float], tuple[float, float]], ...]] = {
    "fused": (((0.0, 0.0), (0.0, 0.0)), ((0.0, 0.0), (0.0, 0.0))),
    "repeat": (((4.0, 0.0), (1.0, 0.0)), ((4.0, 0.0), (1.0, 0.0))),
    "split-cat": (((4.0, 0.0), (1.0, 0.0)), ((2.0, 24.0), (2.0, 32.0))),
}


#: Bytes per element of the attention output that the sinks' rescale moves, by
#: ``EfficiencyProfile.sink_rescale`` (module docstring): (forward, backward), each (bytes per
#: activation byte β, fixed bytes).
SINK_RESCALE_BYTES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "fused": ((0.0, 0.0), (0.0, 0.0)),
    "bf16": ((2.0, 0.0), (6.0, 0.0)),
    "fp32": ((2.0, 8.0), (3.0, 28.0)),
}


def sink_rescale_bytes(model: ModelSpec, sh: Sharding, act_bytes: float,
                       kernel: str) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of one layer's attention-sink rescale on a device, per micro-batch:
    T·(a/t)·d_v elements of the attention output times the per-element bytes (module docstring).
    0 for a model without sinks."""
    if not model.attention_sinks:
        return 0.0, 0.0
    elements = sh.tokens * model.num_attention_heads / sh.tp * model.value_head_dim
    (fwd_beta, fwd_fixed), (bwd_beta, bwd_fixed) = SINK_RESCALE_BYTES[kernel]
    return elements * (fwd_beta * act_bytes + fwd_fixed), elements * (bwd_beta * act_bytes + bwd_fixed)


def query_width_elements(model: ModelSpec, sh: Sharding) -> tuple[Array | float, Array | float]:
    """(Q, O) elements of one micro-batch on a device, T·(a/t)·d_qk and T·(a/t)·d_v: also the keys
    and values torch's ring attention moves, which torchtitan repeats to every query head."""
    width = sh.tokens * model.num_attention_heads / sh.tp
    return width * model.qk_head_dim, width * model.value_head_dim


def kv_allgather_bytes(model: ModelSpec, sh: Sharding, act_bytes: float, kv_elements: Array | float,
                       ranks: Array | float) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of one layer's copies around all-gather context parallelism
    (module docstring) on a rank of ``ranks``, whose own keys and values are ``kv_elements``
    (the ranks' K + V elements at the layer's split), per micro-batch."""
    q, o = query_width_elements(model, sh)
    c = np.asarray(ranks, dtype=float)
    forward = 2.0 * c * kv_elements + 2.0 * o
    backward = (8.0 * c + 1.5) * kv_elements + 2.0 * q
    return forward * act_bytes, backward * act_bytes


def ring_merge_bytes(model: ModelSpec, sh: Sharding, act_bytes: float, kernel: str,
                     steps: Array | float) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of one layer's ring-attention merges and copies on the busiest
    rank of a ring of ``steps`` ranks, per micro-batch (module docstring); 0 without a ring (one
    step) or under 'fused'."""
    if kernel == "fused":
        return 0.0, 0.0
    q, o = query_width_elements(model, sh)
    kv = q + o  # keys at the query width, values at the output's
    n, beta = np.asarray(steps, dtype=float), act_bytes
    forward = n * 2.0 * beta * kv + ((n + 1.0) * (beta + 4.0) + 32.0 * (n - 1.0)) * o
    backward = (4.0 * (q + kv) + n * 2.0 * beta * kv + (8.0 + beta) * kv + (n - 1.0) * (12.0 + beta / 2.0) * kv
                + 8.0 * n * kv + n * (8.0 + beta) * q + (4.0 + beta) * (q + kv))
    ring = n > 1.0
    return np.where(ring, forward, 0.0), np.where(ring, backward, 0.0)


def mla_assembly_bytes(model: ModelSpec, sh: Sharding, act_bytes: float,
                       kernel: str) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of one layer's MLA query and key assembly on a device, per
    micro-batch, by ``kernel`` ('fused' or 'cat', module docstring); 0 for a model without MLA."""
    if not model.is_mla:
        return 0.0, 0.0
    nope, rope, value = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    qk = nope + rope
    heads = sh.tokens * model.num_attention_heads / sh.tp
    if kernel == "fused":
        moved = heads * (2.0 * nope + 2.0 * value + rope) * act_bytes
        return moved, moved
    forward = (heads * (3.0 * qk + nope) + sh.tokens * rope) * act_bytes
    backward = (heads * (2.0 * qk + 2.0 * nope + 2.0 * value + rope) + sh.tokens * rope) * act_bytes
    return forward, backward


def qkv_transpose_bytes(model: ModelSpec, sh: Sharding, act_bytes: float,
                        transposed: bool) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of one layer's head-major copies of q, k, v and the attention
    output on a device, per micro-batch, where the runtime makes them (module docstring)."""
    if not transposed:
        return 0.0, 0.0
    heads_per_rank = model.num_attention_heads / sh.tp + model.split_kv_heads / kv_split(model, sh.tp)  # Q + O, K + V
    moved = 2.0 * act_bytes * sh.tokens * heads_per_rank * (model.qk_head_dim + model.value_head_dim)
    return moved, moved


def kv_repeat_bytes(model: ModelSpec, sh: Sharding, act_bytes: float,
                    repeat: Array | float) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of one layer's KV-head repeat before a Ulysses all-to-all on a
    device, per micro-batch (``model.heads.ulysses_kv_repeat``: r > 1 where MindSpeed repeats):
    repeat_interleave reads the rank's K and V and writes them r times; the backward sums the r
    copies' gradients (reads r, writes one) -> β·T·(k + v)/kv_split·(1 + r) each way; 0 where r = 1."""
    kv = sh.tokens * model.split_kv_heads * (model.qk_head_dim + model.value_head_dim) / kv_split(model, sh.tp)
    moved = np.where(np.asarray(repeat) > 1, act_bytes * kv * (1.0 + np.asarray(repeat)), 0.0)
    return moved, moved


def expert_bias_bytes(model: ModelSpec, sh: Sharding, act_bytes: float, kernel: str,
                      routed_factor: float = 1.0) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of one MoE layer's routed-expert bias adds on a device, per
    micro-batch: R·(w_1·up + h·down), R = (T·k/t)·etp·routed_factor received rows (the busiest
    rank's), w_1 = gate_factor·f_e/etp (module docstring). 0 for a model without expert biases."""
    if not model.expert_bias:
        return 0.0, 0.0
    (up_f, up_b), (down_f, down_b) = EXPERT_BIAS_BYTES[kernel]
    rows = sh.tokens * model.num_experts_per_tok / sh.tp * sh.etp * routed_factor
    up_width = (2.0 if model.gated_mlp else 1.0) * model.moe_ffn_hidden_size / sh.etp
    h = model.hidden_size

    def moved(up: tuple[float, float], down: tuple[float, float]) -> Array | float:
        return rows * (up_width * (up[0] * act_bytes + up[1]) + h * (down[0] * act_bytes + down[1]))

    return moved(up_f, down_f), moved(up_b, down_b)


def norm_tokens(sh: Sharding, sp: Array | float) -> Array | float:
    """T_n: tokens in the regions sequence parallelism splits."""
    return sh.tokens / np.where(np.asarray(sp) > 0, sh.tp, 1.0)


def rope_width(model: ModelSpec, tp: Array | float) -> Array | float:
    """Query + key features that get rotary embeddings on a rank of ``tp``: the query heads /t,
    the key heads over ``kv_split`` (one a rank where tp exceeds them); MLA's rope key, one head
    shared by all, /t as its queries."""
    if model.is_mla:
        return (model.num_attention_heads + 1) * model.qk_rope_head_dim / tp
    return (model.num_attention_heads / tp + model.num_kv_heads / kv_split(model, tp)) * model.head_dim


def layer_bytes(
    model: ModelSpec, sh: Sharding, sp: Array | float, kind: MlpKind, act_bytes: float,
    chunk_sort: Array | float = 0.0, allgather: Array | float = 0.0,
) -> tuple[Array | float, Array | float]:
    """(all elementwise bytes, the subset selective recompute re-runs) of one layer, forward.

    Selective recompute re-runs the cheap elementwise ops: norms, rotary, activations; residual
    adds and MoE token shuffles are kept (their outputs are the saved checkpoints).
    ``chunk_sort``: 1 where the dispatcher re-sorts the received rows by local expert and back
    (see the module docstring), else 0; ``allgather``: 1 where Megatron's allgather dispatcher
    gathers over etp·ep > 1 ranks (its combine's zero fill and fp32 casts), else 0.
    """
    h, t, tok = model.hidden_size, sh.tp, sh.tokens
    t_n = norm_tokens(sh, sp)
    norms = 2.0 * model.norms_per_layer * t_n * h
    residual = 6.0 * t_n * h
    softmax = 1.0 - model.linear_share(kind)  # the share of the kind's layers with softmax attention
    rope = 2.0 * tok * rope_width(model, t) * softmax
    extra_norms: Array | float = 0.0
    if model.qk_norm:
        heads_per_rank = model.num_attention_heads / t + model.num_kv_heads / kv_split(model, t)
        extra_norms = extra_norms + 2.0 * tok * heads_per_rank * model.head_dim * softmax
    if model.is_mla:  # the latent norms, on the down-projections' tokens (flops.attention_gemms)
        extra_norms = extra_norms + 2.0 * t_n * (model.q_lora_rank + model.kv_lora_rank)
    if model.attention_output_gate:  # sigmoid of the gate (read, write) and the product (read 2, write 1)
        extra_norms = extra_norms + 5.0 * tok * model.num_attention_heads * model.head_dim / t * softmax
    if model.has_linear_attention:
        extra_norms = extra_norms + model.linear_share(kind) * linear_mixer_elements(model, sh)
    activation: Array | float
    shuffle: Array | float
    if kind == "dense":
        activation = _dense_activation(model, sh)
        shuffle = 0.0
    else:
        moe = _MoeElements.of(model, sh, act_bytes)
        activation = moe.routed_activation
        if model.num_shared_experts:
            activation = activation + moe.shared_activation
        sort = CHUNK_SORT_PASSES * chunk_sort * moe.copies * sh.etp * h
        shuffle = 5.0 * moe.copies * h + sort + moe.router
        if np.any(allgather):
            own = tok / t
            shuffle = shuffle + allgather * (own * sh.etp * sh.ep * h * ALLGATHER_GATHERED_BYTES
                                             + own * h * ALLGATHER_OWN_BYTES) / act_bytes
    recomputable = norms + rope + extra_norms + activation
    return act_bytes * (recomputable + residual + shuffle), act_bytes * recomputable


def linear_mixer_elements(model: ModelSpec, sh: Sharding) -> Array | float:
    """Elements the memory-bound ops of one Gated DeltaNet block move on a device, forward,
    beside its projections and the chunked delta rule's own kernels (their time is the core's):
    with C = 2·Kd + Vd the convolved q, k, v channels, the causal convolution with its SiLU
    (read C, write C), the kernel's contiguous copies of q, k, v (read C, write C), the q and k
    L2 norms (read 2·Kd, write 2·Kd), and the gated RMSNorm (read the output and z, write one:
    3·Vd), all split over t by heads -> (4·C + 4·Kd + 3·Vd)·T/t. The per-head beta and decay
    (Hv a token) are left out: under 1% of it."""
    key, value = model.linear_key_width, model.linear_value_width
    channels = 2 * key + value
    return (4.0 * channels + 4.0 * key + 3.0 * value) * sh.tokens / sh.tp


def _gate_factor(model: ModelSpec) -> float:
    """Elements an MLP activation moves per hidden unit: a gated one reads gate and up and writes
    one (3), a plain one reads and writes one (2)."""
    return 3.0 if model.gated_mlp else 2.0


def _dense_activation(model: ModelSpec, sh: Sharding) -> Array | float:
    """Elements of a dense MLP's activation per device: gate_factor·T·f/t."""
    return _gate_factor(model) * sh.tokens * model.ffn_hidden_size / sh.tp


@dataclass(frozen=True)
class _MoeElements:
    """A MoE block's memory-bound elements per device (module docstring): ``copies`` the routed
    copies T·k/t, the routed experts' and the shared experts' activations, and the router's
    bytes in activation elements (``router``)."""

    copies: Array | float
    routed_activation: Array | float
    shared_activation: Array | float
    router: Array | float

    @classmethod
    def of(cls, model: ModelSpec, sh: Sharding, act_bytes: float) -> _MoeElements:
        tok, t, gate_factor = sh.tokens, sh.tp, _gate_factor(model)
        copies = tok * model.num_experts_per_tok / t
        router = ROUTER_BYTES_PER_LOGIT * (tok / t) * model.num_experts + PERMUTE_INDEX_BYTES * copies
        return cls(copies, gate_factor * copies * model.moe_ffn_hidden_size,
                   gate_factor * tok * model.num_shared_experts * model.shared_expert_ffn_hidden_size / t,
                   router / act_bytes)


def module_replay_bytes(
    model: ModelSpec, sh: Sharding, sp: Array | float, kind: MlpKind, act_bytes: float, modules: tuple[str, ...],
) -> Array | float:
    """Elementwise bytes the recompute ``modules`` (``Strategy.recompute_modules``) replay in one
    layer's backward, forward-pass counts as ``layer_bytes``: ``layernorm`` a norm that is its own
    module (MLA's input norm; a MoE layer's pre-MLP norm, which feeds the router), 2·T_n·h each;
    ``moe_act`` the routed experts' activation; ``mlp`` the dense MLP's fused norm and activation;
    ``shared_experts`` their activation; ``moe`` the MoE block's activations, token shuffles and
    router; ``mla_up_proj`` the rotary embedding it re-applies (and the query and key assembly,
    ``mla_assembly_bytes``, which layer.py adds as it counts it: op by op)."""
    h, tok = model.hidden_size, sh.tokens
    one_norm = 2.0 * norm_tokens(sh, sp) * h
    total: Array | float = 0.0
    if "layernorm" in modules:
        total = total + one_norm * ((1.0 if model.is_mla else 0.0) + (1.0 if kind == "moe" else 0.0))
    if "mla_up_proj" in modules and model.is_mla:
        total = total + 2.0 * tok * rope_width(model, sh.tp)
    if kind == "dense" and "mlp" in modules:
        total = total + one_norm + _dense_activation(model, sh)
    if kind == "moe":
        moe = _MoeElements.of(model, sh, act_bytes)
        if "moe" in modules:
            total = total + moe.routed_activation + moe.shared_activation + 5.0 * moe.copies * h + moe.router
        else:
            total = total + ("moe_act" in modules) * moe.routed_activation + ("shared_experts" in modules) * moe.shared_activation
    return act_bytes * total


def unfused_score_bytes(model: ModelSpec, sh: Sharding) -> Array | float:
    """Forward bytes of a materialised softmax (+dropout) over the full s×s score square, and of
    the soft-capping before it where the model caps its scores (three bf16 passes: 12 bytes)."""
    elements = sh.micro_batch * (model.num_attention_heads / sh.tp) * (sh.seq / sh.cp) * sh.seq
    per_score = UNFUSED_SCORE_BYTES if model.attention_dropout > 0 else UNFUSED_SCORE_BYTES_NO_DROPOUT
    return (per_score + (2.0 * SOFTCAP_ELEMENTS if model.attention_softcap else 0.0)) * elements


def head_bytes(model: ModelSpec, sh: Sharding, sp: Array | float, act_bytes: float,
               loss_upcast: bool = True, loss_parallel: bool = True) -> Array | float:
    """Final norm and cross-entropy, forward (the backward moves the same). The loss reads
    T·V/t logits where it is vocabulary-parallel (``loss_parallel``), else the T·V logits the
    output layer's all-gather replicated on every tensor-parallel rank."""
    logits = sh.tokens * model.vocab_size / (sh.tp if loss_parallel else 1.0)
    per_logit = LOSS_BYTES_PER_LOGIT if loss_upcast else LOSS_BYTES_PER_LOGIT_NO_UPCAST
    if model.final_softcap:
        per_logit = per_logit + SOFTCAP_ELEMENTS * act_bytes
    return act_bytes * 2.0 * norm_tokens(sh, sp) * model.hidden_size + per_logit * logits


def embedding_bytes(model: ModelSpec, sh: Sharding, act_bytes: float) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of the embedding lookup and its gradient scatter-add."""
    elements = sh.tokens * model.hidden_size
    return 2.0 * act_bytes * elements, EMBEDDING_GRAD_BYTES * elements
