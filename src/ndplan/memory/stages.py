"""Peak memory of every pipeline stage, for one strategy or millions, by one code path.

Per stage s of a strategy (all in bytes, per device):

    static(s)      = params + grads + optimizer states of the layers, tables and MTP on s
    held(s)        = max over the schedule's timeline of Σ_chunks in_flight(t, c) · act(c)
    comm(s)        = collective buffers alive while a layer runs (FSDP gathers, SP gather, CP
                     K/V exchange, EP dispatch, PP send/recv)
    transient(s)   = the backward's working set of one layer (plus what recompute rebuilds),
                     or the logits and their gradients around the loss, whichever is larger

The held activations are per micro-batch; a working set, and the buffers a layer's exchanges
and the pipeline's send and receive take, are per op: a micro-batch's tokens, or under Seq1F1B
one sub-sequence's, tokens / seq_chunks (``_per_op``).
    allocated(s)   = max(static + held + comm + transient, static + optimizer-step temporaries)
                     (at the held peak's moment: less the tensors handed over at a V's turn, and
                     without the gradients a runtime creates in the backward where none exist yet)
    device(s)      = allocated · (1 + allocator slack) + runtime context + communicator buffers

Strategies are grouped by their pipeline shape (``fields.PIPELINE_SHAPE``: schedule, pp, vpp,
Seq1F1B's sequence chunks, and whether the embedding and the head count as layers), for which the
placement is made once, and within a group taken in the order of their micro-batch counts, each
count's schedule simulated once; everything else is numpy over the group.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ndplan.arrays import gathered, one_value, unique
from ndplan.errors import NdplanError
from ndplan.memory.activations import (
    Combinations,
    LayerActivations,
    activation_columns,
    layer_activations,
    prices_sdpa_mask,
    sdpa_mask_bytes,
)
from ndplan.memory.backward import (
    ScoresMoments,
    expert_weight_grad_working,
    layer_working_set,
    mtp_module_bytes,
    pending_split_grad_width,
    scores_backward_moments,
    weight_grad_step,
)
from ndplan.memory.buffers import allgather_dispatch_bytes, layer_buffers, receive_buffers
from ndplan.memory.fields import PIPELINE_SHAPE, STATIC_FIELDS, UNREAD_FIELDS
from ndplan.memory.frontier import inputs_kept_at_end
from ndplan.memory.fsdp import FsdpPhases, FsdpRequest, fsdp_moments
from ndplan.memory.grouping import group_alike, shape_groups
from ndplan.memory.held_peak import activation_kinds, held_peak, pattern_leaders
from ndplan.memory.layer_offload import held_away
from ndplan.memory.options import MemoryOptions
from ndplan.memory.overhead import RuntimeOverhead
from ndplan.memory.result import ACTIVATION_KINDS, CATEGORIES, STATIC_KINDS, StageMemory
from ndplan.memory.shape import (
    GroupShape,
    chunk_column,
    group_shape,
    largest_chunks,
    recomputed_layers,
    to_stages,
)
from ndplan.memory.static_state import SharedStatic, StaticState, static_state
from ndplan.memory.terms import (
    dense_weight_accumulate,
    head_accumulate,
    routes_own_tokens,
    whole_embedding_grad_extra,
)
from ndplan.model.spec import ModelSpec
from ndplan.schedule import EVERY_BACKWARD_SPLIT, SPLIT_BACKWARD, V_SHAPE
from ndplan.schedule.unshard import ACTIVE_CHUNKS
from ndplan.strategy.batch import CODES, StrategyBatch, distinct_columns
from ndplan.units import memory_limit


def stage_memory(
    model: ModelSpec,
    batch: StrategyBatch,
    options: MemoryOptions | None = None,
    *,
    breakdown: bool = False,
    stage_layers: tuple[int, ...] | None = None,
) -> StageMemory:
    """Per-stage memory of every strategy in ``batch`` (see the module docstring).

    ``stage_layers`` places the layers of every strategy in the batch unevenly (pp·vpp counts,
    the same for all); without it each strategy uses the uniform placement of its pp and vpp.
    """
    options = options or MemoryOptions()
    n = len(batch)
    max_pp = int(batch.pp.max())
    names = (*CATEGORIES, "optimizer_step", "forward_backward", "allocated", "reserved", "device")
    result = {name: np.zeros((n, max_pp)) for name in names}
    kinds: dict[str, dict[str, np.ndarray]] | None = None
    if breakdown:
        kinds = {
            "static": {k: np.zeros((n, max_pp)) for k in STATIC_KINDS},
            "activations": {k: np.zeros((n, max_pp)) for k in ACTIVATION_KINDS},
        }
    if kinds is None:
        # Sorted by pipeline shape once, every group is a slice: its columns are views, not copies.
        for _key, rows, out, of in _sorted_groups(model, batch, options, stage_layers):
            pp = out["device"].shape[1]
            for name in names:
                result[name][rows, :pp] = out[name] if of is None else out[name][of]
        return StageMemory(**result, by_kind=None)
    acts = layer_activations(model, batch, options)
    for key, index in batch.groups(PIPELINE_SHAPE):
        out = _evaluate_group(model, batch.take(index), options, key, index, kinds, stage_layers, acts.take(index))
        pp = out["device"].shape[1]
        for name in names:
            result[name][index, :pp] = out[name]
    return StageMemory(**result, by_kind=kinds)


def _sorted_groups(
    model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, stage_layers: tuple[int, ...] | None,
    *, static_only: bool = False, device_only: bool = False, limit: float | None = None,
) -> Iterator[tuple[tuple[int, ...], np.ndarray, dict[str, np.ndarray], np.ndarray | None]]:
    """Each pipeline-shape group's figures: (key, the group's rows in ``batch``, arrays; only
    "device" with ``static_only`` or ``device_only``, and with ``limit`` (``device_only``)
    "cut" and "bound" as ``_evaluate_group`` gives them; and per row of the group, its row of
    the arrays, or None where they have a row each, in order). Strategies alike in every field
    the model reads share a row (``group_alike``)."""
    # Within a group, rows by micro-batch count: each count's schedule frontier prices a slice.
    groups, group_of = shape_groups(batch)
    order = np.concatenate([rows for _, rows in groups])
    sizes = [len(rows) for _, rows in groups]
    starts = np.cumsum([0, *sizes])
    priced_row: np.ndarray | None = None  # per row of ``order``, its row of ``priced``
    priced, priced_sizes = order, sizes  # the rows of ``batch`` priced, group by group
    if not static_only:
        # The static state depends on STATE_FIELDS alone: priced once per combination
        # (``SharedStatic``), numbered by the fields' values, whatever the rows' order.
        static_code, alike = group_alike(model, batch, options, groups, stage_layers, group_of)
        if alike is not None:
            kinds = alike[1]
            # A row of each kind, in ``order``'s order: the same order, fewer rows. (Any row of a
            # kind stands for it: the one at a place of ``order`` that the kind's write leaves.)
            in_order = kinds[order]
            place_of_kind = np.empty(len(alike[0]), dtype=np.int64)
            place_of_kind[in_order] = np.arange(len(order))
            first = np.zeros(len(order), dtype=bool)
            first[place_of_kind] = True
            kept = np.flatnonzero(first)
            priced = order[kept]
            priced_sizes = np.diff(np.searchsorted(kept, starts)).tolist()
            # Per row of ``order``, the row of ``priced`` that stands for its kind.
            priced_row = (np.cumsum(first) - 1)[place_of_kind][in_order]
        static_code = static_code[priced]
        static_rows = np.empty(int(static_code.max(initial=-1)) + 1, dtype=np.int64)
        static_rows[static_code] = np.arange(len(priced))
    # Each field is gathered once, by the whole order (measured on 1M mixed strategies: 65-73 ms
    # for 14 fields, against 103-106 ms gathered by group, then within each group's block).
    # The pipeline shape's fields are the groups' keys: repeated, not gathered; the fields one
    # value fills (a search fixes many) are that value broadcast (read-only, as every field is
    # read here), neither gathered nor written; and so are the fields no figure reads (UNREAD_FIELDS:
    # the first row's value stands for every row's, as ``group_alike``'s kinds let any row stand for
    # the rows that differ only in them).
    ordered = StrategyBatch(**{
        name: _repeated(np.array([key[PIPELINE_SHAPE.index(name)] for key, _ in groups], dtype=np.int64), priced_sizes)
        if name in PIPELINE_SHAPE else _gathered(getattr(batch, name), priced, unread=name in UNREAD_FIELDS)
        for name in batch.array_fields()
    }, precision=batch.precision, recompute_modules=batch.recompute_modules, offload_modules=batch.offload_modules,
        optimizer_offload_fraction=batch.optimizer_offload_fraction)
    parts = [slice(a, b) for a, b in itertools.pairwise(np.cumsum([0, *priced_sizes]).tolist())]
    statics: SharedStatic | None = None
    if not static_only:
        # The bytes per token of each layer depend on a few fields: priced once per combination
        # of the rows priced (their fields gathered already, fewer rows than the batch's).
        distinct, combination, _ = distinct_columns(activation_columns(model, ordered, options), len(ordered))
        by_activations = ordered.take(distinct)
        acts = layer_activations(model, by_activations, options)
        # Only eager attention and SDPA's math path materialise the scores (most strategies: none).
        materialised = np.zeros(len(acts.output), dtype=bool)
        for kind in ("dense", "moe"):
            materialised |= np.broadcast_to(acts.attention_backward[kind], materialised.shape) > 0
        statics = SharedStatic(model, ordered, options, stage_layers, [key for key, _ in groups], parts,
                                static_rows, static_code,
                                [bool(materialised.any()) and bool(materialised[combination[part]].any()) for part in parts])
    group_start = np.cumsum([0, *(len(index) for _, index in groups)]).tolist()  # each group's start in ``order``

    def evaluation(g: int) -> Generator[FsdpRequest, tuple[FsdpPhases, np.ndarray], dict[str, np.ndarray]]:
        part = parts[g]
        return _group_evaluation(model, ordered.take(part), options, groups[g][0], np.arange(part.start, part.stop),
                                 None, stage_layers, None, device_only=device_only,
                                 static=None if statics is None else statics.of(g), limit=limit,
                                 combinations=None if static_only else Combinations(acts, by_activations,
                                                                                     combination[part]))

    def result(g: int, out: dict[str, np.ndarray]) -> tuple[tuple[int, ...], np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        (key, index), start = groups[g], group_start[g]
        return key, index, out, None if priced_row is None else priced_row[start:start + len(index)] - parts[g].start

    # The groups that place their layers alike (``SharedStatic``) are evaluated side by side, up
    # to their FSDP unit moments, which are priced together (``fsdp_moments``), then each to its
    # end (1M mixed DeepSeek-V3 strategies: 21 calls of a few hundred numpy operations each over
    # 23,813 distinct sharded rows, instead of 55 over 57,030: rows alike across groups are found).
    side_by_side: dict[Any, list[int]] = {}
    for g in range(len(groups)):
        side_by_side.setdefault(g if statics is None else statics.placement_of[g], []).append(g)
    for members in side_by_side.values():
        outs: dict[int, dict[str, np.ndarray]] = {}
        waiting: dict[int, tuple[Generator[FsdpRequest, tuple[FsdpPhases, np.ndarray], dict[str, np.ndarray]],
                                 FsdpRequest]] = {}
        for g in members:
            run = evaluation(g)
            try:
                waiting[g] = run, next(run)
            except StopIteration as done:  # (no strategy of the group is sharded)
                outs[g] = done.value
        if waiting:
            moments = fsdp_moments([request for _, request in waiting.values()])
            for (g, (run, _)), answer in zip(waiting.items(), moments, strict=True):
                try:
                    run.send(answer)
                except StopIteration as done:
                    outs[g] = done.value
        for g in members:
            yield result(g, outs[g])


def _gathered(values: np.ndarray, order: np.ndarray, *, unread: bool = False) -> np.ndarray:
    """values[order] (``ndplan.arrays.gathered``: from an int32 copy where the values fit, the
    one value broadcast where they hold one), or the first value broadcast (read-only) where the
    field is ``unread`` (1M mixed strategies: three fields' gathers less)."""
    if len(values) and unread:
        return np.broadcast_to(values[:1], (len(order),))
    return gathered(values, order)


def _repeated(values: np.ndarray, counts: list[int]) -> np.ndarray:
    """np.repeat(values, counts), or the one value broadcast (read-only) where all are one."""
    if len(values) and one_value(values):
        return np.broadcast_to(values[:1], (sum(counts),))
    return np.repeat(values, counts)


def static_lower_bound(
    model: ModelSpec, batch: StrategyBatch, options: MemoryOptions | None = None, *, distinct: bool = False
) -> np.ndarray:
    """Per strategy, a lower bound of ``peak_memory``'s peak (bytes): the device total of the
    largest stage's parameters, gradients and optimizer states alone, as every stage holds them
    at its optimizer step. A fraction of the full model's work: the search rejects with it first.
    ``distinct``: the caller knows that no two strategies of ``batch`` share their values of
    STATIC_FIELDS (they are not looked for)."""
    options = options or MemoryOptions()
    combination: np.ndarray | None = None
    if not distinct:
        # A function of STATIC_FIELDS alone, which a search's candidates share many at a time (they
        # differ in sequence parallelism, context-parallel kind, recompute, ...): priced once each.
        rows, combination = batch.distinct(STATIC_FIELDS)
        batch = batch.take(rows)
    bound = np.zeros(len(batch))
    for _key, index, out, _ in _sorted_groups(model, batch, options, None, static_only=True):
        bound[index] = out["device"].max(axis=1)
    return bound if combination is None else bound[combination]


def peak_memory(
    model: ModelSpec, batch: StrategyBatch, options: MemoryOptions | None = None, *, limit: float | str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per strategy: the largest device total over its stages (bytes) and that stage. The same
    numbers as ``stage_memory(...).peak()``, without keeping every stage of every strategy.

    With ``limit`` (bytes), a strategy found above it part way through its pricing is priced no
    further (a search needs only that it does not fit): its peak is then a lower bound of the
    full one, still above ``limit``, and its stage -1. Every strategy whose peak is at most
    ``limit``, and every one not cut short, gets the figures it gets without a limit, bit for
    bit (``_certainly_over`` says where the cut comes and why it is safe). ``limit`` is bytes
    or a size such as "80GiB" (``units.memory_limit``)."""
    options = options or MemoryOptions()
    limit = None if limit is None else memory_limit(limit, "limit", none_means="no limit")
    peak = np.zeros(len(batch))
    stage = np.zeros(len(batch), dtype=np.int64)
    for _key, index, out, of in _sorted_groups(model, batch, options, None, device_only=True, limit=limit):
        if "device" in out:
            top, first = _first_max(out["device"].T)
            if "stages" in out:  # the stages priced (``pattern_leaders``), the others never the first peak
                first = out["stages"][first]
        else:  # every strategy of the group was cut short
            top, first = out["bound"], np.full(len(out["bound"]), -1, dtype=np.int64)
        if "cut" in out:
            top, first = np.where(out["cut"], out["bound"], top), np.where(out["cut"], -1, first)
        peak[index], stage[index] = (top, first) if of is None else (top[of], first[of])
    return peak, stage


#: How far below its partial total a strategy's peak may be, relative: the partial total is a
#: lower bound of the full one in exact arithmetic, but the full one adds further terms (one of
#: them negative where FSDP credits freed activations against its buffers) and may round below
#: it by a few units in the last place of its largest term (~1e-16 relative each, a handful of
#: additions). The margin covers that unless a term were a million times the peak, and is about
#: 80 bytes of an 80 GB limit: a strategy that close to the limit is priced in full.
ROUNDING_MARGIN = 1e-9


def _certainly_over(
    partial: np.ndarray, overhead: RuntimeOverhead, limit: float, additive: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per strategy (``partial``: stage-major [stages, n]), where its peak is certainly above
    ``limit`` from ``partial`` alone, and a lower bound of its peak: the device total of its
    largest partial, less ``ROUNDING_MARGIN``.

    ``partial`` is the forward/backward sum's first terms (held activations with the extra
    columns, the gradients where static, parameters and optimizer states); the rest, where
    ``additive``, is added to it and adds at least 0: the communication buffers (all >= 0, the
    tensors handed over at a V's turn among them, subtracted once) and the transient (a working
    set >= 0, or under FSDP the worst unit moment's working set and buffers less what the
    buffers count twice, whose total is >= 0: every stage's moments include an empty one, and
    the gradients a moment makes are counted only with one micro-batch, which is not additive).
    The device total is a maximum with that sum, scaled by 1 + slack and offset: monotone.
    Where not ``additive`` (one micro-batch whose gradients appear in the backward) the peak is
    a maximum of other sums: never cut."""
    bound = overhead.reserved(partial.max(axis=0))
    bound += overhead.fixed_bytes
    bound *= 1.0 - ROUNDING_MARGIN
    return additive & (bound > limit), bound


def _first_max(by_stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column of ``by_stage`` [pp, n]: its largest value and the first row holding it (as
    ``np.argmax`` chooses; along the long axis, not per strategy over a few stages)."""
    top = by_stage.max(axis=0)
    first = np.zeros(by_stage.shape[1], dtype=np.int64)
    for s in range(len(by_stage) - 1, -1, -1):  # the last write, the first stage, wins
        first[by_stage[s] == top] = s
    return top, first


def _per_op(values: np.ndarray, seq_chunks: int) -> np.ndarray:
    """``values`` (bytes of a micro-batch's tokens) for what one forward, backward or loss op
    runs on or frees: the micro-batch, or under Seq1F1B one of its ``seq_chunks`` sub-sequences,
    values / seq_chunks (the same array where there is one).

    Seq1F1B (Sun et al. 2024, arXiv 2406.03488) splits each micro-batch's sequence into
    seq_chunks sub-sequences and runs every op on one: the layers, the loss on its logits, the
    pipeline send and receive (thunlp/Seq1F1B; MindSpeed's implementation gives each sub-sequence
    the same length by default, ``--seq1f1b-balance-method average``, as the time model's
    f / seq_chunks per op assumes; its ``uniform_comp`` split makes the first sub-sequence the
    longest, whose ops this reads short). Each op's working set, its exchange buffers and the
    activations it frees are then a sub-sequence's. Not priced: a sub-sequence's attention reads
    the K/V of every earlier one (MindSpeed's ``Seq1F1BCache`` concatenates them, and its backward
    carries their gradients to the earlier sub-sequences' backwards), so each held sub-sequence
    keeps its prefix's K/V rather than its own, and the backward carries a prefix's dK/dV."""
    return values if seq_chunks == 1 else values / seq_chunks


def _evaluate_group(
    model: ModelSpec,
    batch: StrategyBatch,
    options: MemoryOptions,
    key: tuple[int, ...],
    index: np.ndarray,
    kinds: dict[str, dict[str, np.ndarray]] | None,
    stage_layers: tuple[int, ...] | None,
    acts: LayerActivations | None,
    *,
    device_only: bool = False,
    static: StaticState | None = None,
    limit: float | None = None,
) -> dict[str, np.ndarray]:
    """``_group_evaluation`` of one group alone, its FSDP unit moments priced on its own."""
    run = _group_evaluation(model, batch, options, key, index, kinds, stage_layers, acts, device_only=device_only,
                            static=static, limit=limit)
    try:
        request = next(run)
        run.send(fsdp_moments([request])[0])
    except StopIteration as done:
        return done.value
    raise AssertionError("a group asks for its FSDP unit moments once")


def _group_evaluation(
    model: ModelSpec,
    batch: StrategyBatch,
    options: MemoryOptions,
    key: tuple[int, ...],
    index: np.ndarray,
    kinds: dict[str, dict[str, np.ndarray]] | None,
    stage_layers: tuple[int, ...] | None,
    acts: LayerActivations | None,
    *,
    device_only: bool = False,
    static: StaticState | None = None,
    limit: float | None = None,
    combinations: Combinations | None = None,
) -> Generator[FsdpRequest, tuple[FsdpPhases, np.ndarray], dict[str, np.ndarray]]:
    """(A generator: where the group has sharded strategies it yields their FSDP unit moments'
    arguments, ``FsdpRequest``, to be sent (the moments, and per sharded strategy its row of
    them), so that groups of one placement price theirs together; it returns the figures.)

    Every category for one pipeline shape, as [strategies in the group, pp] arrays (without
    ``acts`` or ``combinations``: only "device" for the static state alone, a lower bound of the device peak; with
    ``device_only``: only "device", the figures of the stages in between are not expanded).
    ``static``: the group's static state, where the caller priced it; ``combinations``: its
    strategies' layer activations by combination, where the caller has them (else ``acts``).

    With ``limit`` (``device_only`` alone): "cut" [n] bool, the strategies found certainly above
    ``limit`` once the static state at the held peak is added to it (``_certainly_over``), and
    "bound" [n], a lower bound of each one's peak; the rest of the work (the FSDP unit moments)
    skips them and their "device" rows are not their peaks. Where every strategy is cut, no
    "device". (DeepSeek-V3's search, bench_search: of 581k strategies priced, 342k are over the
    80 GB limit, 305k of them cut here; their FSDP moments were the largest cost after the cut.)

    Every term but the held activations is computed per stage pattern (see ``GroupShape``):
    arrays [n, P] over patterns and [n, U] over the virtual stages they run, expanded to the pp
    stages where the held peak joins them.

    Those arrays are column-major (order="F"): they are filled and read column by column (see
    ``_outer_sum``), and a column-major column is contiguous, where a row-major one is strided
    through every cache line of the array; their transposes, the stage-major [P, n] rows that
    the held peak and ``GroupShape.by_stage`` take, are then contiguous too. Elementwise
    results keep their operands' layout (one row-major operand makes them row-major), so the
    arrays made here are made column-major."""
    schedule_code, pp, vpp, seq_chunks, embedding_as_layer, output_as_layer = key
    schedule = CODES["schedule"][schedule_code]
    hands_over_enabled = bool(options.profile.pipeline_stage_output)
    shape = group_shape(model, schedule, pp, vpp, stage_layers, bool(embedding_as_layer), bool(output_as_layer),
                         hands_over_enabled, kinds is None)
    placement = shape.placement
    virtual = pp * vpp
    computed, patterns = len(shape.used), len(shape.reps)  # virtual stages and stage patterns priced
    on_stage, chunks = shape.on_stage, shape.chunks
    first_stage = on_stage[:, 0]
    hands_over = hands_over_enabled and schedule in V_SHAPE and virtual > 1
    hands_forward, hands_backward = shape.hands_forward, shape.hands_backward
    moe_per_stage = shape.moe_per_stage
    dense_layers, moe_layers = shape.dense, shape.moe  # per virtual stage computed

    precision = batch.precision
    tp, cp = batch.tp.astype(float), batch.cp.astype(float)
    grad_bytes = precision.grad_bytes
    n = len(batch)
    first_virtual, last_virtual = shape.first, shape.last
    # The layer activations' figures by combination (see ``Combinations``; per strategy where
    # the caller has no combinations).
    by_combination = combinations or (Combinations(acts, batch, None) if acts is not None else None)
    # Only eager attention and SDPA's math path materialise the scores (most strategies: none):
    # looked for among the group's combinations where some has them.
    scores = by_combination is not None and any(
        bool(np.any(positive)) and bool(np.any(by_combination.rows(positive)))
        for positive in (by_combination.acts.attention_backward[k] > 0 for k in ("dense", "moe")))
    if static is None:
        static_of = batch.distinct(STATIC_FIELDS) if by_combination is not None and kinds is None else None
        if static_of is None or 2 * len(static_of[0]) > n:
            static = static_state(model, batch, options, shape, scores=scores, kinds=kinds, index=index)
        else:
            # The static state is a function of STATIC_FIELDS, which a group's strategies share
            # many at a time (they differ in micro-batch size, recompute, sequence parallelism,
            # ...): priced once per combination and read through its index, where that is much
            # less than the group.
            static = replace(static_state(model, batch.take(static_of[0]), options, shape, scores=scores),
                             index=static_of[1])
    overhead = replace(static.overhead, fixed_bytes=static.at(static.overhead.fixed_bytes))

    if by_combination is None:
        # allocated >= params + grads + optimizer, and the device total grows with allocated.
        return {"device": shape.expand(overhead.reserved(static.at(static.total)) + overhead.fixed_bytes[:, None])}

    # (The figures of the layer activations and activation_columns alone worked out per
    # combination and gathered: 1M mixed DeepSeek-V3 strategies, at most 192 combinations.)
    table_recompute_on = by_combination.recompute_on()
    table_tp = by_combination.batch.tp.astype(float)
    tokens = (batch.micro_batch_size * batch.seq_length).astype(float) / cp
    recompute_on = ~batch.is_("recompute", "none")
    # Sequence parallelism shards the activations between layers over tp.
    table_sp_div = np.where(by_combination.batch.sequence_parallel > 0, table_tp, 1.0)
    sp_div = by_combination.rows(table_sp_div)
    # What one forward, backward or loss runs on (``_per_op``): a micro-batch, or under Seq1F1B
    # one of its seq_chunks sub-sequences, tokens / seq_chunks. The held activations stay per
    # micro-batch: the schedule counts a held sub-sequence as 1/seq_chunks of one.
    op_tokens = _per_op(tokens, seq_chunks)
    group = _Group(model, batch, options, shape, schedule, pp, vpp, seq_chunks, static, by_combination, scores,
                   tokens, op_tokens, recompute_on, tp, table_recompute_on, table_tp, table_sp_div)
    profile = options.profile
    t = tokens[:, None]
    out: dict[str, np.ndarray] = {}

    # ---- activations held across the schedule
    held_b = _held_until_backward(group, breakdown=kinds is not None)
    per_b_virtual = held_b.per_b_virtual
    # Gradients created in the backward (set_to_none) do not exist before a chunk's first
    # backward: GPipe's peak, all forwards held, has none. Elsewhere they are static.
    grads_in_schedule = profile.grads_created_in_backward
    zero3 = batch.zero == 3
    # torch.distributed.pipelining defers FSDP's reduce to the end of the step: a chunk keeps its
    # unsharded gradients from its first backward on (accumulated in the reduce dtype), and no
    # sharded ones until then.
    deferred = zero3 & profile.pipeline_defers_fsdp_reduce & (virtual > 1)
    # From a step's second pipeline run on, the gradients the first made are there from the run's
    # start (the runs accumulate into them): static, and that run's peak is the step's. Under a
    # deferred FSDP reduce those are the sharded ones, and each run makes its unsharded ones anew.
    later_runs = (batch.pipeline_runs > 1) if grads_in_schedule else np.zeros(n, dtype=bool)
    extra: list[np.ndarray | None] | None = None
    # [n, V] the weight gradients a chunk's W leaves for its next B's hook to accumulate (ZB-V
    # under a deferred FSDP reduce; None elsewhere): the frontier's grads_pending columns.
    per_pending: np.ndarray | None = None
    if grads_in_schedule:
        per_grads = static.at(static.grads_virtual)
        deferred_rows = np.flatnonzero(deferred)
        static_rows = np.flatnonzero(later_runs & ~deferred)
        if deferred_rows.size or static_rows.size:
            if static.index is None:  # (the static state's own array; gathered, it is a copy already)
                per_grads = per_grads.copy(order="F")
            deferred_elements = static.at(static.elements_virtual, deferred_rows)
            # (and the gradients made outside FSDP, from the chunk's first backward on too)
            per_grads[deferred_rows] = deferred_elements * grad_bytes + static.at(static.direct_grads_virtual,
                                                                                  deferred_rows)
            pending_width = pending_split_grad_width(schedule, precision, profile, first_virtual)
            if deferred_rows.size and pending_width.any():
                per_pending = np.zeros_like(per_grads)
                per_pending[deferred_rows] = deferred_elements * pending_width[None, :]
            # DTensor's vocabulary-parallel embedding accumulates the whole [vocab, h] table's
            # unsharded gradient, not its shard (measured on fake tensors: Llama-3.1-405B, tp 8,
            # pp 8, 7.83 GiB in fp32 on the first stage).
            # (FSDP's unsharded gradient: priced as one without ZeRO-3's sharding, zero 0)
            whole = whole_embedding_grad_extra(model, profile, batch.tp[deferred_rows], 0, 1)
            per_grads[deferred_rows] += np.multiply.outer(whole * grad_bytes, first_virtual)
            per_grads[static_rows] = 0.0
        extra = [chunk_column(per_grads, chunks, c) for c in range(vpp)]
    split = schedule in SPLIT_BACKWARD
    per_w_virtual = _held_until_weight_grad(group, held_b) if split else None  # nothing waits for W without a split
    kept_inputs: np.ndarray | None = None  # [n, U] an input gradient a split backward leaves, per micro-batch
    # The frontier's columns are [held until B per chunk | held until W per chunk | gradients
    # per chunk | (split backward) weight-gradient steps, first steps, input gradients kept and
    # gradients pending, per chunk | (V schedules) hand-overs]: their weights, one [n, pp] array each.
    weights: list[np.ndarray | None] = [chunk_column(per_b_virtual, chunks, c) for c in range(vpp)]
    weights += [None if per_w_virtual is None else chunk_column(per_w_virtual, chunks, c) for c in range(vpp)]
    # ---- transient: one layer's backward working set (+ what recompute rebuilds), or the loss
    has_moe = moe_per_stage > 0
    working = _working_sets(group, held_b, split)
    out["transient"] = working.transient
    if split:
        # The frontier's columns after the gradients: each chunk's weight-gradient step while it
        # runs. Its working set takes the place of a layer backward's (the transient, added to
        # every row), so a column weighs what it allocates beyond that.
        # (Both kinds of columns are worked out at the full-recompute rows ``stepping`` alone and
        # placed among zeros: elsewhere a step and its gradients are 0, less a transient >= +0,
        # which the maximum with 0 makes +0.)
        stepping, steps, new_grads = weight_grad_step(
            model, batch, by_combination, profile, t, recompute_on, recompute_layers_of=(dense_layers, moe_layers),
            chunks=chunks,
            vpp=vpp, head_chunk=last_virtual, first_chunk=first_virtual)
        transient_stepping = out["transient"][stepping] if any(step is not None for step in steps) else None
        extra = [*(extra or [None] * vpp),
                 *(None if step is None else _placed(np.maximum(step - transient_stepping, 0.0), stepping, n)
                   for step in steps)]
        # A chunk's first such step creates its gradients as it runs: at its peak, all but the
        # norms' (a runtime that creates them in the backward; elsewhere they are static), one
        # of them the step's new weight gradient, counted in the step already.
        # (Not on the pipeline's first stage, whose W is one whole backward: its gradients turn
        # on after it, as after any backward.)
        first_step: list[np.ndarray | None] = [None] * vpp
        if grads_in_schedule and any(step is not None for step in steps):
            whole_w = first_virtual > 0 if profile.first_stage_backward_at_w else np.zeros_like(first_virtual, dtype=bool)
            made = per_grads[stepping] if per_pending is None else per_grads[stepping] + per_pending[stepping]
            made_in_step = np.where(~whole_w[None, :], made, 0.0)
            first_step = [None if step is None else _placed(np.maximum(chunk_column(made_in_step, chunks, c) - new_grad, 0.0),
                                                            stepping, n)
                          for c, (step, new_grad) in enumerate(zip(steps, new_grads, strict=True))]
        extra += first_step
        # Each B apart from its W leaves the micro-batch's input gradient on the chunk's
        # receive buffer (a chunk that receives from a peer) until the next step: the
        # frontier's inputs_kept columns count them (measured on fake tensors: ZB-V, a 8-layer
        # Llama-3.1-8B over pp 4, its middle stages -2.2% without them).
        if profile.split_backward_keeps_input_grads and shape.receives_from_peer.any():
            kept_inputs = np.multiply.outer(tokens * model.hidden_size * precision.activation_bytes / sp_div,
                                            shape.receives_from_peer.astype(float))
        extra += [None if kept_inputs is None else chunk_column(kept_inputs, chunks, c) for c in range(vpp)]
        # A W's new weight gradients wait beside the chunk's accumulated ones until its next B
        # (FSDP2's hook runs there): counted from the W to that B, not throughout (measured on
        # fake tensors: ZB-V, an 8-layer Llama-3.1-8B over pp 4, its turn stage, whose last B's
        # leave none pending while every W is still to run).
        if schedule in EVERY_BACKWARD_SPLIT:  # (the frontier's columns: for these alone)
            extra += [None if per_pending is None else chunk_column(per_pending, chunks, c) for c in range(vpp)]
    handed_over: np.ndarray | None = None  # none handed over without a V's turn
    if hands_over:
        one_hand_over = tokens * model.hidden_size * precision.activation_bytes / sp_div
        per_handover = np.zeros((len(batch), patterns), order="F")
        per_handover[:, shape.turn] = one_hand_over  # the frontier's hand-over column: the V's turn
        extra = [*(extra or [None] * vpp), per_handover]
        count = on_stage @ (hands_forward.astype(float) + hands_backward)
        handed_over = (batch.num_micro_batches * one_hand_over)[:, None] * count[None, :]
    # The device total alone reads the held peak without the extra columns only at a single
    # micro-batch's loss (below); the rest of its rows are left unpriced.
    held_read = None
    # The device total alone is read for its largest stage, the first: stages that an earlier
    # one of their pattern outweighs are left out (``pattern_leaders``), the rows of the held
    # peak and of every sum after it are those of the stages ``leaders`` (DeepSeek-V3's search:
    # the 1F1B and GPipe groups of 16 and 32 stages price 4-5 each).
    leaders: np.ndarray | None = None
    priced_shape = shape
    if device_only:
        held_read = (batch.micro_batches_per_step == 1) & profile.grads_created_in_backward
        leaders = pattern_leaders(schedule, pp, vpp, seq_chunks, batch.num_micro_batches, weights, extra,
                                   shape.pattern_of)
        if leaders is not None:
            priced_shape = replace(shape, pattern_of=shape.pattern_of[leaders])
    held, held_with_extra, chosen = held_peak(  # stage-major [pp, n] (device_only: [len(leaders), n])
        schedule, pp, vpp, seq_chunks, batch.num_micro_batches, weights, extra, shape.pattern_of,
        keep_rows=kinds is not None, held_read=held_read, stages=leaders,
    )
    # What the weight-gradient steps add to the peak, reported with the transient (the rest of the
    # forward/backward peak): the same peak without their columns, subtracted. Not needed for the
    # device total alone.
    weight_step_extra: np.ndarray | None = None
    if split and extra is not None and not device_only and any(e is not None for e in extra[vpp:3 * vpp]):
        without = [*extra[:vpp], *([None] * (2 * vpp)), *extra[3 * vpp:]]
        _, without_steps, _ = held_peak(
            schedule, pp, vpp, seq_chunks, batch.num_micro_batches, weights, without, shape.pattern_of)
        weight_step_extra = held_with_extra - without_steps
    if kinds is not None and chosen is not None and held_b.layer_counts is not None:
        activation_kinds(kinds, index, pp, vpp, placement, chosen, t, by_combination.taken, *held_b.layer_counts,
                          {"embedding": np.multiply.outer(held_b.embedding_held, first_virtual),
                           "output": np.multiply.outer(held_b.output_held, last_virtual) + held_b.kept_logits,
                           "mtp": np.multiply.outer(held_b.mtp_held, last_virtual),
                           "pipeline": held_b.kept_hidden,
                           "checkpoint_mask": np.zeros((n, computed), order="F") if held_b.checkpoint_mask_virtual is None
                           else held_b.checkpoint_mask_virtual,
                           "received_checkpoint": np.zeros((n, computed), order="F")
                           if held_b.received_checkpoint_virtual is None else held_b.received_checkpoint_virtual},
                          np.zeros_like(per_b_virtual) if per_w_virtual is None else per_w_virtual, model)

    # forward/backward = params + optimizer + held (+ grads where static) + comm - handed over
    # + transient, every term but the held peak expanded from its patterns to the stages; summed
    # in this order, term by term, so that stages of equal totals tie exactly (the peak stage is
    # the first of them). Stage-major [pp, n], as the held peak comes: a stage's row is one copy.
    # The static state at the held peak first: with ``limit``, that partial sum already rejects
    # most of the strategies over it, before the buffers and the FSDP moments are priced.
    # (held + grads) + (params + optimizer): the same sum as (params + optimizer) + (held + grads)
    # (Summed in place where nothing else reads the held peak with the extra columns.)
    forward_backward = held_with_extra if device_only and held_with_extra is not held else held_with_extra.copy()
    if not grads_in_schedule:
        priced_shape.combine_by_stage(forward_backward, static.at(static.grads))
    elif later_runs.any():
        priced_shape.combine_by_stage(forward_backward, static.at(static.grads) * later_runs[:, None])
    priced_shape.combine_by_stage(forward_backward, static.at(static.params_optimizer))
    cut: np.ndarray | None = None
    if limit is not None and device_only:
        additive = ~((batch.micro_batches_per_step == 1) & profile.grads_created_in_backward)
        cut, bound = _certainly_over(forward_backward, overhead, limit, additive)
        if cut.all():
            return {"cut": cut, "bound": bound}

    # ---- communication buffers alive while a layer runs
    overlapping_with_pp = layer_buffers(model, batch, options, op_tokens, tokens, pp, has_moe, sp_div)
    # Only FSDP strategies have unit moments: price those rows alone.
    sharded_rows = np.flatnonzero(zero3 if cut is None else zero3 & ~cut)
    if sharded_rows.size:
        # The moments, priced once per distinct row of their inputs (``fsdp_moments``), with
        # those of the groups of this placement where the caller evaluates them side by side.
        sharded, rows_of = yield _fsdp_request(group, held_b, sharded_rows, deferred)
        # Per row of the batch, its row of the moments, or one past them (a row of zeros) where
        # nothing is sharded: each figure read is then one gather, not a gather by the distinct
        # rows and a scatter to the sharded ones. The moments stay per row computed (``fsdp``,
        # then the row of zeros), where the figures made of them are worked out before that
        # gather (a few thousand distinct rows: DeepSeek-V3's search, 2.2k of 5.5k sharded of
        # 14k per group), and the single micro-batch's gather only its rows.
        computed_rows = len(sharded.buffers)
        source = np.full(len(batch), computed_rows)
        source[sharded_rows] = rows_of
        fsdp = FsdpPhases(*(
            np.concatenate([values, np.zeros((1, patterns))])
            for values in (sharded.buffers, sharded.working, sharded.last_unit, sharded.grads_made)
        ))
    else:
        source = np.zeros(len(batch), dtype=np.intp)
        fsdp = FsdpPhases(*(np.zeros((1, patterns)) for _ in range(4)))
    # The communication buffers, summed in place in the order overlapping + kept gathered +
    # receive + DDP buckets (+ FSDP's gathers). A term that is zero for a strategy, or for all
    # the group's, is not added there: every term is bytes, finite and >= +0, which x + 0.0 leaves
    # as it is (on 1M mixed strategies most strategies keep nothing gathered, and DDP's buckets
    # are the runtime's own or none).
    other_comm = overlapping_with_pp  # (its own array)
    # FSDP without resharding after forward keeps the stage's gathered parameters (under a
    # deferring pipeline every unit stays gathered after its backward whatever the setting: the
    # unit moments hold them, _fsdp_unit_phases' kept_after_backward).
    kept_rows = np.flatnonzero(zero3 & (batch.reshard_after_forward == 0) & ~deferred)
    if kept_rows.size:
        # Every element whole on the device (non-expert /tp, experts /ep·etp): the two kinds
        # are sharded over different groups, so the sharded bytes do not give them back.
        other_comm[kept_rows] += static.at(static.stage_elements, kept_rows) * precision.param_gather_bytes
    receive = receive_buffers(model, batch, options, shape, tokens, sp_div)  # (its own array)
    if handed_over is not None:
        # The tensors handed over at a V's turn are reported with the receive buffers (all m of
        # them, as at the step's end); the forward/backward peak counts those handed over by then.
        receive += handed_over
    ddp_buckets = static.at(static.ddp_buckets) if static.ddp_buckets.any() else None
    if options.moe_dispatcher == "allgather" and model.is_moe:
        # Megatron's global memory buffer the allgather dispatcher gathers into: kept from the
        # first MoE layer's forward on, through the optimizer step (on stages with MoE layers).
        dispatch_buffer = allgather_dispatch_bytes(model, batch, op_tokens)[0][:, None] * (moe_per_stage > 0)
        ddp_buckets = dispatch_buffer if ddp_buckets is None else ddp_buckets + dispatch_buffer
    other_comm += receive
    if ddp_buckets is not None:
        other_comm += ddp_buckets
    # Zero where nothing is sharded. A moment that frees a micro-batch's activations is credited
    # against its buffers (_fsdp_unit_phases); past zero the credit is the working set's, so that
    # neither category reads below zero (the sum, the moment, is the same).
    out["comm"] = other_comm + np.maximum(fsdp.buffers, 0.0).take(source, axis=0) if sharded_rows.size else other_comm
    out["transient"][sharded_rows] = (fsdp.working + np.minimum(fsdp.buffers, 0.0)).take(source[sharded_rows], axis=0)
    # The math libraries' workspaces (cuBLAS, cuBLASLt) come from the caching allocator at the
    # first matmul and stay: part of every working set, forward/backward and optimizer step alike.
    # A runtime's grouped GEMM may take its own at its first expert layer (per stage pattern).
    workspaces = overhead.workspace_bytes + overhead.expert_workspace_bytes * options.grouped_gemm * (moe_per_stage > 0)
    out["transient"] += workspaces

    # ---- optimizer step temporaries (activations are gone by then)
    optimizer_step = static.at(static.optimizer_update) + receive
    if kept_inputs is not None:
        # The input gradients the step's B's left stay through it (the largest count of a
        # pattern's stages: DualPipeV's differ by stage).
        optimizer_step += _kept_inputs_at_end(schedule, pp, vpp, batch.num_micro_batches, shape, kept_inputs)
    if ddp_buckets is not None:
        optimizer_step += ddp_buckets
    optimizer_step += workspaces
    out["optimizer_step"] = optimizer_step

    # The static state per strategy: its sums, each gathered once, and its parts where the
    # figures of every category are kept.
    # (the optimizer step holds every state; the forward and backward not those that wait on the
    # host between steps)
    total = static.at(static.total)
    total_fb = static.at(static.total_forward_backward)
    if not device_only:
        for name in ("params", "grads", "optimizer"):
            out[name] = static.at(getattr(static, name))
    # forward/backward: the static state at the held peak (summed above), then the rest.
    expand = priced_shape.by_stage
    priced_shape.combine_by_stage(forward_backward, out["comm"])
    if handed_over is not None:
        priced_shape.combine_by_stage(forward_backward, handed_over, np.subtract)
    priced_shape.combine_by_stage(forward_backward, out["transient"])
    if options.profile.grads_created_in_backward:
        # zero_grad(set_to_none=True): with one micro-batch the gradients appear during the
        # backward as the activations go, so the loss (all activations, no gradients) and the end
        # of the backward (all gradients, one layer's working set) are the two candidate peaks.
        single = np.flatnonzero(batch.micro_batches_per_step == 1)  # priced on those rows alone
        if single.size:
            static_single, comm_single = total_fb[single], out["comm"][single]
            grads_single = static.at(static.grads, single)
            loss_phase = expand(static_single - grads_single) + held[:, single]
            loss_phase += expand(comm_single)
            loss_phase += expand(out["transient"][single])
            loss_phase += expand(fsdp.grads_made.take(source[single], axis=0))
            # The embedding's backward comes last, when nothing is held.
            backward_end = static_single + comm_single + np.maximum(
                working.layer_transient[single], working.embedding_gradient[single, None] * first_stage[None, :])
            # Under FSDP the backward ends in the first unit's reduce, not the stage's worst one.
            backward_end = np.where(zero3[single, None], static_single + other_comm[single] + fsdp.last_unit.take(source[single], axis=0),
                                    backward_end)
            backward_end += overhead.workspace_bytes
            forward_backward[:, single] = np.maximum(loss_phase, expand(backward_end))
            # Where the scores are materialised, the first layer's attention backward: the loss's
            # activations are gone, the head's and that layer's MLP gradients made (FSDP prices
            # its moments with its units).
            if working.scores_during is not None and working.scores_grads is not None:
                scores_phase = expand(static_single - grads_single + comm_single + overhead.workspace_bytes
                                      + working.scores_during[single]
                                      + np.where(zero3[single, None], 0.0, working.scores_grads[single]))
                scores_phase += held[:, single]
                forward_backward[:, single] = np.maximum(forward_backward[:, single], scores_phase)
    closing = np.flatnonzero(deferred) if extra is not None else np.zeros(0, dtype=np.intp)
    if closing.size:
        # A deferred FSDP reduce closes the step: every unsharded gradient the runs accumulated is
        # there, every unit still gathered (at most three chunks), no activations, and the first
        # unit's reduce-scatter input (its gradient in the reduce dtype) beside them (measured on
        # fake tensors: an 8-layer Llama-3.1-8B, pp 2, FSDP 2, its first stage's peak).
        # (every chunk's last W has left its gradients pending)
        accumulated = to_stages(per_grads[closing] if per_pending is None
                                else per_grads[closing] + per_pending[closing], chunks)
        elements = static.at(static.elements_virtual, closing)
        gathered = (to_stages(elements, chunks) if vpp <= ACTIVE_CHUNKS else largest_chunks(elements, chunks, vpp)
                    ) * precision.param_gather_bytes
        units = static.unit_elements
        layer_unit = np.maximum(static.at(units["dense"], closing), static.at(units["moe"], closing))
        first_unit = np.where(to_stages(np.broadcast_to(first_virtual, elements.shape), chunks) > 0,
                              static.at(units["embedding"], closing)[:, None], layer_unit[:, None])
        end = (total_fb[closing] - static.at(static.grads, closing) + accumulated + gathered
               + first_unit * grad_bytes + overhead.workspace_bytes)
        forward_backward[:, closing] = np.maximum(forward_backward[:, closing], expand(end))
    if device_only:  # in place: the figures in between are not kept
        priced_shape.combine_by_stage(forward_backward, np.add(total, optimizer_step, out=optimizer_step), np.maximum)
        # (Scaled in place: the same product, and no [pp, n] array to allocate and fault in.)
        device = overhead.reserved(forward_backward, out=forward_backward)
        device += overhead.fixed_bytes
        result = {"device": device.T} if leaders is None else {"device": device.T, "stages": leaders}
        return result if cut is None else result | {"cut": cut, "bound": bound}
    allocated = np.maximum(forward_backward, expand(total + out["optimizer_step"]))
    reserved = overhead.reserved(allocated)
    by_stage = {"activations": held, "forward_backward": forward_backward, "allocated": allocated,
                "reserved": reserved, "device": reserved + overhead.fixed_bytes}
    for name, values in by_stage.items():
        out[name] = values.T
    # An FSDP moment whose freed activations outweigh its buffers and working set (the credit
    # above) lowers the peak's sum, which is priced; as a category the transient stays >= 0, and
    # what the moment lacks is read as not there at the peak (``unmade_bytes``).
    out["transient"] = np.maximum(out["transient"], 0.0)
    for name in ("params", "grads", "optimizer", "comm", "transient", "optimizer_step"):
        out[name] = shape.expand(out[name])
    if weight_step_extra is not None:
        out["transient"] = out["transient"] + weight_step_extra.T
    deferred_rows = np.flatnonzero(np.broadcast_to(deferred, (len(batch),)))
    if deferred_rows.size:
        # Under a deferred FSDP reduce the stage holds its chunks' unsharded gradients at the peak,
        # FSDP's gradient buffers until the step's end reduce-scatter: they are reported with the
        # communication buffers (as FSDP's memory tracker counts them), and the sharded gradients,
        # made by that reduce, as not yet created; the categories then add up to the peak.
        rows = out["forward_backward"][deferred_rows]
        others = sum(out[name][deferred_rows] for name in ("params", "optimizer", "activations", "comm", "transient"))
        others = others + out["grads"][deferred_rows] * later_runs[deferred_rows, None]  # a later run's
        out["comm"] = out["comm"].copy()
        out["comm"][deferred_rows] += np.maximum(rows - others, 0.0)
    return out


@dataclass(frozen=True)
class _Group:
    """One pipeline-shape group as the parts of its evaluation read it: its strategies
    (``batch``, n of them), what their pipeline shape fixes, their static state and layer
    activations by combination (``scores``: whether some materialises the attention scores), and
    per strategy [n] the tokens of a micro-batch on a rank, mbs · seq / cp (``tokens``), of one
    op (``op_tokens``, ``_per_op``), whether it recomputes, its tp as floats (read by two parts,
    made once), and the sequence-parallel divisor (``table_sp_div``: tp under SP,
    else 1; per combination, as ``table_tp`` and ``table_recompute_on``)."""

    model: ModelSpec
    batch: StrategyBatch
    options: MemoryOptions
    shape: GroupShape
    schedule: str
    pp: int
    vpp: int
    seq_chunks: int
    static: StaticState
    by_combination: Combinations
    scores: bool
    tokens: np.ndarray
    op_tokens: np.ndarray
    recompute_on: np.ndarray
    tp: np.ndarray
    table_recompute_on: np.ndarray
    table_tp: np.ndarray
    table_sp_div: np.ndarray


@dataclass(frozen=True)
class _HeldUntilBackward:
    """Bytes one micro-batch's forward leaves on each virtual stage until its backward, [n, U]
    (column-major) per strategy and virtual stage, or [n] for a one-column entry:
    ``layers_held`` its layers' (as each strategy's recompute keeps them), ``plain_held`` those
    of the layers a recompute limit leaves plain (None without a limit), ``embedding_held`` (first
    virtual stage), ``output_held`` and ``mtp_held`` (last), ``checkpoint_mask_virtual`` the
    masks recompute's checkpoints keep (None where none is kept), ``received_checkpoint_virtual``
    the first layers' checkpointed inputs that are receive buffers, counted with those and
    subtracted here (None where none is), and ``per_b_virtual`` the sum
    of them all with the pipeline's kept stage outputs. For the breakdown by kind:
    ``layer_counts`` (plain dense, plain MoE, recomputed dense, recomputed MoE layers [n, U]; also
    under a limit), ``kept_logits`` and ``kept_hidden`` (zero-width without the breakdown).
    ``full_recompute`` and ``mtp_limited`` [n]: where the strategy recomputes fully, and where it
    does with a limit (which leaves the MTP modules whole)."""

    layers_held: np.ndarray
    plain_held: np.ndarray | None
    layer_counts: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
    embedding_held: np.ndarray
    output_held: np.ndarray
    mtp_held: np.ndarray
    per_b_virtual: np.ndarray
    checkpoint_mask_virtual: np.ndarray | None
    received_checkpoint_virtual: np.ndarray | None
    kept_logits: np.ndarray
    kept_hidden: np.ndarray
    full_recompute: np.ndarray
    mtp_limited: np.ndarray


@dataclass(frozen=True)
class _WorkingSets:
    """The backward's working sets per strategy and stage pattern, [n, P] bytes (column-major):
    ``transient`` the largest beside what the stage holds (a layer's backward with what
    recompute rebuilds, the loss, the accumulated embedding, head and expert gradients, an MTP
    module's rebuild); ``layer_transient`` the backward's last layer's, when nothing else is
    held; ``scores_during`` and ``scores_grads`` the attention backward's moments where the
    scores are materialised (None where no strategy materialises them, ``ScoresMoments``); and
    ``embedding_gradient`` [n], the bytes of a new embedding gradient."""

    transient: np.ndarray
    layer_transient: np.ndarray
    scores_during: np.ndarray | None
    scores_grads: np.ndarray | None
    embedding_gradient: np.ndarray


def _held_until_backward(group: _Group, *, breakdown: bool) -> _HeldUntilBackward:
    """What one micro-batch's forward leaves on each virtual stage until its backward (see
    ``_HeldUntilBackward``); the breakdown's parts too with ``breakdown``."""
    model, batch, options, shape, by_combination = group.model, group.batch, group.options, group.shape, group.by_combination
    table, table_recompute_on, table_tp, table_sp_div = (by_combination.acts, group.table_recompute_on, group.table_tp,
                                                         group.table_sp_div)
    tokens, recompute_on, precision, profile = group.tokens, group.recompute_on, batch.precision, options.profile
    t = tokens[:, None]
    n, computed, virtual, mtp_kind = len(batch), len(shape.used), group.pp * group.vpp, model.mtp_mlp_kind
    dense_layers, moe_layers, last_virtual = shape.dense, shape.moe, shape.last
    hands_forward, receives_from_peer = shape.hands_forward, shape.receives_from_peer
    # A chunk's layers hold t · Σ_kinds (plain layers · full bytes + recomputed layers · kept
    # bytes) per micro-batch. Without a recompute limit a chunk recomputes all its layers or none:
    # t · (dense · kept_dense + moe · kept_moe), with a layer's bytes as the strategy keeps them.
    kept_dense, kept_moe = (np.where(table_recompute_on, table.recomputed[k], table.full[k]) for k in ("dense", "moe"))
    # Column by column (see _outer_sum): the same products, in passes over the strategies, once
    # per distinct pair of layer counts (the interior chunks of a uniform placement share one).
    layers_held = np.empty((len(batch), computed), order="F")
    column_of: dict[tuple[float, float], int] = {}
    for column, (dense, moe) in enumerate(zip(dense_layers.tolist(), moe_layers.tolist(), strict=True)):
        same = column_of.setdefault((dense, moe), column)
        layers_held[:, column] = (tokens * by_combination.rows(kept_dense * dense + kept_moe * moe) if same == column
                                  else layers_held[:, same])
    limited = np.flatnonzero(recompute_on & (batch.recompute_layers > 0))
    # The layers a recompute limit leaves plain, their full bytes: their autograd graph is held
    # from the forward to the weight gradient like any layer's without recompute (0 where every
    # layer of a chunk recomputes).
    plain_held: np.ndarray | None = None
    layer_counts = None
    if limited.size or breakdown:
        # With a limit, only the first recompute_layers layers of each chunk are recomputed.
        rows = np.arange(len(batch)) if breakdown else limited
        layer_counts = plain_dense, plain_moe, recomputed_dense, recomputed_moe = recomputed_layers(
            recompute_on[rows], batch.recompute_layers[rows], dense_layers, moe_layers)
        full, recomputed = by_combination.taken.full, by_combination.taken.recomputed
        plain = t[rows] * (plain_dense * full["dense"][rows, None] + plain_moe * full["moe"][rows, None])
        layers_held[rows] = plain + t[rows] * (
            recomputed_dense * recomputed["dense"][rows, None] + recomputed_moe * recomputed["moe"][rows, None]
        )
        if limited.size:
            plain_held = np.zeros((len(batch), computed))
            plain_held[rows] = np.where(recompute_on[rows, None], plain, 0.0)
    offloading = np.flatnonzero(batch.offload_layers > 0)
    if offloading.size:
        # Megatron-Core's layer offload (layer_offload): without a pipeline, one chunk; the first
        # layers' activations are on the host at the peak. (No recompute: every layer plain.)
        if not profile.layer_offload:
            raise NdplanError(f"offload_layers is Megatron-Core's --cpu-offloading-num-layers; runtime '{profile.name}' "
                              "has no such feature (use runtime megatron)")
        away_dense, away_moe = held_away(model, batch.offload_layers[offloading])
        full = by_combination.taken.full
        layers_held[offloading, 0] -= tokens[offloading] * (away_dense * full["dense"][offloading]
                                                            + away_moe * full["moe"][offloading])
        if breakdown and layer_counts is not None:  # (every row's counts, plain ones first)
            plain_dense, plain_moe = (np.array(counts, dtype=float) for counts in layer_counts[:2])
            plain_dense[offloading, 0] -= away_dense
            plain_moe[offloading, 0] -= away_moe
            layer_counts = (plain_dense, plain_moe, *layer_counts[2:])
    # One-column entries [n]: the int64 token ids (and what the embedding keeps) on the first
    # virtual stage; the loss, and the MTP modules (their layer as the strategy keeps it), on the last.
    embedding_held = tokens * by_combination.rows(8.0 + table.embedding)
    output_held = tokens * by_combination.rows(table.output)
    # Megatron-Core's MTP modules (multi_token_prediction.py) under full recompute: the uniform
    # method checkpoints each module whole; the block method (a recompute limit) skips their
    # recompute ("not supported for MTP yet"), so the layer keeps everything. Selective recompute
    # runs in the module's TransformerLayer as in any other.
    full_recompute = batch.is_("recompute", "full")
    mtp_limited = full_recompute & (batch.recompute_layers > 0)
    if mtp_limited.any():
        mtp_module = mtp_module_bytes(by_combination.taken, mtp_kind, recompute_on, full_recompute, mtp_limited)
    else:  # (no limit read: a figure of the combinations)
        table_full_recompute = by_combination.batch.is_("recompute", "full")
        mtp_module = by_combination.rows(mtp_module_bytes(table, mtp_kind, table_recompute_on, table_full_recompute,
                                                     np.zeros_like(table_full_recompute)))
    mtp_held = tokens * model.mtp_depth * mtp_module
    # Bytes of one micro-batch per virtual stage, held until its backward: the sum of the entries
    # (in this order, so that the sums are those of the breakdown's entries).
    per_b_virtual = layers_held.copy(order="F")
    per_b_virtual[:, 0] += embedding_held
    per_b_virtual[:, -1] += output_held
    per_b_virtual[:, -1] += mtp_held
    # Under recompute each chunk's checkpoints keep the boolean mask they were given, once per
    # micro-batch (their layers share it): transformers' SDPA masks sliding layers from seq >= window.
    # (None where no strategy keeps one: 0 bytes, which leave the sums, finite and >= +0, as
    # they are; 1M mixed DeepSeek-V3 strategies: a where, an [n, U] product and two [n, U]
    # sums less a group.)
    checkpoint_mask_virtual: np.ndarray | None = None
    if prices_sdpa_mask(model, options):
        checkpoint_mask = np.where(recompute_on, sdpa_mask_bytes(model, batch, options), 0.0)
        checkpoint_mask_virtual = np.multiply(checkpoint_mask[:, None], ((dense_layers + moe_layers) > 0).astype(float),
                                              out=np.empty((n, computed), order="F"))
        per_b_virtual += checkpoint_mask_virtual
    # A chunk that receives its input from a peer, and checkpoints its first layer's input under
    # full recompute, keeps that input as the receive buffer itself (``receive_buffers``), not a
    # second copy (measured on fake tensors: a 16-layer Llama-3.1-8B over pp 4, its middle stages
    # +2.6% with it). (None where no chunk receives or no strategy recomputes fully.)
    received_checkpoint_virtual: np.ndarray | None = None
    receives = receives_from_peer & ((dense_layers + moe_layers) > 0)
    if profile.pipeline_stage_output and receives.any():
        whole_input = np.where(full_recompute & recompute_on, tokens * by_combination.rows(model.hidden_size / table_sp_div)
                               * precision.activation_bytes, 0.0)
        if whole_input.any():
            received_checkpoint_virtual = np.multiply.outer(whole_input, receives.astype(float))
            per_b_virtual -= received_checkpoint_virtual
    # Per virtual stage, for the breakdown by kind: the logits and the hidden states the pipeline
    # runtime keeps per micro-batch (below), the head's and the pipeline's.
    # (Zeros only where the breakdown by kind reads them: elsewhere an [n, U] fill for nothing.)
    kept_logits = kept_hidden = np.zeros_like(per_b_virtual) if breakdown else per_b_virtual[:, :0]
    if profile.pipeline_stage_output and virtual > 1:
        # A pipeline stage keeps its output until that micro-batch's backward: the hidden state
        # (sequence-sharded under SP) on every stage but the last, the logits on the last.
        vocab_div = table_tp if options.loss_parallel or (options.loss_parallel is None and profile.loss_parallel) else 1.0
        act_bytes = precision.activation_bytes
        # The input a later stage received, which needs a gradient, is its receive buffer
        # itself (allocated up front for every micro-batch, ``receive_buffers``): not kept again
        # (measured on fake tensors: a 16-layer Llama-3.1-8B over pp 4, its middle stages
        # +1.1% with it, no recompute). Per virtual stage: the logits and hidden states kept,
        # per token, as counts times their elements per rank.
        logits_kept = last_virtual * ~hands_forward
        hidden_kept = (1.0 - last_virtual) * ~hands_forward
        token_bytes = tokens * act_bytes
        logits_per_token = np.broadcast_to(model.vocab_size / vocab_div, table_tp.shape)  # (per combination)
        hidden_per_token = model.hidden_size / table_sp_div
        # Column by column (see _outer_sum): the same products, in passes over the strategies, once
        # per distinct pair of counts.
        kept_bytes: dict[tuple[float, float], np.ndarray] = {}
        for column, (logits, hidden) in enumerate(zip(logits_kept.tolist(), hidden_kept.tolist(), strict=True)):
            term = kept_bytes.get((logits, hidden))
            if term is None:
                term = kept_bytes[logits, hidden] = token_bytes * by_combination.rows(
                    logits_per_token * logits + hidden_per_token * hidden)
            per_b_virtual[:, column] += term
        if breakdown:
            kept_logits = np.multiply.outer(token_bytes * by_combination.rows(logits_per_token), logits_kept.astype(float))
            kept_hidden = np.multiply.outer(token_bytes * by_combination.rows(hidden_per_token),
                                            hidden_kept.astype(float))
    return _HeldUntilBackward(layers_held, plain_held, layer_counts, embedding_held, output_held, mtp_held, per_b_virtual,
                              checkpoint_mask_virtual, received_checkpoint_virtual, kept_logits, kept_hidden,
                              full_recompute, mtp_limited)



def _held_until_weight_grad(group: _Group, held: _HeldUntilBackward) -> np.ndarray:
    """[n, U] bytes of one micro-batch per virtual stage held from its input gradient (B) until
    its weight gradient (W), under a schedule that splits the backward."""
    model, batch, options, shape, by_combination = group.model, group.batch, group.options, group.shape, group.by_combination
    table, tokens, recompute_on, precision, profile = (by_combination.acts, group.tokens, group.recompute_on,
                                                       batch.precision, options.profile)
    tp, n, computed = group.tp, len(batch), len(shape.used)
    dense_layers, moe_layers, first_virtual, last_virtual = shape.dense, shape.moe, shape.first, shape.last
    layers_held, plain_held, per_b_virtual = held.layers_held, held.plain_held, held.per_b_virtual
    checkpoint_mask_virtual = held.checkpoint_mask_virtual
    if profile.weight_grad_holds == "all":
        # torch.distributed.pipelining keeps a micro-batch's whole autograd graph from its input
        # gradient (B) until its weight gradient (W), and with it the gradients of the linear
        # and norm outputs that W consumes. Under recompute that graph is the one B rebuilt: every
        # activation of the layer; where W rebuilds the layer again, per parameter group, B's
        # rebuilt copy is gone by the end of B and only the output gradients stay (traced).
        # The head's weight gradient reads the gradient of the logits, kept from B until W.
        logits_div = tp if options.loss_parallel or (options.loss_parallel is None and profile.loss_parallel) else 1.0
        logits_gradient = tokens * model.vocab_size * precision.activation_bytes / logits_div
        outputs_dense, outputs_moe = table.weight_grad_outputs["dense"], table.weight_grad_outputs["moe"]
        per_w_virtual = np.empty((n, computed), order="F")
        # Column by column (see _outer_sum): the same products, in passes over the strategies.
        for column, (dense, moe, last) in enumerate(
                zip(dense_layers.tolist(), moe_layers.tolist(), last_virtual.tolist(), strict=True)):
            if profile.weight_grad_recomputes_per_group:
                # A recomputed layer's rebuilt copy is gone after B; a plain one's graph is not.
                graph_for_w = np.where(recompute_on, 0.0 if plain_held is None else plain_held[:, column],
                                       layers_held[:, column])
            else:
                whole_graph = tokens * by_combination.rows(table.full["dense"] * dense + table.full["moe"] * moe)
                graph_for_w = np.where(recompute_on, whole_graph, layers_held[:, column])
            per_w_virtual[:, column] = (graph_for_w + tokens * by_combination.rows(outputs_dense * dense + outputs_moe * moe)
                                        + logits_gradient * last)
        # The checkpoints stay in that graph until W, and with them the mask they keep.
        if checkpoint_mask_virtual is not None:
            per_w_virtual += checkpoint_mask_virtual
        if profile.first_stage_backward_at_w:
            # The pipeline's first stage has no input gradient to make: torch skips its B and runs
            # one whole backward at W, so what its forward kept stays until then, and no more.
            per_w_virtual[:, first_virtual > 0] = per_b_virtual[:, first_virtual > 0]
    else:
        # W needs the linear layers' inputs and their output gradients (about as large).
        per_w_virtual = np.empty((n, computed), order="F")
        # Column by column (see _outer_sum): the same products, in passes over the strategies.
        for column, (dense, moe) in enumerate(zip(dense_layers.tolist(), moe_layers.tolist(), strict=True)):
            per_w_virtual[:, column] = 2 * tokens * by_combination.rows(
                table.weight_input["dense"] * dense + table.weight_input["moe"] * moe)
    return per_w_virtual



def _working_sets(group: _Group, held: _HeldUntilBackward, split: bool) -> _WorkingSets:
    """The backward's transient peak per stage pattern, beside what the stage holds (see
    ``_WorkingSets``)."""
    model, batch, options, shape, by_combination = group.model, group.batch, group.options, group.shape, group.by_combination
    table, table_recompute_on = by_combination.acts, group.table_recompute_on
    op_tokens, recompute_on, seq_chunks, static = group.op_tokens, group.recompute_on, group.seq_chunks, group.static
    precision, profile, mtp_kind = batch.precision, options.profile, model.mtp_mlp_kind
    tp, etp, n, patterns = group.tp, batch.etp.astype(float), len(batch), len(shape.reps)
    on_stage, dense_layers, moe_per_stage = shape.on_stage, shape.dense, shape.moe_per_stage
    first_stage, last_stage = on_stage[:, 0], on_stage[:, -1]
    output_held, per_b_virtual = held.output_held, held.per_b_virtual
    full_recompute, mtp_limited = held.full_recompute, held.mtp_limited
    has_moe = moe_per_stage > 0
    has_dense = (on_stage @ dense_layers) > 0
    # Per strategy for a stage with MoE layers and for one without; each stage takes its own.
    # Recompute rebuilds, beside what a layer keeps, the rest of its activations: full − kept of
    # the layer's own kind, the largest over the kinds the stage holds.
    loss_per_token = op_tokens * by_combination.rows(table.output_transient)
    # Column by column (see _outer_sum), once per combination of the kinds a stage holds.
    layer_by_kinds: dict[tuple[bool, bool], np.ndarray] = {}
    last_layer_by_kinds: dict[tuple[bool, bool], np.ndarray] = {}
    scores_moments: dict[tuple[bool, bool, bool, bool], ScoresMoments] = {}
    layer_transient = np.empty((n, patterns), order="F")
    scores_during, scores_grads = (np.empty((n, patterns), order="F"), np.empty((n, patterns), order="F")) if group.scores else (None, None)
    transient = np.empty((n, patterns), order="F")
    for column, (moe_here, dense_here, first, last) in enumerate(
            zip(has_moe.tolist(), has_dense.tolist(), first_stage.tolist(), last_stage.tolist(), strict=True)):
        layer = layer_by_kinds.get((moe_here, dense_here))
        if layer is None:
            per_token = layer_working_set(table, table_recompute_on, moe_here, dense_here)
            layer_by_kinds[moe_here, dense_here], last_layer_by_kinds[moe_here, dense_here] = (
                op_tokens * by_combination.rows(values) for values in per_token)
            layer = layer_by_kinds[moe_here, dense_here]
        last_layer = last_layer_by_kinds[moe_here, dense_here]
        if scores_during is None or scores_grads is None:
            layer_transient[:, column] = last_layer
            transient[:, column] = np.maximum(layer, loss_per_token * last)
            continue
        moment = scores_moments.get((moe_here, dense_here, first, last))
        if moment is None:
            moment = scores_moments[moe_here, dense_here, first, last] = scores_backward_moments(
                by_combination.taken, {k: static.at(v) for k, v in static.mlp_grads.items()}, op_tokens,
                _per_op(output_held, seq_chunks),
                recompute_on,
                static.at(static.head_grad_bytes),
                kinds=tuple(k for k, here in (("dense", dense_here), ("moe", moe_here)) if here), last=last,
                table_grad=static.at(static.table_made_last) * first)
        scores_during[:, column], scores_grads[:, column] = moment.during, moment.grads_made
        layer_transient[:, column] = np.maximum(last_layer, moment.at_end)
        transient[:, column] = np.maximum(np.maximum(layer, moment.during), loss_per_token * last)
    # From the second micro-batch on, the embedding's backward makes a whole new gradient of the
    # table (the scatter of token gradients is dense) and adds it to the kept one; by then that
    # micro-batch's first-chunk activations are gone. FSDP gradients are new each micro-batch
    # and priced with its unit buffers.
    accumulates = (batch.micro_batches_per_step > 1) & (batch.zero < 3)
    if profile.grads_created_in_backward and model.is_moe:
        # Likewise the fused experts' new gate_up gradient (one tensor for all local experts)
        # exists beside the kept one until it is added, with the output gradient it is computed
        # from; on the last stage that micro-batch's loss activations are freed by then (a dense
        # layer's: below). Megatron fuses the accumulation into its main-grad buffer.
        local_experts = model.num_experts / np.maximum(batch.ep, 1)
        # (The output gradient is the rank's routed tokens' through experts 1/etp wide: k·2f/tp per
        # token where each rank routes its own tokens, as the profiles' expert_width shard:
        # expert_weight_grad_working's gradient.)
        # Under full recompute (a whole backward, not a split one's W, whose rebuilt copies
        # weight_grad_step prices) the rebuilt expert inputs and outputs are still there, as in
        # FSDP's expert moment (expert_weight_grad_working): measured on fake tensors, Mixtral's
        # last stage under GPipe, 470 MiB of the rebuilt layer beside the new gradient (-1.62%
        # without them). (Selective recompute's measured rows read over without them already.)
        output_gradient = op_tokens * by_combination.rows(_expert_working_per_token(group, rebuilt=False))
        if not split and full_recompute.any():
            with_rebuilt = op_tokens * by_combination.rows(_expert_working_per_token(group, rebuilt=True))
            output_gradient = np.where(full_recompute, with_rebuilt, output_gradient)
        expert_gradient = (
            2 * local_experts * model.moe_ffn_hidden_size * model.hidden_size / etp * precision.param_bytes
            + output_gradient
        )
        loss_freed = _per_op(output_held, seq_chunks)
        # Column by column (see _outer_sum): the same values, in passes over the strategies, once
        # per value of ``last``. (A stage without MoE layers makes none: its transient, >= +0,
        # stays as it is.)
        new_gradients: dict[int, np.ndarray] = {}
        for column, (moe_here, last) in enumerate(zip(has_moe.tolist(), last_stage.tolist(), strict=True)):
            if moe_here:
                new_gradient = new_gradients.get(last)
                if new_gradient is None:
                    new_gradient = new_gradients[last] = np.where(accumulates, expert_gradient - loss_freed * last, 0.0)
                np.maximum(transient[:, column], new_gradient, out=transient[:, column])
    if profile.grads_created_in_backward and accumulates.any() and has_dense.any():
        # So is a dense layer's largest new weight gradient, with the activation gradients beside
        # it: more than the layer's other moments at short sequences (zero 3: FSDP's unit moments).
        dense_gradient = np.where(accumulates, dense_weight_accumulate(
            model, precision.activation_bytes, precision.param_bytes, op_tokens, tp, split), 0.0)
        for column, dense_here in enumerate(has_dense.tolist()):
            if dense_here:
                np.maximum(transient[:, column], dense_gradient, out=transient[:, column])
    # Under DTensor tensor parallelism that new gradient is the whole table, before it becomes
    # the rank's shard, with one micro-batch too (``static_state``).
    embedding_gradient = static.at(static.embedding_gradient)
    embedding_accumulate = np.maximum(embedding_gradient - _per_op(per_b_virtual[:, 0], seq_chunks), 0.0)
    # Column by column (see _outer_sum): the same values, in passes over the strategies; on the
    # first stage alone (elsewhere its 0 bytes leave the transient, >= +0, as it is).
    for column, first in enumerate(first_stage.tolist()):
        if first:
            np.maximum(transient[:, column], embedding_accumulate * first, out=transient[:, column])
    # The head's, on the last stage (a split backward makes it in the W step: weight_grad_step).
    head_gradient = static.at(static.head_gradient)
    if not split and np.any(head_gradient):
        head_moment = head_accumulate(model, precision.activation_bytes, head_gradient, op_tokens, tp,
                                      _per_op(output_held, seq_chunks))
        for column, last in enumerate(last_stage.tolist()):
            if last:
                transient[:, column] = np.maximum(transient[:, column], head_moment)
    if model.mtp_depth:
        # An MTP module checkpointed whole (full recompute, uniform) rebuilds its layer, norms and
        # eh_proj input at once in its backward, beside that layer's working set: more than one
        # decoder layer's rebuild, on the stage that holds the modules.
        mtp_rebuild = np.where(full_recompute & ~mtp_limited,
                               op_tokens * by_combination.rows(table.mtp_rebuilt + table.backward_extra[mtp_kind]), 0.0)
        for column, last in enumerate(last_stage.tolist()):
            if last:
                transient[:, column] = np.maximum(transient[:, column], mtp_rebuild)

    return _WorkingSets(transient, layer_transient, scores_during, scores_grads, embedding_gradient)



def _fsdp_request(group: _Group, held: _HeldUntilBackward, sharded_rows: np.ndarray,
                  deferred: np.ndarray) -> FsdpRequest:
    """The FSDP unit moments' arguments (``fsdp._fsdp_unit_phases``) of the group's sharded
    strategies ``sharded_rows``: their inputs per strategy."""
    model, batch, shape, by_combination = group.model, group.batch, group.shape, group.by_combination
    table, table_recompute_on = by_combination.acts, group.table_recompute_on
    op_tokens, seq_chunks, static = group.op_tokens, group.seq_chunks, group.static
    precision, chunks, vpp = batch.precision, shape.chunks, group.vpp
    grad_bytes = precision.grad_bytes
    layers_held, output_held, per_b_virtual = held.layers_held, held.output_held, held.per_b_virtual

    def pick(values: Any) -> np.ndarray:
        return np.broadcast_to(np.asarray(values, dtype=float), (len(batch),))[sharded_rows]

    def pick_static(values: Any) -> np.ndarray:  # a figure of the static state
        return np.broadcast_to(np.asarray(static.at(values, sharded_rows), dtype=float), (len(sharded_rows),))

    # The per-token inputs worked out on the sharded rows alone, from their operands' rows:
    # the same element-wise operations on the same values, over a quarter of the rows or
    # fewer (1M mixed DeepSeek-V3 strategies: ~10 passes over each group less).
    # (Per token, a figure of the combinations: worked out on those, gathered to these rows.)
    tokens_at, deferred_at = pick(op_tokens), deferred[sharded_rows]
    table_rebuilt = {kind: np.where(table_recompute_on, table.rebuilt[kind], 0.0) for kind in ("dense", "moe")}
    inputs: dict[str, Any] = dict(
        reduce_bytes=np.where(deferred_at, 0.0, float(grad_bytes)),
        units={kind: pick_static(elements) for kind, elements in static.unit_elements.items()},
        working={
            kind: tokens_at * by_combination.rows(
                np.maximum(table.backward_extra[kind], table.attention_backward[kind]) + table_rebuilt[kind],
                sharded_rows)
            for kind in ("dense", "moe")
        },
        loss_working=tokens_at * by_combination.rows(table.output_transient, sharded_rows),
        # DTensor's vocabulary-parallel embedding makes the whole [vocab, h] gradient, in the
        # activations' dtype (its output gradient's), before its shard, FSDP's units too
        # (measured on fake tensors, tp 2: tests/test_measure_step.py).
        embedding_whole_grad=np.where(
            pick(batch.tp) > 1, float(model.vocab_size * model.hidden_size * precision.activation_bytes)
            * group.options.profile.tp_accumulates_whole_embedding_grad, 0.0),
        expert_elements=pick_static(static.expert_elements),
        unit_grads={kind: pick_static(grads) for kind, grads in static.unit_grads.items()},
        expert_working=tokens_at * by_combination.rows(_expert_working_per_token(group, rebuilt=True), sharded_rows),
        # What an op frees: its micro-batch's, or under Seq1F1B its sub-sequence's, share.
        one_micro_batch=pick(_per_op(per_b_virtual[:, 0], seq_chunks)),
        one_micro_batch_layers=pick(_per_op(layers_held[:, 0], seq_chunks)),
        one_micro_batch_loss=pick(_per_op(output_held, seq_chunks)),
        kept_after_backward=deferred_at,
        # Under a deferred reduce: 2 where every unit of the stage sits beside a unit's
        # moments (never resharded after forward: gathered from the first forward on, the
        # loss's moments too, measured on fake tensors: an 8-layer Llama-3.1-8B, pp 2, its
        # last stage); else 1: the rank's other chunks, whose units stay gathered from their
        # backward to their next forward (under a V torch keeps both of a rank's chunks
        # gathered ahead; interleaved 1F1B, measured: a 4-layer Qwen2.5-7B, pp 2, vpp 2).
        kept_beside=np.where(deferred_at, np.where(batch.reshard_after_forward[sharded_rows] == 0, 2.0, 1.0), 0.0),
        kept_elements=largest_chunks(static.at(static.elements_virtual, sharded_rows), chunks, vpp)
        if vpp > ACTIVE_CHUNKS else None,
    )
    return FsdpRequest(shape.placement, shape.full_on_stage, shape.reps, precision.param_gather_bytes, inputs)


def _expert_working_per_token(group: _Group, *, rebuilt: bool) -> np.ndarray:
    """Per combination of the group (``by_combination``'s rows), bytes per token beside a MoE
    layer's new expert weight gradient (``expert_weight_grad_working``): the output gradient it is
    computed from, and with ``rebuilt`` the rebuilt expert copies where recompute is on. FSDP's
    expert moment and the accumulating runtime's both read it."""
    by_combination, table_tp = group.by_combination, group.table_tp
    etp = by_combination.batch.etp.astype(float)
    share = np.where(routes_own_tokens(by_combination.batch.sequence_parallel, table_tp), etp / table_tp, 1.0)
    rebuilt_moe = (np.where(group.table_recompute_on, by_combination.acts.rebuilt["moe"], 0.0) if rebuilt
                   else np.zeros(len(etp)))
    return expert_weight_grad_working(group.model, group.batch.precision.activation_bytes, etp, rebuilt_moe, share)


def _kept_inputs_at_end(schedule: str, pp: int, vpp: int, micro_batches: np.ndarray, shape: GroupShape,
                        kept_inputs: np.ndarray) -> np.ndarray:
    """[n, P] bytes of the input gradients a split backward leaves by a step's end: per
    pattern, its stages' largest count per chunk (``inputs_kept_at_end``) times the chunk's
    bytes per micro-batch (``kept_inputs`` [n, U])."""
    out = np.zeros((len(micro_batches), len(shape.reps)), order="F")
    for m in unique(micro_batches).tolist():
        rows = np.flatnonzero(micro_batches == m)
        counts = inputs_kept_at_end(schedule, pp, vpp, int(m))  # [pp, vpp]
        for pattern in range(len(shape.reps)):
            at = counts[shape.pattern_of == pattern].max(axis=0)
            for c in range(vpp):
                if at[c]:
                    out[rows, pattern] += at[c] * kept_inputs[rows, shape.chunks[pattern, c]]
    return out


def _placed(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """[len(rows), k] values at ``rows`` (ascending) of an [n, k] array of zeros (``values``
    itself where those are every row)."""
    if len(rows) == n:
        return values
    out = np.zeros((n, values.shape[1]))
    out[rows] = values
    return out


__all__ = ["peak_memory", "stage_memory", "static_lower_bound"]
