"""FSDP (ZeRO-3) unit moments: per stage, the worst moment of gathering, using and reduce-scattering
its units unit by unit through the forward and the backward, with what each moment frees; priced
once per distinct row of their inputs (``fsdp_moments``), for every group of one placement together.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ndplan.arrays import unique
from ndplan.placement import Placement


@dataclass(frozen=True)
class FsdpRequest:
    """A group's FSDP unit moments to price (``_fsdp_unit_phases``' arguments): its sharded
    rows' ``inputs``."""

    placement: Placement
    on_stage: np.ndarray
    stages: np.ndarray
    gather_bytes: int
    inputs: dict[str, Any]


def fsdp_moments(requests: list[FsdpRequest]) -> list[tuple[FsdpPhases, np.ndarray]]:
    """The FSDP unit moments of ``requests`` of one placement (the same ``_fsdp_unit_phases``
    arguments but the inputs), priced together: per request (the moments, and per row of its
    inputs its row of them).

    A strategy's moments are a function of its inputs alone, which the sharded rows share many
    at a time (they differ in what the moments do not read: the context-parallel kind, the
    data-parallel degree past one micro-batch, ..., and the schedule's order of operations):
    priced once per distinct row of the inputs, where that is at most half the rows."""
    first = requests[0]
    inputs = first.inputs if len(requests) == 1 else _joined([request.inputs for request in requests])
    sizes = [len(request.inputs["loss_working"]) for request in requests]
    distinct = _distinct_rows(_leaves(inputs))
    if distinct is not None and 2 * len(distinct[0]) > sum(sizes):
        distinct = None
    if distinct is not None:
        inputs = _taken(inputs, distinct[0])
    moments = _fsdp_unit_phases(first.placement, first.on_stage, first.stages, first.gather_bytes, **inputs)
    rows_of = np.arange(sum(sizes)) if distinct is None else distinct[1]
    return [(moments, rows_of[a:b]) for a, b in itertools.pairwise(np.cumsum([0, *sizes]).tolist())]


@dataclass(frozen=True)
class FsdpPhases:
    """FSDP2's unit buffers per stage [n, pp], in bytes: at the stage's worst moment, the
    buffers (``buffers``), the working set beside them (``working``) and the sharded gradients
    made by then where those are priced by moment (``grads_made``, single micro-batch); and the
    total of the last unit the backward reaches (``last_unit``)."""

    buffers: np.ndarray
    working: np.ndarray
    last_unit: np.ndarray
    grads_made: np.ndarray


class _WorstMoment:
    """Per strategy, the worst of a stage's FSDP moments (each [n]: the buffers, the working set
    beside them, and the gradients made by then, inside the buffers): the first of the largest
    totals buffers + working set, from a floor of -1 with nothing (a NaN total is never taken).

    The moments are collected and the worst picked once, by one argmax over the stacked totals,
    rather than folded in one by one (five passes per moment): a search's FSDP inputs are a few
    thousand distinct rows, where each numpy call costs its overhead more than its work. The
    first index of the largest total is the one a running "strictly larger" fold keeps."""

    def __init__(self, n: int) -> None:
        self.zero = np.zeros(n)
        self.totals, self.buffers, self.work, self.made = [np.full(n, -1.0)], [self.zero], [self.zero], [self.zero]

    def consider(self, buf: np.ndarray, wrk: np.ndarray | None = None, made: np.ndarray | None = None) -> None:
        """A moment: buffers, working set (None: none), and (inside ``buf``) gradients made by then."""
        self.totals.append(buf if wrk is None else buf + wrk)
        self.buffers.append(buf)
        self.work.append(self.zero if wrk is None else wrk)
        self.made.append(self.zero if made is None else made)

    def consider_beside(self, held: np.ndarray, buf: np.ndarray, wrk: np.ndarray | None = None,
                        made: np.ndarray | None = None) -> None:
        """A moment with ``held`` bytes of buffers more (a unit gathered throughout)."""
        self.consider(buf + held, wrk, made)

    def worst(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(buffers less the gradients made, working set, gradients made) at the worst moment."""
        totals = np.array(self.totals)  # [moments, n]
        totals[np.isnan(totals)] = -np.inf  # never the worst (as a fold by ">" never takes it)
        n = totals.shape[1]
        at = totals.argmax(axis=0) * n + np.arange(n)  # flat index of each row's worst moment
        buffers, work, made = (np.array(values).ravel().take(at) for values in (self.buffers, self.work, self.made))
        return buffers - made, work, made


def _gathered_beside(g: float, mode: np.ndarray, size: dict[str, np.ndarray], runs: list[tuple[str, int]],
                     run_chunk: list[int], cap: np.ndarray | None, index: int,
                     before_index: int | None = None) -> np.ndarray:
    """Bytes of a stage's parameters gathered beside a moment of its run ``index`` that counts
    that run's unit gathered, and the unit of run ``before_index`` where given (``index`` itself:
    a second unit of the same run), per strategy by ``mode`` (``_fsdp_unit_phases``'
    ``kept_beside``): 0 nothing; 1 every unit of the rank's other chunks (less the neighbour
    counted, where it is theirs); 2 every unit of the stage less those counted, of at most
    ``cap`` elements where torch keeps only some chunks gathered (None: all)."""
    if not mode.any():
        return np.zeros(len(mode))
    chunk_elements: dict[int, Any] = {}
    for (kind, count), v in zip(runs, run_chunk, strict=True):
        chunk_elements[v] = chunk_elements.get(v, 0.0) + count * size[kind]
    stage_elements = sum(chunk_elements.values(), np.zeros(len(mode)))
    if cap is not None:
        stage_elements = np.minimum(stage_elements, cap)
    v = run_chunk[index]
    own = size[runs[index][0]]
    others = stage_elements - chunk_elements[v]
    if before_index is not None:
        own = own + size[runs[before_index][0]]
        if run_chunk[before_index] != v:
            others = others - size[runs[before_index][0]]
    return g * np.where(mode >= 2, np.maximum(stage_elements - own, 0.0),
                        np.where(mode >= 1, np.maximum(others, 0.0), 0.0))


def _fsdp_unit_phases(
    placement: Placement, on_stage: np.ndarray, stages: np.ndarray, gather_bytes: int, reduce_bytes: np.ndarray,
    units: dict[str, np.ndarray], working: dict[str, np.ndarray], loss_working: np.ndarray,
    expert_elements: np.ndarray, expert_working: np.ndarray, unit_grads: dict[str, np.ndarray],
    one_micro_batch: np.ndarray, one_micro_batch_loss: np.ndarray, one_micro_batch_layers: np.ndarray,
    kept_after_backward: np.ndarray, kept_elements: np.ndarray | None = None,
    kept_beside: np.ndarray | None = None,
    embedding_whole_grad: np.ndarray | None = None,
) -> FsdpPhases:
    """FSDP2 (torchtitan's wrapping: the embedding, each decoder layer, and [final norm, head]
    are units) holds, besides the sharded state, the buffers of at most three units at once.
    With N the unit's elements, g the gathered width (= the unsharded gradient's), r the
    reduce width, and the backward running unit k (forward order: k-1 before, k+1 after):

        compute  g·N_k (its parameters) + g·N_k-1 (prefetched) + r·N_k+1 (the last reduce
                 input, kept until the next reduce) + the layer's working set
        end      (g + g)·N_k (parameters, whole gradients) + g·N_k-1 + r·N_k+1
        reduce   (g + r)·N_k (gradients, reduce input; parameters resharded) + g·N_k-1

    A MoE layer has a fourth moment, its fused experts' gate_up weight gradient: the expert
    gradients made so far (down, then gate_up: g·E) on top of the compute buffers, beside the
    gate_up output's gradient (and under recompute the rebuilt gate_up output and expert input):
    ``expert_elements`` E and ``expert_working`` bytes.

    The head unit is not resharded after forward: its all-gather (2g·N: buffer and copy) comes
    with every activation held, the loss runs beside g·N, and its reduce keeps the parameters:
    (2g + r)·N. Each stage takes its worst moment over its units (measured on fake-tensor
    FSDP2 steps: MoE layers next to smaller units were over-estimated by the largest-unit rule).
    ``reduce_bytes`` is 0 where a pipeline defers the reduce to the end of the step: then no
    reduce input lives beside a backward (the unsharded gradients are priced as gradients), and
    (``kept_after_backward``) every unit stays gathered from its backward to its next forward,
    or, where torch keeps only some chunks gathered (``kept_elements`` [n, stages]: the elements of
    the largest three), those.

    Beside a unit's moments, what else of the stage is gathered then (``kept_beside``, per
    strategy 0: nothing priced; 1: the units of the rank's other chunks, gathered from their
    backward on and not resharded until their REDUCE_GRAD or next forward; 2: every unit of the
    stage but those the moment counts, never resharded after forward). Under a V schedule the
    first stage holds the embedding's chunk and the head's: the loss's backward runs with the
    whole embedding chunk gathered beside the head (measured, ZB-V: 2.36 GiB of llama-3.1-8b's
    gathered parameters at the head's backward, not the head's 0.98 GiB alone).

    The embedding's backward may make the whole table's gradient before its unit's shard of it
    (DTensor's vocabulary-parallel embedding: ``embedding_whole_grad`` bytes, 0 where not): it
    sits beside that unit's gradients, reduce input and reduce output (its sharded gradient),
    (g + r)·N_k.

    The embedding's moments come at the end of a micro-batch's backward or the start of its
    forward, when that micro-batch's first-chunk activations (``one_micro_batch`` bytes) are not
    held: they are credited against its buffers; so are, in the first layer's moments, the
    activations of the chunk's other layers (``one_micro_batch_layers`` bytes for them all), and
    in every layer's moments on the last stage, that micro-batch's loss activations
    (``one_micro_batch_loss``), freed by the loss's backward.

    With one micro-batch, the sharded gradients of the units after k exist at k's moments
    (``unit_grads``: a unit's sharded gradient bytes, its experts at their own shard width; 0
    where gradients are priced otherwise).

    A tied table on a stage that holds both ends (``units["tied"]`` elements, 0 otherwise) is one
    unit with the final norm and the head (torchtitan and accelerate group the three; PyTorch
    refuses a shared parameter in two units): gathered from the embedding's forward to its
    backward, it sits beside every layer's and the head's moments (g·N_tied), and the head's
    moments count its own elements (the norm) besides.

    The arrays returned have one column per stage in ``stages`` (``on_stage`` [pp, pp·vpp]).
    """
    n = len(loss_working)
    columns = len(stages)
    kinds = ("embedding", "dense", "moe", "head")
    zero = np.zeros(n)
    size = {k: np.broadcast_to(units[k], (n,)).astype(float) for k in kinds}
    tied = np.broadcast_to(units.get("tied", 0.0), (n,)).astype(float)
    size[""] = zero
    expert = np.broadcast_to(expert_elements, (n,)).astype(float)
    grads_of = {k: np.broadcast_to(unit_grads[k], (n,)).astype(float) for k in kinds}
    buffers = np.zeros((n, columns), order="F")
    work = np.zeros((n, columns), order="F")
    last_unit = np.zeros((n, columns), order="F")
    grads_made = np.zeros((n, columns), order="F")
    first_chunk_layers = max(float(placement.dense_layers[0] + placement.moe_layers[0]), 1.0)
    g, r = float(gather_bytes), np.broadcast_to(np.asarray(reduce_bytes, dtype=float), (n,))
    priced: dict[tuple[Any, ...], int] = {}  # signature -> a column priced with it
    for column, s in enumerate(stages.tolist()):
        # The stage's units in forward order, as runs of one kind: [(kind, count)].
        runs: list[tuple[str, int]] = [("embedding", 1)] if placement.stage_of[0] == s else []
        run_chunk: list[int] = [0] if runs else []
        for v in np.flatnonzero(on_stage[s]):
            here = [(k, int(c)) for k, c in (("dense", placement.dense_layers[v]), ("moe", placement.moe_layers[v])) if c]
            runs += here
            run_chunk += [int(v)] * len(here)
        if placement.stage_of[-1] == s:
            runs.append(("head", 1))
            run_chunk.append(len(placement.stage_of) - 1)
        # Stages with the same units (and the same role: the last one frees the loss) have the
        # same moments: the interior stages of a uniform placement are priced once.
        # (and the same chunks: which runs share one)
        signature = (tuple(runs), placement.stage_of[-1] == s,
                     tuple(a == b for a, b in zip(run_chunk, run_chunk[1:], strict=False)))
        if signature in priced:
            same = priced[signature]
            for array in (buffers, work, grads_made, last_unit):
                array[:, column] = array[:, same]
            continue
        priced[signature] = column
        moments = _WorstMoment(n)
        consider_alone = moments.consider
        holds_tied_table = bool(runs) and runs[0][0] == "embedding" and runs[-1][0] == "head"
        consider = partial(moments.consider_beside, g * tied) if holds_tied_table else consider_alone
        # What else of the stage is gathered beside a moment (``_gathered_beside``).
        beside = partial(_gathered_beside, g, zero if kept_beside is None else np.broadcast_to(kept_beside, (n,)),
                         size, runs, run_chunk, None if kept_elements is None else kept_elements[:, column])

        later = zero.copy()  # elements of the units after the current run, forward order
        later_grads = zero.copy()  # and their sharded gradients' bytes
        for index in range(len(runs) - 1, -1, -1):
            kind, count = runs[index]
            previous = runs[index - 1][0] if index else ""
            following = runs[index + 1][0] if index + 1 < len(runs) else ""
            n_k = size[kind]
            if kind == "head":
                kept = beside(index)
                consider(2 * g * n_k + kept)  # its all-gather, every activation held
                consider(g * n_k + kept, loss_working)  # the loss beside the gathered head
                consider((2 * g + r) * n_k + g * size[previous] + (beside(index, index - 1) if index else kept))
            elif kind == "embedding":
                # Whatever follows has made its gradients (single micro-batch: sharded by now).
                made = later_grads
                kept = beside(index)
                whole = zero if embedding_whole_grad is None else np.broadcast_to(embedding_whole_grad, (n,))
                # (with the whole table, its reduce-scatter's output too: the unit's sharded gradient)
                whole = np.where(whole > 0, whole + grads_of[kind], 0.0)
                for buf in (g * n_k + r * size[following], 2 * g * n_k + r * size[following], (g + r) * n_k + whole):
                    moment = np.maximum(buf + kept + made - one_micro_batch, 0.0)
                    consider_alone(moment, None, np.minimum(made, moment))  # a tied table is its n_k
            else:
                # Three positions cover a run: its last unit (first in backward), a middle one
                # and its first, each with its neighbours and the units after it (and the
                # run whose unit is the neighbour before: None for its own).
                grads_k = grads_of[kind]
                before_run = index - 1 if index else None
                positions = [(kind if count > 1 else previous, following, later_grads,
                              index if count > 1 else before_run)]
                if count > 2:
                    positions.append((kind, kind, later_grads + grads_k, index))
                if count > 1:
                    positions.append((previous, kind, later_grads + (count - 1) * grads_k, before_run))
                for before_kind, after_kind, made, before_at in positions:
                    before, after = size[before_kind], size[after_kind]
                    credit = one_micro_batch_loss if placement.stage_of[-1] == s else zero
                    if before_kind == "embedding":
                        # The first layer's backward comes after the rest of its chunk's
                        # backward has freed those layers' activations of that micro-batch.
                        credit = credit + one_micro_batch_layers * (1.0 - 1.0 / first_chunk_layers)
                    if before_at == index:  # a unit of its own run: counted as such
                        kept = beside(index, index)
                    else:
                        kept = beside(index, before_at) if before_at is not None else beside(index)
                    base = g * before + r * after + made - credit + kept
                    consider(g * n_k + base, working.get(kind, zero), made)
                    if kind == "moe":
                        moment = np.maximum(g * (n_k + expert) + base, 0.0)
                        consider(moment, expert_working, np.minimum(made, moment))
                    moment = np.maximum(2 * g * n_k + base, 0.0)
                    consider(moment, None, np.minimum(made, moment))
                    moment = np.maximum((g + r) * n_k + g * before + made - credit + kept, 0.0)
                    consider(moment, None, np.minimum(made, moment))
            later = later + count * n_k
            later_grads = later_grads + count * grads_of[kind]
        if runs:
            # Deferred reduce: after a backward the stage's units stay gathered until their next
            # forward, which all-gathers the first unit again.
            first = runs[0][0]
            if kept_after_backward.any():
                kept = later if kept_elements is None else np.minimum(later, kept_elements[:, column])
                counted = g * (kept + size[first]) - one_micro_batch * (first == "embedding")
                # (a tied table is the first unit's, counted there)
                consider_alone(np.maximum(np.where(kept_after_backward, counted, 0.0), 0.0))
            else:
                consider_alone(zero)  # nothing kept: the moment is empty
        buffers[:, column], work[:, column], grads_made[:, column] = moments.worst()
        if runs:
            first, count = runs[0]
            after = size[first] if count > 1 else size[runs[1][0]] if len(runs) > 1 else zero
            last_unit[:, column] = np.maximum((g + r) * size[first], 2 * g * size[first] + r * after)
    return FsdpPhases(buffers=buffers, working=work, last_unit=last_unit, grads_made=grads_made)


def _leaves(values: Any) -> list[np.ndarray]:
    """The arrays in ``values`` (nested dicts of arrays, or None), columns of 2-D ones apart."""
    if values is None:
        return []
    if isinstance(values, dict):
        return [leaf for value in values.values() for leaf in _leaves(value)]
    return [values] if values.ndim == 1 else list(values.T)


def _taken(values: Any, rows: np.ndarray) -> Any:
    """``values`` (as ``_leaves`` reads them) at ``rows``."""
    if values is None:
        return None
    if isinstance(values, dict):
        return {name: _taken(value, rows) for name, value in values.items()}
    return values[rows]


def _joined(values: list[Any]) -> Any:
    """``values`` (alike nested dicts of arrays, or None) joined row after row."""
    if values[0] is None:
        return None
    if isinstance(values[0], dict):
        return {name: _joined([value[name] for value in values]) for name in values[0]}
    return np.concatenate(values)


def _distinct_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """The distinct rows of ``columns`` ([n] arrays, bit for bit): (a row of each, and per row
    the index of its own), or None where there are no columns or the hash that finds them
    collides.

    Each row's bits are hashed into one 64-bit word (a polynomial in a large odd number, mod
    2^64), the words' distinct values found by one sort of n, and every column is checked to
    equal its representative's, bit for bit: a collision gives None, never a wrong answer.
    Any row of a kind represents it (they are alike bit for bit): the sort need not be stable,
    which the first of each would need (np.unique's return_index: a search's FSDP inputs,
    ~200k rows, sorted stably in 17-21 ms, unstably in 6-7 ms)."""
    if not columns:
        return None
    words = [np.ascontiguousarray(column).view(np.uint64) if column.dtype.itemsize == 8
             else np.ascontiguousarray(column, dtype=np.uint64) for column in columns]
    digest = words[0].copy()
    for word in words[1:]:
        digest *= np.uint64(0x9E3779B97F4A7C15)
        digest += word
    distinct, inverse = unique(digest, return_inverse=True)
    inverse = inverse.ravel()
    first = np.empty(len(distinct), dtype=np.int64)
    first[inverse] = np.arange(len(inverse))  # (the last row of each kind)
    representative = first.take(inverse)
    for word in words:
        if not (word.take(representative) == word).all():
            return None
    return first, inverse
