"""Parameters, gradients and optimizer states per rank: element counts split by how they shard.

Tensor parallelism shards column/row-parallel weights and leaves norms, routers, row-parallel
biases and MLA's down-projections (Megatron-Core builds them "duplicated") whole on every rank.
Routed experts are divided over ep·etp ranks (their down-projection biases over ep alone). What
remains is replicated over the data-parallel ranks, where ZeRO/FSDP divides it again
(``sharding_factors``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ndplan.model.params import (
    attention_params,
    layer_norm_params,
    layer_params,
    linear_attention_params,
    mtp_extra_params,
    norm_params,
    qk_norm_params,
)
from ndplan.model.spec import MlpKind, ModelSpec


@dataclass(frozen=True)
class TpSplit:
    """Elements of one block: ``sharded`` is divided by the TP degree, ``whole`` is not."""

    sharded: int
    whole: int

    def per_rank(self, tp: np.ndarray) -> np.ndarray:
        return self.sharded / tp + self.whole


def attention_split(model: ModelSpec, kind: MlpKind | None = None) -> TpSplit:
    """A decoder layer's token mixer (of MLP ``kind``), the mean over its layers: softmax
    attention (``softmax_attention_split``) and, on the 'linear' layers, a Gated DeltaNet, whose
    projections, convolution and per-head dt_bias and A_log split with its heads, and whose gated
    norm (one weight of the value head width, shared by the heads) every rank holds whole."""
    softmax = softmax_attention_split(model)
    share = model.linear_share(kind)
    if not share:
        return softmax
    whole = norm_params(model, model.linear_value_head_dim)
    linear = TpSplit(linear_attention_params(model) - whole, whole)
    return TpSplit((1.0 - share) * softmax.sharded + share * linear.sharded,  # type: ignore[arg-type]
                   (1.0 - share) * softmax.whole + share * linear.whole)  # type: ignore[arg-type]


def softmax_attention_split(model: ModelSpec) -> TpSplit:
    """One softmax attention block (``attention_params``) split as tensor parallelism splits it."""
    h = model.hidden_size
    total = attention_params(model)
    whole = h if model.o_bias else 0
    if model.qk_norm and model.qk_norm_width == "head":
        # One weight vector shared by every head, so every TP rank holds it whole; a norm over the
        # whole projection is split with its heads (the sharded part).
        whole += qk_norm_params(model)
    if model.is_mla:
        q_rank, kv_down = model.q_lora_rank, model.kv_lora_rank + model.qk_rope_head_dim
        if q_rank:
            whole += h * q_rank + (q_rank if model.qkv_bias else 0) + norm_params(model, q_rank)
        whole += h * kv_down + (kv_down if model.qkv_bias else 0) + norm_params(model, model.kv_lora_rank)
    return TpSplit(total - whole, whole)


def mlp_split(model: ModelSpec) -> TpSplit:
    total = layer_params(model, "dense").mlp
    whole = model.hidden_size if model.mlp_bias else 0  # the row-parallel down_proj bias
    return TpSplit(total - whole, whole)


def shared_expert_split(model: ModelSpec) -> TpSplit:
    total = layer_params(model, "moe").shared_experts if model.is_moe else 0
    whole = model.hidden_size if model.shared_expert_gate else 0
    return TpSplit(total - whole, whole)


def non_expert_split(model: ModelSpec, kind: MlpKind) -> TpSplit:
    """A decoder layer's elements outside its routed experts, split as tensor parallelism splits
    them (what ``layer_elements`` gives per rank): attention, norms (whole), and the dense MLP or
    the router (whole) and shared experts."""
    attention = attention_split(model, kind)
    norms = layer_norm_params(model)
    if kind == "dense":
        mlp = mlp_split(model)
        return TpSplit(attention.sharded + mlp.sharded, attention.whole + norms + mlp.whole)
    shared = shared_expert_split(model)
    router = layer_params(model, "moe").router
    return TpSplit(attention.sharded + shared.sharded, attention.whole + norms + router + shared.whole)


def mtp_extra_split(model: ModelSpec) -> TpSplit:
    """An MTP module besides its decoder layer: the column-parallel 2h -> h projection, and
    norms (whole)."""
    h = model.hidden_size
    return TpSplit(2 * h * h, mtp_extra_params(model) - 2 * h * h)


@dataclass(frozen=True)
class LayerElements:
    """Per-rank elements of one decoder layer of each kind, for a batch of strategies.

    ``non_expert`` is replicated over the dp·cp ranks; ``expert`` over the expert-data-parallel
    ranks. ``by_kind`` splits the layer for the breakdown (attention, norm, mlp, moe).
    """

    non_expert: dict[MlpKind, np.ndarray]
    expert: dict[MlpKind, np.ndarray]
    by_kind: dict[MlpKind, dict[str, np.ndarray]]


def layer_elements(model: ModelSpec, tp: np.ndarray, ep: np.ndarray, etp: np.ndarray) -> LayerElements:
    attention = {kind: attention_split(model, kind).per_rank(tp) for kind in ("dense", "moe")}
    norms = np.full(tp.shape, float(layer_norm_params(model)))
    zeros = np.zeros(tp.shape)
    dense_mlp = mlp_split(model).per_rank(tp) if model.num_dense_layers else zeros
    if model.is_moe:
        moe = layer_params(model, "moe")
        moe_non_expert = moe.router + shared_expert_split(model).per_rank(tp)
        # An expert's down-projection bias is added after the etp reduction: whole on each rank.
        down_biases = model.num_experts * model.hidden_size if model.expert_bias else 0
        experts = (moe.routed_experts - down_biases) / (ep * etp) + down_biases / ep
    else:
        moe_non_expert, experts = zeros, zeros
    # The same sums as non_expert_split(model, kind).per_rank(tp), kept apart for by_kind.
    return LayerElements(
        non_expert={"dense": attention["dense"] + norms + dense_mlp, "moe": attention["moe"] + norms + moe_non_expert},
        expert={"dense": zeros, "moe": experts},
        by_kind={
            "dense": {"attention": attention["dense"], "norm": norms, "mlp": dense_mlp},
            "moe": {"attention": attention["moe"], "norm": norms, "moe": moe_non_expert + experts},
        },
    )


def linear_weight_elements(model: ModelSpec, tp: np.ndarray, ep: np.ndarray, etp: np.ndarray) -> dict[MlpKind, dict[str, np.ndarray]]:
    """Per layer kind, the weight elements on one rank of the linears a decoder layer runs its
    GEMMs through (Transformer Engine's modules under Megatron-Core), keyed like
    ``LayerElements.by_kind``: the attention projections (MLA's down-projections whole, the rest
    /tp), the dense MLP (/tp), or the shared experts (/tp) and the routed experts (E/ep of them,
    /etp). Biases, norms, the router and the shared-expert gate run no GEMM of their own; the
    embedding and output head are not Transformer Engine modules."""
    h, heads = model.hidden_size, model.num_attention_heads
    if model.is_mla:
        q_up = model.q_lora_rank or h
        whole = (h * model.q_lora_rank if model.q_lora_rank else 0) + h * (model.kv_lora_rank + model.qk_rope_head_dim)
        split = (q_up * heads * model.qk_head_dim
                 + model.kv_lora_rank * heads * (model.qk_nope_head_dim + model.v_head_dim)
                 + heads * model.v_head_dim * h)
    else:
        q_width, kv_width = heads * model.head_dim, model.num_kv_heads * model.head_dim
        gate = q_width if model.attention_output_gate else 0
        whole, split = 0, h * (q_width + gate + 2 * kv_width) + q_width * h
    softmax = split / tp + whole
    # A Gated DeltaNet's projections (its in_proj and out_proj), on the kind's 'linear' layers
    key, value, value_heads = model.linear_key_width, model.linear_value_width, model.linear_num_value_heads
    linear = h * (2 * key + 2 * value + 2 * value_heads + value) / tp
    attention = {kind: (1.0 - share) * softmax + share * linear
                 for kind, share in (("dense", model.linear_share("dense")), ("moe", model.linear_share("moe")))}
    mlp = model.mlp_matrices * h * model.ffn_hidden_size / tp
    shared = model.num_shared_experts * model.mlp_matrices * h * model.shared_expert_ffn_hidden_size / tp
    routed = model.num_experts * model.mlp_matrices * h * model.moe_ffn_hidden_size / (ep * etp)
    return {"dense": {"attention": attention["dense"], "mlp": mlp},
            "moe": {"attention": attention["moe"], "moe": shared + routed}}


def mtp_extra_linear_elements(model: ModelSpec, tp: np.ndarray) -> np.ndarray:
    """An MTP module's linear besides its decoder layer: the column-parallel 2h -> h projection."""
    return 2 * model.hidden_size * model.hidden_size / tp


def embedding_elements(model: ModelSpec, tp: np.ndarray) -> np.ndarray:
    """The vocabulary-parallel embedding (or output head) table on one rank."""
    return model.vocab_size * model.hidden_size / tp


def mtp_extra_elements(model: ModelSpec, tp: np.ndarray) -> np.ndarray:
    """An MTP module besides its decoder layer: the 2h -> h projection (column-parallel) and norms."""
    return mtp_extra_split(model).per_rank(tp)


@dataclass(frozen=True)
class ShardingFactors:
    """Divisors that ZeRO/FSDP applies to each state, for non-expert and expert elements."""

    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    expert_params: np.ndarray
    expert_grads: np.ndarray
    expert_optimizer: np.ndarray
    data_shards: np.ndarray
    expert_data_shards: np.ndarray


Degrees = np.ndarray | float


def shard_groups(
    dp: Degrees, cp: Degrees, tp: Degrees, ep: Degrees, etp: Degrees, shard_group: Degrees,
) -> tuple[np.ndarray, np.ndarray]:
    """(non-expert, expert) ranks that ZeRO/FSDP shard one replica over (floats).

    Non-expert weights: the dp·cp ranks that hold the same replica, or the ``shard_group``
    (HSDP; Megatron's distributed-optimizer instances). Experts: the expert-data-parallel ranks
    dp·cp·tp/(ep·etp), or under HSDP the expert ranks inside one shard group,
    shard_group·tp/(ep·etp): expert parallelism is carved out of the shard group (torchtitan's
    dp_shard_mod_ep mesh; Megatron's expert data-parallel group split into the same instances).
    The rule ``shard_group_holds_expert_groups`` keeps that a whole number."""
    replicas = np.asarray(dp * cp, dtype=np.float64)
    expert_width = np.asarray(ep * etp, dtype=np.float64)
    expert_replicas = np.maximum(np.floor(replicas * tp / expert_width), 1.0)
    hsdp = np.asarray(shard_group) > 0
    if not hsdp.any():
        return replicas, expert_replicas
    groups = np.asarray(shard_group, dtype=np.float64)
    shards = np.where(hsdp, np.minimum(groups, replicas), replicas)
    expert_shards = np.where(hsdp, np.maximum(np.floor(shards * tp / expert_width), 1.0), expert_replicas)
    return shards, expert_shards


def sharding_factors(
    dp: np.ndarray, cp: np.ndarray, tp: np.ndarray, ep: np.ndarray, etp: np.ndarray,
    zero: np.ndarray, shard_group: np.ndarray,
) -> ShardingFactors:
    """ZeRO stage z shards optimizer states (z >= 1), gradients (z >= 2) and parameters (z = 3)
    over the ranks that hold the same replica (``shard_groups``): dp·cp for non-expert weights,
    dp·cp·tp/(ep·etp) for experts, or under HSDP (``shard_group`` > 0) shard_group and
    shard_group·tp/(ep·etp)."""
    shards, expert_shards = shard_groups(dp, cp, tp, ep, etp, shard_group)
    stage3, stage2, stage1 = zero >= 3, zero >= 2, zero >= 1
    return ShardingFactors(
        params=np.where(stage3, shards, 1.0),
        grads=np.where(stage2, shards, 1.0),
        optimizer=np.where(stage1, shards, 1.0),
        expert_params=np.where(stage3, expert_shards, 1.0),
        expert_grads=np.where(stage2, expert_shards, 1.0),
        expert_optimizer=np.where(stage1, expert_shards, 1.0),
        data_shards=shards,
        expert_data_shards=expert_shards,
    )


def optimizer_on_device(optimizer_offload: Degrees, fraction: float) -> np.ndarray:
    """The share of a rank's optimizer states the device holds: all of them, or 1 − f where the
    optimizer is offloaded for a step on the CPU (``Strategy.optimizer_offload_fraction`` f)."""
    return np.where(np.asarray(optimizer_offload) > 0, 1.0 - fraction, 1.0)


def experts_out_of_fsdp(outside_fsdp: bool, zero: Degrees, expert_shards: Degrees) -> np.ndarray:
    """Where the routed experts stay out of FSDP (``MemoryOptions.experts_outside_fsdp``, NeMo
    AutoModel's parallelizer): under ZeRO-3, with their shard group one rank."""
    return outside_fsdp & (np.asarray(zero) == 3) & (np.asarray(expert_shards) == 1)
