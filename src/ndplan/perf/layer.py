"""Seconds of one layer (and of the embedding and the output head) per micro-batch and pass.

For each piece of a stage this returns, per pass and per category, the seconds one device
spends on one micro-batch:

* pieces: ``dense`` / ``moe`` decoder layer, ``emb`` (embedding), ``head`` (final norm, output
  head, loss and the MTP modules), and ``rc_dense`` / ``rc_moe``: what recomputing one layer
  adds to its backward.
* passes: ``F`` forward, ``B`` backward input-gradient part (with the attention backward,
  elementwise backward and recompute), ``W`` weight-gradient GEMMs. Schedules that do not split
  the backward run B+W as one op.
* categories: ``compute`` (GEMMs, attention core, memory-bound ops, per-layer overhead) and the
  EXPOSED part of each communication: ``tp``, ``cp``, ``ep``, and ``dp`` for FSDP/ZeRO-3's
  per-layer parameter gathers and gradient reduce-scatters.

Communication per layer and micro-batch, A = (T/c)·h·act_bytes the layer's activation on a
device (T = b·s):
* TP (t > 1): without SP, 2 all-reduces of A forward (after attention and after the MLP) and 2
  backward; with SP each all-reduce becomes an all-gather + a reduce-scatter of A.
* CP ring: c-1 point-to-point steps, each passing the local K and V
  (T/c)·(w_k + w_v)/t·act_bytes forward, and K,V plus dK,dV backward in c sends (the first
  K,V alone, the last dK,dV alone; w: GQA n_kv·d, MLA the expanded a·d_qk and a·d_v). Ulysses: all-to-all of q, k, v and o forward, same backward.
  Hybrid: Ulysses over ulysses_degree ranks, then a ring over cp/ulysses_degree.
* EP: dispatch and combine all-to-alls of the (T/c)·k/t routed copies of h forward, both
  backward, at activation width (Megatron-Core quantises inside the expert GEMM; with
  ``OverlapConfig.ep_dispatch_fp8`` the dispatch carries fp8, 1 byte, for fp8 GEMMs only:
  ``ep_dispatch_bytes``), over the ep ranks at
  stride etp (× moe_imbalance, or the capacity factor of a token-dropping MoE padded to
  capacity: EfficiencyProfile.routed_token_factor). With
  ``OverlapConfig.ep_dispatch = 'node_dedup'`` (DeepEP/HybridEP) a token crosses the network
  once per distinct remote node and NVLink once per distinct destination rank other than the
  one the network delivered it to, D·(g-1)/g times; the receiving rank copies it to each of its
  local experts itself. Its k distinct experts drawn uniformly from the E (or from those of the
  L nodes node-limited routing allows, ``ep_node_limit``), a group of G holding E/G of them is
  missed with probability C(E - E/G, k)/C(E, k): N nodes give N·(1 - that)·(N-1)/N remote ones,
  R = L·g ranks D = R·(1 - that). With ``ep_routing`` 'contiguous' (k consecutive experts from a
  multiple of k) D = max(1, k·ep/E) and max(1, k·ep/(E·g))·(N-1)/N remote nodes.
* FSDP / ZeRO-3: all-gather the layer's parameter shard forward (param_gather_bytes), again in
  backward when resharding after forward, and reduce-scatter its gradient (grad_bytes), over
  the shard group (non-expert: shard_group or dp·cp ranks at stride tp; experts: the
  expert-data-parallel ranks).
Exposure (see OverlapConfig): hidden comm is max(0, comm - the compute it runs under).

Compute per layer and pass: GEMMs (gemm.py, each pass with its own bytes) + fp8 input casts +
attention core + elementwise bytes (memory_ops.py) + ``layer_overhead_s``, never less than the
host floor (``host_layer_s`` / ``host_moe_layer_s`` + ``host_expert_s`` per local expert, the
backward's expert term twice; see EfficiencyProfile). A MoE forward also waits out the dropless
token-count sync: at least (host_f - host_layer_s) + g_pre, g_pre the GPU time queued before
the sync (attention projections, attention core, router GEMM and their fp8 casts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ndplan.errors import NdplanError
from ndplan.memory.activations import LayerActivations, layer_activations
from ndplan.memory.fields import ACTIVATION_FIELDS
from ndplan.memory.layer_offload import first_layers
from ndplan.memory.options import MemoryOptions
from ndplan.memory.static import TpSplit, non_expert_split, shard_groups
from ndplan.model.heads import ulysses_kv_repeat
from ndplan.model.params import layer_params, weight_grad_groups
from ndplan.model.spec import MlpKind, ModelSpec
from ndplan.perf import collectives as coll
from ndplan.perf.accumulation import forced_unfused
from ndplan.perf.codes import first_of_codes, row_codes
from ndplan.perf.efficiency import EfficiencyProfile
from ndplan.perf.flops import (
    Gemm,
    Sharding,
    alternate_recomputed_gemms,
    attention_core_flops,
    attention_gemms,
    head_gemms,
    kv_split,
    layer_gemms,
    linear_core_flops,
    masked_pairs,
    module_gemms,
    mtp_gemms,
    qkv_output_width,
)
from ndplan.perf.gemm import PASS_NAMES, ComputeRates, gemm_pass_seconds, gemm_seconds, gemms_seconds
from ndplan.perf.memory_ops import (
    embedding_bytes,
    expert_bias_bytes,
    head_bytes,
    kv_allgather_bytes,
    kv_repeat_bytes,
    layer_bytes,
    mla_assembly_bytes,
    module_replay_bytes,
    qkv_transpose_bytes,
    query_width_elements,
    ring_merge_bytes,
    sink_rescale_bytes,
    unfused_score_bytes,
)
from ndplan.perf.overlap import OverlapConfig
from ndplan.perf.topology import (
    Fabric,
    collective_sm_share,
    fits_in_domain,
    group_link,
    inside_bandwidth,
    members_per_domain,
    scaleup_link,
)
from ndplan.schedule.ops import SPLIT_BACKWARD
from ndplan.strategy.batch import CODES, StrategyBatch, ulysses_ranks
from ndplan.strategy.precision import PrecisionPolicy

#: Schedule codes whose backward splits into B and W.
SPLIT_SCHEDULE_CODES = np.array([CODES["schedule"].index(name) for name in sorted(SPLIT_BACKWARD)], dtype=float)

Array = np.ndarray
PASSES = ("F", "B", "W")
CATEGORIES = ("compute", "tp", "cp", "ep", "dp", "offload")
PIECES = ("dense", "moe", "emb", "head", "rc_dense", "rc_moe", "table_copy")

#: FlashAttention's backward runs 5 matmul-sized products per forward's 2 (it recomputes the
#: scores): 2.5x the forward FLOPs where query/key and value heads are as wide
#: (``flash_backward_factor``).
FLASH_BACKWARD_FACTOR = 2.5


def flash_backward_factor(model: ModelSpec) -> float:
    """Backward over forward FLOPs of FlashAttention: the backward recomputes S = QKᵀ (d_qk per
    pair and head) and runs dV = Pᵀ·dO and dP = dO·Vᵀ (d_v each), dQ = dS·K and dK = dSᵀ·Q (d_qk
    each), (3·d_qk + 2·d_v)/(d_qk + d_v) of the forward's QKᵀ and PV: 2.5 for equal widths, 2.6
    for MLA's 192 and 128."""
    qk, v = model.qk_head_dim, model.value_head_dim
    return (3.0 * qk + 2.0 * v) / (qk + v)


@dataclass
class PieceTimes:
    """seconds[(pass, category)] of one piece; missing entries are 0."""

    seconds: dict[tuple[str, str], Array | float] = field(default_factory=dict)

    def add(self, pass_: str, category: str, value: Array | float) -> None:
        key = (pass_, category)
        self.seconds[key] = self.seconds.get(key, 0.0) + value

    def get(self, pass_: str, category: str) -> Array | float:
        return self.seconds.get((pass_, category), 0.0)

    def total(self, pass_: str) -> Array | float:
        return sum((v for (p, _), v in self.seconds.items() if p == pass_), 0.0)

    def scaled_add(self, other: PieceTimes, factor: Array | float) -> None:
        for key, value in other.seconds.items():
            self.seconds[key] = self.seconds.get(key, 0.0) + factor * value


@dataclass(frozen=True)
class LayerContext:
    """Everything per-layer pricing needs besides the strategy columns."""

    model: ModelSpec
    rates: ComputeRates
    fabric: Fabric
    eff: EfficiencyProfile
    overlap: OverlapConfig
    precision: PrecisionPolicy
    #: The runtime rebuilds a checkpointed layer once per parameter group in a split backward's
    #: weight-gradient step (torch.distributed.pipelining; the runtime profile's
    #: ``weight_grad_recomputes_per_group``).
    weight_grad_rebuilds: bool = False
    #: ``Strategy.recompute_modules`` of the batch: what selective recompute replays (empty: the
    #: runtime's own policy, ``EfficiencyProfile.selective_recompute``).
    recompute_modules: tuple[str, ...] = ()
    #: ``Strategy.offload_modules`` of the batch: what goes to host memory and back.
    offload_modules: tuple[str, ...] = ()
    #: The rates of a launch that adds its weight gradients apart (gradient-accumulation fusion
    #: off), where the runtime's rules turn the fusion off for some rows (``perf.accumulation``):
    #: ``piece_times`` prices those rows' weight-gradient GEMMs at them. None: every row at ``rates``.
    unfused_rates: ComputeRates | None = None


#: The strategy columns a ``Sharding`` reads (in its field order).
SHARDING_FIELDS = ("micro_batch_size", "seq_length", "tp", "cp", "ep", "etp", "sequence_parallel")


@dataclass(frozen=True)
class ShardingRows:
    """The distinct shardings among the rows priced: a GEMM's shape depends on the sharding
    alone, so GEMMs are priced once per distinct sharding (a few hundred among the tens of
    thousands of layer configurations of a search) and ``spread`` back to the rows."""

    distinct: Sharding
    #: [rows] the entry of ``distinct`` each row has; None: ``distinct`` is the rows themselves.
    codes: Array | None = None

    def spread(self, value: Array | float) -> Array | float:
        """``value`` per distinct sharding, per row (scalars as they are)."""
        return _spread(value, self.codes)


def _spread(value: Array | float, codes: Array | None) -> Array | float:
    """``value`` given per distinct row, per row: ``value[codes]`` (``codes`` None: the distinct
    rows are the rows; a scalar is every row's), by np.take (the same values; 1M DeepSeek-V3
    strategies' 132,616 layer configurations: the ~86 spreads of ``piece_times`` ~2 ms less
    than by the fancy index)."""
    if codes is None or np.ndim(value) == 0:
        return value
    return np.asarray(value).take(codes)


def sharding_rows(cols: dict[str, Array]) -> ShardingRows:
    """The distinct shardings among the rows of ``cols``."""
    codes, count = row_codes([cols[name] for name in SHARDING_FIELDS])
    first = first_of_codes(codes, count)
    return ShardingRows(Sharding(*(np.asarray(cols[name])[first] for name in SHARDING_FIELDS)), codes)


#: The strategy columns the sharding part of a decoder layer reads (``BaseRows``): its GEMMs,
#: attention core, elementwise bytes, raw TP/CP/EP collectives and what they expose on their own.
BASE_FIELDS = SHARDING_FIELDS + ("cp_kind", "ulysses_degree")
#: The column, 1 on the rows whose launch adds its weight gradients apart (``LayerContext.unfused_rates``),
#: that ``piece_times`` adds to the base fields where some rows do.
UNFUSED = "unfused_accumulation"


@dataclass(frozen=True)
class BaseRows:
    """The distinct ``BASE_FIELDS`` rows among the layer configurations priced (~3k among ~25k
    in a DeepSeek-V3 search): what a layer computes and moves, and how much of it a pass exposes
    before recompute, EP pairing and FSDP enter, depends on them alone, so ``decoder_layer``
    prices it once per base row and ``spread``s it to the rows (the same operations on the same
    values: the same bits)."""

    #: BASE_FIELDS at the base rows (float arrays), and their Sharding
    cols: dict[str, Array]
    sh: Sharding
    #: [rows] the base row each row has; None: the base rows are the rows themselves.
    codes: Array | None = None

    def spread(self, value: Array | float) -> Array | float:
        """``value`` per base row, per row (scalars as they are)."""
        return _spread(value, self.codes)


def base_rows(cols: dict[str, Array]) -> BaseRows:
    """The distinct ``BASE_FIELDS`` rows of ``cols`` (and ``UNFUSED``, where ``cols`` has it)."""
    fields = BASE_FIELDS + ((UNFUSED,) if UNFUSED in cols else ())
    codes, count = row_codes([cols[name] for name in fields])
    first = first_of_codes(codes, count)
    base = {name: np.asarray(cols[name])[first] for name in fields}
    return BaseRows(base, Sharding(*(base[name] for name in SHARDING_FIELDS)), codes)


def _paired_tp_forward(ctx: LayerContext, cols: dict[str, Array], sh: Sharding, shardings: ShardingRows,
                       forward_of: dict[str, Array | float], exposed: Array | float) -> Array | float:
    """A dense layer's exposed forward TP seconds where its sequence-parallel collectives overlap
    (``OverlapConfig.tp``): each under the GEMM it is pipelined with, not under the layer's GEMMs
    together. Transformer Engine's userbuffers, MindSpeed's MC2 and torch's AsyncTP split a
    GEMM and its collective into chunks, the all-gather of the input with the GEMM that reads it
    (QKV, up), the reduce-scatter of the output with the GEMM that makes it (output, down):
    Σ max(0, collective − its GEMM). A collective longer than its GEMM shows even where the
    layer's GEMMs together outlast its collectives (TP 8 of an 8B model on Ascend 910B's HCCS:
    the QKV and output projections are shorter than their collectives). Without SP, with MLA or
    linear attention (other projections), ``exposed`` as it is."""
    return _paired_tp(ctx, cols, sh, shardings, forward_of, exposed,
                      (("gather", "qkv_proj"), ("scatter", "o_proj"), ("gather", "mlp_up"), ("scatter", "mlp_down")))


def _paired_tp_backward(ctx: LayerContext, cols: dict[str, Array], sh: Sharding, shardings: ShardingRows,
                        backward_of: dict[str, Array | float], exposed: Array | float) -> Array | float:
    """The backward's as ``_paired_tp_forward``: the gradient of a row-parallel linear's output
    (output, down) all-gathered with that linear's input-gradient GEMM, which reads it, and a
    column-parallel one's input gradient (QKV, up) reduce-scattered with the GEMM that makes it
    (MC2's matmul-reduce-scatter; Transformer Engine's bulk overlap runs it under the same linear's
    weight-gradient GEMM, of the same FLOPs). Where the runtime's overlap reaches the backward's
    all-gathers alone (``EfficiencyProfile.tp_overlap_backward`` 'all-gathers': torch's AsyncTP),
    the reduce-scatters count whole."""
    scatters_hide = ctx.eff.tp_overlap_backward != "all-gathers"
    return _paired_tp(ctx, cols, sh, shardings, backward_of, exposed,
                      (("scatter", "qkv_proj" if scatters_hide else ""), ("gather", "o_proj"),
                       ("scatter", "mlp_up" if scatters_hide else ""), ("gather", "mlp_down")))


def _paired_tp(ctx: LayerContext, cols: dict[str, Array], sh: Sharding, shardings: ShardingRows,
               seconds_of: dict[str, Array | float], exposed: Array | float,
               pairs: tuple[tuple[str, str], ...]) -> Array | float:
    """Σ max(0, collective − its GEMM's ``seconds_of``) over ``pairs`` (a collective, 'gather' or
    'scatter' of the activation, and the GEMM it runs with: '' for none), where the layer's
    sequence-parallel collectives overlap; never below ``exposed``, the pass's collectives under
    its GEMMs together (Σ max(0, c − g) >= max(0, Σc − Σg))."""
    model = ctx.model
    if not ctx.overlap.tp or model.is_mla or model.has_linear_attention or "qkv_proj" not in seconds_of:
        return exposed
    gather, scatter = _sp_pair_seconds(ctx, cols, sh.tokens * model.hidden_size * ctx.precision.activation_bytes)
    collective = {"gather": gather, "scatter": scatter}
    paired: Array | float = 0.0
    for kind, name in pairs:
        cover = shardings.spread(seconds_of[name]) if name else 0.0
        paired = paired + np.maximum(collective[kind] - cover, 0.0)
    return np.where(cols["sequence_parallel"] > 0, np.maximum(paired, exposed), exposed)


def _exposed(comm: Array | float, cover: Array | float, hide: bool | Array, share: Array | float = 0.0) -> Array | float:
    """What the step pays for ``comm`` running under ``cover`` seconds of compute: the part that
    outlasts the compute, plus ``share`` of the part that hides (the compute it slows by holding
    SMs: ``EfficiencyProfile.ep_comm_compute_share``, ``collective_sm_share``)."""
    exposed = np.maximum(comm - cover, 0.0)
    if np.any(share):
        exposed = exposed + share * np.minimum(comm, cover)
    return np.where(hide, exposed, comm)


def _beyond_slack(exposed: tuple[Array | float, ...], slack: Array | float) -> tuple[Array | float, ...]:
    """What a pass pays of its ``exposed`` communication where the host's floor leaves the GPU
    ``slack`` idle seconds: the pass takes max(host, GPU compute + exposed), so the total beyond
    the slack, each part its share of it."""
    if not np.any(slack):
        return exposed
    total = sum(exposed, np.zeros(np.shape(slack)))
    paid = np.maximum(total - slack, 0.0)
    kept = np.divide(paid, total, out=np.zeros(np.shape(total)), where=np.asarray(total) > 0)
    return tuple(part * kept for part in exposed)


def _fsdp_exposed(ctx: LayerContext, comm: Array | float, cover: Array | float, full_rate_s: Array | float
                  ) -> Array | float:
    """``_exposed`` for FSDP/ZeRO-3 gathers and reduces on their own stream: hidden under
    ``cover`` where FSDP prefetches (``OverlapConfig.fsdp_prefetch``), slowing that compute by
    the SMs their kernels hold, which go with their bytes' seconds at the scale-up rate,
    ``full_rate_s`` (``collective_sm_share``)."""
    if not (ctx.eff.dp_comm_compute_share and np.any(comm)):  # (most rows of a search shard nothing)
        return _exposed(comm, cover, ctx.overlap.fsdp_prefetch)
    return _exposed(comm, cover, ctx.overlap.fsdp_prefetch, collective_sm_share(ctx.eff, full_rate_s, comm))


def _kv_allgather_moved(ctx: LayerContext, cols: dict[str, Array], sh: Sharding) -> tuple[Array | float, Array | float]:
    """(forward, backward) bytes of all-gather CP's copies of one layer's micro-batch
    (``memory_ops.kv_allgather_bytes``); 0 for the other kinds."""
    gathered = gathers_kv(cols)
    if not np.any(gathered):
        return 0.0, 0.0
    forward, backward = kv_allgather_bytes(ctx.model, sh, ctx.precision.activation_bytes,
                                           rank_kv_elements(ctx.model, cols["tp"], sh), cols["cp"])
    return np.where(gathered, forward, 0.0), np.where(gathered, backward, 0.0)


def rank_kv_elements(model: ModelSpec, tp: Array | float, sh: Sharding) -> Array | float:
    """K + V elements of a rank's T tokens as context parallelism moves them: T·(k + v) over the
    layer's KV split (``kv_split``: a whole KV head a rank where tp exceeds the KV heads)."""
    _, wk, wv, _ = _kv_widths(model)
    return sh.tokens * (wk + wv) / kv_split(model, tp)


def _kv_widths(model: ModelSpec) -> tuple[float, float, float, float]:
    """(q, k, v, o) widths over all heads, as context parallelism moves them."""
    a = model.num_attention_heads
    if model.is_mla:
        return a * model.qk_head_dim, a * model.qk_head_dim, a * model.value_head_dim, a * model.value_head_dim
    d = model.head_dim
    return a * d, model.num_kv_heads * d, model.num_kv_heads * d, a * d


def fp8_cast_seconds(ctx: LayerContext, gemms: list[Gemm]) -> tuple[Array | float, Array | float]:
    """(forward, backward) seconds to quantise GEMM inputs to fp8: fp8_cast_bytes per element
    of each activation [m, k] forward and each output gradient [m, n] backward; 0 unless the
    GEMMs run in fp8 (operand width 1 byte)."""
    if ctx.rates.operand_bytes != 1.0:
        return 0.0, 0.0
    per = ctx.eff.fp8_cast_bytes / ctx.rates.hbm_rate
    forward = sum((g.m * g.k * g.count for g in gemms), 0.0)
    backward = sum((g.m * g.n * g.count for g in gemms), 0.0)
    return per * forward, per * backward


def attention_core_seconds(ctx: LayerContext, sh: Sharding, kind: MlpKind | None = None, full: bool = False,
                           calls: Array | float = 1.0) -> tuple[Array | float, Array | float]:
    """(forward, backward) seconds of the attention core on a device, in a layer of ``kind``
    (sliding-window layers among them do less: ``flops.attention_pairs``; ``full``: every layer
    attends in full, as MTP modules do)."""
    model = ctx.model
    linear_f: Array | float = 0.0
    linear_b: Array | float = 0.0
    if not full and model.has_linear_attention:  # Gated DeltaNet layers' chunked delta rule
        linear_f, linear_b = (flops / ctx.rates.linear_attention_rate for flops in linear_core_flops(model, sh, kind))
    softmax_f, softmax_b = _softmax_core_seconds(ctx, sh, kind, full, calls)
    return softmax_f + linear_f, softmax_b + linear_b


def _softmax_core_seconds(ctx: LayerContext, sh: Sharding, kind: MlpKind | None, full: bool,
                          calls: Array | float) -> tuple[Array | float, Array | float]:
    """(forward, backward) seconds of the softmax attention core (``attention_core_seconds``), the
    mean over the kind's layers (none on Gated DeltaNet layers)."""
    model = ctx.model
    share = 1.0 if full else 1.0 - model.linear_share(kind)
    if ctx.eff.flash_attention:
        masked_window = not ctx.eff.window_kernel
        flops = attention_core_flops(model, sh, kind=kind, windowed=not full, masked_window=masked_window)
        seconds = flops / ctx.rates.attention_rate
        if masked_window and not full and ctx.rates.masked_attention_rate:
            # the sliding layers' squares run the masked kernel, at its own rate
            masked = (2.0 * sh.micro_batch * model.num_attention_heads / sh.tp
                      * (model.qk_head_dim + model.value_head_dim) * masked_pairs(model, sh.seq, kind) / sh.cp)
            seconds = seconds + masked * (1.0 / ctx.rates.masked_attention_rate - 1.0 / ctx.rates.attention_rate)
        # each call's fixed cost (the backward's pre- and post-processing kernels), split as the
        # FLOPs; ring attention calls the kernel once per ring step (``calls``)
        backward = flash_backward_factor(model)
        call = share * calls * ctx.eff.attention_call_s / (1.0 + backward)
        return seconds + call, backward * (seconds + call)
    # Unfused: batched GEMMs over the full square, plus a materialised softmax (+dropout).
    count = sh.micro_batch * model.num_attention_heads / sh.tp
    queries = sh.seq / sh.cp
    qk = Gemm("scores", queries, sh.seq, model.qk_head_dim, count=count)
    pv = Gemm("context", queries, model.value_head_dim, sh.seq, count=count)
    matmuls = gemm_seconds(qk, ctx.rates) + gemm_seconds(pv, ctx.rates)
    softmax = unfused_score_bytes(model, sh) / ctx.rates.hbm_rate
    return share * (matmuls + softmax), share * 2.0 * (matmuls + softmax)


def tp_gather_share(ctx: LayerContext) -> float:
    """Width of TP's sequence-parallel all-gathers over the activation's: 1 byte over the
    activation width where the runtime gathers fp8 GEMM inputs (``EfficiencyProfile.fp8_tp_gather``
    under an fp8 compute dtype), else 1."""
    if ctx.eff.fp8_tp_gather and ctx.precision.compute_dtype == "fp8":
        return 1.0 / ctx.precision.activation_bytes
    return 1.0


def _sp_pair_seconds(ctx: LayerContext, cols: dict[str, Array], activation: Array | float
                     ) -> tuple[Array | float, Array | float]:
    """(all-gather, reduce-scatter) seconds of one sequence-parallel pair of ``activation`` over
    the TP group, the gather at ``tp_gather_share`` of the width."""
    t = cols["tp"]
    link = group_link(t, 1.0, ctx.fabric, "ring")
    return (coll.all_gather_s(activation * tp_gather_share(ctx), t, link),
            coll.reduce_scatter_s(activation, t, link))


def tp_gather_part(ctx: LayerContext, cols: dict[str, Array], sh: Sharding) -> Array | float:
    """The all-gathers' part of a pass's TP seconds: of a sequence-parallel pair of the
    activation A (``_sp_pair_seconds``), the gather's seconds over the pair's; without SP
    (all-reduces) half."""
    gather, scatter = _sp_pair_seconds(ctx, cols, sh.tokens * ctx.model.hidden_size * ctx.precision.activation_bytes)
    pair = gather + scatter
    return np.where(cols["sequence_parallel"] > 0, np.divide(gather, pair, out=np.zeros(np.shape(pair)),
                                                             where=np.asarray(pair) > 0), 0.5)


def _tp_seconds(ctx: LayerContext, cols: dict[str, Array], activation: Array | float, collectives: float) -> Array | float:
    """Forward (= backward) TP seconds of ``collectives`` all-reduce-equivalents of ``activation``:
    under SP each an all-gather (at ``tp_gather_share`` of the width) and a reduce-scatter."""
    t = cols["tp"]
    sp = cols["sequence_parallel"] > 0
    ar = coll.all_reduce_s(activation, t, group_link(t, 1.0, ctx.fabric, "ring"))
    gather, scatter = _sp_pair_seconds(ctx, cols, activation)
    return collectives * np.where(sp, gather + scatter, ar)


def ring_exchange_seconds(model: ModelSpec, fabric: Fabric, act_bytes: float, cols: dict[str, Array], sh: Sharding
                          ) -> tuple[Array | float, Array | float, Array | float]:
    """(K and V bytes a device holds at the query heads' width, the all-gather of them over the
    ring, one send of their fp32 gradients to the next rank) of torch's context parallelism
    (``EfficiencyProfile.ring_exchange`` 'allgather'), per layer and micro-batch: K + V =
    T·(a/t)·(d_qk + d_v)·β, gathered from the ring's n ranks ((n - 1)/n of n·(K + V) over a ring
    link), the gradients 4 bytes an element (torch's _cp_options.convert_to_f32) over a
    point-to-point link."""
    t = cols["tp"]
    ring_n = ring_steps(cols)
    u = cols["cp"] / ring_n
    q, o = query_width_elements(model, sh)
    elements = q + o
    kv = elements * act_bytes
    gather = coll.all_gather_s(ring_n * kv, ring_n, group_link(ring_n, t * u, fabric, "ring"))
    send = np.where(ring_n > 1, coll.p2p_s(4.0 * elements, group_link(ring_n, t * u, fabric, "p2p")), 0.0)
    return kv, gather, send


def kv_allgather_seconds(model: ModelSpec, fabric: Fabric, act_bytes: float, cols: dict[str, Array], sh: Sharding
                         ) -> tuple[Array | float, Array | float, Array | float]:
    """(a rank's K + V bytes, forward seconds, backward seconds) of all-gather context parallelism
    (``cp_kind`` 'allgather') per layer and micro-batch: K + V = T·(k + v)·β over the layer's KV
    split (``kv_split``); the forward all-gathers the c ranks' c·(K + V) over the CP group at
    stride tp, the backward gathers them again and reduce-scatters their gradients, the same
    bytes (the kernels return them at the activations' width)."""
    c, t = cols["cp"], cols["tp"]
    kv = rank_kv_elements(model, t, sh) * act_bytes
    link = group_link(c, t, fabric, "ring")
    forward = coll.all_gather_s(c * kv, c, link)
    return kv, forward, forward + coll.reduce_scatter_s(c * kv, c, link)


def _cp_seconds(
    ctx: LayerContext, cols: dict[str, Array], sh: Sharding
) -> tuple[Array | float, ...]:
    """(ring forward, ring backward, Ulysses all-to-alls per pass, one send of torch's K and V
    gradients) raw CP seconds of one attention block. Under torch's ring
    (``EfficiencyProfile.ring_exchange`` 'allgather') the forward is its all-gather of K and V;
    the send is 0 for Transformer Engine's ring. All-gather CP (``gathers_kv``) takes the ring's
    places (``kv_allgather_seconds``)."""
    c, t = cols["cp"], cols["tp"]
    beta = ctx.precision.activation_bytes
    wq, wk, wv, wo = _kv_widths(ctx.model)
    tok = sh.tokens
    ring_n = ring_steps(cols)
    u = c / ring_n
    a2a_link = group_link(u, t, ctx.fabric, "all_to_all")
    # (t where each rank holds whole KV heads; less by the repeat where MindSpeed repeats them
    # to the query heads before the all-to-all, which then moves K and V, and the hybrid's ring
    # passes them, that much wider)
    repeat = kv_repeat(ctx, cols)
    split = kv_split(ctx.model, t) / repeat
    a2a = sum((coll.all_to_all_s(tok * w / s * beta, u, a2a_link) for w, s in ((wq, t), (wk, split), (wv, split), (wo, t))),
              0.0)
    send: Array | float = 0.0
    if ctx.eff.ring_exchange == "allgather":
        # One all-gather of K and V in each pass (the backward gathers them again), and the
        # backward's n sends of their gradients, one after every step.
        _, ring_f, send = ring_exchange_seconds(ctx.model, ctx.fabric, beta, cols, sh)
        ring_b = ring_f + ring_n * send
    else:
        kv = rank_kv_elements(ctx.model, t, sh) * repeat * beta
        ring_link = group_link(ring_n, t * u, ctx.fabric, "p2p")
        ring_f = np.where(ring_n > 1, (ring_n - 1) * coll.p2p_s(kv, ring_link), 0.0)
        # Transformer Engine's backward sends at each of its n steps: K,V alone first, K,V and the
        # dK,dV accumulated so far in between, dK,dV alone last: 2(n - 1) blocks in n sends.
        ring_b = np.where(ring_n > 1, ring_n * ring_link.latency + (ring_n - 1) * 2.0 * kv / ring_link.bandwidth, 0.0)
    gathered = gathers_kv(cols)
    if np.any(gathered):  # all-gather CP: no ring, no Ulysses part
        _, gather_f, gather_b = kv_allgather_seconds(ctx.model, ctx.fabric, beta, cols, sh)
        ring_f, ring_b = np.where(gathered, gather_f, ring_f), np.where(gathered, gather_b, ring_b)
        a2a, send = np.where(gathered, 0.0, a2a), np.where(gathered, 0.0, send)
    return ring_f, ring_b, a2a, send


@dataclass(frozen=True)
class LayerComm:
    """A decoder layer's raw TP and CP seconds, for every kind of layer (dense, MoE, an MTP
    module's), worked out once per call (``layer_comm``)."""

    #: forward (= backward) TP seconds of a dense layer: the attention's collectives and the
    #: MLP's (``attention`` + one all-reduce equivalent of the layer's activation)
    tp: Array | float
    #: CP ring forward, ring backward and Ulysses all-to-alls per pass (``_cp_seconds``)
    ring_f: Array | float
    ring_b: Array | float
    a2a: Array | float
    #: one send of torch's K and V gradients (``ring_exchange_seconds``; its all-gather is
    #: ``ring_f``); 0 for Transformer Engine's ring
    ring_grad_send: Array | float = 0.0
    #: forward (= backward) TP seconds of a MoE layer's MLP block, the attention's pair apart
    #: (``_moe_block_tp_seconds``), and the part of it the shared experts move; 0 for a model
    #: without MoE layers
    moe_block: Array | float = 0.0
    moe_shared: Array | float = 0.0
    #: forward (= backward) TP seconds of the attention block (``_attention_tp_seconds``), and
    #: what recomputing MLA's up-projections (mla_up_proj) replays of them
    attention: Array | float = 0.0
    mla_up_replay: Array | float = 0.0
    #: forward all-gather (= backward reduce-scatter) seconds of the QKV output where tp exceeds
    #: the KV heads (``qkv_gather_seconds``), apart from ``attention``: no TP overlap hides it
    qkv_gather: Array | float = 0.0


def qkv_gather_seconds(ctx: LayerContext, cols: dict[str, Array], sh: Sharding) -> Array | float:
    """Seconds of Megatron-Core's all-gather of the QKV output over the TP group where it has more
    ranks than the model has KV heads (Attention.get_query_key_value_tensors: each rank then
    keeps one KV head and its queries), per pass: T·(q + gate + k + v)·β gathered in the forward,
    its gradient reduce-scattered in the backward; 0 where tp divides the KV heads, and for MLA.
    A plain collective on the compute stream (all_gather_last_dim_from_tensor_parallel_region):
    Transformer Engine's TP overlap does not reach it."""
    model, t = ctx.model, cols["tp"]
    if model.is_mla:
        return 0.0
    above = np.asarray(t) > model.num_kv_heads
    if not np.any(above):
        return 0.0
    link = group_link(t, 1.0, ctx.fabric, "ring")
    gathered = sh.tokens * qkv_output_width(model) * ctx.precision.activation_bytes
    return np.where(above, coll.all_gather_s(gathered, t, link), 0.0)


def _attention_tp_seconds(ctx: LayerContext, cols: dict[str, Array], sh: Sharding,
                          activation: Array | float) -> tuple[Array | float, Array | float]:
    """(the attention block's TP seconds per pass, the part mla_up_proj's recompute replays).

    One all-reduce equivalent of A (an all-gather of the input and a reduce-scatter of the
    output under SP, an all-reduce without), but MLA under SP in Megatron-Core: its
    down-projections (duplicated TELinear) take each rank's sequence shard, so the group
    all-gathers the latents instead of the hidden state, T·(q_lora + kv_lora) through the
    up-projections' ColumnParallel input (the hidden state's A for a query projected without a
    latent, q_lora_rank 0) and the rope key's T·d_rope (gather_from_sequence_parallel_region),
    and the backward reduce-scatters their gradients; the output projection's reduce-scatter of A
    stays. Recomputing mla_up_proj replays the up-projections and their gathers. Without SP
    the pair is priced as for other attention."""
    model, t = ctx.model, cols["tp"]
    pair = _tp_seconds(ctx, cols, activation, 1.0)
    if not model.is_mla:
        return pair, 0.0
    link = group_link(t, 1.0, ctx.fabric, "ring")
    beta = ctx.precision.activation_bytes
    q_in = model.q_lora_rank or model.hidden_size
    up_inputs = sh.tokens * (q_in + model.kv_lora_rank) * beta
    latents = up_inputs + sh.tokens * model.qk_rope_head_dim * beta
    mla = coll.all_gather_s(latents, t, link) + coll.reduce_scatter_s(activation, t, link)
    sp = cols["sequence_parallel"] > 0
    return np.where(sp, mla, pair), np.where(sp, coll.all_gather_s(up_inputs, t, link), 0.0)


def _moe_block_tp_seconds(ctx: LayerContext, cols: dict[str, Array], sh: Sharding,
                          activation: Array | float) -> tuple[Array | float, Array | float]:
    """(the MoE block's tensor-parallel seconds per pass, the shared experts' part of them).

    Megatron-Core runs the MoE block on each rank's sequence shard (it requires SP with TP;
    without TP every rank has its own tokens): the router and dispatcher take the T/t local
    tokens, the all-to-all sends their T·k/t routed copies over the EP group, and no collective
    of the attention's TP group touches them. What does:

    * shared experts (SharedExpertMLP, an MLP over the attention's TP group): an all-gather of
      the activation A before them and a reduce-scatter after, as a dense MLP under SP;
    * expert tensor parallelism (etp > 1, MoEAlltoAllTokenDispatcher): after the all-to-all the
      received copies are all-gathered over the etp group (etp consecutive ranks) and
      reduce-scattered back before the combine, a buffer of T·k·etp/t copies of h (the
      tokens the local experts' GEMMs take, ``flops.expert_tokens``) at the busiest rank's
      ``routed_token_factor``.

    The backward runs each collective's transpose, the same bytes. Without SP and with tp > 1
    (which Megatron-Core refuses for MoE training; ``memory.stages`` then holds every token's
    copies on each rank) the block is priced as before, one all-reduce of A like a dense MLP."""
    model, t, x = ctx.model, cols["tp"], cols["etp"]
    sp = cols["sequence_parallel"] > 0
    link = group_link(t, 1.0, ctx.fabric, "ring")
    pair = coll.all_gather_s(activation, t, link) + coll.reduce_scatter_s(activation, t, link)
    shared = pair if model.num_shared_experts else 0.0
    routed = (sh.tokens * model.num_experts_per_tok * x / t * model.hidden_size * ctx.precision.activation_bytes
              * ctx.eff.routed_token_factor)
    x_link = group_link(x, 1.0, ctx.fabric, "ring")
    gather = coll.all_gather_s(routed, x, x_link) + coll.reduce_scatter_s(routed, x, x_link)
    if ctx.eff.moe_dispatcher == "allgather":
        gather = 0.0  # its gather spans etp x ep at once: expert-parallel seconds (allgather_dispatch_seconds)
    sharded = sp | (t <= 1)
    return (np.where(sharded, shared + gather, _tp_seconds(ctx, cols, activation, 1.0)),
            np.where(sharded, shared, 0.0))


def layer_comm(ctx: LayerContext, cols: dict[str, Array], sh: Sharding) -> LayerComm:
    """``LayerComm`` of the rows of ``cols``."""
    activation = sh.tokens * ctx.model.hidden_size * ctx.precision.activation_bytes
    moe_block: Array | float = 0.0
    moe_shared: Array | float = 0.0
    if "moe" in ctx.model.layer_mlp_kinds or (ctx.model.mtp_depth and ctx.model.mtp_mlp_kind == "moe"):
        moe_block, moe_shared = _moe_block_tp_seconds(ctx, cols, sh, activation)
    attention, mla_up_replay = _attention_tp_seconds(ctx, cols, sh, activation)
    dense = attention + _tp_seconds(ctx, cols, activation, 1.0)
    ring_f, ring_b, a2a, ring_grad_send = _cp_seconds(ctx, cols, sh)
    return LayerComm(dense, ring_f, ring_b, a2a, ring_grad_send, moe_block, moe_shared, attention, mla_up_replay,
                     qkv_gather_seconds(ctx, cols, sh))


_ULYSSES, _HYBRID, _ALLGATHER = (CODES["cp_kind"].index(kind) for kind in ("ulysses", "hybrid", "allgather"))


def ring_steps(cols: dict[str, Array]) -> Array:
    """Ranks of each strategy's CP ring (cp / the Ulysses degree): the attention kernel's calls
    per layer and pass, one per ring step (1 without CP, under pure Ulysses and under
    all-gather CP, which run no ring; ``attention_calls`` counts the latter's calls)."""
    c, kind = cols["cp"], cols["cp_kind"]
    return c / np.where((kind == _ULYSSES) | (kind == _ALLGATHER), c, np.where(kind == _HYBRID, cols["ulysses_degree"], 1.0))


def kv_repeat(ctx: LayerContext, cols: dict[str, Array]) -> Array:
    """Per row, the times a rank's KV heads are repeated before its Ulysses all-to-all
    (``model.heads.ulysses_kv_repeat``, when the runtime repeats them: ``EfficiencyProfile.ulysses_kv_repeat``;
    1 where there is none, or it scatters whole heads)."""
    return ulysses_kv_repeat(ctx.model, cols["tp"], ulysses_ranks(cols["cp"], cols["cp_kind"], cols["ulysses_degree"]),
                             ctx.eff.ulysses_kv_repeat)


def gathers_kv(cols: dict[str, Array]) -> Array:
    """[n] bool: the strategies whose context parallelism gathers the whole K/V before attention
    (``cp_kind`` 'allgather' with cp > 1)."""
    return (cols["cp_kind"] == _ALLGATHER) & (cols["cp"] > 1)


def attention_calls(cols: dict[str, Array]) -> Array:
    """The attention kernel's calls per layer and pass: one per ring step (``ring_steps``); two
    under all-gather CP, one for each of a rank's two load-balanced sequence chunks, each over
    the gathered keys before its chunk's end."""
    return np.where(gathers_kv(cols), 2.0, ring_steps(cols))


def _groups_reached(groups: Array | float, experts: Array | float, k: float) -> Array:
    """Expected distinct groups that k distinct experts, drawn uniformly from ``experts`` split
    evenly into ``groups`` groups, fall in: G·(1 - C(E - E/G, k) / C(E, k)), the ratio as
    the product over i < k of (E - E/G - i) / (E - i)."""
    g = np.asarray(groups, dtype=np.float64)
    e = np.asarray(experts, dtype=np.float64)
    missed = np.ones(np.broadcast(g, e).shape)
    for i in range(int(k)):
        missed = missed * np.clip((e - e / g - i) / np.maximum(e - i, 1.0), 0.0, None)
    return np.asarray(g * (1.0 - missed))


def ranks_per_token(ranks: Array | float, k: float, experts: float, limit_ranks: Array | float | None = None) -> Array:
    """Expected distinct ranks one token's k experts lie on: the k distinct experts drawn
    uniformly from the ``experts`` on R = min(``limit_ranks``, ``ranks``) ranks (E/ranks each),
    ``_groups_reached``. One expert per rank gives k; many per rank, fewer."""
    r = np.asarray(ranks, dtype=np.float64)
    reach = r if limit_ranks is None else np.minimum(limit_ranks, r)
    return _groups_reached(reach, experts * reach / r, k)


def contiguous_reach(experts: int, k: int, per_group: Array | float) -> Array:
    """Mean groups of ``per_group`` consecutive experts that k consecutive experts starting at a
    multiple of k (mod E) span, over the E/gcd(E, k) distinct starts: 1 where the blocks align
    (DeepSeek-V3's 8 over ranks of 4: 2), more where they straddle (6 over groups of 8: 1.5)."""
    starts = (np.arange(experts // math.gcd(experts, k)) * k) % experts
    groups = np.asarray(per_group, dtype=np.float64)
    values, inverse = np.unique(groups, return_inverse=True)
    spans = np.array([float(np.mean((starts + k - 1) // int(q) - starts // int(q) + 1)) for q in values])
    return np.asarray(spans[inverse].reshape(groups.shape))


def remote_nodes_per_token(nodes: Array | float, k: float, experts: float, limit: int | None = None) -> Array:
    """Expected distinct remote nodes one token's k routed copies reach, over N = ``nodes``.

    The k distinct experts are drawn uniformly from those of L = min(limit, N) nodes (node-limited
    routing picks L of them; without a limit L = N), E·L/N experts, E/N per node
    (``_groups_reached``), and those L are uniform among the N, so the token's own node is one of
    them with probability L/N:

        remote = L·(1 - C(E·L/N - E/N, k) / C(E·L/N, k))·(N - 1)/N
    """
    n = np.asarray(nodes, dtype=np.float64)
    big_l = n if limit is None else np.minimum(float(limit), n)
    return _groups_reached(big_l, experts * big_l / n, k) * (n - 1.0) / n


def token_reach(model: ModelSpec, overlap: OverlapConfig, ep: Array | float, g: Array | float) -> tuple[Array, Array]:
    """(distinct ranks, distinct remote nodes) one token's k experts lie on, over ``ep`` ranks of
    ``g`` per node, with the run's routing (``OverlapConfig.ep_routing``, ``ep_node_limit``)."""
    k = model.num_experts_per_tok
    e = np.asarray(ep, dtype=np.float64)
    nodes = np.maximum(e / g, 1.0)
    if overlap.ep_routing == "contiguous":
        # k consecutive experts from a multiple of k: E/ep per rank, E/ep·g per node.
        per_rank = model.num_experts / np.maximum(e, 1.0)
        return (contiguous_reach(model.num_experts, k, per_rank),
                contiguous_reach(model.num_experts, k, per_rank * g) * (nodes - 1.0) / nodes)
    limit = overlap.ep_node_limit
    experts = float(model.num_experts)
    return (ranks_per_token(e, k, experts, None if limit is None else np.minimum(float(limit), nodes) * g),
            remote_nodes_per_token(nodes, k, experts, limit))


def _ep_all_to_all_s(ctx: LayerContext, cols: dict[str, Array], nbytes: Array | float) -> Array | float:
    """One expert all-to-all of an ``nbytes`` send buffer (all routed copies of the device's
    tokens) over the ep ranks at stride etp, with the run's dispatcher (OverlapConfig.ep_dispatch)."""
    e, x = cols["ep"], cols["etp"]
    if ctx.overlap.ep_dispatch != "node_dedup":
        return coll.all_to_all_s(nbytes, e, group_link(e, x, ctx.fabric, "all_to_all"))
    fabric = ctx.fabric
    k = float(ctx.model.num_experts_per_tok)
    g = members_per_domain(e, x, fabric.domain)
    nodes = np.maximum(e / g, 1.0)
    distinct, remote = token_reach(ctx.model, ctx.overlap, e, g)
    outside = nbytes / k * remote / fabric.scaleout_bw
    inside = nbytes / k * distinct * (g - 1.0) / g / inside_bandwidth(fabric, g)
    latency = (nodes - 1.0) * fabric.scaleout_latency + (g - 1.0) * fabric.scaleup_latency
    return np.where(e > 1, latency + np.maximum(inside, outside), 0.0)


#: Bytes per element of the allgather dispatcher's routing probabilities and of its combine
#: (cast to the probabilities' fp32 before the reduce-scatter; memory.buffers.ALLGATHER_COMBINE_BYTES).
ALLGATHER_PROBS_BYTES = 4.0


def allgather_dispatch_seconds(ctx: LayerContext, cols: dict[str, Array], sh: Sharding
                               ) -> tuple[Array | float, Array | float]:
    """(forward, backward) seconds of Megatron-Core's allgather token dispatcher
    (MoEAllGatherTokenDispatcher) in one MoE layer, over the tp_ep group: the etp·ep consecutive
    ranks of the expert layout (expert TP fastest, then EP), ring collectives.

    Each rank routes its own r = T/t tokens (T: the micro-batch's; Megatron-Core requires SP
    with TP) and the group's G = r·etp·ep are gathered whatever the routing. Forward: all-gathers
    of the routing map (G·E bytes, bool), the fp32 probabilities (G·E·4) and the hidden states
    (G·h, activation dtype), then the combine's reduce-scatter of the un-permuted output cast
    to fp32 (G·h·4). Backward, each transposed where it carries a gradient: the combine's
    gradient all-gathered in fp32 (G·h·4), the hidden states' and the probabilities' gradients
    reduce-scattered (G·h, G·E·4). The expert-TP gather of the all-to-all dispatcher is part of
    it (``_moe_block_tp_seconds`` leaves it out)."""
    model, t, x, e = ctx.model, cols["tp"], cols["etp"], cols["ep"]
    n = x * e
    link = group_link(n, 1.0, ctx.fabric, "ring")
    gathered = sh.tokens / np.maximum(t, 1.0) * n
    hidden = gathered * model.hidden_size
    scores = gathered * model.num_experts
    beta = ctx.precision.activation_bytes
    forward = (coll.all_gather_s(scores, n, link) + coll.all_gather_s(scores * ALLGATHER_PROBS_BYTES, n, link)
               + coll.all_gather_s(hidden * beta, n, link) + coll.reduce_scatter_s(hidden * ALLGATHER_PROBS_BYTES, n, link))
    backward = (coll.all_gather_s(hidden * ALLGATHER_PROBS_BYTES, n, link) + coll.reduce_scatter_s(hidden * beta, n, link)
                + coll.reduce_scatter_s(scores * ALLGATHER_PROBS_BYTES, n, link))
    return forward, backward


def ep_dispatch_bytes(ctx: LayerContext) -> float:
    """Bytes per element the dispatch all-to-all sends: the activation dtype, or with
    ``OverlapConfig.ep_dispatch_fp8`` one byte, the fp8 the expert GEMMs read (DeepSeek-V3's
    framework quantises before dispatching rather than inside the GEMM).

    Refused where the GEMMs do not run in fp8: a bf16 expert GEMM cannot read an fp8 dispatch,
    and no training runtime we know of sends one to dequantise on arrival (Megatron-Core's
    all-to-all, DeepEP and HybridEP dispatchers send the activation dtype; HybridEP refuses fp8
    dispatch outright), so the switch said 1 byte while the price stayed 2 (a silent no-op)."""
    if not ctx.overlap.ep_dispatch_fp8:
        return ctx.precision.activation_bytes
    if ctx.rates.operand_bytes != 1.0:
        raise NdplanError(
            f"ep_dispatch_fp8 sends the expert dispatch in fp8 for expert GEMMs that run in fp8 (DeepSeek-V3's "
            f"framework); precision '{ctx.precision.name}' runs them in {ctx.precision.compute_dtype}, and no runtime "
            f"dispatches fp8 to bf16 experts: turn ep_dispatch_fp8 off or price an fp8 precision (e.g. megatron-fp8)")
    return 1.0


def _layer_param_split(model: ModelSpec, kind: MlpKind) -> tuple[TpSplit, float]:
    """(non-expert as tensor parallelism splits it, routed-expert) parameters of one layer."""
    return non_expert_split(model, kind), float(layer_params(model, kind).routed_experts)


def _fsdp_groups(cols: dict[str, Array]) -> tuple[Array, Array]:
    """(non-expert, expert) FSDP shard group sizes (``memory.static.shard_groups``): the shard
    group or dp·cp ranks, at stride tp, and the expert ranks of one shard group, at stride ep·etp."""
    return shard_groups(cols["dp"], cols["cp"], cols["tp"], cols["ep"], cols["etp"], cols["shard_group"])


#: The strategy columns FSDP's shard groups, their links and how the main stream's collectives
#: stand to them read (``_fsdp_groups``, ``_fsdp_beside_scaleup``).
FSDP_GROUP_FIELDS = ("dp", "cp", "tp", "ep", "etp", "shard_group")


@dataclass(frozen=True)
class FsdpGroups:
    """What the FSDP/ZeRO-3 collectives of every piece share (``fsdp_groups``), worked out once
    for the configurations priced rather than once per piece: the (non-expert, expert) shard
    groups (``_fsdp_groups``) and their links, and the masks of the three passes' collectives.
    The groups and links are given per distinct FSDP_GROUP_FIELDS row (``codes``), the masks
    per row."""

    shard: Array
    expert_shard: Array
    ne_link: coll.Link
    ex_link: coll.Link
    #: parameters sharded and the reduce not deferred (the forward's gather, the backward's reduce)
    per_micro_batch: Array
    #: parameters sharded and resharded after forward (the backward's gather)
    regathered: Array
    #: how the main stream's (tp, cp, ep) collectives stand to FSDP's: (beside, sharing) masks
    #: (``_fsdp_beside_scaleup``), the same for every kind of layer
    beside: tuple[Array, Array, Array]
    sharing: tuple[Array, Array, Array]
    #: (tp, ep, etp) of the distinct rows the groups are given for
    degrees: tuple[Array, Array, Array] | None = None
    #: [rows] the distinct row each row has; None: the distinct rows are the rows themselves
    codes: Array | None = None

    def spread(self, value: Array | float) -> Array | float:
        """``value`` per distinct row, per row (scalars as they are)."""
        return _spread(value, self.codes)


def fsdp_groups(ctx: LayerContext, cols: dict[str, Array]) -> FsdpGroups:
    """The shared part of ``_fsdp_pass_seconds`` for the rows of ``cols``. The shard groups, their
    links and how the main stream's collectives stand to them depend on FSDP_GROUP_FIELDS
    alone, 500-750 distinct rows among a DeepSeek-V3 search call's 23-28k layer configurations:
    worked out on those and spread to the rows, as the pieces' FSDP collectives are (the same
    operations on the same values, so the same bits, for each piece two gathers where each
    collective's formula ran over every configuration)."""
    sharded = (cols["zero"] >= 3) | (cols["fsdp"] > 0)
    reshard = cols["reshard_after_forward"] > 0
    deferred = (cols["pp"] > 1) & ctx.eff.pipeline_defers_fsdp_reduce
    group_cols: dict[str, Array] = cols
    codes: Array | None = None
    if all(np.ndim(cols[name]) == 1 for name in FSDP_GROUP_FIELDS) and len(cols["tp"]) > 1:
        codes, count = row_codes([cols[name] for name in FSDP_GROUP_FIELDS])
        first = first_of_codes(codes, count)
        group_cols = {name: np.asarray(cols[name])[first] for name in FSDP_GROUP_FIELDS}
    t, e, x = group_cols["tp"], group_cols["ep"], group_cols["etp"]
    shard, edp = _fsdp_groups(group_cols)
    beside, sharing = _fsdp_beside_scaleup(ctx, group_cols)
    if codes is not None:
        beside = (beside[0][codes], beside[1][codes], beside[2][codes])
        sharing = (sharing[0][codes], sharing[1][codes], sharing[2][codes])
    return FsdpGroups(shard, edp, group_link(shard, t, ctx.fabric, "ring"), group_link(edp, e * x, ctx.fabric, "ring"),
                      sharded & ~deferred, sharded & reshard, beside, sharing, (t, e, x), codes)


#: (forward, backward gather, backward reduce) seconds
FsdpPasses = tuple[Array | float, Array | float, Array | float]


def _fsdp_seconds(
    ctx: LayerContext, cols: dict[str, Array], non_expert: TpSplit, expert: float, groups: FsdpGroups | None = None,
) -> tuple[tuple[Array | float, Array | float], tuple[Array | float, Array | float]]:
    """(forward, backward) FSDP/ZeRO-3 seconds, and the same at the scale-up rate
    (``_fsdp_pass_seconds``, the backward's gather and reduce together)."""
    (forward, gather, reduce), (forward_full, gather_full, reduce_full) = _fsdp_pass_seconds(
        ctx, cols, non_expert, expert, groups)
    return (forward, gather + reduce), (forward_full, gather_full + reduce_full)


def _fsdp_pass_seconds(
    ctx: LayerContext, cols: dict[str, Array], non_expert: TpSplit, expert: float, groups: FsdpGroups | None = None,
) -> tuple[FsdpPasses, FsdpPasses]:
    """(forward, backward gather, backward reduce) FSDP/ZeRO-3 seconds of one piece's parameter shard gathers/reduces
    per micro-batch (its non-expert parameters per tensor-parallel rank, its routed experts per
    ep·etp rank), and the same bytes' seconds at the scale-up rate without latency (the SMs
    they hold while they hide go with those: ``collective_sm_share``; zeros where the profile
    prices no SMs). Under a pipeline that defers FSDP's reduce (``pipeline_defers_fsdp_reduce``)
    a micro-batch reduces nothing and gathers once (for its backward) where parameters are
    resharded after forward, never where they are not: the reduce, and then the gathers, come
    once a run (``step._dp_raw``). ``groups``: ``fsdp_groups`` of ``cols``, where the caller has it."""
    groups = groups or fsdp_groups(ctx, cols)
    # on the groups' distinct rows, spread to the rows below
    t, e, x = groups.degrees or (cols["tp"], cols["ep"], cols["etp"])
    shard, edp, ne_link, ex_link = groups.shard, groups.expert_shard, groups.ne_link, groups.ex_link
    gather = ctx.precision.param_gather_bytes
    grad = ctx.precision.grad_bytes
    ne, ex = non_expert.per_rank(t), expert / (e * x)
    full_rate = scaleup_link(ctx.fabric)

    def gathers_and_reduces(ne_link: coll.Link, ex_link: coll.Link) -> tuple[Array | float, Array | float]:
        ag = coll.all_gather_s(ne * gather, shard, ne_link)
        rs = coll.reduce_scatter_s(ne * grad, shard, ne_link)
        if expert:  # a piece without experts runs no expert collectives (not even their latencies)
            ag = ag + coll.all_gather_s(ex * gather, edp, ex_link)
            rs = rs + coll.reduce_scatter_s(ex * grad, edp, ex_link)
        return ag, rs

    def passes(ag: Array | float, rs: Array | float) -> FsdpPasses:
        ag, rs = groups.spread(ag), groups.spread(rs)
        # A deferring pipeline keeps parameters gathered after each backward: resharded after
        # forward, a layer is gathered again for its backward and the next forward finds it
        # gathered (one gather a micro-batch, priced in the backward); not resharded, never
        # (once a run, step.py).
        return (np.where(groups.per_micro_batch, ag, 0.0), np.where(groups.regathered, ag, 0.0),
                np.where(groups.per_micro_batch, rs, 0.0))

    seconds = passes(*gathers_and_reduces(ne_link, ex_link))
    if ctx.eff.fsdp_cpu_offload:
        # FSDP2's CPU offload: each gather first copies the unit's parameter shard in, each
        # reduce-scatter's gradient shard goes out, over the host link on FSDP's own streams.
        shard_elements = groups.spread(ne / shard + (ex / edp if expert else 0.0))
        on_host = cols["optimizer_offload"] > 0
        copy_in = np.where(on_host, shard_elements * ctx.precision.param_bytes / ctx.fabric.host_bw, 0.0)
        copy_out = np.where(on_host, shard_elements * grad / ctx.fabric.host_bw, 0.0)
        forward, gather_b, reduce_b = seconds
        seconds = (forward + np.where(groups.per_micro_batch, copy_in, 0.0),
                   gather_b + np.where(groups.regathered, copy_in, 0.0),
                   reduce_b + np.where(groups.per_micro_batch, copy_out, 0.0))
    if not ctx.eff.dp_comm_compute_share:  # no SMs priced: their yardstick unused
        return seconds, (0.0, 0.0, 0.0)
    return seconds, passes(*gathers_and_reduces(full_rate, full_rate))


def _fsdp_copy_seconds(
    ctx: LayerContext, cols: dict[str, Array], non_expert: TpSplit, expert: float, groups: FsdpGroups | None = None,
) -> tuple[Array | float, Array | float, Array | float]:
    """(forward, backward gather, backward reduce) seconds FSDP2's copies take on the compute
    stream per micro-batch (``EfficiencyProfile.fsdp_stream_copies``; 0 elsewhere), with the
    gathers and reduces ``_fsdp_pass_seconds`` prices: a gather's copy-out 2·g·P bytes, a
    reduce's copy-in (a + r)·P bytes, P the unit's parameters per device where its shard group
    has more than one rank, at the HBM rate. ZeRO-2, which reduce-scatters every micro-batch
    unit by unit as FSDP does (``step._dp_seconds``), copies its gradients in likewise."""
    if not ctx.eff.fsdp_stream_copies:
        return 0.0, 0.0, 0.0
    groups = groups or fsdp_groups(ctx, cols)
    t, e, x = groups.degrees or (cols["tp"], cols["ep"], cols["etp"])
    sharded = (np.where(groups.shard > 1, non_expert.per_rank(t), 0.0)
               + (np.where(groups.expert_shard > 1, expert / (e * x), 0.0) if expert else 0.0))
    hbm = ctx.rates.hbm_rate
    precision = ctx.precision
    copy_out = groups.spread(sharded * 2.0 * precision.param_gather_bytes / hbm)
    copy_in = groups.spread(sharded * (precision.activation_bytes + precision.grad_bytes) / hbm)
    reduces = groups.per_micro_batch | (cols["zero"] == 2)
    return (np.where(groups.per_micro_batch, copy_out, 0.0), np.where(groups.regathered, copy_out, 0.0),
            np.where(reduces, copy_in, 0.0))


def _add_fsdp_copies(piece: PieceTimes, ctx: LayerContext, cols: dict[str, Array], params: TpSplit,
                     groups: FsdpGroups | None) -> None:
    """Add to ``piece``'s compute the FSDP copies (``_fsdp_copy_seconds``) of a unit of
    ``params`` without experts: the forward gather's, the backward's gather and reduce."""
    forward, gather, reduce = _fsdp_copy_seconds(ctx, cols, params, 0.0, groups)
    piece.add("F", "compute", forward)
    piece.add("B", "compute", gather + reduce)


def _fsdp_beside_scaleup(ctx: LayerContext, cols: dict[str, Array]) -> tuple[tuple[Array, Array, Array],
                                                                              tuple[Array, Array, Array]]:
    """How the main stream's TP, CP and EP collectives stand to FSDP's transfers, as two triples
    of (tp, cp, ep) masks. Beside: FSDP's shard groups all cross the scale-up domain (their
    traffic is on the scale-out network) and that dimension's group stays inside it (its traffic
    is on the scale-up links); FSDP runs on its own stream, so it proceeds while the main stream
    waits on such a collective, which covers it. Sharing: both on the same links (both inside
    the domain, or both across it), where the time a collective spends hidden under compute is
    link time FSDP cannot have; otherwise (FSDP inside, the dimension across) neither."""
    domain = ctx.fabric.domain
    cp, t, e, x = cols["cp"], cols["tp"], cols["ep"], cols["etp"]
    shard, edp = _fsdp_groups(cols)
    fsdp_inside = fits_in_domain(shard, t, domain) & ((edp <= 1) | fits_in_domain(edp, e * x, domain))
    fsdp_out = ((shard <= 1) | ~fits_in_domain(shard, t, domain)) & ((edp <= 1) | ~fits_in_domain(edp, e * x, domain))
    tp_in, cp_in, ep_in = fits_in_domain(t, 1.0, domain), fits_in_domain(cp, t, domain), fits_in_domain(e, x, domain)

    def sharing(group_inside: Array) -> Array:
        return (fsdp_inside & group_inside) | (fsdp_out & ~group_inside)

    return (fsdp_out & tp_in, fsdp_out & cp_in, fsdp_out & ep_in), (sharing(tp_in), sharing(cp_in), sharing(ep_in))


def _pass_gemm_seconds(ctx: LayerContext, gemms: list[Gemm], rates: ComputeRates | None = None
                       ) -> tuple[dict[str, Array | float], dict[str, Array | float], dict[str, Array | float]]:
    """(seconds of ``gemms`` per pass F, B, W, routed experts scaled by the busiest rank's routed
    tokens over a balanced share, ``EfficiencyProfile.routed_token_factor``;
    forward seconds of each GEMM by name; its backward's input-gradient seconds, B, by name),
    at ``rates`` (None: ``ctx.rates``)."""
    total: dict[str, Array | float] = {p: 0.0 for p in PASS_NAMES}
    forward: dict[str, Array | float] = {}
    backward: dict[str, Array | float] = {}
    for g in gemms:
        times = gemm_pass_seconds(g, rates or ctx.rates)
        scale = ctx.eff.routed_token_factor if g.expert else 1.0
        for pass_, value in times.items():
            total[pass_] = total[pass_] + scale * value
        forward[g.name] = times["F"]
        backward[g.name] = times["B"]
    return total, forward, backward


def _weight_grad_seconds(ctx: LayerContext, bc: dict[str, Array], shardings: ShardingRows, fused: Array | float,
                         seconds_at: Callable[[ComputeRates], Array | float]) -> Array | float:
    """Weight-gradient (W) seconds per base row ``bc``: ``fused`` (per base row, at ``ctx.rates``),
    or on the rows whose launch adds its gradients apart (``UNFUSED``) ``seconds_at`` those rates
    (``ctx.unfused_rates``; per distinct sharding, spread): the same figures a launch priced
    unfused as a whole gets."""
    apart = bc.get(UNFUSED)
    if ctx.unfused_rates is None or apart is None or not np.any(apart):
        return fused
    return np.where(apart > 0, shardings.spread(seconds_at(ctx.unfused_rates)), fused)


def _chunk_sort(ctx: LayerContext, cols: dict[str, Array]) -> Array | float:
    """1 where Megatron's all-to-all dispatcher sorts the received rows by local expert (ep > 1
    and more than one local expert), else 0 (memory_ops.layer_bytes)."""
    if ctx.overlap.ep_dispatch != "all_to_all" or ctx.eff.moe_dispatcher == "allgather":
        return 0.0
    return np.where((cols["ep"] > 1) & (ctx.model.num_experts > cols["ep"]), 1.0, 0.0)


def _module_replay_seconds(ctx: LayerContext, cols: dict[str, Array], sh: Sharding, shardings: ShardingRows,
                           kind: MlpKind, gemms: list[Gemm], forward_of: dict[str, Array | float],
                           attn_f: Array | float, host_f: Array | float) -> tuple[Array | float, bool]:
    """(seconds the recompute modules replay in one layer's backward, whether they replay the
    expert dispatch): ``core_attn`` the attention core's forward, the modules' GEMMs
    (``flops.MODULE_GEMMS``, with their fp8 casts, routed experts at ``routed_token_factor``) and
    elementwise bytes (``memory_ops.module_replay_bytes``); ``moe`` re-runs the dispatch and
    combine all-to-alls too (returned apart, as expert-parallel communication). ``host_f``: the
    layer's forward host time (``decoder_layer``). ``gemms`` and ``forward_of`` are per distinct
    sharding of ``shardings``; the rest per row."""
    modules = ctx.recompute_modules
    replayed = module_gemms(gemms, modules)
    cast_f, _ = fp8_cast_seconds(ctx, replayed)
    seconds = shardings.spread(
        sum((forward_of[g.name] * (ctx.eff.routed_token_factor if g.expert else 1.0) for g in replayed), 0.0) + cast_f)
    if "core_attn" in modules:
        seconds = seconds + attn_f
    replay_bytes = module_replay_bytes(ctx.model, sh, cols["sequence_parallel"], kind, ctx.precision.activation_bytes, modules)
    seconds = seconds + ctx.eff.elementwise_passes * replay_bytes / ctx.rates.hbm_rate
    if "mla_up_proj" in modules:  # the up-projections' checkpoint builds the query and key again
        assembly_f, _ = mla_assembly_bytes(ctx.model, sh, ctx.precision.activation_bytes, ctx.eff.mla_assembly)
        seconds = seconds + assembly_f / ctx.rates.hbm_rate
    replays_moe = kind == "moe" and "moe" in modules
    if replays_moe:
        # The replayed block launches its experts again, after the dropless sync as in the
        # forward: no faster than the host launches the MoE part (the forward's host time past
        # a dense layer's, as in decoder_layer's floor).
        seconds = np.maximum(seconds, np.maximum(host_f - ctx.eff.host_layer_s, 0.0))
    return seconds, replays_moe


def _megatron_activations(ctx: LayerContext, cols: dict[str, Array]) -> LayerActivations:
    """What a layer of the rows of ``cols`` keeps for backward under Megatron-Core's runtime
    profile (``ndplan.memory.activations.layer_activations``), whose offloads the copies move.
    An unfused attention core saves its scores too, which core_attn offload moves."""
    # (and the context-parallel fields, which set the KV heads' repeat before a Ulysses all-to-all)
    columns = {name: np.asarray(cols[name]).astype(np.int64)
               for name in (*ACTIVATION_FIELDS, "cp", "cp_kind", "ulysses_degree") if name in cols}
    batch = StrategyBatch.from_columns(columns, ctx.precision, recompute_modules=ctx.recompute_modules,
                                       offload_modules=ctx.offload_modules)
    options = MemoryOptions(runtime="megatron", attention="flash" if ctx.eff.flash_attention else "eager",
                            ulysses_kv_repeat=ctx.eff.ulysses_kv_repeat)
    return layer_activations(ctx.model, batch, options)


def offloaded_bytes(ctx: LayerContext, cols: dict[str, Array], kind: MlpKind) -> Array:
    """Bytes per token of one layer that activation offload moves each way (``_megatron_activations``)."""
    return _megatron_activations(ctx, cols).offloaded[kind]


def layer_offload_seconds(ctx: LayerContext, cols: dict[str, Array], sh: Sharding, kind: MlpKind) -> Array:
    """Seconds a layer of ``kind`` waits, on average, to copy the activations of Megatron-Core's
    layer offload (``Strategy.offload_layers``, ``memory.layer_offload``) each way, before
    subtracting the compute it overlaps: c·N_k/L_k, c one layer's saved bytes over the host link
    (``Fabric.host_bw``), N_k of the model's L_k layers of that kind among the first N.

    Transformer Engine serialises the copies on a side stream in N windows of about L/N layers:
    a layer's copy must end before its window's next one starts, so the compute waits
    max(0, c - (L/N)·f) a window, f a layer's compute in that pass; over the L layers that is
    L·max(0, (N/L)·c - f), priced as each layer's max(0, (N/L)·c - f) (decoder_layer subtracts
    f). The backward reloads the same bytes under the backward's compute. The copies' own HBM
    traffic beside the compute is not priced."""
    kinds = [k == kind for k in ctx.model.layer_mlp_kinds]
    moved = first_layers(ctx.model, cols["offload_layers"].astype(np.int64))[1 if kind == "moe" else 0]
    share = moved / max(sum(kinds), 1)
    return share * _megatron_activations(ctx, cols).full[kind] * sh.tokens / ctx.fabric.host_bw


@dataclass(frozen=True)
class _LayerCompute:
    """One decoder layer's compute per pass on the base rows, seconds: the GEMMs priced per
    distinct sharding (``gemms``, each one's forward seconds ``forward_of``, per pass ``gemm``
    spread to the base rows), the attention core's forward and backward (``attn_f``, ``attn_b``),
    the elementwise passes of a forward and what selective recompute re-runs of them (``ew_f``,
    ``ew_rc``), the forward's ops counted one by one (``unfused_f``: MLA assembly, head-major
    copies, sinks, ring merges, expert biases), the host's launch time of a forward
    (``host_f``), and each pass's compute as the GPU or the host bounds it (``compute_f``,
    ``compute_b``, ``compute_w``)."""

    gemms: list[Gemm]
    forward_of: dict[str, Array | float]
    #: each GEMM's input-gradient (B) seconds by name, per distinct sharding
    backward_of: dict[str, Array | float]
    gemm: dict[str, Array | float]
    attn_f: Array | float
    attn_b: Array | float
    ew_f: Array | float
    ew_rc: Array | float
    unfused_f: Array | float
    host_f: Array | float
    compute_f: Array | float
    compute_b: Array | float
    compute_w: Array | float
    #: the forward's and backward's GPU work, before the host floor (``compute_f``, ``compute_b``)
    gpu_f: Array | float
    gpu_b: Array | float


def _layer_compute(ctx: LayerContext, bc: dict[str, Array], bsh: Sharding, shardings: ShardingRows, kind: MlpKind,
                   full_attention: bool) -> _LayerCompute:
    """The compute of one decoder layer of ``kind`` on the base rows ``bc`` (see ``_LayerCompute``)."""
    model, rates, eff = ctx.model, ctx.rates, ctx.eff
    beta = ctx.precision.activation_bytes
    gemms = layer_gemms(model, shardings.distinct, kind, full_attention=full_attention)  # per distinct sharding
    gemm_distinct, forward_of, backward_of = _pass_gemm_seconds(ctx, gemms)
    gemm = {pass_: shardings.spread(value) for pass_, value in gemm_distinct.items()}
    gemm["W"] = _weight_grad_seconds(ctx, bc, shardings, gemm["W"],
                                     lambda rates: _pass_gemm_seconds(ctx, gemms, rates)[0]["W"])
    cast_f, cast_b = (shardings.spread(value) for value in fp8_cast_seconds(ctx, gemms))
    attn_f, attn_b = attention_core_seconds(ctx, bsh, kind, full_attention, calls=attention_calls(bc))
    sort = _chunk_sort(ctx, bc) if kind == "moe" else 0.0
    gathers: Array | float = 0.0
    if kind == "moe" and eff.moe_dispatcher == "allgather":
        gathers = np.where(bc["etp"] * bc["ep"] > 1, 1.0, 0.0)
    ew_bytes, ew_rc_bytes = layer_bytes(model, bsh, bc["sequence_parallel"], kind, beta, sort, gathers)
    ew_f = eff.elementwise_passes * ew_bytes / rates.hbm_rate
    ew_rc = eff.elementwise_passes * ew_rc_bytes / rates.hbm_rate
    # Ops counted one by one as the runtime's code runs them (EfficiencyProfile): MLA's query and
    # key assembly, head-major copies around the attention kernel, the attention sinks' rescale,
    # ring attention's merges and copies, MindSpeed's KV-head repeat before a Ulysses all-to-all,
    # and the routed experts' bias adds.
    moved = (mla_assembly_bytes(model, bsh, beta, eff.mla_assembly),
             qkv_transpose_bytes(model, bsh, beta, eff.qkv_transpose),
             sink_rescale_bytes(model, bsh, beta, eff.sink_rescale),
             ring_merge_bytes(model, bsh, beta, eff.ring_merge, ring_steps(bc)),
             _kv_allgather_moved(ctx, bc, bsh),
             kv_repeat_bytes(model, bsh, beta, kv_repeat(ctx, bc)),
             expert_bias_bytes(model, bsh, beta, eff.expert_bias_add, eff.routed_token_factor)
             if kind == "moe" else (0.0, 0.0))
    unfused_f = sum((f for f, _ in moved), 0.0) / rates.hbm_rate
    unfused_b = sum((b for _, b in moved), 0.0) / rates.hbm_rate
    overhead = eff.layer_overhead_s
    gpu_f = gemm["F"] + cast_f + attn_f + ew_f + unfused_f + overhead
    host_f: Array | float = eff.host_layer_s
    host_b: Array | float = eff.host_layer_s
    floor_f: Array | float = host_f
    if kind == "moe":
        local_experts = model.num_experts / bc["ep"]
        host_f = eff.host_moe_layer_s + local_experts * eff.host_expert
        host_b = eff.host_moe_layer_s + 2.0 * local_experts * eff.host_expert
        # Dropless dispatch syncs the host on the per-expert token counts mid-forward: the GPU
        # drains what was queued before (attention block and router, g_pre) while the host
        # waits, then runs the rest as the host launches it. Launching the part before the
        # sync costs about a dense layer's host time, so the forward takes at least
        # (host_f - host_layer_s) + g_pre.
        pre_sync = (attention_gemms(model, shardings.distinct, kind, full_attention=full_attention)
                    + [g for g in gemms if g.name == "router"])
        pre_cast, _ = fp8_cast_seconds(ctx, pre_sync)
        g_pre = shardings.spread(sum((forward_of[g.name] for g in pre_sync), 0.0) + pre_cast) + attn_f
        floor_f = np.maximum(host_f, np.maximum(host_f - eff.host_layer_s, 0.0) + g_pre)

    # The GPU cannot run a layer faster than the host enqueues it (see EfficiencyProfile).
    compute_f = np.maximum(gpu_f, floor_f)
    gpu_b = gemm["B"] + cast_b + attn_b + 2.0 * ew_f + unfused_b + overhead
    compute_b = np.maximum(gpu_b, host_b)
    compute_w = gemm["W"]

    return _LayerCompute(gemms, forward_of, backward_of, gemm, attn_f, attn_b, ew_f, ew_rc, unfused_f, host_f, compute_f, compute_b,
                         compute_w, gpu_f, gpu_b)


def decoder_layer(ctx: LayerContext, cols: dict[str, Array], sh: Sharding, kind: MlpKind,
                  full_attention: bool = False, shardings: ShardingRows | None = None,
                  fsdp: FsdpGroups | None = None, comm: LayerComm | None = None,
                  base: BaseRows | None = None) -> tuple[PieceTimes, PieceTimes]:
    """(the layer, what recomputing it adds) for one decoder layer of ``kind`` (its attention the
    mean of the model's layers of that kind, sliding ones included; ``full_attention``: full
    causal attention, as an MTP module's layer). ``shardings``: the distinct shardings of ``sh``
    (``sharding_rows``), on which the GEMMs are priced; None prices them on ``sh``. ``fsdp``:
    ``fsdp_groups`` of ``cols``, ``comm`` its ``layer_comm``, where the caller has them.
    ``base``: ``base_rows`` of ``cols``, on which the sharding part is priced (then
    ``shardings`` and ``comm`` are of its rows); None prices it on the rows."""
    model, rates, eff = ctx.model, ctx.rates, ctx.eff
    # The sharding part, on the base rows (bc, bsh), spread to the rows (up) where recompute,
    # EP pairing and FSDP enter.
    base = base or BaseRows(cols, sh)
    bc, bsh, up = base.cols, base.sh, base.spread
    shardings = shardings or ShardingRows(bsh)
    computed = _layer_compute(ctx, bc, bsh, shardings, kind, full_attention)
    gemms, forward_of, gemm, attn_f, attn_b = (computed.gemms, computed.forward_of, computed.gemm, computed.attn_f,
                                               computed.attn_b)
    ew_rc, host_f, unfused_f = computed.ew_rc, computed.host_f, computed.unfused_f
    compute_f, compute_b, compute_w = computed.compute_f, computed.compute_b, computed.compute_w

    comm = comm or layer_comm(ctx, bc, bsh)
    tp = comm.tp
    # What selective recompute's replay of the MLP block's modules re-runs of the TP seconds:
    # a dense layer's MLP collective is half its TP (mlp; moe and shared_experts too, as
    # before); a MoE layer's block collectives are its own (_moe_block_tp_seconds): moe re-runs
    # them all, shared_experts the shared experts' pair.
    modules = set(ctx.recompute_modules)
    mlp_tp = comm.tp - comm.attention  # a dense layer's MLP pair
    replayed_tp: Array | float = mlp_tp if {"mlp", "moe", "shared_experts"} & modules else 0.0
    if kind == "moe":
        tp = comm.attention + comm.moe_block
        replayed_tp = comm.moe_block if "moe" in modules else comm.moe_shared if "shared_experts" in modules else 0.0
    if "mla_up_proj" in modules:
        replayed_tp = replayed_tp + comm.mla_up_replay
    replays_mlp_tp: Array | float = np.divide(replayed_tp, tp, out=np.zeros(np.shape(tp)), where=np.asarray(tp) > 0)
    tp_f = _exposed(tp, gemm["F"], ctx.overlap.tp)
    if kind == "dense":
        tp_f = _paired_tp_forward(ctx, bc, bsh, shardings, forward_of, tp_f)
    # The overlap may reach the backward's all-gathers alone (EfficiencyProfile.tp_overlap_backward).
    gathers = tp * (tp_gather_part(ctx, bc, bsh) if eff.tp_overlap_backward == "all-gathers" else 1.0)
    tp_b = _exposed(gathers, gemm["B"] + gemm["W"], ctx.overlap.tp) + (tp - gathers)
    if kind == "dense":
        tp_b = _paired_tp_backward(ctx, bc, bsh, shardings, computed.backward_of, tp_b)

    ring_f, ring_b, a2a = comm.ring_f, comm.ring_b, comm.a2a
    ring_n = ring_steps(bc)
    hide_ring = ctx.overlap.cp_ring
    if eff.ring_exchange == "allgather":
        # torch's all-gather runs under the first of the n equal steps alone (the second waits
        # for it); each gradient send under the next step's backward, the last under nothing.
        step_f, step_b = attn_f / ring_n, attn_b / ring_n
        gather, send = ring_f, comm.ring_grad_send
        cp_f = _exposed(gather, step_f, hide_ring) + a2a
        cp_b = (_exposed(gather, step_b, hide_ring) + (ring_n - 1.0) * _exposed(send, step_b, hide_ring) + send
                + a2a)
    else:
        # Forward: the ring's n - 1 sends each run under one of its n equal attention steps
        # (load-balanced causal chunks); the last step computes with nothing in flight, so
        # (n - 1)/n of it covers. Backward: a send under every step (_cp_seconds), the whole of it.
        cp_f = _exposed(ring_f, (ring_n - 1.0) / ring_n * attn_f, hide_ring) + a2a
        cp_b = _exposed(ring_b, attn_b, hide_ring) + a2a
    # All-gather CP gathers on the compute stream before its attention and reduce-scatters after:
    # nothing hides them.
    gathered = gathers_kv(bc)
    if np.any(gathered):
        cp_f, cp_b = np.where(gathered, ring_f, cp_f), np.where(gathered, ring_b, cp_b)

    # A host-bound pass leaves the GPU idle for what its floor adds (compute - gpu): its TP and
    # CP collectives, overlapped or not, run there first, so that a faster GPU never lengthens it.
    # Not a MoE layer's forward: its dropless dispatch syncs the host mid-layer, and the GPU must
    # drain the attention block's collectives before the host goes on (its floor counts them).
    if kind == "dense":
        tp_f, cp_f = _beyond_slack((tp_f, cp_f), compute_f - computed.gpu_f)
    tp_b, cp_b = _beyond_slack((tp_b, cp_b), compute_b - computed.gpu_b)

    if kind == "moe":
        routed = [g for g in gemms if g.expert]
        experts, _, _ = _pass_gemm_seconds(ctx, routed)
        expert_s = {p: shardings.spread(v) for p, v in experts.items()}
        expert_s["W"] = _weight_grad_seconds(ctx, bc, shardings, expert_s["W"],
                                             lambda rates: _pass_gemm_seconds(ctx, routed, rates)[0]["W"])
        forward, backward, paired_exposed_f, paired_exposed_b, paired_hidden_f, paired_hidden_b = _ep_exchange(
            ctx, bc, bsh, (compute_f, compute_b, compute_w), (computed.gpu_f, computed.gpu_b), expert_s, up)

    # Selective recompute's replay (below) reads the sharding part alone too.
    replays_dispatch = False
    if ctx.recompute_modules:
        selective_s, replays_dispatch = _module_replay_seconds(ctx, bc, bsh, shardings, kind, gemms, forward_of,
                                                               attn_f, host_f)
    elif eff.selective_recompute == "torchtitan-op":
        replayed = alternate_recomputed_gemms(model, shardings.distinct, kind)
        replay_cast, _ = fp8_cast_seconds(ctx, replayed)
        selective_s = shardings.spread(gemms_seconds(replayed, rates, "F")[0] + replay_cast) + ew_rc + unfused_f
    elif eff.selective_recompute == "keep-matmuls":  # the elementwise ops layer_bytes deems recomputable
        # and the copies and merges counted one by one: no matmul or attention output of theirs is saved
        selective_s = ew_rc + unfused_f
    else:  # Megatron's default module list: the attention core alone
        selective_s = attn_f
    selective_s = up(selective_s)

    compute_f, compute_b, compute_w = up(compute_f), up(compute_b), up(compute_w)
    tp, tp_f, tp_b, replays_mlp_tp = up(tp), up(tp_f), up(tp_b), up(replays_mlp_tp)
    qkv_gather = up(comm.qkv_gather)  # (exposed in each pass; a full recompute replays it)
    ring_f, ring_b, a2a, cp_f, cp_b = up(ring_f), up(ring_b), up(a2a), up(cp_f), up(cp_b)

    out = PieceTimes()
    out.add("F", "compute", compute_f)
    out.add("B", "compute", compute_b)
    out.add("W", "compute", compute_w)
    out.add("F", "tp", tp_f + qkv_gather)
    out.add("B", "tp", tp_b + qkv_gather)
    out.add("F", "cp", cp_f)
    out.add("B", "cp", cp_b)

    ep_f: Array | float = 0.0
    ep_b: Array | float = 0.0
    if kind == "moe":
        hide_ep = cols["ep_overlap"] > 0
        # Warm-up forwards and cool-down backwards have no partner micro-batch to hide under
        # (schedule.pairing): that share of the passes runs its all-to-all exposed.
        unpaired = cols["ep_unpaired"] / cols["ep_passes"]
        ep_f = np.where(hide_ep, unpaired * forward + (1.0 - unpaired) * paired_exposed_f, forward)
        ep_b = np.where(hide_ep, unpaired * backward + (1.0 - unpaired) * paired_exposed_b, backward)
        out.add("F", "ep", ep_f)
        out.add("B", "ep", ep_b)

    # The copies of activation offload (modules or whole layers: Megatron runs one or the other)
    # each way, beside the pass they overlap.
    offloads_layers = np.any(cols["offload_layers"] > 0)
    if ctx.offload_modules or offloads_layers:
        link = (layer_offload_seconds(ctx, cols, sh, kind) if offloads_layers
                else offloaded_bytes(ctx, cols, kind) * sh.tokens / ctx.fabric.host_bw)
        out.add("F", "offload", np.maximum(link - out.total("F"), 0.0))
        out.add("B", "offload", np.maximum(link - out.total("B") - out.total("W"), 0.0))

    # Recompute: full replays the whole forward (its collectives too); selective replays what
    # the recompute modules name (Megatron's --recompute-modules), else the runtime's policy:
    # the attention core (Megatron's default, core_attn) or every second matmul and the cheap
    # elementwise ops (torchtitan's per-op policy), or the elementwise ops alone (keep-matmuls).
    rc = PieceTimes()
    full = cols["recompute"] == 2
    selective = cols["recompute"] == 1
    recomputed_s = np.where(full, compute_f, np.where(selective, selective_s, 0.0))
    rc.add("B", "compute", recomputed_s)
    # Replayed modules re-run their collectives: the MLP block's TP/SP ones and MLA's
    # up-projection gathers (replays_mlp_tp of the layer's, above); the attention core's CP
    # exchange with core_attn (also Megatron's default policy); the expert dispatch where the
    # replayed modules include it. Each as a share of the forward's (share_*): all of it under full.
    replays_core = "core_attn" in modules or (not modules and eff.selective_recompute == "megatron")
    share_tp = np.where(full, 1.0, np.where(selective, replays_mlp_tp, 0.0))
    share_cp = np.where(full | (selective & replays_core), 1.0, 0.0)
    share_ep = np.where(full | (selective & replays_dispatch), 1.0, 0.0)
    rc.add("B", "tp", share_tp * tp_f + np.where(full, qkv_gather, 0.0))
    rc.add("B", "cp", share_cp * cp_f)
    rc.add("B", "ep", share_ep * ep_f)
    # FSDP gathers a layer's shard before its backward and reduce-scatters the gradients after
    # it, while the neighbouring layers' backward runs; the recomputed forward is part of that
    # backward (the hook gathers once, the replay finds the parameters whole), so it hides them too.
    # So do the main stream's collectives on other links (_fsdp_beside_scaleup).
    non_expert, expert = _layer_param_split(model, kind)
    fsdp = fsdp or fsdp_groups(ctx, cols)
    (fs_f, fs_gather_b, fs_reduce_b), (full_f, full_gather_b, full_reduce_b) = _fsdp_pass_seconds(
        ctx, cols, non_expert, expert, fsdp)
    (by_tp, by_cp, by_ep), (sharing_tp, sharing_cp, sharing_ep) = fsdp.beside, fsdp.sharing
    # The backward's stream holds what the recompute replays of the forward's collectives too
    # (selective's share as much as full's: a replay that hid FSDP under full alone priced
    # selective recompute above full where FSDP's traffic set the pace).
    stream_f = np.where(by_tp, tp_f + qkv_gather, 0.0) + np.where(by_cp, cp_f, 0.0) + np.where(by_ep, ep_f, 0.0)
    stream_b = (np.where(by_tp, tp_b + qkv_gather + share_tp * tp_f + np.where(full, qkv_gather, 0.0), 0.0)
                + np.where(by_cp, cp_b + share_cp * cp_f, 0.0)
                + np.where(by_ep, ep_b + share_ep * ep_f, 0.0))
    # A collective hidden under the same compute on FSDP's links holds those links meanwhile:
    # that compute covers FSDP for what is left, so that the two together never hide more than
    # the compute lasts (counted apart, a faster device, less cover, exposed both and ran slower).
    ep_hidden_f: Array | float = 0.0
    ep_hidden_b: Array | float = 0.0
    if kind == "moe":
        paired = np.where(hide_ep, 1.0 - unpaired, 0.0)
        ep_hidden_f = paired * paired_hidden_f
        ep_hidden_b = paired * paired_hidden_b
    held_f = (np.where(sharing_tp, tp - tp_f, 0.0) + np.where(sharing_cp, ring_f + a2a - cp_f, 0.0)
              + np.where(sharing_ep, ep_hidden_f, 0.0))
    held_b = (np.where(sharing_tp, tp - tp_b + share_tp * (tp - tp_f), 0.0)
              + np.where(sharing_cp, ring_b + a2a - cp_b + share_cp * (ring_f + a2a - cp_f), 0.0)
              + np.where(sharing_ep, ep_hidden_b + share_ep * ep_hidden_f, 0.0))
    cover_f = np.maximum(compute_f + stream_f - held_f, 0.0)
    cover_b = np.maximum(compute_b + recomputed_s + stream_b - held_b, 0.0)
    out.add("F", "dp", _fsdp_exposed(ctx, fs_f, cover_f, full_f))
    # A split backward runs W later, apart from B: B's gather hides under B alone and the
    # reduce, of the gradients W makes, under W; elsewhere both under the whole backward.
    split = np.isin(cols["schedule"], SPLIT_SCHEDULE_CODES)
    together = _fsdp_exposed(ctx, fs_gather_b + fs_reduce_b, cover_b + compute_w, full_gather_b + full_reduce_b)
    out.add("B", "dp", np.where(split, _fsdp_exposed(ctx, fs_gather_b, cover_b, full_gather_b), together))
    out.add("W", "dp", np.where(split, _fsdp_exposed(ctx, fs_reduce_b, compute_w, full_reduce_b), 0.0))
    copy_f, copy_gather_b, copy_reduce_b = _fsdp_copy_seconds(ctx, cols, non_expert, expert, fsdp)
    out.add("F", "compute", copy_f)
    out.add("B", "compute", copy_gather_b + np.where(split, 0.0, copy_reduce_b))
    out.add("W", "compute", np.where(split, copy_reduce_b, 0.0))
    if ctx.weight_grad_rebuilds:
        # A split backward's W calls autograd once per parameter group, and each call replays
        # the checkpointed layer's forward: G more forwards per layer and micro-batch (traced
        # on the memory side, docs/accuracy.md). Priced on every stage; torch's first stage
        # runs one whole backward at W instead, G − 1 fewer.
        rebuilds = np.where(full & np.isin(cols["schedule"], SPLIT_SCHEDULE_CODES), float(weight_grad_groups(model)[kind]), 0.0)
        for category, forward_s in (("compute", compute_f), ("tp", tp_f + qkv_gather), ("cp", cp_f), ("ep", ep_f)):
            rc.add("W", category, rebuilds * forward_s)
    return out, rc


def paired_exposure(comm: tuple[Array | float, ...], attention: tuple[Array | float, Array | float],
                    experts: tuple[Array | float, Array | float, Array | float], share: Array | float = 0.0,
                    slack: Array | float = 0.0) -> tuple[Array | float, Array | float]:
    """(forward's, backward's) exposed seconds of a forward layer paired with another micro-batch's
    backward layer in Megatron-Core's combined 1F1B (``_ep_exchange``): ``comm`` the all-to-alls
    (dispatch_F, combine_F, dispatch_B, combine_B), ``attention`` the (F, B) compute but the
    experts', ``experts`` their (F, B, W) GEMMs; ``share`` of the compute a hidden all-to-all
    slows. The pair takes

        max(combine_B, attention_F) + phase 2 + max(combine_F, attention_B) (+ the share terms),
        phase 2 = max(max(experts_B + experts_W, dispatch_F) + experts_F, max(dispatch_F, experts_B) + dispatch_B),

    whose excess over the compute is phase 1's for the backward, phase 3's for the forward and
    phase 2's split by the dispatches' seconds. ``slack``: seconds the host's floor adds to the
    pair's compute, which the GPU spends idle: the excess is paid only beyond it (shared as
    above), so that a faster device never lengthens the pair."""
    dispatch_f, combine_f, dispatch_b, combine_b = comm
    attention_f, attention_b = attention
    experts_f, experts_b, experts_w = experts

    # Phase 2: experts_F starts when both dispatch_F and experts_B + W are done; dispatch_B
    # when both dispatch_F and experts_B are.
    compute = experts_b + experts_w + experts_f
    comp_end = np.maximum(experts_b + experts_w, dispatch_f) + experts_f
    comm_end = np.maximum(dispatch_f, experts_b) + dispatch_b
    middle = np.maximum(comp_end, comm_end) - compute + share * np.minimum(dispatch_f + dispatch_b, compute)
    sent = dispatch_f + dispatch_b
    to_forward = np.divide(dispatch_f, sent, out=np.zeros(np.shape(sent)), where=np.asarray(sent) > 0)
    forward = _exposed(combine_f, attention_b, True, share) + to_forward * middle
    backward = _exposed(combine_b, attention_f, True, share) + (1.0 - to_forward) * middle
    if not np.any(slack):
        return forward, backward
    total = forward + backward
    paid = np.maximum(total - slack, 0.0)
    kept = np.divide(paid, total, out=np.zeros(np.shape(total)), where=np.asarray(total) > 0)
    return forward * kept, backward * kept


def _ep_exchange(ctx: LayerContext, bc: dict[str, Array], bsh: Sharding,
                 compute: tuple[Array | float, Array | float, Array | float], gpu: tuple[Array | float, Array | float],
                 experts: dict[str, Array | float], up: Callable[[Array | float], Array | float]
                 ) -> tuple[Array | float, ...]:
    """A MoE layer's expert dispatch and combine, seconds per row (spread by ``up`` from the base
    rows ``bc``): (forward, backward, what a pass paired with another micro-batch's exposes in
    its forward and backward, and what it hides there under the layer's compute). ``compute``:
    the layer's (F, B, W) compute, ``gpu`` the GPU's part of F and B (below the host's floor);
    ``experts``: the routed experts' GEMMs' part of them per pass.

    A paired pass runs as Megatron-Core's combined 1F1B runs a forward layer beside another
    micro-batch's backward layer (TransformerLayerSchedulePlan.run), three phases, each until
    both streams are done, the communication stream beside the compute stream:

        comm:  combine_B      | dispatch_F -> dispatch_B      | combine_F
        comp:  attention_F    | experts_B -> experts_W -> experts_F | attention_B     (attention_W after)

    with the data dependencies of phase 2 (experts_F waits for dispatch_F, dispatch_B for
    experts_B). "Attention" is the layer's compute but the experts' GEMMs (norms, router,
    permutation, shared experts with it), the phases are the GPU's; the pair takes the longer of
    them and its compute as the host floors it (a host-bound layer leaves the GPU idle, and the
    all-to-alls run there). What the pair takes beyond its compute is what it exposes, the
    forward's and backward's shares as the phases' excesses fall: phase 1's to the backward,
    phase 3's to the forward, phase 2's split by their bytes. Where the compute runs beside a
    hidden all-to-all it is slowed by ``ep_comm_compute_share``.
    DualPipe's forward-backward chunks (the DeepSeek-V3 report's figure 4) pair the same
    components."""
    model, eff = ctx.model, ctx.eff
    beta = ctx.precision.activation_bytes
    t = bc["tp"]
    compute_f, compute_b, compute_w = compute
    # Dispatch sends the routed copies in the activation dtype (Megatron-Core quantises
    # inside the expert GEMM) or, with ep_dispatch_fp8, at fp8 GEMM operand width; combine
    # returns them in activation width; the backward moves gradients both ways.
    share = eff.ep_comm_compute_share
    if eff.moe_dispatcher == "allgather":
        # every token of the group moves whatever the routing: no busiest-rank factor
        forward, backward = allgather_dispatch_seconds(ctx, bc, bsh)
        dispatch_f = combine_f = 0.5 * forward
        dispatch_b = combine_b = 0.5 * backward
    else:
        copies = bsh.tokens * model.num_experts_per_tok / t * model.hidden_size
        dispatch_bytes = ep_dispatch_bytes(ctx)
        # (each all-to-all priced once: the combine's serves the backward's two, and the
        # dispatch where it sends at activation width too)
        combine = _ep_all_to_all_s(ctx, bc, copies * beta)
        dispatch = combine if dispatch_bytes == beta else _ep_all_to_all_s(ctx, bc, copies * dispatch_bytes)
        # the busiest rank's routed copies: moe_imbalance, or the capacity factor of padded buffers
        factor = eff.routed_token_factor
        dispatch_f, combine_f = dispatch * factor, combine * factor
        dispatch_b = combine_b = combine * factor
        forward, backward = dispatch_f + combine_f, dispatch_b + combine_b
    exposed_f, exposed_b = paired_exposure(
        (dispatch_f, combine_f, dispatch_b, combine_b),
        (np.maximum(gpu[0] - experts["F"], 0.0), np.maximum(gpu[1] - experts["B"], 0.0)),
        (experts["F"], experts["B"], experts["W"]), share,
        slack=(compute_f - gpu[0]) + (compute_b - gpu[1]))
    paired_exposed_f, paired_exposed_b = up(exposed_f), up(exposed_b)
    # Overlapped: what a paired pass hides (holding the links FSDP uses).
    paired_hidden_f = up(np.minimum(forward, compute_f))
    paired_hidden_b = up(np.minimum(backward, compute_b + compute_w))
    forward, backward = up(forward), up(backward)
    return forward, backward, paired_exposed_f, paired_exposed_b, paired_hidden_f, paired_hidden_b


def embedding_piece(ctx: LayerContext, cols: dict[str, Array], sh: Sharding, fsdp: FsdpGroups | None = None,
                    base: BaseRows | None = None) -> PieceTimes:
    """Embedding lookup (vocab-parallel). Its TP collective: without SP an all-reduce of the
    partial lookups forward, whose backward is the identity (reduce_from_tensor_model_parallel
    _region); with SP a reduce-scatter to the sequence shards forward, whose backward all-gathers
    the output gradient, the same A bytes (reduce_scatter_to_sequence_parallel_region). ``base``:
    ``base_rows`` of ``cols``, on which the lookup and its TP collectives are priced."""
    model = ctx.model
    beta = ctx.precision.activation_bytes
    base = base or BaseRows(cols, sh)
    bc, bsh, up = base.cols, base.sh, base.spread
    fwd_bytes, bwd_bytes = embedding_bytes(model, bsh, beta)
    backward_s = up(bwd_bytes / ctx.rates.hbm_rate)
    out = PieceTimes()
    out.add("F", "compute", up(fwd_bytes / ctx.rates.hbm_rate))
    out.add("B", "compute", backward_s)
    activation = bsh.tokens * model.hidden_size * beta
    t = bc["tp"]
    link = group_link(t, 1.0, ctx.fabric, "ring")
    sp = bc["sequence_parallel"] > 0
    out.add("F", "tp", up(np.where(sp, coll.reduce_scatter_s(activation, t, link), coll.all_reduce_s(activation, t, link))))
    out.add("B", "tp", up(np.where(sp, coll.all_gather_s(activation, t, link), 0.0)))
    table = TpSplit(model.vocab_size * model.hidden_size, 0)  # vocabulary-parallel
    (fs_f, fs_b), (_, full_b) = _fsdp_seconds(ctx, cols, table, 0.0, fsdp)
    out.add("F", "dp", _exposed(fs_f, 0.0, False))
    out.add("B", "dp", _fsdp_exposed(ctx, fs_b, backward_s, full_b))
    _add_fsdp_copies(out, ctx, cols, table, fsdp)
    return out


def table_copy_piece(ctx: LayerContext, cols: dict[str, Array], sh: Sharding,
                     shardings: ShardingRows | None = None, fsdp: FsdpGroups | None = None,
                     base: BaseRows | None = None) -> PieceTimes:
    """The output stage's own copy of a tied table, or of the embedding MTP modules read, where
    the two ends sit on different stages (the step counts it there): its FSDP gather and
    reduce-scatter, hidden under the head's passes as an untied head's table is. ``shardings``
    and ``base`` as in ``head_piece``."""
    model = ctx.model
    base = base or BaseRows(cols, sh)
    shardings = shardings or ShardingRows(base.sh)
    head = head_gemms(model, shardings.distinct)
    head_s = {p: shardings.spread(gemms_seconds(head, ctx.rates.head, p)[0]) for p in PASS_NAMES}
    head_s["W"] = _weight_grad_seconds(ctx, base.cols, shardings, head_s["W"],
                                       lambda rates: gemms_seconds(head, rates.head, "W")[0])
    head_s = {p: base.spread(value) for p, value in head_s.items()}
    (fs_f, fs_b), (full_f, full_b) = _fsdp_seconds(ctx, cols, TpSplit(model.vocab_size * model.hidden_size, 0), 0.0, fsdp)
    out = PieceTimes()
    out.add("F", "dp", _fsdp_exposed(ctx, fs_f, head_s["F"], full_f))
    out.add("B", "dp", _fsdp_exposed(ctx, fs_b, head_s["B"] + head_s["W"], full_b))
    _add_fsdp_copies(out, ctx, cols, TpSplit(model.vocab_size * model.hidden_size, 0), fsdp)
    return out


def head_piece(ctx: LayerContext, cols: dict[str, Array], sh: Sharding, mtp_layer: PieceTimes,
               shardings: ShardingRows | None = None, fsdp: FsdpGroups | None = None,
               base: BaseRows | None = None, mtp_rc: PieceTimes | None = None) -> PieceTimes:
    """Final norm, output head and loss, plus each MTP module (its embedding lookup, projection,
    decoder layer ``mtp_layer`` and the shared head again, with their TP collectives, and what
    recomputing it adds, ``mtp_rc``: Megatron-Core's MTP layer runs selective recompute inside its
    decoder layer like any other, and under full recompute checkpoints its projection and layer
    with the uniform method (every layer recomputed, ``recompute_layers`` 0) but not the block
    method (MultiTokenPredictionLayer._checkpointed_forward)). GEMMs priced per distinct sharding (``shardings``,
    as in ``decoder_layer``), the head's compute and TP on ``base`` (as there).

    TP, A = T·h·act_bytes the head's input: with SP an all-gather of A forward and a
    reduce-scatter of its gradient backward, without SP an all-reduce of that gradient (the
    vocabulary shards' partial sums). The loss: vocabulary-parallel (``loss_parallel``, Megatron's
    and torchtitan's with TP) on the T·V/t local logits, with three all-reduces of one fp32
    number per token forward (max, sum of exponentials, target logit); otherwise the output
    layer all-gathers the logits, T·V·act_bytes, to every rank forward (its backward keeps the
    local shard of the gradient: no communication) and the loss runs on all T·V of them.
    The head's GEMMs run in bf16 under an fp8 recipe (``ComputeRates.head``): nothing to cast."""
    model, rates = ctx.model, ctx.rates
    beta = ctx.precision.activation_bytes
    base = base or BaseRows(cols, sh)
    bc, bsh, up = base.cols, base.sh, base.spread
    shardings = shardings or ShardingRows(bsh)
    head = head_gemms(model, shardings.distinct)
    head_s = {p: shardings.spread(gemms_seconds(head, rates.head, p)[0]) for p in PASS_NAMES}
    head_s["W"] = _weight_grad_seconds(ctx, bc, shardings, head_s["W"], lambda r: gemms_seconds(head, r.head, "W")[0])
    vocab_parallel = ctx.eff.loss_parallel
    loss_s = ctx.eff.figure("loss_elementwise_passes") * head_bytes(model, bsh, bc["sequence_parallel"], beta,
                                                     ctx.eff.loss_upcast, vocab_parallel) / rates.hbm_rate
    t = bc["tp"]
    link = group_link(t, 1.0, ctx.fabric, "ring")
    sp = bc["sequence_parallel"] > 0
    activation = bsh.tokens * model.hidden_size * beta
    if vocab_parallel:  # vocab-parallel cross-entropy: three all-reduces of one fp32 number per token
        loss_tp = 3.0 * coll.all_reduce_s(bsh.tokens * 4.0, t, link)
    else:  # the logits all-gathered whole to every rank (the backward's split moves nothing)
        loss_tp = coll.all_gather_s(bsh.tokens * model.vocab_size * beta, t, link)
    tp_f = np.where(sp, coll.all_gather_s(activation, t, link), 0.0) + loss_tp
    tp_b = np.where(sp, coll.reduce_scatter_s(activation, t, link), coll.all_reduce_s(activation, t, link))

    one = PieceTimes()
    one.add("F", "compute", up(head_s["F"] + loss_s))
    one.add("B", "compute", up(head_s["B"] + loss_s))
    one.add("W", "compute", up(head_s["W"]))
    one.add("F", "tp", up(_exposed(tp_f, head_s["F"], ctx.overlap.tp)))
    one.add("B", "tp", up(_exposed(tp_b, head_s["B"], ctx.overlap.tp)))
    head_s = {p: up(value) for p, value in head_s.items()}
    table = TpSplit(0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size, 0)
    (fs_f, fs_b), (full_f, full_b) = _fsdp_seconds(ctx, cols, table, 0.0, fsdp)
    one.add("F", "dp", _fsdp_exposed(ctx, fs_f, head_s["F"], full_f))
    one.add("B", "dp", _fsdp_exposed(ctx, fs_b, head_s["B"] + head_s["W"], full_b))
    _add_fsdp_copies(one, ctx, cols, table, fsdp)

    out = PieceTimes()
    out.scaled_add(one, 1.0)
    if model.mtp_depth:
        proj = mtp_gemms(model, shardings.distinct)
        proj_s = {p: shardings.spread(gemms_seconds(proj, rates, p)[0]) for p in PASS_NAMES}
        proj_s["W"] = _weight_grad_seconds(ctx, bc, shardings, proj_s["W"], lambda r: gemms_seconds(proj, r, "W")[0])
        module = PieceTimes()
        module.scaled_add(mtp_layer, 1.0)
        module.scaled_add(one, 1.0)
        for pass_ in PASS_NAMES:
            module.add(pass_, "compute", up(proj_s[pass_]))
        # The module's own lookup of the shifted tokens in the (vocabulary-parallel) embedding,
        # its TP collective as the embedding's (embedding_piece), and eh_proj's: a column-
        # parallel 2h -> h whose SP input all-gather moves 2A forward (its gradient's reduce-
        # scatter 2A backward; without SP the input copy all-reduces that gradient), then
        # gather_from_tensor_model_parallel_region all-gathers the h/t outputs, A, forward and
        # scatter_to_sequence_parallel_region's backward all-gathers A (Megatron-Core's
        # MultiTokenPredictionLayer._concat_embeddings).
        lookup_f, lookup_b = embedding_bytes(model, bsh, beta)
        module.add("F", "compute", up(lookup_f / rates.hbm_rate))
        module.add("B", "compute", up(lookup_b / rates.hbm_rate))
        lookup_tp_f = np.where(sp, coll.reduce_scatter_s(activation, t, link), coll.all_reduce_s(activation, t, link))
        lookup_tp_b = np.where(sp, coll.all_gather_s(activation, t, link), 0.0)
        output_gather = coll.all_gather_s(activation, t, link)
        proj_tp_f = np.where(sp, coll.all_gather_s(2.0 * activation, t, link), 0.0) + output_gather
        proj_tp_b = np.where(sp, coll.reduce_scatter_s(2.0 * activation, t, link) + output_gather,
                             coll.all_reduce_s(2.0 * activation, t, link))
        proj_exposed_f = up(_exposed(proj_tp_f, proj_s["F"], ctx.overlap.tp))
        module.add("F", "tp", up(lookup_tp_f) + proj_exposed_f)
        module.add("B", "tp", up(lookup_tp_b + _exposed(proj_tp_b, proj_s["B"], ctx.overlap.tp)))
        if mtp_rc is not None:
            every = (cols["recompute"] == 2) & (cols["recompute_layers"] <= 0)  # the uniform method
            module.scaled_add(mtp_rc, np.where((cols["recompute"] == 2) & ~every, 0.0, 1.0))
            module.add("B", "compute", np.where(every, up(proj_s["F"]), 0.0))
            module.add("B", "tp", np.where(every, proj_exposed_f, 0.0))
        out.scaled_add(module, float(model.mtp_depth))
    return out


def piece_times(ctx: LayerContext, cols: dict[str, Array]) -> dict[str, PieceTimes]:
    """Every piece of a stage, for the strategies in ``cols`` (float arrays, see step.py)."""
    model = ctx.model
    sh = Sharding(*(cols[name] for name in SHARDING_FIELDS))
    if ctx.unfused_rates is not None and UNFUSED not in cols:
        # The rows whose launch adds its weight gradients apart, a base field (``UNFUSED``;
        # ``step.evaluate`` gives the flags its layer key was made of).
        apart = forced_unfused(model, cols, ctx.eff, ctx.precision)
        if apart is not None and np.any(apart):
            cols[UNFUSED] = apart.astype(np.float64)
    # Every piece's sharding part on the distinct base rows (BaseRows), with their shardings.
    base = base_rows(cols)
    shardings = sharding_rows(base.cols)
    fsdp = fsdp_groups(ctx, cols)  # every piece's FSDP collectives run over the same groups
    comm = layer_comm(ctx, base.cols, base.sh)  # and every kind of layer moves the same activations
    pieces: dict[str, PieceTimes] = {}
    for kind in ("dense", "moe"):
        if kind in model.layer_mlp_kinds or (model.mtp_depth and model.mtp_mlp_kind == kind):
            layer, rc = decoder_layer(ctx, cols, sh, kind, shardings=shardings, fsdp=fsdp,  # type: ignore[arg-type]
                                      comm=comm, base=base)
        else:
            layer, rc = PieceTimes(), PieceTimes()
        pieces[kind] = layer
        pieces[f"rc_{kind}"] = rc
    pieces["emb"] = embedding_piece(ctx, cols, sh, fsdp, base)
    mtp_layer = pieces[model.mtp_mlp_kind] if model.mtp_depth else PieceTimes()
    mtp_rc = pieces[f"rc_{model.mtp_mlp_kind}"] if model.mtp_depth else None
    if model.mtp_depth and model.sliding_layers()[0]:  # MTP modules attend in full
        mtp_layer, mtp_rc = decoder_layer(ctx, cols, sh, model.mtp_mlp_kind, full_attention=True,
                                          shardings=shardings, fsdp=fsdp, comm=comm, base=base)
    pieces["head"] = head_piece(ctx, cols, sh, mtp_layer, shardings, fsdp, base, mtp_rc)
    pieces["table_copy"] = table_copy_piece(ctx, cols, sh, shardings, fsdp, base)
    return pieces
