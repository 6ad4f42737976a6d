"""A config.json that leaves out fields reads with transformers' defaults for its model_type.

Each MINIMAL config gives only the fields ndplan requires, so every field ndplan can fall back on
(num_key_value_heads, head_dim, shared-expert widths, DeepSeek's q_lora_rank, routed and shared
expert counts...) takes its default; ndplan must count what transformers builds from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.model import count_parameters, spec_from_hf_config
from ndplan.model.hf import READERS

_DENSE = {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000}
_MLA = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000, "moe_intermediate_size": 64,
        "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}

# Head counts are chosen so the default num_key_value_heads divides them (qwen2/qwen3 32,
# qwen2_moe 16, qwen3_moe 4, mistral/mixtral/gpt_oss 8, llama = heads; MLA has no KV groups).
MINIMAL: dict[str, dict] = {
    "llama": {"model_type": "llama", **_DENSE, "num_attention_heads": 8},
    "mistral": {"model_type": "mistral", **_DENSE, "num_attention_heads": 16},
    "mixtral": {"model_type": "mixtral", **_DENSE, "num_attention_heads": 16, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen2": {"model_type": "qwen2", **_DENSE, "num_attention_heads": 32},
    "qwen2_moe": {"model_type": "qwen2_moe", **_DENSE, "num_attention_heads": 16, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 128},
    "qwen3": {"model_type": "qwen3", **_DENSE, "num_attention_heads": 32},
    "qwen3_moe": {"model_type": "qwen3_moe", **_DENSE, "num_attention_heads": 8, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 128},
    "deepseek_v2": {"model_type": "deepseek_v2", **_MLA, "num_hidden_layers": 2, "num_attention_heads": 8,
                    "num_experts_per_tok": 2},
    "deepseek_v3": {"model_type": "deepseek_v3", **_MLA, "num_hidden_layers": 4, "num_attention_heads": 128},
    "kimi_k2": {"model_type": "kimi_k2", **_MLA, "num_hidden_layers": 4, "num_attention_heads": 128},
    "gpt_oss": {"model_type": "gpt_oss", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 128,
                "vocab_size": 1000, "num_attention_heads": 16, "num_local_experts": 8},
    # 128 routed experts and one shared after one dense layer, top 8, no q/k norms or biases
    "glm4_moe": {"model_type": "glm4_moe", **_DENSE, "num_attention_heads": 8, "moe_intermediate_size": 128},
    # DeepSeek-V3's layer with GLM-4.7-Flash's defaults: a 768 query rank, 64 experts, top 4
    "glm4_moe_lite": {"model_type": "glm4_moe_lite", **_MLA, "num_hidden_layers": 4, "num_attention_heads": 8},
    # 256 experts of intermediate_size, top 8, head_dim 128, 8 KV heads, q/k norms over the projection
    "minimax_m2": {"model_type": "minimax_m2", **_DENSE, "num_attention_heads": 8},
    # fused qkv and gate/up projections (transformers' pad_token_id default, 32000, must fit the table)
    "phi3": {"model_type": "phi3", **_DENSE, "num_attention_heads": 8, "pad_token_id": 0},
    # post-norm layers, q/k norms over the projection (OLMo 3: sliding windows on 3 of every 4)
    "olmo2": {"model_type": "olmo2", **_DENSE, "num_attention_heads": 8},
    "olmo3": {"model_type": "olmo3", **_DENSE, "num_attention_heads": 8},
    # 64 experts of intermediate_size, top 8
    "olmoe": {"model_type": "olmoe", **_DENSE, "num_attention_heads": 8},
    # four norms a layer, 4 KV heads of 256, a tied head over 262,208 tokens (no vocab_size)
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 256, "num_hidden_layers": 2,
                    "intermediate_size": 512, "num_attention_heads": 8},
    # Gemma 2 2B's heads (8 of 256, 4 KV), its 256,000-token vocabulary and soft-capping, no q/k norms
    "gemma2": {"model_type": "gemma2", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512},
    # every 4th layer gated softmax attention of 2 (Next, 3.5-MoE) or 4 KV heads of 256, the others
    # Gated DeltaNet of 16 key and 32 value heads of 128 with 4 taps; Next: 512 experts of 512, top
    # 10, and a shared one of 512; 3.5-MoE: 256 experts, top 8
    "qwen3_next": {"model_type": "qwen3_next", "hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1000,
                   "num_attention_heads": 8},
    "qwen3_5_text": {"model_type": "qwen3_5_text", **_DENSE, "num_hidden_layers": 4, "num_attention_heads": 8},
    "qwen3_5_moe_text": {"model_type": "qwen3_5_moe_text", "hidden_size": 256, "num_hidden_layers": 4,
                         "vocab_size": 1000, "num_attention_heads": 8},
}

# Parameters transformers 5.24.0 builds for each MINIMAL config (AutoConfig.for_model, then
# AutoModelForCausalLM.from_config on the meta device; tests/hf_meta.py), without DeepSeek's
# MTP module, which transformers does not build. Hard-coded so the check runs without torch.
TRANSFORMERS_COUNTS = {
    "llama": 1_824_000, "mistral": 1_692_928, "mixtral": 4_054_272, "qwen2": 1_825_536,
    "qwen2_moe": 10_478_848, "qwen3": 9_688_832, "qwen3_moe": 1_695_104, "deepseek_v2": 9_191_744,
    "deepseek_v3": 59_011_456, "kimi_k2": 59_011_456, "gpt_oss": 3_675_952, "glm4_moe": 14_144_768,
    "glm4_moe_lite": 12_887_424, "minimax_m2": 204_072_192, "olmo2": 1_825_024, "olmo3": 1_825_024,
    "olmoe": 51_403_008, "gemma3_text": 71_060_736, "phi3": 1_824_000, "qwen3_next": 822_485_312,
    "qwen3_5_text": 16_915_776, "qwen3_5_moe_text": 419_569_984, "gemma2": 69_470_464,
}

# No MTP module where num_nextn_predict_layers is not stated (transformers builds none).
MTP_DEPTH: dict[str, int] = {}


def _count(config: dict) -> tuple[int, int]:
    """(parameters without MTP, MTP parameters) ndplan counts for ``config``."""
    counts = count_parameters(spec_from_hf_config(config, name=config["model_type"]))
    return counts.total, counts.mtp


def test_every_model_type_is_covered():
    assert set(MINIMAL) == set(READERS) == set(TRANSFORMERS_COUNTS)


@pytest.mark.parametrize("model_type", sorted(MINIMAL))
def test_defaults_count_what_transformers_builds(model_type):
    body, mtp = _count(MINIMAL[model_type])
    assert body == TRANSFORMERS_COUNTS[model_type]
    assert spec_from_hf_config(MINIMAL[model_type], name="m").mtp_depth == MTP_DEPTH.get(model_type, 0)
    assert (mtp > 0) == (model_type in MTP_DEPTH)


@pytest.mark.parametrize("model_type", sorted(MINIMAL))
def test_defaults_match_transformers_live(model_type):
    """The same, block by block, against the transformers installed (the census extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_meta import meta_block_counts

    ours = count_parameters(spec_from_hf_config(MINIMAL[model_type], name="m")).blocks()
    ours.pop("mtp")
    assert {k: v for k, v in ours.items() if v} == dict(meta_block_counts(MINIMAL[model_type]))


def test_qwen3_without_head_dim_takes_128():
    """Qwen3Config's head_dim defaults to 128, not hidden_size / num_attention_heads (64 here)."""
    config = {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
              "num_hidden_layers": 28, "intermediate_size": 3072, "vocab_size": 151936,
              "tie_word_embeddings": True}
    spec = spec_from_hf_config(config, name="q")
    assert spec.head_dim == 128
    assert count_parameters(spec).total == 596_049_920  # transformers 5.24.0 on the meta device


def test_deepseek_q_lora_rank_null_means_uncompressed_queries():
    """Absent, q_lora_rank is transformers' 1536; null (DeepSeek-V2-Lite) means no query LoRA."""
    assert spec_from_hf_config(MINIMAL["deepseek_v2"], name="m").q_lora_rank == 1536
    assert spec_from_hf_config({**MINIMAL["deepseek_v2"], "q_lora_rank": None}, name="m").q_lora_rank == 0


def test_null_num_key_value_heads_is_num_attention_heads():
    spec = spec_from_hf_config({**MINIMAL["qwen2"], "num_attention_heads": 16, "num_key_value_heads": None},
                               name="m")
    assert spec.num_kv_heads == 16


def test_a_default_num_key_value_heads_that_does_not_divide_the_heads_is_named():
    with pytest.raises(NdplanError, match=r"no field 'num_key_value_heads', and transformers' default for "
                                          r"model_type 'qwen2' \(32\) does not divide num_attention_heads \(16\)"):
        spec_from_hf_config({**MINIMAL["qwen2"], "num_attention_heads": 16}, name="m")


# hidden_size 1024 with 12 heads: transformers' LlamaConfig and DeepseekV2Config reject it even
# with head_dim given; the other types derive head_dim = 1024 // 12 only without one, and
# qwen3, gpt_oss and DeepSeek-V3 (MLA) have a head width of their own.
_UNEVEN = {"hidden_size": 1024, "num_attention_heads": 12, "num_key_value_heads": 4}
ALWAYS_REJECTED = ["llama", "deepseek_v2", "gemma3_text"]
REJECTED_WITHOUT_HEAD_DIM = ["mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3_moe", "glm4_moe", "olmo2", "olmo3", "phi3"]
ACCEPTED = ["qwen3", "gpt_oss", "deepseek_v3", "kimi_k2", "glm4_moe_lite", "minimax_m2"]


@pytest.mark.parametrize("model_type", ALWAYS_REJECTED)
@pytest.mark.parametrize("head_dim", [{}, {"head_dim": 64}])
def test_hidden_size_heads_do_not_divide_rejected_as_transformers_does(model_type, head_dim):
    with pytest.raises(NdplanError, match=rf"config.json: hidden_size \(1024\) is not a multiple of "
                                          rf"num_attention_heads \(12\); transformers rejects that for "
                                          rf"model_type '{model_type}'$"):
        spec_from_hf_config({**MINIMAL[model_type], **_UNEVEN, **head_dim}, name="m")


@pytest.mark.parametrize("model_type", REJECTED_WITHOUT_HEAD_DIM)
def test_a_head_dim_derived_from_uneven_sizes_is_rejected(model_type):
    with pytest.raises(NdplanError, match=r"config.json: no field 'head_dim', and hidden_size \(1024\) is not a "
                                          r"multiple of num_attention_heads \(12\); give head_dim"):
        spec_from_hf_config({**MINIMAL[model_type], **_UNEVEN}, name="m")
    assert spec_from_hf_config({**MINIMAL[model_type], **_UNEVEN, "head_dim": 64}, name="m").head_dim == 64


@pytest.mark.parametrize("model_type", ACCEPTED)
def test_types_with_their_own_head_width_accept_uneven_sizes(model_type):
    spec_from_hf_config({**MINIMAL[model_type], **_UNEVEN}, name="m")


def test_census_names_the_uneven_fields_on_one_line(tmp_path: Path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = tmp_path / "uneven.json"
    path.write_text(json.dumps({**MINIMAL["llama"], **_UNEVEN}))
    assert main(["census", str(path), "--seq", "128"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "hidden_size (1024) is not a multiple of num_attention_heads (12)" in err


def test_census_of_a_type_ndplan_does_not_read_names_what_torch_refused(tmp_path: Path, capsys):
    """A model type only transformers reads (gemma): a size torch cannot allocate is one line."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = tmp_path / "gemma.json"
    path.write_text(json.dumps({"model_type": "gemma", "hidden_size": 64, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": -4, "num_hidden_layers": 2,
                                "intermediate_size": 128, "vocab_size": 100}))
    assert main(["census", str(path), "--seq", "32"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "census: transformers cannot build 'gemma' from this config: Trying to create tensor with negative" in err


# A null count is not the field left out: transformers' configs reject null for these (DeepSeek's
# own modeling code reads a null n_routed_experts as a dense model and a null n_shared_experts as
# none), so ndplan must not price transformers' example model's value in its place (64 or 256
# routed experts, 1 or 2 shared, a 5632-wide shared expert...).
NULL_REFUSED = [
    ("deepseek_v2", "n_routed_experts"), ("deepseek_v3", "n_routed_experts"), ("kimi_k2", "n_routed_experts"),
    ("deepseek_v2", "n_shared_experts"), ("deepseek_v3", "n_shared_experts"),
    ("deepseek_v2", "first_k_dense_replace"), ("deepseek_v3", "first_k_dense_replace"),
    ("deepseek_v3", "num_experts_per_tok"), ("gpt_oss", "num_experts_per_tok"),
    ("qwen2_moe", "shared_expert_intermediate_size"), ("qwen2_moe", "decoder_sparse_step"),
    ("qwen3_moe", "decoder_sparse_step"),
    ("glm4_moe", "n_routed_experts"), ("glm4_moe", "n_shared_experts"), ("glm4_moe", "first_k_dense_replace"),
    ("glm4_moe", "num_experts_per_tok"), ("glm4_moe_lite", "n_routed_experts"), ("glm4_moe_lite", "n_shared_experts"),
    ("minimax_m2", "num_local_experts"), ("minimax_m2", "num_experts_per_tok"),
    ("olmoe", "num_experts"), ("olmoe", "num_experts_per_tok"),
]


@pytest.mark.parametrize("model_type,field", NULL_REFUSED)
def test_a_null_count_is_refused_not_defaulted(model_type, field):
    with pytest.raises(NdplanError, match=rf"^config.json: field '{field}' must be an integer \(at least \d\), "
                                          r"got null$"):
        spec_from_hf_config({**MINIMAL[model_type], field: None}, name="m")


def test_nulls_that_mean_none_or_the_default_still_read():
    """null num_key_value_heads: the head count; q_lora_rank: uncompressed queries; the MTP
    depth and the position limit: none; head_dim: the type's default."""
    v3 = spec_from_hf_config({**MINIMAL["deepseek_v3"], "num_nextn_predict_layers": None, "q_lora_rank": None,
                              "max_position_embeddings": None, "num_key_value_heads": None}, name="m")
    assert (v3.mtp_depth, v3.q_lora_rank, v3.max_position_embeddings, v3.num_kv_heads) == (0, 0, 0, 128)
    assert spec_from_hf_config({**MINIMAL["llama"], "head_dim": None}, name="m").head_dim == 32


def test_deepseek_zero_q_lora_rank_is_refused():
    """q_lora_rank 0 is not null: transformers and DeepSeek's code build a rank-0 query LoRA
    (no query weights at all), where ndplan would count a full uncompressed q_proj."""
    with pytest.raises(NdplanError, match=r"^config.json: field 'q_lora_rank' must be null \(queries not "
                                          r"compressed\) or at least 1, got 0$"):
        spec_from_hf_config({**MINIMAL["deepseek_v2"], "q_lora_rank": 0}, name="m")


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_zero_routed_experts_is_refused(model_type):
    """n_routed_experts 0: transformers builds MoE blocks with no routed experts (only the shared
    ones, and a top-k over nothing), ndplan would count dense MLPs of intermediate_size."""
    with pytest.raises(NdplanError, match=r"^config.json: field 'n_routed_experts' must be at least 1, got 0$"):
        spec_from_hf_config({**MINIMAL[model_type], "n_routed_experts": 0}, name="m")


@pytest.mark.parametrize("model_type", sorted(MINIMAL))
def test_attention_dropout_is_read(model_type):
    """Every supported transformers model applies config.attention_dropout to the attention
    probabilities in training; eager attention keeps its mask for backward, so the spec must
    carry it (it read 0 whatever the config said)."""
    assert spec_from_hf_config({**MINIMAL[model_type], "attention_dropout": 0.1}, name="m").attention_dropout == 0.1
    assert spec_from_hf_config({**MINIMAL[model_type], "attention_dropout": None}, name="m").attention_dropout == 0
    assert spec_from_hf_config(MINIMAL[model_type], name="m").attention_dropout == 0


@pytest.mark.parametrize("value", [1.0, -0.1, "0.1", True])
def test_a_bad_attention_dropout_is_named(value):
    with pytest.raises(NdplanError, match=r"^config.json: field 'attention_dropout' must be a probability in "
                                          rf"\[0, 1\), got {value!r}$"):
        spec_from_hf_config({**MINIMAL["llama"], "attention_dropout": value}, name="m")


# Options the shipped presets and MINIMAL leave at one setting, each turned the other way:
# biases, explicit head widths, tied tables, sparse steps and dense-only layers, DeepSeek's
# attention_bias with and without a query LoRA, no shared experts. Totals from transformers
# 5.24.0 on the meta device (hard-coded, so the check runs without torch).
VARIANTS: dict[str, tuple[str, dict, int]] = {
    "llama-biases-tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
                                    "head_dim": 48, "num_key_value_heads": 2}, 1_539_456),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True, "head_dim": 16, "num_key_value_heads": 8}, 1_957_184),
    "qwen2_moe-sparse-step": ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [1], "num_hidden_layers": 4,
                                            "shared_expert_intermediate_size": 96, "qkv_bias": False}, 3_210_752),
    "qwen3_moe-mlp-only": ("qwen3_moe", {"mlp_only_layers": [0], "attention_bias": True, "head_dim": 48}, 1_892_800),
    "deepseek_v2-bias-q-lora": ("deepseek_v2", {"attention_bias": True, "q_lora_rank": 48, "first_k_dense_replace": 1,
                                                "n_shared_experts": 0, "n_routed_experts": 4}, 1_354_848),
    "deepseek_v3-bias-no-q-lora": ("deepseek_v3", {"attention_bias": True, "q_lora_rank": None,
                                                   "first_k_dense_replace": 1, "n_shared_experts": 2,
                                                   "n_routed_experts": 8, "num_experts_per_tok": 2,
                                                   "num_attention_heads": 8, "num_key_value_heads": 8}, 3_159_616),
    "gpt_oss-no-attention-bias": ("gpt_oss", {"attention_bias": False, "tie_word_embeddings": True}, 3_415_344),
    # Qwen2-MoE builds its shared expert and the expert's sigmoid gate (h -> 1) in every MoE
    # block whatever the width: at 0 the expert is empty but the gate's h weights remain.
    "qwen2_moe-no-shared-width": ("qwen2_moe", {"shared_expert_intermediate_size": 0}, 1_828_096),
    "phi3-gqa-window-tied": ("phi3", {"num_key_value_heads": 2, "sliding_window": 2047, "tie_word_embeddings": True},
                             1_371_392),
    # biases on q, k, v and o; grouped KV heads (narrower k norms over the projection)
    "olmo2-bias-gqa": ("olmo2", {"attention_bias": True, "num_key_value_heads": 2}, 1_629_312),
    "olmoe-bias-gqa": ("olmoe", {"attention_bias": True, "num_key_value_heads": 4, "num_experts": 6,
                                 "num_experts_per_tok": 2}, 5_630_464),
    "gemma3_text-bias-untied": ("gemma3_text", {"attention_bias": True, "tie_word_embeddings": False,
                                                "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 500},
                                1_702_400),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_count_what_transformers_builds(name):
    model_type, fields, total = VARIANTS[name]
    assert _count({**MINIMAL[model_type], **fields}) == (total, 0)


# Two variants build an empty module (no shared experts: deepseek_v2's zero-width shared MLP,
# qwen2_moe's zero-width shared expert), which torch reports as a no-op initialisation.
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_match_transformers_live(name):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_meta import meta_block_counts

    model_type, fields, _ = VARIANTS[name]
    config = {**MINIMAL[model_type], **fields}
    ours = count_parameters(spec_from_hf_config(config, name="m")).blocks()
    ours.pop("mtp")
    assert {k: v for k, v in ours.items() if v} == {k: v for k, v in meta_block_counts(config).items() if v}


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "kimi_k2"])
def test_mla_has_a_key_and_value_per_query_head(model_type):
    """MLA makes every head's key and value out of the shared latent (kv_b_proj), so its KV
    heads are its query heads whatever num_key_value_heads says: DeepSeek's code does not read
    the field, transformers' fails in the forward pass unless it equals num_attention_heads (it
    repeats the per-head K/V again), and the Megatron and MindFormers readers set the same. It
    was read as GQA groups (a fp32 math-path share in the memory model, a 'lost' note in
    --emit), and a config leaving it out with fewer heads than the type's default was refused."""
    grouped = spec_from_hf_config({**MINIMAL[model_type], "num_attention_heads": 8, "num_key_value_heads": 2},
                                  name="m")
    assert (grouped.num_kv_heads, grouped.attention_kind) == (8, "mla")
    absent = {k: v for k, v in MINIMAL[model_type].items() if k != "num_key_value_heads"}
    assert spec_from_hf_config({**absent, "num_attention_heads": 8}, name="m").num_kv_heads == 8
    with pytest.raises(NdplanError, match=r"field 'num_key_value_heads' must be an integer, got 'x'"):
        spec_from_hf_config({**MINIMAL[model_type], "num_key_value_heads": "x"}, name="m")


def test_glm4_moe_lite_layers_follow_mlp_layer_types_not_first_k_dense_replace():
    """transformers builds Glm4MoeLite's layers from mlp_layer_types (default: one dense layer,
    then MoE) and has no first_k_dense_replace; a list of another length or kind is named."""
    base = MINIMAL["glm4_moe_lite"]
    assert spec_from_hf_config({**base, "first_k_dense_replace": 3}, name="m").layer_mlp_kinds == (
        "dense", "moe", "moe", "moe")
    listed = spec_from_hf_config({**base, "mlp_layer_types": ["dense", "dense", "sparse", "dense"]}, name="m")
    assert listed.layer_mlp_kinds == ("dense", "dense", "moe", "dense")
    with pytest.raises(NdplanError, match=r"^config.json: field 'mlp_layer_types' must list 4 entries, each "
                                          r"'dense' or 'sparse'; got \['dense', 'moe'\]$"):
        spec_from_hf_config({**base, "mlp_layer_types": ["dense", "moe"]}, name="m")
    with pytest.raises(NdplanError, match=r"field 'mlp_layer_types' must list 4 entries"):
        spec_from_hf_config({**base, "mlp_layer_types": [{"dense": 1}] * 4}, name="m")  # not a kind's name
