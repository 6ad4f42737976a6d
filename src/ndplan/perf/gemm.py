"""Seconds of a matmul and of the attention core on one device.

GEMM [m, k] @ [k, n], repeated ``count`` times (grouped experts):

    rate      = peak · eff · min(1, min(m, n, k) / knee)        FLOP/s
    compute_s = 2·m·n·k·count / rate
    memory_s  = count · (bytes_in·(m·k + k·n) + 2·m·n) / (hbm · hbm_eff)   (bf16 output)
    time      = max(compute_s, memory_s)                        (roofline)
              + count · expert_latency                          (routed experts only)

The knee models tile quantisation: a GEMM whose thinnest side is below one tile (~128-256
elements) still pays for a whole tile, so its time stops shrinking with that side; a thin
GEMM whose weights dominate the bytes (few tokens per expert) becomes memory-bound instead.
The backward's two GEMMs (input grad, weight grad) have the same three sides in another order,
hence the same time as the forward.

Routed experts run as one grouped GEMM over the ``count`` local experts. With few tokens per
expert each expert's weights are read from HBM for little work (the memory term above counts
count·k·n weight bytes), and each expert's GEMM has a fixed cost the roofline does not see:
kernel prologue/epilogue, the partial last wave and its own fp8 quantisation kernel. That is
``expert_latency`` per expert per GEMM, added to the roofline time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ndplan.perf.flops import Gemm

Array = np.ndarray


@dataclass(frozen=True)
class ComputeRates:
    """Effective rates of one device for one strategy's precision.

    peak_flops: dense peak for the compute dtype, FLOP/s.
    gemm_eff, knee, grouped_factor: see EfficiencyProfile.
    attention_rate: FLOP/s of the fused attention core.
    hbm_rate: bytes/s memory-bound kernels reach.
    operand_bytes: bytes per GEMM input element (1 for fp8, else 2).
    expert_latency: seconds per local expert per routed-expert GEMM (see EfficiencyProfile).
    """

    peak_flops: float
    gemm_eff: float
    knee: float
    grouped_factor: float
    attention_rate: float
    hbm_rate: float
    operand_bytes: float
    expert_latency: float = 0.0


def gemm_seconds(g: Gemm, r: ComputeRates) -> Array | float:
    """Forward seconds of ``g`` (also the input-grad and the weight-grad seconds)."""
    smallest = np.minimum(np.minimum(g.m, g.n), g.k)
    eff = r.gemm_eff * np.minimum(1.0, smallest / r.knee)
    if g.expert:
        eff = eff * r.grouped_factor
    compute = g.flops / (r.peak_flops * eff)
    moved = g.count * (r.operand_bytes * (g.m * g.k + g.k * g.n) + 2.0 * g.m * g.n)
    roofline = np.maximum(compute, moved / r.hbm_rate)
    if g.expert:
        return roofline + g.count * r.expert_latency
    return roofline


def gemms_seconds(gemms: list[Gemm], r: ComputeRates) -> tuple[Array | float, Array | float]:
    """(seconds of the non-expert GEMMs, seconds of the routed-expert GEMMs), forward."""
    dense: Array | float = 0.0
    expert: Array | float = 0.0
    for g in gemms:
        if g.expert:
            expert = expert + gemm_seconds(g, r)
        else:
            dense = dense + gemm_seconds(g, r)
    return dense, expert
