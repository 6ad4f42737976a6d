"""Exact parameter counts per block, as the transformers modeling code builds them.

Counts are element counts (Python ints, exact). Memory code multiplies them by bytes per element.
Every formula here is pinned by a test that builds the same config with transformers on the meta
device and sums ``numel()`` per block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ndplan.model.spec import MlpKind, ModelSpec


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, split the way sharding treats them.

    ``attention`` includes the projections, their biases, QK-norm and MLA's latent norms (in a
    kind whose layers mix softmax and Gated DeltaNet attention, their mean: ``mixer_params``);
    ``norms`` the h-wide norms around attention and MLP (``ModelSpec.norms_per_layer``); ``mlp`` the dense MLP (0 in a MoE layer);
    ``router`` the gate; ``routed_experts`` all routed experts together; ``shared_experts`` the
    always-on experts and their gate.
    """

    attention: int | float
    norms: int
    mlp: int
    router: int
    routed_experts: int
    shared_experts: int

    @property
    def total(self) -> int | float:
        return self.attention + self.norms + self.mlp + self.router + self.routed_experts + self.shared_experts

    @property
    def non_expert(self) -> int | float:
        """What every rank of an expert-parallel group holds in full: all but the experts."""
        return self.attention + self.norms + self.mlp + self.router


def norm_params(spec: ModelSpec, width: int) -> int:
    """One norm over ``width`` features: a weight, plus a bias for LayerNorm with bias."""
    return width * (2 if spec.norm == "layernorm" and spec.norm_bias else 1)


def layer_norm_params(spec: ModelSpec) -> int:
    """A decoder layer's h-wide norms (``ModelSpec.norms_per_layer`` of them): two, or four with
    sandwich norms."""
    return spec.norms_per_layer * norm_params(spec, spec.hidden_size)


def attention_params(spec: ModelSpec) -> int:
    """One softmax attention block: q, k, v, o projections (q twice as wide with an output
    gate), their biases, q/k norms and sinks; MLA's latent projections and norms."""
    h = spec.hidden_size
    heads = spec.num_attention_heads
    if spec.is_mla:
        qk = spec.qk_head_dim
        if spec.q_lora_rank:
            q_rank = spec.q_lora_rank
            query = h * q_rank + (q_rank if spec.qkv_bias else 0) + norm_params(spec, q_rank) + q_rank * heads * qk
        else:
            query = h * heads * qk
        kv_down = spec.kv_lora_rank + spec.qk_rope_head_dim
        key_value = (
            h * kv_down
            + (kv_down if spec.qkv_bias else 0)
            + norm_params(spec, spec.kv_lora_rank)  # kv_a_layernorm
            + spec.kv_lora_rank * heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        )
        output = heads * spec.v_head_dim * h + (h if spec.o_bias else 0)
        return query + key_value + output
    d = spec.head_dim
    q_width = heads * d
    kv_width = spec.num_kv_heads * d
    projected = q_width * (2 if spec.attention_output_gate else 1) + 2 * kv_width
    qkv = h * projected + (projected if spec.qkv_bias else 0)
    output = q_width * h + (h if spec.o_bias else 0)
    qk_norm = qk_norm_params(spec)
    sinks = heads if spec.attention_sinks else 0
    return qkv + output + qk_norm + sinks


def linear_attention_params(spec: ModelSpec) -> int:
    """One Gated DeltaNet block (Qwen3-Next, Qwen3.5), Kd = key heads x key width, Vd = value
    heads x value width, Hv value heads: the input projections h -> q, k (Kd each), v and the
    output gate z (Vd each), and the per-head beta and decay inputs (Hv each); the depthwise causal
    convolution over q, k, v ((2Kd + Vd) x kernel taps, no bias); dt_bias and A_log (Hv each);
    the gated RMSNorm over each value head (one weight of the value width, shared by the heads);
    the output projection Vd -> h."""
    if not spec.has_linear_attention:
        return 0
    h = spec.hidden_size
    key, value, heads = spec.linear_key_width, spec.linear_value_width, spec.linear_num_value_heads
    projections = h * (2 * key + 2 * value + 2 * heads)
    convolution = (2 * key + value) * spec.linear_conv_kernel
    return projections + convolution + 2 * heads + norm_params(spec, spec.linear_value_head_dim) + value * h


def mixer_params(spec: ModelSpec, kind: MlpKind | None = None) -> float:
    """A decoder layer's token mixer (of MLP ``kind``, where given) as the mean of its layers:
    softmax attention, or a Gated DeltaNet on the model's 'linear' layers."""
    share = spec.linear_share(kind)
    return (1.0 - share) * attention_params(spec) + share * linear_attention_params(spec) if share else attention_params(spec)


def qk_norm_params(spec: ModelSpec) -> int:
    """Weights of the q and k norms: one norm of head_dim each (shared by the heads), or, over the
    whole projection (``qk_norm_width`` 'projection'), one of heads x head_dim and one of
    kv_heads x head_dim; 0 without q/k norms."""
    if not spec.qk_norm:
        return 0
    d = spec.head_dim
    if spec.qk_norm_width == "projection":
        return norm_params(spec, spec.num_attention_heads * d) + norm_params(spec, spec.num_kv_heads * d)
    return 2 * norm_params(spec, d)


def mlp_params(spec: ModelSpec, width: int, *, bias: bool) -> int:
    """A (gated) MLP of ``width``: gate/up project h -> width, down projects width -> h."""
    up_matrices = spec.mlp_matrices - 1
    weights = spec.mlp_matrices * spec.hidden_size * width
    biases = (up_matrices * width + spec.hidden_size) if bias else 0
    return weights + biases


def layer_params(spec: ModelSpec, kind: MlpKind, *, full_attention: bool = False) -> LayerParams:
    """One decoder layer of MLP ``kind``: its token mixer the mean of the kind's layers
    (``mixer_params``), or a softmax attention block where ``full_attention`` (an MTP module's)."""
    h = spec.hidden_size
    attention = attention_params(spec) if full_attention else mixer_params(spec, kind)
    norms = layer_norm_params(spec)
    if kind == "dense":
        return LayerParams(attention, norms, mlp_params(spec, spec.ffn_hidden_size, bias=spec.mlp_bias), 0, 0, 0)
    router = spec.num_experts * (h + (1 if spec.router_bias else 0))
    # Expert weights are stacked 3-D tensors in transformers, without biases but in gpt-oss.
    routed = spec.num_experts * mlp_params(spec, spec.moe_ffn_hidden_size, bias=spec.expert_bias)
    shared = spec.num_shared_experts * mlp_params(spec, spec.shared_expert_ffn_hidden_size, bias=False)
    if spec.shared_expert_gate:
        shared += h
    return LayerParams(attention, norms, 0, router, routed, shared)


def mtp_extra_params(spec: ModelSpec) -> int:
    """One MTP module beyond its decoder layer: two input norms, the 2h -> h projection, and the
    output norm. The embedding and output head are shared with the main model (DeepSeek-V3,
    Megatron-Core), so they are not counted again."""
    h = spec.hidden_size
    return 3 * norm_params(spec, h) + 2 * h * h


@dataclass(frozen=True)
class ParameterCounts:
    """Whole-model parameter counts per block. ``total`` excludes MTP modules, as published model
    sizes do (DeepSeek-V3: 671B + 14B MTP); ``total_with_mtp`` includes them."""

    embedding: int
    attention: int
    norms: int
    mlp: int
    router: int
    routed_experts: int
    shared_experts: int
    final_norm: int
    output_head: int
    mtp: int
    active: int

    @property
    def total(self) -> int:
        return (
            self.embedding + self.attention + self.norms + self.mlp + self.router
            + self.routed_experts + self.shared_experts + self.final_norm + self.output_head
        )

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp

    def blocks(self) -> dict[str, int]:
        out = asdict(self)
        out.pop("active")
        return out


def count_parameters(spec: ModelSpec | str) -> ParameterCounts:
    """Sum per-layer counts over the body; active = total minus the routed experts a token skips.
    ``spec``: a ModelSpec, or a preset name, config path or model folder."""
    from ndplan.model.presets import as_model

    spec = as_model(spec)
    per_kind = {kind: layer_params(spec, kind, full_attention=True) for kind in set(spec.layer_mlp_kinds)}
    sums = dict.fromkeys(("attention", "norms", "mlp", "router", "routed_experts", "shared_experts"), 0)
    for kind in spec.layer_mlp_kinds:
        for key in sums:
            sums[key] += getattr(per_kind[kind], key)
    # Counted layer by layer: a Gated DeltaNet layer's mixer in place of its softmax attention.
    linear = spec.linear_layers()[0]
    sums["attention"] += linear * (linear_attention_params(spec) - attention_params(spec))
    embedding = spec.vocab_size * spec.hidden_size
    output_head = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    mtp = spec.mtp_depth * (mtp_extra_params(spec) + int(layer_params(spec, spec.mtp_mlp_kind, full_attention=True).total))
    skipped_experts = 0
    if spec.num_experts:
        skipped_experts = sums["routed_experts"] * (spec.num_experts - spec.num_experts_per_tok) // spec.num_experts
    counts = ParameterCounts(
        embedding=embedding,
        final_norm=norm_params(spec, spec.hidden_size),
        output_head=output_head,
        mtp=mtp,
        active=0,
        **sums,
    )
    return ParameterCounts(**{**asdict(counts), "active": counts.total - skipped_experts})


# --------------------------------------------------------------------------- parameter groups
#: Model types whose MoE block holds its router before its experts (Hugging Face transformers 5
#: module order, traced: Mixtral's router group runs before its experts'; Qwen3-MoE's and
#: DeepSeek-V2's after them).
ROUTER_FIRST_MODEL_TYPES = frozenset({"mixtral"})


def weight_grad_groups(model: ModelSpec) -> dict[str, float]:
    """Per layer kind, the parameter groups of one decoder layer: parameters whose gradients
    come from one op (a linear's weight and bias, a norm's weight) form one group, and a split
    backward's weight-gradient step runs one autograd call per group. Counted as Hugging Face
    modules hold them: fused 3-D expert weights (gate_up, down), one router. A kind whose layers
    mix Gated DeltaNet and softmax attention counts their mean (``_mixer_groups``)."""
    _, mlp, shared = _weight_grad_blocks(model)
    norms = model.norms_per_layer
    return {"dense": _mixer_groups(model, "dense") + mlp + norms,
            "moe": _mixer_groups(model, "moe") + 1 + 2 + shared + norms}


def weight_grad_peak_group(model: ModelSpec) -> dict[str, float]:
    """Per layer kind, the group at which a layer's rebuilt copies peak: the MLP's down
    projection (the routed experts' in an MoE layer), after which nothing later keeps that
    branch of the graph alive. Groups come in module order: attention, then the MLP (router and
    experts in the model's order, then shared experts), then the norms."""
    _, mlp, _ = _weight_grad_blocks(model)
    router_first = 1 if model.model_type in ROUTER_FIRST_MODEL_TYPES else 0
    return {"dense": _mixer_groups(model, "dense") + mlp, "moe": _mixer_groups(model, "moe") + router_first + 2}


def _mixer_groups(model: ModelSpec, kind: MlpKind) -> float:
    """Parameter groups of a layer's token mixer, the mean over the layers of ``kind``: softmax
    attention's (``_weight_grad_blocks``), or a Gated DeltaNet's: Qwen3.5's in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a, conv1d, dt_bias, A_log, the gated norm and out_proj (9); Qwen3-Next fuses
    the projections into in_proj_qkvz and in_proj_ba (7)."""
    attention = _weight_grad_blocks(model)[0]
    share = model.linear_share(kind)
    if not share:
        return attention
    linear = 7 if model.model_type == "qwen3_next" else 9
    return (1.0 - share) * attention + share * linear


def _weight_grad_blocks(model: ModelSpec) -> tuple[int, int, int]:
    """Parameter groups of a layer's attention, of a dense MLP, and of the shared experts."""
    if model.is_mla:
        attention = (3 if model.q_lora_rank else 1) + 3 + 1  # q (a, norm, b), kv (a, norm, b), o
    else:
        attention = 4 + (2 if model.qk_norm else 0)  # q, k, v, o (+ the per-head q and k norms)
    mlp = 3 if model.gated_mlp else 2
    shared = (mlp if model.num_shared_experts else 0) + (1 if model.shared_expert_gate else 0)
    return attention, mlp, shared
