"""Soft-capped attention scores and logits (Gemma 2): what they keep, what they cost, where they
cannot run; held to the census of a tiny Gemma 2 (eager attention, transformers' default for it)."""

from __future__ import annotations

import importlib.util

import pytest

from ndplan.errors import NdplanError
from ndplan.memory.activations import layer_activations
from ndplan.memory.options import MemoryOptions
from ndplan.model import get_preset
from ndplan.model.hf import spec_from_hf_config
from ndplan.strategy import Strategy
from ndplan.strategy.batch import StrategyBatch

needs_torch = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")),
    reason="needs the census extra (torch, transformers)",
)

# h 64, 4 query and 2 KV heads of 16, a window of 32 keys on every other layer, scores capped at
# 50 and logits at 30 (Gemma2Config's defaults)
TINY_GEMMA2 = {"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 128,
               "sliding_window": 32}


def _acts(spec, recompute="none", tp=1, seq=64, attention="eager", census=(), runtime="pytorch"):
    strategy = Strategy(tp=tp, dp=1, seq_length=seq, micro_batch_size=1, global_batch_size=1, recompute=recompute)
    options = MemoryOptions(runtime=runtime, include_overhead=False, attention=attention, census=tuple(census),
                            loss_parallel=True, **({"selective_policy": "keep-matmuls"} if runtime == "pytorch" else {}))
    return layer_activations(spec, StrategyBatch.of(strategy), options)


def test_reader_takes_gemma_2s_caps_and_windows():
    spec = spec_from_hf_config(TINY_GEMMA2, name="t")
    assert (spec.attention_softcap, spec.final_softcap) == (50.0, 30.0)
    assert spec.layer_attention_spans == ("sliding", "full") and spec.norm_placement == "sandwich" and not spec.qk_norm
    off = spec_from_hf_config({**TINY_GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None}, name="t")
    assert (off.attention_softcap, off.final_softcap) == (0.0, 0.0)


def test_capped_bytes_by_hand():
    """tanh keeps its output: the logits' (2·V bytes a token, bf16, vocabulary-parallel) and,
    under eager attention, the scores' (2·heads·s, split by TP)."""
    capped = spec_from_hf_config(TINY_GEMMA2, name="t")
    plain = spec_from_hf_config({**TINY_GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None},
                                name="t")
    for tp in (1, 2):
        a, b = _acts(capped, tp=tp), _acts(plain, tp=tp)
        assert float(a.output[0] - b.output[0]) == 2 * 128 / tp
        assert float(a.full["dense"][0] - b.full["dense"][0]) == 2 * 4 * 64 / tp


@needs_torch
def test_formulas_equal_the_census():
    """A tiny Gemma 2 measured with eager attention at 64 tokens (past its window) and at 16: its
    layers and output price as measured, at TP 1 and 2, with no, selective and full recompute
    (eager's repeated K and V, its QK^T kept under selective recompute and no log-sum-exp
    included; the output's within the 1/s bytes of its padded labels)."""
    from ndplan.census.measure import run_census

    spec = spec_from_hf_config(TINY_GEMMA2, name="g2")
    for seq in (16, 64):
        records = run_census(TINY_GEMMA2, seq_length=seq, attention="eager", name="g2")
        for tp in (1, 2):
            for recompute in ("none", "selective", "full"):
                priced, measured = (_acts(spec, recompute, tp, seq, census=census) for census in ((), records))
                figure = "full" if recompute == "none" else "recomputed"
                assert getattr(priced, figure)["dense"][0] == getattr(measured, figure)["dense"][0], (seq, tp, recompute)
                assert measured.output[0] - priced.output[0] == pytest.approx(8 / seq, abs=1e-9)


def test_where_caps_cannot_run():
    spec = get_preset("gemma-2-9b")
    with pytest.raises(NdplanError, match="soft-caps its attention scores, which transformers' SDPA path cannot do"):
        _acts(spec, attention="sdpa")
    with pytest.raises(NdplanError, match="which Megatron-Core's layers do not: price it under runtime 'pytorch'"):
        _acts(spec, attention="flash", runtime="megatron")


def test_capped_logits_cost_three_passes():
    """Soft-capping the logits adds a division, tanh and product (each reading and writing a
    bf16 element: 12 bytes a logit) to the loss's forward and again to its backward, at the
    runtime's loss passes over HBM: Gemma 2 2B, one sequence of 8,192 tokens on one H100."""
    from ndplan.hardware import get_device
    from ndplan.perf import estimate_time
    from ndplan.perf.efficiency import default_efficiency

    spec = get_preset("gemma-2-2b")
    h100 = get_device("h100-sxm")
    eff = default_efficiency(h100)
    strategy = Strategy(dp=1, seq_length=8192, micro_batch_size=1, global_batch_size=1)
    capped = estimate_time(spec, strategy, h100, efficiency=eff).step_s
    plain = estimate_time(spec.model_copy(update={"final_softcap": 0.0}), strategy, h100, efficiency=eff).step_s
    passes = eff.figure("loss_elementwise_passes")
    rate = h100.hbm_bandwidth_bytes_per_s * eff.hbm_efficiency
    assert capped - plain == pytest.approx(2 * passes * 12 * 8192 * 256_000 / rate, rel=1e-9)
