"""TimeReport: one strategy's step time, its parts, and an explanation of every term."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ndplan.errors import NdplanError
from ndplan.hardware.device import Cluster, Device
from ndplan.memory.options import MemoryOptions
from ndplan.memory.static import shard_groups
from ndplan.model.heads import kv_repeat_note, ulysses_kv_repeat
from ndplan.model.spec import ModelSpec
from ndplan.perf.accumulation import launch_efficiency
from ndplan.perf.efficiency import (
    DEEPGEMM_FP8_EFFICIENCY,
    FLEX_ATTENTION_SHARE,
    EfficiencyProfile,
    device_family,
    waits_for_sends,
)
from ndplan.perf.flops import (
    Sharding,
    attention_core_flops,
    gemm_flops,
    layer_gemms,
    linear_core_flops,
    model_flops_per_micro_batch,
)
from ndplan.perf.gaps import time_known_gaps
from ndplan.perf.gemm import PASS_NAMES, gemms_seconds
from ndplan.perf.layer import (
    CATEGORIES,
    LayerContext,
    flash_backward_factor,
    kv_allgather_seconds,
    offloaded_bytes,
    piece_times,
    rank_kv_elements,
    ring_exchange_seconds,
    ring_steps,
    token_reach,
)
from ndplan.perf.memory_ops import (
    expert_bias_bytes,
    kv_allgather_bytes,
    mla_assembly_bytes,
    qkv_transpose_bytes,
    ring_merge_bytes,
    sink_rescale_bytes,
)
from ndplan.perf.overlap import OverlapConfig
from ndplan.perf.step import (
    compute_rates,
    evaluate,
    optimizer_bytes_per_param,
    pricing_settings,
    strategy_columns,
)
from ndplan.perf.topology import Fabric, group_link, members_per_domain, pipeline_crossing_share
from ndplan.schedule.unshard import ACTIVE_CHUNKS, chunk_gathers
from ndplan.strategy.batch import StrategyBatch
from ndplan.strategy.rules import validate_strategy
from ndplan.strategy.strategy import CP_KINDS, Strategy

COMM_KEYS = ("tp", "cp", "ep", "dp", "offload", "pp")


def _pairs_formula(model: ModelSpec, kind: str, masked_window: bool = False) -> str:
    """The kept (query, key) pairs of a layer of ``kind`` as the explain line writes them."""
    sliding, layers = model.sliding_layers(kind)  # type: ignore[arg-type]
    linear = model.linear_layers(kind)[0]  # type: ignore[arg-type]
    if linear:  # Gated DeltaNet layers attend no pair
        return f"{layers - linear}·s(s+1)/2/{layers}" if not sliding else f"(…)/{layers} ({linear} Gated DeltaNet layers: 0)"
    if not sliding:
        return "s(s+1)/2"
    windowed = f"(w(w+1)/2 + (s−w)·w, w = min(s, {model.sliding_window:,}))"
    if masked_window:  # the window reaches the kernel as a mask: the whole square from s >= w on
        windowed = f"(s² if s ≥ {model.sliding_window:,}, else s(s+1)/2)"
    if sliding == layers:
        return windowed
    return f"({layers - sliding}·s(s+1)/2 + {sliding}·{windowed})/{layers}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


@dataclass(frozen=True)
class TimeReport:
    """Predicted step time of one strategy, in seconds, with its parts.

    breakdown: {"compute", "comm_exposed": {"tp", "cp", "ep", "dp", "offload", "pp"}, "bubble",
    "optimizer"}, seconds that sum to ``step_s``.
    model_flops: FLOPs the model needs per step (3 × forward matmuls and causal attention, no
    recompute), the MFU numerator; hardware_flops adds recomputation (HFU).
    """

    model: ModelSpec
    strategy: Strategy
    cluster: Cluster
    efficiency: EfficiencyProfile
    overlap: OverlapConfig
    step_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float
    hfu: float
    model_flops: float
    hardware_flops: float
    breakdown: dict[str, Any]
    details: dict[str, float] = field(default_factory=dict)
    #: Priced with the runtime's rebuilds per parameter group in a split backward's W.
    weight_grad_rebuilds: bool = False
    #: Seconds per micro-batch of each stage's chunks, [pp][vpp] lists for "forward", "backward"
    #: (B: the whole backward where the schedule does not split it, else its input-gradient
    #: part) and "weight_grad": what the pipeline simulation ran (a timeline can be drawn from it).
    chunk_seconds: dict[str, list[list[float]]] = field(default_factory=dict)
    #: Whether the schedule's compute waits for its own sends (``EfficiencyProfile.p2p_wait``):
    #: the chunk seconds then hold them, and a timeline drawn from them takes no time per hop.
    sends_waited: bool = False
    #: The runtime profile priced (``MemoryOptions.runtime``), where ``estimate_time`` was given one.
    runtime: str | None = None
    #: Why its launch adds the weight gradients apart though the runtime fuses them by default
    #: (``perf.accumulation``; the efficiency above says so); '' where it does not.
    unfused_why: str = ""

    @property
    def caveats(self) -> list[str]:
        """What the step-time model is known to miss for a strategy of this kind, against published
        runs (``perf.gaps``; the runtime's, where known)."""
        return time_known_gaps(self.model, self.strategy, self.runtime or "", device_family(self.cluster.device))

    def to_dict(self) -> dict[str, Any]:
        """The step time, throughput, MFU and breakdown as JSON-ready data (what --json prints under "time")."""
        return {
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "breakdown": {
                "compute": self.breakdown["compute"],
                "comm_exposed": dict(self.breakdown["comm_exposed"]),
                "bubble": self.breakdown["bubble"],
                "optimizer": self.breakdown["optimizer"],
            },
            "chunk_seconds": self.chunk_seconds,
            "sends_waited": self.sends_waited,
            "gradient_accumulation_fusion": self.efficiency.gradient_accumulation_fusion,
            **({"unfused_why": self.unfused_why} if self.unfused_why else {}),
            **({"kv_heads_repeated": self.kv_heads_repeated} if self.kv_heads_repeated > 1 else {}),
            "caveats": self.caveats,
        }

    @property
    def kv_heads_repeated(self) -> float:
        """Times a rank's KV heads are repeated before the plan's Ulysses all-to-all (1: not;
        ``model.heads.ulysses_kv_repeat``)."""
        return float(ulysses_kv_repeat(self.model, self.strategy.tp, self.strategy.ulysses_ranks,
                                       self.efficiency.ulysses_kv_repeat))

    def explain(self) -> list[str]:
        """One line per term: what it is, its formula, and its value."""
        return explain_lines(self)


def estimate_time(
    model: ModelSpec | str,
    strategy: Strategy,
    cluster: Cluster | Device | str,
    *,
    options: MemoryOptions | None = None,
    efficiency: EfficiencyProfile | None = None,
    overlap: OverlapConfig | str | Mapping[str, Any] | None = None,
    weight_grad_rebuilds: bool | None = None,
    software: Mapping[str, Any] | None = None,
) -> TimeReport:
    """Step time of one strategy: the batch path on a batch of one, with the pipeline
    schedule simulated (exact op orders) instead of its closed form (``weight_grad_rebuilds``
    and ``software`` as in ``step.evaluate``).

    ``options`` prices what its runtime runs, as ``ndplan estimate`` does (its
    ``time_keywords()``: rebuilds, selective policy, attention kernel, overlap; a keyword given
    here wins). Without options or those keywords, the device profile's own figures and the
    device runtime's overlap, as the published-run comparison uses them. ``model`` may be a
    preset name or path, ``cluster`` a Device or device name (then the strategy's world size),
    ``overlap`` an OverlapConfig or what ``parse_overlap`` reads ("megatron,tp=on").

    Raises NdplanError listing every rule the strategy breaks for this model and cluster.
    """
    from ndplan.hardware import as_device
    from ndplan.model import as_model

    model = as_model(model)
    if not isinstance(strategy, Strategy):
        raise NdplanError(f"estimate_time needs a Strategy, got {type(strategy).__name__}")
    if not isinstance(cluster, Cluster):
        cluster = as_device(cluster, "cluster")
    if isinstance(cluster, Device):
        cluster = Cluster(device=cluster, num_devices=strategy.world_size)
    if options is not None:
        if not hasattr(options, "time_keywords"):
            raise NdplanError(f"options must be a MemoryOptions (e.g. MemoryOptions(runtime='megatron')), "
                              f"got {type(options).__name__}")
        runtime = options.time_keywords()
        weight_grad_rebuilds = runtime["weight_grad_rebuilds"] if weight_grad_rebuilds is None else weight_grad_rebuilds
        software = runtime["software"] if software is None else software
        overlap = runtime["overlap"] if overlap is None else overlap
    weight_grad_rebuilds = bool(weight_grad_rebuilds)
    validate_strategy(strategy, model, cluster.num_devices)
    eff, ov = pricing_settings(cluster, efficiency, overlap, software)
    # A launch its runtime's rules run without gradient-accumulation fusion: priced, and said, so.
    eff, unfused_why = launch_efficiency(eff, model, strategy)
    batch = StrategyBatch.of(strategy)
    out = evaluate(model, batch, cluster, efficiency=eff, overlap=ov, pipeline="simulate",
                   stage_layers=strategy.stage_layers, details=True, weight_grad_rebuilds=weight_grad_rebuilds)
    chunks = out.pop("chunk_seconds")[0]  # [F/B/W, pp, vpp]: what the simulator ran
    v = {k: float(a[0]) for k, a in out.items()}
    breakdown = {
        "compute": v["compute_s"],
        "comm_exposed": {k: v[f"{k}_s"] for k in COMM_KEYS},
        "bubble": v["bubble_s"],
        "optimizer": v["optimizer_s"],
    }
    return TimeReport(
        model=model, strategy=strategy, cluster=cluster, efficiency=eff, overlap=ov,
        step_s=v["step_s"], tokens_per_s=v["tokens_per_s"], tokens_per_s_per_device=v["tokens_per_s_per_device"],
        mfu=v["mfu"], hfu=v["hfu"], model_flops=v["model_flops"], hardware_flops=v["hardware_flops"],
        breakdown=breakdown, details=v, weight_grad_rebuilds=weight_grad_rebuilds,
        chunk_seconds={name: chunks[i].tolist() for i, name in enumerate(("forward", "backward", "weight_grad"))},
        sends_waited=strategy.pp > 1 and waits_for_sends(eff.p2p_wait, strategy.schedule),
        runtime=None if options is None else options.runtime,
        unfused_why=unfused_why,
    )


def _scatters_sends(r: TimeReport) -> bool:
    """Whether the pipeline's sends are Megatron-LM's scatter/gather (``pipeline_scatter_gather``,
    a TP rank without SP sending 1/tp of the activation: ``step._p2p_seconds``)."""
    s = r.strategy
    return bool(r.efficiency.pipeline_scatter_gather and s.tp > 1 and not s.sequence_parallel and s.pp > 1)


def _p2p_note(r: TimeReport) -> str:
    """How a pipeline transfer is sent and waited for, where the runtime's facts make it other
    than the plain send the receiver waits for."""
    notes = []
    if _scatters_sends(r):
        notes.append("pipeline_scatter_gather: 1/tp of it over each TP rank's link, then an all-gather over TP")
    if r.sends_waited:
        notes.append(f"waited for by its sender (p2p_wait {r.efficiency.p2p_wait}): a pass that sends on lasts it "
                     "longer, and its output arrives as it ends")
    return f" ({'; '.join(notes)})" if notes else ""


_POLICY_REPLAYS = {
    "megatron": "the attention core",
    "keep-matmuls": "the norms and activations; matmul and attention outputs are kept",
    "torchtitan-op": "every second matmul and the elementwise ops",
}


def _dp_line(s: Strategy, r: TimeReport, d: Mapping[str, float], deferred: bool, grouped: bool) -> str:
    """The per-step data-parallel term, as the time model composes it (step._price_group)."""
    m, runs = s.num_micro_batches, s.pipeline_runs
    over = (f"shard_group = {s.shard_group}, all-reduced across {s.dp * s.cp // s.shard_group} groups" if grouped
            else f"dp·cp = {s.dp * s.cp}") + ("; experts over their own shard groups" if s.ep > 1 else "")
    per_layer = r.breakdown["comm_exposed"]["dp"] - d["dp_step_s"]
    if deferred:
        if s.reshard_after_forward:
            gathers = ""
        elif s.vpp > ACTIVE_CHUNKS:
            count = chunk_gathers(s.schedule, s.pp, s.vpp, m, s.seq_chunks)
            gathers = (f"; parameters stay gathered between micro-batches, {ACTIVE_CHUNKS} of the rank's {s.vpp} "
                       f"chunks at a time: {count} chunk gathers a run ({s.vpp} once each, the rest again, "
                       "prefetched under the run's compute)")
        else:
            gathers = "; parameters stay gathered between micro-batches: gathered once a run, prefetched under its first forward"
        return (f"DP per step: the pipeline defers FSDP's reduce, so each chunk's gradients are reduce-scattered "
                f"over {over} once a run, after its last backward, the compute stream waiting for it" + gathers
                + (f"; {runs} runs" if runs > 1 else "") + f": {_ms(d['dp_step_s'])} exposed"
                + (f"; resharded after forward, each layer is gathered again for every micro-batch's backward "
                   f"(the next forward finds it gathered), exposed inside the passes above: {_ms(per_layer)}, in the "
                   "step's dp term" if s.reshard_after_forward else ""))
    zero2 = (f", {m} times (ZeRO-2: each but the last waited for at its backward's end, what outlasts that backward "
             "less the stage's slack behind the bottleneck)" if s.zero == 2 and m > 1 else "")
    return (f"DP per step (grad {'all-reduce' if s.zero == 0 else 'reduce-scatter'} over {over}"
            f"{', param all-gather' if s.zero in (1, 2) and not s.fsdp else ''}"
            f"{zero2}"
            f"{f'; once per pipeline run, {runs} times' if runs > 1 else ''}), exposed after the pipeline: "
            f"{_ms(d['dp_step_s'])}"
            + (f" (FSDP's per-layer gathers and reduces exposed inside the passes above: {_ms(per_layer)}, in the "
               "step's dp term)" if s.zero == 3 else ""))


def _replays(strategy: Strategy, efficiency: EfficiencyProfile) -> str:
    """What a selective recompute re-runs, for the explain line (empty for other recompute)."""
    if strategy.recompute != "selective":
        return ""
    if strategy.recompute_modules:
        return f": re-runs {'+'.join(strategy.recompute_modules)}"
    return f", {efficiency.selective_recompute} policy: re-runs {_POLICY_REPLAYS[efficiency.selective_recompute]}"


def explain_lines(r: TimeReport) -> list[str]:
    s, model, d, dev = r.strategy, r.model, r.details, r.cluster.device
    batch = StrategyBatch.of(s)
    rates = compute_rates(r.cluster, batch, r.efficiency)
    cols = strategy_columns(model, batch, r.overlap)
    ctx = LayerContext(model, rates, Fabric.of(r.cluster, r.efficiency), r.efficiency, r.overlap, batch.precision,
                       r.weight_grad_rebuilds, batch.recompute_modules,
                       batch.offload_modules)
    pieces = piece_times(ctx, cols)
    sh = _sharding(s)
    dtype = s.precision.compute_dtype
    gemm_eff = rates.gemm_eff
    lines = [
        f"strategy: {s.short()} on {r.cluster.num_devices}× {dev.name}; {model.name}, seq {s.seq_length}, "
        f"global batch {s.global_batch_size} = dp {s.dp} · mbs {s.micro_batch_size} · m {s.num_micro_batches}"
        + (f" · pipeline runs {s.pipeline_runs}" if s.pipeline_runs > 1 else ""),
        f"GEMM rate = peak[{dtype}] · gemm_eff · min(1, min(M,N,K)/knee) · depth(R) = {rates.peak_flops / 1e12:,.1f} TFLOP/s · "
        f"{gemm_eff:.3f}{_fp8_kernel_text(r.efficiency, dtype)} (knee {r.efficiency.gemm_knee:.0f}; depth(R) = min(1, R/(R+{rates.depth_knee:.0f})·"
        f"({rates.depth_ref:.0f}+{rates.depth_knee:.0f})/{rates.depth_ref:.0f}), R the pass's reduction: K in F, N in B, M in W); "
        f"roofline vs HBM {rates.hbm_rate / 1e12:,.2f} TB/s effective, "
        f"each pass with its own bytes " + (
            f"(W read-modify-writes {rates.wgrad_accum_bytes:.0f} B per weight of gradient)" if not rates.wgrad_add_bytes
            else f"(W writes {rates.wgrad_accum_bytes:.0f} B per weight of gradient, then, without gradient-accumulation "
                 f"fusion, a kernel of its own adds it to the buffer: + {rates.wgrad_add_bytes:.0f} B per weight at HBM)"),
        (f"attention core rate = peak · attention_eff{_flex_text(r.efficiency)} = {rates.attention_rate / 1e12:,.1f} TFLOP/s "
         f"(fused flash kernel: backward = {flash_backward_factor(model):g}× forward FLOPs)"
         + (f", + attention_call_s {r.efficiency.attention_call_s * 1e3:g} ms per layer call (a ring step's under CP), "
            f"split F:B as 1:{flash_backward_factor(model):g}" if r.efficiency.attention_call_s else "")
         + ("" if r.efficiency.window_kernel else
            f"; a sliding window given as a mask: its whole square at peak · masked_attention_eff = "
            f"{rates.masked_attention_rate / 1e12:,.1f} TFLOP/s")
         if r.efficiency.flash_attention else
         "attention core unfused: QKᵀ and PV as GEMMs over the full s² square at the GEMM rate, plus the "
         "softmax's bytes at HBM rate; backward = 2× forward") + _sink_text(r, sh, rates.hbm_rate)
        + _assembly_text(r, sh, rates.hbm_rate),
        f"elementwise ops (norms, activations, rotary, residuals, loss): bytes · elementwise_passes "
        f"{r.efficiency.elementwise_passes:g} / HBM {rates.hbm_rate / 1e12:,.2f} TB/s"
        + (" (eager kernels: each op a pass)" if r.efficiency.elementwise_passes > 1 else " (fused kernels)"),
    ]
    if model.is_moe:
        lines.append(
            f"routed experts: {'one grouped GEMM kernel for all local experts (no per-expert cost)' if r.efficiency.expert_gemm == 'grouped' else f'a GEMM per local expert: + {r.efficiency.expert_gemm_latency_s * 1e6:g} µs each per GEMM and pass, host {r.efficiency.host_expert_s * 1e6:g} µs each per forward'}"
            + _expert_bias_text(r, sh, rates.hbm_rate)
        )
    for kind in sorted(set(model.layer_mlp_kinds)):
        gemms = layer_gemms(model, sh, kind)  # type: ignore[arg-type]
        per_pass = {ps: float(np.asarray(sum(gemms_seconds(gemms, rates, ps), 0.0)).reshape(-1)[0]) for ps in PASS_NAMES}
        flops = float(gemm_flops(gemms))
        masked = not r.efficiency.window_kernel
        attn = float(attention_core_flops(model, sh, kind=kind, masked_window=masked))  # type: ignore[arg-type]
        p = pieces[kind]
        linear_f, linear_b = (float(np.asarray(x).reshape(-1)[0]) for x in linear_core_flops(model, sh, kind))  # type: ignore[arg-type]
        lines.append(
            f"{kind} layer, one micro-batch on one device: matmul FLOPs fwd = Σ 2·M·N·K = {flops / 1e9:,.1f} GFLOP "
            f"(GEMMs F {_ms(per_pass['F'])}, B {_ms(per_pass['B'])}, W {_ms(per_pass['W'])}); attention core fwd = "
            f"2·b·(a/t)·(d_qk+d_v)·{_pairs_formula(model, kind, masked)}/c = {attn / 1e9:,.1f} GFLOP"
            + (f"; Gated DeltaNet core ({model.linear_layers(kind)[0]} of {model.linear_layers(kind)[1]} layers, "  # type: ignore[arg-type]
               f"chunks of 64) fwd {linear_f / 1e9:,.1f}, bwd {linear_b / 1e9:,.1f} GFLOP at peak · "
               f"linear_attention_eff {r.efficiency.linear_attention_efficiency:g} = "
               f"{rates.linear_attention_rate / 1e12:,.1f} TFLOP/s" if linear_f else "")
        )
        for pass_ in ("F", "B", "W"):
            parts = ", ".join(
                f"{c} {_ms(float(np.asarray(p.get(pass_, c)).reshape(-1)[0]))}" for c in CATEGORIES
                if float(np.asarray(p.get(pass_, c)).reshape(-1)[0]) > 0
            )
            lines.append(f"  {pass_}: {parts or '0'}")
        rc = float(np.asarray(pieces[f'rc_{kind}'].total("B")).reshape(-1)[0])
        if rc > 0:
            lines.append(f"  recompute ({s.recompute}{_replays(s, r.efficiency)}) adds to B: {_ms(rc)} per recomputed layer")
        if s.offload_modules:
            moved = float(np.asarray(offloaded_bytes(ctx, cols, kind)).reshape(-1)[0]) * float(sh.tokens)
            copy = moved / ctx.fabric.host_bw
            lines.append(
                f"  offload ({' '.join(s.offload_modules)}): {moved / 2**20:,.1f} MiB each way per layer and micro-batch; copy c = "
                f"bytes / (host link {dev.host_link_bandwidth_bytes_per_s / 1e9:,.0f} GB/s · host_link_efficiency "
                f"{r.efficiency.host_link_efficiency:.2f}) = {_ms(copy)}; exposed max(0, c − F) in F, "
                f"max(0, c − (B+W)) in B (its own copy stream hides the rest)")
    lines += _communication_lines(r, rates.hbm_rate)
    for name, label in (("emb", "embedding (first stage)"), ("head", "final norm + output head + loss" + (" + MTP" if model.mtp_depth else "") + " (last stage)")):
        p = pieces[name]
        total = {ps: float(np.asarray(p.total(ps)).reshape(-1)[0]) for ps in ("F", "B", "W")}
        lines.append(f"{label}: F {_ms(total['F'])}, B {_ms(total['B'])}, W {_ms(total['W'])}")
    m, runs = s.num_micro_batches, s.pipeline_runs
    deferred = s.zero == 3 and s.pp > 1 and r.efficiency.pipeline_defers_fsdp_reduce
    grouped = bool(s.shard_group and s.zero and s.shard_group < s.dp * s.cp)
    lines += [
        f"bottleneck stage {int(d['bottleneck_stage'])}: per micro-batch F {_ms(d['stage_forward_s'])}, "
        f"B {_ms(d['stage_backward_s'])}, W {_ms(d['stage_weight_grad_s'])}; p2p per transfer {_ms(d['p2p_s'])}"
        + _p2p_note(r),
        f"pipeline ({s.schedule}, pp {s.pp}, vpp {s.vpp}, m {m}, simulated): makespan "
        + (f"{_ms(d['makespan_s'])} = " if runs == 1 else
           f"{_ms(d['makespan_s'])} = {runs} runs of the schedule, each {_ms(d['makespan_s'] / runs)}; together ")
        + f"{'m·runs' if runs > 1 else 'm'}·T* "
        f"{_ms(m * runs * (d['stage_forward_s'] + d['stage_backward_s'] + d['stage_weight_grad_s']))} + bubble "
        f"{_ms(d['bubble_s'])} + " + ("p2p waited for, what it adds to the makespan" if r.sends_waited
                                       else "p2p on critical path") + f" {_ms(d['pp_s'])}",
        _dp_line(s, r, d, deferred, grouped),
        f"optimizer (Adam over the local shard, {r.efficiency.optimizer_kernel}: "
        f"{optimizer_bytes_per_param(s.precision, r.efficiency.optimizer_kernel):g} B per parameter with clipping, at "
        f"HBM · {r.efficiency.figure('optimizer_efficiency'):.2f} = "
        f"{rates.optimizer_rate / 1e12:,.2f} TB/s"
        + (f"; on the CPU, {r.efficiency.cpu_optimizer_params_per_s / 1e9:g} G parameters/s, with the gradients out "
           "and the weights back over the host link" if s.optimizer_offload else "")
        + (f", {s.optimizer_offload_fraction:g} of the shard there beside the rest on the device: max(f · CPU, "
           "(1 - f) · device)" if s.optimizer_offload and s.optimizer_offload_fraction < 1.0 else "")
        + f") + grad-norm all-reduce: {_ms(d['optimizer_update_s'])}",
        f"step = compute {_ms(r.breakdown['compute'])} + comm exposed "
        + ", ".join(f"{k} {_ms(v)}" for k, v in r.breakdown["comm_exposed"].items())
        + f" + bubble {_ms(r.breakdown['bubble'])} + optimizer {_ms(r.breakdown['optimizer'])} = {_ms(r.step_s)}",
    ]
    per_seq = model_flops_per_micro_batch(model, 1.0, float(s.seq_length))
    lines += [
        f"model FLOPs/step = gbs · 3·(matmul + causal attention fwd) = {s.global_batch_size} · "
        f"{float(per_seq.model) / 1e12:,.2f} TFLOP = {r.model_flops / 1e15:,.3f} PFLOP; hardware (with recompute) "
        f"{r.hardware_flops / 1e15:,.3f} PFLOP",
        f"MFU = model FLOPs / (step · devices · peak) = {r.mfu:.1%}; HFU {r.hfu:.1%}; "
        f"{r.tokens_per_s:,.0f} tokens/s ({r.tokens_per_s_per_device:,.0f} per device)",
    ]
    return lines


def _sharding(s: Strategy) -> Sharding:
    """One micro-batch's split on a device under ``s`` (the formulas' scalar inputs)."""
    return Sharding(float(s.micro_batch_size), float(s.seq_length), float(s.tp), float(s.cp), float(s.ep), float(s.etp),
                    float(s.sequence_parallel))


def _moved_text(moved: tuple[Any, Any], hbm_rate: float) -> str:
    """(forward, backward) bytes a layer's micro-batch moves, and their seconds at ``hbm_rate``."""
    forward, backward = (float(np.asarray(v).reshape(-1)[0]) for v in moved)
    return (f"{forward / 1e9:,.2f} GB forward, {backward / 1e9:,.2f} GB backward a layer at HBM rate = "
            f"{_ms(forward / hbm_rate)} + {_ms(backward / hbm_rate)}")


def _cp_cols(s: Strategy) -> dict[str, Any]:
    """The strategy's tp and context-parallel fields as the layer formulas read them (float columns)."""
    code = {"cp": s.cp, "tp": s.tp, "cp_kind": CP_KINDS.index(s.cp_kind), "ulysses_degree": s.ulysses_degree}
    return {k: np.asarray(v, dtype=np.float64) for k, v in code.items()}


def _ring_merge_text(r: TimeReport, sh: Sharding, hbm_rate: float) -> str:
    """What torch's ring merges and copies cost a layer's micro-batch (``memory_ops.ring_merge_bytes``)."""
    s = r.strategy
    steps = float(ring_steps(_cp_cols(s)))
    if r.efficiency.ring_merge == "fused" or steps < 2:
        return ""
    moved = ring_merge_bytes(r.model, sh, s.precision.activation_bytes, "torch", steps)
    return ("; torch's ring merges each step's output in fp32 and copies keys, values and their gradients every "
            f"step (ring_merge torch, the busiest rank): {_moved_text(moved, hbm_rate)}")


def _allgather_ring_text(r: TimeReport, fabric: Fabric) -> str:
    """torch's ring exchange (``ring_exchange`` allgather, ``layer.ring_exchange_seconds``): what it
    moves and where it hides, per layer and micro-batch."""
    s = r.strategy
    kv, gather, send = (float(np.asarray(v).reshape(-1)[0]) for v in ring_exchange_seconds(
        r.model, fabric, s.precision.activation_bytes, _cp_cols(s), _sharding(s)))
    return (f"K and V at the query heads' width, T·(a/t)·(d_qk + d_v)·β = {kv / 1e6:,.1f} MB, all-gathered over "
            f"cp={s.cp} at stride tp ({_link_text(s.cp, s.tp, fabric)}) once a pass, {_ms(gather)}, under the "
            f"first ring step alone; their fp32 gradients sent to the next rank after every backward step "
            f"({_link_text(s.cp, s.tp, fabric, 'p2p')}), {_ms(send)} each, the last under nothing "
            "(ring_exchange allgather, torch's context parallelism)")


def _kv_allgather_text(r: TimeReport, fabric: Fabric, hbm_rate: float) -> str:
    """All-gather context parallelism (``layer.kv_allgather_seconds``, ``memory_ops.kv_allgather_bytes``):
    what it moves per layer and micro-batch, all of it exposed."""
    s = r.strategy
    cols, sh = _cp_cols(s), _sharding(s)
    kv, forward, backward = (float(np.asarray(v).reshape(-1)[0]) for v in kv_allgather_seconds(
        r.model, fabric, s.precision.activation_bytes, cols, sh))
    moved = kv_allgather_bytes(r.model, sh, s.precision.activation_bytes, rank_kv_elements(r.model, s.tp, sh), s.cp)
    return (f"K and V of the rank's tokens, T·(k + v)·β = {kv / 1e6:,.1f} MB, all-gathered from cp={s.cp} ranks at "
            f"stride tp ({_link_text(s.cp, s.tp, fabric)}) before attention, {_ms(forward)} forward; gathered again "
            f"and their gradients reduce-scattered after it, {_ms(backward)} backward; exposed, on the compute stream "
            f"(Transformer Engine's and MindSpeed's AttnFuncWithCPAndKVAllGather); two attention calls a pass; "
            f"reordering, zero-filling and accumulating the gathered tensors: {_moved_text(moved, hbm_rate)}")


def _fp8_kernel_text(efficiency: EfficiencyProfile, dtype: str) -> str:
    """Whose fp8 GEMM rate the GEMM line uses, where it is not the profile's own."""
    if dtype != "fp8" or efficiency.fp8_gemm_kernel == "default":
        return ""
    if efficiency.family not in DEEPGEMM_FP8_EFFICIENCY:
        return f" (DeepGEMM: no figure for the {efficiency.family} family, priced as fp8_gemm_efficiency)"
    return " (DeepGEMM's published H800 rates, fp8_gemm_kernel deepgemm)"


def _flex_text(efficiency: EfficiencyProfile) -> str:
    """FlexAttention's share of the family's flash kernel, where it runs (``EfficiencyProfile.flex_share``)."""
    if not efficiency.flex_attention:
        return ""
    if efficiency.family not in FLEX_ATTENTION_SHARE:
        return f" (FlexAttention: no figure for the {efficiency.family} family, priced as its flash kernel)"
    return f" · FlexAttention's share {efficiency.flex_share:.3f} (its developer's {efficiency.family} averages)"


def _sink_text(r: TimeReport, sh: Sharding, hbm_rate: float) -> str:
    """What the attention sinks' rescale costs a layer's micro-batch (``memory_ops.sink_rescale_bytes``)."""
    kernel = r.efficiency.sink_rescale
    if not r.model.attention_sinks:
        return ""
    if kernel == "fused":
        return "; attention sinks in the kernel's softmax (sink_rescale fused: no bytes of their own)"
    moved = sink_rescale_bytes(r.model, sh, r.strategy.precision.activation_bytes, kernel)
    return f"; attention sinks as a rescale of its output after the kernel (sink_rescale {kernel}): {_moved_text(moved, hbm_rate)}"


def _assembly_text(r: TimeReport, sh: Sharding, hbm_rate: float) -> str:
    """What building the attention's inputs costs a layer's micro-batch beyond the GEMMs and the
    rotary op: MLA's query and key (``memory_ops.mla_assembly_bytes``) and head-major copies
    (``memory_ops.qkv_transpose_bytes``)."""
    model, eff, beta = r.model, r.efficiency, r.strategy.precision.activation_bytes
    text = ""
    if model.is_mla:
        how = ("key and value written out of the up-projection's output by the fused RoPE kernel"
               if eff.mla_assembly == "fused" else "query and key concatenated with torch.cat, the rope key expanded to every head")
        moved = mla_assembly_bytes(model, sh, beta, eff.mla_assembly)
        text += f"; MLA's {how} (mla_assembly {eff.mla_assembly}): {_moved_text(moved, hbm_rate)}"
    if eff.qkv_transpose:
        text += ("; q, k, v copied to head-major layout and the output back (qkv_transpose): "
                 f"{_moved_text(qkv_transpose_bytes(model, sh, beta, True), hbm_rate)}")
    return text


def _expert_bias_text(r: TimeReport, sh: Sharding, hbm_rate: float) -> str:
    """What the routed experts' bias adds cost a MoE layer's micro-batch (``memory_ops.expert_bias_bytes``)."""
    model, kernel = r.model, r.efficiency.expert_bias_add
    if not model.expert_bias:
        return ""
    if kernel == "fused":
        return "; expert biases in the GEMMs' epilogue (expert_bias_add fused: no bytes of their own)"
    moved = expert_bias_bytes(model, sh, r.strategy.precision.activation_bytes, kernel, r.efficiency.routed_token_factor)
    return f"; expert biases added apart (expert_bias_add {kernel}): {_moved_text(moved, hbm_rate)}"


def _link_text(size: float, stride: float, fabric: Fabric, pattern: str = "ring") -> str:
    link = group_link(size, stride, fabric, pattern)  # type: ignore[arg-type]
    level = "scale-up" if float(link.latency) == fabric.scaleup_latency else "scale-out"
    return f"{float(link.bandwidth) / 1e9:,.0f} GB/s {level}"


def _dedup_text(r: TimeReport, fabric: Fabric) -> str:
    """What the deduplicating dispatch sends of a token's k copies (``layer._ep_all_to_all_s``)."""
    s, model = r.strategy, r.model
    k, limit = model.num_experts_per_tok, r.overlap.ep_node_limit
    g = float(members_per_domain(s.ep, s.etp, fabric.domain))
    ranks, remote = (float(v) for v in token_reach(model, r.overlap, float(s.ep), g))
    how = ("contiguous experts" if r.overlap.ep_routing == "contiguous"
           else "k distinct experts at random" + (f", at most {limit} nodes" if limit else ""))
    return (f"node-dedup dispatch ({how}): a token's {k} copies reach {ranks:.2f} ranks "
            f"({ranks * (g - 1) / g:.2f} sends over the scale-up links) on {remote:.2f} remote nodes "
            "(one network send each)")


def _communication_lines(r: TimeReport, hbm_rate: float) -> list[str]:
    """Volumes, groups and links of each collective (before overlap); ``hbm_rate`` prices the
    copies the ring makes beside its sends."""
    s, model, prec = r.strategy, r.model, r.strategy.precision
    fabric = Fabric.of(r.cluster, r.efficiency)
    tokens = s.micro_batch_size * s.seq_length / s.cp
    activation = tokens * model.hidden_size * prec.activation_bytes
    out = [f"ranks: tp innermost, then cp, dp, pp; scale-up domain {fabric.domain} devices"]
    # A MoE layer runs its block on the sequence shard under SP (or without TP): its own TP line.
    moe_apart = model.is_moe and bool(s.sequence_parallel or s.tp == 1)
    if s.tp > 1 and (not moe_apart or "dense" in model.layer_mlp_kinds):
        kind = "all-gather + reduce-scatter" if s.sequence_parallel else "all-reduce"
        out.append(
            f"TP per {'dense ' if moe_apart else ''}layer and pass: 2 × {kind} of A = (b·s/c)·h·"
            f"{prec.activation_bytes} B = {activation / 1e6:,.1f} MB over tp={s.tp} ({_link_text(s.tp, 1, fabric)}"
            + ("; the all-gathers in fp8, 1 B an element: the runtime's fp8_tp_gather"
               if s.sequence_parallel and r.efficiency.fp8_tp_gather and prec.compute_dtype == "fp8" else "")
            + f"); overlap {'on' if r.overlap.tp else 'off'}"
            + ("; each collective under its own GEMM (in the forward the all-gathers under the QKV and up "
               "projections, the reduce-scatters under the output and down projections; in the backward the "
               "reverse, under the same projections' input-gradient GEMMs): Σ max(0, collective − its GEMM)"
               if r.overlap.tp and s.sequence_parallel and not model.is_mla
               and not model.has_linear_attention else "")
            + (" (in the backward on the all-gathers alone, the runtime's tp_overlap_backward)"
               if r.overlap.tp and r.efficiency.tp_overlap_backward == "all-gathers" else "")
        )
    if moe_apart and (s.tp > 1 or s.etp > 1):
        parts = []
        if s.tp > 1:
            what = "attention, shared experts" if model.num_shared_experts else "attention"
            pairs = 2 if model.num_shared_experts else 1
            parts.append(f"{pairs} × all-gather + reduce-scatter of A = {activation / 1e6:,.1f} MB ({what}; the routed "
                         f"experts run on the sequence shard)")
        if s.etp > 1 and r.efficiency.moe_dispatcher != "allgather":
            copies = tokens * model.num_experts_per_tok * s.etp / s.tp * model.hidden_size
            parts.append(f"all-gather + reduce-scatter of the (b·s/c)·k·etp/t·h = {copies / 1e6:,.1f} M elements of "
                         f"routed copies over etp={s.etp} ({_link_text(s.etp, 1, fabric)})")
        out.append("TP per MoE layer and pass: " + ", and ".join(parts))
    if s.cp > 1:
        if s.cp_kind == "ulysses":
            where = f"all-to-alls over cp={s.cp} at stride tp ({_link_text(s.cp, s.tp, fabric, 'all_to_all')})"
        elif s.cp_kind == "hybrid":
            u = s.ulysses_degree
            where = (f"all-to-alls over ulysses_degree={u} at stride tp ({_link_text(u, s.tp, fabric, 'all_to_all')}), "
                     f"ring over {s.cp // u} at stride tp·{u} ({_link_text(s.cp // u, s.tp * u, fabric, 'p2p')})")
        elif s.cp_kind == "allgather":
            where = _kv_allgather_text(r, fabric, hbm_rate)
        elif r.efficiency.ring_exchange == "allgather":
            where = _allgather_ring_text(r, fabric)
        else:
            where = f"ring over cp={s.cp} at stride tp ({_link_text(s.cp, s.tp, fabric, 'p2p')})"
        ring = "" if s.cp_kind == "allgather" else f"; ring overlap with attention {'on' if r.overlap.cp_ring else 'off'}"
        repeated = kv_repeat_note(model, s.tp, s.ulysses_ranks, r.efficiency.ulysses_kv_repeat)
        if repeated:
            where += "; " + repeated
        out.append(f"CP ({s.cp_kind}): {where}{ring}" + _ring_merge_text(r, _sharding(s), hbm_rate))
    if model.is_moe and r.efficiency.moe_dispatcher == "allgather" and s.ep * s.etp > 1:
        n = s.ep * s.etp
        gathered = tokens / s.tp * n
        out.append(f"EP per MoE layer (allgather dispatcher): all-gather of the G = (b·s/c)/t·etp·ep = {gathered:,.0f} "
                   f"tokens (h each, and the routing map and fp32 probabilities, E each), reduce-scatter of the "
                   f"experts' output cast to fp32 (G·h·4 B); the backward transposes them; over etp·ep={n} "
                   f"({_link_text(n, 1, fabric)}), whatever the routing")
    elif model.is_moe and s.ep > 1:
        copies = tokens * model.num_experts_per_tok / s.tp * model.hidden_size
        line = (f"EP per MoE layer: dispatch + combine all-to-all of (b·s/c)·k/t·h = {copies / 1e6:,.1f} M elements over "
                f"ep={s.ep} at stride etp={s.etp} ({_link_text(s.ep, s.etp, fabric, 'all_to_all')})")
        if r.overlap.ep_dispatch == "node_dedup":
            line += "; " + _dedup_text(r, fabric)
        out.append(line)
    if s.pp > 1:
        share = pipeline_crossing_share(s.schedule, s.pp, s.vpp, s.tp * s.cp * s.dp, fabric.domain)
        if 0.0 < share < 1.0:
            inside = _link_text(2, 1, fabric, "p2p")
            outside = f"{fabric.scaleout_bw / 1e9:,.0f} GB/s scale-out"
            over = f"- {share:.0%} of the hops over {outside}, the rest over {inside} (a transfer: their mean)"
        else:
            over = "over " + _link_text(s.pp, s.tp * s.cp * s.dp, fabric, "p2p")
        out.append(
            f"PP send per micro-batch and boundary: [mbs, seq/cp{'/tp' if s.sequence_parallel else ''}, h]"
            f"{'/tp (scatter/gather)' if _scatters_sends(r) else ''} {over}"
        )
    replicas = s.dp * s.cp
    if replicas > 1:
        how = ("FSDP all-gather/reduce-scatter per layer" if s.zero >= 3 or s.fsdp else
               "all-reduce" if s.zero == 0 else "reduce-scatter + parameter all-gather")
        if s.shard_group and s.zero and s.shard_group < replicas:
            groups = replicas // s.shard_group
            line = (f"DP: {how} over shard_group={s.shard_group} at stride tp ({_link_text(s.shard_group, s.tp, fabric)}), "
                    f"then an all-reduce of each shard across the {groups} groups "
                    f"({_link_text(groups, s.tp * s.shard_group, fabric)})")
        else:
            line = f"DP: {how} over dp·cp={replicas} at stride tp ({_link_text(replicas, s.tp, fabric)})"
        if model.is_moe:
            _, sharded = shard_groups(s.dp, s.cp, s.tp, s.ep, s.etp, s.shard_group)
            expert_ranks = int(sharded) if s.zero else max(replicas * s.tp // (s.ep * s.etp), 1)
            line += f"; experts over {expert_ranks} ranks at stride ep·etp"
            if expert_ranks > 1:
                line += f" ({_link_text(float(expert_ranks), s.ep * s.etp, fabric)})"
        if r.efficiency.fsdp_stream_copies and (s.zero >= 2 or s.fsdp):
            prec = s.precision
            copied = [f"each gradient into the reduce-scatter buffer cast to the reduce dtype "
                      f"({prec.activation_bytes:g} + {prec.grad_bytes:g} B an element)"]
            if s.zero >= 3 or s.fsdp:
                copied.insert(0, f"each gathered unit out of its buffer (2·{prec.param_gather_bytes:g} B an element)")
            line += (f"; copies on the compute stream at the HBM rate: {' and '.join(copied)} "
                     "(FSDP2, the runtime's fsdp_stream_copies)")
        out.append(line)
    return out
