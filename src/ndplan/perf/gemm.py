"""Seconds of a matmul and of the attention core on one device, per pass.

GEMM [m, k] @ [k, n], repeated ``count`` times (grouped experts). The three passes have the
same FLOPs but move different bytes:

    rate      = peak · eff · min(1, min(m, n, k) / knee)        FLOP/s
    compute_s = 2·m·n·k·count / (rate · depth(R))               R: the pass's reduction
    depth(R)  = min(1, R/(R + depth_knee) · (ref + depth_knee)/ref),  ref = 8192
    bytes     F (Y = X·W):     count · (b_in·(m·k + k·n) + 2·m·n)       read X, W; write Y (bf16)
              B (dX = dY·Wᵀ):  count · (b_in·(m·n + k·n) + 2·m·k)       read dY, W; write dX (bf16)
              W (dW = Xᵀ·dY):  count · (b_in·(m·k + m·n) + b_acc·k·n)   read X, dY; read-modify-
                                                                       write the weight gradient
    time      = max(compute_s, bytes / (hbm · hbm_eff))         (roofline)
              + count · expert_latency                          (routed experts only)

b_in: operand width (1 for fp8, 2 for bf16). b_acc = 2·grad_bytes: the weight-gradient GEMM
accumulates into the gradient buffer (Megatron's gradient-accumulation fusion, Transformer
Engine's fused wgrad accumulation: C = Xᵀ·dY + C in fp32, read 4 + write 4 bytes per weight,
every micro-batch). Without that fusion (``EfficiencyProfile.gradient_accumulation_fusion``
off) b_acc is the activation width a (the GEMM writes the gradient) and W adds a kernel of its
own after the GEMM, count·(a + 2·grad_bytes)·k·n / hbm seconds (``wgrad_add_bytes``: the add
reads the new gradient and reads and writes the buffer). With many tokens per weight (dense layers, m in the thousands) every pass
is compute-bound and the three times agree; with few tokens per expert the weight-gradient
GEMM is the first to turn memory-bound, because its output is the weight itself at fp32 width:
its arithmetic intensity is 2·m·n·k / (8·k·n) = m/4 FLOP/byte, below a Hopper or Blackwell
ridge point (~590 FLOP/byte in fp8, ~295 in bf16) for m < ~1200-2400 tokens per expert.

Reduction depth: every output tile pays a fixed cost (filling the load pipeline, the epilogue
that writes the tile, fp8 scale handling) worth about ``depth_knee`` elements of its reduction,
so a pass that sums over R elements runs at R/(R + depth_knee) of the asymptotic rate. The
forward sums over k, the input gradient over n and the weight gradient over m (the tokens).
The efficiencies are quoted for large square GEMMs (R = 8192, ``DEPTH_REFERENCE``), hence the
normalisation; deeper reductions are not made faster than quoted. A reduction thinner than the
knee is taken as the knee (the tile term already pays for it). Published GEMM timings fit this
with depth_knee ~720 (fp8) and ~240 (bf16) on Hopper, ~740 and ~480 on Blackwell (efficiency.py
gives the sources): an expert down-projection of f_e = 768 runs at ~0.56 of the quoted fp8 rate.

The knee models tile quantisation: a GEMM whose thinnest side is below one tile (~128-256
elements) still pays for a whole tile, so its time stops shrinking with that side; a thin
GEMM whose weights dominate the bytes (few tokens per expert) becomes memory-bound instead.

Routed experts run as one grouped GEMM over the ``count`` local experts. With few tokens per
expert each expert's weights are read from HBM for little work (the bytes above count
count·k·n weight elements), and each expert's GEMM has a fixed cost the roofline does not see:
kernel prologue/epilogue, the partial last wave and its own fp8 quantisation kernel. That is
``expert_latency`` per expert per GEMM and pass, added to the roofline time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ndplan.perf.flops import Gemm

Array = np.ndarray
Pass = Literal["F", "B", "W"]
#: The passes in order: forward, input gradient, weight gradient.
PASS_NAMES: tuple[Pass, ...] = ("F", "B", "W")
#: Reduction depth (elements) at which the profiles' GEMM efficiencies are quoted: large
#: square GEMMs (M = N = K = 8192), the shape GEMM microbenchmarks report.
DEPTH_REFERENCE = 8192.0


@dataclass(frozen=True)
class ComputeRates:
    """Effective rates of one device for one strategy's precision.

    peak_flops: dense peak for the compute dtype, FLOP/s.
    gemm_eff, knee, grouped_factor: see EfficiencyProfile.
    attention_rate: FLOP/s of the fused attention core.
    hbm_rate: bytes/s memory-bound kernels reach.
    operand_bytes: bytes per GEMM input element (1 for fp8, else 2).
    expert_latency: seconds per local expert per routed-expert GEMM (see EfficiencyProfile).
    optimizer_rate: bytes/s the optimizer's update kernels reach (0: ``hbm_rate``).
    masked_attention_rate: FLOP/s of an attention kernel given an explicit mask (0: ``attention_rate``).
    linear_attention_rate: FLOP/s of Gated DeltaNet's chunked delta rule (its executed FLOPs).
    wgrad_accum_bytes: bytes per weight element the weight-gradient GEMM reads and writes in
        the gradient buffer (2 · the precision's grad_bytes: 8 for fp32 main gradients), or
        writes where a kernel of its own accumulates it (the activation width).
    wgrad_add_bytes: bytes per weight element of that separate accumulation (the new gradient
        read, the buffer read and written), 0 where the GEMM accumulates in its epilogue.
    """

    peak_flops: float
    gemm_eff: float
    knee: float
    grouped_factor: float
    attention_rate: float
    hbm_rate: float
    operand_bytes: float
    expert_latency: float = 0.0
    wgrad_accum_bytes: float = 8.0
    wgrad_add_bytes: float = 0.0
    depth_knee: float = 0.0
    depth_ref: float = DEPTH_REFERENCE
    optimizer_rate: float = 0.0
    masked_attention_rate: float = 0.0
    linear_attention_rate: float = 0.0
    #: The rates of the GEMMs an fp8 recipe leaves in bf16: the output head (Megatron-Core's
    #: output layer is not a Transformer Engine module, torchao's Float8 conversion skips
    #: ``output``, DeepSeek-V3 keeps the head in its original precision). None where every GEMM
    #: runs at these rates.
    unquantised: ComputeRates | None = None

    @property
    def head(self) -> ComputeRates:
        """The rates the output head's GEMMs run at."""
        return self.unquantised or self


def gemm_bytes(g: Gemm, r: ComputeRates, pass_: Pass = "F") -> Array | float:
    """HBM bytes of one pass of ``g`` (see the module docstring)."""
    b = r.operand_bytes
    if pass_ == "F":
        return g.count * (b * (g.m * g.k + g.k * g.n) + 2.0 * g.m * g.n)
    if pass_ == "B":
        return g.count * (b * (g.m * g.n + g.k * g.n) + 2.0 * g.m * g.k)
    return g.count * (b * (g.m * g.k + g.m * g.n) + r.wgrad_accum_bytes * g.k * g.n)


def reduction_depth(g: Gemm, pass_: Pass) -> Array | float:
    """The dimension a pass of ``g`` sums over: F (X·W) k, B (dY·Wᵀ) n, W (Xᵀ·dY) m."""
    return g.k if pass_ == "F" else g.n if pass_ == "B" else g.m


def depth_factor(depth: Array | float, r: ComputeRates) -> Array | float:
    """Fraction of the quoted GEMM rate a pass reaches at reduction depth R (see module doc):

        min(1, R/(R + depth_knee) · (depth_ref + depth_knee)/depth_ref)

    1 at and beyond the reference depth, lower for shallow reductions; 1 when depth_knee is 0."""
    if r.depth_knee <= 0.0:
        return 1.0
    k0 = r.depth_knee
    return np.minimum(1.0, depth / (depth + k0) * (r.depth_ref + k0) / r.depth_ref)


def _compute_seconds(g: Gemm, r: ComputeRates) -> Array | float:
    """FLOP-bound seconds of a pass of ``g`` at full reduction depth (the passes have the
    same FLOPs; ``depth_factor`` then slows each by its own reduction depth)."""
    smallest = np.minimum(np.minimum(g.m, g.n), g.k)
    eff = r.gemm_eff * np.minimum(1.0, smallest / r.knee)
    if g.expert:
        eff = eff * r.grouped_factor
    return g.flops / (r.peak_flops * eff)


def _roofline(g: Gemm, r: ComputeRates, compute: Array | float, pass_: Pass) -> Array | float:
    if r.depth_knee > 0.0:
        # A reduction thinner than the knee already pays a whole tile (the knee term above).
        compute = compute / depth_factor(np.maximum(reduction_depth(g, pass_), r.knee), r)
    time = np.maximum(compute, gemm_bytes(g, r, pass_) / r.hbm_rate)
    if pass_ == "W" and r.wgrad_add_bytes:
        time = time + g.count * g.k * g.n * r.wgrad_add_bytes / r.hbm_rate  # the unfused accumulation
    return time + g.count * r.expert_latency if g.expert else time


def gemm_seconds(g: Gemm, r: ComputeRates, pass_: Pass = "F") -> Array | float:
    """Seconds of one pass of ``g``: F forward, B input gradient, W weight gradient."""
    return _roofline(g, r, _compute_seconds(g, r), pass_)


def gemm_pass_seconds(g: Gemm, r: ComputeRates) -> dict[Pass, Array | float]:
    """Seconds of every pass of ``g`` (``gemm_seconds`` of F, B and W, the FLOP term once)."""
    compute = _compute_seconds(g, r)
    return {pass_: _roofline(g, r, compute, pass_) for pass_ in PASS_NAMES}


def gemms_seconds(gemms: list[Gemm], r: ComputeRates, pass_: Pass = "F") -> tuple[Array | float, Array | float]:
    """(seconds of the non-expert GEMMs, seconds of the routed-expert GEMMs) of one pass."""
    dense: Array | float = 0.0
    expert: Array | float = 0.0
    for g in gemms:
        if g.expert:
            expert = expert + gemm_seconds(g, r, pass_)
        else:
            dense = dense + gemm_seconds(g, r, pass_)
    return dense, expert
