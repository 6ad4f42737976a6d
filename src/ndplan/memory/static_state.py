"""Parameters, gradients and optimizer states per stage, and what is made of them alone
(``StaticState``): priced once per combination of STATE_FIELDS, and shared by the pipeline-shape
groups that place the layers alike (``SharedStatic``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ndplan.errors import NdplanError
from ndplan.memory.grouping import group_combinations, shape_signature
from ndplan.memory.options import MemoryOptions
from ndplan.memory.overhead import RuntimeOverhead, overhead_model
from ndplan.memory.result import STATIC_KINDS
from ndplan.memory.shape import GroupShape, group_shape, to_stages
from ndplan.memory.static import (
    embedding_elements,
    experts_out_of_fsdp,
    layer_elements,
    linear_weight_elements,
    mtp_extra_elements,
    mtp_extra_linear_elements,
    optimizer_on_device,
    sharding_factors,
)
from ndplan.memory.terms import (
    ddp_bucket_width,
    fp8_weight_cache_width,
    makes_whole_embedding_grad,
    whole_embedding_grad_extra,
)
from ndplan.model.spec import MlpKind, ModelSpec
from ndplan.strategy.batch import CODES, StrategyBatch

#: A term of the static element counts: (kind, per strategy [n], per virtual stage [pp·vpp]).
StaticTerm = tuple[str, Any, np.ndarray]


def host_optimizer_width(precision: Any) -> int:
    """Host bytes per element of an offloaded optimizer's shard: its states, and the weight it
    updates (the master copy, or the parameter where there is none) with that weight's gradient
    at the same width: the CPU step reads and writes those two there. Megatron-Core's
    HybridDeviceOptimizer keeps a pinned CPU copy of each offloaded fp32 main parameter and of
    its gradient; FSDP2's CPUOffloadPolicy keeps the fp32 sharded parameters and their
    gradients on the CPU: 2·4 + 4 + 4 = 16 B with Adam in fp32."""
    updated = precision.master_weight_bytes or precision.param_bytes
    return int(precision.optimizer_states * precision.optimizer_state_bytes + 2 * updated)


def _outer_sum(terms: list[StaticTerm], n: int, width: int) -> np.ndarray:
    """Σ_terms per_strategy ⊗ per_virtual as [n, width]. Terms with the same per-virtual vector
    add their per-strategy factors first (a few [n] operations instead of [n, width] ones); a
    one-hot vector (the embedding's or the head's stage) adds to its column alone.

    Column by column: an outer product [n, width] runs numpy's inner loop over the few columns
    once per strategy, several times slower than a pass over the strategies per column."""
    factors: dict[int, tuple[np.ndarray, Any]] = {}
    for _kind, per_strategy, per_virtual in terms:
        if per_virtual.any():
            known = factors.get(id(per_virtual))
            factors[id(per_virtual)] = (per_virtual, per_strategy if known is None else known[1] + per_strategy)
    total = np.zeros((n, width), order="F")
    for per_virtual, per_strategy in factors.values():
        hot = np.flatnonzero(per_virtual)
        if len(hot) == 1 and per_virtual[hot[0]] == 1.0:
            total[:, hot[0]] += per_strategy
        else:
            # Columns of a zero factor are skipped: the element counts are finite, so each would
            # add ±0, which leaves every sum as it is (a total starts at +0 and never reads -0).
            # A DeepSeek-like model's dense layers fill the first virtual stage alone.
            for column in hot.tolist():
                total[:, column] += per_strategy * per_virtual[column]
    return total


class SharedStatic:
    """The static states of the pipeline-shape groups of an ordered batch (``keys``, rows
    ``parts`` of ``ordered``; ``scores``: per group, whether it materialises attention scores),
    each priced once per combination of STATE_FIELDS (the combinations numbered ``codes``, a row
    of each at ``rows``: ``group_combinations``) and shared by the groups whose pipeline shapes
    place the layers alike (schedules that differ only in their order of operations: the static
    state reads the placement alone). A static state is a few hundred numpy operations over its
    combinations, per row: the groups that share one pay them once (1M mixed DeepSeek-V3
    strategies: 55 groups, 21 placements). Each is priced when its first group asks for it,
    and dropped after its last."""

    def __init__(self, model: ModelSpec, ordered: StrategyBatch, options: MemoryOptions,
                 stage_layers: tuple[int, ...] | None, keys: list[tuple[int, ...]], parts: list[slice],
                 rows: np.ndarray, codes: np.ndarray, scores: list[bool]) -> None:
        self.model, self.ordered, self.options, self.scores = model, ordered, options, scores
        hands_over_enabled = bool(options.profile.pipeline_stage_output)
        self.combinations = [group_combinations(rows, codes, part) for part in parts]
        self.parts = parts
        self.shapes: list[GroupShape] = []
        self.members: dict[tuple[Any, ...], list[int]] = {}  # placement -> its groups (with combinations)
        self.placement_of: list[tuple[Any, ...]] = []
        for g, key in enumerate(keys):
            shape = group_shape(model, CODES["schedule"][key[0]], key[1], key[2], stage_layers, bool(key[4]),
                                 bool(key[5]), hands_over_enabled, True)
            self.shapes.append(shape)
            self.placement_of.append(shape_signature(shape))
            if self.combinations[g] is not None:
                self.members.setdefault(self.placement_of[g], []).append(g)
        self.priced: dict[tuple[Any, ...], tuple[StaticState, list[int]]] = {}  # placement -> (state, offsets)

    def of(self, g: int) -> StaticState | None:
        """Group ``g``'s static state, its index its rows' combinations (None: the group prices its own)."""
        combinations = self.combinations[g]
        if combinations is None:
            return None
        signature = self.placement_of[g]
        members = self.members[signature]
        if signature not in self.priced:
            rows = np.concatenate([self.parts[m].start + self.combinations[m][0] for m in members])  # type: ignore[index]
            state = static_state(self.model, self.ordered.take(rows), self.options, self.shapes[g],
                                  scores=any(self.scores[m] for m in members))
            sizes = [len(self.combinations[m][0]) for m in members]  # type: ignore[index]
            self.priced[signature] = state, np.cumsum([0, *sizes]).tolist()
        state, offsets = self.priced[signature]
        at = members.index(g)
        if at == len(members) - 1:
            del self.priced[signature]  # (its groups come in order: none asks again)
        return replace(state, index=combinations[1] + offsets[at])


def static_state(
    model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, shape: GroupShape, *, scores: bool,
    kinds: dict[str, dict[str, np.ndarray]] | None = None, index: np.ndarray | None = None,
) -> StaticState:
    """``StaticState`` of a group's strategies (``scores``: with ``mlp_grads``); with ``kinds``,
    each kind's parameters, gradients and optimizer states are added to the breakdown's rows
    ``index``."""
    if not options.profile.optimizer_state_offload and bool(batch.offload_optimizer_states.any()):
        raise NdplanError(f"offload_optimizer_states is Megatron-Core's --offload-optimizer-states (MindSpeed's "
                          f"--swap-optimizer); runtime '{options.profile.name}' has no such feature (use runtime megatron)")
    # Megatron-Core's HybridDeviceOptimizer splits the rank's parameters; FSDP2's CPUOffloadPolicy
    # moves all of them or none.
    offload_fraction = batch.optimizer_offload_fraction
    if offload_fraction < 1.0 and bool(options.profile.kernels.get("fsdp_cpu_offload")) \
            and bool((batch.optimizer_offload > 0).any()):
        raise NdplanError(f"optimizer_offload_fraction {offload_fraction:g} is Megatron-Core's "
                          f"--optimizer-offload-fraction; runtime '{options.profile.name}' offloads the whole "
                          "optimizer (FSDP2's CPUOffloadPolicy) or none of it (use runtime megatron)")
    placement = shape.placement
    pp, vpp = len(shape.pattern_of), shape.chunks.shape[1]
    computed, chunks = len(shape.used), shape.chunks
    dense_layers, moe_layers = shape.dense, shape.moe
    precision = batch.precision
    tp, ep, etp = (batch.tp.astype(float), batch.ep.astype(float), batch.etp.astype(float))
    layers = layer_elements(model, tp, ep, etp)
    shards = sharding_factors(batch.dp, batch.cp, batch.tp, batch.ep, batch.etp, batch.zero, batch.shard_group)

    # ---- static: element counts per stage [n, pp], split non-expert / expert and by kind
    table = embedding_elements(model, tp)
    embedding_stage, output_stage = int(placement.stage_of[0]), int(placement.stage_of[-1])
    tables_apart = embedding_stage != output_stage
    # A tied table lives once where both ends meet; apart, the output stage keeps its own copy.
    # MTP modules embed the shifted tokens too, so they need the table on the output stage.
    # Per strategy, the ends meet as two copies where a V's first stage holds them in two chunks
    # that torch.distributed.pipelining (the runtime that defers FSDP's reduce) wraps as FSDP
    # roots of their own: fully_shard of the embedding's chunk replaces the shared parameter
    # there alone, and the head's chunk shards the original again (measured, llama-3.2-1b ZB-V
    # dp2 pp2: 1.21 GiB of sharded parameters on stage 0, two tables; one without FSDP).
    split_tie = (model.tie_word_embeddings and not tables_apart and pp * vpp > 1
                 and options.profile.pipeline_defers_fsdp_reduce) & (batch.zero == 3)
    apart = tables_apart | split_tie  # [n]
    head_on_output = (not model.tie_word_embeddings) | apart
    embedding_copy_for_mtp = model.mtp_depth > 0 and tables_apart and not model.tie_word_embeddings
    final_norm = float(model.hidden_size * (2 if model.norm == "layernorm" and model.norm_bias else 1))
    mtp_kind = model.mtp_mlp_kind
    mtp_layer = layers.non_expert[mtp_kind] + mtp_extra_elements(model, tp)
    # Element counts per virtual stage [n, U] as terms (kind, per strategy [n], per virtual
    # stage [U]): the counts are Σ_terms per_strategy ⊗ per_virtual; a stage sums its chunks.
    first_virtual, last_virtual = shape.first, shape.last
    non_expert_terms: list[StaticTerm] = [("embedding", table, first_virtual)]
    if embedding_copy_for_mtp:
        non_expert_terms.append(("embedding", table, last_virtual))
    non_expert_terms += [
        ("output", table * head_on_output + final_norm, last_virtual),
        ("mtp", model.mtp_depth * mtp_layer, last_virtual),
    ]
    expert_terms: list[StaticTerm] = [("mtp", model.mtp_depth * layers.expert[mtp_kind], last_virtual)]
    layer_kind: MlpKind
    for layer_kind, per_stage in (("dense", dense_layers), ("moe", moe_layers)):
        for part, elements in layers.by_kind[layer_kind].items():
            expert_part = layers.expert[layer_kind] if part == "moe" else 0.0
            non_expert_terms.append((part, elements - expert_part, per_stage))
            if part == "moe":
                expert_terms.append(("moe", layers.expert[layer_kind], per_stage))

    param_bytes, grad_bytes, optimizer_bytes = precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes
    # NeMo AutoModel's MoE parallelizer leaves the routed experts out of FSDP where their shard
    # group is one rank (``MemoryOptions.experts_outside_fsdp``): FSDP gathers none of them and
    # makes no unsharded gradient of theirs, and their gradients are kept in the parameters' dtype.
    experts_outside = experts_out_of_fsdp(options.experts_outside_fsdp, batch.zero, shards.expert_data_shards)[:, None]
    expert_in_fsdp = np.where(experts_outside, 0.0, 1.0)
    expert_grad_bytes = np.where(experts_outside, float(param_bytes), float(grad_bytes))
    offload = batch.optimizer_offload[:, None] > 0
    on_device = optimizer_on_device(offload, offload_fraction)  # (the optimizer's share the device keeps)
    # FSDP2's CPUOffloadPolicy (the runtime's fsdp_cpu_offload, what its optimizer offload is under
    # FSDP) keeps the sharded parameters and gradients on the host with the states: on the device
    # only what FSDP gathers (its unit buffers, comm) and the gradients it makes before reducing.
    shards_on_host = offload & (batch.zero[:, None] == 3) & bool(options.profile.kernels.get("fsdp_cpu_offload"))
    states = {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes}
    out: dict[str, np.ndarray] = {}
    # Sum the kinds first: the search needs only totals, the breakdown prices each kind alike.
    n = len(batch)
    non_expert_total = _outer_sum(non_expert_terms, n, computed)
    expert_total = _outer_sum(expert_terms, n, computed)
    non_expert_stage, expert_stage = to_stages(non_expert_total, chunks), to_stages(expert_total, chunks)
    whole_embedding_grad_tp = makes_whole_embedding_grad(options.profile, batch.tp, batch.zero)
    grads_virtual = np.zeros((n, computed), order="F")
    for category, width in states.items():
        non_expert_div = getattr(shards, category)[:, None]
        expert_div = getattr(shards, f"expert_{category}")[:, None]
        expert_width = expert_grad_bytes if category == "grads" else width
        if category == "grads":
            value = non_expert_total * (width / non_expert_div) + expert_total * (expert_width / expert_div)
            # DTensor: once a second micro-batch's embedding gradient is added, the accumulated
            # gradient is the whole table, not the rank's vocabulary shard.
            whole_embedding_extra = whole_embedding_grad_extra(
                model, options.profile, batch.tp, batch.zero, batch.micro_batches_per_step,
                shared_with_head=model.tie_word_embeddings & ~apart) * width
            value[:, 0] += whole_embedding_extra
            value = np.where(shards_on_host, 0.0, value)
            grads_virtual = value
            value = to_stages(value, chunks)
        else:
            value = non_expert_stage * (width / non_expert_div) + expert_stage * (width / expert_div)
        if category == "optimizer":
            # (of offload_fraction of the rank's parameters; the rest stays on the device)
            out[category] = on_device * value
            # Offloaded for a step on the CPU: the states, the weight it updates and that weight's
            # gradient; between steps: the states and master weights (what the device frees).
            between = batch.offload_optimizer_states[:, None] > 0
            out["host_optimizer"] = np.where(
                offload, offload_fraction * value * (host_optimizer_width(precision) / max(width, 1)),
                np.where(between, value, 0.0))
        else:  # (parameters off the device where FSDP2 keeps their shards on the host; gradients above)
            out[category] = np.where(shards_on_host, 0.0, value) if category == "params" else value
        if kinds is None:
            continue
        for static_kind in STATIC_KINDS:
            elements_bytes = (
                _outer_sum([term for term in non_expert_terms if term[0] == static_kind], n, computed) * width / non_expert_div
                + _outer_sum([term for term in expert_terms if term[0] == static_kind], n, computed) * expert_width / expert_div)
            if category == "grads" and static_kind == "embedding":
                elements_bytes[:, 0] += whole_embedding_extra  # the whole table's gradient is the embedding's
            share = to_stages(elements_bytes, chunks)
            kinds["static"][static_kind][index, :pp] += shape.expand(
                on_device * share if category == "optimizer"
                else np.where(shards_on_host, 0.0, share))

    # The quantised copies of the linear weights an fp8 runtime keeps across micro-batches: part
    # of the weights on the device (params).
    cache_factor = fp8_weight_cache_width(options.profile, precision, batch.zero)[:, None]
    if cache_factor.any():
        linear = linear_weight_elements(model, tp, ep, etp)
        layers_of = {"dense": dense_layers, "moe": moe_layers}
        cache_terms: list[StaticTerm] = [(part, elements, layers_of[linear_kind])
                                         for linear_kind, parts in linear.items() for part, elements in parts.items()]
        cache_terms.append(("mtp", model.mtp_depth * (sum(linear[mtp_kind].values()) + mtp_extra_linear_elements(model, tp)),
                            last_virtual))
        out["params"] = out["params"] + to_stages(_outer_sum(cache_terms, n, computed) * cache_factor, chunks)
        if kinds is not None:
            for static_kind in STATIC_KINDS:
                share = _outer_sum([term for term in cache_terms if term[0] == static_kind], n, computed) * cache_factor
                kinds["static"][static_kind][index, :pp] += shape.expand(to_stages(share, chunks))

    # What the rest of the model reads of the above, all functions of the same fields.
    profile = options.profile
    deferred = (batch.zero == 3) & profile.pipeline_defers_fsdp_reduce & (pp * vpp > 1)
    # Gradient bytes per element as the stage keeps them (ZeRO-2 shards them as they are made).
    grad_width = grad_bytes / shards.grads
    # The head's weight gradient exists from the head's backward on (its own table, or the tied
    # one where both ends share a stage), and the MTP modules', whose backward comes before any
    # decoder layer's (with the embedding copy they keep apart from the first stage). The
    # embedding's gradient is made last, after every layer's backward, unless it is that same
    # shared table.
    head_grad_bytes = ((table * (1 + embedding_copy_for_mtp) + final_norm + model.mtp_depth * mtp_layer) * grad_width
                       + model.mtp_depth * layers.expert[mtp_kind] * expert_grad_bytes[:, 0] / shards.expert_grads)
    table_made_last = np.where(model.tie_word_embeddings & ~apart, 0.0, table * grad_width)
    # From the second micro-batch on, the embedding's backward makes a whole new gradient of the
    # table (the scatter of token gradients is dense) and adds it to the kept one. FSDP gradients
    # are new each micro-batch and priced with its unit buffers. Under DTensor tensor parallelism
    # that new gradient is the whole table, [vocab, h], before it becomes the rank's shard, with
    # one micro-batch too.
    accumulates = (batch.micro_batches_per_step > 1) & (batch.zero < 3)
    whole_table = float(model.vocab_size * model.hidden_size)
    embedding_gradient = np.where(
        whole_embedding_grad_tp, whole_table, np.where(accumulates, table, 0.0)
    ) * precision.param_bytes
    # Likewise the head's backward makes a new gradient of its own weight, [vocab/tp, h], beside
    # the kept one, where autograd accumulates it (``head_accumulate``); Megatron fuses the
    # accumulation into its main-grad buffer.
    head_gradient = np.where(accumulates & profile.grads_created_in_backward & head_on_output, table, 0.0
                             ) * precision.param_bytes
    # One micro-batch under FSDP (and no deferred reduce): the units already reduced have
    # their sharded gradients; the single-micro-batch peak counts no others.
    made_by_now = ((batch.micro_batches_per_step == 1) & ~deferred & profile.grads_created_in_backward
                   & ~shards_on_host[:, 0])  # (copied to the host as they are reduced)
    unit_parts: dict[str, tuple[Any, Any]] = {  # (non-expert, expert) elements of each FSDP unit
        "embedding": (table, 0.0),
        "dense": (layers.non_expert["dense"], layers.expert["dense"]),
        "moe": (layers.non_expert["moe"], layers.expert["moe"]),
        "head": (table * head_on_output + final_norm, 0.0),
    }
    # The gradients of a layer's MLP and second norm, made before its attention backward.
    mlp_grads: dict[str, np.ndarray] = {}
    kind: MlpKind
    for kind, mlp_name in (("dense", "mlp"), ("moe", "moe")) if scores else ():
        experts = layers.expert[kind]
        mlp_grads[kind] = ((layers.by_kind[kind][mlp_name] - experts + 0.5 * layers.by_kind[kind]["norm"]) * grad_width
                           + experts * (expert_grad_bytes[:, 0] / shards.expert_grads))
    # Replicas without ZeRO or FSDP run DDP: where the runtime's reducer keeps buckets apart from
    # the gradients (PyTorch's, gradient_as_bucket_view off), they are as large again, allocated
    # when DDP wraps the model and kept (the comm buffers of every phase).
    ddp_buckets = (non_expert_stage + expert_stage) * ddp_bucket_width(profile, grad_bytes, batch.zero, batch.dp,
                                                                       batch.cp)[:, None]
    # The optimizer states and master weights an offload between steps keeps on the host through
    # the forward and backward (Megatron-Core's --offload-optimizer-states): on the device at the
    # step alone.
    optimizer_forward_backward = np.where(batch.offload_optimizer_states[:, None] > 0, 0.0, out["optimizer"])
    params_optimizer = out["params"] + optimizer_forward_backward
    # The optimizer step's temporaries of the update, in the dtype of the weights it updates.
    updated_bytes = precision.master_weight_bytes or precision.param_bytes
    optimizer_update = out["optimizer"] / max(optimizer_bytes, 1) * profile.optimizer_temp_copies * updated_bytes
    return StaticState(
        params=out["params"], grads=out["grads"], optimizer=out["optimizer"], params_optimizer=params_optimizer,
        total=out["params"] + out["grads"] + out["optimizer"], optimizer_update=optimizer_update,
        total_forward_backward=out["params"] + out["grads"] + optimizer_forward_backward,
        grads_virtual=grads_virtual,
        unit_elements={kind: non_expert + expert * expert_in_fsdp[:, 0] for kind, (non_expert, expert) in unit_parts.items()}
        | {"tied": table * (model.tie_word_embeddings & ~apart)},
        unit_grads={kind: np.where(made_by_now, non_expert * grad_bytes / shards.grads
                                   + expert * expert_in_fsdp[:, 0] * grad_bytes / shards.expert_grads, 0.0)
                    for kind, (non_expert, expert) in unit_parts.items()},
        expert_elements=layers.expert["moe"], head_grad_bytes=head_grad_bytes, table_made_last=table_made_last,
        embedding_gradient=embedding_gradient, head_gradient=head_gradient, mlp_grads=mlp_grads,
        overhead=overhead_model(options.profile, batch, options.include_overhead),
        elements_virtual=non_expert_total + expert_total * expert_in_fsdp,
        stage_elements=non_expert_stage + expert_stage * expert_in_fsdp,
        direct_grads_virtual=expert_total * np.where(experts_outside, float(param_bytes), 0.0),
        ddp_buckets=ddp_buckets, host_optimizer=out["host_optimizer"],
    )


@dataclass(frozen=True)
class StaticState:
    """A group's parameters, gradients and optimizer states and what is made of them alone (all
    functions of STATIC_FIELDS), per combination of those fields: ``index`` gives each strategy's
    (None: one each, in order); ``at`` reads a figure per strategy.

    Per stage pattern [combinations, P] bytes: ``params``, ``grads`` and ``optimizer`` (0 where
    offloaded for a step on the CPU), ``params_optimizer`` = params + optimizer as the forward and
    backward hold them (no optimizer where it waits on the host between steps), ``total`` = params
    + grads + optimizer (summed in that order; at the step), ``total_forward_backward`` the same
    as the forward and backward hold it, ``optimizer_update`` = optimizer / max(optimizer bytes, 1)
    · optimizer_temp_copies · the updated weights' bytes (the optimizer step's temporaries of
    the update); per virtual stage [combinations, U] ``grads_virtual``; the elements per virtual
    stage and per pattern (non-expert + expert: ``elements_virtual``, ``stage_elements``); per
    combination: the elements of each FSDP unit (``unit_elements``), the bytes of their sharded
    gradients where a unit's moments count them (``unit_grads``: one micro-batch, no deferred
    reduce; else 0), the routed experts' elements of a MoE layer (``expert_elements``), the
    gradient bytes of the head and the MTP modules (``head_grad_bytes``), of the embedding made
    after every layer (``table_made_last``), of a new embedding gradient
    (``embedding_gradient``) and a new head gradient (``head_gradient``), and per layer kind of its MLP and second norm (``mlp_grads``, only
    where the scores are materialised); ``overhead`` the runtime overhead; per pattern the DDP
    reducer's buckets kept beside the gradients (``ddp_buckets``, 0 where there are none).

    Strategies share these many at a time (they differ in micro-batch size, recompute, sequence
    parallelism, ...): each figure is gathered where it is read, and only there (the FSDP
    unit figures at the sharded strategies alone), sums of figures summed per combination."""

    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    params_optimizer: np.ndarray
    total: np.ndarray
    total_forward_backward: np.ndarray
    optimizer_update: np.ndarray
    grads_virtual: np.ndarray
    elements_virtual: np.ndarray
    stage_elements: np.ndarray
    #: per virtual stage, the gradient bytes the backward makes outside FSDP where FSDP shards the
    #: rest (the routed experts AutoModel leaves out of it: ``experts_outside_fsdp``); 0 elsewhere
    direct_grads_virtual: np.ndarray
    unit_elements: dict[str, np.ndarray]
    unit_grads: dict[str, np.ndarray]
    expert_elements: np.ndarray
    head_grad_bytes: np.ndarray
    table_made_last: Any
    embedding_gradient: np.ndarray
    head_gradient: np.ndarray
    mlp_grads: dict[str, np.ndarray]
    overhead: RuntimeOverhead
    ddp_buckets: np.ndarray
    #: per pattern, the pinned host memory an offloaded optimizer fills (``host_optimizer_width``
    #: per element of its shard; 0 where the optimizer stays on the device)
    host_optimizer: np.ndarray
    index: np.ndarray | None = None  # per strategy its combination (None: one each)

    def at(self, values: Any, rows: np.ndarray | None = None) -> Any:
        """``values``, one of the figures above (per combination, or a number for all), per
        strategy: at the strategies ``rows`` (None: every one; 2-D figures column-major)."""
        if not isinstance(values, np.ndarray) or values.ndim == 0:
            return values
        if self.index is not None:
            rows = self.index if rows is None else self.index[rows]
        return values if rows is None else _rows_of(values, rows)


def _rows_of(values: Any, index: np.ndarray) -> Any:
    """``values`` [combinations] or [combinations, k] at ``index`` (a number as it is), 2-D
    arrays column-major: a column gathered at a time, contiguous."""
    if not isinstance(values, np.ndarray):
        return values
    if values.ndim == 1:
        return values[index]
    if values.flags.f_contiguous:  # (the static state's are: one take of its transpose's rows)
        return np.take(values.T, index, axis=1).T
    out = np.empty((len(index), values.shape[1]), order="F")
    for column in range(values.shape[1]):
        np.take(values[:, column], index, out=out[:, column])
    return out
