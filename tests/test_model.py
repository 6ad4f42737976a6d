"""ModelSpec from HF configs and exact parameter counts."""

from __future__ import annotations

import json
import re

import pytest

from hf_meta import meta_block_counts
from ndplan.errors import NdplanError
from ndplan.model import (
    count_parameters,
    get_preset,
    hf_config,
    load_model,
    preset_names,
    spec_from_hf_config,
)
from ndplan.model.presets import preset_index

REQUIRED_PRESETS = [
    "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b",
    "mistral-7b", "mixtral-8x7b", "mixtral-8x22b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b",
    "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v2-lite", "deepseek-v3",
]


def test_required_presets_ship():
    assert set(REQUIRED_PRESETS) <= set(preset_names())


@pytest.mark.parametrize("name", sorted(preset_names()))
def test_counts_match_transformers_meta_build(name):
    """Every block ndplan counts equals what transformers builds for the same config.json."""
    ours = count_parameters(get_preset(name)).blocks()
    ours.pop("mtp")  # transformers does not build DeepSeek's MTP module
    theirs = meta_block_counts(hf_config(name))
    assert {k: v for k, v in ours.items() if v} == dict(theirs)


# Exact totals published by the authors (safetensors metadata on the Hub / model cards).
EXACT_TOTALS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    # fp32 weights' total_size in model.safetensors.index.json / 4
    "olmo-2-13b": 13_716_198_400,
    # The index's other exact figures (Hub safetensors metadata, or GGUF for Qwen2.5 14B-72B).
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "deepseek-v2-lite": 15_706_484_224,
    # GGUF general.parameter_count of the MXFP4 checkpoints (logical elements, not packed bytes).
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-2-27b": 27_227_128_320,
}


@pytest.mark.parametrize("name,total", sorted(EXACT_TOTALS.items()))
def test_published_totals(name, total):
    assert count_parameters(get_preset(name)).total == total


@pytest.mark.parametrize("name,total,active", [("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)])
def test_gpt_oss_matches_its_model_card(name, total, active):
    """The model card's table (to 10M): total, and active per token counting the unembedding
    but not the embedding (ndplan's active counts both). Biases on attention, router and
    experts and one sink per head are parameters too: without them 20b would count 20.90B."""
    counts = count_parameters(get_preset(name))
    assert round(counts.total / 1e7) == round(total / 1e7)
    assert round((counts.active - counts.embedding) / 1e7) == round(active / 1e7)
    spec = get_preset(name)
    assert spec.sliding_window == 128 and spec.layer_attention_spans[:2] == ("sliding", "full")


def test_moe_active_parameters_match_published_rounded_figures():
    # DeepSeek-V3: 671B total, 37B activated (without the embedding, as its card counts; with it
    # ndplan's active is 37.55B); Qwen3-30B-A3B: 30.5B / 3.3B; Mixtral-8x7B: 12.9B active.
    v3 = count_parameters(get_preset("deepseek-v3"))
    assert round(v3.total / 1e9) == 671 and round((v3.active - v3.embedding) / 1e9) == 37
    q3 = count_parameters(get_preset("qwen3-30b-a3b"))
    assert round(q3.total / 1e8) == 305 and round(q3.active / 1e8) in (33, 34)
    assert round(count_parameters(get_preset("mixtral-8x7b")).active / 1e8) == 129


def test_glm_4_5_counts_against_its_report():
    """GLM-4.5 report: 355B total / 32B activated, Air 106B / 12B (rounded). Activated without the
    embedding and head (the report's count): 32.08B and 12.18B. Total: Air 106.85B (its card
    truncates); GLM-4.5 352.80B without its MTP layer and 356.79B with it, the headline 355B
    between the two (transformers' build of both configs is pinned above, block by block)."""
    full, air = count_parameters(get_preset("glm-4.5")), count_parameters(get_preset("glm-4.5-air"))
    assert round((full.active - full.embedding - full.output_head) / 1e9) == 32
    assert round((air.active - air.embedding - air.output_head) / 1e9) == 12
    assert int(air.total / 1e9) == 106
    assert full.total < 355e9 < full.total + full.mtp


@pytest.mark.parametrize("name", ["deepseek-v3", "glm-4.5", "glm-4.5-air"])
def test_mtp_module(name):
    # One MTP module: 3 norms + eh_proj (2h x h) + one MoE decoder layer; head and embedding shared.
    spec = get_preset(name)
    counts = count_parameters(spec)
    h = spec.hidden_size
    moe_layer = (count_parameters(spec).routed_experts + counts.shared_experts + counts.router) // spec.num_moe_layers
    attention = counts.attention // spec.num_layers
    assert counts.mtp == 3 * h + 2 * h * h + attention + 2 * h + moe_layer


@pytest.mark.parametrize("name,embedding_m,non_embedding_m", [
    ("gemma-3-1b", 302, 698), ("gemma-3-4b", 671, 3_209), ("gemma-3-12b", 1_007, 10_759), ("gemma-3-27b", 1_410, 25_600)])
def test_gemma_3_counts_against_its_report(name, embedding_m, non_embedding_m):
    """Gemma 3 report, Table 1: non-embedding parameters of the language model, in millions
    (698M, 3,209M, 10,759M, 25,600M); its embedding column runs 4-6M over vocabulary x width
    (675M, 1,012M, 1,416M) beyond the 1B, which these are. Four norms a layer: with two, the 27B
    would read 25,599.72M - 62 x 2 x 5,376 = 25,599.05M."""
    counts = count_parameters(get_preset(name))
    assert round(counts.embedding / 1e6) == embedding_m
    assert round((counts.total - counts.embedding) / 1e6) == non_embedding_m  # tied head: no second table


def test_olmoe_counts_against_its_paper():
    """OLMoE paper: 6.9B total, 1.3B active (rounded), 64 experts of which 8 run per token."""
    counts = count_parameters(get_preset("olmoe-1b-7b"))
    assert round(counts.total / 1e8) == 69 and round(counts.active / 1e8) == 13


def test_sandwich_and_post_norms_by_hand():
    """A sandwich layer (Gemma 3) holds four h-wide norms, a post-norm one (OLMo 2) two, after
    the branches; OLMo 3 slides three of every four layers by default, Gemma 3 five of six."""
    gemma = spec_from_hf_config(dict(model_type="gemma3_text", hidden_size=8, intermediate_size=16, num_hidden_layers=6,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=10,
                                     sliding_window=4), name="g")
    assert (gemma.norm_placement, gemma.norms_per_layer) == ("sandwich", 4)
    counts = count_parameters(gemma)
    assert counts.norms == 6 * 4 * 8
    assert counts.attention == 6 * (8 * (8 + 2 * 4) + 8 * 8 + 2 * 4)  # q, k, v, o; per-head q/k norms of 4
    assert gemma.layer_attention_spans == ("sliding",) * 5 + ("full",)
    olmo = spec_from_hf_config(dict(model_type="olmo3", hidden_size=8, intermediate_size=16, num_hidden_layers=4,
                                    num_attention_heads=2, vocab_size=10), name="o")
    assert (olmo.norm_placement, olmo.norms_per_layer, olmo.qk_norm_width) == ("post", 2, "projection")
    assert count_parameters(olmo).norms == 4 * 2 * 8
    assert olmo.layer_attention_spans == ("sliding", "sliding", "sliding", "full") and olmo.sliding_window == 4096


def test_preset_index_covers_presets():
    index = preset_index()
    for name in REQUIRED_PRESETS:
        assert index[name]["hf_repo"]


def test_q_and_k_norms_over_the_whole_projection_by_hand():
    """MiniMax-M2 normalises q and k over all their heads at once: per layer a norm of heads x
    head_dim and one of kv_heads x head_dim (8·4 + 2·4 = 40 weights), where per-head norms hold
    head_dim each (2·4 = 8); under TP a rank holds its heads' share of the first kind."""
    from ndplan.memory.static import attention_split

    config = dict(model_type="minimax_m2", hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=4, num_local_experts=4,
                  num_experts_per_tok=2, vocab_size=10)
    spec = spec_from_hf_config(config, name="tiny")
    assert spec.qk_norm and spec.qk_norm_width == "projection"
    per_head = spec.model_copy(update={"qk_norm_width": "head"})
    projections = 16 * (32 + 2 * 8) + 32 * 16  # q, k, v, o without biases
    assert count_parameters(spec).attention == 2 * (projections + 8 * 4 + 2 * 4)
    assert count_parameters(per_head).attention == 2 * (projections + 2 * 4)
    assert attention_split(spec).whole == 0 and attention_split(per_head).whole == 2 * 4


def test_tiny_llama_by_hand():
    config = dict(model_type="llama", hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    counts = count_parameters(spec_from_hf_config(config, name="tiny"))
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8 = 192; mlp 3*8*16 = 384; 2 norms 16
    assert counts.attention == 2 * 192
    assert counts.mlp == 2 * 384
    assert counts.norms == 2 * 16
    assert counts.embedding == counts.output_head == 80
    assert counts.total == 80 + 2 * (192 + 384 + 16) + 8 + 80


def test_layer_kinds_of_mixed_models():
    assert get_preset("deepseek-v3").layer_mlp_kinds[:4] == ("dense", "dense", "dense", "moe")
    assert get_preset("deepseek-v2-lite").num_dense_layers == 1
    assert get_preset("qwen3-30b-a3b").num_moe_layers == 48


def test_load_model_file_hf_and_native(tmp_path):
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(hf_config("qwen3-8b")))
    assert count_parameters(load_model(str(hf))).total == count_parameters(get_preset("qwen3-8b")).total
    native = tmp_path / "mine.yaml"
    native.write_text("num_layers: 2\nhidden_size: 8\nffn_hidden_size: 16\nnum_attention_heads: 2\n"
                      "num_kv_heads: 1\nhead_dim: 4\nvocab_size: 10\n")
    spec = load_model(str(native))
    assert spec.name == "mine" and spec.layer_mlp_kinds == ("dense", "dense")


_TINY_GEMMA = {"model_type": "gemma3_text", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
               "num_attention_heads": 2, "vocab_size": 10}
_TINY_OLMOE = {"model_type": "olmoe", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
               "num_attention_heads": 2, "vocab_size": 10}
_TINY_QWEN35 = {"model_type": "qwen3_5_text", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 4,
                "linear_value_head_dim": 4, "full_attention_interval": 2}
BAD_CONFIGS = [
    ({"model_type": "gpt2", "n_layer": 2}, "unsupported model_type 'gpt2'"),
    # known types ndplan does not price say why
    ({"model_type": "gemma3", "text_config": {}}, "model_type 'gemma3' is not supported: Gemma 3's vision-language "
     "model (a SigLIP vision tower and projector beside the language model), which ndplan does not price; for its "
     "language model give the file's text_config as a config of its own (model_type 'gemma3_text')"),
    ({"model_type": "qwen3_5_moe", "text_config": {}}, "model_type 'qwen3_5_moe' is not supported: Qwen3.5-MoE's "
     "vision-language model (a vision tower beside the language model), which ndplan does not price; for its language "
     "model give the file's text_config as a config of its own (model_type 'qwen3_5_moe_text')"),
    ({**_TINY_QWEN35, "layer_types": ["linear_attention", "sliding_attention"]}, "field 'layer_types' must list 2 "
     "entries, each one of full_attention, linear_attention; got ['linear_attention', 'sliding_attention']"),
    ({**_TINY_QWEN35, "full_attention_interval": 0}, "field 'full_attention_interval' must be >= 1, got 0"),
    ({**_TINY_QWEN35, "linear_num_value_heads": 3}, "linear_num_key_heads=2 does not divide linear_num_value_heads=3"),
    ({"model_type": "glm_moe_dsa"}, "model_type 'glm_moe_dsa' is not supported: GLM-5's DeepSeek sparse attention"),
    ({"model_type": "deepseek_v4"}, "model_type 'deepseek_v4' is not supported: DeepSeek-V4's compressed sparse "
     "attention"),
    ({"model_type": "kimi_k25", "text_config": {}}, "give the file's text_config as a config of its own with "
     "model_type 'deepseek_v3'"),
    ({**_TINY_GEMMA, "final_logit_softcapping": -1}, "field 'final_logit_softcapping' must be a positive number or "
     "null, got -1"),
    ({**_TINY_GEMMA, "use_bidirectional_attention": True}, "field 'use_bidirectional_attention' true is not supported"),
    ({**_TINY_GEMMA, "sliding_window_pattern": 0}, "field 'sliding_window_pattern' must be at least 1, got 0"),
    ({"model_type": "phi3", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
      "vocab_size": 10, "resid_pdrop": 0.1}, "field 'resid_pdrop' (0.1) is not supported: ndplan does not price the "
     "dropout masks of Phi-3's residual branches and embedding (allowed: 0)"),
    ({**_TINY_OLMOE, "clip_qkv": 8.0}, "field 'clip_qkv' (8.0) is not supported: ndplan does not price the clamps"),
    ({**_TINY_OLMOE, "head_dim": 2}, "OLMoE's q norm is hidden_size (8) wide, so num_attention_heads x head_dim "
     "(2 x 2) must equal it"),
    ({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10},
     "missing field 'intermediate_size'"),
    ({"model_type": "llama", "hidden_size": "8", "intermediate_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 2, "vocab_size": 10}, "field 'hidden_size' must be an integer"),
    ({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 0,
      "num_attention_heads": 2, "vocab_size": 10}, "field 'num_hidden_layers' must be at least 1, got 0"),
    ({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 0, "vocab_size": 10}, "field 'num_attention_heads' must be at least 1, got 0"),
    ({"model_type": "llama", "hidden_size": 12, "intermediate_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 3, "num_key_value_heads": 2, "vocab_size": 10}, "num_kv_heads=2 does not divide"),
    ({"model_type": "mixtral", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10, "num_local_experts": 4},
     "missing field 'num_experts_per_tok'"),
    ({"model_type": "mixtral", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10, "num_local_experts": 4,
      "num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 2, "vocab_size": -5}, "field 'vocab_size'"),
    ({"model_type": "qwen2", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
      "num_attention_heads": 2, "vocab_size": 10, "tie_word_embeddings": "yes"}, "must be true or false"),
    ({**json.loads(json.dumps(hf_config("deepseek-v2-lite"))), "mlp_bias": True},
     "field 'mlp_bias' true is not supported for deepseek_v2 (allowed: false"),
]


@pytest.mark.parametrize("config,message", BAD_CONFIGS)
def test_bad_hf_configs_name_the_field(config, message):
    with pytest.raises(NdplanError, match=re.escape(message)) as info:
        spec_from_hf_config(config, name="bad")
    assert "\n" not in str(info.value)


def test_unknown_preset_lists_presets():
    with pytest.raises(NdplanError, match="unknown model 'falcon-180b'; presets: deepseek-v2-lite"):
        load_model("falcon-180b")


def test_a_model_folder_reads_its_config_json(tmp_path):
    """A Hugging Face checkpoint folder names the model and holds its config.json."""
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config("qwen3-8b")))
    spec = load_model(str(folder))
    assert spec.name == "Qwen3-8B"
    assert count_parameters(spec).total == count_parameters(get_preset("qwen3-8b")).total
    with pytest.raises(NdplanError, match="a model folder needs a config.json"):
        load_model(str(tmp_path))


def test_qwen2_moe_without_qkv_bias_counts_as_transformers_builds_it():
    """transformers reads Qwen2-MoE's ``qkv_bias`` (default on): off, the q/k/v biases go."""
    config = {**hf_config("qwen1.5-moe-a2.7b"), "qkv_bias": False}
    ours = count_parameters(spec_from_hf_config(config, name="no-bias")).blocks()
    ours.pop("mtp")
    assert {k: v for k, v in ours.items() if v} == dict(meta_block_counts(config))
    with_bias = count_parameters(get_preset("qwen1.5-moe-a2.7b")).total
    assert with_bias - count_parameters(spec_from_hf_config(config, name="no-bias")).total == 24 * 3 * 2048


def test_kimi_k2_reads_as_deepseek_v3_architecture():
    """Kimi K2's config (model_type kimi_k2) is DeepSeek-V3's architecture: one dense layer, 384
    routed experts, 64 MLA heads, no MTP. Its model card rounds to 1T total, 32B activated (the
    activated count without the embedding, as DeepSeek's card counts its 37B)."""
    spec = get_preset("kimi-k2")
    counts = count_parameters(spec)
    assert spec.is_mla and spec.mtp_depth == 0 and spec.layer_mlp_kinds[:2] == ("dense", "moe")
    assert (spec.num_experts, spec.num_experts_per_tok, spec.num_attention_heads) == (384, 8, 64)
    assert round(counts.total / 1e12) == 1 and round((counts.active - counts.embedding) / 1e9) == 32


def test_deepseek_v3_reproduces_the_hub_safetensors_split_to_the_digit():
    """The Hub's safetensors metadata for deepseek-ai/DeepSeek-V3 (BF16 3,918,786,560; F8_E4M3
    680,571,043,840; F32 41,555,600; total 684,531,386,000) is ndplan's count plus what the
    checkpoint stores beside the parameters ndplan trains: the MTP layer's own copies of the
    embedding and output head (shared in training), one FP32 scale per 128x128 block of every
    FP8 weight, and the router's e_score_correction_bias (a buffer in transformers)."""
    spec = get_preset("deepseek-v3")
    counts = count_parameters(spec)
    h, heads, vocab = spec.hidden_size, spec.num_attention_heads, spec.vocab_size
    moe_layers = spec.num_moe_layers + spec.mtp_depth  # the MTP module's layer is MoE

    def blocks(rows: int, cols: int) -> int:
        return -(-rows // 128) * -(-cols // 128)

    attention = (blocks(spec.q_lora_rank, h) + blocks(heads * spec.qk_head_dim, spec.q_lora_rank)
                 + blocks(spec.kv_lora_rank + spec.qk_rope_head_dim, h)
                 + blocks(heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank)
                 + blocks(h, heads * spec.v_head_dim))

    def mlp(width: int) -> int:
        return 2 * blocks(width, h) + blocks(h, width)

    scales = ((spec.num_layers + spec.mtp_depth) * attention + spec.num_dense_layers * mlp(spec.ffn_hidden_size)
              + moe_layers * (spec.num_experts + spec.num_shared_experts) * mlp(spec.moe_ffn_hidden_size))
    bias_buffers = moe_layers * spec.num_experts
    assert scales + bias_buffers == 41_555_600
    layer_norms = (spec.num_layers + spec.mtp_depth) * (2 * h + spec.q_lora_rank + spec.kv_lora_rank)
    bf16 = (4 * vocab * h + layer_norms + h + 3 * h  # tables (and the MTP copies), norms
            + moe_layers * spec.num_experts * h + 2 * h * h)  # routers, the MTP's eh_proj
    assert bf16 == 3_918_786_560
    assert counts.total_with_mtp + 2 * vocab * h - bf16 == 680_571_043_840


@pytest.mark.parametrize("field", ["q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"])
def test_mla_widths_without_kv_lora_rank_are_refused(tmp_path, field):
    """kv_lora_rank > 0 is what switches MLA on: a native spec that gives MLA's other widths
    without it was priced as plain MHA of head_dim, those widths silently dropped."""
    path = tmp_path / "mla.yaml"
    path.write_text("num_layers: 2\nhidden_size: 64\nffn_hidden_size: 128\nnum_attention_heads: 4\nnum_kv_heads: 4\n"
                    f"head_dim: 16\nvocab_size: 100\n{field}: 32\n")
    with pytest.raises(NdplanError, match=rf"mla.yaml: field '{field}' \(32\) is a multi-head latent attention "
                                          r"width, but kv_lora_rank=0 \(MLA off\); give kv_lora_rank > 0 or "
                                          rf"leave {field} 0$"):
        load_model(str(path))


def test_layernorm_qk_norms_carry_their_biases():
    """Megatron's --qk-layernorm under --normalization LayerNorm builds its q and k norms as the
    model's norm (Transformer Engine's LayerNorm: a weight and a bias of head_dim each), and MLA's
    latent norms likewise: 2·2·d per layer, not 2·d; replicated over TP (the whole part)."""
    import numpy as np

    from ndplan.memory.static import attention_split
    from ndplan.model import ModelSpec
    from ndplan.model.params import attention_params

    base = ModelSpec(name="ln", num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=4,
                     head_dim=16, vocab_size=256, norm="layernorm", norm_bias=True)
    with_qk = base.model_copy(update={"qk_norm": True})
    assert attention_params(with_qk) - attention_params(base) == 2 * 2 * 16
    assert attention_split(with_qk).whole - attention_split(base).whole == 2 * 2 * 16
    mla = base.model_copy(update={"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                                  "v_head_dim": 16})
    rms = mla.model_copy(update={"norm": "rmsnorm", "norm_bias": False})
    assert attention_params(mla) - attention_params(rms) == 32 + 16  # the q and kv latent norms' biases
    assert attention_split(mla).per_rank(np.array([2.0]))[0] - attention_split(rms).per_rank(np.array([2.0]))[0] == 48


@pytest.mark.parametrize(("name", "hidden", "layers", "heads", "head_dim"), [
    ("llama-3.2-1b", 2048, 16, 32, 64), ("llama-3.2-3b", 3072, 28, 24, 128)])
def test_tied_llama_3_2_counts_its_table_once(name: str, hidden: int, layers: int, heads: int, head_dim: int) -> None:
    """Llama 3.2's embedding and LM head are one [128,256, h] table: 1,235,814,400 and
    3,212,749,824 parameters (the model cards' 1.23B and 3.21B), by hand."""
    table, kv = 128_256 * hidden, 8 * head_dim
    layer = 2 * hidden * heads * head_dim + 2 * hidden * kv + 3 * hidden * 8192 + 2 * hidden
    model = get_preset(name)
    assert model.tie_word_embeddings
    assert count_parameters(model).total == table + layers * layer + hidden == {"llama-3.2-1b": 1_235_814_400,
                                                                                "llama-3.2-3b": 3_212_749_824}[name]
