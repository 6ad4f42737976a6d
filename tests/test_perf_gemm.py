"""GEMM seconds per pass: the roofline with each pass's own bytes, derived by hand."""

from __future__ import annotations

import pytest

from ndplan.perf.flops import Gemm
from ndplan.perf.gemm import ComputeRates, depth_factor, gemm_bytes, gemm_seconds, reduction_depth

# 1 PFLOP/s peak at 0.75, knee 256, grouped factor 0.9, 2.6 TB/s HBM, bf16 operands, fp32
# gradient accumulation (read 4 + write 4 bytes per weight), no per-expert latency.
RATES = ComputeRates(1e15, 0.75, 256.0, 0.9, 5e14, 2.6e12, 2.0, expert_latency=0.0, wgrad_accum_bytes=8.0)

# The brief's fine-grained case: a 4096-token micro-batch, top-8 of 128 experts -> 256 tokens
# per expert, 16 local experts of a 2048 -> 768 projection.
SMALL = Gemm("experts_down_like", 256.0, 768.0, 2048.0, count=16.0, expert=True)


def test_bytes_of_each_pass():
    # F: read X (256·2048) and W (2048·768) in bf16, write Y (256·768) in bf16
    assert gemm_bytes(SMALL, RATES, "F") == 16 * (2 * (256 * 2048 + 2048 * 768) + 2 * 256 * 768) == 73_400_320
    # B: read dY (256·768) and W, write dX (256·2048)
    assert gemm_bytes(SMALL, RATES, "B") == 16 * (2 * (256 * 768 + 2048 * 768) + 2 * 256 * 2048) == 73_400_320
    # W: read X and dY, read-modify-write the fp32 weight gradient (2048·768 · 8 bytes)
    assert gemm_bytes(SMALL, RATES, "W") == 16 * (2 * (256 * 2048 + 256 * 768) + 8 * 2048 * 768) == 224_395_264
    # fp8 operands: the two reads halve, the bf16 output does not
    fp8 = ComputeRates(2e15, 0.5, 256.0, 0.9, 5e14, 2.6e12, 1.0)
    assert gemm_bytes(SMALL, fp8, "F") == 16 * ((256 * 2048 + 2048 * 768) + 2 * 256 * 768)
    assert gemm_bytes(SMALL, fp8, "B") == 16 * ((256 * 768 + 2048 * 768) + 2 * 256 * 2048)


def test_few_tokens_per_expert_make_the_weight_gradient_memory_bound():
    # compute: 2·256·768·2048·16 FLOP at 1e15 · 0.75 · min(1, 256/256) · 0.9 = 19.09 us
    compute = 2 * 256 * 768 * 2048 * 16 / (1e15 * 0.75 * 0.9)
    assert compute == pytest.approx(19.09e-6, rel=1e-3)
    # all three passes are memory-bound at 2.6 TB/s; W moves 3.06x the bytes of F
    assert gemm_seconds(SMALL, RATES, "F") == pytest.approx(73_400_320 / 2.6e12, rel=1e-12)
    assert gemm_seconds(SMALL, RATES, "W") == pytest.approx(224_395_264 / 2.6e12, rel=1e-12)
    assert gemm_seconds(SMALL, RATES, "W") / gemm_seconds(SMALL, RATES, "F") == pytest.approx(3.057, rel=1e-3)


def test_a_large_gemm_is_compute_bound_in_every_pass():
    big = Gemm("mlp_up", 8192.0, 8192.0, 8192.0)
    compute = 2 * 8192**3 / (1e15 * 0.75)  # 1.466 ms; W's 805 MB take 0.31 ms
    assert gemm_bytes(big, RATES, "W") / 2.6e12 < 0.25 * compute
    for pass_ in ("F", "B", "W"):
        assert gemm_seconds(big, RATES, pass_) == pytest.approx(compute, rel=1e-12)


def test_reduction_depth_slows_shallow_passes_by_hand():
    # Qwen3-30B-like expert on an FP8 Hopper: 4096 tokens per expert, h = 2048, f_e = 768.
    # F (X·W) sums over k = 768, B (dY·Wᵀ) over n = 2048, W (Xᵀ·dY) over m = 4096 tokens.
    # depth factor = min(1, R/(R + 720) · (8192 + 720)/8192), the quoted rate being at 8192.
    rates = ComputeRates(1e15, 0.5, 256.0, 0.9, 5e14, 2.6e12, 1.0, depth_knee=720.0)
    down = Gemm("experts_down", 4096.0, 2048.0, 768.0, count=16.0, expert=True)
    full = 16 * 2 * 4096 * 2048 * 768 / (1e15 * 0.5 * 0.9)  # 0.716 ms at full depth
    scale = (8192 + 720) / 8192
    assert depth_factor(768.0, rates) == pytest.approx(768 / 1488 * scale, rel=1e-12)  # 0.5615
    assert gemm_seconds(down, rates, "F") == pytest.approx(full / (768 / 1488 * scale), rel=1e-12)
    assert gemm_seconds(down, rates, "B") == pytest.approx(full / (2048 / 2768 * scale), rel=1e-12)
    assert gemm_seconds(down, rates, "W") == pytest.approx(full / (4096 / 4816 * scale), rel=1e-12)
    assert [reduction_depth(down, p) for p in ("F", "B", "W")] == [768.0, 2048.0, 4096.0]


def test_depth_factor_is_one_at_the_reference_depth_beyond_it_and_when_off():
    rates = ComputeRates(1e15, 0.5, 256.0, 0.9, 5e14, 2.6e12, 1.0, depth_knee=720.0)
    assert depth_factor(8192.0, rates) == pytest.approx(1.0, rel=1e-12)
    assert depth_factor(28672.0, rates) == 1.0
    assert depth_factor(768.0, RATES) == 1.0  # depth_knee 0: the figure is off
    big = Gemm("mlp_up", 8192.0, 8192.0, 8192.0)
    deep = ComputeRates(1e15, 0.75, 256.0, 0.9, 5e14, 2.6e12, 2.0, depth_knee=240.0)
    for pass_ in ("F", "B", "W"):
        assert gemm_seconds(big, deep, pass_) == pytest.approx(gemm_seconds(big, RATES, pass_), rel=1e-12)


def test_a_reduction_thinner_than_the_knee_is_not_charged_twice():
    # A head of 8 logits: the knee already prices n = 8 as a 256-wide tile; the B pass (which
    # sums over n) then sees depth 256, not 8.
    rates = ComputeRates(1e15, 0.75, 256.0, 0.9, 5e14, 2.6e12, 2.0, depth_knee=240.0)
    head = Gemm("head", 8192.0, 8.0, 2048.0)
    compute = 2 * 8192 * 8 * 2048 / (1e15 * 0.75 * 8 / 256)
    assert gemm_seconds(head, rates, "B") == pytest.approx(compute / (256 / 496 * 8432 / 8192), rel=1e-12)


def test_unfused_gradient_accumulation_writes_the_gradient_then_adds_it_by_hand():
    """Without gradient-accumulation fusion the weight-gradient GEMM writes its product (2 bytes a
    weight in bf16) and a kernel of its own adds it to the fp32 buffer after it: reads 2 + 4,
    writes 4, 10 bytes a weight at the HBM rate, outside the GEMM's roofline."""
    unfused = ComputeRates(1e15, 0.75, 256.0, 0.9, 5e14, 2.6e12, 2.0, expert_latency=0.0, wgrad_accum_bytes=2.0,
                           wgrad_add_bytes=10.0)
    # W's own bytes: read X and dY, write the bf16 gradient (2048·768 · 2 bytes), 16 experts
    assert gemm_bytes(SMALL, unfused, "W") == 16 * (2 * (256 * 2048 + 256 * 768) + 2 * 2048 * 768) == 73_400_320
    add = 16 * 10 * 2048 * 768 / 2.6e12  # 96.8 us
    assert gemm_seconds(SMALL, unfused, "W") == pytest.approx(73_400_320 / 2.6e12 + add, rel=1e-12)
    assert gemm_seconds(SMALL, unfused, "F") == gemm_seconds(SMALL, RATES, "F")  # F and B as fused
    # A compute-bound GEMM (8192 tokens through a 4096 -> 4096 projection): its compute, then the add
    big = Gemm("proj", 8192.0, 4096.0, 4096.0)
    compute = 2 * 8192 * 4096 * 4096 / (1e15 * 0.75)
    assert gemm_seconds(big, RATES, "W") == pytest.approx(compute, rel=1e-12)
    assert gemm_seconds(big, unfused, "W") == pytest.approx(compute + 10 * 4096 * 4096 / 2.6e12, rel=1e-12)
