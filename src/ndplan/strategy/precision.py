"""Precision policy: how many bytes each kind of training state takes per parameter."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ndplan.errors import NdplanError, did_you_mean, require_name

ComputeDtype = Literal["bf16", "fp16", "fp8", "fp32"]


class PrecisionPolicy(BaseModel):
    """Bytes per parameter element for each training state, and the dtype matmuls run in.

    ``param_bytes`` is the copy the forward uses (all-gathered under FSDP), ``master_weight_bytes``
    an extra high-precision copy kept by the optimizer (0 when the parameters themselves are fp32),
    ``optimizer_state_bytes`` the width of each of ``optimizer_states`` states (Adam: 2).
    ``activation_bytes`` is the element width of activations kept for backward.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    param_bytes: int = Field(gt=0)
    grad_bytes: int = Field(gt=0)
    master_weight_bytes: int = Field(ge=0)
    optimizer_state_bytes: int = Field(gt=0)
    optimizer_states: int = Field(default=2, ge=0)
    activation_bytes: int = Field(default=2, gt=0)
    compute_dtype: ComputeDtype = "bf16"
    param_gather_bytes: int = Field(default=2, gt=0, description="element width of FSDP's all-gathered parameters")

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer-owned bytes per parameter: the states plus the master copy."""
        return self.optimizer_states * self.optimizer_state_bytes + self.master_weight_bytes


PRECISION_PRESETS: dict[str, PrecisionPolicy] = {
    # Megatron-LM --bf16 with the (distributed) optimizer: bf16 weights, fp32 main gradients
    # (accumulate_allreduce_grads_in_fp32), fp32 master weights and Adam moments: 2 + 4 + 12 B.
    "megatron-bf16": PrecisionPolicy(
        name="megatron-bf16", param_bytes=2, grad_bytes=4, master_weight_bytes=4, optimizer_state_bytes=4
    ),
    # torch FSDP2 / torchtitan MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the
    # sharded parameters stay fp32 and are the optimizer's weights, no separate master copy.
    "fsdp-bf16": PrecisionPolicy(
        name="fsdp-bf16", param_bytes=4, grad_bytes=4, master_weight_bytes=0, optimizer_state_bytes=4,
        param_gather_bytes=2,
    ),
    # Everything in fp32 (no mixed precision).
    "fp32": PrecisionPolicy(
        name="fp32", param_bytes=4, grad_bytes=4, master_weight_bytes=0, optimizer_state_bytes=4,
        activation_bytes=4, compute_dtype="fp32", param_gather_bytes=4,
    ),
    # Pure bf16: weights, gradients and Adam moments in bf16, no master copy.
    "bf16-pure": PrecisionPolicy(
        name="bf16-pure", param_bytes=2, grad_bytes=2, master_weight_bytes=0, optimizer_state_bytes=2
    ),
    # Megatron fp8 (Transformer Engine): bf16 weights and fp32 optimizer as megatron-bf16, fp8 GEMMs.
    "megatron-fp8": PrecisionPolicy(
        name="megatron-fp8", param_bytes=2, grad_bytes=4, master_weight_bytes=4, optimizer_state_bytes=4,
        compute_dtype="fp8",
    ),
    # The same with a bf16 main-gradient buffer, reduced in bf16 (--grad-reduce-in-bf16; Megatron-
    # Bridge's grad_reduce_in_fp32=False, which NVIDIA's performance recipes set): 2 + 2 + 12 B.
    "megatron-bf16-grad16": PrecisionPolicy(
        name="megatron-bf16-grad16", param_bytes=2, grad_bytes=2, master_weight_bytes=4, optimizer_state_bytes=4
    ),
    "megatron-fp8-grad16": PrecisionPolicy(
        name="megatron-fp8-grad16", param_bytes=2, grad_bytes=2, master_weight_bytes=4, optimizer_state_bytes=4,
        compute_dtype="fp8",
    ),
}


def get_precision(name: str) -> PrecisionPolicy:
    """The precision preset called ``name`` (case-insensitive): bytes per parameter, gradient,
    master weight, optimizer state and activation."""
    key = require_name(name, "precision name").lower()
    if key not in PRECISION_PRESETS:
        raise NdplanError(f"unknown precision policy '{name}'{did_you_mean(name, PRECISION_PRESETS)}; "
                          f"known: {', '.join(PRECISION_PRESETS)}")
    return PRECISION_PRESETS[key]
