"""Read a Hugging Face ``config.json`` into a ModelSpec.

Each supported ``model_type`` is mapped field by field as its transformers modeling code reads
the config, with transformers' defaults for the fields a config may leave out (HF_DEFAULTS), so
that parameter counts match what transformers builds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from ndplan.errors import NdplanError, did_you_mean
from ndplan.model.spec import MAX_LAYERS, MAX_SIZE, MlpKind, ModelSpec

HfConfig = Mapping[str, Any]

_MISSING = object()


#: Sizes and counts a model cannot have zero of (others, such as q_lora_rank, use 0 for none).
_AT_LEAST_ONE = frozenset({
    "num_attention_heads", "num_key_value_heads", "hidden_size", "num_hidden_layers", "vocab_size",
    "intermediate_size", "num_local_experts", "decoder_sparse_step", "moe_layer_freq", "moe_intermediate_size",
    "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "head_dim", "n_routed_experts", "sliding_window_pattern",
})

#: Fields whose null reads as their default (absent). Elsewhere a null is refused: transformers'
#: configs reject null for the other counts, and DeepSeek's own code reads a null
#: n_routed_experts as a dense model and a null n_shared_experts as none, so transformers'
#: example value (64 or 256 routed experts, 1 or 2 shared...) would be a silently wrong count.
_NULL_IS_DEFAULT = frozenset({
    "num_key_value_heads",  # null: num_attention_heads, as transformers' __post_init__ reads it
    "max_position_embeddings", "num_nextn_predict_layers",  # null: none
    "moe_layer_freq",  # transformers does not read it
})

#: Counts of layers, bounded by MAX_LAYERS (every other field by MAX_SIZE).
_LAYER_COUNTS = frozenset({"num_hidden_layers", "num_nextn_predict_layers"})


class _Reader:
    """Reads fields of one config and says which one is missing or malformed."""

    def __init__(self, config: HfConfig, source: str):
        self.config = config
        self.source = source
        self.model_type = str(config.get("model_type"))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        value = self.config.get(key, default)
        if value is _MISSING:
            raise NdplanError(
                f"{self.source}: missing field '{key}' (required for model_type '{self.model_type}')"
            )
        return value

    def integer(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        least = 1 if key in _AT_LEAST_ONE else 0
        if value is None and default is not _MISSING:
            if key not in _NULL_IS_DEFAULT:
                raise NdplanError(f"{self.source}: field '{key}' must be an integer (at least {least}), got null")
            value = default
        if isinstance(value, bool) or not isinstance(value, int):
            raise NdplanError(f"{self.source}: field '{key}' must be an integer, got {value!r}")
        if value < least:
            raise NdplanError(f"{self.source}: field '{key}' must be at least {least}, got {value}")
        most = MAX_LAYERS if key in _LAYER_COUNTS else MAX_SIZE
        if value > most:
            raise NdplanError(f"{self.source}: field '{key}' must be at most {most:,}, got {value}")
        return value

    def probability(self, key: str) -> float:
        """A dropout probability: absent or null is none (0)."""
        value = self.config.get(key)
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise NdplanError(f"{self.source}: field '{key}' must be a probability in [0, 1), got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise NdplanError(f"{self.source}: field '{key}' must be true or false, got {value!r}")
        return value


#: What transformers' config class for each model_type fills in where config.json leaves a field
#: out (transformers 5.24.0, models/<type>/configuration_<type>.py; kimi_k2 runs DeepSeek-V3's
#: code, so it takes deepseek_v3's), for the fields ndplan reads with a fallback. ``None`` for
#: num_key_value_heads: num_attention_heads; for head_dim: hidden_size // num_attention_heads.
#: No head_dim entry: the type's head widths come from other fields (DeepSeek's MLA dims), and
#: its KV heads are its query heads (no num_key_value_heads entry either).
#: Fields a model cannot be sized without (hidden_size, num_hidden_layers, intermediate_size,
#: expert counts and widths, MLA ranks...) stay required: a missing one is an error, not
#: transformers' example model's value.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "sliding_window": 4096},
    "mixtral": {"num_key_value_heads": 8, "head_dim": None, "sliding_window": None},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None},
    "qwen2_moe": {"num_key_value_heads": 16, "head_dim": None, "shared_expert_intermediate_size": 5632},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": None, "sliding_window": 4096},
    # num_experts_per_tok: DeepseekV2Config's default is None (no router top-k), so it is required.
    "deepseek_v2": {"n_routed_experts": 64, "n_shared_experts": 2,
                    "q_lora_rank": 1536, "first_k_dense_replace": 0, "num_experts_per_tok": _MISSING,
                    "num_nextn_predict_layers": 0},
    # num_nextn_predict_layers absent: no MTP module. DeepseekV3Config defaults its num_mtp_layers
    # to 1, but transformers builds no MTP module whatever it says, and training runs one only
    # where asked (Megatron's --mtp-num-layers): a config that does not state it gets none.
    "deepseek_v3": {"n_routed_experts": 256, "n_shared_experts": 1,
                    "q_lora_rank": 1536, "first_k_dense_replace": 3, "num_experts_per_tok": 8,
                    "num_nextn_predict_layers": 0},
    "gpt_oss": {"num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "num_experts_per_tok": 4},
    # Glm4MoeConfig has no head_dim field: its attention reads getattr(config, "head_dim",
    # hidden_size // num_attention_heads). num_nextn_predict_layers absent: no MTP module, as for
    # DeepSeek-V3 (its config class defaults it to 1; transformers builds none).
    "glm4_moe": {"num_key_value_heads": 8, "head_dim": None, "n_routed_experts": 128, "n_shared_experts": 1,
                 "first_k_dense_replace": 1, "num_experts_per_tok": 8, "num_nextn_predict_layers": 0},
    # Glm4MoeLiteConfig has no first_k_dense_replace: its layers follow mlp_layer_types
    # (_glm4_moe_lite), which the 1 here, read and then replaced, does not decide.
    "glm4_moe_lite": {"n_routed_experts": 64, "n_shared_experts": 1, "q_lora_rank": 768,
                      "first_k_dense_replace": 1, "num_experts_per_tok": 4, "num_nextn_predict_layers": 0},
    "minimax_m2": {"num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256, "num_experts_per_tok": 8},
    "phi3": {"num_key_value_heads": None, "head_dim": None},
    "olmo2": {"num_key_value_heads": None, "head_dim": None},
    "olmo3": {"num_key_value_heads": None, "head_dim": None, "sliding_window": 4096},
    "olmoe": {"num_key_value_heads": None, "head_dim": None, "num_experts": 64, "num_experts_per_tok": 8},
    # Gemma3TextConfig's sizes are Gemma 3 4B's, whose text_config leaves its heads and vocabulary out.
    "gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                    "vocab_size": 262_208,
                    "hidden_activation": "gelu_pytorch_tanh", "sliding_window_pattern": 6},
}
# Qwen3-Next and Qwen3.5 (transformers' Qwen3NextConfig and the Qwen3.5 text configs built on it):
# GQA of 256-wide heads beside Gated DeltaNet layers of 16 key heads and 32 value heads of 128.
_GATED_DELTANET_DEFAULTS = {"head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
HF_DEFAULTS["qwen3_next"] = {**_GATED_DELTANET_DEFAULTS, "num_key_value_heads": 2, "num_experts": 512,
                             "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                             "shared_expert_intermediate_size": 512}
HF_DEFAULTS["qwen3_5_text"] = {**_GATED_DELTANET_DEFAULTS, "num_key_value_heads": 4}
HF_DEFAULTS["qwen3_5_moe_text"] = {**_GATED_DELTANET_DEFAULTS, "num_key_value_heads": 2, "num_experts": 256,
                                   "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                                   "shared_expert_intermediate_size": 512}
# Gemma2Config's sizes are Gemma 2 2B's; its attention and output logits soft-capped at 50 and 30.
HF_DEFAULTS["gemma2"] = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                         "vocab_size": 256_000, "hidden_activation": "gelu_pytorch_tanh",
                         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
HF_DEFAULTS["kimi_k2"] = HF_DEFAULTS["deepseek_v3"]

#: Model types whose transformers config rejects a hidden_size that num_attention_heads does not
#: divide, even where head_dim is given (LlamaConfig, DeepseekV2Config.validate_architecture).
_HIDDEN_DIVIDES_BY_HEADS = frozenset({"llama", "deepseek_v2", "gemma3_text"})


def _attention_fields(r: _Reader) -> dict[str, Any]:
    defaults = HF_DEFAULTS[r.model_type]
    # Required, but where the type's config class has the model's own (Gemma 3 4B's leaves it out)
    heads = r.integer("num_attention_heads", defaults.get("num_attention_heads", _MISSING))
    hidden = r.integer("hidden_size")
    if r.model_type in _HIDDEN_DIVIDES_BY_HEADS and hidden % heads:
        raise NdplanError(f"{r.source}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); "
                          f"transformers rejects that for model_type '{r.model_type}'")
    if "head_dim" not in defaults:
        # MLA (its head widths come from the query/key dims the reader sets): every head's key and
        # value come out of the shared latent, so there are as many KV heads as query heads.
        # DeepSeek's code does not read num_key_value_heads; transformers' fails unless it equals
        # num_attention_heads (it repeats the per-head K/V again). Checked as a count, not used.
        r.integer("num_key_value_heads", heads)
        return {"num_attention_heads": heads, "num_kv_heads": heads}
    # A num_key_value_heads of null is num_attention_heads, as transformers' __post_init__ reads it.
    given_kv = "num_key_value_heads" in r.config
    kv_default = defaults["num_key_value_heads"]
    kv = r.integer("num_key_value_heads", heads if kv_default is None or given_kv else kv_default)
    if not given_kv and heads % kv:
        raise NdplanError(f"{r.source}: no field 'num_key_value_heads', and transformers' default for "
                          f"model_type '{r.model_type}' ({kv}) does not divide num_attention_heads ({heads}); "
                          "give num_key_value_heads")
    fields = {"num_attention_heads": heads, "num_kv_heads": kv}
    # head_dim absent, null or 0 takes the type's default (transformers' config or modeling code).
    stated = r.config.get("head_dim")
    if not (stated is None or type(stated) is int and stated == 0):
        fields["head_dim"] = r.integer("head_dim")
    elif defaults["head_dim"] is not None:
        fields["head_dim"] = defaults["head_dim"]
    elif hidden % heads:
        raise NdplanError(f"{r.source}: no field 'head_dim', and hidden_size ({hidden}) is not a multiple of "
                          f"num_attention_heads ({heads}); give head_dim or make hidden_size a multiple")
    else:
        fields["head_dim"] = hidden // heads
    return fields


def _common_fields(r: _Reader) -> dict[str, Any]:
    act = r.get("hidden_act", "silu")
    if not isinstance(act, str):
        raise NdplanError(f"{r.source}: field 'hidden_act' must be an activation name (a string such as 'silu'), "
                          f"got {act!r}")
    return {
        "model_type": r.model_type,
        "num_layers": r.integer("num_hidden_layers"),
        "hidden_size": r.integer("hidden_size"),
        # Required but where the type's config class has the model's own (Gemma 3's text_config
        # leaves it out: 262,208).
        "vocab_size": r.integer("vocab_size", HF_DEFAULTS[r.model_type].get("vocab_size", _MISSING)),
        "tie_word_embeddings": r.flag("tie_word_embeddings", False),
        "activation": act,
        # Absent: 0, not transformers' placeholder (RoPE has no position table to size), which
        # --emit would pass to Megatron, whose max_position_embeddings >= seq_length check it can fail.
        "max_position_embeddings": r.integer("max_position_embeddings", 0),
        # Every supported model applies it to the attention probabilities in training (eager
        # attention keeps the mask for backward); none has residual dropout.
        "attention_dropout": r.probability("attention_dropout"),
        **_attention_fields(r),
    }


def _attention_biases(r: _Reader, default: bool = False) -> dict[str, bool]:
    """Biases on the q, k, v and o projections under ``attention_bias`` (``default`` where absent:
    off but for gpt-oss), as Llama and the models built on its attention read it."""
    bias = r.flag("attention_bias", default)
    return {"qkv_bias": bias, "o_bias": bias}


_SPANS = {"full_attention": "full", "sliding_attention": "sliding"}


def _attention_spans(r: _Reader, num_layers: int, window: int | None,
                     sliding: Callable[[int], bool], *, reads_layer_types: bool = True) -> dict[str, Any]:
    """``sliding_window`` and ``layer_attention_spans`` as transformers builds the layers: the
    config's ``layer_types`` where the model type reads it (``reads_layer_types``), else layer i
    slides where ``sliding(i)``; no window, no sliding layer."""
    if not window:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_SIZE:
        raise NdplanError(f"{r.source}: field 'sliding_window' must be a positive integer or null "
                          f"(at most {MAX_SIZE:,}), got {window!r}")
    types = r.config.get("layer_types") if reads_layer_types else None
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or any(not isinstance(t, str) or t not in _SPANS for t in types):
            raise NdplanError(f"{r.source}: field 'layer_types' must list {num_layers} entries, each one of "
                              f"{', '.join(_SPANS)}; got {types!r}")
        spans = tuple(_SPANS[t] for t in types)
    else:
        spans = tuple("sliding" if sliding(i) else "full" for i in range(num_layers))
    return {"sliding_window": window, "layer_attention_spans": spans} if "sliding" in spans else {}


def _every_layer_window(r: _Reader) -> dict[str, Any]:
    """Mistral, Mixtral, Qwen3-MoE: every layer attends the last ``sliding_window`` keys when it
    is set (transformers ignores ``layer_types`` for them)."""
    window = r.get("sliding_window", HF_DEFAULTS[r.model_type]["sliding_window"])
    if r.model_type == "qwen3_moe" and not r.flag("use_sliding_window", False):
        window = None
    return _attention_spans(r, r.integer("num_hidden_layers"), window, lambda i: True, reads_layer_types=False)


def _qwen_window(r: _Reader, sliding: Callable[[int, int], bool]) -> dict[str, Any]:
    """Qwen2, Qwen3 and Qwen2-MoE: a window only with ``use_sliding_window``, on the layers
    ``layer_types`` names, else ``sliding(i, max_window_layers)``."""
    if not r.flag("use_sliding_window", False):
        return {}
    top = r.integer("max_window_layers", 28)
    return _attention_spans(r, r.integer("num_hidden_layers"), r.get("sliding_window", 4096), lambda i: sliding(i, top))


def _llama(r: _Reader) -> dict[str, Any]:
    return {
        **_common_fields(r),
        "ffn_hidden_size": r.integer("intermediate_size"),
        **_attention_biases(r),
        "mlp_bias": r.flag("mlp_bias", False),
    }


def _mistral(r: _Reader) -> dict[str, Any]:
    return {**_common_fields(r), "ffn_hidden_size": r.integer("intermediate_size"), **_every_layer_window(r)}


def _qwen2(r: _Reader) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases and no o_proj bias.
    return {**_common_fields(r), "ffn_hidden_size": r.integer("intermediate_size"), "qkv_bias": True,
            **_qwen_window(r, lambda i, top: i >= top)}


def _qwen3(r: _Reader) -> dict[str, Any]:
    return {
        **_common_fields(r),
        "ffn_hidden_size": r.integer("intermediate_size"),
        **_attention_biases(r),
        "qk_norm": True,
        **_qwen_window(r, lambda i, top: i >= top),
    }


def _mixtral(r: _Reader) -> dict[str, Any]:
    width = r.integer("intermediate_size")
    return {
        **_common_fields(r),
        "ffn_hidden_size": 0,
        "num_experts": r.integer("num_local_experts"),
        "num_experts_per_tok": r.integer("num_experts_per_tok"),
        "moe_ffn_hidden_size": width,
        **_every_layer_window(r),
    }


def _qwen_moe_kinds(r: _Reader, num_layers: int, num_experts: int) -> tuple[MlpKind, ...]:
    listed = r.get("mlp_only_layers", []) or []
    if not isinstance(listed, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in listed):
        raise NdplanError(f"{r.source}: field 'mlp_only_layers' must be a list of layer indices (integers, "
                          f"e.g. [0, 1]), got {listed!r}")
    dense_only = set(listed)
    step = r.integer("decoder_sparse_step", 1)
    if step < 1:
        raise NdplanError(f"{r.source}: field 'decoder_sparse_step' must be >= 1, got {step}")
    return tuple(
        "moe" if i not in dense_only and num_experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(num_layers)
    )


def _qwen2_moe(r: _Reader) -> dict[str, Any]:
    fields = _common_fields(r)
    experts = r.integer("num_experts")
    shared_width = r.integer("shared_expert_intermediate_size",
                             HF_DEFAULTS["qwen2_moe"]["shared_expert_intermediate_size"])
    return {
        **fields,
        "ffn_hidden_size": r.integer("intermediate_size"),
        "qkv_bias": r.flag("qkv_bias", True),  # transformers reads it (default on, as Qwen1.5-MoE)
        "num_experts": experts,
        "num_experts_per_tok": r.integer("num_experts_per_tok"),
        "moe_ffn_hidden_size": r.integer("moe_intermediate_size"),
        "num_shared_experts": 1 if shared_width else 0,
        "shared_expert_ffn_hidden_size": shared_width,
        # transformers builds the gate (h -> 1) in every MoE block, even over a 0-wide shared expert.
        "shared_expert_gate": True,
        "layer_mlp_kinds": _qwen_moe_kinds(r, fields["num_layers"], experts),
        # transformers slides every other layer below max_window_layers, from the first
        **_qwen_window(r, lambda i, top: i % 2 == 0 and i < top),
    }


def _qwen3_moe(r: _Reader) -> dict[str, Any]:
    fields = _common_fields(r)
    experts = r.integer("num_experts")
    return {
        **fields,
        "ffn_hidden_size": r.integer("intermediate_size"),
        **_attention_biases(r),
        "qk_norm": True,
        "num_experts": experts,
        "num_experts_per_tok": r.integer("num_experts_per_tok"),
        "moe_ffn_hidden_size": r.integer("moe_intermediate_size"),
        "layer_mlp_kinds": _qwen_moe_kinds(r, fields["num_layers"], experts),
        **_every_layer_window(r),
    }


def _gpt_oss(r: _Reader) -> dict[str, Any]:
    """gpt-oss: biases on every attention projection, the router and the experts, a learned
    sink logit per head, and sliding-window layers every other one from the first (transformers'
    default ``layer_types``). Its clamped SwiGLU (alpha 1.702, limit 7, up + 1) runs the matmuls
    of a gated SiLU MLP and keeps three more tensors a routed copy (the pytorch profile's
    ``clamped_swiglu``); its few more element-wise passes are priced as a SwiGLU's."""
    fields = _common_fields(r)
    layers = fields["num_layers"]
    experts = r.integer("num_local_experts")
    return {
        **fields,
        "ffn_hidden_size": 0,
        **_attention_biases(r, default=True),
        "attention_sinks": True,
        "num_experts": experts,
        "num_experts_per_tok": r.integer("num_experts_per_tok", HF_DEFAULTS["gpt_oss"]["num_experts_per_tok"]),
        "moe_ffn_hidden_size": r.integer("intermediate_size"),
        "router_bias": True,
        "expert_bias": True,
        **_attention_spans(r, layers, r.get("sliding_window", HF_DEFAULTS["gpt_oss"]["sliding_window"]),
                           lambda i: i % 2 == 0),
    }


def _deepseek_moe(r: _Reader, num_layers: int, *, reads_layer_freq: bool) -> dict[str, Any]:
    """DeepSeek-V3's MoE as GLM-4.5 reuses it: n_routed_experts routed experts and n_shared_experts
    shared ones of moe_intermediate_size each, every layer from first_k_dense_replace on a MoE
    one (and, with ``reads_layer_freq``, only every moe_layer_freq-th: DeepSeek's own code reads
    it, default 1; transformers' does not), num_nextn_predict_layers MTP modules; the model
    type's defaults (``HF_DEFAULTS``) where the config leaves a count out."""
    defaults = HF_DEFAULTS[r.model_type]
    experts = r.integer("n_routed_experts", defaults["n_routed_experts"])
    first_dense = r.integer("first_k_dense_replace", defaults["first_k_dense_replace"])
    frequency = r.integer("moe_layer_freq", 1) if reads_layer_freq else 1
    kinds: tuple[MlpKind, ...] = tuple(
        "moe" if i >= first_dense and i % frequency == 0 else "dense" for i in range(num_layers)
    )
    moe_width = r.integer("moe_intermediate_size")
    shared = r.integer("n_shared_experts", defaults["n_shared_experts"])
    return {
        "num_experts": experts,
        "num_experts_per_tok": r.integer("num_experts_per_tok", defaults["num_experts_per_tok"]),
        "moe_ffn_hidden_size": moe_width,
        "num_shared_experts": shared,
        "shared_expert_ffn_hidden_size": moe_width if shared else 0,
        "layer_mlp_kinds": kinds,
        "mtp_depth": r.integer("num_nextn_predict_layers", defaults["num_nextn_predict_layers"]),
    }


def _deepseek(r: _Reader) -> dict[str, Any]:
    fields = _common_fields(r)
    if r.flag("mlp_bias", False):
        # transformers gives the dense and shared-expert MLPs biases then (not the routed
        # experts); no published DeepSeek model sets it, and ndplan does not count it.
        raise NdplanError(f"{r.source}: field 'mlp_bias' true is not supported for {r.model_type} "
                          "(allowed: false, as every published DeepSeek config)")
    defaults = HF_DEFAULTS[r.model_type]
    moe = _deepseek_moe(r, fields["num_layers"], reads_layer_freq=True)
    # q_lora_rank null: queries are not compressed (DeepSeek-V2-Lite); absent: transformers' default.
    # 0 is not null there: transformers and DeepSeek's code build a rank-0 query LoRA (no query
    # weights at all) where ndplan would count a full q_proj, so it is refused.
    q_lora_rank = defaults["q_lora_rank"]
    if r.config.get("q_lora_rank", _MISSING) is None:
        q_lora_rank = 0
    elif "q_lora_rank" in r.config and (q_lora_rank := r.integer("q_lora_rank")) == 0:
        raise NdplanError(f"{r.source}: field 'q_lora_rank' must be null (queries not compressed) or "
                          "at least 1, got 0")
    return {
        **fields,
        "ffn_hidden_size": r.integer("intermediate_size"),
        **_attention_biases(r),
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": r.integer("kv_lora_rank"),
        "qk_rope_head_dim": r.integer("qk_rope_head_dim"),
        "qk_nope_head_dim": r.integer("qk_nope_head_dim"),
        "v_head_dim": r.integer("v_head_dim"),
        "head_dim": r.integer("qk_rope_head_dim") + r.integer("qk_nope_head_dim"),
        **moe,
    }


def _glm4_moe(r: _Reader) -> dict[str, Any]:
    """GLM-4.5, 4.6 and 4.7 (Glm4MoeForCausalLM): GQA with q/k/v biases under attention_bias
    (o_proj has none) and per-head q/k norms under use_qk_norm; the first first_k_dense_replace
    layers dense, the rest DeepSeek-V3's MoE (sigmoid router with a score-correction bias, which
    transformers keeps as a buffer, and n_shared_experts shared experts of moe_intermediate_size
    each, built as one MLP). num_nextn_predict_layers MTP modules follow, as DeepSeek-V3's
    (transformers builds none; Megatron trains them with --mtp-num-layers). Its partial rotary
    embedding (partial_rotary_factor) holds no parameters."""
    fields = _common_fields(r)
    return {
        **fields,
        "ffn_hidden_size": r.integer("intermediate_size"),
        "qkv_bias": r.flag("attention_bias", False),
        "qk_norm": r.flag("use_qk_norm", False),
        **_deepseek_moe(r, fields["num_layers"], reads_layer_freq=False),
    }


_MLP_LAYER_TYPES: dict[str, MlpKind] = {"dense": "dense", "sparse": "moe"}


def _glm4_moe_lite(r: _Reader) -> dict[str, Any]:
    """GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's layer as transformers builds it (MLA,
    attention_bias on q_a, kv_a and o; a sigmoid router and shared experts), its layers' kinds
    from mlp_layer_types ('dense' or 'sparse'; transformers reads no first_k_dense_replace there:
    without the list, one dense layer, then MoE ones)."""
    fields = _deepseek(r)
    layers = fields["num_layers"]
    listed = r.config.get("mlp_layer_types")
    if listed is None:
        return {**fields, "layer_mlp_kinds": ("dense", *("moe",) * (layers - 1))}
    if (not isinstance(listed, list) or len(listed) != layers
            or any(not isinstance(t, str) or t not in _MLP_LAYER_TYPES for t in listed)):
        raise NdplanError(f"{r.source}: field 'mlp_layer_types' must list {layers} entries, each 'dense' or "
                          f"'sparse'; got {listed!r}")
    return {**fields, "layer_mlp_kinds": tuple(_MLP_LAYER_TYPES[t] for t in listed)}


def _minimax_m2(r: _Reader) -> dict[str, Any]:
    """MiniMax-M2 (MiniMaxM2ForCausalLM): every layer a MoE of num_local_experts routed experts of
    width intermediate_size (no shared or dense MLP; a sigmoid router whose correction bias is a
    buffer), GQA without biases, and q/k norms over the whole projection (heads x head_dim), which
    transformers always builds. Its checkpoints' MTP modules (num_mtp_modules) are not read:
    transformers builds none and no training framework's MTP is known to match them."""
    return {**_common_fields(r), **_projection_normed_moe(r, "num_local_experts")}


def _projection_normed_moe(r: _Reader, experts_field: str) -> dict[str, Any]:
    """MiniMax-M2's and OLMoE's layers: every one a MoE of ``experts_field`` experts of width
    intermediate_size (no shared or dense MLP), with q/k norms over the whole projection; the
    type's defaults (``HF_DEFAULTS``) where the config leaves a count out."""
    defaults = HF_DEFAULTS[r.model_type]
    return {
        "ffn_hidden_size": 0,
        "qk_norm": True,
        "qk_norm_width": "projection",
        "num_experts": r.integer(experts_field, defaults[experts_field]),
        "num_experts_per_tok": r.integer("num_experts_per_tok", defaults["num_experts_per_tok"]),
        "moe_ffn_hidden_size": r.integer("intermediate_size"),
    }


def _phi3(r: _Reader) -> dict[str, Any]:
    """Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layer with q, k and v in one projection and gate
    and up in another (the same weights), no biases, a window on every layer where
    sliding_window is set. Its residual and embedding dropout (resid_pdrop, embd_pdrop) would keep
    masks the pytorch profile does not price: refused above 0, as no published Phi-3/4 trains with."""
    for field in ("resid_pdrop", "embd_pdrop"):
        if r.probability(field):
            raise NdplanError(f"{r.source}: field '{field}' ({r.config[field]!r}) is not supported: ndplan does not "
                              "price the dropout masks of Phi-3's residual branches and embedding (allowed: 0)")
    fields = _common_fields(r)
    return {**fields, "ffn_hidden_size": r.integer("intermediate_size"),
            **_attention_spans(r, fields["num_layers"], r.get("sliding_window", None), lambda i: True,
                               reads_layer_types=False)}


def _olmo2(r: _Reader) -> dict[str, Any]:
    """OLMo 2 (Olmo2ForCausalLM): Llama's projections (biases on q, k, v and o under
    attention_bias) with q/k norms over the whole projection, and its two norms on the branches'
    outputs, before each residual add (post-norm: x + norm(attention(x)))."""
    return {
        **_common_fields(r),
        "ffn_hidden_size": r.integer("intermediate_size"),
        **_attention_biases(r),
        "qk_norm": True,
        "qk_norm_width": "projection",
        "norm_placement": "post",
    }


def _olmo3(r: _Reader) -> dict[str, Any]:
    """OLMo 3 (Olmo3ForCausalLM): OLMo 2's layer with sliding-window attention on the layers
    ``layer_types`` names (transformers' default: three of every four, the fourth in full)."""
    layers = r.integer("num_hidden_layers")
    window = r.get("sliding_window", HF_DEFAULTS["olmo3"]["sliding_window"])
    return {**_olmo2(r), **_attention_spans(r, layers, window, lambda i: (i + 1) % 4 != 0)}


def _olmoe(r: _Reader) -> dict[str, Any]:
    """OLMoE (OlmoeForCausalLM): pre-norm layers, each a MoE of num_experts experts of width
    intermediate_size (top num_experts_per_tok, no shared expert, a router without bias), with
    q/k norms over the whole projection. A clip_qkv (in-place clamps of q, k and v, each keeping
    a mask for backward) is not priced, so refused."""
    if r.config.get("clip_qkv") is not None:
        raise NdplanError(f"{r.source}: field 'clip_qkv' ({r.config['clip_qkv']!r}) is not supported: ndplan does "
                          "not price the clamps of q, k and v (allowed: null, as OLMoE's published configs)")
    fields = _common_fields(r)
    if fields["num_attention_heads"] * fields["head_dim"] != fields["hidden_size"]:
        # transformers builds the q norm hidden_size wide: its forward fails on any other width
        raise NdplanError(f"{r.source}: OLMoE's q norm is hidden_size ({fields['hidden_size']}) wide, so "
                          f"num_attention_heads x head_dim ({fields['num_attention_heads']} x {fields['head_dim']}) "
                          "must equal it; leave head_dim out or give hidden_size / num_attention_heads")
    return {**fields, **_attention_biases(r), **_projection_normed_moe(r, "num_experts")}


def _gemma3_text(r: _Reader) -> dict[str, Any]:
    """Gemma 3's language model (Gemma3ForCausalLM, model_type gemma3_text): four norms a layer
    (sandwich: before and after attention and MLP), per-head q/k norms, a gated MLP of
    hidden_activation (GELU, tanh approximation), a tied output head by default, and sliding
    windows on the layers ``layer_types`` names (else five of every sliding_window_pattern = 6).
    The embedding's scale by √h is a constant (no parameter). Bidirectional attention is refused."""
    defaults = HF_DEFAULTS["gemma3_text"]
    layers = r.integer("num_hidden_layers")
    pattern = r.integer("sliding_window_pattern", defaults["sliding_window_pattern"])
    return {
        **_gemma_layer(r),
        "qk_norm": True,
        **_attention_spans(r, layers, r.get("sliding_window", defaults["sliding_window"]),
                           lambda i: (i + 1) % pattern != 0),
    }


def _gemma2(r: _Reader) -> dict[str, Any]:
    """Gemma 2 (Gemma2ForCausalLM): Gemma 3's layer without q/k norms, sliding windows on every
    other layer from the first (``layer_types`` where given), and soft-capped attention scores
    and output logits (50 and 30 by default)."""
    defaults = HF_DEFAULTS["gemma2"]
    layers = r.integer("num_hidden_layers")
    return {
        **_gemma_layer(r),
        **_attention_spans(r, layers, r.get("sliding_window", defaults["sliding_window"]), lambda i: i % 2 == 0),
    }


def _gemma_layer(r: _Reader) -> dict[str, Any]:
    """What Gemma 2's and 3's layers share: four norms a layer (sandwich), a gated MLP of
    hidden_activation, a tied head by default, and their soft-capping where set."""
    defaults = HF_DEFAULTS[r.model_type]
    if r.flag("use_bidirectional_attention", False):
        raise NdplanError(f"{r.source}: field 'use_bidirectional_attention' true is not supported: ndplan prices "
                          "causal attention (allowed: false)")
    act = r.get("hidden_activation", defaults["hidden_activation"])
    if not isinstance(act, str):
        raise NdplanError(f"{r.source}: field 'hidden_activation' must be an activation name (a string such as "
                          f"'gelu_pytorch_tanh'), got {act!r}")
    caps = {}
    for field, ours in (("attn_logit_softcapping", "attention_softcap"), ("final_logit_softcapping", "final_softcap")):
        value = r.get(field, defaults.get(field))
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise NdplanError(f"{r.source}: field '{field}' must be a positive number or null, got {value!r}")
            caps[ours] = float(value)
    return {
        **_common_fields(r),
        "tie_word_embeddings": r.flag("tie_word_embeddings", True),
        "activation": act,
        "ffn_hidden_size": r.integer("intermediate_size"),
        **_attention_biases(r),
        "norm_placement": "sandwich",
        **caps,
    }


_MIXERS = {"full_attention": "full", "linear_attention": "linear"}


def _gated_deltanet_layers(r: _Reader) -> dict[str, Any]:
    """Qwen3-Next's and Qwen3.5's token mixers: ``layer_types`` (full_attention or
    linear_attention per layer), else every ``full_attention_interval``-th layer in full (4 by
    default) and the others Gated DeltaNet; the full layers' q_proj carries an output gate; the
    norms multiply by (1 + weight) in fp32 (FP32_NORM_WEIGHT_MODEL_TYPES)."""
    defaults = HF_DEFAULTS[r.model_type]
    layers = r.integer("num_hidden_layers")
    types = r.config.get("layer_types")
    if types is not None:
        if (not isinstance(types, list) or len(types) != layers
                or any(not isinstance(t, str) or t not in _MIXERS for t in types)):
            raise NdplanError(f"{r.source}: field 'layer_types' must list {layers} entries, each one of "
                              f"{', '.join(_MIXERS)}; got {types!r}")
        spans = tuple(_MIXERS[t] for t in types)
    else:
        interval = r.integer("full_attention_interval", 4)
        if interval < 1:
            raise NdplanError(f"{r.source}: field 'full_attention_interval' must be >= 1, got {interval}")
        spans = tuple("linear" if (i + 1) % interval else "full" for i in range(layers))
    fields: dict[str, Any] = {"layer_attention_spans": spans, "attention_output_gate": True, "qk_norm": True,
                              **_attention_biases(r)}
    if "linear" in spans:
        fields.update({
            "linear_num_key_heads": r.integer("linear_num_key_heads", defaults["linear_num_key_heads"]),
            "linear_num_value_heads": r.integer("linear_num_value_heads", defaults["linear_num_value_heads"]),
            "linear_key_head_dim": r.integer("linear_key_head_dim", defaults["linear_key_head_dim"]),
            "linear_value_head_dim": r.integer("linear_value_head_dim", defaults["linear_value_head_dim"]),
            "linear_conv_kernel": r.integer("linear_conv_kernel_dim", defaults["linear_conv_kernel_dim"]),
        })
    return fields


def _gated_deltanet_moe(r: _Reader, num_layers: int) -> dict[str, Any]:
    """The MoE block of Qwen3-Next and Qwen3.5-MoE: Qwen2-MoE's (routed experts, one shared
    expert behind a sigmoid gate)."""
    defaults = HF_DEFAULTS[r.model_type]
    experts = r.integer("num_experts", defaults["num_experts"])
    shared_width = r.integer("shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"])
    kinds: tuple[MlpKind, ...] = (_qwen_moe_kinds(r, num_layers, experts) if r.model_type == "qwen3_next"
                                  else ("moe" if experts else "dense",) * num_layers)  # Qwen3.5: every layer
    return {
        "num_experts": experts,
        "num_experts_per_tok": r.integer("num_experts_per_tok", defaults["num_experts_per_tok"]),
        "moe_ffn_hidden_size": r.integer("moe_intermediate_size", defaults["moe_intermediate_size"]),
        "num_shared_experts": 1 if shared_width else 0,
        "shared_expert_ffn_hidden_size": shared_width,
        "shared_expert_gate": True,
        "layer_mlp_kinds": kinds,
    }


def _qwen3_next(r: _Reader) -> dict[str, Any]:
    fields = _common_fields(r)
    moe = _gated_deltanet_moe(r, fields["num_layers"])
    dense = "dense" in moe["layer_mlp_kinds"]
    return {**fields, "ffn_hidden_size": r.integer("intermediate_size") if dense else 0, **moe,
            **_gated_deltanet_layers(r)}


def _qwen3_5_text(r: _Reader) -> dict[str, Any]:
    return {**_common_fields(r), "ffn_hidden_size": r.integer("intermediate_size"), **_gated_deltanet_layers(r)}


def _qwen3_5_moe_text(r: _Reader) -> dict[str, Any]:
    fields = _common_fields(r)
    return {**fields, "ffn_hidden_size": 0, **_gated_deltanet_moe(r, fields["num_layers"]),
            **_gated_deltanet_layers(r)}


READERS: dict[str, Callable[[_Reader], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    # Moonshot's Kimi K2 ships its own model_type with DeepSeek-V3's architecture and code
    # (architectures DeepseekV3ForCausalLM, loaded with trust_remote_code).
    "kimi_k2": _deepseek,
    "gpt_oss": _gpt_oss,
    "glm4_moe": _glm4_moe,
    "glm4_moe_lite": _glm4_moe_lite,
    "minimax_m2": _minimax_m2,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "olmo3": _olmo3,
    "olmoe": _olmoe,
    "gemma3_text": _gemma3_text,
    "gemma2": _gemma2,
    "qwen3_next": _qwen3_next,
    "qwen3_5_text": _qwen3_5_text,
    "qwen3_5_moe_text": _qwen3_5_moe_text,
}

def _vision_language(family: str, text_type: str) -> str:
    return (f"{family}'s vision-language model (a vision tower beside the language model), which ndplan does not "
            f"price; for its language model give the file's text_config as a config of its own (model_type "
            f"'{text_type}')")


#: transformers' norm_topk_prob default per model type whose config has the field (the others'
#: routers renormalise always: Mixtral, MiniMax-M2, Qwen3.5-MoE; gpt-oss takes a softmax over its
#: top k instead).
NORM_TOPK_DEFAULTS = {"qwen2_moe": False, "qwen3_moe": False, "olmoe": False, "deepseek_v2": False,
                      "deepseek_v3": True, "kimi_k2": True, "glm4_moe": True, "glm4_moe_lite": True,
                      "qwen3_next": True}

#: Model types ndplan knows and does not price, with the reason: a refusal that says why.
NOT_PRICED: dict[str, str] = {
    "gemma3": ("Gemma 3's vision-language model (a SigLIP vision tower and projector beside the language model), "
               "which ndplan does not price; for its language model give the file's text_config as a config of its "
               "own (model_type 'gemma3_text')"),
    "qwen3_5": _vision_language("Qwen3.5", "qwen3_5_text"),
    "qwen3_5_moe": _vision_language("Qwen3.5-MoE", "qwen3_5_moe_text"),
    "deepseek_v32": "DeepSeek-V3.2's sparse attention and its indexer are not priced",
    "glm_moe_dsa": "GLM-5's DeepSeek sparse attention (a lightning indexer choosing each query's keys) is not priced",
    "deepseek_v4": ("DeepSeek-V4's compressed sparse attention, manifold-constrained hyper-connections and "
                    "hash-routed experts are not priced"),
    "kimi_linear": "Kimi Linear's Kimi Delta Attention layers are not priced",
    "minimax": "MiniMax-Text-01's lightning (linear) attention layers are not priced",
    "kimi_k25": ("Kimi K2.5's vision-language model (a vision tower beside the language model), which ndplan does "
                 "not price; for its language model give the file's text_config as a config of its own with "
                 "model_type 'deepseek_v3' (DeepSeek-V3's architecture, as Kimi K2's)"),
    "qwen3_vl": "Qwen3-VL's vision-language model (a vision tower and DeepStack merger) is not priced",
    "qwen3_vl_moe": "Qwen3-VL's vision-language model (a vision tower and DeepStack merger) is not priced",
    "llama4": ("Llama 4's vision-language model is not priced, nor its language model (llama4_text: chunked "
               "attention and layers without positions)"),
    "llama4_text": "Llama 4's chunked attention and layers without positions are not priced",
}


def spec_from_hf_config(config: HfConfig, *, name: str, source: str = "config.json") -> ModelSpec:
    """Map a Hugging Face config dict to a ModelSpec; errors name the source and the field."""
    if not isinstance(config, Mapping):
        raise NdplanError(f"{source}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in NOT_PRICED:
        raise NdplanError(f"{source}: model_type '{model_type}' is not supported: {NOT_PRICED[model_type]} "
                          f"(supported: {', '.join(READERS)})")
    if not isinstance(model_type, str) or model_type not in READERS:
        raise NdplanError(
            f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(READERS)} "
            "(for another architecture write an ndplan model spec in YAML/JSON)"
        )
    reader = _Reader(config, source)
    fields = READERS[model_type](reader)
    if fields.get("num_experts") and model_type in NORM_TOPK_DEFAULTS:
        fields["norm_topk_prob"] = reader.flag("norm_topk_prob", NORM_TOPK_DEFAULTS[model_type])
    try:
        return ModelSpec(name=name, **fields)
    except ValidationError as error:
        raise NdplanError(f"{source}: {first_validation_error(error)}") from None


def first_validation_error(error: ValidationError) -> str:
    """One line from pydantic's report: the field path and what is wrong with it. An unknown
    field (pydantic: "Extra inputs are not permitted") is named first, since a misspelt field
    also reads as the right one missing, with the closest allowed field and all of them."""
    errors = error.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    location = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden" and first["loc"]:
        allowed = _allowed_fields(error.title, first["loc"][:-1])
        if allowed:
            return (f"field '{location}': unknown field{did_you_mean(str(first['loc'][-1]), allowed)}; "
                    f"allowed: {', '.join(allowed)}")
        return f"field '{location}': unknown field"
    message = first["msg"].removeprefix("Value error, ")
    if location:
        return f"field '{location}': {message} (got {first.get('input')!r})"
    return message


def _allowed_fields(title: str, path: tuple[Any, ...]) -> list[str]:
    """The fields of the pydantic model at ``path`` inside ndplan's model class named ``title``
    (a ValidationError names its class only so), or [] where that cannot be told."""
    import typing

    from pydantic import BaseModel

    def subclasses(cls: type) -> list[type]:
        out: list[type] = []
        direct: list[type] = cls.__subclasses__()
        for sub in direct:
            out += [sub, *subclasses(sub)]
        return out

    found = [c for c in subclasses(BaseModel) if c.__name__ == title and c.__module__.startswith("ndplan.")]
    if len(found) != 1:
        return []
    model: Any = found[0]
    for part in path:
        if isinstance(part, int):  # an item of a list: the list's own model, already followed
            continue
        field = model.model_fields.get(part)
        inner = [t for t in (field.annotation, *typing.get_args(field.annotation)) if isinstance(t, type)
                 and issubclass(t, BaseModel)] if field is not None else []
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)
