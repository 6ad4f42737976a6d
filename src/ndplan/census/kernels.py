"""Stand-ins for the GPU kernels transformers calls in Gated DeltaNet layers (Qwen3-Next, Qwen3.5).

On a GPU with flash-linear-attention and causal-conv1d installed, transformers runs their kernels
for the chunked delta rule and the short convolution; without them (as on the census's CPU) it
runs a torch reference that keeps other tensors (the whole chunked recurrence, step by step). The
census therefore swaps the reference for autograd functions that keep, allocate and return what
the kernels do, read in their code:

* flash-linear-attention 0.6.0, ``fla/ops/gated_delta_rule/chunk.py`` (its Triton path, native to
  more value heads than key heads): ``input_guard`` makes every input contiguous; the L2-normed q
  and k (input dtype) with their fp32 inverse norms, v, the decay's fp32 chunk-local cumsum, beta
  and each chunk's 64-wide triangular inverse per value head (k's dtype) are saved. Its backward
  rebuilds w, u, the chunk states h and the new values, then makes dv, dh (the states' shape),
  dq, dk and dw per value head, dg in fp32, and the WY representation's gradients.
* causal-conv1d 1.7.0, ``causal_conv1d/causal_conv1d_interface.py``: the input is saved (made
  contiguous only where neither of its last two dimensions is), the SiLU rebuilt in backward.

What the layer keeps around them (projections, gates, norms) is transformers' own code, measured
as it runs. FlashQLA (fla's backend on Hopper when installed) keeps another set: not priced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

#: Tokens per chunk of fla's chunked delta rule.
CHUNK = 64

#: transformers' modules that call the two kernels by these module-level names.
_MODELING_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """fla's ``ChunkGatedDeltaRuleFunction`` with ``use_qk_l2norm_in_kernel``: q, k [B, T, Hk, dk],
    v [B, T, Hv, dv], g and beta [B, T, Hv]."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        q_normed, k_normed = torch.empty_like(q), torch.empty_like(k)
        q_inv_norm = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        k_inv_norm = torch.empty(k.shape[:-1], dtype=torch.float32, device=k.device)
        g_cumsum = torch.empty(g.shape, dtype=torch.float32, device=g.device)
        inverse = torch.empty(*v.shape[:3], CHUNK, dtype=k.dtype, device=k.device)
        ctx.save_for_backward(q_normed, q_inv_norm, k_normed, k_inv_norm, v, g_cumsum, beta, inverse)
        ctx.input_dtypes = (g.dtype, beta.dtype)
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, _, k, _, v, g, beta, _ = ctx.saved_tensors
        batch, tokens, value_heads, value_width = v.shape
        key_width = k.shape[-1]
        chunks = -(-tokens // CHUNK)
        per_value_head = (batch, tokens, value_heads, key_width)
        states = (batch, chunks, value_heads, key_width, value_width)
        # Rebuilt forward (w, u, the chunk states, the new values), then the gradients, all alive
        # until the function returns.
        rebuilt = [k.new_empty(per_value_head), torch.empty_like(v), k.new_empty(states), torch.empty_like(v)]
        grads = [torch.empty_like(grad_output), q.new_empty(states), torch.empty_like(grad_output),
                 q.new_empty(per_value_head), k.new_empty(per_value_head), torch.empty(g.shape, dtype=torch.float32),
                 k.new_empty(per_value_head), k.new_empty(per_value_head), torch.empty_like(v),
                 torch.empty_like(g), torch.empty_like(beta)]
        del rebuilt, grads
        g_dtype, beta_dtype = ctx.input_dtypes
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                torch.empty(g.shape, dtype=g_dtype), torch.empty(beta.shape, dtype=beta_dtype))


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``torch_chunk_gated_delta_rule`` signature, for training (no state kept)."""
    return _ChunkGatedDeltaRule.apply(query, key, value, g, beta), None


class _CausalConv1d(torch.autograd.Function):
    """causal-conv1d's ``CausalConv1dFn`` with its SiLU: x [B, channels, T], weight [channels, taps]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        ctx.save_for_backward(x, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: Any = None,
                     activation: Any = None, **_: Any) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` signature (no bias in these models' convolutions)."""
    return _CausalConv1d.apply(hidden_states, weight)


@contextlib.contextmanager
def gated_deltanet_kernels(used: list[str]) -> Iterator[None]:
    """Within the context, transformers' Gated DeltaNet layers call the stand-ins above instead
    of their torch references. ``used`` collects a note each time a stand-in runs."""
    import importlib

    def noted(function: Any, note: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            used.append(note)
            return function(*args, **kwargs)
        return run

    patched: list[tuple[Any, str, Any]] = []
    for name in _MODELING_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an older transformers without the family
            continue
        for attribute, stand_in, note in (
            ("torch_chunk_gated_delta_rule", chunk_gated_delta_rule,
             "Gated DeltaNet's chunked delta rule kept what flash-linear-attention 0.6's kernel keeps (a stand-in "
             "for transformers' torch reference)"),
            ("causal_conv1d_fn", causal_conv1d_fn,
             "Gated DeltaNet's short convolution kept what causal-conv1d 1.7's kernel keeps (a stand-in)"),
        ):
            if hasattr(module, attribute):
                patched.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, noted(stand_in, note))
    try:
        yield
    finally:
        for module, attribute, original in patched:
            setattr(module, attribute, original)
