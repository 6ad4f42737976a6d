"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5): parameters, FLOPs, step time and activations,
pinned by hand and, where torch is installed, against the census of tiny models (fake tensors,
the GPU kernels' stand-ins: ndplan.census.kernels)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.memory.activations import layer_activations
from ndplan.memory.options import MemoryOptions
from ndplan.model import count_parameters, get_preset
from ndplan.model.hf import spec_from_hf_config
from ndplan.model.params import attention_params, linear_attention_params, mixer_params
from ndplan.perf.flops import (
    Sharding,
    attention_gemms,
    attention_pairs,
    causal_pairs,
    linear_core_flops,
    model_flops_per_micro_batch,
)
from ndplan.strategy import Strategy
from ndplan.strategy.batch import StrategyBatch

needs_torch = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")),
    reason="needs the census extra (torch, transformers)",
)

# h 64; softmax attention 4 query and 2 KV heads of 32; Gated DeltaNet 2 key heads of 16, 4 value heads of 24.
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_hidden_layers": 4}
TINY_NEXT = {**TINY, "model_type": "qwen3_next", "intermediate_size": 96, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2}
TINY_DENSE = {**TINY, "model_type": "qwen3_5_text", "intermediate_size": 96}


def test_counts_against_the_model_cards():
    """Model cards, rounded: Qwen3-Next 80B total, 3B activated (without embedding and head);
    Qwen3.5 397B-A17B, 122B-A10B, 35B-A3B, 27B, their language models without the vision tower
    (about 0.4B) the cards count."""
    nxt = count_parameters(get_preset("qwen3-next-80b-a3b"))
    assert round(nxt.total / 1e9) == 80 and round((nxt.active - nxt.embedding - nxt.output_head) / 1e9) == 3
    for name, total, active in (("qwen3.5-397b-a17b", 397, 17), ("qwen3.5-122b-a10b", 122, 10),
                                ("qwen3.5-35b-a3b", 35, 3), ("qwen3.5-27b", 27, 27)):
        counts = count_parameters(get_preset(name))
        assert abs(counts.total / 1e9 - total) < 1, name  # (the vision tower: about 0.4B)
        assert round(counts.active / 1e9) == active, name


def test_reader_lays_out_the_layers():
    """Without layer_types every full_attention_interval-th layer attends in full (4 by default);
    the full layers' q_proj carries the output gate."""
    spec = spec_from_hf_config({k: v for k, v in TINY_NEXT.items() if k != "layer_types"} | {"num_hidden_layers": 8},
                               name="t")
    assert spec.layer_attention_spans == ("linear", "linear", "linear", "full") * 2
    assert spec.attention_output_gate and spec.qk_norm and spec.linear_share() == 0.75
    assert spec.layer_mlp_kinds == ("moe",) * 8


def test_mixer_parameters_by_hand():
    """A Gated DeltaNet block of h 64, Kd = 2 x 16, Vd = 4 x 24, Hv 4, 4 taps: projections
    64 x (2·32 + 2·96 + 2·4), convolution (2·32 + 96) x 4, dt_bias and A_log 4 each, the gated
    norm 24, out_proj 96 x 64. The gated softmax block: q_proj 64 x 2·128, k, v 64 x 64 each,
    o 128 x 64, q/k norms 32 each."""
    spec = spec_from_hf_config(TINY_NEXT, name="t")
    linear = 64 * (64 + 192 + 8) + 160 * 4 + 8 + 24 + 96 * 64
    assert linear_attention_params(spec) == linear == 23_712
    assert attention_params(spec) == 64 * 256 + 2 * 64 * 64 + 128 * 64 + 64 == 32_832
    assert mixer_params(spec, "moe") == (3 * linear + 32_832) / 4
    counts = count_parameters(spec)
    assert counts.attention == 3 * linear + 32_832


def test_core_flops_by_hand():
    """flash-linear-attention's chunked delta rule, per token and value head at dk = dv = 128:
    182,752 FLOPs forward and 524,288 backward; a device holds its TP share of the value heads,
    and a layer of the kind is the mean (3 of 4 layers here)."""
    spec = get_preset("qwen3-next-80b-a3b")
    forward, backward = linear_core_flops(spec, Sharding(1, 4096))
    assert forward == 0.75 * 4096 * 32 * 182_752 and backward == 0.75 * 4096 * 32 * 524_288
    assert linear_core_flops(spec, Sharding(1, 4096, tp=2))[0] == forward / 2
    # no softmax pair on a Gated DeltaNet layer
    assert attention_pairs(spec, 4096) == causal_pairs(4096) / 4


def test_mixer_gemms_by_hand():
    """A kind's layer runs a Gated DeltaNet's projections on 3 of 4 layers and the gated softmax
    block's on the fourth: each GEMM counted with its share."""
    spec = get_preset("qwen3-next-80b-a3b")
    gemms = {g.name: g for g in attention_gemms(spec, Sharding(1, 4096), "moe")}
    assert gemms["qkv_proj"].n == (2 * 16 + 2 * 2) * 256 and gemms["qkv_proj"].count == 0.25
    assert gemms["linear_in_proj"].n == 2 * 2048 + 2 * 4096 + 2 * 32 and gemms["linear_in_proj"].count == 0.75
    full = {g.name for g in attention_gemms(spec, Sharding(1, 4096), "moe", full_attention=True)}
    assert full == {"qkv_proj", "o_proj"}


def test_model_flops_count_each_layer_once():
    """The forward matmul FLOPs of one token are 2 x the weights its GEMMs multiply: every
    parameter of the active model but the embedding, the norms (q/k norms, the gated norm), the
    convolution and the per-head dt_bias and A_log."""
    spec = get_preset("qwen3-next-80b-a3b")
    counts = count_parameters(spec)
    linear_layers = 36
    kv = spec.linear_key_width
    not_multiplied = (counts.embedding + counts.norms + counts.final_norm
                      + linear_layers * ((2 * kv + spec.linear_value_width) * 4 + 2 * 32 + 128)
                      + 12 * 2 * 256)  # the full layers' q/k norms
    flops = model_flops_per_micro_batch(spec, 1, 1)
    assert flops.matmul_forward == pytest.approx(2 * (counts.active - not_multiplied), rel=1e-12)


def _activations(spec, recompute="none", tp=1, census=(), runtime="pytorch"):
    strategy = Strategy(tp=tp, dp=1, pp=1, seq_length=64, micro_batch_size=1, global_batch_size=1, recompute=recompute)
    options = MemoryOptions(runtime=runtime, include_overhead=False, attention="sdpa", census=tuple(census),
                            **({"selective_policy": "keep-matmuls"} if runtime == "pytorch" else {}))
    acts = layer_activations(spec, StrategyBatch.of(strategy), options)
    kind = "moe" if spec.is_moe else "dense"
    return float((acts.full if recompute == "none" else acts.recomputed)[kind][0])


def test_gated_deltanet_bytes_by_hand():
    """What one Gated DeltaNet block keeps a token (bf16, h 64, Kd 32, Vd 96, Hk 2, Hv 4), read in
    transformers' code with flash-linear-attention and causal-conv1d: the input 2h, the
    convolution's input 2(2Kd + Vd), the normed q and k 4Kd and their fp32 inverse norms 8Hk, v's
    copy 2Vd, beta 2Hv, the decay's softplus input, output and cumsum 12Hv, the chunks' inverses
    2·64·Hv, the gated norm's fp32 input, gate and SiLU 12Vd, its statistic 4Hv, its normalised
    and weighted bf16 copies and out_proj's input 6Vd. Selective recompute keeps the input and the
    projections' outputs: 2h + 2(2Kd + Vd) + 2Vd + 4Hv."""
    h, kd, vd, hk, hv = 64, 32, 96, 2, 4
    block = 2 * h + 2 * (2 * kd + vd) + 4 * kd + 8 * hk + 2 * vd + 2 * hv + 12 * hv + 128 * hv + 12 * vd + 4 * hv + 6 * vd
    kept = 2 * h + 2 * (2 * kd + vd) + 2 * vd + 4 * hv
    spec = spec_from_hf_config({**TINY_DENSE, "layer_types": ["linear_attention"], "num_hidden_layers": 1}, name="t")
    for recompute, expected in (("none", block), ("selective", kept)):
        strategy = Strategy(dp=1, seq_length=64, micro_batch_size=1, global_batch_size=1, recompute=recompute)
        acts = layer_activations(spec, StrategyBatch.of(strategy), MemoryOptions(
            runtime="pytorch", include_overhead=False, attention="sdpa", selective_policy="keep-matmuls"))
        blocks = acts.dense_blocks if recompute == "none" else acts.dense_recomputed_blocks
        assert float(blocks["attention"][0]) == expected == (3096 if recompute == "none" else 656)


@needs_torch
@pytest.mark.parametrize("config", [TINY_NEXT, TINY_DENSE], ids=["qwen3_next", "qwen3_5_text"])
def test_formulas_equal_the_census(config):
    """The census measures the Gated DeltaNet layers apart ('<kind>-linear'), with the kernels'
    stand-ins, and the softmax layers with their output gate; weighed by layer counts the records
    price what the formulas do, at TP 1 and 2, without recompute, selective and full."""
    from ndplan.census.measure import run_census

    spec = spec_from_hf_config(config, name="tiny")
    records = run_census(config, seq_length=64, name="tiny")
    kinds = [r.layer_kind for r in records]
    assert kinds == (["moe-linear", "moe", "output"] if spec.is_moe else ["dense-linear", "dense", "output"])
    assert "kept what flash-linear-attention 0.6's kernel keeps" in records[0].notes
    assert "flash-linear-attention" not in records[1].notes  # the softmax layers ran no stand-in
    for tp in (1, 2):
        for recompute in ("none", "selective", "full"):
            assert _activations(spec, recompute, tp, records) == _activations(spec, recompute, tp), (tp, recompute)


def test_megatron_gated_deltanet_bytes_by_hand():
    """What Megatron-Core's GatedDeltaNet keeps a token (bf16, h 64, Kd 32, Vd 96, Hk 2, Hv 4, two
    value heads a key head), read in its code with fla and causal-conv1d: in_proj's normed input
    2h, the convolution's contiguous input 2(2Kd + Vd), l2norm's normed q and k 4Kd and their fp32
    inverse norms 8Hk, the kernel's q and k repeated to every value head 2·2·2Kd, v's copy 2Vd,
    beta 2Hv, the decay's softplus input, output and cumsum 12Hv, the chunks' inverses 2·64·Hv, the
    output norm's input 2Vd and fp32 statistic 4Hv, the compiled gating's inputs (the norm's output
    and the gate's copy) 4Vd, out_proj's input 2Vd. Megatron checkpoints no part of the layer, so
    its default selective recompute keeps it all; under SP the normed input divides by TP too."""
    h, kd, vd, hk, hv = 64, 32, 96, 2, 4
    block = (2 * h + 2 * (2 * kd + vd) + 4 * kd + 8 * hk + 8 * kd + 2 * vd + 2 * hv + 12 * hv + 128 * hv
             + 2 * vd + 4 * hv + 4 * vd + 2 * vd)
    spec = spec_from_hf_config({**TINY_DENSE, "layer_types": ["linear_attention"], "num_hidden_layers": 1}, name="t")
    for tp, sp, expected in ((1, False, block), (2, False, 2 * h + (block - 2 * h) / 2), (2, True, block / 2)):
        for recompute in ("none", "selective"):
            strategy = Strategy(dp=1, tp=tp, sequence_parallel=sp, seq_length=64, micro_batch_size=1,
                                global_batch_size=1, recompute=recompute)
            acts = layer_activations(spec, StrategyBatch.of(strategy), MemoryOptions(runtime="megatron",
                                                                                    include_overhead=False))
            blocks = acts.dense_blocks if recompute == "none" else acts.dense_recomputed_blocks
            assert float(blocks["attention"][0]) == expected, (tp, sp, recompute)
    assert block == 2392
    # one value head a key head: the kernel is given l2norm's own outputs, no repeated copy
    even = spec_from_hf_config({**TINY_DENSE, "linear_num_value_heads": 2, "layer_types": ["linear_attention"],
                                "num_hidden_layers": 1}, name="even")
    strategy = Strategy(dp=1, seq_length=64, micro_batch_size=1, global_batch_size=1)
    acts = layer_activations(even, StrategyBatch.of(strategy), MemoryOptions(runtime="megatron", include_overhead=False))
    vd, hv = 48, 2
    assert float(acts.dense_blocks["attention"][0]) == (2 * h + 2 * (2 * kd + vd) + 4 * kd + 8 * hk + 2 * vd + 2 * hv
                                                         + 12 * hv + 128 * hv + 2 * vd + 4 * hv + 4 * vd + 2 * vd)


def test_a_profile_without_the_block_refuses(tmp_path):
    """A runtime profile of the user's own that does not say what Gated DeltaNet layers keep."""
    import yaml

    import ndplan.memory

    data = yaml.safe_load((Path(ndplan.memory.__file__).parent / "profiles" / "megatron.yaml").read_text())
    del data["blocks"]["linear_attention"]
    data["name"] = "mine"
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(NdplanError, match="has Gated DeltaNet layers, and runtime 'mine' does not say what they keep"):
        _activations(get_preset("qwen3-next-80b-a3b"), runtime=str(path))


def test_megatron_gated_deltanet_says_it_is_read_from_code():
    from ndplan.memory.report import known_gaps

    spec = get_preset("qwen3-next-80b-a3b")
    strategy = Strategy(dp=8, ep=8, seq_length=4096, micro_batch_size=1, global_batch_size=64)
    said = [g for g in known_gaps(strategy, MemoryOptions(runtime="megatron"), spec) if "priced from its code" in g]
    assert said == ["Megatron-Core's Gated DeltaNet layers (what gated_delta_net.py, fla's l2norm and chunked delta "
                    "rule and causal-conv1d keep) and attention output gate (attention.py) and shared-expert gate "
                    "(moe/shared_experts.py) are priced from its code, not yet checked against a measured run (the "
                    "pytorch runtime's are, by the census)"]
    assert not [g for g in known_gaps(strategy, MemoryOptions(runtime="megatron"), get_preset("qwen3-30b-a3b"))
                if "priced from its code" in g]
    assert not [g for g in known_gaps(strategy, MemoryOptions(runtime="pytorch"), spec) if "priced from its code" in g]


def test_step_time_prices_the_core_at_its_measured_rate():
    """On an H200 fla's chunked delta rule ran at 0.10 of the bf16 peak over the FLOPs it executes
    (ndplan.perf.efficiency). Qwen3.5-27B's 48 Gated DeltaNet layers of 48 value heads, one
    sequence of 32,768 tokens on one device: doubling that rate takes half their core time off
    the step, 48 x T x 48 x (182,752 + 524,288) FLOPs / (989 TFLOP/s x 0.1) / 2."""
    from ndplan.perf import estimate_time
    from ndplan.perf.efficiency import default_efficiency

    spec = get_preset("qwen3.5-27b")
    strategy = Strategy(dp=1, seq_length=32768, micro_batch_size=1, global_batch_size=1)
    h200 = get_device("h200")
    base = default_efficiency(h200)
    assert base.linear_attention_efficiency == 0.1
    slow = estimate_time(spec, strategy, h200, efficiency=base).step_s
    fast = estimate_time(spec, strategy, h200, efficiency=base.replace(linear_attention_efficiency=0.2)).step_s
    core = 48 * 32768 * 48 * (182_752 + 524_288) / (h200.peak_flops_for("bf16") * 0.1)
    assert slow - fast == pytest.approx(core / 2, rel=1e-9)


def test_stages_off_the_models_mix_are_named():
    """Every stage is priced at the model's mix (3 of 4 layers Gated DeltaNet): exact for stages
    of whole groups of four (pp 4: 12 layers each), said where a stage holds another share."""
    from ndplan.memory.report import known_gaps

    spec = get_preset("qwen3-next-80b-a3b")
    options = MemoryOptions(runtime="pytorch")

    def gaps(pp: int) -> list[str]:
        strategy = Strategy(dp=8, ep=8, pp=pp, seq_length=4096, micro_batch_size=1, global_batch_size=64)
        return [g for g in known_gaps(strategy, options, spec) if "Gated DeltaNet" in g]

    assert gaps(4) == []
    (gap,) = gaps(8)
    assert "(36 of 48 Gated DeltaNet), not per stage: stage 0 holds 5 of 6, stage 1 holds 4 of 6" in gap


def test_step_time_says_its_gated_deltanet_rate_is_unchecked():
    from ndplan.perf.gaps import time_known_gaps

    spec = get_preset("qwen3.5-27b")
    (gap,) = time_known_gaps(spec, Strategy(dp=8, seq_length=4096, micro_batch_size=1, global_batch_size=8), "pytorch")
    assert "no published training run of a Gated DeltaNet model" in gap and "value heads a device" not in gap
    (gap,) = time_known_gaps(spec, Strategy(dp=2, tp=4, seq_length=4096, micro_batch_size=1, global_batch_size=2),
                             "pytorch")
    assert "with 12 value heads a device (tp=4) expect it slower" in gap


def test_megatron_gates_by_hand():
    """Under Megatron-Core the output gate adds the gate's bf16 copy and the gated output (2·2·o
    bytes a token, head-sharded by TP), the shared-expert gate its sigmoid output and the shared
    experts' output it multiplies (2·(1 + h), sequence-sharded under SP); a recompute of the shared
    experts (or the MoE layer) rebuilds both, the attention core's recompute neither."""
    spec = spec_from_hf_config({**TINY_NEXT, "layer_types": ["full_attention"], "num_hidden_layers": 1}, name="t")
    assert spec.attention_output_gate and spec.shared_expert_gate
    plain = spec.model_copy(update={"attention_output_gate": False, "shared_expert_gate": False})
    h, o = 64, 4 * 32
    for tp, sp in ((1, False), (2, False), (2, True)):
        for recompute, modules, shared_kept in (("none", (), 1), ("selective", (), 1),
                                                ("selective", ("shared_experts",), 0)):
            strategy = Strategy(dp=1, tp=tp, sequence_parallel=sp, seq_length=64, micro_batch_size=1,
                                global_batch_size=1, recompute=recompute, recompute_modules=modules)
            options = MemoryOptions(runtime="megatron", include_overhead=False)
            blocks = {}
            for name, model in (("gated", spec), ("plain", plain)):
                acts = layer_activations(model, StrategyBatch.of(strategy), options)
                blocks[name] = acts.moe_blocks if recompute == "none" else acts.moe_recomputed_blocks
            attention = float(blocks["gated"]["attention"][0] - blocks["plain"]["attention"][0])
            moe = float(blocks["gated"]["moe"][0] - blocks["plain"]["moe"][0])
            assert attention == 2 * 2 * o / tp, (tp, sp, recompute, modules)
            assert moe == shared_kept * 2 * (1 + h) / (tp if sp else 1), (tp, sp, recompute, modules)
