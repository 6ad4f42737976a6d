"""FLOPs of every matmul in a decoder layer, the attention core, the output head and MTP.

All counts are for ONE micro-batch (b sequences of s tokens) on ONE device, given how the
strategy shards the work; with every degree 1 they are the whole micro-batch's FLOPs, which is
how ``model_flops`` gets the MFU numerator. Arrays broadcast: one entry per strategy.

A matmul [M, K] @ [K, N] costs 2·M·N·K FLOPs. Its backward costs the same twice more: the input
gradient dX = dY @ W^T (2·M·N·K) and the weight gradient dW = X^T @ dY (2·M·N·K); they are kept
apart so zero-bubble schedules can run the weight gradient (W) separately.

Sharding per device (tokens T = b·s per micro-batch; t = tp, c = cp, e = ep, x = etp):
* attention and dense MLP: heads and FFN width split by t; tokens split by c (context
  parallelism gives each rank s/c queries); M = T/c.
* MLA down-projections (h -> q_lora, h -> kv_lora + rope) are replicated over t (duplicated
  TELinear in Megatron-Core) and fed the attention's input as it arrives: under sequence
  parallelism each rank projects its own T/(c·t) tokens and the up-projections all-gather the
  latents; without SP every rank projects all T/c.
* routed experts: each token goes to k experts; under balanced routing the dp·cp·tp ranks of a
  stage share the T·k token-expert pairs evenly, so a device runs (T/c)·k/t of them, through
  E/e local experts of width f_e/x: tokens per local expert M = (T/c)·k·e·x/(t·E).
* router (and a shared-expert gate): Megatron-Core runs the MoE block on each rank's sequence
  shard, so under SP a device gates its T/(c·t) tokens; without SP all T/c.
* output head: vocabulary split by t (vocab-parallel), M = T/c.

Attention core, causal: query i attends to keys 0..i, so a sequence has s(s+1)/2 (query, key)
pairs: the lower triangle with its diagonal, counted exactly (not s²/2). QK^T costs 2·d_qk and
PV 2·d_v FLOPs per pair and head; a device holds a/t heads and 1/c of the pairs (ring CP with
load-balanced chunks, or Ulysses over heads: the same share). A sliding-window layer keeps
min(i + 1, w) keys for query i (``causal_pairs``), as FlashAttention skips the blocks outside
the window. A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) attends no pair: its projections are
GEMMs (``linear_attention_gemms``) and its chunked delta rule counts the FLOPs its kernels execute
(``linear_core_flops``); a layer of a kind mixing both is their mean (each GEMM's ``count`` its
share).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ndplan.model.spec import MlpKind, ModelSpec

Array = np.ndarray


@dataclass(frozen=True)
class Sharding:
    """How one micro-batch is split on a device (arrays, one entry per strategy, or scalars)."""

    micro_batch: Array | float
    seq: Array | float
    tp: Array | float = 1.0
    cp: Array | float = 1.0
    ep: Array | float = 1.0
    etp: Array | float = 1.0
    #: sequence parallelism (> 0: on)
    sp: Array | float = 0.0

    @property
    def tokens(self) -> Array | float:
        """T/c: tokens of the micro-batch this device computes."""
        return self.micro_batch * self.seq / self.cp

    @property
    def shard_tokens(self) -> Array | float:
        """Tokens of the device's sequence shard: T/(c·t) under SP, else T/c."""
        return self.tokens / np.where(np.asarray(self.sp) > 0, self.tp, 1.0)


@dataclass(frozen=True)
class Gemm:
    """``count`` matmuls [m, k] @ [k, n] (count > 1: a grouped GEMM over local experts)."""

    name: str
    m: Array | float
    n: Array | float
    k: Array | float
    count: Array | float = 1.0
    expert: bool = False

    @property
    def flops(self) -> Array | float:
        """Forward FLOPs, 2·m·n·k·count."""
        return 2.0 * self.m * self.n * self.k * self.count


def kv_split(model: ModelSpec, tp: Array | float) -> Array | float:
    """Ranks one KV head's width is spread over: min(tp, KV heads). With more TP ranks than KV
    heads (which divide tp; Megatron-Core) each rank holds one KV head whole, gathered from the
    QKV output, so a K or V tensor of width w over all heads is w/min(tp, KV heads) on a rank.
    MLA's keys and values have a head per query head: tp."""
    return np.minimum(tp, model.split_kv_heads)


def qkv_output_width(model: ModelSpec) -> int:
    """Features of the fused QKV projection's output over all heads (not MLA): the queries (twice
    as wide with an output gate, which comes out of the same projection), keys and values."""
    return (model.num_attention_heads * (2 if model.attention_output_gate else 1) + 2 * model.num_kv_heads) * model.head_dim


def attention_gemms(model: ModelSpec, sh: Sharding, kind: MlpKind | None = None, *,
                    full_attention: bool = False) -> list[Gemm]:
    """Projections of one token mixer (forward): the mean of the layers of MLP ``kind`` (all
    layers where None), a Gated DeltaNet's (``linear_attention_gemms``) on the model's 'linear'
    layers and softmax attention's on the others, each GEMM's ``count`` its share; with
    ``full_attention`` a softmax attention block alone (an MTP module's)."""
    share = 0.0 if full_attention else model.linear_share(kind)
    softmax = _softmax_attention_gemms(model, sh)
    if not share:
        return softmax
    return ([Gemm(g.name, g.m, g.n, g.k, count=g.count * (1.0 - share)) for g in softmax]
            + [Gemm(g.name, g.m, g.n, g.k, count=g.count * share) for g in linear_attention_gemms(model, sh)])


def linear_attention_gemms(model: ModelSpec, sh: Sharding) -> list[Gemm]:
    """A Gated DeltaNet block's projections (forward): h -> q, k, v, the output gate z and the
    per-head beta and decay inputs (2·Kd + 2·Vd + 2·Hv wide, heads split by t), and the output
    projection Vd -> h (Kd, Vd: key and value heads x their widths)."""
    h, t, tok = model.hidden_size, sh.tp, sh.tokens
    width = 2 * model.linear_key_width + 2 * model.linear_value_width + 2 * model.linear_num_value_heads
    return [Gemm("linear_in_proj", tok, width / t, h), Gemm("linear_out_proj", tok, h, model.linear_value_width / t)]


def _softmax_attention_gemms(model: ModelSpec, sh: Sharding) -> list[Gemm]:
    """Projections of one softmax attention block (forward), with GQA or MLA widths; q_proj
    twice as wide where it carries an output gate."""
    h, a, t, tok = model.hidden_size, model.num_attention_heads, sh.tp, sh.tokens
    if model.is_mla:
        qk = model.qk_head_dim
        out: list[Gemm] = []
        shard = sh.shard_tokens  # the down-projections' tokens (see the module docstring)
        if model.q_lora_rank:
            out.append(Gemm("q_down", shard, model.q_lora_rank, h))
            out.append(Gemm("q_up", tok, a * qk / t, model.q_lora_rank))
        else:
            out.append(Gemm("q_proj", tok, a * qk / t, h))
        out.append(Gemm("kv_down", shard, model.kv_lora_rank + model.qk_rope_head_dim, h))
        out.append(Gemm("kv_up", tok, a * (model.qk_nope_head_dim + model.v_head_dim) / t, model.kv_lora_rank))
        out.append(Gemm("o_proj", tok, h, a * model.v_head_dim / t))
        return out
    return [Gemm("qkv_proj", tok, qkv_output_width(model) / t, h), Gemm("o_proj", tok, h, a * model.head_dim / t)]


def mlp_gemms(model: ModelSpec, sh: Sharding, width: int, *, name: str = "mlp", shards: Array | float = 1.0) -> list[Gemm]:
    """A (gated) MLP of ``width`` split over ``shards`` ranks: up(+gate) fused, then down."""
    h = model.hidden_size
    up_width = (model.mlp_matrices - 1) * width
    return [Gemm(f"{name}_up", sh.tokens, up_width / shards, h), Gemm(f"{name}_down", sh.tokens, h, width / shards)]


def expert_tokens(model: ModelSpec, sh: Sharding) -> Array | float:
    """Tokens each local expert processes per micro-batch: (T/c)·k·e·x/(t·E) (balanced routing)."""
    return sh.tokens * model.num_experts_per_tok * sh.ep * sh.etp / (sh.tp * model.num_experts)


def moe_gemms(model: ModelSpec, sh: Sharding) -> list[Gemm]:
    """Router, routed experts (grouped over the E/e local experts) and shared experts."""
    h = model.hidden_size
    per_expert = expert_tokens(model, sh)
    local = model.num_experts / sh.ep
    up_width = (model.mlp_matrices - 1) * model.moe_ffn_hidden_size
    out = [
        Gemm("router", sh.shard_tokens, model.num_experts, h),  # on the sequence shard (see the module docstring)
        Gemm("experts_up", per_expert, up_width / sh.etp, h, count=local, expert=True),
        Gemm("experts_down", per_expert, h, model.moe_ffn_hidden_size / sh.etp, count=local, expert=True),
    ]
    if model.num_shared_experts:
        width = model.num_shared_experts * model.shared_expert_ffn_hidden_size
        out += mlp_gemms(model, sh, width, name="shared", shards=sh.tp)
        if model.shared_expert_gate:
            out.append(Gemm("shared_gate", sh.shard_tokens, 1.0, h))
    return out


def layer_gemms(model: ModelSpec, sh: Sharding, kind: MlpKind, *, full_attention: bool = False) -> list[Gemm]:
    """Every matmul of one decoder layer of ``kind`` (forward): its token mixer the mean of the
    kind's layers, or softmax attention where ``full_attention`` (``attention_gemms``)."""
    mlp = mlp_gemms(model, sh, model.ffn_hidden_size, shards=sh.tp) if kind == "dense" else moe_gemms(model, sh)
    return attention_gemms(model, sh, kind, full_attention=full_attention) + mlp


def matmul_sequence(model: ModelSpec, sh: Sharding, kind: MlpKind) -> list[Gemm]:
    """The layer's ``aten.mm`` calls in execution order, projections unfused, as torchtitan's
    models run them: attention q, k, v, o (GQA; MLA in ``attention_gemms`` order), then the MLP
    w1 (gate), w3 (up), w2 (down) (w1, w2 without a gate), or for a MoE layer the router and
    the shared experts' w1, w3, w2. Routed experts run as grouped GEMMs (not ``aten.mm``) and
    are left out."""
    h, a, t, tok = model.hidden_size, model.num_attention_heads, sh.tp, sh.tokens
    out: list[Gemm]
    if model.is_mla or model.has_linear_attention:  # (a Gated DeltaNet mix: its projections' mean)
        out = attention_gemms(model, sh, kind)
    else:
        d, kv = model.head_dim, model.num_kv_heads
        q_width = a * d * (2 if model.attention_output_gate else 1)
        out = [Gemm("q_proj", tok, q_width / t, h), Gemm("k_proj", tok, kv * d / t, h),
               Gemm("v_proj", tok, kv * d / t, h), Gemm("o_proj", tok, h, a * d / t)]

    def mlp(width: float, name: str) -> list[Gemm]:
        ups = [Gemm(f"{name}_w1", tok, width / t, h)]
        if model.gated_mlp:
            ups.append(Gemm(f"{name}_w3", tok, width / t, h))
        return ups + [Gemm(f"{name}_w2", tok, h, width / t)]

    if kind == "dense":
        return out + mlp(model.ffn_hidden_size, "mlp")
    out.append(Gemm("router", tok, model.num_experts, h))
    if model.num_shared_experts:
        out += mlp(model.num_shared_experts * model.shared_expert_ffn_hidden_size, "shared")
    return out


def alternate_recomputed_gemms(model: ModelSpec, sh: Sharding, kind: MlpKind) -> list[Gemm]:
    """The matmuls torchtitan's per-op selective activation checkpointing recomputes: it saves
    the output of every ``aten.mm`` except every second one, counting from 1 within each
    transformer block (``selective_ac_option = 'op'``), so the 2nd, 4th, ... matmuls of
    ``matmul_sequence`` are recomputed in the backward. For a Llama layer: k, o and w3."""
    return matmul_sequence(model, sh, kind)[1::2]


def head_gemms(model: ModelSpec, sh: Sharding) -> list[Gemm]:
    """The output projection h -> V (vocab-parallel over t)."""
    return [Gemm("output_head", sh.tokens, model.vocab_size / sh.tp, model.hidden_size)]


def mtp_gemms(model: ModelSpec, sh: Sharding) -> list[Gemm]:
    """One MTP module's own matmul: the 2h -> h projection of [embedding; hidden] (its decoder
    layer and the shared output head are counted with the layer and head formulas)."""
    h = model.hidden_size
    return [Gemm("mtp_proj", sh.tokens, h / sh.tp, 2 * h)]


def causal_pairs(seq: Array | float, window: int = 0) -> Array | float:
    """(query, key) pairs a causal mask keeps in one sequence: s(s+1)/2. With a sliding window
    of w keys (the query's own included), query i keeps min(i + 1, w):
    w(w+1)/2 + (s − w)·w once s > w."""
    if not window:
        return seq * (seq + 1) / 2.0
    kept = np.minimum(seq, window)
    return kept * (kept + 1) / 2.0 + (seq - kept) * kept


def attention_pairs(model: ModelSpec, seq: Array | float, kind: MlpKind | None = None,
                    masked_window: bool = False) -> Array | float:
    """Kept (query, key) pairs per sequence of a decoder layer, the mean over the model's layers
    (of MLP ``kind``, where given): full layers keep s(s+1)/2, sliding ones their window's
    (``causal_pairs``). Exact for the model's total, not per stage: where the sliding layers
    cluster (Qwen2's full first layers) a stage's time is off by their share, e.g. Qwen2.5-7B
    with its first half full and a 4,096-key window at 32k tokens on pp2: stage 0 takes 1.19×
    the mean's time and stage 1 0.81×, which the pipeline and the balancer do not see.

    ``masked_window``: the window reaches the kernel as an explicit mask (transformers' SDPA
    from seq >= window on), so a sliding layer computes the whole s×s square there."""
    sliding, layers = model.sliding_layers(kind)
    linear = model.linear_layers(kind)[0]  # Gated DeltaNet layers attend no pair
    if not sliding:
        return causal_pairs(seq) * (layers - linear) / layers if linear else causal_pairs(seq)
    window = causal_pairs(seq, model.sliding_window)
    if masked_window:
        window = np.where(np.asarray(seq) >= model.sliding_window, np.asarray(seq, dtype=float) ** 2, window)
    return ((layers - sliding - linear) * causal_pairs(seq) + sliding * window) / layers


def masked_pairs(model: ModelSpec, seq: Array | float, kind: MlpKind | None = None) -> Array | float:
    """Of ``attention_pairs(masked_window=True)``, the pairs the masked kernel computes: the
    whole s×s square of the sliding layers (mean over the layers of ``kind``) where seq >= window,
    else 0."""
    sliding, layers = model.sliding_layers(kind)
    if not sliding:
        return 0.0 * np.asarray(seq, dtype=float)
    square = np.asarray(seq, dtype=float) ** 2
    return np.where(np.asarray(seq) >= model.sliding_window, square * sliding / layers, 0.0)


def attention_core_flops(model: ModelSpec, sh: Sharding, *, causal: bool = True, kind: MlpKind | None = None,
                         windowed: bool = True, masked_window: bool = False) -> Array | float:
    """Forward FLOPs of QK^T and PV on a device: 2·(d_qk + d_v) per kept pair and local head,
    the pairs of a decoder layer (of ``kind``: ``attention_pairs``, ``masked_window`` passed on),
    or with ``windowed=False`` of full causal attention (MTP modules).

    ``causal=False`` counts the full s×s square, as an unfused (masked) kernel computes it,
    sliding window or not.
    """
    if not causal:
        pairs = sh.seq * sh.seq
    else:
        pairs = attention_pairs(model, sh.seq, kind, masked_window) if windowed else causal_pairs(sh.seq)
    heads = model.num_attention_heads / sh.tp
    return 2.0 * sh.micro_batch * heads * (model.qk_head_dim + model.value_head_dim) * pairs / sh.cp


#: Tokens per chunk of flash-linear-attention's chunked delta rule (``chunk_gated_delta_rule``).
LINEAR_CHUNK = 64


def linear_core_flops(model: ModelSpec, sh: Sharding, kind: MlpKind | None = None) -> tuple[Array | float, Array | float]:
    """(forward, backward) FLOPs of Gated DeltaNet's chunked delta rule on a device, the mean over
    the layers of MLP ``kind`` (0 on softmax layers), as flash-linear-attention's kernels execute
    them (every ``tl.dot``, intra-chunk tiles whole; the backward rebuilds the chunk states), per
    token and value head, with C = 64 tokens a chunk and key and value widths dk, dv:
    forward 6·dk·dv + 6·C·dk + 4·C·dv + C²/2 + 480 (the 64 x 64 triangular inverse),
    backward 16·dk·dv + 20·C·dk + 10·C·dv + 4·C² (182,752 and 524,288 at dk = dv = 128).
    A device holds Hv/t value heads and T/c tokens; GQA-like key heads do not lower it (the
    kernels work per value head)."""
    share = model.linear_share(kind)
    if not share:
        return 0.0, 0.0
    dk, dv, c = model.linear_key_head_dim, model.linear_value_head_dim, LINEAR_CHUNK
    forward = 6 * dk * dv + 6 * c * dk + 4 * c * dv + c * c / 2 + 480
    backward = 16 * dk * dv + 20 * c * dk + 10 * c * dv + 4 * c * c
    head_tokens = share * sh.tokens * model.linear_num_value_heads / sh.tp
    return head_tokens * forward, head_tokens * backward


def gemm_flops(gemms: list[Gemm]) -> Array | float:
    return sum((g.flops for g in gemms), 0.0)


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of one micro-batch on the whole model (every degree 1), per pass kind.

    ``matmul_forward`` and ``attention_forward`` are forward FLOPs; the model FLOPs of a
    training step are 3× their sum (forward + input grad + weight grad; the attention core's
    backward is counted as 2× its forward, its FLOPs being matmuls too). ``recompute_forward``
    is what activation recomputation adds (hardware FLOPs only).
    """

    matmul_forward: Array | float
    attention_forward: Array | float
    recompute_forward: Array | float

    @property
    def model(self) -> Array | float:
        return 3.0 * (self.matmul_forward + self.attention_forward)

    @property
    def hardware(self) -> Array | float:
        return self.model + self.recompute_forward


#: The GEMMs (``layer_gemms`` names) each Megatron recompute module replays in backward
#: (``Strategy.recompute_modules``); ``moe`` the whole MoE block. core_attn replays the
#: attention core; layernorm and moe_act only memory-bound ops.
_SHARED_EXPERT_GEMMS = ("shared_up", "shared_down", "shared_gate")
MODULE_GEMMS: dict[str, tuple[str, ...]] = {
    "mla_up_proj": ("q_up", "kv_up", "q_proj"),  # q_proj: MLA without a query latent (q_lora_rank 0)
    "mlp": ("mlp_up", "mlp_down"),
    "shared_experts": _SHARED_EXPERT_GEMMS,
    "moe": ("router", "experts_up", "experts_down", *_SHARED_EXPERT_GEMMS),
}


def module_gemms(gemms: list[Gemm], modules: tuple[str, ...]) -> list[Gemm]:
    """The GEMMs of ``gemms`` that the recompute ``modules`` replay (``MODULE_GEMMS``)."""
    names = {name for module in modules for name in MODULE_GEMMS.get(module, ())}
    return [g for g in gemms if g.name in names]


def model_flops_per_micro_batch(
    model: ModelSpec,
    micro_batch: Array | float,
    seq: Array | float,
    *,
    recompute_full_fraction: Array | float = 0.0,
    recompute_selective_fraction: Array | float = 0.0,
    selective_policy: str = "megatron",
    recompute_modules: tuple[str, ...] = (),
    recompute_mtp_full: Array | float = 0.0,
    recompute_mtp_selective: Array | float = 0.0,
) -> ModelFlops:
    """FLOPs of one micro-batch through the whole model, not divided by any degree.

    Matmuls: every decoder layer, the MTP modules (projection, layer and the shared head
    applied again) and the output head. The embedding lookup is a gather, not a matmul.
    ``recompute_*_fraction``: the share of decoder layers recomputed fully (adds their whole
    forward) or selectively: with ``selective_policy`` 'megatron' that adds their attention
    core's forward, with 'torchtitan-op' every second matmul (``alternate_recomputed_gemms``),
    with 'keep-matmuls' none;
    with ``recompute_modules`` what those modules replay (``MODULE_GEMMS``, the attention core
    for core_attn) whatever the policy. ``recompute_mtp_*``: the share of the MTP modules
    rebuilt fully (projection, decoder layer and its full causal attention) or selectively (their
    decoder layer's part, as above).
    """
    sh = Sharding(micro_batch, seq)
    kinds = set(model.layer_mlp_kinds) | ({model.mtp_mlp_kind} if model.mtp_depth else set())
    per_kind = {kind: gemm_flops(layer_gemms(model, sh, kind)) for kind in kinds}
    layers = sum((per_kind[k] for k in model.layer_mlp_kinds), 0.0)
    head = gemm_flops(head_gemms(model, sh))
    # a decoder layer's, the mean over layers: softmax attention's core and Gated DeltaNet's
    attention = attention_core_flops(model, sh) + linear_core_flops(model, sh)[0]
    mtp = model.mtp_depth * (
        gemm_flops(mtp_gemms(model, sh)) + gemm_flops(layer_gemms(model, sh, model.mtp_mlp_kind)) + head
    )
    layers_attention = model.num_layers * attention
    mtp_attention = attention_core_flops(model, sh, windowed=False)
    if recompute_modules:
        per_kind_rc = {kind: gemm_flops(module_gemms(layer_gemms(model, sh, kind), recompute_modules)) for kind in kinds}
        core = "core_attn" in recompute_modules
    elif selective_policy == "keep-matmuls":
        per_kind_rc = {kind: 0.0 for kind in kinds}  # every matmul's and the attention core's output is kept
        core = False
    elif selective_policy == "torchtitan-op":
        per_kind_rc = {kind: gemm_flops(alternate_recomputed_gemms(model, sh, kind)) for kind in kinds}
        core = False
    else:
        per_kind_rc = {kind: 0.0 for kind in kinds}
        core = True
    selective = sum((per_kind_rc[k] for k in model.layer_mlp_kinds), 0.0)
    if core:
        selective = selective + layers_attention
    recompute = recompute_full_fraction * (layers + layers_attention) + recompute_selective_fraction * selective
    if model.mtp_depth:
        kind = model.mtp_mlp_kind
        full_mtp = gemm_flops(mtp_gemms(model, sh)) + per_kind[kind] + mtp_attention
        selective_mtp = per_kind_rc[kind] + (mtp_attention if core else 0.0)
        recompute = recompute + model.mtp_depth * (recompute_mtp_full * full_mtp + recompute_mtp_selective * selective_mtp)
    return ModelFlops(
        matmul_forward=layers + head + mtp,
        attention_forward=layers_attention + model.mtp_depth * mtp_attention,
        recompute_forward=recompute,
    )
