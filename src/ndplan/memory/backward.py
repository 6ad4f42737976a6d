"""The backward's working sets: one layer's (with what recompute rebuilds), an MTP module's, the
attention backward where the scores are materialised, the experts' weight gradient, and the
weight-gradient (W) step of the schedules that split the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ndplan.memory.activations import Combinations, LayerActivations
from ndplan.memory.profile import RuntimeProfile
from ndplan.memory.shape import chunk_column, recomputed_layers
from ndplan.model.params import weight_grad_groups, weight_grad_peak_group
from ndplan.model.spec import ModelSpec
from ndplan.schedule import EVERY_BACKWARD_SPLIT
from ndplan.strategy.batch import StrategyBatch


def layer_working_set(acts: LayerActivations, recompute_on: np.ndarray, moe_here: bool,
                       dense_here: bool) -> tuple[np.ndarray, np.ndarray]:
    """(layer, last layer) [n] bytes per token of an op, on a stage holding MoE (``moe_here``)
    and dense layers: one layer's backward working set, with what recompute rebuilds beside what
    a layer keeps (full − kept of the layer's own kind, the largest over the kinds the stage
    holds); and the backward's last layer's, when nothing else is held: its working set beside
    every gradient, neither its saved nor its rebuilt tensors (the same whatever the recompute: its weight
    gradients are made as they go). Measured on real one-GPU steps (tests/data/measured/cuda):
    Mixtral none -0.68%, the 12-36-layer full-recompute steps +0.13% to +0.50%; counting the
    whole layer read +4.8% and +1.5%, counting what recompute rebuilds (alone) +1.4% to +1.7%
    and priced recompute above none."""
    backward_extra = (np.maximum(acts.backward_extra["moe"], acts.backward_extra["dense"]) if moe_here
                      else acts.backward_extra["dense"])
    rebuilt = np.maximum(acts.rebuilt["moe"] if moe_here else 0.0, acts.rebuilt["dense"] if dense_here else 0.0)
    return backward_extra + np.where(recompute_on, rebuilt, 0.0), backward_extra


def mtp_module_bytes(acts: LayerActivations, kind: str, recompute_on: np.ndarray, full_recompute: np.ndarray,
                limited: np.ndarray) -> np.ndarray:
    """[n] bytes per token of an MTP module (its layer of MLP ``kind``) as the strategy keeps it;
    ``limited``: where full recompute has a limit (the block method, which skips the modules)."""
    layer = np.where(recompute_on & ~limited, acts.recomputed[kind], acts.full[kind])
    return np.where(full_recompute & ~limited, acts.mtp_checkpointed, acts.mtp_extra + layer)


@dataclass(frozen=True)
class ScoresMoments:
    """The attention backward of a layer whose scores are materialised (eager, the SDPA math
    path), on a stage, [n] bytes: ``during`` beside what the stage holds (the working set, net of
    the layer's MLP and second norm, which its backward has freed, and on the last stage of the
    micro-batch's loss activations, freed before any layer's backward); ``grads_made`` the
    gradients that exist by then under a single micro-batch whose gradients the backward creates
    (the head's, on the last stage, and the layer's MLP's); ``at_end`` the first layer's, at the
    backward's end, where nothing else is held (its own saved tensors with the working set), less
    the embedding's gradient on the first stage (``table_grad``), made after it.
    Zeros where no layer on the stage materialises its scores."""

    during: np.ndarray
    grads_made: np.ndarray
    at_end: np.ndarray


def scores_backward_moments(acts: LayerActivations, mlp_grads: dict[str, np.ndarray], tokens: np.ndarray,
                             output_held: np.ndarray, recompute_on: np.ndarray, head_grad_bytes: np.ndarray,
                             kinds: tuple[str, ...], last: bool, table_grad: Any) -> ScoresMoments:
    """``ScoresMoments`` of a stage holding layers of ``kinds`` (``last``: the pipeline's last
    stage); ``mlp_grads``: per layer kind the gradient bytes of its MLP and second norm as the
    stage keeps them (``StaticState``), ``head_grad_bytes`` the head's, ``table_grad`` the
    embedding's made after it."""
    zero = np.zeros_like(tokens)
    during, grads_made, at_end = zero, zero, zero
    for kind in kinds:
        working = acts.attention_backward[kind]
        if not np.any(working > 0):
            continue
        blocks = acts.dense_blocks if kind == "dense" else acts.moe_blocks
        mlp_name = "mlp" if kind == "dense" else "moe"
        freed = blocks[mlp_name] + 0.5 * blocks["norm"]
        rebuilt = np.where(recompute_on, acts.rebuilt[kind], 0.0)
        here = working > 0
        during = np.maximum(during, np.where(here, tokens * (working - freed + rebuilt) - output_held * last, 0.0))
        at_end = np.maximum(at_end, np.where(here, tokens * (working - freed + acts.full[kind]) - table_grad, 0.0))
        grads_made = np.maximum(grads_made, np.where(here, mlp_grads[kind] + head_grad_bytes * last, 0.0))
    return ScoresMoments(during=during, grads_made=grads_made, at_end=at_end)


def expert_weight_grad_working(model: ModelSpec, activation_bytes: int, etp: np.ndarray,
                                rebuilt: np.ndarray, token_share: Any = 1.0) -> np.ndarray:
    """Bytes per token beside the buffers while a MoE layer's fused gate_up weight gradient is
    made: the gradient of the gate_up output, k·2f/etp, and what recompute rebuilt of the experts,
    the gate_up output and their input, k·(2f/etp + h), but never more than the layer's
    ``rebuilt`` bytes per token (Megatron's default selective recompute rebuilds the attention
    core alone, not the experts; 0 without recompute). k experts a token, f their width.
    ``token_share``: the rank's share of the routed tokens, etp/tp where each rank routes its own
    tokens (under sequence parallelism, or without TP), gathered over the expert-TP group (the
    profiles' ``expert_tokens`` shard), else 1."""
    per_expert_token = model.num_experts_per_tok * activation_bytes * token_share
    gradient = per_expert_token * 2 * model.moe_ffn_hidden_size / etp
    rebuilt_experts = per_expert_token * (2 * model.moe_ffn_hidden_size / etp + model.hidden_size)
    return gradient + np.minimum(rebuilt_experts, rebuilt)


def pending_split_grad_width(schedule: str, precision: Any, profile: RuntimeProfile,
                              first_virtual: np.ndarray) -> np.ndarray:
    """Bytes per element, per virtual stage, of the new unsharded gradient a chunk keeps beside
    its accumulated one under a deferred FSDP reduce and ZB-V's split backward.

    torch.distributed.pipelining turns FSDP2's gradient sync off until the chunk's REDUCE_GRAD;
    FSDP2's post-backward then only moves the parameter's gradient into its accumulator in the
    reduce dtype (``to_accumulated_grad_if_needed`` / ``accumulate_unsharded_grad_if_needed``).
    Under the split backward that hook runs in the input-gradient step before the micro-batch's
    weight gradients are accumulated, so each chunk holds, besides its fp32 accumulator, the last
    micro-batch's gradient in the parameter dtype until its next backward (traced on ZB-V: a
    decoder layer of llama-3.1-8b holds 4 + 2 bytes an element from its second backward on): from
    each W to the end of the chunk's next B, the frontier's ``grads_pending`` column. Not
    where the two widths are one (the gradient is accumulated in place), nor on the pipeline's
    first stage where torch runs its W as a whole backward (the hook comes after the gradients),
    nor under DualPipeV, whose steady state runs full backwards (F&B overlapped: traced, no new
    gradient waits there; only its warm-up and cool-down split a backward)."""
    pending = float(precision.param_gather_bytes) if precision.grad_bytes != precision.param_gather_bytes else 0.0
    if schedule not in EVERY_BACKWARD_SPLIT or not profile.pipeline_defers_fsdp_reduce or not pending:
        return np.zeros(len(first_virtual))
    whole_w = (first_virtual > 0) if profile.first_stage_backward_at_w else np.zeros(len(first_virtual), dtype=bool)
    return np.where(whole_w, 0.0, pending)


def weight_grad_step(
    model: ModelSpec, batch: StrategyBatch, combinations: Combinations, profile: RuntimeProfile, t: np.ndarray,
    recompute_on: np.ndarray, *, recompute_layers_of: tuple[np.ndarray, np.ndarray], chunks: np.ndarray, vpp: int,
    head_chunk: np.ndarray, first_chunk: np.ndarray,
) -> tuple[np.ndarray, list[np.ndarray | None], list[np.ndarray | None]]:
    """The strategies whose steps are priced (full recompute; elsewhere every figure is 0), and
    at those rows per chunk [rows, P] (None where nothing), what a weight-gradient step adds at
    its peak to the state it starts from (bytes), and of that the new weight gradient D (which a
    chunk's first step keeps as the gradient itself).

    Under full recompute, torch.distributed.pipelining's step rebuilds a checkpointed layer once
    per parameter group (G = ``weight_grad_groups``), each call a new graph task, and each rebuilt
    copy keeps what no weight gradient reads (U = ``weight_unread``) for as long as a later group
    keeps the layer's graph alive. In a chunk the later layers keep the earlier ones alive; the
    peak comes at the last layer's MLP down projection (group g = ``weight_grad_peak_group``;
    the routed experts' in an MoE layer, after which nothing keeps that branch alive), whose
    copies hold besides U only what is still to be read there, by that projection and the norms
    (R = ``weight_read_last``: a read consumed by an earlier group leaves every copy at once);
    beside them the projection's new weight gradient and the previous group's, which the step's
    loop still references (D: up's and down's, or the fused experts' gate_up and down):
        step = t · (Σ_layers G·U + (g − G_last)·U_last − g·A_last + g·R_last) + D      (bytes)
    A (``weight_past``, part of U) is what ops past the layer's weights save (the router's
    probabilities, the experts' weighting by them): once B has run, only the nodes a weight
    gradient still runs through keep a graph alive, and in the chunk's last layer nothing later
    leads through these, so its rebuilt copies have nowhere to keep A (traced: Qwen3-30B-A3B's
    copies hold one topk·h tensor and no router probabilities; DeepSeek-V2-Lite's head chunk's
    hold both topk·h tensors and the probabilities).
    In the head's chunk (``head_chunk``, per virtual stage) the head's group comes last and keeps
    every layer's graph, A included: the step peaks there, at t · Σ_layers G·U + D_head, if not at
    its last MLP projection, whose copies then hold A too. The pipeline's first stage
    (``first_chunk``) has no split step: torch runs its W as one whole backward. The output gradients B left for W stay to the peak
    (they are the frontier's held-until-W column). Traced tensor by tensor on dense and MoE
    layers (Qwen3, Llama, Mixtral, Qwen3-MoE, DeepSeek-V2-Lite); docs/accuracy.md has the
    measured stages.

    The per-token terms read the layer activations and the recomputed layers alone: without a
    recompute limit every chunk rebuilds all its layers, and they are worked out per combination
    of ``combinations`` and gathered (1M mixed DeepSeek-V3 strategies: a dozen [rows, U] passes
    less in each split-backward group)."""
    if not profile.weight_grad_recomputes_per_group:
        return np.arange(0), [None] * vpp, [None] * vpp
    rows = np.flatnonzero(batch.is_("recompute", "full"))  # priced on the full-recompute rows alone
    if not rows.size:
        return rows, [None] * vpp, [None] * vpp
    dense_layers, moe_layers = recompute_layers_of
    t = t[rows]
    if (batch.recompute_layers[rows] > 0).any():  # per strategy, each with its limit
        _, _, recomputed_dense, recomputed_moe = recomputed_layers(
            recompute_on[rows], batch.recompute_layers[rows], dense_layers, moe_layers)
        copies, last_layer, last_is_moe = _weight_grad_step_per_token(
            model, combinations.taken, rows, recomputed_dense, recomputed_moe, head_chunk)
    else:  # every strategy's counts those of one without a limit, [1, U]
        _, _, recomputed_dense, recomputed_moe = recomputed_layers(
            np.ones(1, dtype=bool), np.zeros(1, dtype=np.int64), dense_layers, moe_layers)
        copies, last_layer, last_is_moe = _weight_grad_step_per_token(
            model, combinations.acts, slice(None), recomputed_dense, recomputed_moe, head_chunk)
        index = rows if combinations.index is None else combinations.index[rows]
        copies, last_layer = copies.take(index, axis=0), last_layer.take(index, axis=0)
    copies = t * copies
    last_layer = t * last_layer
    # ... beside the projection's new weight gradient and the previous group's, which the step's
    # loop still references while the projection's runs (up's, or the fused experts' gate_up,
    # twice down's size).
    param_bytes = batch.precision.param_bytes
    tp, ep, etp = batch.tp[rows], batch.ep[rows], batch.etp[rows]
    dense_weight = 2 * model.ffn_hidden_size * model.hidden_size / tp * param_bytes
    local_experts = model.num_experts / np.maximum(ep, 1)
    moe_weight = 3 * local_experts * model.moe_ffn_hidden_size / etp * model.hidden_size * param_bytes
    # In the chunk that ends with the output head, the head's weight gradient comes last and keeps
    # every layer's graph alive: its peak holds all the copies and the head's new weight gradient.
    head_weight = model.vocab_size * model.hidden_size / tp * param_bytes
    new_grad = np.where(head_chunk[None, :] > 0, head_weight[:, None],
                        np.where(last_is_moe, moe_weight[:, None], dense_weight[:, None]))
    # The head's chunk peaks at whichever comes higher: its last MLP projection, as any chunk's,
    # or the head's own group, with every copy and no read left.
    mlp_peak = last_layer + np.where(last_is_moe, moe_weight[:, None], dense_weight[:, None])
    last_layer = np.where(head_chunk[None, :] > 0, np.maximum(mlp_peak, new_grad), mlp_peak)
    step = copies + np.where(recomputed_dense + recomputed_moe > 0, last_layer, 0.0)
    if profile.first_stage_backward_at_w:
        # The pipeline's first stage runs its W as one whole backward (one rebuild per layer,
        # priced as any backward's working set).
        step[:, first_chunk > 0] = 0.0
        new_grad[:, first_chunk > 0] = 0.0
    np.maximum(step, 0.0, out=step)
    return rows, [chunk_column(step, chunks, c) for c in range(vpp)], [chunk_column(new_grad, chunks, c) for c in range(vpp)]


def _weight_grad_step_per_token(
    model: ModelSpec, acts: LayerActivations, select: np.ndarray | slice, recomputed_dense: np.ndarray,
    recomputed_moe: np.ndarray, head_chunk: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``weight_grad_step``'s terms per token, per row ``select`` of ``acts`` and virtual stage:
    (the copies, Σ_layers G·U, and the last layer's (g − G_last)·U_last − g·A_last + g·R_last),
    and where the chunk's last layer is an MoE layer."""
    groups = weight_grad_groups(model)
    n = len(acts.output)

    def figure(values: Any) -> np.ndarray:
        return np.broadcast_to(values, (n,))[select, None]

    unread = {k: figure(acts.weight_unread[k]) for k in ("dense", "moe")}
    read_last = {k: figure(acts.weight_read_last[k]) for k in ("dense", "moe")}
    copies = recomputed_dense * groups["dense"] * unread["dense"] + recomputed_moe * groups["moe"] * unread["moe"]
    # The last layer of a chunk with MoE layers is an MoE layer (dense layers lead).
    last_is_moe = recomputed_moe > 0
    last_unread = np.where(last_is_moe, unread["moe"], unread["dense"])
    last_read = np.where(last_is_moe, read_last["moe"], read_last["dense"])
    peak_group = weight_grad_peak_group(model)
    last_groups = np.where(last_is_moe, groups["moe"], groups["dense"])
    last_peak = np.where(last_is_moe, peak_group["moe"], peak_group["dense"])
    # What ops past the last layer's weights save is kept only where the head keeps its graph.
    past = {k: figure(acts.weight_past[k]) for k in ("dense", "moe")}
    last_past = np.where(last_is_moe, past["moe"], past["dense"]) * (head_chunk[None, :] == 0)
    return copies, (last_peak - last_groups) * last_unread - last_peak * last_past + last_peak * last_read, last_is_moe
