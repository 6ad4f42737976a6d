"""Sliding-window attention: read from HF configs as transformers builds the layers, and priced
in FLOPs and time (memory does not change: FlashAttention keeps no scores, eager ones the full square)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.model import get_preset, spec_from_hf_config
from ndplan.perf import estimate_time
from ndplan.perf.flops import (
    Sharding,
    attention_core_flops,
    attention_pairs,
    causal_pairs,
    model_flops_per_micro_batch,
)
from ndplan.strategy import Strategy

QWEN2 = {
    "model_type": "qwen2", "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
}


def full_attention(model):
    return model.model_copy(update={"sliding_window": 0, "layer_attention_spans": ("full",) * model.num_layers})


def test_windowed_pairs_count_min_of_position_and_window():
    # s = 8, w = 3: queries keep 1, 2, 3, 3, 3, 3, 3, 3 keys.
    assert causal_pairs(8, 3) == 21 == sum(min(i + 1, 3) for i in range(8))
    assert causal_pairs(4096, 4096) == causal_pairs(4096) and causal_pairs(100, 4096) == causal_pairs(100)
    np.testing.assert_array_equal(causal_pairs(np.array([2.0, 8.0]), 3), [3.0, 21.0])


def test_mistral_slides_every_layer_and_qwen2_only_with_use_sliding_window():
    mistral = get_preset("mistral-7b")
    assert mistral.sliding_window == 4096 and set(mistral.layer_attention_spans) == {"sliding"}
    assert spec_from_hf_config(QWEN2, name="q").layer_attention_spans == ("full",) * 6
    # transformers' Qwen2: layers from max_window_layers on slide, with the window's default 4096.
    qwen = spec_from_hf_config({**QWEN2, "use_sliding_window": True, "max_window_layers": 4}, name="q")
    assert qwen.sliding_window == 4096 and qwen.layer_attention_spans == ("full",) * 4 + ("sliding",) * 2
    # layer_types, where given, say it layer by layer.
    types = ["sliding_attention", "full_attention"] * 3
    qwen = spec_from_hf_config({**QWEN2, "use_sliding_window": True, "sliding_window": 512, "layer_types": types},
                               name="q")
    assert qwen.sliding_window == 512 and qwen.layer_attention_spans == ("sliding", "full") * 3


def test_qwen2_moe_slides_every_other_layer_below_max_window_layers():
    config = {**QWEN2, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "use_sliding_window": True, "sliding_window": 256, "max_window_layers": 4}
    spans = spec_from_hf_config(config, name="m").layer_attention_spans
    assert spans == ("sliding", "full", "sliding", "full", "full", "full")


@pytest.mark.parametrize("field,value,message", [
    ("layer_types", ["full_attention"] * 5, "field 'layer_types' must list 6 entries"),
    ("layer_types", ["global"] * 6, "each one of full_attention, sliding_attention"),
    ("sliding_window", -4, "field 'sliding_window' must be a positive integer or null"),
])
def test_bad_window_fields_are_named(field, value, message):
    config = {**QWEN2, "use_sliding_window": True, field: value}
    with pytest.raises(NdplanError, match=message):
        spec_from_hf_config(config, name="q")


def test_a_spec_with_sliding_layers_needs_a_window():
    mistral = get_preset("mistral-7b")
    with pytest.raises(ValueError, match="sliding_window=0"):
        type(mistral)(**{**mistral.model_dump(), "sliding_window": 0})


def test_mistral_attention_flops_follow_the_window_beyond_it():
    mistral = get_preset("mistral-7b")
    full = full_attention(mistral)
    short, long = Sharding(1, 4096), Sharding(1, 16384)
    assert attention_core_flops(mistral, short) == attention_core_flops(full, short)
    # 2·b·a·(d_qk + d_v)·pairs per layer: 32 heads of 128, w = 4096 keys of 16384.
    pairs = 4096 * 4097 / 2 + (16384 - 4096) * 4096
    assert attention_core_flops(mistral, long) == pytest.approx(2 * 32 * 256 * pairs)
    assert attention_core_flops(mistral, long) / attention_core_flops(full, long) == pytest.approx(pairs / (16384 * 16385 / 2))
    flops, flops_full = model_flops_per_micro_batch(mistral, 1, 16384), model_flops_per_micro_batch(full, 1, 16384)
    assert flops.matmul_forward == flops_full.matmul_forward
    assert flops.attention_forward == pytest.approx(32 * 2 * 32 * 256 * pairs)
    # The unfused kernel computes the whole square, window or not.
    assert attention_core_flops(mistral, long, causal=False) == attention_core_flops(full, long, causal=False)


def test_a_mixed_model_prices_the_mean_of_its_layers():
    qwen = spec_from_hf_config({**QWEN2, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4},
                               name="q")
    assert attention_pairs(qwen, 32) == pytest.approx((4 * causal_pairs(32) + 2 * causal_pairs(32, 8)) / 6)


def test_the_window_shortens_the_step_of_long_sequences_only():
    mistral = get_preset("mistral-7b")
    device = get_device("h100-sxm")
    long = Strategy(dp=8, seq_length=32768, num_micro_batches=4, recompute="selective")
    windowed, full = estimate_time(mistral, long, device), estimate_time(full_attention(mistral), long, device)
    assert windowed.step_s < 0.75 * full.step_s and windowed.model_flops < full.model_flops
    short = long.model_copy(update={"seq_length": 4096})
    assert estimate_time(mistral, short, device).step_s == estimate_time(full_attention(mistral), short, device).step_s


def test_a_window_given_to_sdpa_as_a_mask_computes_the_whole_square():
    """transformers' SDPA hands the window to the memory-efficient kernel as a mask from seq >=
    window on: every (query, key) pair is computed, so the step is slower than a kernel that
    skips outside the window (FlashAttention), and slower than full causal attention."""
    from ndplan.memory import MemoryOptions

    qwen = spec_from_hf_config({**QWEN2, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4},
                               name="q")
    assert attention_pairs(qwen, 32, masked_window=True) == pytest.approx((4 * causal_pairs(32) + 2 * 32 * 32) / 6)
    assert attention_pairs(qwen, 6, masked_window=True) == attention_pairs(qwen, 6)  # below the window: no mask
    mistral, device = get_preset("mistral-7b"), get_device("h100-sxm")
    long = Strategy(dp=8, seq_length=32768, num_micro_batches=4, recompute="selective")
    flash = estimate_time(mistral, long, device, options=MemoryOptions(attention="flash"))
    sdpa = estimate_time(mistral, long, device, options=MemoryOptions(attention="sdpa"))
    causal = estimate_time(full_attention(mistral), long, device, options=MemoryOptions(attention="sdpa"))
    assert flash.step_s < causal.step_s < sdpa.step_s
    assert sdpa.model_flops == flash.model_flops  # the model's FLOPs are the window's either way
    # Megatron runs no transformers SDPA: the option prices nothing different there, in time as in memory
    megatron = {a: estimate_time(mistral, long, device, options=MemoryOptions(runtime="megatron", attention=a))
                for a in ("flash", "sdpa")}
    assert megatron["sdpa"].step_s == megatron["flash"].step_s


def test_the_masked_square_runs_at_the_masked_kernel_efficiency():
    """Only the sliding layers' masked squares run at ``masked_attention_efficiency`` (0.31 on
    Hopper, measured): unset, they run at the causal kernel's; a flash window, or a sequence
    below the window, does not read it."""
    from ndplan.perf import default_efficiency
    from ndplan.perf.flops import masked_pairs

    mistral, device = get_preset("mistral-7b"), get_device("h100-sxm")
    hopper = default_efficiency(device)
    assert hopper.masked_attention_efficiency == 0.31
    masked = {"window_kernel": False}

    def seconds(seq: int, software: dict, **figures: float) -> float:
        strategy = Strategy(dp=8, seq_length=seq)
        eff = hopper.replace(**figures) if figures else hopper
        return estimate_time(mistral, strategy, device, efficiency=eff, software=software).step_s

    unset = seconds(8192, masked, masked_attention_efficiency=None)
    assert seconds(8192, masked) > unset == seconds(8192, masked, masked_attention_efficiency=hopper.attention_efficiency)
    assert seconds(8192, {}) == seconds(8192, {}, masked_attention_efficiency=0.9)  # flash skips the mask
    assert seconds(2048, masked) == seconds(2048, masked, masked_attention_efficiency=0.9)  # below the window
    # every Mistral layer slides: the whole square from the window on, nothing below it
    assert masked_pairs(mistral, 8192) == 8192**2 and masked_pairs(mistral, 2048) == 0


def test_preset_configs_carry_their_window_fields():
    """The shipped Mistral config states its window; the Qwen ones switch it off."""
    from importlib.resources import files

    presets = files("ndplan.model") / "presets"
    assert json.loads((presets / "mistral-7b.json").read_text())["sliding_window"] == 4096
    assert json.loads((presets / "qwen2.5-7b.json").read_text())["use_sliding_window"] is False


def test_a_spec_with_a_window_and_no_pattern_slides_every_layer(tmp_path):
    from ndplan.model import load_model

    spec = tmp_path / "mine.yaml"
    spec.write_text("num_layers: 4\nhidden_size: 64\nffn_hidden_size: 96\nnum_attention_heads: 4\nnum_kv_heads: 2\n"
                    "head_dim: 16\nvocab_size: 100\nsliding_window: 512\n")
    assert load_model(str(spec)).layer_attention_spans == ("sliding",) * 4


def test_layer_types_of_the_wrong_type_are_named():
    config = {**QWEN2, "use_sliding_window": True, "layer_types": [["sliding_attention"]] * 6}
    with pytest.raises(NdplanError, match="field 'layer_types' must list 6 entries"):
        spec_from_hf_config(config, name="q")


def test_mtp_modules_attend_in_full_in_time_as_in_flops():
    """An MTP module's layer attends in full (FLOPs said so; its time took the sliding mean)."""
    from ndplan.balance.build import piece_seconds
    from ndplan.hardware import Cluster
    from ndplan.strategy import StrategyBatch

    base = get_preset("qwen3-8b").model_copy(update={"mtp_depth": 1})
    windowed = base.model_copy(update={"sliding_window": 512, "layer_attention_spans": ("sliding",) * base.num_layers})
    batch = StrategyBatch.of(Strategy(dp=8, seq_length=32768, num_micro_batches=4))
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=8)
    full_head = piece_seconds(base, batch, cluster)["head"]
    windowed_pieces = piece_seconds(windowed, batch, cluster)
    np.testing.assert_allclose(windowed_pieces["head"], full_head, rtol=1e-12)
    assert windowed_pieces["dense"][0] < 0.8 * piece_seconds(base, batch, cluster)["dense"][0]


def test_a_measured_model_cut_to_fewer_layers_keeps_its_pattern():
    from ndplan.census.measure_step import trimmed_spec

    cut = trimmed_spec(get_preset("gpt-oss-20b"), 4)
    assert cut.layer_attention_spans == ("sliding", "full") * 2
    assert type(cut).model_validate(cut.model_dump()) == cut


def test_sdpa_repeats_kv_heads_only_where_a_rank_holds_more_than_one():
    """Past the window transformers' SDPA gets a mask and repeats K and V to every query head;
    with one KV head on a rank (Mistral's 8 at TP 8, Gemma 3 1B's one anywhere) repeat_kv's
    reshape is a view and only the mask's bias is kept: seq · 2 bytes a token where Mistral at
    TP 4 keeps (q - k + o - v) · 2 / 4 more."""
    from ndplan.memory import MemoryOptions
    from ndplan.memory.activations import layer_activations
    from ndplan.strategy import StrategyBatch

    mistral = get_preset("mistral-7b")
    options = MemoryOptions(runtime="pytorch", include_overhead=False, attention="sdpa")
    flash = MemoryOptions(runtime="pytorch", include_overhead=False)
    extra = {}
    for tp in (4, 8):
        batch = StrategyBatch.of(Strategy(seq_length=8192, tp=tp))
        extra[tp] = (layer_activations(mistral, batch, options).full["dense"][0]
                     - layer_activations(mistral, batch, flash).full["dense"][0])
    repeated = 2 * (32 - 8) * 128 * 2  # (q - k) + (o - v): 24 heads of 128 each, bf16
    assert extra[8] == 8192 * 2
    assert extra[4] == 8192 * 2 + repeated / 4
