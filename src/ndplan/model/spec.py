"""ModelSpec: one immutable description of a decoder-only LLM, in ndplan's own field names.

Everything downstream (parameter counts, memory, FLOPs) reads a ModelSpec and nothing else, so a
model from a Hugging Face config, a preset or a user's YAML file is priced by the same formulas.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The most decoder layers (and MTP modules) a model may have. No model comes near (DeepSeek-V3
#: has 61); the bound keeps a typo'd count from building per-layer tuples of billions of entries.
MAX_LAYERS = 100_000

#: The largest width or count (hidden size, head_dim, vocabulary, experts, window...) a model may
#: state: far above any real model, and low enough that the memory and time formulas stay within
#: 64-bit integers instead of overflowing.
MAX_SIZE = 2**32

MlpKind = Literal["dense", "moe"]
AttentionSpan = Literal["full", "sliding", "linear"]
AttentionKind = Literal["mha", "gqa", "mqa", "mla"]


#: ModelSpec fields that do not shape any one layer's tensors: the model's name and its stack
#: (how many layers, of which MLP and attention kind, the MTP depth, the longest position).
_NOT_LAYER_SHAPE = ("name", "num_layers", "layer_mlp_kinds", "layer_attention_spans", "mtp_depth",
                    "max_position_embeddings")


class ModelSpec(BaseModel):
    """Architecture of a decoder-only transformer.

    Widths are element counts (not bytes). ``layer_mlp_kinds[i]`` says whether body layer ``i``
    has a dense MLP or a mixture of experts; MTP modules (``mtp_depth``) follow the body and use
    the kind of the last body layer, as DeepSeek-V3 does. ``layer_attention_spans[i]`` says
    whether its queries attend every earlier key ("full") or the last ``sliding_window`` keys
    only ("sliding", Mistral's sliding-window attention), or whether the layer mixes tokens
    through a Gated DeltaNet instead of softmax attention ("linear": Qwen3-Next, Qwen3.5; its
    widths are the ``linear_*`` fields); MTP modules attend in full.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    model_type: str = "custom"

    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(ge=0, description="width of the dense MLP (0 if every layer is MoE)")
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0, description="query/key head width for MHA/GQA/MQA")
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False

    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_bias: bool = False
    #: Where a layer's norms sit: "pre" before attention and MLP (Llama: x + f(norm(x)), two a
    #: layer); "post" on each branch's output before the residual add (OLMo 2 and 3:
    #: x + norm(f(x)), two a layer); "sandwich" both (Gemma 2 and 3: x + norm(f(norm(x))), four).
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    activation: str = "silu"
    gated_mlp: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    #: What a q/k norm normalises: each head's head_dim (Qwen3, GLM-4.5, Megatron's --qk-layernorm)
    #: or the whole projection, heads x head_dim (MiniMax-M2, OLMo 2): one weight per element of
    #: it, which a TP rank holds for its own heads.
    qk_norm_width: Literal["head", "projection"] = "head"
    attention_sinks: bool = False  # a learned logit per head joining each softmax (gpt-oss)
    #: A sigmoid gate on each head's attention output, projected by q_proj beside the query
    #: (Qwen3-Next, Qwen3.5: q_proj is 2 x heads x head_dim wide).
    attention_output_gate: bool = False
    #: Soft-capping (Gemma 2): attention scores become c·tanh(scores/c) with c this (0: none),
    #: and the output logits with ``final_softcap``.
    attention_softcap: float = Field(default=0.0, ge=0.0, description="0: attention scores not capped")
    final_softcap: float = Field(default=0.0, ge=0.0, description="0: output logits not capped")
    # Dropout probabilities in training. They cost memory where a runtime keeps the masks for
    # backward (Megatron's bias-dropout-add; unfused attention's dropout); 0 keeps none.
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="on each residual branch's output")
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="on the attention probabilities")

    # Multi-head latent attention (DeepSeek-V2/V3). kv_lora_rank > 0 switches it on.
    q_lora_rank: int = Field(default=0, ge=0, description="0: queries are not compressed")
    kv_lora_rank: int = Field(default=0, ge=0)
    qk_rope_head_dim: int = Field(default=0, ge=0)
    qk_nope_head_dim: int = Field(default=0, ge=0)
    v_head_dim: int = Field(default=0, ge=0)

    # Mixture of experts. num_experts == 0 means a dense model.
    num_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(default=0, ge=0)
    moe_ffn_hidden_size: int = Field(default=0, ge=0)
    num_shared_experts: int = Field(default=0, ge=0)
    shared_expert_ffn_hidden_size: int = Field(default=0, ge=0, description="width of each shared expert")
    shared_expert_gate: bool = False
    router_bias: bool = False
    #: The router renormalises its top-k weights to sum to one (and keeps their sum and quotient
    #: for backward): transformers' norm_topk_prob, true for Mixtral, DeepSeek-V3, Qwen3-Next.
    norm_topk_prob: bool = True
    expert_bias: bool = False  # biases on every routed expert's projections (gpt-oss)
    layer_mlp_kinds: tuple[MlpKind, ...] = ()

    mtp_depth: int = Field(default=0, ge=0, le=MAX_LAYERS, description="multi-token-prediction modules")
    max_position_embeddings: int = Field(default=0, ge=0)
    sliding_window: int = Field(default=0, ge=0, description="keys a sliding layer's query attends, itself "
                                                            "included (0: no sliding layers)")
    layer_attention_spans: tuple[AttentionSpan, ...] = ()

    # Gated DeltaNet (linear attention) layers, the "linear" spans: key heads of
    # linear_key_head_dim (queries share them), value heads of linear_value_head_dim (a multiple
    # of the key heads), a causal depthwise convolution of linear_conv_kernel taps over q, k, v.
    linear_num_key_heads: int = Field(default=0, ge=0)
    linear_num_value_heads: int = Field(default=0, ge=0)
    linear_key_head_dim: int = Field(default=0, ge=0)
    linear_value_head_dim: int = Field(default=0, ge=0)
    linear_conv_kernel: int = Field(default=0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_layer_kinds(cls, data: object) -> object:
        # A spec without per-layer kinds is homogeneous: all MoE if it has experts, else dense.
        # A bad num_layers (not a count, or over MAX_LAYERS: gigabytes of tuple) builds nothing;
        # its field validator reports it.
        if not isinstance(data, dict) or not _countable(data.get("num_layers")):
            return data
        layers = int(data["num_layers"])
        if not data.get("layer_mlp_kinds"):
            data = {**data, "layer_mlp_kinds": ("moe" if data.get("num_experts", 0) else "dense",) * layers}
        if not data.get("layer_attention_spans"):
            # A window without a pattern slides on every layer, as Mistral's config means it.
            data = {**data, "layer_attention_spans": ("sliding" if data.get("sliding_window") else "full",) * layers}
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> ModelSpec:
        for field_name, value in self:
            if type(value) is int and value > MAX_SIZE:
                raise ValueError(f"field '{field_name}' must be at most {MAX_SIZE:,} (2^32), got {value}")
        if len(self.layer_mlp_kinds) != self.num_layers:
            raise ValueError(
                f"layer_mlp_kinds has {len(self.layer_mlp_kinds)} entries but num_layers={self.num_layers}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} does not divide num_attention_heads={self.num_attention_heads}"
            )
        if self.is_mla and not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim):
            raise ValueError("MLA (kv_lora_rank > 0) needs qk_rope_head_dim, qk_nope_head_dim and v_head_dim > 0")
        for width in ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if not self.is_mla and getattr(self, width):
                # Without kv_lora_rank the layer is priced as MHA/GQA of head_dim: the width would be dropped.
                raise ValueError(f"field '{width}' ({getattr(self, width)}) is a multi-head latent attention width, "
                                 f"but kv_lora_rank=0 (MLA off); give kv_lora_rank > 0 or leave {width} 0")
        has_moe = "moe" in self.layer_mlp_kinds
        if has_moe:
            if not self.num_experts:
                raise ValueError("layer_mlp_kinds names 'moe' layers but num_experts=0")
            if not self.moe_ffn_hidden_size:
                raise ValueError("a MoE model needs moe_ffn_hidden_size > 0")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
                )
        if len(self.layer_attention_spans) != self.num_layers:
            raise ValueError(
                f"layer_attention_spans has {len(self.layer_attention_spans)} entries but num_layers={self.num_layers}"
            )
        if "sliding" in self.layer_attention_spans and not self.sliding_window:
            raise ValueError("layer_attention_spans names 'sliding' layers but sliding_window=0")
        linear_widths = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel")
        if "linear" in self.layer_attention_spans:
            missing = [width for width in linear_widths if not getattr(self, width)]
            if missing:
                raise ValueError(f"layer_attention_spans names 'linear' (Gated DeltaNet) layers but "
                                 f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} 0")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_key_heads={self.linear_num_key_heads} does not divide "
                                 f"linear_num_value_heads={self.linear_num_value_heads}")
            if self.is_mla:
                raise ValueError("Gated DeltaNet ('linear') layers beside multi-head latent attention "
                                 "(kv_lora_rank > 0) are not supported")
        else:
            for width in linear_widths:
                if getattr(self, width):
                    raise ValueError(f"field '{width}' ({getattr(self, width)}) is a Gated DeltaNet width, but no "
                                     "layer is 'linear' in layer_attention_spans; name the linear layers or leave it 0")
        if "dense" in self.layer_mlp_kinds and not self.ffn_hidden_size:
            raise ValueError("dense layers need ffn_hidden_size > 0")
        if self.num_shared_experts and not self.shared_expert_ffn_hidden_size:
            raise ValueError("num_shared_experts > 0 needs shared_expert_ffn_hidden_size > 0")
        return self

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def split_kv_heads(self) -> int:
        """The key/value heads tensor parallelism splits: the KV heads, or, for MLA, whose keys
        and values are up-projected per query head, the query heads."""
        return self.num_attention_heads if self.is_mla else self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return "moe" in self.layer_mlp_kinds

    @property
    def biases_beyond_qkv(self) -> bool:
        """Whether a linear layer other than the query/key/value projection has a bias: the
        attention output's, a dense MLP's (where the model has dense layers) or an expert's
        (where it has experts). Megatron's one switch for them, add_bias_linear, then stays on."""
        return bool(self.o_bias or (self.mlp_bias and self.num_dense_layers) or (self.expert_bias and self.is_moe))

    @property
    def attention_kind(self) -> AttentionKind:
        if self.is_mla:
            return "mla"
        if self.num_kv_heads == self.num_attention_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    @property
    def num_moe_layers(self) -> int:
        return self.layer_mlp_kinds.count("moe")

    @property
    def num_dense_layers(self) -> int:
        return self.layer_mlp_kinds.count("dense")

    def sliding_layers(self, kind: MlpKind | None = None) -> tuple[int, int]:
        """(sliding-window layers, layers) among the decoder layers (of MLP ``kind``, where given);
        no sliding layer where the model has no window."""
        return self._span_layers("sliding", kind) if self.sliding_window else (0, self._layers_of(kind))

    def linear_layers(self, kind: MlpKind | None = None) -> tuple[int, int]:
        """(Gated DeltaNet layers, layers) among the decoder layers (of MLP ``kind``, where given)."""
        return self._span_layers("linear", kind) if self.has_linear_attention else (0, self._layers_of(kind))

    def _layers_of(self, kind: MlpKind | None) -> int:
        return sum(1 for k in self.layer_mlp_kinds if kind is None or k == kind)

    def _span_layers(self, span: AttentionSpan, kind: MlpKind | None) -> tuple[int, int]:
        """(layers attending with ``span``, layers) among the decoder layers of MLP ``kind``."""
        spans = [s for s, k in zip(self.layer_attention_spans, self.layer_mlp_kinds, strict=True)
                 if kind is None or k == kind]
        return spans.count(span), len(spans)

    def linear_share(self, kind: MlpKind | None = None) -> float:
        """The share of the decoder layers (of MLP ``kind``) that are Gated DeltaNet layers: a
        layer of the kind is priced as this mix of a Gated DeltaNet and a softmax attention layer."""
        linear, layers = self.linear_layers(kind)
        return linear / layers if layers else 0.0

    @property
    def has_linear_attention(self) -> bool:
        return "linear" in self.layer_attention_spans

    @property
    def linear_key_width(self) -> int:
        """Elements of a Gated DeltaNet layer's queries (= its keys) per token: key heads x width."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_width(self) -> int:
        """Elements of a Gated DeltaNet layer's values (= its output, = its gate z) per token."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def mtp_mlp_kind(self) -> MlpKind:
        return self.layer_mlp_kinds[-1]

    @property
    def mlp_kinds(self) -> frozenset[MlpKind]:
        """The MLP kinds the model runs: its decoder layers' and, with MTP, its modules'."""
        return frozenset((*self.layer_mlp_kinds, *((self.mtp_mlp_kind,) if self.mtp_depth else ())))

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: nope + rope parts for MLA, head_dim otherwise."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    def layer_architecture(self) -> tuple[tuple[str, Any], ...]:
        """The fields that shape one layer's tensors, as sorted (field, value) pairs: every field
        but the name and how many layers of which kind the model stacks. Two models that agree on
        these keep the same bytes per token in a layer of the same kind (a census's business)."""
        return tuple(sorted((name, value) for name, value in self.model_dump().items()
                            if name not in _NOT_LAYER_SHAPE))

    @property
    def norms_per_layer(self) -> int:
        """Norms of width hidden_size in one decoder layer: four with sandwich norms, else two."""
        return 4 if self.norm_placement == "sandwich" else 2

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices per MLP: gate, up and down when gated (SwiGLU), up and down otherwise."""
        return 3 if self.gated_mlp else 2


def _countable(num_layers: object) -> bool:
    """Whether ``num_layers`` is a layer count per-layer tuples can be built for."""
    try:
        return 0 < int(num_layers) <= MAX_LAYERS  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
