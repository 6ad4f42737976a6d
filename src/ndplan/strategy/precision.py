"""Precision policy: how many bytes each kind of training state takes per parameter."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ndplan.errors import NdplanError, did_you_mean, require_name

ComputeDtype = Literal["bf16", "fp16", "fp8", "fp32"]


class PrecisionPolicy(BaseModel):
    """Bytes per parameter element for each training state, and the dtype matmuls run in.

    ``param_bytes`` is the copy the forward uses (all-gathered under FSDP), ``master_weight_bytes``
    an extra high-precision copy kept by the optimizer (0 when the parameters themselves are fp32),
    ``optimizer_state_bytes`` the width of each of ``optimizer_states`` states (Adam: 2).
    ``activation_bytes`` is the element width of activations kept for backward. ``fp8_params``:
    the linear layers' weights are kept in fp8, one byte an element, the copy their fp8 GEMMs
    read (Megatron-Core's ``--fp8-param-gather``, Transformer Engine's ``fp8_model_init``): the
    runtime's quantised weight copies (``RuntimeProfile.fp8_weight_cache_bytes``) then include
    the parameter instead of sitting beside a 2-byte one, and the distributed optimizer gathers
    the updated weights at ``param_gather_bytes``. Norms, embeddings and the output layer stay
    at ``param_bytes``.
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
    fp8_params: bool = False

    @model_validator(mode="after")
    def _fp8_params_need_fp8_gemms(self) -> PrecisionPolicy:
        if self.fp8_params and self.compute_dtype != "fp8":
            raise ValueError(f"fp8_params keeps the linear weights for fp8 GEMMs; compute_dtype is {self.compute_dtype!r}, "
                             "not 'fp8'")
        return self

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
    # The two above with the linear weights kept in fp8 (--fp8-param-gather, which NVIDIA's FP8
    # performance recipes set): 1 byte a linear weight and its transposed fp8 copy, where the
    # others keep a bf16 weight beside two fp8 copies; the updated weights gathered in fp8.
    "megatron-fp8-param": PrecisionPolicy(
        name="megatron-fp8-param", param_bytes=2, grad_bytes=4, master_weight_bytes=4, optimizer_state_bytes=4,
        compute_dtype="fp8", param_gather_bytes=1, fp8_params=True,
    ),
    "megatron-fp8-param-grad16": PrecisionPolicy(
        name="megatron-fp8-param-grad16", param_bytes=2, grad_bytes=2, master_weight_bytes=4, optimizer_state_bytes=4,
        compute_dtype="fp8", param_gather_bytes=1, fp8_params=True,
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
