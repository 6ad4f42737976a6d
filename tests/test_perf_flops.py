"""FLOP counts derived by hand for tiny configurations, and how sharding divides them."""

from __future__ import annotations

import numpy as np
import pytest

from ndplan.model.params import count_parameters
from ndplan.model.spec import ModelSpec
from ndplan.perf.flops import (
    Sharding,
    attention_core_flops,
    causal_pairs,
    expert_tokens,
    gemm_flops,
    layer_gemms,
    model_flops_per_micro_batch,
)

# h=64, 2 layers, 4 query heads of 16, 2 KV heads (GQA), gated MLP of 96, vocabulary 100, no biases.
TINY = ModelSpec(
    name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
    head_dim=16, vocab_size=100,
)


def test_causal_pairs_count_the_lower_triangle_with_its_diagonal():
    assert causal_pairs(1) == 1
    assert causal_pairs(4) == 10  # 1 + 2 + 3 + 4
    assert causal_pairs(4096) == 4096 * 4097 // 2


def test_dense_model_flops_are_6_n_tokens_plus_the_attention_term():
    b, s = 3, 32
    tokens = b * s
    # Matmul weights by hand: q 64·64, k and v 64·32 each, o 64·64, gate/up/down 3·64·96, per layer;
    # the output head 64·100 (untied). Embedding and norms are not matmuls.
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96
    matmul_weights = 2 * per_layer + 64 * 100
    counts = count_parameters(TINY)
    assert matmul_weights == counts.total - counts.embedding - counts.norms - counts.final_norm
    # Causal attention: QK^T and PV cost 2·(16 + 16) FLOPs per kept (query, key) pair and head.
    attention_forward = 2 * 4 * (2 * (16 + 16)) * b * (s * (s + 1) // 2)
    expected = 6 * matmul_weights * tokens + 3 * attention_forward
    got = model_flops_per_micro_batch(TINY, b, s)
    assert got.model == pytest.approx(expected, rel=1e-12)
    assert got.hardware == got.model  # no recompute


def test_recompute_adds_hardware_flops_only():
    base = model_flops_per_micro_batch(TINY, 1, 64)
    full = model_flops_per_micro_batch(TINY, 1, 64, recompute_full_fraction=1.0)
    selective = model_flops_per_micro_batch(TINY, 1, 64, recompute_selective_fraction=1.0)
    assert full.model == base.model and selective.model == base.model
    # full recompute adds one forward of both decoder layers (not the head), selective their attention core
    layer_matmuls = 2 * gemm_flops(layer_gemms(TINY, Sharding(1.0, 64.0), "dense"))
    attention = 2 * attention_core_flops(TINY, Sharding(1.0, 64.0))
    assert full.hardware - full.model == pytest.approx(layer_matmuls + attention)
    assert selective.hardware - selective.model == pytest.approx(attention)


def test_per_device_flops_divide_by_tp_and_cp():
    whole = Sharding(2.0, 128.0)
    split = Sharding(2.0, 128.0, tp=4.0, cp=2.0)
    assert gemm_flops(layer_gemms(TINY, split, "dense")) == pytest.approx(gemm_flops(layer_gemms(TINY, whole, "dense")) / 8)
    assert attention_core_flops(TINY, split) == pytest.approx(attention_core_flops(TINY, whole) / 8)


def test_routed_experts_take_top_k_copies_shared_evenly_over_the_stage():
    moe = ModelSpec(
        name="tiny-moe", num_layers=1, hidden_size=64, ffn_hidden_size=0, num_attention_heads=4, num_kv_heads=4,
        head_dim=16, vocab_size=100, num_experts=8, num_experts_per_tok=2, moe_ffn_hidden_size=32,
        num_shared_experts=1, shared_expert_ffn_hidden_size=48,
    )
    tokens = 256.0
    whole = {g.name: g for g in layer_gemms(moe, Sharding(1.0, tokens), "moe")}
    # 256 tokens · 2 experts each through 3 matrices of 64×32; router 64→8; shared expert 3·64·48
    experts = whole["experts_up"].flops + whole["experts_down"].flops
    assert experts == pytest.approx(2 * tokens * 2 * 3 * 64 * 32)
    assert whole["router"].flops == pytest.approx(2 * tokens * 64 * 8)
    assert whole["shared_up"].flops + whole["shared_down"].flops == pytest.approx(2 * tokens * 3 * 64 * 48)
    # tp=2, ep=4, etp=1 over a stage: each device runs 1/(cp·tp) of the copies: ep does not change it
    sharded = Sharding(1.0, tokens, tp=2.0, ep=4.0, etp=1.0)
    local = {g.name: g for g in layer_gemms(moe, sharded, "moe")}
    assert local["experts_up"].flops + local["experts_down"].flops == pytest.approx(experts / 2)
    # tokens per local expert: (T/c)·k·ep·etp/(tp·E) = 256·2·4/(2·8) = 128; 2 local experts
    # (8 over ep=4) take the device's 256·2/2 = 256 copies
    assert expert_tokens(moe, sharded) == pytest.approx(128.0)
    assert local["experts_up"].count == 2.0


def test_mla_projections_use_the_lora_ranks():
    mla = ModelSpec(
        name="tiny-mla", num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=4,
        head_dim=16, vocab_size=100, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16,
    )
    gemms = {g.name: g.flops for g in layer_gemms(mla, Sharding(1.0, 10.0), "dense")}
    assert gemms["q_down"] == 2 * 10 * 64 * 24
    assert gemms["q_up"] == 2 * 10 * 24 * 4 * (16 + 8)
    assert gemms["kv_down"] == 2 * 10 * 64 * (16 + 8)
    assert gemms["kv_up"] == 2 * 10 * 16 * 4 * (16 + 16)
    assert gemms["o_proj"] == 2 * 10 * 4 * 16 * 64
    attention = attention_core_flops(mla, Sharding(1.0, 10.0))
    assert attention == 2 * 4 * ((16 + 8) + 16) * 55  # 55 causal pairs of 10 tokens


def test_flops_broadcast_over_strategy_arrays():
    seq = np.array([128.0, 256.0])
    flops = model_flops_per_micro_batch(TINY, 1.0, seq)
    assert np.asarray(flops.model).shape == (2,)
    assert flops.model[1] > 2 * flops.model[0]  # attention grows faster than linearly


def test_torchtitan_op_policy_recomputes_every_second_matmul():
    from ndplan.perf.flops import alternate_recomputed_gemms, matmul_sequence

    sh = Sharding(1.0, 10.0)
    # torchtitan runs q, k, v, o, w1 (gate), w3 (up), w2 (down) as separate matmuls and saves
    # the 1st, 3rd, 5th and 7th: k, o and w3 are recomputed
    assert [g.name for g in matmul_sequence(TINY, sh, "dense")] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "mlp_w1", "mlp_w3", "mlp_w2"]
    recomputed = alternate_recomputed_gemms(TINY, sh, "dense")
    assert [g.name for g in recomputed] == ["k_proj", "o_proj", "mlp_w3"]
    # k 64·32, o 64·64, w3 64·96 weights: 2·(2048 + 4096 + 6144) = 24,576 FLOPs per token
    assert gemm_flops(recomputed) == 10 * 24_576
    # the unfused sequence holds the same FLOPs as the fused projections
    assert gemm_flops(matmul_sequence(TINY, sh, "dense")) == pytest.approx(gemm_flops(layer_gemms(TINY, sh, "dense")))
    # hardware FLOPs: 2 layers · 64 tokens · 24,576, and no attention core
    base = model_flops_per_micro_batch(TINY, 1, 64)
    op = model_flops_per_micro_batch(TINY, 1, 64, recompute_selective_fraction=1.0, selective_policy="torchtitan-op")
    assert op.hardware - base.model == pytest.approx(2 * 64 * 24_576)


def test_mla_down_projections_run_on_the_sequence_shard_under_sp():
    """Megatron-Core builds the MLA down-projections as duplicated TELinear layers fed the
    attention's input as it arrives: under SP each tensor-parallel rank projects its own T/t
    tokens (q_compressed [s/TP, b, q_lora_rank], multi_latent_attention._qkv_down_projection),
    then the up-projections all-gather the latents; without SP every rank projects all T.
    10 tokens over tp 2: q_down 2·5·64·24, kv_down 2·5·64·(16 + 8) with SP; twice that without;
    the up-projections take all 10 tokens and half the heads either way."""
    mla = ModelSpec(
        name="tiny-mla", num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=4,
        head_dim=16, vocab_size=100, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16,
    )
    sp = {g.name: g.flops for g in layer_gemms(mla, Sharding(1.0, 10.0, tp=2.0, sp=1.0), "dense")}
    whole = {g.name: g.flops for g in layer_gemms(mla, Sharding(1.0, 10.0, tp=2.0), "dense")}
    assert sp["q_down"] == 2 * 5 * 64 * 24 and sp["kv_down"] == 2 * 5 * 64 * (16 + 8)
    assert whole["q_down"] == 2 * 10 * 64 * 24 and whole["kv_down"] == 2 * 10 * 64 * (16 + 8)
    for name in ("q_up", "kv_up", "o_proj"):
        assert sp[name] == whole[name]
    assert sp["q_up"] == 2 * 10 * 24 * 2 * (16 + 8)


def test_the_router_takes_the_sequence_shard_under_sp():
    """Megatron-Core runs the MoE block on each rank's sequence shard (it requires SP with TP):
    the router's gating GEMM takes the T/t local tokens, 2·(256/2)·64·8 over tp 2, not all 256
    on every rank; without SP all T/c."""
    moe = ModelSpec(
        name="tiny-moe", num_layers=1, hidden_size=64, ffn_hidden_size=0, num_attention_heads=4, num_kv_heads=4,
        head_dim=16, vocab_size=100, num_experts=8, num_experts_per_tok=2, moe_ffn_hidden_size=32,
    )
    routers = [next(g for g in layer_gemms(moe, Sharding(1.0, 256.0, tp=2.0, sp=sp), "moe") if g.name == "router")
               for sp in (1.0, 0.0)]
    assert routers[0].flops == 2 * 128 * 64 * 8
    assert routers[1].flops == 2 * 256 * 64 * 8
