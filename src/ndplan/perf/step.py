"""One training step in seconds, for a batch of strategies: the single code path.

    step = pipeline makespan + exposed DP communication + optimizer + fixed step overhead

* makespan (pipeline.py): per stage and micro-batch, F/B/W seconds = Σ over the pieces the
  stage holds (layers, embedding on the first stage, head+loss+MTP on the last) of their
  compute and exposed TP/CP/EP/FSDP communication (layer.py), recompute added to B.
* DP, once per step, priced on the stage holding the most parameters per device: gradient
  all-reduce (ZeRO-0), or reduce-scatter (ZeRO-1 once per step, ZeRO-2 every micro-batch)
  plus the parameter all-gather after the update (Megatron distributed optimizer); under
  FSDP/ZeRO-3 only the HSDP all-reduce across shard groups is per step (the per-layer traffic
  is in the layer times). Groups: non-expert parameters over the dp·cp replicas (stride tp),
  experts over the expert-data-parallel ranks (stride ep·etp). Exposure: with overlap, the
  gradient reduce hides under that stage's backward of one micro-batch except at least the
  last bucket (the runtime's: grad_bucket_params, last_bucket_params; FSDP's unit, a layer);
  the parameter all-gather likewise under one forward.
* optimizer: Adam over the local parameter shard (/dp·cp with ZeRO >= 1), memory-bound:
  reads gradient, states and master weights, writes states, master and the bf16 copy, plus
  one gradient read for clipping and one write to zero the gradient; a latency-bound
  all-reduce of the gradient norm (tree: 2·ceil(log2(world)) steps; none on one device).
  With optimizer offload: the gradient goes to the host and the parameters come back over the
  host link, and a CPU Adam runs at ``cpu_optimizer_params_per_s``. With the optimizer states
  offloaded between steps: their reload (states and master weights over the host link) before
  the update on the device.

Breakdown (seconds, summing to step_s), on the bottleneck stage s* (largest per-micro-batch
time): compute = m·compute(s*), comm_exposed tp/cp/ep = m·exposed(s*), dp = m·FSDP(s*) + the
per-step DP exposure, offload = m·(activation copies over the host link that outlast the
passes they run beside, on s*), pp = point-to-point time on the critical path, bubble = makespan -
m·T(s*) - pp, optimizer = optimizer + step overhead.

Speed: layers are priced once per distinct layer configuration (codes.py) and stages once per
distinct stage profile of each layout (pipeline.StageLayout), so the per-strategy work is a
few gathers and [n, profiles] sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from ndplan.arrays import gathered, unique
from ndplan.errors import NdplanError
from ndplan.hardware.device import Cluster
from ndplan.memory.static import mtp_extra_split, non_expert_split, shard_groups
from ndplan.model.params import layer_params, norm_params
from ndplan.model.spec import ModelSpec
from ndplan.perf import collectives as coll
from ndplan.perf.accumulation import forced_unfused, rules_apply
from ndplan.perf.codes import dense_codes, first_of_codes, row_codes
from ndplan.perf.efficiency import EfficiencyProfile, default_efficiency, waits_for_sends, with_software
from ndplan.perf.flops import model_flops_per_micro_batch
from ndplan.perf.gemm import ComputeRates
from ndplan.perf.layer import (
    CATEGORIES,
    PASSES,
    PIECES,
    SPLIT_SCHEDULE_CODES,
    UNFUSED,
    LayerContext,
    PieceTimes,
    piece_times,
)
from ndplan.perf.overlap import OverlapConfig, default_overlap, parse_overlap
from ndplan.perf.pipeline import (
    StageLayout,
    closed_form_holds,
    closed_form_makespan,
    interleaved_chain_bound_by_stage,
    interleaved_stall,
    is_v_shape,
    recomputed_layers,
    simulated_makespan,
    simulated_makespan_batch,
    stage_layout,
)
from ndplan.perf.topology import (
    Fabric,
    collective_sm_share,
    group_link,
    inside_bandwidth,
    pipeline_crossing_share,
)
from ndplan.schedule.pairing import unpaired_forwards
from ndplan.schedule.unshard import ACTIVE_CHUNKS, chunk_gathers
from ndplan.strategy.batch import CODES, StrategyBatch
from ndplan.strategy.precision import PrecisionPolicy

Array = np.ndarray
PipelineMethod = Literal["simulate", "closed_form"]

#: Output arrays of ``evaluate``, in seconds unless named otherwise: the step, its throughput
#: and FLOPs, and the breakdown (compute_s ... optimizer_s sum to step_s).
OUTPUT_KEYS = (
    "step_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "hfu", "model_flops", "hardware_flops",
    "compute_s", "tp_s", "cp_s", "ep_s", "dp_s", "offload_s", "pp_s", "bubble_s", "optimizer_s",
)
#: Further arrays with ``details=True`` (what explain() prints).
DETAIL_KEYS = (
    "makespan_s", "stage_forward_s", "stage_backward_s", "stage_weight_grad_s", "bottleneck_stage",
    "dp_step_s", "p2p_s", "optimizer_update_s",
)
#: Arrays a group fills (the rest are derived after the loop).
_GROUP_KEYS = (
    "compute_s", "tp_s", "cp_s", "ep_s", "dp_s", "offload_s", "pp_s", "bubble_s", "optimizer_s", "makespan_s",
    "stage_forward_s", "stage_backward_s", "stage_weight_grad_s", "bottleneck_stage", "dp_step_s",
    "optimizer_update_s",
)

#: Strategy fields a layer's price depends on (layer.py reads nothing else, but whether the
#: schedule splits the backward: ``distinct_layer_configs`` adds it; and the unpaired share of
#: overlapped expert passes, which ``ep_pairing``'s code stands for).
_LAYER_FIELDS = ("tp", "cp", "ep", "etp", "micro_batch_size", "seq_length", "cp_kind", "ulysses_degree",
                 "sequence_parallel", "recompute", "ep_overlap", "ep_pairing", "offload_layers")
#: The first of _LAYER_FIELDS, which the DP configurations fix (``distinct_layer_configs``).
_LAYER_DEGREES = ("tp", "cp", "ep", "etp")
#: Per schedule code, whether the schedule splits the backward (SPLIT_SCHEDULE_CODES): taken
#: per strategy (1M strategies: 0.36 ms, where np.isin took 1.04 ms).
_SPLITS_BACKWARD = np.isin(np.arange(len(CODES["schedule"])), SPLIT_SCHEDULE_CODES)
#: Strategy fields the stage, pipeline, DP and optimizer formulas read per strategy: counts they
#: multiply by (as floats).
_STEP_FIELDS = ("num_micro_batches", "pipeline_runs", "seq_chunks")
#: Strategy fields the per-step DP and optimizer terms read (besides the stage's parameters).
_DP_FIELDS = ("tp", "ep", "etp", "dp", "cp", "pp", "zero", "fsdp", "shard_group", "optimizer_offload",
              "offload_optimizer_states", "reshard_after_forward")


def compute_rates(cluster: Cluster, batch: StrategyBatch, eff: EfficiencyProfile) -> ComputeRates:
    """Peak and efficiency for the batch's compute dtype. Attention runs in bf16 (fp8
    recipes keep the attention core in bf16), at the bf16 peak; so does the output head
    (``ComputeRates.unquantised``)."""
    device = cluster.device
    dtype = batch.precision.compute_dtype
    fp8 = dtype == "fp8"
    attention_peak = device.peak_flops_for("bf16") if fp8 else device.peak_flops_for(dtype)

    def rates(gemm_dtype: str, unquantised: ComputeRates | None = None) -> ComputeRates:
        in_fp8 = gemm_dtype == "fp8"
        return ComputeRates(
            peak_flops=device.peak_flops_for(gemm_dtype),
            gemm_eff=eff.fp8_gemm_rate_share if in_fp8 else eff.gemm_efficiency,
            knee=eff.gemm_knee,
            grouped_factor=eff.grouped_gemm_factor,
            attention_rate=attention_peak * eff.attention_efficiency * eff.flex_share,
            # never faster than the causal kernel (a fitted attention_efficiency may fall below it)
            masked_attention_rate=attention_peak * min(eff.figure("masked_attention_efficiency"), eff.attention_efficiency),
            linear_attention_rate=attention_peak * eff.linear_attention_efficiency,
            hbm_rate=device.hbm_bandwidth_bytes_per_s * eff.hbm_efficiency,
            operand_bytes=1.0 if in_fp8 else 2.0,
            expert_latency=eff.expert_gemm_latency,
            wgrad_accum_bytes=(2.0 * batch.precision.grad_bytes if eff.gradient_accumulation_fusion
                               else float(batch.precision.activation_bytes)),
            wgrad_add_bytes=(0.0 if eff.gradient_accumulation_fusion
                             else batch.precision.activation_bytes + 2.0 * batch.precision.grad_bytes),
            depth_knee=eff.fp8_gemm_depth_knee if in_fp8 else eff.gemm_depth_knee,
            optimizer_rate=device.hbm_bandwidth_bytes_per_s * eff.figure("optimizer_efficiency"),
            unquantised=unquantised,
        )

    return rates("fp8", unquantised=rates("bf16")) if fp8 else rates(dtype)


def unfused_rates(cluster: Cluster, batch: StrategyBatch, eff: EfficiencyProfile) -> ComputeRates | None:
    """The batch's rates with gradient-accumulation fusion off, where ``eff`` fuses and the
    runtime's rules may turn it off for some rows (``perf.accumulation``; ``LayerContext.unfused_rates``),
    else None."""
    if not rules_apply(eff):
        return None
    return compute_rates(cluster, batch, eff.replace(gradient_accumulation_fusion=False))


def strategy_overlap_flags(batch: StrategyBatch, overlap: OverlapConfig) -> Array:
    """1 where expert all-to-alls overlap with compute (the switch, or DualPipeV when unset)."""
    dualpipev = CODES["schedule"].index("dualpipev")
    on = (batch.schedule == dualpipev) if overlap.ep is None else np.full(len(batch), overlap.ep)
    return np.asarray(on, dtype=np.int64)


def ep_pairing(model: ModelSpec, batch: StrategyBatch, flags: Array) -> tuple[Array, Array, Array]:
    """(unpaired forwards, forwards, pairing code) of each strategy's first stage where its
    expert all-to-all overlaps (``flags``, a MoE model, ep > 1), from the schedule
    (``schedule.pairing``), counted once per distinct (schedule, pp, vpp, micro-batches,
    sequence chunks); (0, 1) elsewhere. The code (0 elsewhere, else 1 + that tuple's index) is
    small, so layer configurations key on it rather than on the counts."""
    code, counted = ep_pairing_codes(model, batch, flags)
    return counted[code, 0], counted[code, 1], code


def ep_pairing_codes(model: ModelSpec, batch: StrategyBatch, flags: Array) -> tuple[Array, Array]:
    """``ep_pairing``'s pairing code of each strategy and the [codes, 2] (unpaired forwards,
    forwards) of each code, without spreading the counts over the batch: ``evaluate`` reads
    them at a row per layer configuration (two batch-length arrays and a gather less)."""
    code = np.zeros(len(batch), dtype=np.int64)
    elsewhere = np.array([[0, 1]], dtype=np.int64)
    if "moe" not in model.layer_mlp_kinds:
        return code, elsewhere
    on = np.flatnonzero((np.asarray(flags) > 0) & (batch.ep > 1))
    if not len(on):
        return code, elsewhere
    fields = ("schedule", "pp", "vpp", "num_micro_batches", "seq_chunks")
    columns = [getattr(batch, name)[on] for name in fields]
    codes, count = row_codes(columns)
    counted = np.array([unpaired_forwards(CODES["schedule"][int(columns[0][row])],
                                          *(int(c[row]) for c in columns[1:]))
                        for row in first_of_codes(codes, count).tolist()], dtype=np.int64).reshape(count, 2)
    code[on] = codes + 1
    return code, np.concatenate([elsewhere, counted])


def strategy_columns(model: ModelSpec, batch: StrategyBatch, overlap: OverlapConfig) -> dict[str, Array]:
    """The batch as float arrays, plus the derived ``ep_overlap`` switch and its pairing."""
    cols = {name: getattr(batch, name).astype(np.float64) for name in StrategyBatch.array_fields()}
    flags = strategy_overlap_flags(batch, overlap)
    cols["ep_overlap"] = flags.astype(np.float64)
    unpaired, passes, _ = ep_pairing(model, batch, flags)
    cols["ep_unpaired"], cols["ep_passes"] = unpaired.astype(np.float64), passes.astype(np.float64)
    return cols


def piece_params(model: ModelSpec) -> dict[str, tuple[float, float, float]]:
    """Parameters of each piece kind (dense, moe, emb, head+MTP): (non-expert that tensor
    parallelism splits, non-expert every tensor-parallel rank keeps whole, routed experts)."""
    out: dict[str, tuple[float, float, float]] = {}
    for kind in ("dense", "moe"):
        if kind in model.layer_mlp_kinds or (model.mtp_depth and model.mtp_mlp_kind == kind):
            split = non_expert_split(model, kind)  # type: ignore[arg-type]
            routed = layer_params(model, kind).routed_experts  # type: ignore[arg-type]
            out[kind] = (float(split.sharded), float(split.whole), float(routed))
        else:
            out[kind] = (0.0, 0.0, 0.0)
    table = float(model.vocab_size * model.hidden_size)  # vocabulary-parallel
    out["emb"] = (table, 0.0, 0.0)
    head = (0.0 if model.tie_word_embeddings else table, float(norm_params(model, model.hidden_size)), 0.0)  # final norm: whole
    if model.mtp_depth:
        layer, extra = out[model.mtp_mlp_kind], mtp_extra_split(model)
        head = (head[0] + model.mtp_depth * (extra.sharded + layer[0]),
                head[1] + model.mtp_depth * (extra.whole + layer[1]), model.mtp_depth * layer[2])
    out["head"] = head
    return out


def distinct_layer_configs(ints: dict[str, Array], dp_config: Array, dp_rows: Array, weight_grad_rebuilds: bool = False,
                           defers_fsdp_reduce: bool = False, mtp: bool = False,
                           unfused: Array | None = None) -> tuple[Array, Array]:
    """(first row of each distinct layer configuration, the configuration code of every row).

    FSDP's data-parallel size and shard group only matter when parameters are sharded, so they
    are zeroed otherwise; whether the schedule splits the backward only under full recompute
    with ``weight_grad_rebuilds`` (W's rebuilds, ``layer.decoder_layer``) or with sharded
    parameters (W's reduce, apart from B's gather); whether a pipeline defers FSDP's reduce only
    where it does (``defers_fsdp_reduce``, ``layer._fsdp_seconds``); whether full recompute
    limits its layers (``recompute_layers``, Megatron's block method) only for a model with MTP
    modules (``mtp``), which only the uniform method recomputes (``layer.head_piece``); and where
    given, ``unfused``, the rows whose launch adds its weight gradients apart (``layer.UNFUSED``).

    The fields of the DP configurations (``dp_config``: the codes of _DP_FIELDS; ``dp_rows``: a
    row of each) join the key as two codes worked out per DP configuration and taken per row:
    the rank of the degrees (tp, cp, ep, etp) and that of the sharded parameters' fields. Each
    stands for a run of adjacent columns in their order, so the configurations are numbered as
    by the columns themselves, for two passes over the batch instead of about thirty (1M
    DeepSeek-V3 strategies: 9 of 19 columns).
    """
    at = {name: ints[name][dp_rows] for name in _DP_FIELDS}
    sharded = (at["zero"] >= 3) | (at["fsdp"] > 0)
    degrees, _ = row_codes([at[name] for name in _LAYER_DEGREES])
    fsdp, _ = row_codes([
        sharded,
        at["dp"] * at["cp"] * sharded,
        at["shard_group"] * sharded,
        at["reshard_after_forward"] * sharded,
        sharded & (at["pp"] > 1) & defers_fsdp_reduce,
        sharded & (at["optimizer_offload"] > 0),  # (FSDP2's CPU offload copies the shards: fsdp_cpu_offload)
        at["zero"] == 2,  # (ZeRO-2 copies its gradients in per micro-batch as FSDP does: layer._fsdp_copy_seconds)
    ])
    split = _SPLITS_BACKWARD.take(ints["schedule"])
    rebuilt = split & (ints["recompute"] == 2) & weight_grad_rebuilds
    columns = [degrees.take(dp_config)] + [ints[name] for name in _LAYER_FIELDS[len(_LAYER_DEGREES):]] + [
        rebuilt,
        fsdp.take(dp_config),
        sharded.take(dp_config) & split,
    ]
    if mtp:
        columns.append((ints["recompute"] == 2) & (ints["recompute_layers"] > 0))
    if unfused is not None:
        columns.append(unfused)
    config, count = row_codes(columns)
    return first_of_codes(config, count), config


class _RowColumns(dict[str, Array]):
    """The strategy columns at ``rows`` as float arrays, each gathered the first time it is read:
    the layer prices read about half of the batch's fields (~5% of their time went to gathering
    and converting the others). _DP_FIELDS are read at ``dp_rows`` instead, rows of the same
    DP configurations (the same values): a few hundred rows' cache lines rather than nearly
    every line of the column (1M DeepSeek-V3 strategies, 132,616 rows: ~1.2 ms a field)."""

    def __init__(self, columns: Mapping[str, Array], rows: Array, dp_rows: Array):
        super().__init__()
        self._columns, self._rows, self._dp_rows = columns, rows, dp_rows

    def __missing__(self, name: str) -> Array:
        value = self._columns[name][self._dp_rows if name in _DP_FIELDS else self._rows].astype(np.float64)
        self[name] = value
        return value


#: The strategy fields a group shares: the stage layout and the pipeline formula.
_GROUP_FIELDS = ("pp", "vpp", "schedule", "embedding_as_layer", "output_as_layer")


def _group_codes(batch: StrategyBatch) -> tuple[Array, int]:
    """(codes, count): one code per distinct (pp, vpp, schedule, embedding/output as layer), in
    that lexicographic order. ``row_codes`` gives each field its own radix, so no two tuples
    share a code whatever the degrees (a packed ``pp·64 + vpp`` made pp 2 × vpp 66 and pp 3 ×
    vpp 2 one group, priced on one layout)."""
    return row_codes([getattr(batch, name) for name in _GROUP_FIELDS])


@lru_cache(maxsize=64)
def _length_flops(model: ModelSpec, lengths: tuple[float, ...], policy: str, modules: tuple[str, ...]) -> tuple[Array, ...]:
    """``model_flops_per_micro_batch``'s figures of one sequence of each of ``lengths`` that
    ``_seq_flops`` reads: the model's FLOPs, what the full and the selective rebuild add to the
    forward, and with MTP modules what their full and selective rebuilds add (read-only arrays).
    A function of the model, the lengths and the recompute settings alone, which the calls of
    a search (and later searches) share: worked out once for them rather than once a call
    (five walks over the model's GEMMs, ~0.8 ms of Python a call for DeepSeek-V3)."""
    x = np.asarray(lengths, dtype=np.float64)

    def rebuild(**settings: Any) -> Array:
        return np.asarray(model_flops_per_micro_batch(model, 1.0, x, **settings).recompute_forward)

    figures = [np.asarray(model_flops_per_micro_batch(model, 1.0, x).model), rebuild(recompute_full_fraction=1.0),
               rebuild(recompute_selective_fraction=1.0, selective_policy=policy, recompute_modules=modules)]
    if model.mtp_depth:
        figures += [rebuild(recompute_mtp_full=1.0),
                    rebuild(recompute_mtp_selective=1.0, selective_policy=policy, recompute_modules=modules)]
    for value in figures:
        value.flags.writeable = False
    return tuple(figures)


def _rebuilt_flops(per_length: list[Array], recomputed: Array, recompute: Array, every: Array | bool) -> Array:
    """``_seq_flops``' hardware FLOPs from the figures of each strategy's length (``per_length``,
    as ``_length_flops`` gives them), the fraction of its layers rebuilt, its recompute code and
    whether MTP modules are rebuilt whole (``every``), arrays that broadcast together."""
    base, extra_full, extra_sel = per_length[:3]
    hardware = extra_full * recomputed * (recompute == 2) + base
    hardware = hardware + extra_sel * recomputed * (recompute == 1)
    if len(per_length) > 3:
        hardware = hardware + (per_length[3] * every + per_length[4] * (recompute == 1))
    return hardware


def _seq_flops(model: ModelSpec, seq: Array, recompute: Array, limited: Array, limited_fraction: Array,
               policy: str = "megatron", modules: tuple[str, ...] = ()) -> tuple[Array, Array]:
    """(model, hardware) FLOPs of one sequence, priced once per distinct sequence length:
    hardware = model + full · the full rebuild's + selective · the selective rebuild's, where
    full (selective) is the fraction of layers rebuilt on the strategies whose ``recompute``
    code is 2 (1), else 0: all of them (1), but on the rows ``limited`` (recompute on, with a
    limit of layers), whose fractions are ``limited_fraction``; ``policy`` is the profile's
    selective_recompute, ``modules`` the batch's recompute modules. MTP modules add their own
    rebuild: selective as in a decoder layer, full where every layer is rebuilt (full
    recompute without a limit, Megatron's uniform method; the block method skips them).

    Every row but the limited ones is a function of (length, recompute code): worked out once
    per pair, in a [lengths, codes] table, and taken from it. Each figure is the same
    operations on the same operands as worked out per row (a factor 0 or 1 gives 0 or the
    product), so the same bits, for a few passes over the batch rather than a score."""
    codes, count = dense_codes(seq)
    lengths = seq[first_of_codes(codes, count)].astype(np.float64)
    per_length = _length_flops(model, tuple(lengths.tolist()), policy, modules)
    kinds = np.arange(len(CODES["recompute"]))
    table = _rebuilt_flops([figure[:, None] for figure in per_length], (kinds > 0).astype(np.float64), kinds,
                           kinds == 2)
    hardware = table.ravel().take(codes * len(kinds) + recompute)
    if len(limited):
        hardware[limited] = _rebuilt_flops([figure.take(codes[limited]) for figure in per_length], limited_fraction,
                                           recompute[limited], False)
    return per_length[0].take(codes), hardware


def _exposed_step(comm: Array, cover: Array, floor: Array, hide: bool, share: Array | float = 0.0) -> Array:
    """Per-step collective under ``cover`` seconds, never below ``floor`` seconds (its last
    bucket, which has no compute left to hide under), plus ``share`` of the part that hides
    (the compute it slows by holding SMs, ``topology.collective_sm_share``)."""
    if not hide:
        return comm
    exposed = np.maximum(comm - cover, floor)
    if np.any(share):  # (np.clip costs several times a minimum of a maximum)
        exposed = exposed + share * np.minimum(np.maximum(comm - floor, 0.0), cover)
    return np.asarray(exposed)


#: Megatron-Core's default DDP bucket (DistributedDataParallel.__init__, --ddp-bucket-size unset):
#: max(40,000,000, 1,000,000 · data-parallel size) parameters, the data-parallel size without CP.
MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PER_DP = 40_000_000.0, 1_000_000.0


def grad_bucket_params(eff: EfficiencyProfile, overlap: OverlapConfig, dp: Array, grad_bytes: float) -> Array:
    """Parameters per gradient bucket of the data-parallel reduce, per strategy's ``dp``: the
    overlap's ``dp_bucket_params`` where given (Megatron's --ddp-bucket-size), else the runtime's
    default: Megatron-Core max(40e6, 1e6·dp), PyTorch DDP ``ddp_bucket_cap_mb`` MiB of gradients."""
    dp = np.asarray(dp, dtype=np.float64)
    if overlap.dp_bucket_params is not None:
        return np.full(dp.shape, float(overlap.dp_bucket_params))
    if eff.grad_buckets == "ddp":
        return np.full(dp.shape, eff.ddp_bucket_cap_mb * 2.0**20 / grad_bytes)
    return np.maximum(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PER_DP * dp)


def last_bucket_params(stage_params: Array, first_params: Array | float, bucket: Array) -> Array:
    """Parameters in the last bucket a stage's backward fills, per device. Buckets are cut in
    reverse order of the parameters (Megatron-Core's _ParamAndGradBuffer, DDP's
    compute_bucket_assignment_by_size), a bucket closing once it holds ``bucket`` parameters,
    so the last holds what the others leave of the stage's parameters after the ones it always
    holds whole, ``first_params`` (the token table on the first stage, a tensor no bucket
    splits, whose gradient the backward makes last): first + (rest - bucket·(ceil(rest/bucket) - 1)),
    the remainder in (0, bucket] (tensors counted as if they split at the bucket's edge)."""
    stage = np.asarray(stage_params, dtype=np.float64)
    first = np.minimum(np.asarray(first_params, dtype=np.float64), stage)
    rest = stage - first
    remainder = np.where(rest > 0, rest - bucket * (np.ceil(rest / bucket) - 1.0), 0.0)
    return np.asarray(first + remainder)


def optimizer_bytes_per_param(precision: PrecisionPolicy, kernel: str, clip: bool = True) -> float:
    """HBM bytes Adam's update moves per local parameter, with gradient clipping (``clip``).

    fused (one pass): read the gradient, both states and the master weights, write the states and
    the master weights (and the bf16 copy where a master is kept); clipping reads the gradient
    and the runtime zeroes it for the next step (2 gradient widths).
    foreach (torch.optim.AdamW(foreach=True), one multi-tensor kernel per op): weight decay and
    the final addcdiv read and write the weights (4 widths), lerp_ and addcdiv the first moment
    (3), mul_, addcmul_ and sqrt the second (5), sqrt's temporary is written, divided, shifted and
    read (6, state width), lerp_ and addcmul_ read the gradient (2); clip_grad_norm_ reads the
    gradient and scales it in place (3); zero_grad(set_to_none) writes nothing. Counted for
    Adam's two states; an optimizer with other states is priced as one fused pass.
    """
    master = precision.master_weight_bytes or precision.param_bytes
    bf16_copy = precision.param_bytes if precision.master_weight_bytes else 0
    grad = precision.grad_bytes
    if kernel == "foreach" and precision.optimizer_states == 2:  # counted for Adam; others as one pass
        return 4 * master + 14 * precision.optimizer_state_bytes + 2 * grad + bf16_copy + (3 * grad if clip else 0)
    states = precision.optimizer_states * precision.optimizer_state_bytes
    return grad + 2 * (states + master) + bf16_copy + (2 * grad if clip else 0)


def _dp_raw(
    batch: StrategyBatch, c: dict[str, Array], ne: Array, ex: Array, fabric: Fabric, optimizer_rate: float,
    host_bw: float, cpu_params_per_s: float, foreach: bool = False, defers_fsdp_reduce: bool = False,
    fsdp_cpu_offload: bool = False,
) -> tuple[Array, Array, Array, Array]:
    """(gradient collectives, the part of them across shard groups, parameter all-gather,
    optimizer) seconds, before overlap,
    of a stage holding ``ne`` non-expert and ``ex`` expert parameters per device; the update moves
    its bytes at ``optimizer_rate`` (``foreach``: torch's multi-kernel AdamW, else a fused one).
    The gradient collectives come once per pipeline run, the rest once per step; but FSDP under a
    pipeline that defers its reduce (``defers_fsdp_reduce``) reduce-scatters the stage's gradients
    once per run and, without resharding after forward, gathers its parameters once per run."""
    prec = batch.precision
    t, e, x = c["tp"], c["ep"], c["etp"]
    replicas = c["dp"] * c["cp"]
    edp = replicas * t / (e * x)
    zero = c["zero"]
    sharded3 = (zero >= 3) | (c["fsdp"] > 0)
    g_ne, g_ex = ne * prec.grad_bytes, ex * prec.grad_bytes
    experts = np.asarray(ex) > 0  # no expert collectives (not even their latencies) without experts
    all_reduce = (coll.all_reduce_s(g_ne, replicas, group_link(replicas, t, fabric, "ring"))
                  + np.where(experts, coll.all_reduce_s(g_ex, edp, group_link(edp, e * x, fabric, "ring")), 0.0))
    # ZeRO shards over the shard groups (HSDP / distributed-optimizer instances: the replica's
    # ranks split into groups), then all-reduces each shard across the groups.
    shard, expert_shard = shard_groups(c["dp"], c["cp"], t, e, x, c["shard_group"])
    ne_link = group_link(shard, t, fabric, "ring")
    ex_link = group_link(expert_shard, e * x, fabric, "ring")
    groups = replicas / shard
    across = group_link(groups, t * shard, fabric, "ring")
    cross = coll.all_reduce_s(g_ne / shard, groups, across) + np.where(
        experts, coll.all_reduce_s(g_ex / expert_shard, groups, across), 0.0)
    reduce_scatter = coll.reduce_scatter_s(g_ne, shard, ne_link) + np.where(
        experts, coll.reduce_scatter_s(g_ex, expert_shard, ex_link), 0.0)
    # The distributed optimizer gathers the updated weights as the forward keeps them: fp8
    # parameters (Megatron's --fp8-param-gather) at their gather width.
    width = prec.param_gather_bytes if prec.fp8_params else prec.param_bytes
    gather = (coll.all_gather_s(ne * width, shard, ne_link)
              + np.where(experts, coll.all_gather_s(ex * width, expert_shard, ex_link), 0.0))
    grad = np.where(sharded3, cross, np.where(zero == 0, all_reduce, reduce_scatter + cross))
    params_ag = np.where((zero >= 1) & ~sharded3, gather, 0.0)
    if defers_fsdp_reduce:
        deferred = sharded3 & (c["pp"] > 1)
        grad = np.where(deferred, reduce_scatter + cross, grad)
        fsdp_gather = (coll.all_gather_s(ne * prec.param_gather_bytes, shard, ne_link)
                       + np.where(experts, coll.all_gather_s(ex * prec.param_gather_bytes, expert_shard, ex_link), 0.0))
        params_ag = np.where(deferred & (c["reshard_after_forward"] == 0), fsdp_gather, params_ag)

    local = ne / np.where(zero >= 1, shard, 1.0) + ex / np.where(zero >= 1, expert_shard, 1.0)
    per_param = optimizer_bytes_per_param(prec, "foreach" if foreach else "fused")
    update = local * per_param / optimizer_rate
    offload = local * (prec.grad_bytes + prec.param_bytes) / host_bw + local / cpu_params_per_s
    if fsdp_cpu_offload:
        # FSDP2's CPU offload: the shards' copies come with FSDP's gathers and reduces (here, a
        # deferring pipeline's once-a-run ones; layer._fsdp_pass_seconds, each micro-batch's),
        # and the CPU's Adam finds its operands on the host.
        on_host = sharded3 & (c["optimizer_offload"] > 0)
        grad = grad + np.where(on_host & (c["pp"] > 1) & defers_fsdp_reduce, local * prec.grad_bytes / host_bw, 0.0)
        params_ag = params_ag + np.where(on_host & (params_ag > 0), local * prec.param_bytes / host_bw, 0.0)
        offload = np.where(on_host, local / cpu_params_per_s, offload)
    # Megatron-Core's HybridDeviceOptimizer runs the device's share of the update (its kernels
    # launched first, asynchronously) beside the CPU's share, its copies and its step:
    # max(f · offloaded, (1 - f) · on the device), f the optimizer_offload_fraction.
    fraction = batch.optimizer_offload_fraction
    update = np.where(c["optimizer_offload"] > 0, np.maximum(fraction * offload, (1.0 - fraction) * update), update)
    # States and master weights kept on the host between steps come back before the step: the
    # reload, which starts as the gradients are finalised, is priced whole before the update (its
    # overlap with their reduce is not); the copy out overlaps the next forward.
    reload = local * (prec.optimizer_states * prec.optimizer_state_bytes + prec.master_weight_bytes) / host_bw
    update = update + np.where(c["offload_optimizer_states"] > 0, reload, 0.0)
    # The gradient norm's all-reduce: latency-bound, 2·ceil(log2(world)) tree steps; a world of
    # one rank has nothing to reduce.
    world = c["dp"] * c["cp"] * c["tp"] * c["pp"]
    norm = np.where(world > 1, 2.0 * np.ceil(np.log2(np.maximum(world, 2.0))) * fabric.scaleout_latency, 0.0)
    return grad, np.where(zero >= 1, cross, 0.0), params_ag, update + norm


@dataclass(frozen=True)
class _Priced:
    """What every group reads: per-configuration piece times and the run's settings."""

    model: ModelSpec
    batch: StrategyBatch
    eff: EfficiencyProfile
    overlap: OverlapConfig
    rates: ComputeRates
    fabric: Fabric
    per_pass: dict[tuple[str, str], Array]  # [configs] seconds per (piece, pass), all categories
    per_cat: dict[tuple[str, str], Array]  # [configs] seconds per (piece, category), all passes
    table: Array  # [configs, quantities (F, B, W, categories), pieces] of the two above
    params: dict[str, tuple[float, float, float]]
    host_bw: float
    pipeline: PipelineMethod
    #: _DP_FIELDS as floats, one value per DP configuration (``evaluate``'s codes)
    dp_fields: dict[str, Array]
    #: The categories the table holds: every one but ``offload`` where the batch offloads nothing
    #: (a column of zeros costs ~3% of a search's pricing).
    categories: tuple[str, ...] = CATEGORIES
    #: Categories but dp that no layer configuration has (ep without experts): zeros for every
    #: strategy, which ``evaluate`` fills rather than the groups.
    idle: frozenset[str] = frozenset()


def _piece_table(pieces: Mapping[str, PieceTimes], n: int, categories: tuple[str, ...]) -> tuple[
        Array, dict[tuple[str, str], Array], dict[tuple[str, str], Array]]:
    """([configs, quantities, pieces] seconds, per_pass, per_cat): every pass (F, B, W) and
    category of each piece (quantities: PASSES + ``categories``); per_pass[(piece, pass)] sums
    the pass's categories, per_cat[(piece, category)] the category's passes (F + B + W), [configs]
    each. Recompute pieces count in B (the rebuilt forward), W (a runtime's rebuilds per
    parameter group) and in the categories."""
    quantities = PASSES + categories
    # Summed in place into contiguous [quantity, piece] rows, then transposed in one copy:
    # writing each strided column of [configs, quantities, pieces] directly takes twice as long.
    # The sums run in the order PieceTimes.total and a plain sum from 0.0 take, the same bits.
    by_quantity = np.zeros((len(quantities), len(PIECES), n))
    for j, name in enumerate(PIECES):
        piece = pieces[name]
        for i, quantity in enumerate(quantities):
            if quantity in PASSES:
                terms = [value for (pass_, _), value in piece.seconds.items() if pass_ == quantity]
            else:
                terms = [piece.get(pass_, quantity) for pass_ in PASSES]
            if name.startswith("rc_") and quantity == "F":
                continue  # recompute adds nothing to the forward (its entry stays 0)
            row = by_quantity[i, j]
            for value in terms:
                # A term 0.0 leaves the sum as it is (the sum, from +0.0, is never -0.0).
                if np.ndim(value) or value != 0.0:
                    np.add(row, value, out=row)
    table = np.ascontiguousarray(by_quantity.transpose(2, 0, 1))
    # per_pass and per_cat as (strided) views of the table: the groups gather a few rows of them
    per_pass = {(name, quantity): table[:, i, j] for j, name in enumerate(PIECES) for i, quantity in enumerate(PASSES)}
    per_cat = {(name, quantity): table[:, i, j] for j, name in enumerate(PIECES)
               for i, quantity in enumerate(quantities) if quantity not in PASSES}
    return table, per_pass, per_cat


def _p2p_seconds(model: ModelSpec, batch: StrategyBatch, fabric: Fabric, group_code: Array, dp_config: Array,
                 dp_rows: Array, scatter_gather: bool = False) -> Array:
    """Per strategy, seconds of one point-to-point send between pipeline stages (0 without a
    pipeline): one op's activation [mbs, seq/(cp·k), h] (/tp with SP), k = seq_chunks: Seq1F1B
    sends each of a micro-batch's k sub-sequences on its own (the schedule's ops and its
    transfer count, pipeline.p2p_hops, are per sub-sequence); 1 elsewhere. With
    ``scatter_gather`` (``EfficiencyProfile.pipeline_scatter_gather``) a TP rank without SP
    sends 1/tp of it and the receiver all-gathers the whole over TP, which the send includes.

    Where the stages at stride tp·cp·dp share a scale-up domain q at a time (the stride divides
    the domain, the pipeline spans more than one), only the hops between domains take the
    network: a transfer costs the mean over the chain's hops (``pipeline_crossing_share`` x of
    them cross), x·(scale-out send) + (1 - x)·(scale-up send). Before, every hop was priced at
    the network's rate once any crossed.

    The share is a function of (pp, tp·cp·dp, schedule, vpp) alone: worked out once per
    distinct (``_group_codes``' ``group_code``, which holds the first and the last, stride) (a few
    dozen in a million strategies) and gathered, rather than through a score of [n]
    temporaries; the mean only on the rows whose share is strictly between 0 and 1. The
    stride is the DP configuration's (``dp_config``, ``dp_rows``: a row of each): worked out
    and ranked per configuration, its rank taken per row, which numbers the links as the
    strides would (two products and a renumbering of the batch's length less)."""
    scattered = (batch.sequence_parallel > 0) | (scatter_gather & (batch.tp > 1))
    t_sp = np.where(scattered, batch.tp, 1)
    divisor = batch.cp * t_sp
    divisor *= batch.seq_chunks
    p2p_bytes = (batch.micro_batch_size * batch.seq_length) / divisor
    p2p_bytes *= model.hidden_size * batch.precision.activation_bytes
    stride = batch.tp[dp_rows] * batch.cp[dp_rows]
    stride *= batch.dp[dp_rows]
    stride_rank, _ = dense_codes(stride)
    link_code, links = row_codes([group_code, stride_rank.take(dp_config)])
    first = first_of_codes(link_code, links)
    share = np.array([pipeline_crossing_share(CODES["schedule"][int(batch.schedule[i])], int(batch.pp[i]),
                                              int(batch.vpp[i]), int(stride[dp_config[i]]), fabric.domain)
                      for i in first])
    inside_bw = float(inside_bandwidth(fabric, 2.0))
    # Each link's latency and bandwidth (the network's where every hop crosses), taken per row:
    # latency + bytes / bandwidth, the sum and quotient of scale-up or scale-out sends as such.
    # Without a pipeline nothing is sent: latency 0 and an infinite bandwidth give +0.0.
    crossing, single = share >= 1.0, batch.pp[first] <= 1
    latency = np.where(single, 0.0, np.where(crossing, fabric.scaleout_latency, fabric.scaleup_latency))
    bandwidth = np.where(single, np.inf, np.where(crossing, fabric.scaleout_bw, inside_bw))
    p2p = np.divide(p2p_bytes, bandwidth.take(link_code))
    p2p += latency.take(link_code)
    mixed = np.flatnonzero((share > 0.0) & (share < 1.0) & ~single)  # the links some hops of which cross
    if len(mixed):
        rows = np.flatnonzero(np.isin(link_code, mixed))
        x, sent = share.take(link_code[rows]), p2p_bytes[rows]
        p2p[rows] = (x * (fabric.scaleout_latency + sent / fabric.scaleout_bw)
                     + (1.0 - x) * (fabric.scaleup_latency + sent / inside_bw))
    gathered = np.flatnonzero(scattered & (batch.sequence_parallel == 0) & (batch.pp > 1))
    if len(gathered):
        # Megatron-LM's scatter/gather: the receiver's TP ranks rebuild the activation from their
        # pieces (gather_split_1d_tensor), an all-gather over the TP group at stride 1.
        tp = batch.tp[gathered].astype(np.float64)
        p2p[gathered] += coll.all_gather_s(p2p_bytes[gathered] * tp, tp, group_link(tp, 1.0, fabric, "ring"))
    return p2p


def _keeps_table_copy(model: ModelSpec, layout: StageLayout) -> float:
    """1 where the output stage keeps its own copy of the token table: the embedding and the head
    on different stages, and the table tied or read by MTP modules (memory.stages: head_on_output,
    embedding_copy_for_mtp); else 0."""
    apart = layout.stage_of[0] != layout.stage_of[-1]
    return float(apart and bool(model.tie_word_embeddings or model.mtp_depth))


@dataclass(frozen=True)
class _DPStage:
    """One stage layout's per-step DP and optimizer figures, [u] per DP configuration of its pp
    (``_dp_stage``), on the stage holding the most parameters per device."""

    position: Array  # [DP configurations] each one's index in the arrays below (-1: another pp)
    heavy: Array | None  # the heaviest stage's profile (None: one profile)
    share: Array  # a layer's share of its parameters (FSDP's unit)
    zero: Array  # the ZeRO stage
    unbucketed: Array  # Megatron-Core's later heavy stage, reduced as one bucket
    behind: Array  # the stages still running backwards after the heavy one
    grad_raw: Array  # the gradient collectives, the part across shard groups, the parameter
    cross_raw: Array  # all-gather, before overlap (``_dp_raw``)
    gather_raw: Array
    optimizer: Array
    grad_floor: Array  # what stays exposed of them (the last bucket, FSDP's last unit)
    gather_floor: Array
    #: Where any is unbucketed: the first stage's profile, its raw gradient collectives and
    #: all-gather and its last bucket's (Megatron-Core's first stage, whose own last bucket stays
    #: exposed beside a later heavy stage's).
    first_stage: tuple[int, Array, Array, Array, Array] | None
    table_grad: Array | None  # the tied table's gradient summed between stages (None: no copy)
    #: the share of the SMs the gradient collectives and the all-gather hold while they hide
    #: (``topology.collective_sm_share``; 0-d where none is priced)
    grad_sm: Array
    gather_sm: Array


def _dp_stage(pr: _Priced, layout: StageLayout) -> _DPStage:
    """``_price_group``'s figures that depend on the stage layout and the DP configuration
    alone, for every DP configuration of the layout's pp: worked out once per layout for the
    groups that share it (1M DeepSeek-V3 strategies: 43 groups, 21 layouts) rather than per
    group over the group's configurations, element by element either way (the same bits)."""
    members = np.flatnonzero(pr.dp_fields["pp"] == layout.pp)
    position = np.full(len(pr.dp_fields["pp"]), -1, dtype=np.int64)
    position[members] = np.arange(len(members))
    cu = {name: value[members] for name, value in pr.dp_fields.items()}
    dp_count = len(members)
    prof = layout.profile
    counts = {k: v for k, v in (("dense", prof["dense"]), ("moe", prof["moe"]), ("emb", prof["emb"]),
                                ("head", prof["head"])) if v.any()}
    zero_stages = np.zeros(len(layout.profile_count))
    split_stage, whole_stage, ex_stage = (sum((pr.params[p][i] * v for p, v in counts.items()), zero_stages)
                                          for i in range(3))
    # The output stage's own copy of a tied table (or of the embedding MTP modules read).
    split_stage = split_stage + (float(pr.model.vocab_size * pr.model.hidden_size) * prof["head"]
                                 * _keeps_table_copy(pr.model, layout))
    heavy: Array | None = None
    if len(layout.profile_count) > 1:  # the heaviest stage depends on tp and ep·etp only
        per_device = (np.multiply.outer(1.0 / cu["tp"], split_stage) + whole_stage
                      + np.multiply.outer(1.0 / (cu["ep"] * cu["etp"]), ex_stage))
        heavy_u = heavy = np.argmax(per_device, axis=1)
    else:
        heavy_u = np.zeros(dp_count, dtype=np.int64)
    share = 1.0 / np.maximum((prof["dense"] + prof["moe"])[heavy_u], 1.0)
    # What stays exposed once the backward's compute is done: the last gradient bucket, whose
    # reduce starts after the last gradient it holds (its all-gather after the update is
    # likewise the first the next forward waits on). Bucketed runtimes (ZeRO 0-2) cut buckets
    # by parameters (grad_bucket_params); FSDP/ZeRO-3 reduces unit by unit, a layer each, so
    # its last unit's share. Megatron-Core buckets the first pipeline stage alone: on a later
    # stage the stage's whole reduce is one bucket, started after its last backward and hidden
    # only under the backwards the stages before it still run (one micro-batch's each, a chunk's
    # under interleaving: _dp_seconds divides by vpp), while
    # the first stage's own last bucket stays exposed: the step waits for the later of the two.
    bucket = grad_bucket_params(pr.eff, pr.overlap, cu["dp"], pr.batch.precision.grad_bytes)
    sharded = (cu["zero"] >= 3) | (cu["fsdp"] > 0)
    unbucketed = (pr.eff.grad_buckets == "megatron") & (layout.profile_stage[heavy_u] > 0) & ~sharded

    def stages_and_last_buckets(*stages: Array, fabric: Fabric = pr.fabric
                                ) -> list[tuple[tuple[Array, ...], tuple[Array, ...]]]:
        """Per profile index array q of ``stages``, ``_dp_raw`` of q's stage per DP
        configuration: on all of its parameters per device, then on its last bucket's (the
        gradient collectives, the part across shard groups, the parameter all-gather). All in
        one call over [2·len(stages)·dp_count]: _dp_raw works element by element, so each part
        has the figures it has priced alone, for one call's fixed cost (~0.2 ms a layout) rather
        than one a stage and bucket."""
        params = []
        for q in stages:
            ne = split_stage[q] / cu["tp"] + whole_stage[q]
            ex = ex_stage[q] / (cu["ep"] * cu["etp"])
            last_ne = last_bucket_params(ne, pr.params["emb"][0] * prof["emb"][q] / cu["tp"], bucket)
            last_ex = last_bucket_params(ex, 0.0, bucket)
            params += [(ne, ex), (last_ne, last_ex)]
        priced = _dp_raw(pr.batch, {name: np.concatenate([value] * len(params)) for name, value in cu.items()},
                         np.concatenate([ne for ne, _ in params]), np.concatenate([ex for _, ex in params]), fabric,
                         pr.rates.optimizer_rate or pr.rates.hbm_rate, pr.host_bw, pr.eff.cpu_optimizer_params_per_s,
                         foreach=pr.eff.optimizer_kernel == "foreach",
                         defers_fsdp_reduce=pr.eff.pipeline_defers_fsdp_reduce, fsdp_cpu_offload=pr.eff.fsdp_cpu_offload)
        part = [tuple(x[i * dp_count:(i + 1) * dp_count] for x in priced) for i in range(len(params))]
        return [(part[2 * i], part[2 * i + 1]) for i in range(len(stages))]

    # Megatron-Core's first stage, whose own last bucket stays exposed beside a later heavy stage's
    # (``_price_group``): priced with the heavy stage, in the same call.
    q0 = int(np.flatnonzero(layout.profile_stage == 0)[0])
    any_unbucketed = bool(np.any(unbucketed))
    by_stage = (stages_and_last_buckets(heavy_u, np.full(dp_count, q0)) if any_unbucketed
                else stages_and_last_buckets(heavy_u))
    (grad_raw, cross_raw, gather_raw, optimizer), (grad_last, _, gather_last, _) = by_stage[0]
    first_stage = None
    if any_unbucketed:
        raw0, (grad0, _, gather0, _) = by_stage[1]
        first_stage = (q0, raw0[0], raw0[2], grad0, gather0)
    # The SMs the collectives hold while they hide (collective_sm_share): their bytes at the
    # scale-up rate, the same pricing over a fabric whose every link runs at it.
    grad_sm: Array | float = 0.0
    gather_sm: Array | float = 0.0
    if pr.eff.dp_comm_compute_share:
        (grad_full, _, gather_full, _), _ = stages_and_last_buckets(heavy_u, fabric=pr.fabric.at_scaleup_rate())[0]
        grad_sm = collective_sm_share(pr.eff, grad_full, grad_raw)
        gather_sm = collective_sm_share(pr.eff, gather_full, gather_raw)
    table_grad = None
    if _keeps_table_copy(pr.model, layout):
        # The embedding's table and the output stage's copy of it (tied, or read by the MTP
        # modules) take one gradient: summed between the two stages once the backward is done
        # (Megatron-Core's embedding group, finalize_model_grads), before the update, so exposed.
        # Sharded gradients (ZeRO-3/FSDP) are summed shard by shard.
        shards = np.where(cu["zero"] >= 3, cu["dp"] * cu["cp"], 1.0)
        table_bytes = (pr.model.vocab_size * pr.model.hidden_size / (cu["tp"] * shards)
                       * pr.batch.precision.grad_bytes)
        link = group_link(cu["pp"], cu["tp"] * cu["cp"] * cu["dp"], pr.fabric, "p2p")
        table_grad = np.asarray(coll.all_reduce_s(table_bytes, 2.0, link))
    return _DPStage(
        position=position, heavy=heavy, share=share, zero=cu["zero"], unbucketed=unbucketed,
        behind=layout.profile_stage[heavy_u].astype(np.float64),  # stages still running backwards after it
        grad_raw=grad_raw, cross_raw=cross_raw, gather_raw=gather_raw, optimizer=optimizer,
        grad_floor=np.where(unbucketed, 0.0, np.where(sharded, grad_raw * share, grad_last)),
        gather_floor=np.where(unbucketed, 0.0, np.where(sharded, gather_raw * share, gather_last)),
        first_stage=first_stage, table_grad=table_grad, grad_sm=np.asarray(grad_sm), gather_sm=np.asarray(gather_sm),
    )


def _price_group(
    pr: _Priced, layout: StageLayout, dp: _DPStage, cols: dict[str, Array], config: Array, name: str,
    recompute_layers: Array, p2p: Array, details: bool = True,
) -> dict[str, Array]:
    """Every _GROUP_KEYS array for strategies sharing one stage layout and schedule (``name``;
    arrays sliced), and where a recompute limit applies, those rows (``limited_rows``) and the
    share of layers they rebuild (``limited_fraction``);
    without ``details`` the DETAIL_KEYS that cost a pass of their own (the makespan, the
    bottleneck stage and its passes) are left out: no caller reads them."""
    g = len(config)
    rows = np.arange(g)
    prof = layout.profile
    # Stage sums are tabulated per distinct configuration of the group ([u, quantity, P], one
    # matrix product) and gathered. The recompute pieces are zero for configurations without
    # recompute and cover every layer unless recompute_layers limits them: only those rows
    # get a correction.
    local, u = dense_codes(config)
    # The distinct configurations in code order, each written by its rows (one scatter; finding
    # a row of each and gathering took ~1.3 ms more over 1M DeepSeek-V3 strategies' 43 groups).
    group_configs = np.empty(u, dtype=config.dtype)
    group_configs[local] = config
    piece_counts = np.stack([prof["dense"], prof["moe"], prof["emb"], prof["head"], prof["dense"], prof["moe"],
                             prof["head"] * _keeps_table_copy(pr.model, layout)])
    quantities = pr.table.shape[1]
    # [u, quantities, P] as one 2-D product (a stack of [quantities, pieces] matrices would
    # run a tiny product per configuration). The configurations' rows are taken with np.take,
    # which copies each [quantities, pieces] row whole: the fancy index pr.table[group_configs]
    # moves the same bytes at half the speed (1M DeepSeek-V3 strategies' 43 groups: ~30 -> ~15 ms).
    tables = (np.take(pr.table, group_configs, axis=0).reshape(u * quantities, -1) @ piece_counts).reshape(
        u, quantities, -1)
    # The rows a recompute limit applies to: one set, and recompute on (read at those rows alone).
    limited = np.flatnonzero(recompute_layers > 0)
    partial = limited[pr.batch.recompute[cols["row"][limited]] > 0]
    if len(partial):
        rd, rm = recomputed_layers(layout, recompute_layers[partial])
        delta_d, delta_m = rd - prof["dense"], rm - prof["moe"]
    # Each pass's [u, P] block is strided in tables: np.take copies such an input whole before
    # gathering from it, so the rows are gathered from the contiguous [u·quantities, P] view at
    # local·quantities + pass instead (~3x faster; the same numbers moved).
    rows_of = local * quantities
    by_quantity = tables.reshape(u * quantities, -1)
    stage = {p: np.take(by_quantity, rows_of + i if i else rows_of, axis=0) for i, p in enumerate(PASSES)}
    if len(partial):
        for pass_ in ("B", "W"):
            stage[pass_][partial] += (pr.per_pass[("rc_dense", pass_)][config[partial], None] * delta_d
                                      + pr.per_pass[("rc_moe", pass_)][config[partial], None] * delta_m)
    f, b, w = stage["F"], stage["B"], stage["W"]

    # A step runs the schedule ``runs`` times over m micro-batches each (gradient accumulation
    # outside the pipeline): the makespan and its parts are one run's, paid ``runs`` times.
    m, runs = cols["num_micro_batches"], cols["pipeline_runs"]
    seconds = _StageSeconds.of(f, b, w)
    per_mb, star, t_star = seconds.per_mb, seconds.star, seconds.t_star
    star_at = rows * per_mb.shape[1] + star
    makespan, p2p_part, chunk_seconds = _makespan(pr, layout, name, seconds, config, local, u, recompute_layers, cols,
                                                  p2p)

    out: dict[str, Array] = {}  # (no offload_s where the batch offloads nothing: ``evaluate``'s zeros)
    # Each strategy's categories on its bottleneck stage: the tables' categories made rows of
    # [configuration·stage profile, categories] (a small copy) and taken whole per strategy, one
    # take of a row (a cache line) rather than one take per category at flat positions of the
    # tables (1M DeepSeek-V3 strategies' 43 groups, with the step counts' product: 22.1 -> 13.1 ms).
    stages = tables.shape[2]
    by_stage = np.ascontiguousarray(tables[:, len(PASSES):, :].transpose(0, 2, 1)).reshape(u * stages, -1)
    star_categories = np.take(by_stage, local * stages + star, axis=0)  # [g, categories]
    micro_batches = m * runs  # micro-batches per step
    for i, cat in enumerate(pr.categories):
        if cat in pr.idle:
            continue  # (+0.0 for every strategy: evaluate's zeros)
        at_star = star_categories[:, i]
        if len(partial):
            at_star[partial] += (pr.per_cat[("rc_dense", cat)][config[partial]] * delta_d[np.arange(len(partial)), star[partial]]
                                 + pr.per_cat[("rc_moe", cat)][config[partial]] * delta_m[np.arange(len(partial)), star[partial]])
        out["compute_s" if cat == "compute" else f"{cat}_s"] = micro_batches * at_star

    # DP and optimizer: on the stage holding the most parameters per device (``_dp_seconds``).
    dp_step, optimizer = _dp_seconds(pr, layout, dp, name, seconds, cols)

    out["dp_s"] = out["dp_s"] + dp_step
    out["dp_step_s"] = dp_step
    out["pp_s"] = runs * p2p_part
    out["bubble_s"] = runs * np.maximum(makespan - m * t_star - p2p_part, 0.0)
    if chunk_seconds is not None:
        out["chunk_seconds"] = chunk_seconds
    out["optimizer_update_s"] = optimizer
    out["optimizer_s"] = optimizer + pr.eff.step_overhead_s
    if details:
        out["makespan_s"] = runs * makespan
        out["stage_forward_s"] = np.take(f, star_at)
        out["stage_backward_s"] = np.take(b, star_at)
        out["stage_weight_grad_s"] = np.take(w, star_at)
        out["bottleneck_stage"] = layout.profile_stage[star].astype(np.float64)
    if len(partial):
        # The share of layers rebuilt where a limit applies (every layer elsewhere, where recompute
        # is on: ``evaluate`` takes that from the batch).
        out["limited_rows"] = partial
        out["limited_fraction"] = ((rd + rm) @ layout.profile_count) / pr.model.num_layers
    return out


@dataclass(frozen=True)
class _StageSeconds:
    """A group's seconds of one micro-batch on each stage profile, [g, P]: its forward ``f``,
    input-gradient backward ``b`` (the whole backward where the schedule does not split it) and
    weight gradient ``w``, and their sum ``per_mb``; per strategy [g] the bottleneck stage
    profile ``star`` (the largest sum) and that sum, ``t_star``."""

    f: Array
    b: Array
    w: Array
    per_mb: Array
    star: Array
    t_star: Array

    @classmethod
    def of(cls, f: Array, b: Array, w: Array) -> _StageSeconds:
        """The seconds of passes ``f``, ``b``, ``w`` [g, P], with their sum and bottleneck."""
        per_mb = f + b + w
        star = np.argmax(per_mb, axis=1) if per_mb.shape[1] > 1 else np.zeros(len(per_mb), dtype=np.int64)
        # [g, P] arrays read at one stage per strategy: np.take at flat positions (~2.5x faster
        # than the fancy index [rows, star])
        t_star = np.take(per_mb, np.arange(len(per_mb)) * per_mb.shape[1] + star)
        return cls(f, b, w, per_mb, star, t_star)


def _makespan(pr: _Priced, layout: StageLayout, name: str, seconds: _StageSeconds, config: Array, local: Array, u: int,
              recompute_layers: Array, cols: dict[str, Array], p2p: Array) -> tuple[Array, Array, Array | None]:
    """One pipeline run's makespan and its point-to-point part per strategy [g] (seconds), of
    the group's strategies (configurations ``config``, numbered ``local`` among ``u``) under
    schedule ``name``: in closed form where the search prices it (the simulator's timeline where
    too few micro-batches leave no steady state; interleaving's stalls and chain bound), else
    simulated; and for the simulated, the chunk seconds it ran [g, F/B/W, pp, vpp] (else None).

    Where the runtime's schedule waits for its sends (``EfficiencyProfile.p2p_wait``), each pass
    that sends on lasts its transfers longer (k of them a micro-batch, one per sub-sequence) and
    its output arrives as it ends: the makespan of those passes without hops, and the p2p part
    what they add to the makespan without transfers."""
    if layout.pp == 1 or not waits_for_sends(pr.eff.p2p_wait, name):
        return _timed_makespan(pr, layout, name, seconds, config, local, u, recompute_layers, cols, p2p, None)
    sent = p2p * cols["seq_chunks"]  # seconds a pass waits per send, a micro-batch's
    waited = _StageSeconds.of(seconds.f + sent[:, None] * layout.profile["sends_f"],
                              seconds.b + sent[:, None] * layout.profile["sends_b"], seconds.w)
    no_hops = np.zeros_like(p2p)
    makespan, _, chunk_seconds = _timed_makespan(pr, layout, name, waited, config, local, u, recompute_layers, cols,
                                                 no_hops, sent)
    unsent, _, _ = _timed_makespan(pr, layout, name, seconds, config, local, u, recompute_layers, cols, no_hops, None)
    return makespan, makespan - unsent, chunk_seconds


def _timed_makespan(pr: _Priced, layout: StageLayout, name: str, seconds: _StageSeconds, config: Array, local: Array,
                    u: int, recompute_layers: Array, cols: dict[str, Array], p2p: Array,
                    sent: Array | None) -> tuple[Array, Array, Array | None]:
    """``_makespan``'s timing, hops of ``p2p`` seconds between stages; ``sent`` [g]: seconds each
    pass that sends on lasts longer (its chunk seconds read with them), or None."""
    f, b, w, per_mb, star, t_star = seconds.f, seconds.b, seconds.w, seconds.per_mb, seconds.star, seconds.t_star
    m, k = cols["num_micro_batches"], cols["seq_chunks"]
    pp, vpp, g = layout.pp, layout.vpp, len(config)
    rows = np.arange(g)
    chunk_seconds = None
    # What the chunk seconds are functions of: the layer configuration and recompute limit, and
    # the waited sends' seconds where there are any (by their rank among the distinct values).
    sent_rank: list[Array] = [] if sent is None else [unique(sent, return_inverse=True)[1].ravel()]
    if pr.pipeline == "closed_form":
        makespan, p2p_part, _ = closed_form_makespan(
            name, float(pp), float(vpp), m, k, f, b, w, p2p, layout.profile_count, star, per_mb, layout.stage_profile,
            alike=[local, recompute_layers, m, *sent_rank],  # f, b, w are functions of the first two (and sent)
        )
        # Too few micro-batches for the closed form's steady state: the simulator's timeline, for
        # these strategies together, one per distinct (m, layer configuration, recompute, p2p).
        short = np.flatnonzero(~closed_form_holds(name, pp, m))
        if len(short):
            # Integer codes of the rows (p2p by its rank among the distinct values): a packed key
            # rather than np.unique(axis=0) over float rows, which sorts them (~4x slower). Each
            # strategy's simulated time depends on its own row alone, so the order does not matter.
            _, p2p_rank = unique((p2p if sent is None else sent)[short], return_inverse=True)
            code, count = row_codes([m[short], k[short], config[short], recompute_layers[short], p2p_rank.ravel()])
            distinct = short[first_of_codes(code, count)]  # a strategy of each distinct row
            span, part = np.zeros(count), np.zeros(count)
            shape, shapes = row_codes([m[distinct], k[distinct]])
            for j in range(shapes):
                members = np.flatnonzero(shape == j)
                at = distinct[members]
                fc, bc, wc = _chunk_seconds(pr, layout, config[at], recompute_layers[at], None if sent is None else sent[at])
                span[members], part[members] = simulated_makespan_batch(name, pp, vpp, int(m[at[0]]), int(k[at[0]]),
                                                                        fc, bc, wc, p2p[at])
            makespan, p2p_part = makespan.copy(), p2p_part.copy()
            makespan[short], p2p_part[short] = span[code], part[code]
        if name == "interleaved" and vpp > 1:
            # Unequal chunks on a stage stall the steady state every micro-batch: the layout's
            # stall (the simulator's, per unit layer), less what the bottleneck's margin over the
            # largest other stage absorbs (docs/time.md). A function of the strategy alone.
            grid = np.zeros((pp, vpp))
            grid[layout.stage_of, layout.chunk_of] = layout.chunk_dense + layout.chunk_moe
            stall = interleaved_stall(pp, tuple(grid.ravel().tolist()))
            if stall > 0:
                others = np.where(np.arange(per_mb.shape[1])[None, :] == star[:, None],
                                  np.where(layout.profile_count[star] > 1, per_mb[rows, star], 0.0)[:, None], per_mb)
                margin = 1.0 - others.max(axis=1) / t_star
                makespan = makespan + m * t_star * np.maximum(stall - margin, 0.0)
        if name == "interleaved" and vpp > 1:
            # The closed form sees stage totals; a chain through each stage's chunks bounds the
            # simulator from below (pipeline.interleaved_chain_bound): where it is longer, it is
            # the closer figure. The chunks once per distinct (layer configuration, recompute),
            # the chains once per distinct (those, m, p2p).
            chunks, chunk_count = ((local, u) if not recompute_layers.any() and sent is None
                                   else row_codes([config, recompute_layers, *sent_rank]))
            first = first_of_codes(chunks, chunk_count)
            ft, bt = _chunk_seconds_by_stage(pr, layout, config[first], recompute_layers[first],
                                             None if sent is None else sent[first])
            if np.array_equal(m[first][chunks], m) and np.array_equal(p2p[first][chunks], p2p):
                # The usual case: the configuration (micro-batch size, degrees) fixes m and p2p, and
                # each chunk configuration is one chain (no codes of the rows to work out).
                code, distinct, of = chunks, first, None
            else:
                _, p2p_rank = unique(p2p, return_inverse=True)
                code, count = row_codes([chunks, m, p2p_rank.ravel()])
                distinct = first_of_codes(code, count)
                of = chunks[distinct]
            bound, hops = interleaved_chain_bound_by_stage(ft, bt, m[distinct], p2p[distinct], of)
            longer = bound[code] > makespan
            if np.any(longer):
                makespan = np.where(longer, bound[code], makespan)
                p2p_part = np.where(longer, hops[code] * p2p, p2p_part)
    else:
        makespan, p2p_part = np.zeros(g), np.zeros(g)
        fc, bc, wc = _chunk_seconds(pr, layout, config, recompute_layers, sent)
        for j in range(g):
            makespan[j], p2p_part[j] = simulated_makespan(
                name, pp, vpp, int(m[j]), int(k[j]), fc[j], bc[j], wc[j], float(p2p[j]),
            )
        chunk_seconds = np.stack([fc, bc, wc], axis=1)  # what the simulator ran: [g, F/B/W, pp, vpp]
    return makespan, p2p_part, chunk_seconds


def _dp_seconds(pr: _Priced, layout: StageLayout, dp: _DPStage, name: str, seconds: _StageSeconds,
                cols: dict[str, Array]) -> tuple[Array, Array]:
    """Per strategy [g], seconds of a step's exposed data-parallel traffic (gradient reduces,
    parameter gathers, the embedding table's) and of its optimizer update."""
    f, b, w, per_mb = seconds.f, seconds.b, seconds.w, seconds.per_mb
    m, k, runs = cols["num_micro_batches"], cols["seq_chunks"], cols["pipeline_runs"]
    pp, vpp, rows = layout.pp, layout.vpp, np.arange(len(f))
    # On the stage holding the most parameters per device, priced once per DP
    # configuration of the layout (``_dp_stage``); only the overlap is per strategy. Every figure
    # that depends on the DP configuration alone (the raw collectives, the last bucket's, their
    # floors, which stage is heaviest and its layer share) is gathered once where a strategy's
    # own seconds enter: the same operations on the same values as per strategy, so the same
    # bits, with ~30 fewer passes over the group.
    dp_code = dp.position.take(cols["dp_config"])
    if dp.heavy is not None:
        heavy_at = rows * per_mb.shape[1] + dp.heavy[dp_code]
    else:
        heavy_at = rows
    f_heavy = np.take(f, heavy_at)
    window = np.take(b, heavy_at) + np.take(w, heavy_at)
    # (Which stages a group's strategies price beside the heavy one: read at its rows, as the
    # group's own DP configurations.)
    unbucketed_rows = dp.unbucketed[dp_code] if dp.first_stage is not None else None
    if unbucketed_rows is not None and not unbucketed_rows.any():
        unbucketed_rows = None
    if unbucketed_rows is not None:
        # The stages before a later one run one chunk each after its last backward (and before
        # its first forward): the cool-down (warm-up) of an interleaved schedule goes chunk by chunk.
        grad_cover = np.where(unbucketed_rows, dp.behind[dp_code] * window / vpp, window)
        gather_cover = np.where(unbucketed_rows, dp.behind[dp_code] * f_heavy / vpp, f_heavy)
    else:
        grad_cover, gather_cover = window, f_heavy
    grad_raw, cross_raw, gather_raw, share = dp.grad_raw, dp.cross_raw, dp.gather_raw, dp.share

    def sm_share(per_config: Array, codes: Array) -> Array | float:
        return per_config[codes] if per_config.ndim else 0.0

    grad = _exposed_step(grad_raw[dp_code], grad_cover, dp.grad_floor[dp_code], pr.overlap.dp_grad_reduce,
                         sm_share(dp.grad_sm, dp_code))
    # ZeRO-2 reduce-scatters every micro-batch: m - 1 more than ZeRO-1, each under its own
    # backward, unit by unit as an FSDP does (Megatron-FSDP's optim_grads, FSDP2 without
    # resharding: a layer's share exposed); the last one and the all-reduce across shard groups
    # run as ZeRO-1's do. (On its strategies alone.) The compute stream waits for a micro-batch's
    # reduces at the end of its backward (FSDP2's finalize_backward waits for the last
    # reduce-scatter's event), so what is exposed lengthens the heavy stage's period, and where
    # that stage is not the bottleneck its slack, t* less its own period, takes the first of it:
    # the steady state runs at max(t*, its period + exposed). (Added after the pipeline instead,
    # a faster device, which shrinks the backward that hides the reduces, could price a slower
    # step: up to 0.8% in benchmarks/time_invariants.py.)
    zero2 = np.flatnonzero((dp.zero == 2)[dp_code])
    if len(zero2):
        own = (grad_raw - cross_raw)[dp_code[zero2]]
        per_micro_batch = _exposed_step(own, window[zero2], ((grad_raw - cross_raw) * share)[dp_code[zero2]],
                                        pr.overlap.dp_grad_reduce, sm_share(dp.grad_sm, dp_code[zero2]))
        slack = seconds.t_star[zero2] - np.take(per_mb, heavy_at[zero2])
        grad[zero2] = (m[zero2] - 1) * np.maximum(per_micro_batch - slack, 0.0) + grad[zero2]
    gather = _exposed_step(gather_raw[dp_code], gather_cover, dp.gather_floor[dp_code], pr.overlap.dp_param_gather,
                           sm_share(dp.gather_sm, dp_code))
    if unbucketed_rows is not None and dp.first_stage is not None:
        # The first stage's own exposure, priced as the heavy stage's is where that is the first.
        q0, grad0_raw, gather0_raw, grad0, gather0 = dp.first_stage
        at0 = rows * per_mb.shape[1] + q0
        first_grad = _exposed_step(grad0_raw[dp_code], np.take(b, at0) + np.take(w, at0), grad0[dp_code],
                                   pr.overlap.dp_grad_reduce, sm_share(dp.grad_sm, dp_code))
        first_gather = _exposed_step(gather0_raw[dp_code], np.take(f, at0), gather0[dp_code], pr.overlap.dp_param_gather,
                                     sm_share(dp.gather_sm, dp_code))
        grad = np.where(unbucketed_rows, np.maximum(grad, first_grad), grad)
        gather = np.where(unbucketed_rows, np.maximum(gather, first_gather), gather)
    if pr.eff.pipeline_defers_fsdp_reduce and pp > 1:
        # FSDP under torch.distributed.pipelining: a chunk's reduce runs after its last backward
        # and the compute stream waits for it (exposed); a run's gathers, where parameters stay
        # gathered, come before its first forward, prefetched unit by unit (the first exposed).
        # (On its strategies alone.)
        deferred = np.flatnonzero((dp.zero >= 3)[dp_code])
        if len(deferred):
            code_d = dp_code[deferred]
            grad[deferred] = grad_raw[code_d]
            per_run = _exposed_step(gather_raw[code_d], f_heavy[deferred], (gather_raw * share)[code_d],
                                    pr.overlap.fsdp_prefetch, sm_share(dp.gather_sm, code_d))
            if vpp > ACTIVE_CHUNKS and np.any(gather_raw[dp_code] > 0):  # (the group's DP configurations)
                # More chunks on a rank than torch keeps gathered: some are freed and gathered again
                # within the run (schedule.unshard), prefetched under the run's compute.
                m_d = m[deferred]
                run_sizes, row_size = unique(m_d, return_inverse=True)
                again = np.array([chunk_gathers(name, pp, vpp, int(c), int(k[0])) for c in run_sizes],
                                 dtype=np.float64)[row_size] - vpp
                extra = gather_raw[code_d] * again / vpp
                cover = m_d * np.take(per_mb, heavy_at[deferred])
                per_run = per_run + (np.maximum(extra - cover, 0.0) if pr.overlap.fsdp_prefetch else extra)
            gather[deferred] = runs[deferred] * per_run
    # Each pipeline run ends in its own gradient reduce (the pipeline runtime syncs the gradients
    # at a run's last backward); ZeRO-1/2 gather the parameters once, after the update.
    dp_step = runs * grad
    dp_step += gather
    if dp.table_grad is not None:
        dp_step += dp.table_grad[dp_code]
    optimizer = dp.optimizer[dp_code]
    return dp_step, optimizer


def pricing_settings(cluster: Cluster, efficiency: Any, overlap: Any, software: Any) -> tuple[EfficiencyProfile, OverlapConfig]:
    """The efficiency profile (with the runtime's ``software`` facts) and overlap switches a
    pricing runs with, the device's defaults where None. The overlap may be written as
    ``parse_overlap`` reads it (a preset name, ``key=value`` pairs, a mapping). Anything else is
    an NdplanError naming the argument, not an AttributeError from deep in the time model."""
    if efficiency is not None and not isinstance(efficiency, EfficiencyProfile):
        raise NdplanError(f"efficiency must be an EfficiencyProfile (e.g. ndplan.perf.load_efficiency('profile.yaml')) "
                          f"or None (the device's), got {type(efficiency).__name__}")
    eff = with_software(efficiency or default_efficiency(cluster.device), software)
    return eff, parse_overlap(overlap) or default_overlap(cluster.device.runtime)


def evaluate(
    model: ModelSpec,
    batch: StrategyBatch,
    cluster: Cluster,
    *,
    efficiency: EfficiencyProfile | None = None,
    overlap: OverlapConfig | None = None,
    pipeline: PipelineMethod = "closed_form",
    stage_layers: tuple[int, ...] | None = None,
    details: bool = False,
    weight_grad_rebuilds: bool = False,
    software: Mapping[str, Any] | None = None,
) -> dict[str, Array]:
    """Step time and its parts for every strategy of ``batch`` (OUTPUT_KEYS, plus DETAIL_KEYS
    with ``details``; and, for a batch of one with the pipeline simulated, ``chunk_seconds``
    [1, 3, pp, vpp]: the F, B and W seconds per micro-batch of each stage's chunks the simulator
    ran). ``stage_layers`` overrides the uniform placement (a batch of one).
    ``weight_grad_rebuilds``: the runtime replays a checkpointed layer's forward once per
    parameter group in a split backward's W (torch.distributed.pipelining, the ``pytorch``
    runtime profile), which full recompute then pays under ZB-H1, ZB-V and DualPipeV.
    ``software``: facts of the runtime (``MemoryOptions.time_keywords``: what its selective
    recompute re-runs, whether its attention is flash) that replace the efficiency profile's."""
    eff, ov = pricing_settings(cluster, efficiency, overlap, software)
    n = len(batch)
    rates = compute_rates(cluster, batch, eff)
    fabric = Fabric.of(cluster, eff)

    # Layer prices, once per distinct layer configuration.
    ints = {name: getattr(batch, name) for name in StrategyBatch.array_fields()}
    ints["ep_overlap"] = strategy_overlap_flags(batch, ov)
    ints["ep_pairing"], pairing_counts = ep_pairing_codes(model, batch, ints["ep_overlap"])
    # Distinct DP configurations (the parameters' stage is added per group), and a row of each.
    dp_columns = {name: ints[name] for name in _DP_FIELDS}
    dp_config, dp_count = row_codes(list(dp_columns.values()))
    dp_rows = first_of_codes(dp_config, dp_count)
    # Rows whose launch adds its weight gradients apart (the runtime's rules) price their own
    # weight-gradient GEMMs: a field of the layer key where there are any.
    apart_rates = unfused_rates(cluster, batch, eff)
    apart = None if apart_rates is None else forced_unfused(model, ints, eff, batch.precision)
    if apart is None or not np.any(apart):
        apart, apart_rates = None, None
    first, config = distinct_layer_configs(ints, dp_config, dp_rows, weight_grad_rebuilds,
                                           eff.pipeline_defers_fsdp_reduce, bool(model.mtp_depth), apart)
    ctx = LayerContext(model, rates, fabric, eff, ov, batch.precision, weight_grad_rebuilds, batch.recompute_modules,
                       batch.offload_modules, apart_rates)
    at_first = _RowColumns(ints, first, dp_rows.take(dp_config.take(first)))
    pairing = ints["ep_pairing"][first]  # (a field of the layer key)
    at_first["ep_unpaired"] = pairing_counts[pairing, 0].astype(np.float64)
    at_first["ep_passes"] = pairing_counts[pairing, 1].astype(np.float64)
    if apart is not None:  # the flags the key was made of (piece_times works them out where absent)
        at_first[UNFUSED] = apart[first].astype(np.float64)
    pieces = piece_times(ctx, at_first)
    categories = CATEGORIES if batch.offload_modules else tuple(c for c in CATEGORIES if c != "offload")
    table, per_pass, per_cat = _piece_table(pieces, len(first), categories)
    # A category every piece prices at zero in every pass (expert all-to-alls in a dense model)
    # sums to +0.0 in the table (from +0.0), so to +0.0 on every strategy's bottleneck stage,
    # times its micro-batches: zeros, neither worked out per group nor gathered back (dp is
    # not: the per-step DP adds to it). Read from the pieces' own arrays, stopping at the
    # first nonzero one (the table's strided column took ~11 ms on 1M DeepSeek-V3 strategies).
    idle = frozenset(cat for cat in categories if cat != "dp" and not any(
        np.any(pieces[name].get(pass_, cat)) for name in PIECES for pass_ in PASSES))
    # Arrays are dropped once read, here and below: each batch-length array alive at once is
    # memory a call touches fresh, whose pages it faults in and zeroes (~2.4 ms per 8 MB on
    # this host; 1M DeepSeek-V3 strategies held ~425 MB at the end of a call).
    del ints, at_first, pieces
    priced = _Priced(model, batch, eff, ov, rates, fabric, per_pass, per_cat, table, piece_params(model),
                     fabric.host_bw, pipeline, {name: value[dp_rows].astype(np.float64) for name, value in dp_columns.items()},
                     categories, idle)

    # Sort by stage layout once, so every group is a contiguous slice; carry only the columns
    # the step formulas read per strategy.
    group_code, group_count = _group_codes(batch)
    p2p = _p2p_seconds(model, batch, fabric, group_code, dp_config, dp_rows, eff.pipeline_scatter_gather)
    order = np.argsort(group_code.astype(np.uint16 if group_count < (1 << 16) else np.int64), kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(group_code, minlength=group_count))))
    # The counts stay integers here and are made floats a group at a time (a group's slice is in
    # cache, and its floats take no fresh pages: a batch's length of them did, three times).
    counts = {name: gathered(getattr(batch, name), order, widen=False) for name in _STEP_FIELDS}
    cols = {"dp_config": gathered(dp_config, order, low=0, high=dp_count - 1, widen=False), "row": order}  # indices, kept integral
    config = gathered(config, order, low=0, high=len(first) - 1, widen=False)
    recompute_layers = gathered(batch.recompute_layers, order, widen=False)
    p2p_sorted = p2p[order]
    del group_code, dp_config, dp_rows
    if not details:
        del p2p  # (returned with details alone)

    # Only the arrays the caller reads are kept from the groups (without ``details``, 9 of the
    # 16: 1M strategies, 56 MB less written and gathered back). The share of layers recomputed
    # comes back only for the rows whose recompute limit sets it (the rest is the batch's).
    wanted: tuple[str, ...] = OUTPUT_KEYS + DETAIL_KEYS if details else OUTPUT_KEYS
    # Where the batch offloads nothing, its offload seconds are zeros, not gathered from the groups;
    # so are the seconds of a category no layer configuration has (idle).
    zeros = {f"{cat}_s" for cat in CATEGORIES if cat not in categories or cat in idle}
    out = {key: np.empty(n) for key in _GROUP_KEYS if key in wanted and key not in zeros}
    chunk_seconds: Array | None = None
    limited_rows, limited_fraction = [np.zeros(0, dtype=np.int64)], [np.zeros(0)]
    dp_stages: dict[tuple[int, int, bool, bool, bool], _DPStage] = {}  # per stage layout, which groups share
    for gi in range(group_count):
        sl = slice(int(bounds[gi]), int(bounds[gi + 1]))
        i0 = int(order[sl.start])
        name = CODES["schedule"][int(batch.schedule[i0])]  # (a group's _GROUP_FIELDS: one schedule)
        shape = (int(batch.pp[i0]), int(batch.vpp[i0]), is_v_shape(name), bool(batch.embedding_as_layer[i0]),
                 bool(batch.output_as_layer[i0]))
        layout = stage_layout(model, shape[0], shape[1], shape[2], stage_layers, shape[3], shape[4])
        if shape not in dp_stages:
            dp_stages[shape] = _dp_stage(priced, layout)
        group_cols = {key: value[sl] for key, value in cols.items()}
        group_cols.update({key: value[sl].astype(np.float64) for key, value in counts.items()})
        group = _price_group(priced, layout, dp_stages[shape], group_cols, config[sl], name, recompute_layers[sl],
                             p2p_sorted[sl], details)
        for key, value in group.items():
            if key == "chunk_seconds":  # per stage and chunk: kept for a batch of one (estimate_time)
                chunk_seconds = value if n == 1 else None
            elif key == "limited_rows":  # their rows in the batch
                limited_rows.append(order[sl][value])
            elif key == "limited_fraction":
                limited_fraction.append(value)
            elif key in out:
                out[key][sl] = value

    del counts, cols, config, recompute_layers, p2p_sorted, priced, table, per_pass, per_cat

    # Back to the batch's order (a slice written per group and one gather at the end: scattering
    # each group's rows into the batch's order instead took twice as long); the step and the
    # figures derived from it are worked out in that order (element-wise, the same values),
    # which spares gathering each of them and their inputs. Each figure is gathered into the
    # group-order array of the one before it, read already: one fresh array for them all
    # rather than one each (9 gathers of 1M figures: 45 -> 23 ms in a scratch test). Mode
    # "clip" writes into ``out=`` directly ("raise" buffers it); the indices are in range.
    back = np.empty_like(order)
    back[order] = np.arange(n)
    res: dict[str, Array] = {}
    spare = np.empty(n)
    for key, value in out.items():
        res[key] = np.take(value, back, out=spare, mode="clip")
        spare = value
    del out, back
    for key in zeros:
        res[key] = np.zeros(n)
    if details:
        res["p2p_s"] = p2p
    # bubble is clipped at 0 (a makespan cannot undercut m·T*), so the step is the sum of parts,
    # summed in place in the order written (the same bits as one expression, fewer temporaries)
    step = np.add(res["compute_s"], res["tp_s"], out=spare)
    for key in ("cp_s", "ep_s", "dp_s", "offload_s", "pp_s", "bubble_s", "optimizer_s"):
        step += res[key]
    res["step_s"] = step
    # (Products of whole numbers below 2^53 in floats: exact, as the integers' product converted.
    # The figures below are written into their operands where those are temporaries: a
    # million strategies' fresh [n] arrays each cost their page faults.)
    tokens = np.multiply(batch.global_batch_size, batch.seq_length, dtype=np.float64)
    res["tokens_per_s"] = np.divide(tokens, res["step_s"], out=tokens)
    res["tokens_per_s_per_device"] = res["tokens_per_s"] * (1.0 / cluster.num_devices)
    model_flops, hardware_flops = _seq_flops(model, batch.seq_length, batch.recompute, np.concatenate(limited_rows),
                                             np.concatenate(limited_fraction), eff.selective_recompute,
                                             batch.recompute_modules)
    res["model_flops"] = np.multiply(batch.global_batch_size, model_flops, out=model_flops)
    res["hardware_flops"] = np.multiply(batch.global_batch_size, hardware_flops, out=hardware_flops)
    capacity = res["step_s"] * (cluster.num_devices * rates.peak_flops)
    res["mfu"] = res["model_flops"] / capacity
    res["hfu"] = np.divide(res["hardware_flops"], capacity, out=capacity)
    if details and chunk_seconds is not None:
        res["chunk_seconds"] = chunk_seconds
        wanted += ("chunk_seconds",)
    return {key: res[key] for key in wanted}


def _chunk_seconds(pr: _Priced, layout: StageLayout, config: Array, recompute_layers: Array,
                   sent: Array | None = None) -> tuple[Array, Array, Array]:
    """[n, pp, vpp] F, B, W seconds of every chunk for each layer configuration of ``config``
    and recompute limit (0: every layer of a recomputing chunk), the simulator's input; with
    ``sent`` [n], each pass that sends on waits that much longer (``_model_chunk_seconds``)."""
    per_chunk = _model_chunk_seconds(pr, layout, config, recompute_layers, sent)
    # Model order to [stage, local chunk]: a gather along the last axis (scattering into a
    # [n, passes, pp, vpp] grid by two index arrays took five times as long).
    slot_of = np.empty(layout.pp * layout.vpp, dtype=np.intp)
    slot_of[layout.stage_of * layout.vpp + layout.chunk_of] = np.arange(len(layout.chunk_of))
    grid = per_chunk.take(slot_of, axis=2).reshape(len(config), len(PASSES), layout.pp, layout.vpp)
    return grid[:, 0], grid[:, 1], grid[:, 2]


def _chunk_seconds_by_stage(pr: _Priced, layout: StageLayout, config: Array, recompute_layers: Array,
                            sent: Array | None = None) -> tuple[Array, Array]:
    """``_chunk_seconds``' forward and whole backward (B + W) seconds stage-major, [vpp, pp, n]
    (``interleaved_chain_bound_by_stage``'s input): the chunks in model order transposed, which
    for Megatron's interleaving (virtual stage c·pp + s on stage s) is this order."""
    n, chunks = len(config), layout.pp * layout.vpp
    by_row = np.empty((len(PASSES), chunks, n))
    # Priced 1024 rows at a time and transposed in blocks of ~100 kB, in cache: transposed at
    # once, each element read is a cache line's (~3x as long for 10^4 rows of 32 chunks).
    rows = max(4096 // chunks, 1)
    for start in range(0, n, 1024):
        per_chunk = _model_chunk_seconds(pr, layout, config[start:start + 1024], recompute_layers[start:start + 1024],
                                         None if sent is None else sent[start:start + 1024])  # [rows, F/B/W, chunks]
        for lo in range(0, len(per_chunk), rows):
            piece = per_chunk[lo:lo + rows]  # (the last of a block may be shorter: 1024 rows need not divide)
            by_row[:, :, start + lo:start + lo + len(piece)] = piece.transpose(1, 2, 0)
    order = np.empty(chunks, dtype=np.intp)
    order[layout.chunk_of * layout.pp + layout.stage_of] = np.arange(chunks)
    if np.any(order != np.arange(chunks)):
        by_row = by_row.take(order, axis=1)
    grid = by_row.reshape(len(PASSES), layout.vpp, layout.pp, n)
    backward = grid[1]
    backward += grid[2]
    return grid[0], backward


def _model_chunk_seconds(pr: _Priced, layout: StageLayout, config: Array, recompute_layers: Array,
                         sent: Array | None = None) -> Array:
    """[n, F/B/W, chunks in model order] seconds of every chunk (``_chunk_seconds``); with
    ``sent`` [n], the forward of every chunk that sends its output to another stage and the
    backward (B) of every one that sends its input gradient last that much longer."""
    nv = layout.chunk_dense + layout.chunk_moe
    ends = np.zeros((2, len(nv)))
    ends[0, 0] = ends[1, -1] = 1.0
    copy = _keeps_table_copy(pr.model, layout)
    counts = np.stack([layout.chunk_dense, layout.chunk_moe, ends[0], ends[1], layout.chunk_dense, layout.chunk_moe,
                       ends[1] * copy])  # [pieces, chunks in model order]
    table = pr.table[:, :len(PASSES)][config]  # [n, passes, pieces] (the passes alone gathered: 2-3x faster)
    # [n, passes, chunks] as one 2-D product: a stack of [passes, pieces] matrices runs one tiny
    # product per row (4-6x as long); each entry is the same sum over the pieces either way.
    per_chunk = (table.reshape(-1, len(PIECES)) @ counts).reshape(len(config), len(PASSES), -1)
    # A limit recomputes min(limit, layers) of a chunk's layers: the recompute pieces scaled (the
    # rows with a limit alone: the others' share is 1, their correction 0).
    limited = np.flatnonzero(np.asarray(recompute_layers) > 0)
    if len(limited):
        limit = np.asarray(recompute_layers, dtype=np.float64)[limited, None]
        share = np.divide(np.minimum(limit, nv), nv, out=np.zeros((len(limit), len(nv))), where=nv > 0)
        for piece, layers in ((PIECES.index("rc_dense"), layout.chunk_dense),
                              (PIECES.index("rc_moe"), layout.chunk_moe)):
            per_chunk[limited] += table[limited, :, piece, None] * ((share - 1.0) * layers)[:, None, :]
    if sent is not None:
        per_chunk[:, 0] += sent[:, None] * layout.chunk_sends_f
        per_chunk[:, 1] += sent[:, None] * layout.chunk_sends_b
    return per_chunk


def step_time_batch(
    model: ModelSpec,
    batch: StrategyBatch,
    cluster: Cluster,
    *,
    efficiency: EfficiencyProfile | None = None,
    overlap: OverlapConfig | None = None,
    weight_grad_rebuilds: bool = False,
    software: Mapping[str, Any] | None = None,
) -> dict[str, Array]:
    """Step time of every strategy of ``batch`` with closed-form pipelines (for the search;
    ``weight_grad_rebuilds`` and ``software`` as in ``evaluate``).

    Returns arrays keyed as ``OUTPUT_KEYS``: step_s, tokens_per_s, tokens_per_s_per_device,
    mfu, hfu, model_flops, hardware_flops, and the breakdown compute_s, tp_s, cp_s, ep_s,
    dp_s, pp_s, bubble_s, optimizer_s (seconds that sum to step_s).
    """
    return evaluate(model, batch, cluster, efficiency=efficiency, overlap=overlap, pipeline="closed_form",
                    weight_grad_rebuilds=weight_grad_rebuilds, software=software)
