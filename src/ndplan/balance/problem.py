"""The balancing problem in plain numbers, independent of how the costs were estimated.

A model is a sequence of decoder layers, each of a kind (dense, moe). Every layer is placed on
one virtual stage (contiguous runs, every virtual stage non-empty) and runs one recompute option.
For each (kind, option) we know, per micro-batch: the time of forward + backward (recompute
included), the activation bytes held until its backward, and the layer's static bytes. The first
virtual stage also holds the embedding, the last the output head, loss and MTP modules.

Memory of a physical stage s (bytes):
    fixed[s] + Σ_{layers on s} static + Σ_{chunks c of s} peak_in_flight[s, c] · Σ_{layers in c} activation
             + [any layer on s recomputes] · recompute_transient[s]
             + Σ_{options r run on s} recompute_option_bytes[r][s]
             + Σ_{layers on s recomputing under option r} recompute_layer_bytes[r][s]
             + max(0, max_{chunks c of s} Σ_{layers in c} recompute_chunk_bytes[kind, option][s, c]
                      − recompute_chunk_offset[s])
and, at the optimizer step (activations gone; parameters, gradients, states and the update's
temporaries held), step_fixed[s] + Σ_{layers on s} step_layer_bytes[kind]: a stage fits when
both are under the limit, and its peak is the larger. The step's bytes move with the layers
only, so they bound how many layers a stage may hold whatever its recompute. The estimator
takes the peak over time of the chunks' weighted sum (``InFlight.peak_weighted``; chunks peak
at different instants); ``peak_in_flight`` is one weight per chunk that stands for it
(``build.chunk_weights``): prefix peaks of the in-flight table in the order the solvers fill
chunks (fewest first), so that bytes falling along that order weigh at or over the max over
time, and exactly it where the chunks hold the same; under a split backward, what a layer keeps
from B until W is priced per layer at the stage's peak rows (``held_until_w_bytes``).
Calibrated at uniform placement (``fixed``), that is exact there. Each chunk weighed by its own
peak read a stage that gave up layers low (8 + 4 micro-batches on stage 1 of interleaved pp4
vpp2, which holds 9 at once): on stage totals within three layers a chunk of uniform, filled as
the solvers fill them, one setting, Llama-3.1-8B tp2 pp4 interleaved vpp2 −32.2% then, −0.5%
now; ZB-H1 under PyTorch −10.9…+40.9% then, −2.1…+3.9% now
(``tests/test_balance_placement_memory.py``). The peak is convex in a stage's layers (a max
of linear functions of them over time), so a line through the uniform placement still reads
a little low where the peak's row moves (docs/balance.md). Step time (seconds), with v chunks
per stage (v = vpp) and
T_s = Σ_{chunks of s} Σ_{layers} time:

    step = (m − 1/v) · max_s T_s + (1/v) · Σ_s T_s

For v = 1 this is the 1F1B composition Σ_s T_s + (m − 1)·max_s T_s. With interleaving, the
bottleneck stage works m·T_max and the warm-up and cool-down pass every other stage once per
chunk, a 1/v of its time each. That holds when a stage's chunks take about the same time:
a plan that piles a stage's layers into one chunk stalls the interleaved order (simulated:
twice the step of the even plan on Llama-70B pp4 vpp5), which no linear composition sees.
So every solver keeps a stage's chunks within one layer's time of each other
(``even_chunks``): loads weigh each layer by its kind's seconds (``layer_units``) and count the
embedding and the head (with MTP) as the layers their seconds equal (``end_units``).
DeepSeek-V3's head and MTP weigh two MoE layers and a dense layer a third of one; a last chunk
holding the head besides its share of layers, or a first chunk of cheap dense layers next to
heavier ones, made plans' simulated steps 12–18% longer than composed. Recompute options are
dealt evenly over a stage's chunks for the same reason (``chunks.dealt_chunks``).
Over random chunk times within ±50% of each other the formula is within −4…+6% of
``ndplan.schedule.simulate`` on interleaved 1F1B (median +1–2%) and +2…+8% on ZB-V;
``benchmarks/bench_balance.py`` prints the check for the plans it finds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

#: Of the limit, kept free at the optimizer step by the solvers against rounding (80 bytes of
#: 80 GB), so that ``evaluate``'s own float sums never land just over it.
STEP_MARGIN = 1e-9


@dataclass(frozen=True)
class LayerCost:
    """One layer of one kind under one recompute option, per micro-batch."""

    time_s: float
    activation_bytes: float
    static_bytes: float


@dataclass(frozen=True)
class BalanceProblem:
    layer_kinds: tuple[str, ...]
    options: tuple[str, ...]
    costs: dict[tuple[str, str], LayerCost]  # (kind, option) -> cost
    stage_of: np.ndarray  # [virtual stages] physical stage of each virtual stage
    chunk_of: np.ndarray  # [virtual stages] local chunk index on its stage
    peak_in_flight: np.ndarray  # [pp, vpp] micro-batches of each chunk held at the stage's peak
    num_micro_batches: int
    first_extra: LayerCost  # embedding, on virtual stage 0
    last_extra: LayerCost  # final norm, head, loss, MTP, on the last virtual stage
    fixed_bytes: np.ndarray  # [pp] buffers, transients and overhead that do not move with layers
    memory_limit_bytes: float
    recompute_transient_bytes: np.ndarray | None = None  # [pp] added once where any layer recomputes
    #: option -> [pp] bytes added once on stage s where at least one of its layers runs that
    #: option, besides ``recompute_transient_bytes``: with it, the rebuilt working set of the
    #: options present (``build.recompute_terms``). None: nothing.
    recompute_option_bytes: dict[str, np.ndarray] | None = None
    #: option -> [pp] bytes each layer recomputing under that option adds on stage s besides its
    #: own static and activation bytes (what recompute rebuilds, and under a split backward the
    #: weight-gradient step's rebuilt copies, grow with the layers a stage recomputes). None: nothing.
    recompute_layer_bytes: dict[str, np.ndarray] | None = None
    #: (kind, option) -> [pp] bytes each such layer on stage s holds besides its static bytes and
    #: its chunk's in-flight activations: under a split backward, what it keeps from its input
    #: gradient (B) until its weight gradient (W), times the micro-batches held so at the stage's
    #: peak (``build.chunk_weights``). None: nothing.
    held_until_w_bytes: dict[tuple[str, str], np.ndarray] | None = None
    #: (kind, option) -> [pp, v] bytes each such layer in local chunk c of stage s adds to that
    #: chunk's sum; stage s holds max(0, its largest chunk sum − ``recompute_chunk_offset[s]``)
    #: once: under PyTorch's split backward, the rebuilt copies a chunk's weight-gradient step
    #: keeps per fully recomputed layer, which raise the stage's peak once they outgrow what the
    #: step's instant holds below it (``build.chunk_copy_terms``). Non-negative; several chunks
    #: per stage only (with one, the largest is the sum: ``recompute_layer_bytes``). None: nothing.
    recompute_chunk_bytes: dict[tuple[str, str], np.ndarray] | None = None
    recompute_chunk_offset: np.ndarray | None = None  # [pp] (None: zeros)

    def __post_init__(self) -> None:
        if self.recompute_chunk_bytes is not None and self.chunks_per_stage == 1:
            raise ValueError("recompute_chunk_bytes needs several chunks per stage; with one, a chunk's "
                             "bytes per layer are recompute_layer_bytes")
    #: The optimizer step's peak of stage s: step_fixed_bytes[s] (the embedding and head
    #: included, as they never move) + Σ_{layers on s} step_layer_bytes[kind]. None: not priced
    #: (problems built by hand), the step never binds.
    step_fixed_bytes: np.ndarray | None = None  # [pp]
    step_layer_bytes: dict[str, float] | None = None  # kind -> bytes

    def layer_extra(self, kinds: Sequence[str], options: Sequence[str] | None = None) -> np.ndarray:
        """[pp, G, R] bytes a layer of each of ``kinds`` under each of ``options`` (default the
        problem's) adds on each stage besides its ``LayerCost`` bytes (``recompute_layer_bytes``;
        zeros without). Every solver adds it to its per-layer bytes, as ``evaluate`` does."""
        options = self.options if options is None else options
        out = np.zeros((self.pp, len(kinds), len(options)))
        for r, option in enumerate(options):
            if self.recompute_layer_bytes is not None and option in self.recompute_layer_bytes:
                out[:, :, r] = np.asarray(self.recompute_layer_bytes[option], dtype=float)[:, None]
            if self.held_until_w_bytes is not None:
                for g, kind in enumerate(kinds):
                    if (kind, option) in self.held_until_w_bytes:
                        out[:, g, r] += np.asarray(self.held_until_w_bytes[kind, option], dtype=float)
        return out

    def chunk_bytes(self, kinds: Sequence[str], options: Sequence[str] | None = None) -> np.ndarray:
        """[pp, v, G, R] ``recompute_chunk_bytes`` of a layer of each of ``kinds`` under each of
        ``options`` (default the problem's) in each local chunk of each stage; zeros without."""
        options = self.options if options is None else options
        out = np.zeros((self.pp, self.chunks_per_stage, len(kinds), len(options)))
        if self.recompute_chunk_bytes is not None:
            for g, kind in enumerate(kinds):
                for r, option in enumerate(options):
                    if (kind, option) in self.recompute_chunk_bytes:
                        out[:, :, g, r] = np.asarray(self.recompute_chunk_bytes[kind, option], dtype=float)
        return out

    @property
    def chunk_offset(self) -> np.ndarray:
        """[pp] ``recompute_chunk_offset`` (zeros without)."""
        return (np.zeros(self.pp) if self.recompute_chunk_offset is None
                else np.asarray(self.recompute_chunk_offset, dtype=float))

    def chunk_term(self, largest: np.ndarray, stage: np.ndarray | slice | None = None) -> np.ndarray:
        """What stages hold for their largest chunk sums ``largest`` [..., S] (``stage``: the
        stages along the last axis, default every one): max(0, largest − offset)."""
        offset = self.chunk_offset if stage is None else self.chunk_offset[stage]
        return np.maximum(largest - offset, 0.0)

    @property
    def has_chunk_terms(self) -> bool:
        """Whether a stage's largest chunk sum (``recompute_chunk_bytes``) can be anything but
        zero: the solvers price it where it is."""
        return self.recompute_chunk_bytes is not None and any(
            np.any(np.asarray(b, dtype=float) != 0) for b in self.recompute_chunk_bytes.values())

    def recompute_transient(self, stage: int) -> float:
        return 0.0 if self.recompute_transient_bytes is None else float(self.recompute_transient_bytes[stage])

    def option_charges(self, options: Sequence[str] | None = None) -> np.ndarray:
        """[pp, R] bytes each of ``options`` (default the problem's) adds once on a stage where
        some layer runs it (``recompute_option_bytes``; zeros without, and for "none")."""
        options = self.options if options is None else options
        out = np.zeros((self.pp, len(options)))
        for r, option in enumerate(options):
            if self.recompute_option_bytes is not None and option in self.recompute_option_bytes and option != "none":
                out[:, r] = np.asarray(self.recompute_option_bytes[option], dtype=float)
        return out

    def recompute_charge(self, stage: int, present: Sequence[bool]) -> float:
        """Bytes stage ``stage`` holds once for its recompute, given whether each of the
        problem's options is ``present`` on it: the transient where any recomputes, and each
        present option's own bytes (``option_charges``)."""
        flags = [bool(p) and option != "none" for p, option in zip(present, self.options, strict=True)]
        if not any(flags):
            return 0.0
        return self.recompute_transient(stage) + float(self.option_charges()[stage] @ np.array(flags, dtype=float))

    @property
    def has_option_charges(self) -> bool:
        """Whether ``option_charges`` can be anything but zeros."""
        return self.recompute_option_bytes is not None and any(
            np.any(np.asarray(b, dtype=float) != 0) for o, b in self.recompute_option_bytes.items() if o != "none")

    def step_room(self, margin: float = STEP_MARGIN) -> np.ndarray | None:
        """[pp] bytes a stage's layers may hold at the optimizer step: the limit (less a hair,
        ``margin`` of it, against rounding) less the step's fixed bytes; None where not priced."""
        if self.step_fixed_bytes is None or self.step_layer_bytes is None:
            return None
        return self.memory_limit_bytes * (1 - margin) - np.asarray(self.step_fixed_bytes, dtype=float)

    def step_bytes_of(self, kinds: Sequence[str]) -> np.ndarray:
        """[G] each kind's bytes per layer at the optimizer step (zeros where not priced)."""
        table = self.step_layer_bytes or {}
        return np.array([float(table.get(kind, 0.0)) for kind in kinds])

    def step_fits(self, stage: np.ndarray, held: np.ndarray, kinds: Sequence[str]) -> np.ndarray | None:
        """[Q] whether stage ``stage[q]`` holding ``held[q]`` [G] layers of each of ``kinds``
        fits at the optimizer step; None where the step is not priced (everything fits)."""
        room = self.step_room()
        if room is None:
            return None
        return np.asarray(held, dtype=float) @ self.step_bytes_of(kinds) <= room[stage]

    @property
    def has_layer_extra(self) -> bool:
        """Whether ``layer_extra`` can be anything but zeros."""
        return self.recompute_layer_bytes is not None or self.held_until_w_bytes is not None

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def num_virtual_stages(self) -> int:
        return int(self.stage_of.shape[0])

    @property
    def pp(self) -> int:
        return int(self.peak_in_flight.shape[0])

    @property
    def chunks_per_stage(self) -> int:
        """v: virtual stages per physical stage (vpp; 2 on V schedules)."""
        return self.num_virtual_stages // self.pp

    def in_flight_of_virtual(self) -> np.ndarray:
        return self.peak_in_flight[self.stage_of, self.chunk_of]


@dataclass(frozen=True)
class Plan:
    """Layers per virtual stage (model order) and each layer's recompute option."""

    stage_layers: tuple[int, ...]
    recompute: tuple[str, ...]  # per layer, model order

    def ranges(self) -> list[tuple[int, int, str]]:
        """(first layer, count, option) runs, as frameworks take recompute settings."""
        runs: list[tuple[int, int, str]] = []
        for layer, option in enumerate(self.recompute):
            if runs and runs[-1][2] == option and runs[-1][0] + runs[-1][1] == layer:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, option)
            else:
                runs.append((layer, 1, option))
        return runs


@dataclass(frozen=True)
class PlanCost:
    stage_memory_bytes: np.ndarray  # [pp]
    stage_time_s: np.ndarray  # [pp] per micro-batch, forward + backward
    step_s: float  # composed from the stage times (module docstring)
    fits: bool


def evaluate(problem: BalanceProblem, plan: Plan) -> PlanCost:
    """Memory per stage and the composed step time of a plan, by the formulas of the docstring.

    Vectorised over layers: a lookup of each layer's (kind, option) cost, then sums per
    physical stage (``np.bincount``), so that it is cheap enough to score every candidate.
    """
    if sum(plan.stage_layers) != problem.num_layers or len(plan.recompute) != problem.num_layers:
        raise ValueError(f"plan places {sum(plan.stage_layers)} layers with {len(plan.recompute)} recompute options; "
                         f"the model has {problem.num_layers}")
    index = cost_index(problem)
    codes = [index[pair] for pair in zip(problem.layer_kinds, plan.recompute, strict=True)]
    return evaluate_codes(problem, plan.stage_layers, cost_columns(problem), np.array(codes))


def cost_index(problem: BalanceProblem) -> dict[tuple[str, str], int]:
    """Each (kind, option)'s position in ``problem.costs``: the code ``evaluate_codes`` takes."""
    return {pair: i for i, pair in enumerate(problem.costs)}


def cost_columns(problem: BalanceProblem) -> np.ndarray:
    """[4, (kind, option)] seconds, static bytes, activation bytes and whether it recomputes, of
    each entry of ``problem.costs`` in its order (the codes ``evaluate_codes`` takes)."""
    return np.array([[c.time_s for c in problem.costs.values()], [c.static_bytes for c in problem.costs.values()],
                     [c.activation_bytes for c in problem.costs.values()],
                     [option != "none" for _, option in problem.costs]], dtype=float)


def extra_columns(problem: BalanceProblem) -> np.ndarray | None:
    """[pp, (kind, option)] ``BalanceProblem.layer_extra`` of each entry of ``problem.costs`` in
    its order (the codes ``evaluate_codes`` takes); None where the problem has none."""
    if not problem.has_layer_extra:
        return None
    pairs = list(problem.costs)
    kinds = tuple(dict.fromkeys(kind for kind, _ in pairs))
    options = tuple(dict.fromkeys(option for _, option in pairs))
    table = problem.layer_extra(kinds, options)  # [pp, kinds, options]
    return table[:, [kinds.index(kind) for kind, _ in pairs], [options.index(option) for _, option in pairs]]


class EvaluationConstants(NamedTuple):
    """What ``evaluate_codes`` takes from the problem whatever the plan: [V] each virtual stage's
    physical stage and micro-batches in flight, [pp] the fixed bytes, (stage, bytes, seconds)
    of the embedding and of the head, in that order, and the optimizer step's terms."""

    stage_of: np.ndarray
    flight: np.ndarray
    fixed: np.ndarray
    extras: tuple[tuple[int, float, float], ...]
    step_fixed: np.ndarray | None = None  # [pp] the optimizer step's fixed bytes (None: not priced)
    step_layer: np.ndarray | None = None  # [L] each layer's bytes at the optimizer step
    extra: np.ndarray | None = None  # [pp, (kind, option)] ``extra_columns``
    charges: tuple[np.ndarray, np.ndarray] | None = None  # ``charge_columns``
    chunk: np.ndarray | None = None  # [V, (kind, option)] ``chunk_columns``


def evaluation_constants(problem: BalanceProblem) -> EvaluationConstants:
    """``EvaluationConstants`` of a problem, for callers that evaluate many plans of it."""
    V = problem.num_virtual_stages
    flight = problem.in_flight_of_virtual().astype(float)  # [V]
    extras = tuple((int(problem.stage_of[v]), extra.static_bytes + flight[v] * extra.activation_bytes, extra.time_s)
                   for v, extra in ((0, problem.first_extra), (V - 1, problem.last_extra)))
    step_fixed = step_layer = None
    if problem.step_fixed_bytes is not None and problem.step_layer_bytes is not None:
        step_fixed = np.asarray(problem.step_fixed_bytes, dtype=float)
        step_layer = np.array([problem.step_layer_bytes[kind] for kind in problem.layer_kinds], dtype=float)
    return EvaluationConstants(np.asarray(problem.stage_of), flight, problem.fixed_bytes.astype(float), extras,
                               step_fixed, step_layer, extra_columns(problem), charge_columns(problem),
                               chunk_columns(problem))


def chunk_columns(problem: BalanceProblem) -> np.ndarray | None:
    """[V, (kind, option)] ``BalanceProblem.chunk_bytes`` of each entry of ``problem.costs`` in
    its order on each virtual stage (its stage's local chunk); None where the problem has no
    chunk terms (``has_chunk_terms``)."""
    if not problem.has_chunk_terms:
        return None
    pairs = list(problem.costs)
    kinds = tuple(dict.fromkeys(kind for kind, _ in pairs))
    options = tuple(dict.fromkeys(option for _, option in pairs))
    table = problem.chunk_bytes(kinds, options)  # [pp, v, kinds, options]
    per_virtual = table[problem.stage_of, problem.chunk_of]  # [V, kinds, options]
    return per_virtual[:, [kinds.index(kind) for kind, _ in pairs], [options.index(option) for _, option in pairs]]



def charge_columns(problem: BalanceProblem) -> tuple[np.ndarray, np.ndarray] | None:
    """[pp, O] ``BalanceProblem.option_charges`` of the options of ``problem.costs`` in their
    order, and [(kind, option)] each entry's option among them (the codes ``evaluate_codes``
    takes): a stage pays an option's bytes once, whatever kinds run it. None where the problem
    has none."""
    if not problem.has_option_charges:
        return None
    pairs = list(problem.costs)
    options = tuple(dict.fromkeys(option for _, option in pairs))
    return problem.option_charges(options), np.array([options.index(option) for _, option in pairs])


def evaluate_codes(problem: BalanceProblem, stage_layers: tuple[int, ...] | np.ndarray, columns: np.ndarray,
                   codes: np.ndarray, constants: EvaluationConstants | None = None) -> PlanCost:
    """``evaluate`` of a plan given as layers per virtual stage (an array where the caller has
    one, which spares converting a tuple) and each layer's entry of
    ``problem.costs`` (its index in that order, ``cost_columns``' columns), the form solvers
    hold plans in (``constants``: ``evaluation_constants``, where the caller has them).
    ``evaluate_codes_many`` does the same for N plans; a batch of one through it costs ~15 µs
    more, a tenth of the heuristic's per-call budget, so this stays its own pass."""
    pp, V = problem.pp, problem.num_virtual_stages
    constants = constants if constants is not None else evaluation_constants(problem)
    virtual = np.arange(V).repeat(stage_layers)  # virtual stage of each layer
    stage = constants.stage_of[virtual]
    seconds, static, activation, recomputing = columns[:, codes]  # [L] each
    held = static + constants.flight[virtual] * activation
    if constants.extra is not None:
        held = held + constants.extra[stage, codes]
    memory = constants.fixed + np.bincount(stage, weights=held, minlength=pp)
    time = np.bincount(stage, weights=seconds, minlength=pp)
    for s, extra_bytes, extra_s in constants.extras:  # the embedding's, then the head's
        memory[s] += extra_bytes
        time[s] += extra_s
    if problem.recompute_transient_bytes is not None:
        recomputes = np.bincount(stage, weights=recomputing, minlength=pp) > 0
        np.add(memory, problem.recompute_transient_bytes, out=memory, where=recomputes)
    if constants.charges is not None:  # each option's bytes, once on a stage where it runs
        table, option_of = constants.charges
        present = np.zeros(table.shape, dtype=bool)
        present[stage, option_of[codes]] = True
        memory = memory + (present * table).sum(axis=1)
    if constants.chunk is not None:  # the largest chunk sum of each stage, once
        per_virtual = np.bincount(virtual, weights=constants.chunk[virtual, codes], minlength=V)
        largest = np.zeros(pp)
        np.maximum.at(largest, constants.stage_of, per_virtual)
        memory = memory + problem.chunk_term(largest)
    if constants.step_fixed is not None:  # the optimizer step's peak, where it is the larger
        np.maximum(memory, constants.step_fixed + np.bincount(stage, weights=constants.step_layer, minlength=pp),
                   out=memory)
    return PlanCost(memory, time, composed_step_s(problem, time), bool((memory <= problem.memory_limit_bytes).all()))


def evaluate_codes_many(problem: BalanceProblem, stage_layers: tuple[int, ...], columns: np.ndarray,
                        codes: np.ndarray, constants: EvaluationConstants | None = None) -> list[PlanCost]:
    """``evaluate_codes`` of N plans with the same layers per virtual stage, ``codes`` [N, L]:
    one pass for all of them (the uniform placement under each option). Each plan's sums are
    those ``evaluate_codes`` takes alone: its layers in order into its own (plan, stage) bins,
    then the embedding's and the head's terms one after the other."""
    pp, V = problem.pp, problem.num_virtual_stages
    constants = constants if constants is not None else evaluation_constants(problem)
    N = len(codes)
    virtual = np.arange(V).repeat(stage_layers)  # virtual stage of each layer
    bins = (pp * np.arange(N)[:, None] + constants.stage_of[virtual]).reshape(-1)  # [N·L]
    seconds, static, activation, recomputing = columns[:, codes]  # [N, L] each
    layer_bytes = static + constants.flight[virtual] * activation
    if constants.extra is not None:
        layer_bytes = layer_bytes + constants.extra[constants.stage_of[virtual][None, :], codes]
    held = np.bincount(bins, weights=layer_bytes.reshape(-1), minlength=N * pp)
    memory: np.ndarray = constants.fixed + held.reshape(N, pp)
    time: np.ndarray = np.bincount(bins, weights=seconds.reshape(-1), minlength=N * pp).reshape(N, pp)
    for s, extra_bytes, extra_s in constants.extras:  # the embedding's, then the head's
        memory[:, s] += extra_bytes
        time[:, s] += extra_s
    if problem.recompute_transient_bytes is not None:
        recomputes = np.bincount(bins, weights=recomputing.reshape(-1), minlength=N * pp).reshape(N, pp) > 0
        np.add(memory, problem.recompute_transient_bytes, out=memory, where=recomputes)
    if constants.charges is not None:  # each option's bytes, once on a stage where it runs
        table, option_of = constants.charges
        present = np.zeros((N * pp, table.shape[1]), dtype=bool)
        present[bins, option_of[codes.reshape(-1)]] = True
        memory = memory + (present.reshape(N, pp, -1) * table[None]).sum(axis=2)
    if constants.chunk is not None:  # the largest chunk sum of each stage, once
        chunk_bins = (V * np.arange(N)[:, None] + virtual[None, :]).reshape(-1)
        per_virtual = np.bincount(chunk_bins, weights=constants.chunk[virtual[None, :], codes].reshape(-1),
                                  minlength=N * V).reshape(N, V)
        largest = np.zeros((N, pp))
        np.maximum.at(largest, (np.arange(N)[:, None], constants.stage_of[None, :]), per_virtual)
        memory = memory + problem.chunk_term(largest)
    if constants.step_fixed is not None:  # the same placement for all: one step peak
        step = constants.step_fixed + np.bincount(constants.stage_of[virtual], weights=constants.step_layer, minlength=pp)
        np.maximum(memory, step, out=memory)
    fits = np.logical_and.reduce(memory <= problem.memory_limit_bytes, axis=1).tolist()
    steps = composed_steps_s(problem, time).tolist()
    return [PlanCost(memory[n], time[n], steps[n], bool(fits[n])) for n in range(N)]


def stage_bases(problem: BalanceProblem, constants: EvaluationConstants | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stage [pp], what does not move with its layers: bytes (fixed, plus the embedding and
    head with their chunks' in-flight counts), seconds per micro-batch (the embedding and head),
    and the recompute transient (zero where the problem has none). ``constants``:
    ``evaluation_constants``, where the caller has them (they hold the embedding's and head's
    terms)."""
    constants = constants if constants is not None else evaluation_constants(problem)
    bytes_ = constants.fixed.copy()
    seconds = np.zeros(problem.pp)
    for s, extra_bytes, extra_s in constants.extras:  # the embedding's, then the head's
        bytes_[s] += extra_bytes
        seconds[s] += extra_s
    transient = (np.zeros(problem.pp) if problem.recompute_transient_bytes is None
                 else np.asarray(problem.recompute_transient_bytes, dtype=float))
    return bytes_, seconds, transient


def step_never_binds(problem: BalanceProblem) -> bool:
    """The optimizer step's peak stays at or under the forward/backward one for every plan, so
    the solvers may leave it out: each layer holds at least its step bytes through the
    forward/backward under any option (its static bytes and its activations at the fewest
    micro-batches any chunk holds), and each stage's fixed step bytes are at most its fixed
    forward/backward bytes with the embedding and head. Megatron's update keeps no temporaries,
    so there it never binds."""
    if problem.step_fixed_bytes is None or problem.step_layer_bytes is None:
        return True
    fewest = float(np.asarray(problem.peak_in_flight).min())
    for kind in set(problem.layer_kinds):
        extra = problem.layer_extra([kind]).min(axis=0)[0]  # [R] the least any stage adds
        held = min(problem.costs[(kind, option)].static_bytes + fewest * problem.costs[(kind, option)].activation_bytes
                   + float(extra[r]) for r, option in enumerate(problem.options))
        if problem.step_layer_bytes[kind] > held:
            return False
    return bool((np.asarray(problem.step_fixed_bytes, dtype=float) <= stage_bases(problem)[0]).all())


def composed_step_s(problem: BalanceProblem, stage_time_s: np.ndarray) -> float:
    """(m − 1/v)·max_s T_s + (1/v)·Σ_s T_s seconds (module docstring), T_s per micro-batch."""
    v = problem.chunks_per_stage
    return float((problem.num_micro_batches - 1 / v) * stage_time_s.max() + stage_time_s.sum() / v)


def composed_steps_s(problem: BalanceProblem, stage_time_s: np.ndarray) -> np.ndarray:
    """``composed_step_s`` of N plans at once, ``stage_time_s`` [N, pp]: [N] seconds, each the
    same float (a row's max and sum are the 1-D ones: the same pairwise sum per row)."""
    v = problem.chunks_per_stage
    return (problem.num_micro_batches - 1 / v) * stage_time_s.max(axis=1) + stage_time_s.sum(axis=1) / v


def simulated_step_s(problem: BalanceProblem, plan: Plan, schedule: str) -> float:
    """The plan's step in seconds by ``ndplan.schedule.simulate`` instead of the composition:
    each chunk's seconds per micro-batch (its layers under their options, and the embedding or
    head it holds) split 1 : 2 into forward and backward, or 1 : 1 : 1 into forward, input and
    weight gradients where the schedule splits the backward. A check of ``composed_step_s``.
    DualPipeV's overlapped forward and backward run one after the other (``overlap_f_and_b``
    off, as the step-time model simulates them, ``ndplan.perf.pipeline``): compute cannot hide
    compute. With them overlapped as max(F, B+W), Llama-3.1-8B tp2 pp4 DualPipeV (m 64)
    simulated 2.329 s for a plan whose busiest stage computes 3.34 s."""
    from ndplan.schedule import SPLIT_BACKWARD, simulate

    seconds = np.zeros((problem.pp, problem.chunks_per_stage))
    layer = 0
    for virtual, count in enumerate(plan.stage_layers):
        held = sum(problem.costs[(kind, option)].time_s for kind, option in
                   zip(problem.layer_kinds[layer:layer + count], plan.recompute[layer:layer + count], strict=True))
        held += problem.first_extra.time_s if virtual == 0 else 0.0
        held += problem.last_extra.time_s if virtual == problem.num_virtual_stages - 1 else 0.0
        seconds[problem.stage_of[virtual], problem.chunk_of[virtual]] = held
        layer += count
    split = schedule in SPLIT_BACKWARD
    result = simulate(schedule, problem.pp, problem.chunks_per_stage, problem.num_micro_batches,
                      forward_s=seconds / 3, backward_s=seconds / 3 if split else 2 * seconds / 3,
                      weight_grad_s=seconds / 3 if split else 0 * seconds, overlap_f_and_b=False)
    return float(result.makespan_s)


def _reference_seconds(problem: BalanceProblem) -> float:
    """Seconds of a layer of the most numerous kind without recompute: the unit of loads."""
    kind = max(set(problem.layer_kinds), key=lambda k: (problem.layer_kinds.count(k), k))
    option = "none" if "none" in problem.options else problem.options[0]
    return problem.costs[(kind, option)].time_s


def end_units(problem: BalanceProblem, layer_s: float | None = None) -> np.ndarray:
    """[V] layer equivalents each virtual stage holds besides its layers: the embedding's seconds
    on the first and the head's (final norm, output layer, loss, MTP) on the last, over a
    reference layer's (``_reference_seconds``; ``layer_s``, where the caller has them), rounded.
    Zero elsewhere, and everywhere with one chunk per stage (nothing to even out)."""
    units = np.zeros(problem.num_virtual_stages, dtype=np.int64)
    layer_s = layer_s if layer_s is not None else _reference_seconds(problem)
    if problem.chunks_per_stage == 1 or layer_s <= 0:
        return units
    units[0] += round(problem.first_extra.time_s / layer_s)
    units[-1] += round(problem.last_extra.time_s / layer_s)
    return units


def layer_units(problem: BalanceProblem, layer_s: float | None = None) -> dict[str, float]:
    """Per layer kind, its seconds without recompute over the reference layer's: a dense layer
    of DeepSeek-V3 weighs 0.37 of a MoE one (``layer_s``: ``_reference_seconds``, where the
    caller has them, as it takes as much as the rest)."""
    layer_s = layer_s if layer_s is not None else _reference_seconds(problem)
    option = "none" if "none" in problem.options else problem.options[0]
    return {kind: (problem.costs[(kind, option)].time_s / layer_s if layer_s > 0 else 1.0)
            for kind in set(problem.layer_kinds)}


def chunk_loads(problem: BalanceProblem, stage_layers: tuple[int, ...] | np.ndarray,
                weights: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[pp, v] each chunk's load: its layers weighed by ``layer_units`` plus its ``end_units``
    (``weights``: those two from ``load_weights``, for callers that load many placements)."""
    per_layer, ends = weights if weights is not None else load_weights(problem)
    virtual = np.arange(problem.num_virtual_stages).repeat(stage_layers)
    held = np.bincount(virtual, weights=per_layer, minlength=problem.num_virtual_stages) + ends
    loads = np.zeros((problem.pp, problem.chunks_per_stage))
    loads[problem.stage_of, problem.chunk_of] = held
    return loads


def load_weights(problem: BalanceProblem, units: dict[str, float] | None = None, layer_s: float | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """[L] each layer's ``layer_units`` (``units`` where the caller has them) and [V] each
    virtual stage's ``end_units`` (``layer_s``: ``_reference_seconds``, where the caller has
    them): what ``chunk_loads`` weighs, the same for every placement."""
    layer_s = layer_s if layer_s is not None else _reference_seconds(problem)
    units = units if units is not None else layer_units(problem, layer_s)
    return np.array([units[kind] for kind in problem.layer_kinds]), end_units(problem, layer_s)


def load_spread(problem: BalanceProblem, units: dict[str, float] | None = None) -> float:
    """How far a stage's chunk loads may lie apart: one layer of the heaviest kind (at least one
    reference layer), the least that every stage total can meet (``units``: ``layer_units``,
    where the caller has them)."""
    return max(1.0, *(units if units is not None else layer_units(problem)).values())


def even_chunks(problem: BalanceProblem, stage_layers: tuple[int, ...] | np.ndarray) -> bool:
    """Every stage's chunks carry loads (``chunk_loads``) within ``load_spread`` of each other,
    but for a chunk of a single layer, which cannot carry less (module docstring)."""
    counts = np.zeros((problem.pp, problem.chunks_per_stage), dtype=np.int64)
    counts[problem.stage_of, problem.chunk_of] = stage_layers
    if len(set(problem.layer_kinds)) == 1:
        # One kind: a layer weighs its kind's seconds over the reference layer's, its own, so
        # exactly 1, and the spread is 1. The loads are its layers plus the ends' units, the same
        # floats as weighing every layer (a sum of ones is exact), at a fraction of the cost.
        loads = counts.astype(float)
        loads[problem.stage_of, problem.chunk_of] += end_units(problem)
        spread = 1.0
    else:
        layer_s = _reference_seconds(problem)  # the unit, once for the layers' and the ends' loads
        units = layer_units(problem, layer_s)  # weighed once for the loads and their spread
        loads = chunk_loads(problem, stage_layers, load_weights(problem, units, layer_s))
        spread = load_spread(problem, units)
    too_heavy = loads > loads.min(axis=1, keepdims=True) + spread + 1e-9
    return bool((~too_heavy | (counts == 1)).all())


def window_binds(problem: BalanceProblem, plan: Plan, low: int, high: int) -> bool:
    """Whether a heuristic's window of stage totals ``low`` … ``high`` (layers per physical
    stage) may have cut off a faster plan than ``plan``, the best inside it: the plan recomputes
    somewhere (memory binds) and some stage's total sits at an edge of the window. A stage at
    the low edge may want fewer layers so as to recompute less, one at the high edge more so
    that others recompute less; inside the window neither is possible. Llama-3.1-70B tp8 pp4
    ZB-V at 60.2 GiB: the window 18–22 forced stage 0 (which holds the most micro-batches) to 18
    layers with full recompute, 9.59 s composed, where 17 layers and no recompute anywhere take
    4.58 s. The solvers widen their window while this holds (``heuristic_windows``)."""
    if all(option == "none" for option in plan.recompute):
        return False
    totals = np.bincount(np.asarray(problem.stage_of), weights=np.asarray(plan.stage_layers, dtype=float),
                         minlength=problem.pp)
    return bool(((totals <= low) | (totals >= high)).any())


def heuristic_windows(window: int) -> list[int]:
    """The windows a heuristic tries in turn while ``window_binds``: doubling from ``window``,
    up to 8 times it (beyond that the exact search is as cheap)."""
    return [window * 2**k for k in range(4)]


def uniform_plan(problem: BalanceProblem, option: str) -> Plan:
    """Layers spread evenly (remainder to the first virtual stages), one recompute option for all."""
    return Plan(uniform_counts(problem), (option,) * problem.num_layers)


def uniform_counts(problem: BalanceProblem) -> tuple[int, ...]:
    """``uniform_plan``'s layers per virtual stage."""
    V = problem.num_virtual_stages
    base, extra = divmod(problem.num_layers, V)
    return (base + 1,) * extra + (base,) * (V - extra)  # tuples repeated: no loop over the stages
