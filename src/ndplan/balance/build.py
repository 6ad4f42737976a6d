"""Build a balancing problem from ndplan's memory and time models, solve it, and compare.

Costs come from the same code the estimator and the time model run:
* a layer's time per micro-batch: forward + backward + weight-gradient seconds of its piece in
  the time model, plus the recomputed forward for the selective/full options;
* its activation bytes per micro-batch: the runtime profile (or census) bytes per token times the
  tokens of a micro-batch on a rank, under each recompute option;
* its static bytes: parameters, gradients and optimizer states per rank after TP/EP/ZeRO;
* what does not move with layers (buffers, transients, runtime overhead) from the estimator;
* the optimizer step's peak apart: its fixed bytes, and per layer its static bytes with the
  update's temporaries (a layer moved onto a stage raises that peak whatever it recomputes).
Memory is scaled by the allocator slack the runtime profile states, so that the limit compares
with device totals as the estimator reports them.
"""

from __future__ import annotations

import time as clock
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from ndplan.balance.problem import (
    BalanceProblem,
    LayerCost,
    Plan,
    PlanCost,
    evaluate,
    simulated_step_s,
    step_never_binds,
    uniform_plan,
)
from ndplan.balance.solve import exact_method, least_peak_plan, solve_exact, solve_heuristic
from ndplan.errors import NdplanError
from ndplan.hardware import Cluster, Device
from ndplan.memory.activations import layer_activations
from ndplan.memory.options import MemoryOptions
from ndplan.memory.overhead import DEFAULTS
from ndplan.memory.stages import stage_memory
from ndplan.memory.static import (
    experts_out_of_fsdp,
    layer_elements,
    linear_weight_elements,
    optimizer_on_device,
    sharding_factors,
)
from ndplan.memory.terms import ddp_bucket_width, fp8_weight_cache_width
from ndplan.model.params import weight_grad_groups
from ndplan.model.spec import ModelSpec
from ndplan.perf.efficiency import default_efficiency, with_software
from ndplan.perf.layer import LayerContext, piece_times
from ndplan.perf.overlap import OverlapConfig, default_overlap
from ndplan.perf.step import compute_rates, strategy_columns, unfused_rates
from ndplan.perf.topology import Fabric
from ndplan.placement import place_layers
from ndplan.schedule import SPLIT_BACKWARD, InFlight, in_flight
from ndplan.strategy import Strategy, StrategyBatch
from ndplan.strategy.rules import validate_strategy
from ndplan.strategy.strategy import offload_conflict
from ndplan.units import format_bytes

OPTIONS = ("none", "selective", "full")


def piece_seconds(model: ModelSpec, batch: StrategyBatch, cluster: Cluster, *, weight_grad_rebuilds: bool = False,
                  overlap: OverlapConfig | None = None, software: Mapping[str, Any] | None = None
                  ) -> dict[str, np.ndarray]:
    """Seconds per micro-batch (F + B + W) of each piece, per strategy of ``batch``: the layer
    kinds, 'rc_dense'/'rc_moe' (what recomputing one layer adds, with a runtime's rebuilds per
    parameter group in a split W: ``ndplan.perf.step.evaluate``) and the ends 'emb'/'head'.
    ``overlap``: what the runtime hides (None: the device runtime's defaults);
    ``software``: the runtime's facts that replace the device profile's (``step.evaluate``)."""
    eff = with_software(default_efficiency(cluster.device), software)
    overlap = overlap or default_overlap(cluster.device.runtime)
    ctx = LayerContext(model, compute_rates(cluster, batch, eff), Fabric.of(cluster, eff), eff, overlap, batch.precision,
                       weight_grad_rebuilds, batch.recompute_modules,
                       batch.offload_modules, unfused_rates(cluster, batch, eff))
    pieces = piece_times(ctx, strategy_columns(model, batch, overlap))
    n = len(batch)
    return {name: np.sum([np.broadcast_to(piece.total(p), (n,)).astype(float) for p in ("F", "B", "W")], axis=0)
            for name, piece in pieces.items()}


def runnable_options(strategy: Strategy, options: MemoryOptions,
                     selective_modules: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The recompute options a plan may use: PyTorch refuses selective checkpointing under a
    split backward ("backward an extra time" in torch.distributed.pipelining, measured), as the
    search does. With activation offload (the same modules in every layer, as Megatron-Core
    runs it): not full recompute, which leaves nothing to offload, nor a selective policy that
    Megatron would refuse beside it (``offload_conflict``; ``selective_modules``: the policy
    tried, default the strategy's own)."""
    if options.runtime == "pytorch" and strategy.schedule in SPLIT_BACKWARD:
        return tuple(o for o in OPTIONS if o != "selective")
    if strategy.offload_modules:
        modules = strategy.recompute_modules if selective_modules is None else selective_modules
        selective_runs = not offload_conflict(strategy.offload_modules, "selective", modules, strategy.schedule)
        return ("none", "selective") if selective_runs else ("none",)
    return OPTIONS


def baseline_option(problem: BalanceProblem) -> str:
    """What the baseline plan runs on every layer: full recompute, else (where a plan may not
    use it: activation offload) the most memory-saving option it may."""
    return next(o for o in ("full", "selective", "none") if o in problem.options)


def build_problem(
    model: ModelSpec, strategy: Strategy, cluster: Cluster, memory_limit_bytes: float, options: MemoryOptions | None = None,
    selective_modules: tuple[str, ...] | None = None,
) -> BalanceProblem:
    """The balancing problem of ``strategy``: per layer kind and recompute option its time and
    bytes, the stages' fixed bytes, the schedule. The selective option re-runs
    ``selective_modules`` (default: the strategy's own, ``Strategy.recompute_modules``)."""
    return build_problems(model, [strategy], cluster, memory_limit_bytes, options, selective_modules)[0]


def build_problems(
    model: ModelSpec, strategies: Sequence[Strategy], cluster: Cluster, memory_limit_bytes: float,
    options: MemoryOptions | None = None, selective_modules: tuple[str, ...] | None = None, *, validate: bool = True,
) -> list[BalanceProblem]:
    """``build_problem`` of each strategy, the memory and time models run once for them all (a
    search balances hundreds: one at a time, those models' fixed costs per call were 20 ms of
    every candidate's 22). The strategies share a precision policy and offload modules, as a
    search's blocks do; ``validate=False`` skips the rule check (a search's candidates passed it)."""
    options = options or MemoryOptions()
    strategies = list(strategies)
    if validate:
        for strategy in strategies:
            validate_strategy(strategy, model, cluster.num_devices)
    n = len(strategies)
    slack = 1.0 + {**DEFAULTS, **options.profile.overhead}["allocator_slack"] * options.include_overhead
    # Option-major rows: strategy j under OPTIONS[i] is row i·n + j.
    variants = StrategyBatch.of([s.with_recompute(o, modules=selective_modules) for o in OPTIONS for s in strategies])
    seconds = piece_seconds(model, variants, cluster, **options.time_keywords())
    acts = layer_activations(model, variants, options)
    head = variants.take(slice(0, n))  # static bytes do not depend on recompute
    elements = layer_elements(model, head.tp.astype(float), head.ep.astype(float), head.etp.astype(float))
    shards = sharding_factors(head.dp, head.cp, head.tp, head.ep, head.etp, head.zero, head.shard_group)
    # The estimator's stages under uniform placement with no and with full recompute, one batch.
    # Then, for the recompute options, every layer and the first layer of each chunk recomputing:
    # the two points each option's per-layer term and the stage's transient are fitted to.
    calibrated = (("none", 0), ("full", 0), ("selective", 0), ("full", 1), ("selective", 1))
    uniform = stage_memory(model, StrategyBatch.of([s.with_recompute(o, k, selective_modules)
                                                    for o, k in calibrated for s in strategies]), options)
    # The device's two peaks apart, so that each moves with its own layer terms: the forward/
    # backward one and the optimizer step's (device = the larger, each with the allocator's
    # slack and the runtime's fixed overhead).
    overhead_bytes = uniform.device - uniform.reserved
    forward_backward_device = uniform.forward_backward * slack + overhead_bytes
    step_device = (uniform.params + uniform.grads + uniform.optimizer + uniform.optimizer_step) * slack + overhead_bytes
    p = strategies[0].precision
    # (of the share of the parameters offloaded, the optimizer_offload_fraction: none on the device)
    on_device = optimizer_on_device(head.optimizer_offload, head.optimizer_offload_fraction)
    optimizer = on_device * p.optimizer_bytes
    # The states and master weights an offload between steps keeps on the host through the
    # forward and backward: on the device at the step alone (``static_state``).
    optimizer_fb = np.where(head.offload_optimizer_states > 0, 0.0, optimizer)
    # Bytes per element of a non-expert and of an expert weight (parameters, gradients, states,
    # and the buckets a DDP reducer keeps beside the gradients), as the forward and backward hold them.
    buckets = ddp_bucket_width(options.profile, p.grad_bytes, head.zero, head.dp, head.cp)
    # (FSDP2's CPU offload keeps the parameter and gradient shards on the host too: ``static_state``)
    on_host = (head.optimizer_offload > 0) & (head.zero == 3) & bool(options.profile.kernels.get("fsdp_cpu_offload"))
    param_width, grad_width = np.where(on_host, 0.0, p.param_bytes), np.where(on_host, 0.0, p.grad_bytes)
    per_element = param_width / shards.params + grad_width / shards.grads + optimizer_fb / shards.optimizer + buckets
    # (the experts AutoModel leaves out of FSDP keep their gradients in the parameters' dtype: ``static_state``)
    experts_outside = experts_out_of_fsdp(options.experts_outside_fsdp, head.zero, shards.expert_data_shards)
    expert_grad_width = np.where(experts_outside & ~on_host, p.param_bytes, grad_width)
    per_expert_element = (param_width / shards.expert_params + expert_grad_width / shards.expert_grads
                          + optimizer_fb / shards.expert_optimizer + buckets)
    # Under fp8 GEMMs, the quantised copies of the layer's linear weights the runtime keeps.
    cache_width = fp8_weight_cache_width(options.profile, p, head.zero)
    linear = linear_weight_elements(model, head.tp.astype(float), head.ep.astype(float), head.etp.astype(float))
    static_of = {kind: elements.non_expert[kind] * per_element + elements.expert[kind] * per_expert_element
                 + sum(linear[kind].values()) * cache_width for kind in ("dense", "moe")}
    # The update's temporaries per element the rank's optimizer holds (``stages.stage_memory``).
    temp_bytes = np.where(p.optimizer_bytes == 0, 0.0,
                          on_device * options.profile.optimizer_temp_copies * (p.master_weight_bytes or p.param_bytes))
    # (and the states back from the host for the step)
    temp_bytes = temp_bytes + (optimizer - optimizer_fb)
    step_of = {kind: static_of[kind] + temp_bytes * (elements.non_expert[kind] / shards.optimizer
                                                     + elements.expert[kind] / shards.expert_optimizer)
               for kind in ("dense", "moe")}
    problems = []
    for j, strategy in enumerate(strategies):
        tokens = strategy.micro_batch_size * strategy.seq_length / strategy.cp
        costs: dict[tuple[str, str], LayerCost] = {}
        for kind in ("dense", "moe"):
            static = float(static_of[kind][j])
            for i, option in enumerate(OPTIONS):
                row = i * n + j
                activation = acts.full[kind][row] if option == "none" else acts.recomputed[kind][row]
                rebuild_s = 0.0 if option == "none" else float(seconds[f"rc_{kind}"][row])
                costs[(kind, option)] = LayerCost(
                    time_s=float(seconds[kind][row]) + rebuild_s,
                    activation_bytes=float(activation) * tokens * slack,
                    static_bytes=static * slack,
                )
        # What moves with neither layers nor recompute choices (buffers, transients, overhead): the
        # estimator's forward/backward peaks minus the layer terms, for uniform placement with no
        # and with full recompute (recompute adds a rebuild transient); the larger of the two is
        # kept. The optimizer step's likewise, from its own peak (the same under either).
        # The placement the estimator priced above (uniform, with the embedding or head counted
        # as a layer where the strategy says so; ``stage_memory`` got no stage_layers): its layer
        # terms come off its totals.
        placement = place_layers(model, strategy.pp, strategy.vpp, strategy.schedule,
                                 embedding_as_layer=strategy.embedding_as_layer,
                                 output_as_layer=strategy.output_as_layer)
        flight = in_flight(strategy.schedule, strategy.pp, strategy.vpp, strategy.num_micro_batches, strategy.seq_chunks)
        # Per (kind, option), the bytes per micro-batch a layer keeps from B until W, as the
        # estimator prices them (``stages._evaluate_group``): on the pipeline's first virtual
        # stage where the runtime runs its whole backward at W, everything it held until B.
        until_w, until_w_first = held_until_w(acts, options.profile, strategy.schedule, costs, n, j, tokens, slack)
        per_b = np.zeros((strategy.pp, strategy.vpp))
        per_w = np.zeros((strategy.pp, strategy.vpp))
        main = max(set(model.layer_mlp_kinds), key=model.layer_mlp_kinds.count)
        for v in range(placement.num_virtual_stages):
            stage, chunk = int(placement.stage_of[v]), int(placement.chunk_of[v])
            count = int(placement.dense_layers[v] + placement.moe_layers[v])
            per_b[stage, chunk] = count * costs[(main, "none")].activation_bytes
            per_w[stage, chunk] = count * (until_w_first if v == 0 else until_w)[(main, "none")]
        weights, weights_w = chunk_weights(flight, per_b, per_w)
        # Per stage, the W-held bytes of a layer under each option: its chunks' weights, by the
        # uniform placement's layers.
        layers_of = np.zeros((strategy.pp, strategy.vpp))
        layers_of[placement.stage_of, placement.chunk_of] = placement.dense_layers + placement.moe_layers
        share = layers_of / np.maximum(layers_of.sum(axis=1, keepdims=True), 1)
        first_share = np.zeros((strategy.pp, strategy.vpp))
        first_share[placement.stage_of[0], placement.chunk_of[0]] = share[placement.stage_of[0], placement.chunk_of[0]]
        held_w = {key: ((share - first_share) * weights_w).sum(axis=1) * until_w[key]
                  + (first_share * weights_w).sum(axis=1) * until_w_first[key]
                  for key in costs} if np.any(weights_w) else None
        emb_static = float(model.vocab_size * model.hidden_size / strategy.tp) * float(per_element[j]) * slack
        out_activation = float(acts.output[j] + model.mtp_depth * acts.mtp_extra[j]) * tokens * slack
        head_static = 0.0 if model.tie_word_embeddings and strategy.pp == 1 else emb_static
        first_extra = LayerCost(float(seconds["emb"][j]), (8.0 + float(acts.embedding[j])) * tokens * slack, emb_static)
        last_extra = LayerCost(float(seconds["head"][j]), out_activation, head_static)
        fixed_of = {}
        step_layer = {kind: float(step_of[kind][j]) * slack for kind in ("dense", "moe")}
        step_moving = np.zeros(strategy.pp)
        for v in range(placement.num_virtual_stages):
            stage = int(placement.stage_of[v])
            step_moving[stage] += (placement.dense_layers[v] * step_layer["dense"]
                                   + placement.moe_layers[v] * step_layer["moe"])
        step_fixed = step_device[j, : strategy.pp] - step_moving
        recomputed_of = {}  # (option, layers per chunk) -> [pp] layers the stage recomputes
        for u, (option, limit) in enumerate(calibrated):
            device = forward_backward_device[u * n + j, : strategy.pp]
            moving = np.zeros(strategy.pp)
            recomputed = np.zeros(strategy.pp)
            for v in range(placement.num_virtual_stages):
                stage, chunk = int(placement.stage_of[v]), int(placement.chunk_of[v])
                # A limit recomputes a chunk's first layers, dense ones first (``shape.recomputed_layers``).
                dense, moe = int(placement.dense_layers[v]), int(placement.moe_layers[v])
                on = dense + moe if option == "none" or limit == 0 else min(limit, dense + moe)
                dense_on = min(on, dense)
                for kind, plain, again in (("dense", dense - dense_on, dense_on), ("moe", moe - (on - dense_on), on - dense_on)):
                    for count, held_as in ((plain, "none"), (again, option)):
                        cost = costs[(kind, held_as)]
                        held_after_b = 0.0 if held_w is None else float(held_w[kind, held_as][stage])
                        moving[stage] += float(count) * (cost.static_bytes + weights[stage, chunk] * cost.activation_bytes
                                                         + held_after_b)
                recomputed[stage] += 0 if option == "none" else on
            for v, end in ((0, first_extra), (placement.num_virtual_stages - 1, last_extra)):
                stage, chunk = int(placement.stage_of[v]), int(placement.chunk_of[v])
                moving[stage] += end.static_bytes + weights[stage, chunk] * end.activation_bytes
            fixed_of[option, limit] = device - moving
            recomputed_of[option, limit] = recomputed
        fixed = fixed_of["none", 0]
        runnable = runnable_options(strategy, options, selective_modules)
        # The weight-gradient step's rebuilt copies, per fully recomputed layer of a chunk: the
        # stage holds its largest chunk's beyond an offset (``chunk_copy_terms``), and what that
        # term is with every layer recomputing comes off the extra fitted below.
        copies = chunk_copy_bytes(model, acts, options.profile, strategy.schedule, placement, strategy.pp, n, j,
                                  tokens, slack) if strategy.vpp > 1 and "full" in runnable else None
        # What the estimator's transient grew by under each option, with the first layer of each
        # chunk and with every layer recomputing (``backward.layer_working_set``: the rebuilt
        # layer's working set, once per stage, and under PyTorch's split backward the weight-
        # gradient step's rebuilt copies, which grow with the layers).
        grew = {(option, limit): (uniform.transient[calibrated.index((option, limit)) * n + j, : strategy.pp]
                                  - uniform.transient[j, : strategy.pp]) * slack
                for option in ("selective", "full") for limit in (0, 1)}
        copy_offset = None
        if copies is not None:
            every = _largest_chunk_copies(copies, placement, strategy.pp, strategy.vpp)
            copy_offset, at_every = chunk_copy_terms(every, grew["full", 1], grew["full", 0])
            fixed_of["full", 0] = fixed_of["full", 0] - at_every
            grew["full", 0] = grew["full", 0] - at_every
        transient, per_layer, option_bytes = recompute_terms(
            {option: (fixed_of[option, 1] - fixed, recomputed_of[option, 1], fixed_of[option, 0] - fixed,
                      recomputed_of[option, 0], grew[option, 1], grew[option, 0])
             for option in ("selective", "full") if option in runnable},
            strategy.pp)
        problem = BalanceProblem(
            layer_kinds=model.layer_mlp_kinds, options=runnable,
            costs=costs, stage_of=placement.stage_of, chunk_of=placement.chunk_of, peak_in_flight=weights,
            num_micro_batches=strategy.num_micro_batches, first_extra=first_extra, last_extra=last_extra,
            fixed_bytes=fixed, memory_limit_bytes=float(memory_limit_bytes), recompute_transient_bytes=transient,
            recompute_option_bytes=option_bytes, recompute_layer_bytes=per_layer, held_until_w_bytes=held_w,
            recompute_chunk_bytes=None if copies is None else {(kind, "full"): copies[kind] for kind in ("dense", "moe")},
            recompute_chunk_offset=copy_offset,
            step_fixed_bytes=step_fixed, step_layer_bytes=step_layer,
        )
        # A step that can never be the peak (Megatron's) is left out: the solvers skip its masks.
        problems.append(replace(problem, step_fixed_bytes=None, step_layer_bytes=None)
                        if step_never_binds(problem) else problem)
    return problems


def held_until_w(acts: Any, profile: Any, schedule: str, costs: Mapping[tuple[str, str], LayerCost], n: int, j: int,
                 tokens: float, slack: float) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """Per (kind, option), the bytes per micro-batch one layer keeps from its B until its W
    (zero without a split backward), and the same on the pipeline's first virtual stage, as the
    estimator prices them (``stages._evaluate_group``): under torch.distributed.pipelining the
    layer's autograd graph (none where W rebuilds a recomputed layer per parameter group, the
    whole layer's where it keeps the rebuilt one) and the output gradients W consumes; elsewhere
    the linear layers' inputs and output gradients. Where the runtime runs the first stage's
    whole backward at W, what the layer held until B stays until then."""
    zero = {key: 0.0 for key in costs}
    if schedule not in SPLIT_BACKWARD:
        return zero, zero
    out = {}
    for kind, option in costs:
        row = OPTIONS.index(option) * n + j
        if profile.weight_grad_holds == "all":
            if option == "none":
                graph = float(acts.full[kind][row])
            else:
                graph = 0.0 if profile.weight_grad_recomputes_per_group else float(acts.full[kind][row])
            per_token = graph + float(acts.weight_grad_outputs[kind][row])
        else:
            per_token = 2 * float(acts.weight_input[kind][row])
        out[kind, option] = per_token * tokens * slack
    first = ({key: cost.activation_bytes for key, cost in costs.items()} if profile.first_stage_backward_at_w else out)
    return out, first


def chunk_copy_bytes(model: ModelSpec, acts: Any, profile: Any, schedule: str, placement: Any, pp: int, n: int,
                     j: int, tokens: float, slack: float) -> dict[str, np.ndarray] | None:
    """Per layer kind, [pp, v] the bytes a fully recomputed layer in each local chunk adds to
    that chunk's weight-gradient step, as the estimator prices them (``backward.weight_grad_step``):
    where the runtime rebuilds a checkpointed layer once per parameter group in a split W
    (torch.distributed.pipelining), each of the G = ``weight_grad_groups`` rebuilt copies keeps
    what no weight gradient reads, U = ``weight_unread`` per token, while the chunk's later layers
    keep its graph alive: tokens·G·U a layer, the step's peak at the chunk's last layer, so a
    stage holds its largest chunk's. Zeros on the pipeline's first virtual stage where the
    runtime runs its W as one whole backward (``first_stage_backward_at_w``). None where nothing
    is rebuilt per group (no split backward, or a runtime that keeps B's graph)."""
    if schedule not in SPLIT_BACKWARD or not profile.weight_grad_recomputes_per_group:
        return None
    groups = weight_grad_groups(model)
    row = OPTIONS.index("full") * n + j
    eligible = np.ones((pp, placement.num_virtual_stages // pp))
    if profile.first_stage_backward_at_w:
        eligible[int(placement.stage_of[0]), int(placement.chunk_of[0])] = 0.0
    return {kind: max(tokens * groups[kind] * float(acts.weight_unread[kind][row]) * slack, 0.0) * eligible
            for kind in ("dense", "moe")}


def _largest_chunk_copies(copies: Mapping[str, np.ndarray], placement: Any, pp: int, vpp: int) -> np.ndarray:
    """[pp] each stage's largest chunk sum of ``chunk_copy_bytes`` on the uniform placement with
    full recompute on every layer."""
    held = np.zeros((pp, vpp))
    held[placement.stage_of, placement.chunk_of] = (placement.dense_layers * copies["dense"][placement.stage_of, placement.chunk_of]
                                                    + placement.moe_layers * copies["moe"][placement.stage_of, placement.chunk_of])
    return held.max(axis=1)


def chunk_copy_terms(every: np.ndarray, grew_one: np.ndarray, grew_every: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """[pp] the offset below which a stage's largest chunk sum of copies (``chunk_copy_bytes``)
    raises nothing, and [pp] the term max(0, largest − offset) with every layer recomputing, from
    the largest sum there (``every``) and what the estimator's transient grew by with the first
    layer of each chunk and with every layer recomputing (``grew_one``, ``grew_every``).

    The estimator's peak with a chunk's weight-gradient step is the max over the schedule's
    instants of what is held then plus the step: the copies raise the peak by what they exceed
    the gap between the step's instant and the peak without it, nothing while they are smaller.
    Llama-3.1-8B ZB-V, the head's chunk on stage 0: nothing up to 2 layers, then 2.4 GiB a
    layer; Llama-3.1-70B DualPipeV, stage 1: 0.29 GiB (the rebuilt working set) with a layer a
    chunk, 1.11 GiB per layer of the longer chunk from 4 layers on (16 layers a chunk: 18.95 GiB).
    So the every-layer point lies on the rising part (the copies' 1:1 line through it), and what
    the one-layer point grew by is the constant (the transient, ``recompute_terms``): offset =
    grew_one + every − grew_every (≥ 0). Exact at both points where the one-layer point lies
    where the copies raise nothing, else over it by what they raise there (conservative)."""
    offset = np.maximum(grew_one + every - grew_every, 0.0)
    return offset, np.maximum(every - offset, 0.0)


def chunk_weights(flight: InFlight, per_b: np.ndarray, per_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[pp, v] the micro-batches each chunk's activations count for in its stage's peak: those
    held until their backward (B), and those held from B until the weight gradient (W).

    The estimator's held peak is the max over time t of Σ_c held[t, c]·bytes[c] (the schedule's
    in-flight table, ``InFlight.stages``); the solvers need one weight per chunk. Weighing each
    chunk by its own peak (``InFlight.peak``) counted a layer moved off a stage at every chunk's
    peak at once, more than the stage ever holds (interleaved pp4 vpp2, stage 1: 8 + 4
    micro-batches against 9 at once), so a stage left with fewer layers read low. Here, per
    stage, an order π of its chunks and g(r) = max_t Σ_{first r chunks of π} held[t, c]; chunk
    π_r weighs g(r) − g(r − 1) (``_prefix_weights``). Bytes that fall along π, as the solvers
    deal layers and options (the chunks of least weight first, options holding most bytes
    first), are a sum of prefix indicators with non-negative coefficients, so the weighed sum
    is at or over the max over time, and equal to it where the chunks hold the same bytes.

    Where the stage's peak holds bytes until W as well (a split backward), the two counts per
    chunk are the mean of the rows holding the most bytes with ``per_b``/``per_w`` [pp, v], a
    uniform placement's bytes per micro-batch of each chunk held until B and until W: exact for
    one chunk a stage whatever its layers (a layer adds its bytes at those rows), and off it by
    how the chunks' bytes part from the uniform placement's."""
    weights_b = _schedule_prefix_weights(flight.schedule, flight.pp, flight.vpp, flight.num_micro_batches,
                                         flight.seq_chunks).copy()
    weights_w = np.zeros((flight.pp, flight.vpp))
    if not np.any(per_w):
        return weights_b, weights_w
    for s, series in enumerate(flight.stages):
        held = series.held_until_b @ per_b[s] + series.held_until_w @ per_w[s]
        top = held >= held.max() * (1 - 1e-12)
        if np.any(series.held_until_w[top] * per_w[s]):
            weights_b[s] = series.held_until_b[top].mean(axis=0)
            weights_w[s] = series.held_until_w[top].mean(axis=0)
    return weights_b, weights_w


@lru_cache(maxsize=1024)
def _schedule_prefix_weights(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> np.ndarray:
    """[pp, v] ``_prefix_weights`` of each stage's held-until-B rows (read-only; cached: a search
    builds many problems on one schedule)."""
    flight = in_flight(schedule, pp, vpp, m, seq_chunks)
    out = np.array([_prefix_weights(np.unique(series.held_until_b, axis=0)) for series in flight.stages])
    out.flags.writeable = False
    return out


#: Up to this many chunks a stage's order is chosen among every permutation; beyond, greedily.
_EVERY_ORDER = 6
#: What a chunk's weight grows by per place in its order (micro-batches), so that the solvers'
#: stable argsort of the weights meets the order where two weigh the same.
_ORDER_STEP = 1e-9


def _prefix_weights(held: np.ndarray) -> np.ndarray:
    """[v] chunk weights from a stage's in-flight rows ``held`` [t, v] (``chunk_weights``): the
    order π whose increments g(r) − g(r − 1) do not fall along it (so that ordering the weights
    gives π back), the first such in the order of the chunks' own peaks (every order up to
    ``_EVERY_ORDER`` chunks, else the greedy one); each weight plus ``_ORDER_STEP`` per place."""
    from itertools import permutations

    v = held.shape[1]
    if v == 1:
        return held.max(axis=0)

    def increments(order: tuple[int, ...]) -> np.ndarray:
        prefix = np.cumsum(held[:, list(order)], axis=1).max(axis=0)
        return np.diff(prefix, prepend=0.0)

    peaks = held.max(axis=0)
    if v <= _EVERY_ORDER:
        candidates = sorted(permutations(range(v)), key=lambda order: tuple(peaks[list(order)]))
    else:  # greedy: each next the chunk adding least to the prefix's peak
        greedy: list[int] = []
        for _ in range(v):
            rest = [c for c in range(v) if c not in greedy]
            greedy.append(min(rest, key=lambda c: (np.cumsum(held[:, [*greedy, c]], axis=1).max(axis=0)[-1],
                                                   peaks[c], c)))
        candidates = [tuple(greedy)]
    for order in candidates:
        steps = increments(order)
        if (np.diff(steps) >= 0).all():
            out = np.empty(v)
            out[list(order)] = steps + _ORDER_STEP * np.arange(v)
            return out
    return peaks  # no order with rising increments: each chunk's own peak, as before


def recompute_terms(points: Mapping[str, tuple[np.ndarray, ...]], pp: int
                    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per stage [pp], the recompute transient the options share, each option's own bytes once
    where it runs, and each option's bytes per recomputed layer, from what the estimator holds
    beyond the layer terms and the no-recompute fixed bytes (``points``: option -> (extra, layers
    recomputed) with the first layer of each chunk recomputing and with every layer, then what
    its transient grew by at those two points).

    The extra is the transient's growth T plus the rest A (the activations' peak moving). T is a
    constant (the rebuilt layer's working set, held once) plus, under a split backward that
    rebuilds per parameter group, the weight-gradient step's copies per layer (with several
    chunks a stage the caller takes those off first: ``chunk_copy_terms``): the line through
    its two points, its intercept clipped to 0 … T at every layer. A is nothing with one layer
    per chunk and grows with the recomputed layers (DualPipeV): per layer, through the every-layer
    point; where it reads under the one-per-chunk point, the shortfall joins the constant. So
    every option is exact where all layers recompute and at or over the estimator where one per
    chunk does. A line through the two points of the whole extra put the rebuilt layer per layer
    (Mixtral DualPipeV stage 1, full: 0.432 GiB per layer and no constant, against T = 0.501 at
    both points and A = 2.953 at 8 layers, so 0.501 + 0.369 per layer: a stage left with 2 layers
    read 0.375 GiB low). The constants of the options present on a stage combine as their max
    (the estimator's working set is one layer's, the largest rebuilt): the smallest is the shared
    transient, each option's excess over it its own. Between the two points the estimator's extra
    is a max over the schedule's timeline, not a line: see docs/balance.md for how far it lies
    from it."""
    constants: dict[str, np.ndarray] = {}
    per_layer: dict[str, np.ndarray] = {}
    for option, (one, n_one, every, n_every, grew_one, grew_every) in points.items():
        span = n_every - n_one
        slope = np.divide(grew_every - grew_one, span, out=np.zeros_like(every), where=span > 0)
        intercept = np.where(span > 0, grew_one - n_one * slope, grew_every)
        constant = np.clip(intercept, 0.0, np.maximum(grew_every, 0.0))
        rest_slope = np.divide(every - grew_every, n_every, out=np.zeros_like(every), where=n_every > 0)
        # The one-per-chunk point: at or over it (the transient's line clipped lies over it).
        short = (one - grew_one) - n_one * rest_slope
        constant = constant + np.maximum(short, 0.0)
        constants[option] = constant
        per_layer[option] = np.divide(every - constant, n_every, out=np.zeros_like(every), where=n_every > 0)
    transient = np.min(list(constants.values()), axis=0) if constants else np.zeros(pp)
    return transient, per_layer, {option: constant - transient for option, constant in constants.items()}


@dataclass(frozen=True)
class BalanceResult:
    problem: BalanceProblem
    baseline: tuple[Plan, PlanCost]  # uniform placement, ``baseline_option`` (full recompute) on every layer
    plan: Plan
    cost: PlanCost
    solver: str  # "dp" or "milp" (exact), or "heuristic"
    solve_seconds: float
    simulated_s: tuple[float, float]  # (baseline, plan) steps by the pipeline simulator, a check of the composed ones
    #: Per stage, the full estimator's device peak for the settings --emit writes
    #: (``plan_strategy`` of ``emitted_plan``): a check of the balancer's memory model, which
    #: moves layer terms only.
    estimated_stage_bytes: np.ndarray | None = None
    #: The fastest plan one recompute setting expresses (``best_settings_plan``), its cost and
    #: simulated step: what ``--emit`` writes, where it differs from the plan.
    settings: tuple[Plan, PlanCost, float] | None = None
    #: What the plan's "selective" re-runs (None: the strategy's own modules), and the settings'.
    selective_modules: tuple[str, ...] | None = None
    settings_modules: tuple[str, ...] | None = None
    #: With several selective policies tried: per policy ('+'-joined modules, "default" for the
    #: runtime's own), the step of its plan and of its one-setting plan (None where none fits).
    policy_steps: dict[str, tuple[float | None, float | None]] | None = None
    #: Where the balancer's one-setting plan ran over the limit by the full estimator and a setting
    #: saving more on the same placement fits (``step_up_settings``; ``settings`` is then that
    #: one): the balancer's plan and the full estimator's peak of it (bytes).
    stepped_from: tuple[Plan, float] | None = None

    @property
    def emitted_plan(self) -> Plan:
        """The plan frameworks that take one recompute setting can run (``--emit`` writes it)."""
        return self.plan if self.settings is None else self.settings[0]

    @property
    def emitted_modules(self) -> tuple[str, ...] | None:
        """What the emitted plan's selective recompute re-runs (None: the strategy's own)."""
        return self.selective_modules if self.settings is None else self.settings_modules

    @property
    def gain(self) -> float:
        """Relative step-time gain over the baseline (0.1 = 10 % faster)."""
        return 1.0 - self.cost.step_s / self.baseline[1].step_s

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data: the plan, its per-stage figures and the baseline's (what --json prints)."""
        base_plan, base_cost = self.baseline
        return {
            "solver": self.solver,
            "solve_seconds": self.solve_seconds,
            "stage_layers": list(self.plan.stage_layers),
            "recompute_ranges": [{"first": a, "count": n, "option": o} for a, n, o in self.plan.ranges()],
            "before": {"stage_layers": list(base_plan.stage_layers), "recompute": base_plan.recompute[0],
                       "stage_memory_bytes": base_cost.stage_memory_bytes.round().tolist(),
                       "stage_time_s": base_cost.stage_time_s.tolist(), "step_s": base_cost.step_s, "fits": base_cost.fits},
            "after": {"stage_memory_bytes": self.cost.stage_memory_bytes.round().tolist(),
                      "stage_time_s": self.cost.stage_time_s.tolist(), "step_s": self.cost.step_s, "fits": self.cost.fits},
            "gain": self.gain,
            "simulated": {"before_step_s": self.simulated_s[0], "after_step_s": self.simulated_s[1],
                          "gain": 1.0 - self.simulated_s[1] / self.simulated_s[0]},
            "estimated_stage_bytes": None if self.estimated_stage_bytes is None
            else self.estimated_stage_bytes.round().tolist(),
            "selective_modules": None if self.selective_modules is None else list(self.selective_modules),
            "policy_steps": None if self.policy_steps is None else {
                policy: {"step_s": plan_step, "as_settings_step_s": settings_step}
                for policy, (plan_step, settings_step) in self.policy_steps.items()},
            "as_settings": None if self.settings is None else {
                "selective_modules": None if self.settings_modules is None else list(self.settings_modules),
                "stage_layers": list(self.settings[0].stage_layers),  # may differ from the plan's
                "recompute_ranges": [{"first": a, "count": n, "option": o} for a, n, o in self.settings[0].ranges()],
                "stage_memory_bytes": self.settings[1].stage_memory_bytes.round().tolist(),
                "step_s": self.settings[1].step_s, "fits": self.settings[1].fits,
                "gain": 1.0 - self.settings[1].step_s / base_cost.step_s,
                "simulated_step_s": self.settings[2],
            },
            "stepped_up": None if self.stepped_from is None else {
                "stage_layers": list(self.stepped_from[0].stage_layers),
                "recompute_ranges": [{"first": a, "count": n, "option": o} for a, n, o in self.stepped_from[0].ranges()],
                "estimated_peak_bytes": round(self.stepped_from[1]),
            },
        }


def _recompute_counts(plan: Plan) -> str:
    """A plan's recompute in words: "full recompute on every layer", or "recompute full on 20
    layers, selective on 5, none on 7"."""
    counts = {option: plan.recompute.count(option) for option in dict.fromkeys(plan.recompute)}
    if len(counts) == 1:
        return f"{plan.recompute[0]} recompute on every layer"
    return "recompute " + ", ".join(f"{option} on {n} layer{'s' if n > 1 else ''}" for option, n in counts.items())


def balance(
    model: ModelSpec | str,
    strategy: Strategy,
    cluster: Cluster | Device | str,
    memory_limit_bytes: float | str,
    options: MemoryOptions | None = None,
    *,
    exact: bool = True,
    selective_policies: tuple[tuple[str, ...], ...] = (),
    expressible: Callable[[Strategy], bool] | None = None,
) -> BalanceResult:
    """Layers per virtual stage and recompute per layer that minimise the composed step time
    with every stage under ``memory_limit_bytes``; compared with uniform placement and full
    recompute.

    ``selective_policies``: module sets (Megatron-Core's --recompute-modules) the selective
    option may re-run besides the strategy's own. Each is balanced as its own problem (none,
    that selective policy, full per layer) and the fastest plan wins, and apart the fastest
    one-setting plan: a framework runs one module set for every layer, and a problem with every
    policy as an option per layer multiplies the solvers' work (a minute per plan with seven).

    ``expressible``: whether a target format can write a one-setting strategy (``ndplan balance
    --emit`` passes a round trip through the format); the one-setting plan is chosen among those.

    As the other entry points: ``model`` may be a preset name or path, ``cluster`` a Device or
    device name (then the strategy's world size), ``memory_limit_bytes`` a size ("30GiB")."""
    from ndplan.hardware import as_device
    from ndplan.memory.report import check_kv_heads, check_moe_imbalance, check_options
    from ndplan.model import as_model
    from ndplan.units import memory_limit

    model = as_model(model)
    if not isinstance(strategy, Strategy):
        raise NdplanError(f"balance needs a Strategy, got {type(strategy).__name__}")
    if not isinstance(cluster, Cluster):
        cluster = Cluster(device=as_device(cluster, "cluster"), num_devices=strategy.world_size)
    memory_limit_bytes = memory_limit(memory_limit_bytes, "memory_limit_bytes")
    check_options(options)
    check_moe_imbalance(model, strategy, options or MemoryOptions())
    check_kv_heads(model, strategy, options or MemoryOptions())
    if strategy.offload_layers:
        raise NdplanError(f"offload_layers={strategy.offload_layers}: the balancer plans layers per stage and recompute, "
                          "and Megatron-Core's layer offload runs with neither a pipeline nor recompute: price it "
                          "with `ndplan estimate`, or search offload counts with `ndplan search --dims ... offload_layers`")
    own = strategy.recompute_modules
    policies: list[tuple[str, ...] | None] = [None, *dict.fromkeys(
        p for p in (Strategy(recompute="selective", recompute_modules=p).recompute_modules for p in selective_policies)
        if p != own)]
    best: dict[str, Any] | None = None
    best_settings: dict[str, Any] | None = None
    policy_steps: dict[str, tuple[float | None, float | None]] = {}
    solve_seconds = 0.0
    own_problem: BalanceProblem | None = None
    for modules in policies:
        problem = build_problem(model, strategy, cluster, memory_limit_bytes, options, modules)
        own_problem = own_problem or problem
        baseline_plan = uniform_plan(problem, baseline_option(problem))
        started = clock.perf_counter()
        found = solve_exact(problem) if exact else solve_heuristic(problem)
        solve_seconds += clock.perf_counter() - started
        label = "+".join(own if modules is None else modules) or "default"
        if found is None:
            policy_steps[label] = (None, None)
            continue
        as_settings = best_settings_plan(problem, found[0], baseline_plan,
                                         plans_expressible(expressible, strategy, modules))
        policy_steps[label] = (found[1].step_s, as_settings[1].step_s if as_settings[1].fits else None)
        entry = {"problem": problem, "found": found, "as_settings": as_settings, "modules": modules}
        if best is None or found[1].step_s < best["found"][1].step_s:
            best = entry
        if as_settings[1].fits and (best_settings is None or as_settings[1].step_s < best_settings["as_settings"][1].step_s):
            best_settings = entry
    if best is None:
        assert own_problem is not None  # the strategy's own policy comes first
        option = baseline_option(own_problem)
        needs = evaluate(own_problem, uniform_plan(own_problem, option)).stage_memory_bytes.max()
        least = least_peak_plan(own_problem)
        least_text = "" if least is None else (
            f"the least a plan needs is {format_bytes(least[1].stage_memory_bytes.max())} (layers per virtual stage "
            f"{list(least[0].stage_layers)}, {_recompute_counts(least[0])}, by the balancer's figures); ")
        raise NdplanError(
            f"no placement and recompute plan fits {format_bytes(memory_limit_bytes)} per device for "
            f"{strategy.short()}; {least_text}uniform {option} recompute needs {format_bytes(needs)}"
        )
    problem, found = best["problem"], best["found"]
    baseline_plan = uniform_plan(problem, baseline_option(problem))
    baseline = (baseline_plan, evaluate(problem, baseline_plan))
    simulated = (simulated_step_s(problem, baseline_plan, strategy.schedule),
                 simulated_step_s(problem, found[0], strategy.schedule))
    chosen = best_settings or best
    as_settings = chosen["as_settings"]
    settings = None if as_settings[0] == found[0] and chosen is best else (
        *as_settings, simulated_step_s(chosen["problem"], as_settings[0], strategy.schedule))
    # The full estimator checks what a framework will run: the settings --emit writes.
    written, written_modules = (found[0], best["modules"]) if settings is None else (settings[0], chosen["modules"])
    estimated = plan_stage_bytes(model, strategy, written, options, written_modules)
    stepped_from = None
    if float(estimated.max()) > memory_limit_bytes:
        # The balancer's memory model missed near the limit: a setting saving more, if one fits.
        written_problem = problem if settings is None else chosen["problem"]
        stepped = step_up_settings(model, strategy, written_problem, written, memory_limit_bytes, options,
                                   written_modules, plans_expressible(expressible, strategy, written_modules))
        if stepped is not None:
            stepped_from = (written, float(estimated.max()))
            written, estimated = stepped
            settings = (written, evaluate(written_problem, written),
                        simulated_step_s(written_problem, written, strategy.schedule))
    return BalanceResult(problem, baseline, found[0], found[1], exact_method(problem) if exact else "heuristic",
                         solve_seconds, simulated, estimated, settings, best["modules"], chosen["modules"],
                         policy_steps if len(policies) > 1 else None, stepped_from)


def stepped_settings(plan: Plan, runnable: Sequence[str] = OPTIONS) -> list[Plan]:
    """The one-setting plans on ``plan``'s placement that save more memory than its own setting
    (``_one_setting``), nearest first, each saving at least as much as the one before on every
    stage: full on the first k layers of each virtual stage steps to k + 1, ... then to every
    layer; selective on every layer to full on every layer; no recompute to selective (where
    ``runnable``) and then full. Full on the first k layers is not among the steps from no or
    selective recompute: it need not save more than selective on every layer."""
    option, k = _one_setting(plan)
    widest = max(plan.stage_layers)
    if option == "full":
        steps = [("full", n) for n in range(k + 1, widest)] + [("full", 0)] if k else []
    elif option == "selective":
        steps = [("full", 0)]
    else:
        steps = [("selective", 0), ("full", 0)]
    return [_leading_layers_plan(plan.stage_layers, o, n) for o, n in steps if o in runnable]


def step_up_settings(model: ModelSpec, strategy: Strategy, problem: BalanceProblem, plan: Plan,
                     memory_limit_bytes: float, options: MemoryOptions | None = None,
                     selective_modules: tuple[str, ...] | None = None,
                     expressible: Callable[[Plan], bool] | None = None) -> tuple[Plan, np.ndarray] | None:
    """Where the one-setting ``plan`` (what --emit writes) runs over ``memory_limit_bytes`` by the
    full estimator (``plan_stage_bytes``; the balancer's memory model approximates it, so near the
    limit its plan can miss): the first of ``stepped_settings`` (options the problem runs and,
    where ``expressible`` is given, the format writes) that fits by the full estimator, with its
    per-stage bytes; None where none does. A full-estimator call per step tried."""
    for candidate in stepped_settings(plan, problem.options):
        if expressible is not None and not expressible(candidate):
            continue
        estimated = plan_stage_bytes(model, strategy, candidate, options, selective_modules)
        if float(estimated.max()) <= memory_limit_bytes:
            return candidate, estimated
    return None


def settings_label(strategy: Strategy) -> str:
    """A one-setting strategy's recompute as ``Strategy.short`` writes it ('rc-full:16'; 'rc-none')."""
    return next((part for part in strategy.short().split() if part.startswith("rc-")), "rc-none")


def plans_expressible(expressible: Callable[[Strategy], bool] | None, strategy: Strategy,
                      modules: tuple[str, ...] | None) -> Callable[[Plan], bool] | None:
    """``expressible`` asked of a plan's one-setting strategy (``plan_strategy``)."""
    if expressible is None:
        return None
    check = expressible

    def plan_expressible(plan: Plan) -> bool:
        return check(plan_strategy(strategy, plan, modules))
    return plan_expressible


def plan_stage_bytes(model: ModelSpec, strategy: Strategy, plan: Plan, options: MemoryOptions | None = None,
                     selective_modules: tuple[str, ...] | None = None) -> np.ndarray:
    """Per stage, the full estimator's device peak (bytes) for ``plan`` as a framework runs it
    (``plan_strategy``: one recompute setting, the uneven placement; selective re-running
    ``selective_modules``, default the strategy's own): a check of the balancer's memory model,
    which moves layer terms only."""
    settings = plan_strategy(strategy, plan, selective_modules)
    return stage_memory(model, StrategyBatch.of(settings), options,
                        stage_layers=tuple(plan.stage_layers)).device[0, : strategy.pp]


def _one_setting(plan: Plan) -> tuple[str, int]:
    """(option, layers per virtual stage; 0 for all) of the plan as one recompute setting: the
    strongest option the plan uses, on as many leading layers of each virtual stage as the plan's
    busiest one recomputes (never less memory-saving than the plan)."""
    options = set(plan.recompute)
    option = "full" if "full" in options else "selective" if "selective" in options else "none"
    if option == "none":
        return option, 0
    most, layer = 0, 0
    for count in plan.stage_layers:
        most = max(most, sum(1 for r in plan.recompute[layer:layer + count] if r != "none"))
        layer += count
    return option, 0 if most >= max(plan.stage_layers) else most


def plan_strategy(strategy: Strategy, plan: Plan, selective_modules: tuple[str, ...] | None = None) -> Strategy:
    """The plan in a Strategy's terms, for frameworks that take one recompute setting (Megatron's
    --recompute-granularity with --recompute-num-layers, torchtitan's activation checkpointing):
    the uneven placement and ``_one_setting``'s recompute (selective: ``selective_modules``,
    default the strategy's own)."""
    option, layers = _one_setting(plan)
    return strategy.with_recompute(option, layers, selective_modules).model_copy(update={"stage_layers": plan.stage_layers})


def best_settings_plan(problem: BalanceProblem, plan: Plan, uniform: Plan,
                       expressible: Callable[[Plan], bool] | None = None) -> tuple[Plan, PlanCost]:
    """The fastest plan one recompute setting expresses, on the plan's placement or the uniform
    one: no recompute, selective on every layer, or full on the first k layers of each virtual
    stage (Megatron's --recompute-method block; every layer: uniform). Among those that fit (the
    uniform placement under full recompute is the baseline), the quickest, ties to the placement
    and option listed first. A per-layer mix needs a framework that sets recompute layer by layer;
    this is what the others can run. ``expressible``, where given, keeps only the candidates a
    target format can write (torchtitan has no first-k-layers recompute, MindSpeed's DualPipeV no
    uneven placement); the uniform placement's whole-model settings are always kept."""
    best: tuple[Plan, PlanCost] | None = None
    for layers in dict.fromkeys((plan.stage_layers, uniform.stage_layers)):
        widest = max(layers)
        candidates = [("none", 0), ("selective", 0), *(("full", k) for k in range(1, widest)), ("full", 0)]
        for option, k in candidates:
            if option not in problem.options:  # not runnable here (selective under a split backward)
                continue
            candidate = _leading_layers_plan(layers, option, k)
            if expressible is not None and (layers != uniform.stage_layers or k) and not expressible(candidate):
                continue
            cost = evaluate(problem, candidate)
            if cost.fits and (best is None or cost.step_s < best[1].step_s):
                best = (candidate, cost)
    if best is None:  # nothing fits as one setting: report the plan's own collapse
        collapsed = settings_plan(plan)
        return collapsed, evaluate(problem, collapsed)
    return best


def settings_plan(plan: Plan) -> Plan:
    """The plan as ``plan_strategy``'s settings run it (``_one_setting``)."""
    return _leading_layers_plan(plan.stage_layers, *_one_setting(plan))


def _leading_layers_plan(stage_layers: tuple[int, ...], option: str, layers: int) -> Plan:
    """Per virtual stage, its first ``layers`` layers (all where 0) under ``option``, the others
    none: how Megatron's --recompute-num-layers applies one setting."""
    recompute: list[str] = []
    for count in stage_layers:
        recomputed = count if layers == 0 else min(layers, count)
        recompute += [option] * recomputed + ["none"] * (count - recomputed)
    return Plan(stage_layers, tuple(recompute))
