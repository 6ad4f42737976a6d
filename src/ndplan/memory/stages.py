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
    device(s)      = allocated · (1 + allocator slack) + runtime context + communicator buffers

Strategies are grouped by their pipeline shape (schedule, pp, vpp, micro-batches), for which the
placement and the schedule simulation are computed once; everything else is numpy over the group.
"""

from __future__ import annotations

import itertools
import numbers
import operator
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, fields, replace
from functools import cached_property, lru_cache, partial, reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

from ndplan.arrays import gathered, unique
from ndplan.census.record import CensusRecord, Recompute
from ndplan.errors import NdplanError
from ndplan.memory.overhead import RuntimeOverhead, overhead_model
from ndplan.memory.profile import (
    SHARDS,
    BlockBytes,
    RuntimeProfile,
    block_coefficients,
    get_profile,
    model_symbols,
)
from ndplan.memory.static import (
    embedding_elements,
    layer_elements,
    linear_weight_elements,
    mtp_extra_elements,
    mtp_extra_linear_elements,
    sharding_factors,
)
from ndplan.model.params import weight_grad_groups, weight_grad_peak_group
from ndplan.model.spec import MlpKind, ModelSpec
from ndplan.placement import Placement, place_layers
from ndplan.schedule import SPLIT_BACKWARD, V_SHAPE, in_flight
from ndplan.schedule.unshard import ACTIVE_CHUNKS
from ndplan.strategy.batch import CODES, StrategyBatch, dense_codes, distinct_columns, radix_key
from ndplan.strategy.strategy import OFFLOAD_MODULES, RECOMPUTE_MODULES
from ndplan.units import memory_limit

if TYPE_CHECKING:
    from ndplan.perf.overlap import OverlapConfig

Attention = Literal["flash", "sdpa", "eager"]
#: Megatron-Core's token dispatchers (``--moe-token-dispatcher-type``) as memory and time price
#: them: 'alltoall' (also what the flex dispatcher, DeepEP/HybridEP, is priced as; its network
#: copies follow ``OverlapConfig.ep_dispatch``) and 'allgather' (Megatron's default).
MoeDispatcher = Literal["alltoall", "allgather"]
#: What torch.compile compiles (torchtitan's ``[compile] components``): nothing, the decoder
#: layers, the layers and the loss, or the loss alone.
TorchCompile = Literal["off", "model", "model+loss", "loss"]
CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "transient")
STATIC_KINDS = ("embedding", "attention", "norm", "mlp", "moe", "output", "mtp")
#: ``pipeline``: the stage inputs and outputs a pipeline runtime keeps per micro-batch until its
#: backward (torch.distributed.pipelining), beside its layers' saved tensors.
ACTIVATION_KINDS = ("embedding", "attention", "norm", "mlp", "moe", "recompute", "output", "mtp", "pipeline")


#: Strategies with the same values of these fields share a placement and a schedule simulation.
PIPELINE_SHAPE = ("schedule", "pp", "vpp", "seq_chunks", "embedding_as_layer", "output_as_layer")
#: The fields of a strategy that the static state (parameters, gradients, optimizer states) and
#: the runtime overhead read, and with them ``static_lower_bound`` (a test perturbs the others).
STATIC_FIELDS = (
    *PIPELINE_SHAPE, "tp", "cp", "dp", "ep", "etp", "zero", "shard_group", "optimizer_offload", "num_micro_batches",
    "pipeline_runs",
)
#: What the static state reads of STATIC_FIELDS: all but the micro-batch counts, of which it reads
#: only whether a step runs more than one (``_static_state``: the embedding gradient a DTensor
#: runtime makes whole from the second micro-batch on, the gradients accumulated, the FSDP units'
#: gradients counted with a single one), ``several_micro_batches``. Its tables are priced per
#: combination of these (``_SharedStatic``; 1M mixed DeepSeek-V3 strategies: 25,824 priced,
#: against 102,188 of STATIC_FIELDS).
STATE_FIELDS = (*(name for name in STATIC_FIELDS if name not in ("num_micro_batches", "pipeline_runs")),
                "several_micro_batches")


def _state_columns(batch: StrategyBatch) -> list[np.ndarray]:
    """The columns of STATE_FIELDS (``several_micro_batches``: micro-batches per step > 1)."""
    return [batch.micro_batches_per_step > 1 if name == "several_micro_batches" else getattr(batch, name)
            for name in STATE_FIELDS]


#: The fields of a strategy that no figure of the memory model reads: FSDP is priced as the
#: ZeRO-3 that a valid strategy with ``fsdp`` has, a hybrid context-parallel group's buffers by
#: its kind, and the global batch is dp · micro-batch size · micro-batches per step. Strategies
#: that differ only in these are priced once (``_alike``; a test perturbs them).
UNREAD_FIELDS = ("fsdp", "ulysses_degree", "global_batch_size")


#: Most routed tokens on a rank, or in an expert's buffer, over the balanced share that
#: ``moe_imbalance`` and ``moe_capacity_factor`` may give: past every model's num_experts/top-k
#: (all tokens on one expert: 384/8 = 48 for Kimi K2), and small enough that no byte count
#: overflows.
MAX_MOE_FACTOR = 1024.0


def _is_number(value: object) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class MemoryOptions:
    """How the runtime behaves: its saved-tensor profile, attention kernel, loss, overhead.

    ``moe_imbalance`` scales the routed-expert tokens of the busiest rank (1.0: balanced routing;
    dropless MoE under real routing needs headroom, e.g. 1.2). ``moe_capacity_factor`` prices a
    token-dropping MoE instead: every expert's buffer holds capacity_factor × its balanced share
    of tokens (padded when fewer come, dropped beyond), so routed-expert bytes are exactly that
    multiple whatever the routing. ``census`` replaces the profile's formulas for the layer kinds
    it measured. ``loss_upcast`` off: the loss works on the logits' own dtype (NeMo AutoModel's
    MaskedCrossEntropy(fp32_upcast=False); Megatron with Transformer Engine's cross-entropy,
    which writes the gradient into the logits) instead of an fp32 copy. ``overlap`` says which
    communication the runtime hides; the memory model does not read it, the step-time model and
    the balancer do (None: the device runtime's defaults, ``ndplan.perf.overlap.default_overlap``),
    so the options a command builds carry it to both. ``grouped_gemm`` off: the experts run one
    GEMM each (Megatron's SequentialMLP, without --moe-grouped-gemm), so the profile's
    ``expert_workspace_bytes`` (a grouped GEMM's own workspaces) are not held.
    ``selective_policy`` says what selective recompute keeps where the runtime can run more than
    its own policy (None: the profile's): 'torchtitan-op' is torchtitan's per-op checkpointing
    (every second matmul rebuilt), for the pytorch profile; memory and step time both follow it.
    ``moe_dispatcher`` is Megatron-Core's token dispatcher (``--moe-token-dispatcher-type``):
    'alltoall' (what ``--emit megatron`` writes and the search prices; the flex dispatcher too,
    with ``overlap.ep_dispatch`` node_dedup) or 'allgather' (Megatron's default where a launch
    states none): MoEAllGatherTokenDispatcher gathers every token of the expert-TP x EP group
    into a persistent buffer, keeps the gathered routing probabilities and mask for backward,
    and returns the experts' output by a reduce-scatter in the probabilities' fp32
    (``allgather_dispatch_bytes``, the profile's ``moe_allgather`` block); only for runtimes
    whose profile states that block (megatron).
    ``torch_compile`` says what torch.compile fuses, for the step time alone (the memory
    priced is the eager modules'): 'model' runs each decoder layer's elementwise ops as fused
    kernels (one pass over their bytes) and leaves the final norm and loss at the runtime's eager
    figure; 'model+loss' fuses those too, 'loss' those alone; 'off' prices the runtime's own kernels.
    """

    runtime: str = "pytorch"
    attention: Attention = "flash"
    loss_parallel: bool | None = None
    include_overhead: bool = True
    moe_imbalance: float = 1.0
    moe_capacity_factor: float | None = None
    loss_upcast: bool = True
    census: tuple[CensusRecord, ...] = field(default=())
    overlap: OverlapConfig | None = None
    grouped_gemm: bool = True
    selective_policy: str | None = None
    moe_dispatcher: MoeDispatcher = "alltoall"
    torch_compile: TorchCompile = "off"

    def __post_init__(self) -> None:
        if not isinstance(self.runtime, str):
            raise NdplanError(f"runtime must be a runtime's name or a profile YAML's path, got {self.runtime!r}")
        for name in ("include_overhead", "loss_upcast", "grouped_gemm", "loss_parallel"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)) and not (value is None and name == "loss_parallel"):
                also = " (or None: the runtime's choice)" if name == "loss_parallel" else ""
                raise NdplanError(f"{name} must be True or False{also}, got {value!r}")
        if isinstance(self.census, (str, Path)):  # a census file's path, as the CLI's --census takes
            from ndplan.census.record import load_census_file

            object.__setattr__(self, "census", tuple(load_census_file(self.census)))
        elif isinstance(self.census, list):
            object.__setattr__(self, "census", tuple(self.census))
        wrong = [r for r in self.census if not isinstance(r, CensusRecord)] \
            if isinstance(self.census, tuple) else [self.census]
        if wrong:
            raise NdplanError("census must be census records (ndplan.census) or a census file's path, "
                              f"got {type(wrong[0]).__name__} {wrong[0]!r:.60}")
        if self.attention not in get_args(Attention):
            raise NdplanError(f"attention must be one of {', '.join(get_args(Attention))}, got {self.attention!r}")
        get_profile(self.runtime)  # an unknown runtime is an error here, not at first use
        # (comparisons that NaN fails, and a bound: 1e300 overflowed the byte counts to inf)
        if not _is_number(self.moe_imbalance) or not 1.0 <= self.moe_imbalance <= MAX_MOE_FACTOR:
            raise NdplanError(f"moe_imbalance must be a finite number >= 1.0 and <= {MAX_MOE_FACTOR:g} (busiest rank over "
                              f"balanced routing), got {self.moe_imbalance!r}")
        if self.moe_capacity_factor is not None and (
                not _is_number(self.moe_capacity_factor) or not 0 < self.moe_capacity_factor <= MAX_MOE_FACTOR):
            raise NdplanError(f"moe_capacity_factor must be a finite number > 0 and <= {MAX_MOE_FACTOR:g}, "
                              f"got {self.moe_capacity_factor!r}")
        if self.moe_dispatcher not in get_args(MoeDispatcher):
            raise NdplanError(f"moe_dispatcher must be one of {', '.join(get_args(MoeDispatcher))}, "
                              f"got {self.moe_dispatcher!r}")
        if self.torch_compile not in get_args(TorchCompile):
            raise NdplanError(f"torch_compile must be one of {', '.join(get_args(TorchCompile))}, "
                              f"got {self.torch_compile!r}")
        if self.moe_dispatcher == "allgather" and "moe_allgather" not in self.profile.blocks:
            raise NdplanError(f"moe_dispatcher 'allgather' is Megatron-Core's MoEAllGatherTokenDispatcher; runtime "
                              f"'{self.runtime}' states no such dispatcher (use runtime megatron)")
        if self.moe_dispatcher == "allgather" and self.overlap is not None and self.overlap.ep_dispatch == "node_dedup":
            raise NdplanError("moe_dispatcher 'allgather' gathers every token of the expert group; overlap "
                              "ep_dispatch=node_dedup is the flex dispatcher's (DeepEP, HybridEP): give one or the other")
        allowed = self.profile.selective_policies or (self.profile.selective_policy,)
        if self.selective_policy is not None and self.selective_policy not in allowed:
            raise NdplanError(f"selective_policy {self.selective_policy!r} is not one runtime '{self.runtime}' prices; "
                              f"allowed: {', '.join(allowed)}")
        if self.census and self.selective_policy not in (None, self.profile.selective_policy):
            raise NdplanError(f"a census measures the runtime's own selective recompute "
                              f"({self.profile.selective_policy}), not {self.selective_policy}: leave out one or the other")

    @property
    def recompute_policy(self) -> str:
        """What selective recompute keeps: ``selective_policy``, else the runtime's own."""
        return self.selective_policy or self.profile.selective_policy

    @property
    def routed_token_factor(self) -> float:
        """Routed-expert tokens on a rank relative to balanced routing."""
        return self.moe_capacity_factor if self.moe_capacity_factor is not None else self.moe_imbalance

    @property
    def profile(self) -> RuntimeProfile:
        return get_profile(self.runtime)

    def time_keywords(self) -> dict[str, Any]:
        """What the step-time model (``ndplan.perf.step.evaluate`` and the functions over it)
        needs of this runtime, so that time prices what memory assumes: its rebuilds per
        parameter group in a split backward's W, what its selective recompute re-runs, whether
        its attention kernel is flash (``attention``), and what it hides."""
        software: dict[str, Any] = {"selective_recompute": self.recompute_policy,
                                    "flash_attention": self.attention != "eager",  # SDPA runs a flash kernel
                                    # ... but a sliding window reaches transformers' SDPA as a mask
                                    # (where the runtime prices that mask's memory: sdpa_masked)
                                    "window_kernel": not (self.attention == "sdpa"
                                                          and "sdpa_masked" in self.profile.blocks)}
        software.update(self.profile.kernels)
        if self.torch_compile != "off":
            # A compiled part fuses its elementwise chains into one pass; the rest keeps the
            # runtime's (eager) figure.
            eager = float(software.get("elementwise_passes", 1.0))
            software["elementwise_passes"] = 1.0 if "model" in self.torch_compile else eager
            software["loss_elementwise_passes"] = 1.0 if "loss" in self.torch_compile else eager
        software["pipeline_defers_fsdp_reduce"] = self.profile.pipeline_defers_fsdp_reduce
        software["grad_buckets"] = self.profile.grad_buckets
        software["ddp_bucket_cap_mb"] = self.profile.ddp_bucket_cap_mb
        software["loss_upcast"] = self.loss_upcast
        # Whether the loss is vocabulary-parallel, or runs on logits gathered whole to every
        # tensor-parallel rank (the option, else the runtime's choice), as memory holds them.
        software["loss_parallel"] = self.profile.loss_parallel if self.loss_parallel is None else self.loss_parallel
        # The busiest rank computes and receives as much more as it holds (1.0 too: the options,
        # not a device profile's figure, say what memory priced); a capacity factor, where
        # given, sets it instead (buffers padded to capacity: routed_token_factor), in time too.
        software["moe_imbalance"] = self.moe_imbalance
        software["moe_capacity_factor"] = self.moe_capacity_factor
        software["moe_dispatcher"] = self.moe_dispatcher
        return {"weight_grad_rebuilds": self.profile.weight_grad_recomputes_per_group, "software": software,
                "overlap": self.overlap}


@dataclass
class StageMemory:
    """Arrays [strategies, max_pp] per category in bytes; stages past a strategy's pp are 0.

    ``forward_backward`` is the forward/backward peak: static + activations + comm + transient
    less what does not exist yet at that moment (gradients made by the backward, under a
    runtime that creates them there).

    ``by_kind`` (only when asked for) maps category -> kind -> [strategies, max_pp].
    """

    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    comm: np.ndarray
    transient: np.ndarray
    optimizer_step: np.ndarray
    forward_backward: np.ndarray
    allocated: np.ndarray
    reserved: np.ndarray
    device: np.ndarray
    by_kind: dict[str, dict[str, np.ndarray]] | None = None

    @property
    def overhead(self) -> np.ndarray:
        return self.device - self.allocated

    def peak(self) -> tuple[np.ndarray, np.ndarray]:
        """Per strategy: the largest device total over stages, and the stage where it is."""
        stage = np.argmax(self.device, axis=1)
        return self.device[np.arange(len(stage)), stage], stage


# --------------------------------------------------------------------------- activations
def _per_rank(block: BlockBytes, inverse: dict[str, np.ndarray], seq: np.ndarray, part: str = "base") -> np.ndarray:
    """Bytes per token of a block on one rank: Σ over shard rules of coefficient / divisor
    (``inverse`` holds 1/divisor per rule; rules with no bytes cost nothing)."""
    table, per_seq = getattr(block, part), block.seq_part(part)
    total = np.zeros_like(seq)
    for r in SHARDS:
        if table[r]:
            total = total + table[r] * inverse[r]
        if per_seq is not None and per_seq[r]:
            total = total + per_seq[r] * inverse[r] * seq
    return total


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token per rank of each layer variant (arrays over strategies)."""

    full: dict[str, np.ndarray]        # kind -> no recompute
    recomputed: dict[str, np.ndarray]  # kind -> under the strategy's recompute policy
    weight_input: dict[str, np.ndarray]
    weight_grad_outputs: dict[str, np.ndarray]
    weight_unread: dict[str, np.ndarray]
    weight_read_last: dict[str, np.ndarray]
    #: kind -> what ops past the layer's weights save (the router's probabilities, the experts'
    #: weighting: no weight gradient's path runs through them; part of weight_unread)
    weight_past: dict[str, np.ndarray]
    #: A layer that recomputes nothing, by block, for the breakdown by kind: 'attention', 'norm'
    #: (both norms) and 'mlp' of a dense layer, 'attention', 'norm' and 'moe' of a MoE one. They
    #: sum to ``full``: net of what offload moves, and scaled to the measured layer where a census
    #: replaced the formulas (a census measures whole layers).
    dense_blocks: dict[str, np.ndarray]
    moe_blocks: dict[str, np.ndarray]
    #: what the embedding keeps beside the token ids (the profile's ``embedding`` block)
    embedding: np.ndarray
    output: np.ndarray
    output_transient: np.ndarray
    backward_extra: dict[str, np.ndarray]  # kind -> one layer's backward working set
    #: kind -> the attention backward's working set beyond what is saved, where the scores are
    #: materialised (eager, the SDPA math path; 0 elsewhere)
    attention_backward: dict[str, np.ndarray]
    mtp_extra: np.ndarray
    #: One MTP module under full recompute of every layer (Megatron's uniform method), which
    #: checkpoints the module whole: its two inputs, what the embedding keeps, the head and loss.
    mtp_checkpointed: np.ndarray
    #: What that checkpoint rebuilds in the module's backward (its layer whole, its norms and
    #: eh_proj's input): the module less what it keeps.
    mtp_rebuilt: np.ndarray
    #: kind -> what recompute rebuilds on the device in backward (full − recomputed before offload)
    rebuilt: dict[str, np.ndarray]
    #: kind -> what activation offload moves to the host per layer (``full``/``recomputed`` are net of it)
    offloaded: dict[str, np.ndarray]

    def take(self, index: np.ndarray | slice) -> LayerActivations:
        """The same figures for a subset of the strategies (read-only). A figure of one value
        for every strategy is that value broadcast, not gathered: a search's are a few dozen
        combinations (``ACTIVATION_FIELDS``), taken for thousands of strategies each, and a third
        of the figures do not vary over them. The figures by layer kind are gathered when first
        read (``_TakenByKind``): a group's device total reads about half of them (the blocks, the
        offloaded bytes and, without a split backward, the weight-gradient figures not at all)."""
        n = self.output.shape[0]
        taken = len(range(n)[index]) if isinstance(index, slice) else len(index)
        values: dict[str, Any] = {}
        for (name, key), value in self._figures.items():
            if key is None:
                values[name] = np.broadcast_to(value[:1], (taken,)) if (name, key) in self._one_valued else value[index]
            elif name not in values:
                values[name] = _TakenByKind(self, name, index, taken)
        return LayerActivations(**values)

    @cached_property
    def _figures(self) -> dict[tuple[str, str | None], np.ndarray]:
        """Every figure as an [n] array, by (field, kind or None); taken many times, found once."""
        n = self.output.shape[0]
        out: dict[tuple[str, str | None], np.ndarray] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            for key, figure in value.items() if isinstance(value, dict) else ((None, value),):
                out[item.name, key] = np.broadcast_to(figure, (n,))
        return out

    @cached_property
    def _one_valued(self) -> frozenset[tuple[str, str | None]]:
        """The figures (``_figures``' keys) that hold one value for every strategy."""
        return frozenset(key for key, value in self._figures.items() if len(value) and _one_value(value))


class _TakenByKind(dict[str, np.ndarray]):
    """A ``LayerActivations`` figure by layer kind (``name``) at the strategies ``index``: each
    kind's array gathered (or its one value broadcast) the first time it is read, then kept."""

    def __init__(self, source: LayerActivations, name: str, index: np.ndarray | slice, taken: int) -> None:
        super().__init__()
        self._source, self._name, self._index, self._taken = source, name, index, taken
        self._kinds = tuple(getattr(source, name))

    def __missing__(self, key: str) -> np.ndarray:
        value = self._source._figures[self._name, key]  # (a KeyError for a kind it lacks)
        rows = (np.broadcast_to(value[:1], (self._taken,)) if (self._name, key) in self._source._one_valued
                else value[self._index])
        self[key] = rows
        return rows

    def _all(self) -> None:
        for key in self._kinds:
            self[key]  # noqa: B018 (gathered on first reading)

    def __iter__(self) -> Iterator[str]:
        self._all()
        return super().__iter__()

    def __len__(self) -> int:
        return len(self._kinds)

    def __contains__(self, key: object) -> bool:
        return key in self._kinds

    def keys(self) -> Any:
        self._all()
        return super().keys()

    def values(self) -> Any:
        self._all()
        return super().values()

    def items(self) -> Any:
        self._all()
        return super().items()

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self._kinds else default

    def copy(self) -> dict[str, np.ndarray]:
        # (dict's own copy reads the stored entries alone: every kind is gathered first)
        self._all()
        return dict(super().items())


def _one_value(values: np.ndarray) -> bool:
    """Whether every element of ``values`` (not empty) is the first, bit for bit (0.0 and -0.0
    differ: one stands for the other in no result)."""
    # The last element and every 997th before it first: one of them unlike the first answers for
    # the whole (a search's varying fields mostly show it there), at a thousandth of the passes.
    return _like_first(values[::-997], values[:1]) and _like_first(values, values[:1])


def _like_first(values: np.ndarray, first: np.ndarray) -> bool:
    """Whether every element of ``values`` is ``first``'s one, bit for bit."""
    same = values == first
    if values.dtype.kind == "f":
        same &= np.signbit(values) == np.signbit(first)
    return bool(same.all())


@dataclass(frozen=True)
class _Combinations:
    """The layer activations of a group's strategies by combination of ACTIVATION_FIELDS:
    ``acts`` and ``batch`` (those fields' columns) one row per combination, and per strategy of
    the group its combination, ``index`` (None: ``acts`` and ``batch`` are the group's own, a
    row per strategy).

    A figure made of those alone (a layer's bytes as the strategy's recompute keeps them, the
    sequence-parallel divisor, ...) is worked out on their rows, a few hundred at most, and
    gathered to the strategies by ``rows``: one pass over the group's strategies instead of one
    per operation and per figure gathered. The same operations on the same values, row by row:
    the same bits. (1M mixed DeepSeek-V3 strategies, at most 192 combinations: warm peak_memory
    0.507-0.521 -> 0.467-0.474 s, alternated with the code before, with _alike's group numbers.)"""

    acts: LayerActivations
    batch: StrategyBatch
    index: np.ndarray | None

    def recompute_on(self) -> np.ndarray:
        """Per row, whether the strategy recomputes."""
        return ~self.batch.is_("recompute", "none")

    def rows(self, values: Any, at: np.ndarray | None = None) -> np.ndarray:
        """``values`` (one per row) per strategy of the group, or of its strategies ``at``."""
        values = np.broadcast_to(values, (len(self.batch),))
        if self.index is None:
            return values if at is None else values.take(at)
        return values.take(self.index if at is None else self.index[at])

    @cached_property
    def taken(self) -> LayerActivations:
        """The layer activations per strategy of the group, taken when first read (the device
        total reads them only under a recompute limit, with materialised scores or for the
        breakdown: elsewhere ``rows`` gathers what it reads)."""
        return self.acts if self.index is None else self.acts.take(self.index)


@lru_cache(maxsize=64)
def shipped_census(model: ModelSpec) -> tuple[CensusRecord, ...]:
    """Census records measured for a preset and shipped in ``memory/census/`` (empty for other
    models, or when the spec no longer matches the preset it is named after)."""
    from importlib import resources

    from ndplan.census.record import from_json

    entry = resources.files("ndplan.memory").joinpath("census", f"{model.name}.json")
    if not entry.is_file():
        return ()
    records = from_json(entry.read_text(), source=str(entry))
    return tuple(r for r in records if r.hidden_size == model.hidden_size)


def _census_for(options: MemoryOptions, kind: str, model: ModelSpec | None = None) -> CensusRecord | None:
    """The census record of layer ``kind`` among ``options.census``; with ``model``, refused where
    it was measured on another model (its bytes per token would price the wrong layers)."""
    of_kind = [r for r in options.census if r.layer_kind == kind or r.layer_kind.endswith(f"-{kind}")]
    if model is None or not of_kind:
        return of_kind[0] if of_kind else None
    if kind in ("dense", "moe") and kind not in model.mlp_kinds:
        return None  # no layer of that kind to price (another model's record of it is no concern)
    # A file may hold several models' records (`ndplan census A B --out f.json`): this model's.
    refusals = []
    for record in of_kind:
        try:
            _check_census_model(record, model)
        except NdplanError as error:
            refusals.append(error)
            continue
        return record
    raise refusals[0]


#: The selective recompute a census measures (torch's SAC keeping every matmul's output).
CENSUS_SELECTIVE_POLICY = "keep-matmuls"

#: Bytes per element of the activation dtypes a census names.
_CENSUS_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _check_census_runtime(record: CensusRecord, batch: StrategyBatch, options: MemoryOptions) -> None:
    """Refuse a record measured with another activation width or attention kind than priced:
    its bytes per token would be the other run's (a bf16 census on fp32 activations reads half;
    an eager one keeps the s x s scores a fused kernel does not)."""
    width = _CENSUS_DTYPE_BYTES.get(record.dtype)
    if width is not None and width != batch.precision.activation_bytes:
        raise NdplanError(f"the census measured {record.dtype} activations ({width} B), and precision "
                          f"{batch.precision.name} keeps {batch.precision.activation_bytes:g} B ones: measure it in "
                          "that dtype (`python -m ndplan.census --dtype ...`) or leave out --census")
    if (record.attention == "eager") != (options.attention == "eager"):
        raise NdplanError(f"the census measured {record.attention} attention, and the estimate prices "
                          f"{options.attention}: measure with `ndplan census --attention {options.attention if options.attention != 'flash' else 'sdpa'}` "
                          "or price --attention as measured")


def _check_census_model(record: CensusRecord, model: ModelSpec) -> None:
    """Refuse a record measured on another model. Its layer architecture decides where the record
    carries one (a checkpoint folder named Meta-Llama-3.1-8B measures the llama-3.1-8b preset's
    layers); an older record without it must carry the model's name, in any case."""
    advice = f"measure this model with `ndplan census {model.name}`, or leave out --census"
    where = f"the census record of layer kind '{record.layer_kind}' was measured on {record.model}"
    if record.architecture:
        measured, priced = dict(record.architecture), dict(model.layer_architecture())
        differ = [name for name in sorted(measured.keys() | priced.keys()) if measured.get(name) != priced.get(name)]
        if differ:
            shown = ", ".join(f"{name} {measured.get(name, 'unset')} (census) vs {priced.get(name, 'unset')}"
                              for name in differ[:4])
            more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
            raise NdplanError(f"{where}, whose layers differ from {model.name}'s: {shown}{more}: {advice}")
    elif record.hidden_size != model.hidden_size or record.model.lower() != model.name.lower():
        raise NdplanError(
            f"{where} (hidden size {record.hidden_size}), not on {model.name} (hidden size {model.hidden_size}): "
            f"{advice}")


def _measured(record: CensusRecord | Recompute, tp: np.ndarray, seq: np.ndarray, measured_seq: int) -> np.ndarray:
    """Census bytes per token on a TP rank at sequence length ``seq``: the replicated part plus the
    TP-scaled part / tp, both as measured at ``measured_seq`` (the record's), moved along the
    quadratic attention term's slope when the census measured eager attention (per head, so split
    by TP too): ``CensusRecord.saved_at``, per strategy."""
    return np.asarray(
        record.saved_replicated_bytes_per_token + record.saved_tp_scaled_bytes_per_token / tp
        + record.saved_bytes_per_token_per_seq * (seq - measured_seq) / tp,
        dtype=float,
    )


#: The fields of a strategy that ``layer_activations`` reads (besides the batch's precision).
ACTIVATION_FIELDS = ("tp", "etp", "sequence_parallel", "seq_length", "recompute")


def _sdpa_fallbacks(model: ModelSpec, batch: StrategyBatch) -> dict[MlpKind, tuple[np.ndarray, np.ndarray]]:
    """Per MLP kind, per strategy: the share of its layers where transformers' SDPA runs the
    memory-efficient kernel with an explicit mask (sliding-window layers once seq >= window:
    transformers skips the mask only below the window), and the share where it runs the math path
    (fp32 with grouped KV heads and no mask). The profile's ``sdpa_masked`` and ``sdpa_math``
    blocks price what each keeps; the rest of the layers run the flash kernel. A share is the
    model's, not a stage's: exact where sliding layers are spread evenly (all, or alternating),
    not where they cluster (``known_gaps`` says so beside such a plan)."""
    fp32 = np.asarray(batch.precision.activation_bytes, dtype=float) >= 4
    grouped = model.num_kv_heads < model.num_attention_heads
    out: dict[MlpKind, tuple[np.ndarray, np.ndarray]] = {}
    kind: MlpKind
    for kind in ("dense", "moe"):
        sliding, layers = model.sliding_layers(kind)
        masked = np.where(batch.seq_length >= max(model.sliding_window, 1), sliding / max(layers, 1), 0.0)
        math = np.where(fp32 & grouped, 1.0 - masked, 0.0)
        out[kind] = (masked, math)
    return out


def _prices_sdpa_mask(model: ModelSpec, options: MemoryOptions) -> bool:
    """Whether any strategy keeps the mask of ``_sdpa_mask_bytes`` (SDPA's, for sliding layers,
    where the runtime prices it)."""
    return options.attention == "sdpa" and "sdpa_masked" in options.profile.blocks and bool(model.sliding_layers()[0])


def _sdpa_mask_bytes(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions) -> np.ndarray:
    """Bytes of the boolean mask transformers' SDPA path builds for sliding-window layers, per
    micro-batch: mbs·s² where seq >= window and the runtime prices that mask (``sdpa_masked``),
    else 0."""
    if not _prices_sdpa_mask(model, options):
        return np.zeros(len(batch))
    seq = batch.seq_length.astype(float)
    return np.where(seq >= model.sliding_window, batch.micro_batch_size * seq * seq, 0.0)


def layer_activations(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions) -> LayerActivations:
    """Bytes per token per rank of each layer variant, per strategy (a function of
    ``ACTIVATION_FIELDS`` alone)."""
    profile = options.profile
    act_bytes = batch.precision.activation_bytes
    offload = batch.offload_modules
    # The profile's op_keep flags describe a dense layer with standard attention (its matmuls in
    # Llama's order); a MoE or MLA model keeps the runtime's own flags, an upper bound (its
    # matmuls come in another order, and the experts' grouped GEMMs are not in torchtitan's list).
    policy = options.recompute_policy
    if policy == "torchtitan-op" and (model.is_moe or model.is_mla):
        policy = profile.selective_policy
    blocks = block_coefficients(model, profile, act_bytes, batch.recompute_modules, offload,
                                fp8=batch.precision.compute_dtype == "fp8", loss_upcast=options.loss_upcast,
                                selective_policy=policy, moe_dispatcher=options.moe_dispatcher)
    tp, etp = batch.tp.astype(float), batch.etp.astype(float)
    loss_parallel = profile.loss_parallel if options.loss_parallel is None else options.loss_parallel
    sequence_sharded = (batch.sequence_parallel > 0) & (tp > 1)
    # Routed tokens: each rank routes its own tokens (its sequence shard under SP; all of its own
    # without TP) and the dispatcher gathers them over the expert-TP group (Megatron's all-to-all
    # dispatcher: gather_from_sequence_parallel_region over the etp group), etp/tp of the
    # sequence's, through experts 1/etp wide. Only TP without SP routes tokens every TP rank
    # holds (tensor-parallel experts, no gather).
    own_tokens = routes_own_tokens(batch.sequence_parallel, tp)
    divisors = {
        "tp": tp,
        "sp": np.where(sequence_sharded, tp, 1.0),
        "etp": etp / options.routed_token_factor,
        "expert_tokens": np.where(own_tokens, tp / etp, 1.0) / options.routed_token_factor,
        "expert_width": np.where(own_tokens, tp, etp) / options.routed_token_factor,
        # (whatever the routing: the allgather dispatcher keeps every gathered token's row)
        "gathered": np.where(own_tokens, tp / etp, 1.0),
        "vocab": tp if loss_parallel else np.ones_like(tp),
        "none": np.ones_like(tp),
    }
    seq = batch.seq_length.astype(float)
    empty = BlockBytes(*(dict.fromkeys(SHARDS, 0.0) for _ in range(4)))

    inverse = {rule: 1.0 / np.broadcast_to(divisor, tp.shape) for rule, divisor in divisors.items()}

    def block(name: str, part: str = "base") -> np.ndarray:
        return _per_rank(blocks.get(name, empty), inverse, seq, part)

    attention_name = "attention_mla" if model.is_mla else "attention"
    norm, norm_kept = block("norm"), block("norm", "kept")
    # Per MLP kind: the kinds' layers may differ in attention span (sliding windows).
    attention = dict.fromkeys(("dense", "moe"), block(attention_name))
    attention_kept = dict.fromkeys(("dense", "moe"), block(attention_name, "kept"))
    # The attention backward's working set where the scores are materialised (s² per head), with
    # CUDA softmax's scratch where overhead is counted (fake tensors do not see it).
    attention_backward = dict.fromkeys(("dense", "moe"), 0.0 * tp)
    product = block("softmax_backward_product") if options.include_overhead else 0.0
    if options.attention == "eager":
        for k in ("dense", "moe"):
            attention[k] = attention[k] + block("eager_scores")
            attention_kept[k] = attention_kept[k] + block("eager_scores", "kept")
            attention_backward[k] = block("eager_backward_extra") + product
    if options.attention == "sdpa":
        for k, (masked, math) in _sdpa_fallbacks(model, batch).items():
            attention[k] = attention[k] + masked * block("sdpa_masked") + math * block("sdpa_math")
            attention_kept[k] = (attention_kept[k] + masked * block("sdpa_masked", "kept")
                                 + math * block("sdpa_math", "kept"))
            attention_backward[k] = np.where(math > 0, block("sdpa_math_backward_extra") + product, 0.0)
    mlp, moe = block("mlp"), block("moe")
    full = {"dense": 2 * norm + attention["dense"] + mlp, "moe": 2 * norm + attention["moe"] + moe}
    checkpoint_input = block("layer_input") if profile.selective_keeps_layer_input else 0.0
    selective = {
        "dense": 2 * norm_kept + attention_kept["dense"] + block("mlp", "kept") + checkpoint_input,
        "moe": 2 * norm_kept + attention_kept["moe"] + block("moe", "kept") + checkpoint_input,
    }
    weight_input = {
        "dense": block(attention_name, "weight_input") + block("mlp", "weight_input"),
        "moe": block(attention_name, "weight_input") + block("moe", "weight_input"),
    }
    # The output gradients W consumes; a profile without the table assumes them as large as
    # the linear inputs.
    weight_grad_outputs = {
        "dense": block("weight_grad_outputs") if "weight_grad_outputs" in blocks else weight_input["dense"],
        "moe": block("moe_weight_grad_outputs") if "moe_weight_grad_outputs" in blocks else weight_input["moe"],
    }
    layer_input = block("layer_input")
    rebuilt_input = {"dense": layer_input, "moe": layer_input}
    # The backward's working set is a maximum over time that no per-tensor table captures well
    # for MoE layers: where a census of this model ships with ndplan, its measurement is used.
    backward_extra = {"dense": block("backward_extra"), "moe": block("moe_backward_extra")}
    # A census measures that working set at TP 1 alone: on a TP rank it shrinks as the formula's
    # does, formula(tp) / formula(TP 1) (the census's TP-2 run, on fake tensors: llama-3.1-8b's
    # dense layer 28,672 B/token against 57,344 at TP 1, the formula's 2·ffn·2 / tp).
    unsharded = {rule: np.full_like(tp, options.routed_token_factor if rule in ("etp", "expert_tokens", "expert_width")
                                    else 1.0) for rule in divisors}
    backward_tp_share = {
        k: np.divide(backward_extra[k], at_one, out=np.ones_like(tp), where=at_one > 0)
        for k, at_one in (("dense", _per_rank(blocks.get("backward_extra", empty), unsharded, seq)),
                          ("moe", _per_rank(blocks.get("moe_backward_extra", empty), unsharded, seq)))}
    for record in shipped_census(model) if profile.name == "pytorch" else ():
        shipped_kind = record.layer_kind.split("-")[-1]
        if shipped_kind in backward_extra:
            backward_extra[shipped_kind] = record.backward_peak_extra_bytes_per_token * backward_tp_share[shipped_kind]
    kind: MlpKind
    for kind in ("dense", "moe"):
        measured = _census_for(options, kind, model)
        if measured is not None:
            if offload:
                raise NdplanError("a census measures what a layer keeps on the device, not activation offload "
                                  f"({' '.join(offload)}): leave out one or the other")
            if batch.recompute_modules:
                raise NdplanError("a census measures the runtime's own selective recompute, not recompute modules "
                                  f"({' '.join(batch.recompute_modules)}): leave out one or the other")
            record = measured
            _check_census_runtime(record, batch, options)
            # Measured bytes replace the formulas; the TP split comes from the census's TP-2 run,
            # which splits heads and widths, experts' too, without sequence parallelism: where a
            # strategy shards otherwise (SP, experts by another degree) the formulas price it.
            applies = ~((batch.sequence_parallel > 0) & (tp > 1))
            if kind == "moe":
                applies &= np.where(batch.etp == 0, tp, batch.etp) == tp
            full[kind] = np.where(applies, _measured(record, tp, seq, record.seq_length), full[kind])
            # Its selective figures are torch's keep-every-matmul checkpointing: another policy
            # (Megatron's core-attention recompute) keeps the formulas'.
            if options.recompute_policy == CENSUS_SELECTIVE_POLICY:
                selective[kind] = np.where(applies, _measured(record.selective, tp, seq, record.seq_length),
                                           selective[kind])
            rebuilt_input[kind] = np.where(applies, _measured(record.full_recompute, tp, seq, record.seq_length),
                                           rebuilt_input[kind])
            backward_extra[kind] = np.where(applies, record.backward_peak_extra_bytes_per_token * backward_tp_share[kind],
                                            backward_extra[kind])
    is_full, is_selective = batch.is_("recompute", "full"), batch.is_("recompute", "selective")
    recomputed = {k: np.where(is_full, rebuilt_input[k], selective[k]) for k in ("dense", "moe")}
    # What no weight gradient of the layer reads: the whole layer (measured, where a census
    # replaced the formulas) less its weights' inputs.
    weight_unread = {k: np.maximum(full[k] - weight_input[k] - 2 * block("norm", "weight_input"), 0.0)
                     for k in ("dense", "moe")}
    # What recompute rebuilds in backward lives on the device, offloaded or not: taken before
    # the offload is netted out below.
    rebuilt = {k: full[k] - recomputed[k] for k in ("dense", "moe")}
    offloaded = {k: np.zeros_like(tp) for k in ("dense", "moe")}
    by_block = {"dense": {"attention": attention["dense"], "norm": 2 * norm, "mlp": mlp},
                "moe": {"attention": attention["moe"], "norm": 2 * norm, "moe": moe}}
    for k in ("dense", "moe"):
        formula = sum(by_block[k].values())
        if _census_for(options, k, model) is not None:  # measured: the blocks in the formulas' proportions
            share = np.divide(full[k], formula, out=np.zeros_like(tp), where=formula > 0)
            by_block[k] = {name: value * share for name, value in by_block[k].items()}
    if offload:
        moved_by_block, moved_kept = _offloaded(model, block, attention_name, options.attention == "eager", offload)
        moved_plain = {k: _summed(moved_by_block[k]) for k in ("dense", "moe")}
        by_block = {k: {name: value - moved_by_block[k][name] for name, value in by_block[k].items()} for k in by_block}
        full = {k: full[k] - moved_plain[k] for k in ("dense", "moe")}
        recomputed = {k: recomputed[k] - np.where(is_full, 0.0, moved_kept[k]) for k in ("dense", "moe")}
        # Megatron-Core keeps on the device the last layer of the chunk whose backward comes next
        # (its reload would stall the backward at once) and reloads one layer ahead of the
        # backward: two layers' moved bytes beside the backward's working set. Under selective
        # recompute a layer moves what the policy keeps; the two differ only where a module both
        # rebuilds and offloads a tensor (mla_up_proj beside core_attn), and with recompute
        # limited to some layers the others move the larger amount, which this (a function of
        # ACTIVATION_FIELDS, as the search prices it) counts as the smaller.
        offloaded = {k: np.where(is_selective, moved_kept[k], moved_plain[k]) for k in ("dense", "moe")}
        backward_extra = {k: backward_extra[k] + 2.0 * offloaded[k] for k in ("dense", "moe")}
    norms_read_last = 2 * block("norm", "read_last")
    weight_read_last = {"dense": norms_read_last + block("mlp", "read_last"),
                        "moe": norms_read_last + block("moe", "read_last")}
    weight_past = {"dense": block("mlp", "past_weights"), "moe": block("moe", "past_weights")}
    embedding = 0.0 * tp + block("embedding")
    output = 0.0 * tp + block("norm") + block("output")
    measured_output = _census_for(options, "output", model)
    if measured_output is not None:
        # Its TP-2 run halves the vocabulary (a vocabulary-parallel head and loss): a loss on
        # whole logits keeps the TP-1 bytes.
        vocab_parallel = options.loss_parallel if options.loss_parallel is not None else profile.loss_parallel
        output = _measured(measured_output, tp if vocab_parallel else np.ones_like(tp), seq,
                           measured_output.seq_length)
    # MTP module (Megatron-Core's MultiTokenPredictionLayer): embedding of the shifted tokens, two
    # input norms (enorm, hnorm), the concatenated 2h input of its projection, then its own output
    # norm, head and loss, which ``output`` holds (its norm is the final_layernorm): three norms.
    hidden_per_token = model.hidden_size * act_bytes / divisors["sp"]
    mtp_extra = embedding + 2 * norm + 2 * hidden_per_token + output
    # Under full recompute with --recompute-method uniform Megatron checkpoints the module's
    # projection, layer and final_layernorm as one (MultiTokenPredictionLayer._checkpointed_forward):
    # it keeps its inputs, the decoder's hidden states and the shifted tokens' embedding (h each,
    # sequence-sharded under SP), beside the embedding's dropout mask and the head and loss outside
    # it (``output`` less the norm, which the checkpoint rebuilds).
    mtp_checkpointed = embedding + 2 * hidden_per_token + output - norm
    return LayerActivations(
        full=full, recomputed=recomputed, weight_input=weight_input, weight_grad_outputs=weight_grad_outputs,
        weight_unread=weight_unread, weight_read_last=weight_read_last, weight_past=weight_past,
        dense_blocks=by_block["dense"], moe_blocks=by_block["moe"], embedding=embedding, output=output,
        output_transient=np.maximum(block("output_transient"), block("output_backward_extra")),
        backward_extra=backward_extra, attention_backward=attention_backward, mtp_extra=mtp_extra,
        mtp_checkpointed=mtp_checkpointed, mtp_rebuilt=mtp_extra + full[model.mtp_mlp_kind] - mtp_checkpointed,
        rebuilt=rebuilt,
        offloaded=offloaded,
    )


def routes_own_tokens(sequence_parallel: Any, tp: Any) -> np.ndarray:
    """Where each rank routes its own tokens to the experts (its sequence shard under SP, all of
    them without TP), which the dispatcher gathers over the expert-TP group: etp/tp of the
    sequence's routed tokens on a rank, through experts 1/etp wide. Elsewhere (TP without SP)
    every TP rank routes the tokens they all hold."""
    return ((np.asarray(sequence_parallel) > 0) & (np.asarray(tp) > 1)) | (np.asarray(tp) == 1)


def fp8_weight_cache_width(profile: RuntimeProfile, compute_dtype: str, zero: Any) -> np.ndarray:
    """Bytes per linear-weight element (``static.linear_weight_elements``) of the quantised
    weight copies the runtime keeps across micro-batches under fp8 GEMMs (Transformer Engine's
    weight workspaces under Megatron: ``fp8_weight_cache_bytes``), whole on the rank whatever
    ZeRO-1/2 shards; not priced under ZeRO-3, whose weights are gathered per use. Per ``zero``."""
    width = profile.fp8_weight_cache_bytes if compute_dtype == "fp8" else 0.0
    return np.where(np.asarray(zero) < 3, width, 0.0)


def ddp_bucket_width(profile: RuntimeProfile, grad_bytes: float, zero: Any, dp: Any, cp: Any) -> np.ndarray:
    """Bytes per element of the buckets a DDP reducer keeps beside the gradients
    (``ddp_bucket_copies`` of them): replicas (dp·cp > 1) without ZeRO or FSDP; 0 elsewhere."""
    ddp = (np.asarray(zero) == 0) & (np.asarray(dp) * np.asarray(cp) > 1)
    return np.where(ddp, grad_bytes * profile.ddp_bucket_copies, 0.0)


def makes_whole_embedding_grad(profile: RuntimeProfile, tp: Any, zero: Any) -> Any:
    """Where the embedding's backward makes the whole [vocab, h] gradient before the rank's
    shard (DTensor's vocabulary-parallel embedding: ``tp_accumulates_whole_embedding_grad``,
    under TP and without ZeRO-3's sharded gradients); arrays or scalars."""
    return (np.asarray(tp) > 1) & (np.asarray(zero) < 3) & profile.tp_accumulates_whole_embedding_grad


def whole_embedding_grad_extra(model: ModelSpec, profile: RuntimeProfile, tp: Any, zero: Any, micro_batches: Any) -> Any:
    """Gradient elements on the embedding's rank beyond its vocabulary shard: once a second
    micro-batch's gradient is added, the accumulated one is the whole table, vocab·h·(1 − 1/tp);
    0 elsewhere."""
    accumulated = makes_whole_embedding_grad(profile, tp, zero) & (np.asarray(micro_batches) > 1)
    return np.where(accumulated, model.vocab_size * model.hidden_size - embedding_elements(model, tp), 0.0)


def head_accumulate(model: ModelSpec, activation_bytes: float, head_gradient: Any, tokens: Any, tp: Any,
                    loss_held: Any) -> Any:
    """Bytes beyond the static state and the held activations while the head's backward makes a
    later micro-batch's weight gradient, to be added to the kept one (``head_gradient`` > 0: the
    runtime's autograd accumulates it), with T = ``tokens`` of the op, V = vocab, h = hidden,
    a = activation bytes, p = parameter bytes:

        head_gradient + T·(V/tp·a + 3·h·a) − loss_held,   head_gradient = V·h/tp·p

    the new [vocab/tp, h] weight gradient; the logits' gradient it is computed from (the head's
    vocabulary shard, a loss on whole logits too); two h-wide tensors (the head input's gradient
    among them) and the head's input, which ``loss_held`` (the micro-batch's ``output`` entries,
    T·(h·a + 4·V + 8) with the fp32 loss) counts and the weight gradient still reads; the rest of
    the loss's entries are freed by then. Measured on fake tensors (tests/test_verify.py), the
    last stage's peak at few tokens per vocabulary row: llama-3.1-8b at 256 tokens, tp 1, the
    1,002 MiB gradient, 63 MiB of the logits' gradient and 4 MiB h-wide beside 124 MiB held."""
    tokens_part = tokens * (model.vocab_size / tp * activation_bytes + 3 * model.hidden_size * activation_bytes)
    return np.where(head_gradient > 0, np.maximum(head_gradient + tokens_part - loss_held, 0.0), 0.0)


def applicable_modules(model: ModelSpec) -> tuple[str, ...]:
    """The recompute modules that re-run something in ``model``: the attention core always;
    the norms where one stands apart from the linear layer after it (the router's input in a
    MoE layer, MLA's down-projection input; Megatron fuses the others into the next linear);
    MLA's up-projections with MLA; the dense MLP where a layer (or an MTP module) has one; the
    experts' activation and the MoE block with experts; the shared experts where there are
    some."""
    mla = model.attention_kind == "mla"
    has = {
        "core_attn": True, "layernorm": model.is_moe or mla, "mla_up_proj": mla,
        "mlp": "dense" in model.mlp_kinds, "moe_act": model.is_moe, "moe": model.is_moe,
        "shared_experts": model.is_moe and model.num_shared_experts > 0,
    }
    return tuple(m for m in RECOMPUTE_MODULES if has[m])


def applicable_offload_modules(model: ModelSpec) -> tuple[str, ...]:
    """The offload modules that move something in ``model`` (``_offloaded``'s rules): attn_norm
    only where the attention norm is its own module (MLA), mlp_norm and the experts' modules only
    with MoE layers; the others always. Megatron runs the rest as no-ops."""
    has = {"attn_norm": model.is_mla, "mlp_norm": model.is_moe, "expert_fc1": model.is_moe, "moe_act": model.is_moe}
    return tuple(m for m in OFFLOAD_MODULES if has.get(m, True))


def _offloaded(model: ModelSpec, block: Callable[[str, str], np.ndarray], attention_name: str, eager: bool,
               offload: tuple[str, ...]) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Bytes per token per rank that ``offload`` moves to the host from one layer of each kind:
    (of a layer that recomputes nothing, by block as ``LayerActivations.dense_blocks`` and
    ``moe_blocks``; of one under the selective policy).

    The profile's entries name their modules; the two norms of a layer share the ``norm`` block,
    so their owner is decided here: the attention norm moves with attn_norm where it is its own
    module (MLA's input norm) and with qkv_linear where Transformer Engine fuses it into the QKV
    linear (every other attention); the pre-MLP norm with mlp_norm in MoE layers (it feeds the
    router); a dense MLP's norm is fused into fc1, which no offload module names."""
    attention_side = ("attn_norm" if model.is_mla else "qkv_linear") in offload
    mlp_side = "mlp_norm" in offload
    out = []
    for part in ("offloaded", "offloaded_kept"):
        norm = block("norm", part)
        attention = block(attention_name, part) + (block("eager_scores", part) if eager else 0.0)
        out.append({
            # (in this order, so that the totals are the sums they were: norm + attention + MLP)
            "dense": {"norm": attention_side * norm, "attention": attention, "mlp": block("mlp", part)},
            "moe": {"norm": (attention_side + mlp_side) * norm, "attention": attention, "moe": block("moe", part)},
        })
    return out[0], {k: _summed(blocks) for k, blocks in out[1].items()}


def _summed(blocks: dict[str, np.ndarray]) -> np.ndarray:
    """Σ of the blocks' bytes, added in their order."""
    return reduce(operator.add, blocks.values())


# --------------------------------------------------------------------------- schedule peaks
def steady_micro_batches(schedule: str, pp: int, vpp: int, m: int) -> int:
    """A micro-batch count with the same frontier (``_steady_frontier``) as ``m``.

    Past the warm-up, every schedule but GPipe and the V schedules repeats the same steady
    pattern, so the distinct rows of its activation counts, hence its frontier and peaks, stop
    changing with m: simulating fewer gives the same answer for less work, and searches whose
    micro-batch counts differ past it share one simulation. The frontier stops changing at
    m = pp + 1 in the 1F1B orders (1F1B, ZB-H1, Seq1F1B: a second steady forward after each
    stage's first backward; Seq1F1B earlier, ceil(pp / seq_chunks) + 1) and 3·pp in the
    interleaved order (a multiple of pp, as interleaving requires), at every vpp: these counts
    are taken (a test checks them against the simulation of every count up to 4·pp·vpp). In a V
    the hand-overs at the turn counted before the last stage's warm-up ends keep their count while
    the later ones grow, so its frontier never stops changing: m itself (``_steady_frontier``
    derives it past 2·pp + 2 without simulating m)."""
    if schedule == "gpipe" or schedule in V_SHAPE:
        return m
    cap = 3 * pp if schedule == "interleaved" else pp + 1
    return m if m <= cap else cap


def _frontier(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> tuple[np.ndarray, ...]:
    """Per stage, the frontier rows of ``_steady_frontier`` for ``m`` micro-batches."""
    return _steady_frontier(schedule, pp, vpp, steady_micro_batches(schedule, pp, vpp, m), seq_chunks)


@lru_cache(maxsize=4096)
def _steady_frontier(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> tuple[np.ndarray, ...]:
    """Per stage, the op-boundary rows [held_until_b | held_until_w | grads_ready] (then, for
    schedules that split the backward, ``starts_w`` and ``starts_first_w`` per chunk: the row is
    the state while that chunk's (first) weight-gradient step runs; and for V schedules one more
    column, the hand-overs at the turn so far) that can be the maximum of a non-negative
    weighting: rows dominated by another row are dropped (usually most)."""
    if schedule == "gpipe":
        # GPipe runs every forward before any backward: each stage holds all m micro-batches, and
        # no gradient exists yet; after the first backward, m - 1 and the gradients.
        return tuple(np.array([[float(m), 0.0, 0.0], [float(m - 1), 0.0, 1.0]]) for _ in range(pp))
    if schedule == "1f1b":
        return _one_f_one_b_frontier(pp, m)
    if schedule in V_SHAPE and m > 2 * pp + 2 and seq_chunks == 1:
        return _v_frontier_past_warm_up(schedule, pp, vpp, m)
    return _simulated_frontier(schedule, pp, vpp, m, seq_chunks)


def _v_frontier_past_warm_up(schedule: str, pp: int, vpp: int, m: int) -> tuple[np.ndarray, ...]:
    """A V schedule's (ZB-V's, DualPipeV's) frontier at m > 2·pp + 2 micro-batches, from those
    simulated at 2·pp + 1 and one more: from 2·pp + 1 on, each further micro-batch leaves every
    row as it is but the last stage's hand-overs, which grow by two (its F's and its B's) on the
    rows past its warm-up and stay on the others (a test checks it against the simulation of
    every count up to 8·pp). The search's larger V counts then cost no simulation of their own
    (ZB-V pp 16's frontiers at 4 to 128 micro-batches: 13 -> 10 ms); adding two per micro-batch
    to every row instead, as a count past a cap once did, read the warm-up's rows too high (the
    last stage's peak with the first weight-gradient column weighted: 10.55 against 8.15)."""
    first = 2 * pp + 1
    at, after = _steady_frontier(schedule, pp, vpp, first, 1), _steady_frontier(schedule, pp, vpp, first + 1, 1)
    if any(a.shape != b.shape for a, b in zip(at, after, strict=True)) or not all(
            np.array_equal(a, b) for a, b in zip(at[:-1], after[:-1], strict=True)) or not np.array_equal(
            at[-1][:, :-1], after[-1][:, :-1]):
        return _simulated_frontier(schedule, pp, vpp, m, 1)  # (never seen: the rows moved)
    turn = at[-1].copy()
    turn[:, -1] += (m - first) * (after[-1][:, -1] - at[-1][:, -1])
    return (*at[:-1], turn)


def _simulated_frontier(schedule: str, pp: int, vpp: int, m: int, seq_chunks: int) -> tuple[np.ndarray, ...]:
    """``_steady_frontier`` from the schedule's simulated activation counts."""
    flight = in_flight(schedule, pp, vpp, m, seq_chunks)
    frontiers: list[np.ndarray] = [np.empty(0)] * pp
    # The stages with as many op boundaries (in most schedules, all of them) are done together.
    for members, group in flight.groups:
        counts = [group.held_until_b, group.held_until_w, group.grads_ready]  # [stages, boundaries, chunks]
        if schedule in SPLIT_BACKWARD:
            counts += [group.starts_w, group.starts_first_w]
        if schedule in V_SHAPE:
            # Hand-overs at the V's turn (the last stage: its first chunk's F hands the output
            # to its second, whose B hands the gradient back) so far, one column; zero on the
            # other stages, whose rows then stay dominated as before.
            handovers = np.zeros((*group.held_until_b.shape[:2], 1))
            if members[-1] == pp - 1:
                handovers[-1, :, 0] = group.forwards_done[-1, :, 0] + group.backwards_done[-1, :, 1]
            counts.append(handovers)
        # One skyline over every column, grads_ready's included (its weights, gradient bytes,
        # are non-negative like the rest): the rows that can be a maximum. Rows a neighbour
        # dominates go first, over every stage's series at once.
        boundaries = group.held_until_b.shape[1]
        kept = np.flatnonzero(_locally_undominated_columns([count[:, :, c] for count in counts
                                                             for c in range(count.shape[2])]))
        rows = np.concatenate([count.reshape(-1, count.shape[2])[kept] for count in counts], axis=1)
        for s, frontier in zip(members, _skylines(rows, kept // boundaries, len(members)), strict=True):
            frontiers[s] = frontier
    return tuple(frontiers)


def _one_f_one_b_frontier(pp: int, m: int) -> tuple[np.ndarray, ...]:
    """``_steady_frontier`` of 1F1B, in closed form (a test checks it against the simulation).

    Stage s runs w = min(pp - s - 1, m) warm-up forwards, then F and B alternately, then the
    remaining backwards: it holds k = min(pp - s, m) micro-batches after its last warm-up F and
    its first steady F, and k - 1 after each B. Where a second steady F follows the first B
    (m > pp - s), it holds k again with the gradients made: the one row [k, 0, 1] dominates
    every other. Otherwise the peak comes before any gradient and the first B leaves k - 1 with
    them: rows [k, 0, 0] and [k - 1, 0, 1] (two used columns: the first descending). Each a
    few microseconds rather than a simulation and a skyline (~0.4 ms apiece; DeepSeek-V3's
    search prices 18 such schedules, Llama-3.1-405B's 21)."""
    out = []
    for s in range(pp):
        k = float(min(pp - s, m))
        out.append(np.array([[k, 0.0, 1.0]]) if m > pp - s else np.array([[k, 0.0, 0.0], [k - 1.0, 0.0, 1.0]]))
    return tuple(out)


def _undominated(rows: np.ndarray) -> np.ndarray:
    """The rows of ``rows`` (a time series, one row per op boundary) that no other row is >= in
    every column (the skyline), with the all-zero columns kept so the width is unchanged."""
    kept = np.flatnonzero(_locally_undominated_columns([column[None, :] for column in rows.T]))
    return _skylines(rows[kept], np.zeros(len(kept), np.int64), 1)[0]


#: Weights of a row's columns in the sort key that brings equal rows together (any weights do,
#: repeated for wider rows: rows with equal keys are compared in full).
_GROUPING_WEIGHTS = np.random.default_rng(0).random(64)


def _skylines(rows: np.ndarray, stage: np.ndarray, stages: int) -> list[np.ndarray]:
    """Per stage, the skyline of its rows (``rows[stage == s]``, in time order): the distinct
    rows no other row of the stage is >= in every column, in lexicographic order, or by the first
    used column descending where at most two columns are used (not all zero).

    The stages are sorted and compared together, not one by one: a search asks for a few
    thousand stages' skylines, of a few dozen rows each, where numpy's cost per call would be
    most of the work."""
    # Equal rows together, by stage and a weighted sum (one sort key, not one per column); the
    # first of each run of equal rows kept: the distinct rows, a few twice where sums collide.
    order = np.lexsort((rows @ np.resize(_GROUPING_WEIGHTS, rows.shape[1]), stage))
    rows, stage = rows[order], stage[order]
    fresh = np.ones(len(rows), bool)
    fresh[1:] = (stage[1:] != stage[:-1]) | np.any(rows[1:] != rows[:-1], axis=1)
    rows, stage = rows[fresh], stage[fresh]
    # Distinct rows sorted by stage, then lexicographically (np.unique(axis=0) per stage).
    order = np.lexsort((*rows.T[::-1], stage))
    rows, stage = rows[order], stage[order]
    fresh = np.ones(len(rows), bool)
    fresh[1:] = (stage[1:] != stage[:-1]) | np.any(rows[1:] != rows[:-1], axis=1)
    rows, stage = rows[fresh], stage[fresh]
    # Most dominated rows are dominated by one of the next few in this order: dropped in O(rows)
    # first, they leave the O(rows²) comparison few rows (its maxima, which dominate the rest,
    # all stay).
    near = ~_dominated_by_next(rows, stage, 4)
    rows, stage = rows[near], stage[near]
    undominated = ~_dominated_in_stage(rows, np.searchsorted(stage, np.arange(stages + 1)).tolist())
    rows, stage = rows[undominated], stage[undominated]
    bounds = np.searchsorted(stage, np.arange(stages + 1)).tolist()
    # Every stage keeps a row (its largest stays), so no stage's run of rows is empty.
    used = np.count_nonzero(np.logical_or.reduceat(rows != 0, bounds[:-1], axis=0), axis=1).tolist()
    return [(rows[a:b] if count > 2 else rows[a:b][::-1]).copy()  # else the first used column descending
            for a, b, count in zip(bounds[:-1], bounds[1:], used, strict=True)]


def _locally_undominated_columns(columns: list[np.ndarray]) -> np.ndarray:
    """[stages, rows] mask of the rows not dominated by a neighbour in their stage's series,
    given column by column ([stages, rows] each): row i goes where row i + 1 is >= it in every
    column, or where row i - 1 is >= it in every column and > in one.

    The rows are a time series, one per op boundary, and an op changes few columns, so most rows
    fall here in O(rows) rather than the skyline's O(rows²). Every row dropped is at most its
    kept neighbour's (following drops, which point one way along a run: i <= i + 1 and
    i + 1 < i cannot both hold), so the distinct undominated rows all stay. Column by column on
    [stages, rows] arrays: numpy reduces a row's few columns slowly."""
    shape = columns[0].shape
    below_next = np.ones((shape[0], shape[1] - 1), bool)  # row i <= row i + 1 in every column
    at_least_next = below_next.copy()  # row i >= row i + 1 in every column
    above_next = np.zeros_like(below_next)  # row i > row i + 1 in some column
    for column in columns:
        this, after = column[:, :-1], column[:, 1:]
        below_next &= this <= after
        at_least_next &= this >= after
        above_next |= this > after
    kept = np.ones(shape, bool)
    kept[:, :-1] &= ~below_next
    kept[:, 1:] &= ~(at_least_next & above_next)
    return kept


def _dominated_by_next(rows: np.ndarray, stage: np.ndarray, reach: int) -> np.ndarray:
    """Whether one of the next ``reach`` rows, in the same stage, is >= each row in every column,
    for distinct rows (then it is > in one)."""
    dominated = np.zeros(len(rows), bool)
    for k in range(1, min(reach, len(rows) - 1) + 1):
        dominated[:-k] |= (stage[k:] == stage[:-k]) & np.all(rows[k:] >= rows[:-k], axis=1)
    return dominated


#: Entries of a [stages, width, width] comparison below which every stage is compared at once,
#: padded to the largest.
_PADDED_AT_ONCE = 1 << 16


def _dominated_in_stage(rows: np.ndarray, bounds: list[int]) -> np.ndarray:
    """Whether another row of the same stage is >= each row in every column, for distinct rows
    (then it is > in one) grouped by stage: stage s's rows are ``rows[bounds[s]:bounds[s + 1]]``.

    Stages of alike sizes (the same power of two, at most; all of them where the padded
    comparison is under ``_PADDED_AT_ONCE`` entries) are compared together, each padded to
    their largest with rows of -inf, which are >= no row: a few numpy calls for many stages,
    each comparing its rows with one another only."""
    dominated = np.zeros(len(rows), bool)
    columns = np.ascontiguousarray(rows.T)
    starts, sizes = np.array(bounds[:-1]), np.diff(bounds)
    # One class where even the padded comparison is small: numpy's cost per call, not the
    # padding's, is then most of the work (a search's frontiers: 21 -> 18 ms of skylines).
    size_class = (np.ceil(np.log2(sizes)).astype(np.int64) if len(sizes) * int(sizes.max()) ** 2 > _PADDED_AT_ONCE
                  else np.zeros(len(sizes), np.int64))
    for c in sorted(set(size_class.tolist())):
        members = np.flatnonzero(size_class == c)
        width = int(sizes[members].max())
        # Stages at a time so that a [stages, width, width] comparison stays within 4M entries.
        parts = -(-len(members) * width * width // (1 << 22))
        for part in np.array_split(members, parts) if parts > 1 else [members]:
            index = starts[part, None] + np.arange(width)  # [stages, width]
            real = np.arange(width) < sizes[part, None]
            padded = columns[:, np.where(real, index, 0)]  # [columns, stages, width]
            padded[:, ~real] = -np.inf
            at_least = np.ones((len(part), width, width), bool)  # [stage, j, i]: row j >= row i
            for column in padded:  # column by column: numpy reduces a row's few columns slowly
                at_least &= column[:, :, None] >= column[:, None, :]
            dominated[index[real]] = (np.count_nonzero(at_least, axis=1) > 1)[real]  # more than itself
    return dominated


def _runs_of(values: np.ndarray) -> Iterator[tuple[int, slice | np.ndarray]]:
    """(value, rows) for each distinct value: slices when ``values`` is sorted (the batch path
    sorts each group by micro-batch count), index arrays otherwise."""
    values = np.asarray(values).ravel()
    if len(values) and np.all(values[1:] >= values[:-1]):
        starts = np.concatenate([[0], np.flatnonzero(values[1:] != values[:-1]) + 1, [len(values)]])
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            yield int(values[a]), slice(int(a), int(b))
        return
    for value in np.unique(values):
        yield int(value), np.flatnonzero(values == value)


def _frontier_columns(
    schedule: str, pp: int, vpp: int, m: int, seq_chunks: int, held: tuple[int, ...], grown: tuple[int, ...],
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Per stage, its frontier rows restricted to the ``held`` columns and to the ``grown`` ones
    (contiguous: each is the left operand of a matmul per stage), and which rows of the frontier
    they are. Rows the unused columns alone kept (a weight-gradient step where nothing is priced
    for it) are dominated within the used ones and dropped: neither maximum can come from them.
    (Cached by ``_steady_frontier_columns``, keyed on the count that stands for ``m``.)"""
    return _steady_frontier_columns(schedule, pp, vpp, steady_micro_batches(schedule, pp, vpp, m), seq_chunks,
                                    held, grown)


@lru_cache(maxsize=4096)
def _steady_frontier_columns(
    schedule: str, pp: int, vpp: int, m: int, seq_chunks: int, held: tuple[int, ...], grown: tuple[int, ...],
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """``_frontier_columns`` at a steady micro-batch count."""
    frontiers = _steady_frontier(schedule, pp, vpp, m, seq_chunks)
    priced = list(held) + list(grown)
    # Every stage's rows at once, split where a stage keeps them all: a few numpy calls per
    # frontier rather than a few per stage (each of a few rows, where the calls are the cost).
    bounds = np.cumsum([0, *(len(rows) for rows in frontiers)]).tolist()
    rows = np.concatenate(frontiers)
    # C-contiguous, as each stage's block is the left operand of its products (a matrix product's
    # sums may run in another order on another layout).
    held_rows, grown_rows = (np.ascontiguousarray(rows[:, part]) for part in (list(held), list(grown)))
    # Per stage, the columns something is held in but nothing is priced for (every stage
    # keeps a row, so no run of rows is empty).
    unused = np.logical_or.reduceat(rows != 0, bounds[:-1], axis=0)
    unused[:, priced] = False
    pruned = (unused.any(axis=1) & (np.diff(bounds) > 1)).tolist()
    out = []
    for a, b, prune in zip(bounds[:-1], bounds[1:], pruned, strict=True):
        if prune:
            index = _undominated_index(rows[a:b, priced])
            out.append((held_rows[a:b][index], grown_rows[a:b][index], index))
        else:
            out.append((held_rows[a:b], grown_rows[a:b], np.arange(b - a)))
    return tuple(out)


def _undominated_index(rows: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``rows`` that no other row is >= in every column and > in one
    (equal rows all stay: a maximum is the same whichever is taken)."""
    dominated = np.zeros(len(rows), bool)
    columns = np.ascontiguousarray(rows.T)
    for start in range(0, len(rows), 256):  # chunks bound the R x R comparison's memory
        block = slice(start, start + 256)
        # Column by column on [R, block] arrays: numpy reduces a short last axis slowly.
        at_least = np.ones((len(rows), min(256, len(rows) - start)), bool)
        above = np.zeros_like(at_least)
        for column in columns:
            at_least &= column[:, None] >= column[block]
            above |= column[:, None] > column[block]
        dominated[block] = np.any(at_least & above, axis=0)
    return np.flatnonzero(~dominated)


#: The frontier products run over blocks of strategies, of at most this many multiply-adds
#: (rows × columns × strategies) each: a matrix product this small stays on the calling thread
#: (OpenBLAS spreads a GEMM over threads above 4·65536, which on a busy machine wait for cores,
#: for work a single core does in microseconds), and its [rows, block] result stays in cache.
_PRODUCT_BLOCK = 1 << 18


def _blocks(subset: slice | np.ndarray, step: int) -> Iterator[slice | np.ndarray]:
    """``subset`` (a slice or an index array) in consecutive pieces of at most ``step``."""
    if isinstance(subset, slice):
        start, stop, _ = subset.indices(subset.stop)
        if stop - start <= step:
            yield subset
            return
        for a in range(start, stop, step):
            yield slice(a, min(a + step, stop))
        return
    for a in range(0, len(subset), step):
        yield subset[a:a + step]


def _held_peak(
    schedule: str, pp: int, vpp: int, seq_chunks: int, micro_batches: np.ndarray,
    weights: list[np.ndarray | None], extra: list[np.ndarray | None] | None, pattern_of: np.ndarray | None = None,
    *, keep_rows: bool = False, held_read: np.ndarray | None = None, stages: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per stage, stage-major [pp, n]: the peak over the schedule of the held activations, and of
    the held activations plus what else appears during the step.

    ``weights`` are the bytes of one micro-batch behind each of the frontier's first 2·vpp
    columns, one [n, pp] array per column (held until B per chunk, then held until W per chunk;
    None where zero), or [n, P] per stage pattern where ``pattern_of`` [pp] gives each stage's
    pattern; ``extra`` those of its further columns (each chunk's gradients, and under a
    V schedule the tensors handed over at its turn), or None where nothing appears, and then the
    second result is the first. A stage's peak is max over its frontier rows of
    Σ_c weight_c · row_c. With ``keep_rows``, per strategy and stage the frontier row of the
    activation peak. Strategies are priced per distinct micro-batch count, whose schedule
    simulation they share. ``held_read`` [n] (bool; None: all): the strategies whose first
    result is read where there is ``extra``; elsewhere it may hold anything (a run of one
    micro-batch count none of whose strategies reads it skips one pass over its [rows,
    strategies] values).
    ``stages`` (ascending; None: all): the stages priced, one row each, in that order."""
    n = len(micro_batches)
    held, grown = _priced_columns(weights, extra)
    # Stage-major [pp, columns, n]: per stage, (rows × columns) @ (columns × strategies) gives
    # every row's value in a [rows, n] block whose maximum runs over the leading axis.
    held_weights = _stage_major([w for w in weights if w is not None], pp, n)
    extra_weights = _stage_major([w for w in extra or () if w is not None], pp, n)
    # (Every stage's row is written below: one run of micro-batch counts covers the strategies.)
    priced = list(range(pp)) if stages is None else stages.tolist()
    peak = np.empty((len(priced), n))
    with_extra = np.empty((len(priced), n)) if extra is not None else peak
    chosen: np.ndarray | None = None
    for m, subset in _runs_of(micro_batches):
        frontier = _frontier_columns(schedule, pp, vpp, int(m), seq_chunks, held, grown)
        # Whether the run's first results are read (then written for all its strategies, which
        # those not read may hold): decided once per run, not per stage and block.
        read_here = extra is None or held_read is None or bool(held_read[subset].any())
        if keep_rows and chosen is None:
            chosen = np.zeros((n, pp, _frontier(schedule, pp, vpp, int(m), seq_chunks)[0].shape[1]))
        for row, s in enumerate(priced):
            held_rows, grown_rows, row_index = frontier[s]
            p = s if pattern_of is None else pattern_of[s]
            step = max(1, _PRODUCT_BLOCK // (held_rows.shape[0] * max(held_rows.shape[1], grown_rows.shape[1], 1)))
            for block in _blocks(subset, step):
                if len(held_rows) == 1 and isinstance(block, slice) and not keep_rows:
                    # One frontier row (most micro-batch counts, past the warm-up): its value is
                    # the peak, the products written in place (the same sum: v + g = g + v).
                    _product(held_rows, held_weights[p][:, block], out=peak[row:row + 1, block])
                    if extra is not None:
                        _product(grown_rows, extra_weights[p][:, block], out=with_extra[row:row + 1, block])
                        with_extra[row, block] += peak[row, block]
                    continue
                values = _product(held_rows, held_weights[p][:, block])
                if read_here:
                    _store_max(values, peak[row], block)
                if keep_rows and chosen is not None:
                    chosen[block, s] = _frontier(schedule, pp, vpp, int(m), seq_chunks)[s][row_index[np.argmax(values, axis=0)]]
                if extra is not None:
                    values += _product(grown_rows, extra_weights[p][:, block])
                    _store_max(values, with_extra[row], block)
    return peak, with_extra, chosen


def _priced_columns(
    weights: list[np.ndarray | None], extra: list[np.ndarray | None] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The frontier columns ``_held_peak`` prices: (held, grown), those with weights."""
    return (tuple(c for c, w in enumerate(weights) if w is not None),
            tuple(len(weights) + c for c, w in enumerate(extra or ()) if w is not None))


def _pattern_leaders(
    schedule: str, pp: int, vpp: int, seq_chunks: int, micro_batches: np.ndarray,
    weights: list[np.ndarray | None], extra: list[np.ndarray | None] | None, pattern_of: np.ndarray,
) -> np.ndarray | None:
    """The stages (ascending) whose device totals can be a strategy's peak, or None where that
    is every stage: a stage whose frontier an earlier stage of its pattern dominates for every
    micro-batch count of ``micro_batches`` is never the (first) peak stage.

    Two stages of one pattern differ only in their held peaks (``_GroupShape``), and every
    figure after the held peak is a sum, maximum or positive scaling of it with the pattern's
    terms, each monotone in it as rounded; so a stage whose held peaks (with and without the
    extra columns) are at most an earlier stage's has at most its device total, and the first
    stage of the peak is never it. Its held peaks are at most the earlier stage's where each of
    its frontier rows is at most one of the earlier stage's in every column, the weights being
    non-negative, and the products computed as the same monotone roundings: one column held and
    at most one grown (1F1B, GPipe, Seq1F1B: an elementwise product each, and their sum; a
    matrix product of a few columns may sum another way for another number of rows); with more
    columns, where the frontiers are equal (the same products). Those are the stages of the
    deep pipelines' interior patterns: 1F1B's 32 stages price as 5."""
    held, grown = _priced_columns(weights, extra)
    leaders = _leading_stages(schedule, pp, vpp, seq_chunks, tuple(unique(micro_batches).tolist()), held, grown,
                              tuple(pattern_of.tolist()))
    return None if len(leaders) == pp else leaders


@lru_cache(maxsize=4096)
def _leading_stages(
    schedule: str, pp: int, vpp: int, seq_chunks: int, micro_batches: tuple[int, ...], held: tuple[int, ...],
    grown: tuple[int, ...], pattern_of: tuple[int, ...],
) -> np.ndarray:
    """``_pattern_leaders`` of the distinct micro-batch counts ``micro_batches`` (cached: a
    search prices the same groups block after block)."""
    needed = np.zeros(pp, dtype=bool)
    for m in micro_batches:
        needed |= _leading_stages_at(schedule, pp, vpp, seq_chunks, m, held, grown, pattern_of)
    leaders = np.flatnonzero(needed)
    leaders.flags.writeable = False
    return leaders


@lru_cache(maxsize=8192)
def _leading_stages_at(
    schedule: str, pp: int, vpp: int, seq_chunks: int, m: int, held: tuple[int, ...], grown: tuple[int, ...],
    pattern_of: tuple[int, ...],
) -> np.ndarray:
    """[pp] bool: the stages no earlier stage of their pattern dominates at ``m`` micro-batches."""
    frontier = _frontier_columns(schedule, pp, vpp, m, seq_chunks, held, grown)
    elementwise = len(held) <= 1 and len(grown) <= 1
    # A few rows of a few columns a stage: compared as Python lists, not by numpy calls.
    rows = [np.concatenate([held_rows, grown_rows], axis=1).tolist() for held_rows, grown_rows, _ in frontier]
    leaders: dict[int, list[int]] = {}  # pattern -> its stages kept so far
    needed = np.zeros(pp, dtype=bool)
    for t, pattern in enumerate(pattern_of):
        # (Dominance is transitive: a stage dominated by a dropped one is by a kept one too.)
        dominated = any(_rows_dominated(rows[t], rows[s]) if elementwise else rows[t] == rows[s]
                        for s in leaders.get(pattern, ()))
        if not dominated:
            leaders.setdefault(pattern, []).append(t)
            needed[t] = True
    return needed


def _rows_dominated(rows: list[list[float]], by: list[list[float]]) -> bool:
    """Whether each row of ``rows`` is at most one of ``by`` in every column."""
    return all(any(all(a <= b for a, b in zip(row, other, strict=True)) for other in by) for row in rows)


def _product(rows: np.ndarray, columns: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """rows @ columns ([r, k] @ [k, n]), into ``out`` where given. With k = 1 (1F1B and GPipe:
    one column held, one grown) the outer product, broadcast: the same products, each rounded
    once, faster than the matrix product's kernel for so few rows (a DeepSeek-V3 search's
    _held_peak calls: 66-68 ms -> 57-59 ms)."""
    if rows.shape[1] == 1:
        return np.multiply(rows, columns, out=out)
    return np.matmul(rows, columns, out=out)


def _store_max(values: np.ndarray, row: np.ndarray, block: slice | np.ndarray) -> None:
    """row[block] = the maximum of each column of ``values``: written in place where ``block`` is
    a slice (``row[block]`` is a view), scattered where it is an index array (``row[block]`` is
    then a copy, which ``out=`` would fill and drop: the strategies of a batch not sorted by
    micro-batch count lost their held peak that way)."""
    if isinstance(block, slice):
        values.max(axis=0, out=row[block])
    else:
        row[block] = values.max(axis=0)


def _stage_major(columns: list[np.ndarray], pp: int, n: int) -> np.ndarray:
    """[pp, len(columns), n] from [n, pp] arrays: one column-major array's transpose as a view
    (no copy), several stacked."""
    if not columns:
        return np.zeros((pp, 0, n))
    if len(columns) == 1 and columns[0].flags.f_contiguous:
        return columns[0].T[:, None, :]
    return np.stack([w.T for w in columns], axis=1)


def _recomputed_layers(
    recompute_on: np.ndarray, recompute_layers: np.ndarray, dense_layers: np.ndarray, moe_layers: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per strategy and virtual stage [n, U]: (plain dense, plain MoE, recomputed dense,
    recomputed MoE) layer counts. Under recompute a chunk recomputes its first
    min(recompute_layers, its layers) layers (all of them where the limit is 0), dense ones first."""
    limit = np.where(recompute_layers > 0, recompute_layers, np.iinfo(np.int64).max)
    layer_counts = dense_layers + moe_layers
    recomputed = np.where(recompute_on[:, None], np.minimum(limit[:, None], layer_counts[None, :]), 0)
    recomputed_dense = np.minimum(recomputed, dense_layers[None, :])
    recomputed_moe = recomputed - recomputed_dense
    return dense_layers[None, :] - recomputed_dense, moe_layers[None, :] - recomputed_moe, recomputed_dense, recomputed_moe


#: A term of the static element counts: (kind, per strategy [n], per virtual stage [pp·vpp]).
StaticTerm = tuple[str, Any, np.ndarray]


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


@dataclass(frozen=True)
class _GroupShape:
    """What a pipeline shape fixes, per distinct stage pattern.

    Two stages whose chunks hold the same layers, in the same roles (first or last virtual
    stage, receiving from or sending to a peer, handing over at a V's turn) have the same
    parameters, buffers, working set and per-micro-batch activations: only their place in the
    schedule (the held peak) differs. So every term but the held peak is computed once per
    pattern, on ``patterns`` columns, and expanded to the ``pp`` stages by ``pattern_of``.
    The virtual stages are likewise reduced to those the patterns' stages run (``used``, in
    model order: the first and the last virtual stage are always among them, first and last).

    Per virtual stage in ``used`` [U]: ``dense``/``moe`` layer counts, ``first``/``last``
    (0/1 floats), and the pipeline flags; per pattern [P]: ``chunks`` [P, vpp] (columns of
    ``used``), ``on_stage`` [P, U] (0/1), ``moe_per_stage``; ``turn``: the pattern of the last
    stage, where a V schedule turns.
    """

    placement: Placement
    full_on_stage: np.ndarray  # [pp, pp·vpp]
    reps: np.ndarray           # [P] a stage of each pattern (its first)
    pattern_of: np.ndarray     # [pp] the pattern of each stage
    used: np.ndarray           # [U] virtual stages the representatives run
    chunks: np.ndarray
    on_stage: np.ndarray
    dense: np.ndarray
    moe: np.ndarray
    first: np.ndarray
    last: np.ndarray
    receives_from_peer: np.ndarray
    sends_to_peer: np.ndarray
    hands_forward: np.ndarray
    hands_backward: np.ndarray
    moe_per_stage: np.ndarray
    turn: int

    @property
    def identity(self) -> bool:
        """Every stage is its own pattern (no expansion needed)."""
        return len(self.reps) == len(self.pattern_of)

    def expand(self, values: np.ndarray) -> np.ndarray:
        """[n, P] per pattern -> [n, pp] per stage (``values`` itself when nothing repeats)."""
        return values if self.identity else values[:, self.pattern_of]

    def by_stage(self, values: np.ndarray) -> np.ndarray:
        """[n, P] per pattern -> stage-major [pp, n] (a view where nothing repeats)."""
        return values.T if self.identity else np.ascontiguousarray(values.T)[self.pattern_of]

    def combine_by_stage(self, total: np.ndarray, values: np.ndarray, operation: np.ufunc = np.add) -> None:
        """``total`` (stage-major [pp, n]) = operation(``total``, ``values`` [n, P] per pattern):
        the figures of ``operation(total, by_stage(values))``, stage by stage, in place, without
        a [pp, n] temporary."""
        if self.identity:
            operation(total, values.T, out=total)
            return
        rows = np.ascontiguousarray(values.T)
        for stage, pattern in enumerate(self.pattern_of.tolist()):
            operation(total[stage], rows[pattern], out=total[stage])


@lru_cache(maxsize=1024)
def _group_shape(
    model: ModelSpec, schedule: str, pp: int, vpp: int, stage_layers: tuple[int, ...] | None,
    embedding_as_layer: bool, output_as_layer: bool, hands_over_enabled: bool, distinct: bool,
) -> _GroupShape:
    """The placement and its per-pattern constants (``distinct`` False: one pattern per stage,
    as the breakdown by kind needs every stage's own columns)."""
    placement = place_layers(
        model, pp, vpp, schedule, stage_layers, embedding_as_layer=embedding_as_layer, output_as_layer=output_as_layer,
    )
    virtual = pp * vpp
    full_on_stage = np.zeros((pp, virtual))
    full_on_stage[placement.stage_of, np.arange(virtual)] = 1.0
    table = _chunk_table(placement)
    # Virtual stage v receives activations from v - 1 (gradients from v + 1) over the network
    # only where that neighbour runs on another rank.
    receives_from_peer = np.zeros(virtual, dtype=bool)
    receives_from_peer[1:] = placement.stage_of[1:] != placement.stage_of[:-1]
    sends_to_peer = np.zeros(virtual, dtype=bool)
    sends_to_peer[:-1] = placement.stage_of[:-1] != placement.stage_of[1:]
    # At a V schedule's turn the chunk hands its output (and the next one its input gradient)
    # over on the same rank, by reference: the receiving side keeps that tensor until the step
    # ends, so it stays from that micro-batch's F (B) on.
    hands_over = hands_over_enabled and schedule in V_SHAPE and virtual > 1
    hands_forward = np.zeros(virtual, dtype=bool)
    hands_backward = np.zeros(virtual, dtype=bool)
    if hands_over:
        hands_forward[:-1] = ~sends_to_peer[:-1]
        hands_backward[1:] = ~receives_from_peer[1:]
    first = (np.arange(virtual) == 0).astype(float)
    last = (np.arange(virtual) == virtual - 1).astype(float)
    features = np.stack([placement.dense_layers, placement.moe_layers, first, last, receives_from_peer,
                         sends_to_peer, hands_forward, hands_backward], axis=1).astype(float)
    seen: dict[tuple[Any, ...], int] = {}
    pattern_of = np.empty(pp, dtype=np.intp)
    for s in range(pp):
        signature = (*features[table[s]].ravel().tolist(), s == pp - 1) if distinct else (s,)
        pattern_of[s] = seen.setdefault(signature, len(seen))
    reps = np.array([next(s for s in range(pp) if pattern_of[s] == p) for p in range(len(seen))], dtype=np.intp)
    used = unique(table[reps])
    chunks = np.searchsorted(used, table[reps])
    on_stage = np.zeros((len(reps), len(used)))
    on_stage[np.repeat(np.arange(len(reps)), vpp), chunks.ravel()] = 1.0
    moe = placement.moe_layers[used]
    for array in (full_on_stage, pattern_of, reps, used, chunks, on_stage):
        array.flags.writeable = False
    return _GroupShape(
        placement=placement, full_on_stage=full_on_stage, reps=reps, pattern_of=pattern_of, used=used,
        chunks=chunks, on_stage=on_stage, dense=placement.dense_layers[used], moe=moe,
        first=first[used], last=last[used], receives_from_peer=receives_from_peer[used],
        sends_to_peer=sends_to_peer[used], hands_forward=hands_forward[used],
        hands_backward=hands_backward[used], moe_per_stage=on_stage @ moe, turn=int(pattern_of[pp - 1]),
    )


def _chunk_table(placement: Placement) -> np.ndarray:
    """[pp, vpp]: the virtual stage that runs as chunk c of stage s."""
    table = np.empty((int(placement.stage_of.max()) + 1, int(placement.chunk_of.max()) + 1), dtype=np.int64)
    table[placement.stage_of, placement.chunk_of] = np.arange(len(placement.stage_of))
    return table


def _chunk_column(values: np.ndarray, chunks: np.ndarray, c: int) -> np.ndarray:
    """Per stage [n, pp], the value [n, pp·vpp] of its chunk c (``values`` itself where the
    virtual stages are the stages in order: one chunk each)."""
    if chunks.shape[1] == 1 and np.array_equal(chunks[:, 0], np.arange(len(chunks))):
        return values
    return values[:, chunks[:, c]]


def _largest_chunks(values: np.ndarray, chunks: np.ndarray, vpp: int, count: int = ACTIVE_CHUNKS) -> np.ndarray:
    """Per stage [n, pp], the sum of its ``count`` largest chunks' values [n, pp·vpp]: what
    torch.distributed.pipelining keeps gathered at once of a rank's FSDP chunks (schedule.unshard)."""
    per_chunk = np.stack([_chunk_column(values, chunks, c) for c in range(vpp)], axis=-1)
    return np.sort(per_chunk, axis=-1)[..., -count:].sum(axis=-1)


def _to_stages(values: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """Per stage [n, pp], the sum of its chunks' values [n, pp·vpp] (``chunks`` from
    ``_chunk_table``; may be ``values`` itself: do not write to it)."""
    total = _chunk_column(values, chunks, 0)
    for c in range(1, chunks.shape[1]):
        total = total + values[:, chunks[:, c]]
    return total


# --------------------------------------------------------------------------- main entry
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
    the model reads share a row (``_alike``)."""
    # Within a group, rows by micro-batch count: each count's schedule frontier prices a slice.
    groups, group_of = _shape_groups(batch)
    order = np.concatenate([rows for _, rows in groups])
    sizes = [len(rows) for _, rows in groups]
    starts = np.cumsum([0, *sizes])
    priced_row: np.ndarray | None = None  # per row of ``order``, its row of ``priced``
    priced, priced_sizes = order, sizes  # the rows of ``batch`` priced, group by group
    if not static_only:
        # The static state depends on STATE_FIELDS alone: priced once per combination
        # (``_SharedStatic``), numbered by the fields' values, whatever the rows' order.
        static_code, alike = _alike(model, batch, options, groups, stage_layers, group_of)
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
    # the first row's value stands for every row's, as ``_alike``'s kinds let any row stand for
    # the rows that differ only in them).
    ordered = StrategyBatch(**{
        name: _repeated(np.array([key[PIPELINE_SHAPE.index(name)] for key, _ in groups], dtype=np.int64), priced_sizes)
        if name in PIPELINE_SHAPE else _gathered(getattr(batch, name), priced, unread=name in UNREAD_FIELDS)
        for name in batch.array_fields()
    }, precision=batch.precision, recompute_modules=batch.recompute_modules, offload_modules=batch.offload_modules)
    parts = [slice(a, b) for a, b in itertools.pairwise(np.cumsum([0, *priced_sizes]).tolist())]
    statics: _SharedStatic | None = None
    if not static_only:
        # The bytes per token of each layer depend on a few fields: priced once per combination
        # of the rows priced (their fields gathered already, fewer rows than the batch's).
        distinct, combination = ordered.distinct(ACTIVATION_FIELDS)
        by_activations = ordered.take(distinct)
        acts = layer_activations(model, by_activations, options)
        # Only eager attention and SDPA's math path materialise the scores (most strategies: none).
        materialised = np.zeros(len(acts.output), dtype=bool)
        for kind in ("dense", "moe"):
            materialised |= np.broadcast_to(acts.attention_backward[kind], materialised.shape) > 0
        statics = _SharedStatic(model, ordered, options, stage_layers, [key for key, _ in groups], parts,
                                static_rows, static_code,
                                [bool(materialised.any()) and bool(materialised[combination[part]].any()) for part in parts])
    group_start = np.cumsum([0, *(len(index) for _, index in groups)]).tolist()  # each group's start in ``order``

    def evaluation(g: int) -> Generator[_FsdpRequest, tuple[FsdpPhases, np.ndarray], dict[str, np.ndarray]]:
        part = parts[g]
        return _group_evaluation(model, ordered.take(part), options, groups[g][0], np.arange(part.start, part.stop),
                                 None, stage_layers, None, device_only=device_only,
                                 static=None if statics is None else statics.of(g), limit=limit,
                                 combinations=None if static_only else _Combinations(acts, by_activations,
                                                                                     combination[part]))

    def result(g: int, out: dict[str, np.ndarray]) -> tuple[tuple[int, ...], np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        (key, index), start = groups[g], group_start[g]
        return key, index, out, None if priced_row is None else priced_row[start:start + len(index)] - parts[g].start

    # The groups that place their layers alike (``_SharedStatic``) are evaluated side by side, up
    # to their FSDP unit moments, which are priced together (``_fsdp_moments``), then each to its
    # end (1M mixed DeepSeek-V3 strategies: 21 calls of a few hundred numpy operations each over
    # 23,813 distinct sharded rows, instead of 55 over 57,030: rows alike across groups are found).
    side_by_side: dict[Any, list[int]] = {}
    for g in range(len(groups)):
        side_by_side.setdefault(g if statics is None else statics.placement_of[g], []).append(g)
    for members in side_by_side.values():
        outs: dict[int, dict[str, np.ndarray]] = {}
        waiting: dict[int, tuple[Generator[_FsdpRequest, tuple[FsdpPhases, np.ndarray], dict[str, np.ndarray]],
                                 _FsdpRequest]] = {}
        for g in members:
            run = evaluation(g)
            try:
                waiting[g] = run, next(run)
            except StopIteration as done:  # (no strategy of the group is sharded)
                outs[g] = done.value
        if waiting:
            moments = _fsdp_moments([request for _, request in waiting.values()])
            for (g, (run, _)), answer in zip(waiting.items(), moments, strict=True):
                try:
                    run.send(answer)
                except StopIteration as done:
                    outs[g] = done.value
        for g in members:
            yield result(g, outs[g])


class _SharedStatic:
    """The static states of the pipeline-shape groups of an ordered batch (``keys``, rows
    ``parts`` of ``ordered``; ``scores``: per group, whether it materialises attention scores),
    each priced once per combination of STATE_FIELDS (the combinations numbered ``codes``, a row
    of each at ``rows``: ``_group_combinations``) and shared by the groups whose pipeline shapes
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
        self.combinations = [_group_combinations(rows, codes, part) for part in parts]
        self.parts = parts
        self.shapes: list[_GroupShape] = []
        self.members: dict[tuple[Any, ...], list[int]] = {}  # placement -> its groups (with combinations)
        self.placement_of: list[tuple[Any, ...]] = []
        for g, key in enumerate(keys):
            shape = _group_shape(model, CODES["schedule"][key[0]], key[1], key[2], stage_layers, bool(key[4]),
                                 bool(key[5]), hands_over_enabled, True)
            self.shapes.append(shape)
            self.placement_of.append(_shape_signature(shape))
            if self.combinations[g] is not None:
                self.members.setdefault(self.placement_of[g], []).append(g)
        self.priced: dict[tuple[Any, ...], tuple[_StaticState, list[int]]] = {}  # placement -> (state, offsets)

    def of(self, g: int) -> _StaticState | None:
        """Group ``g``'s static state, its index its rows' combinations (None: the group prices its own)."""
        combinations = self.combinations[g]
        if combinations is None:
            return None
        signature = self.placement_of[g]
        members = self.members[signature]
        if signature not in self.priced:
            rows = np.concatenate([self.parts[m].start + self.combinations[m][0] for m in members])  # type: ignore[index]
            state = _static_state(self.model, self.ordered.take(rows), self.options, self.shapes[g],
                                  scores=any(self.scores[m] for m in members))
            sizes = [len(self.combinations[m][0]) for m in members]  # type: ignore[index]
            self.priced[signature] = state, np.cumsum([0, *sizes]).tolist()
        state, offsets = self.priced[signature]
        at = members.index(g)
        if at == len(members) - 1:
            del self.priced[signature]  # (its groups come in order: none asks again)
        return replace(state, index=combinations[1] + offsets[at])


def _shape_groups(batch: StrategyBatch) -> tuple[list[tuple[tuple[int, ...], np.ndarray]], np.ndarray | None]:
    """``batch.groups(PIPELINE_SHAPE)`` (the groups in the order of their keys) with each group's
    rows in the order of their micro-batch counts (a stable sort: ascending within a count), and
    per strategy its group's number (None where the groups come from ``batch.groups``).

    One stable sort of every strategy by (its group's rank, its micro-batch count's rank), a
    radix sort where the pairs fit 16 bits, gives the same order as grouping and then sorting
    each group by count (1M mixed DeepSeek-V3 strategies, 55 groups of 12 counts: 43 -> 21 ms;
    Llama-3.1-405B's 561k: 31 -> 13 ms)."""
    columns = [getattr(batch, name) for name in PIPELINE_SHAPE]
    if len(batch):
        key = np.zeros(len(batch), dtype=np.int64)
        for column in columns:  # (as batch.groups packs them: the first field the most significant)
            key <<= max(int(column.max()).bit_length(), 1)
            key |= column
        group_of, group_count = dense_codes(key)
        counts, count_count = dense_codes(batch.num_micro_batches)
        if group_count * count_count <= 1 << 16:
            pair = group_of * count_count
            pair += counts
            order = np.argsort(radix_key(pair), kind="stable")
            sizes = np.bincount(pair, minlength=group_count * count_count).reshape(group_count, count_count).sum(axis=1)
            bounds = np.cumsum([0, *sizes.tolist()]).tolist()
            return [(tuple(int(column[order[a]]) for column in columns), order[a:b])
                    for a, b in itertools.pairwise(bounds)], group_of
    groups = batch.groups(PIPELINE_SHAPE)
    return [(key, index[np.argsort(radix_key(batch.num_micro_batches[index]), kind="stable")])
            for key, index in groups], None


def _shape_signature(shape: _GroupShape) -> tuple[Any, ...]:
    """What of a group's shape its static state reads, by value: the placement and the patterns."""
    arrays = (shape.placement.dense_layers, shape.placement.moe_layers, shape.placement.stage_of,
              shape.placement.chunk_of, shape.pattern_of, shape.used, shape.chunks, shape.dense, shape.moe,
              shape.first, shape.last)
    return tuple((array.dtype.str, array.shape, array.tobytes()) for array in arrays)


#: The fields ``_alike`` gives ``distinct_columns`` first after STATE_FIELDS. Their order changes
#: how the kinds are numbered (not which strategies are alike) and how often the key of the
#: combinations so far is renumbered on the way: these few-valued fields, then the micro-batch
#: count, renumber it twice, the second time at 155k combinations, where the batch's own order
#: renumbered three times at up to 620k (1M mixed DeepSeek-V3 strategies: distinct_columns 47-49
#: -> 42 ms, the same kinds; Llama-3.1-405B's 561k: 23-25 -> 23 ms).
_KIND_FIELDS_FIRST = ("sequence_parallel", "recompute", "num_micro_batches", "micro_batch_size", "cp_kind", "seq_length")


def _alike(
    model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, groups: list[tuple[tuple[int, ...], np.ndarray]],
    stage_layers: tuple[int, ...] | None, group_of: np.ndarray | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """Per strategy of ``batch`` (in the pipeline-shape ``groups``: (key, rows)), its combination
    of STATE_FIELDS (as ``batch.distinct`` numbers them); and (a row of each kind of strategies
    alike in every field the model reads, per strategy its kind), or None where fewer than one
    in twenty of the strategies is alike another (so few rows less would not pay for gathering
    the fields and the figures by the kinds).

    A kind is a combination of every field but UNREAD_FIELDS and the context-parallel kind, and
    of that where the model reads it (``_cp_kind_read``): a search prices its candidates' step
    times in each kind of context parallelism, whose exchange is mostly not the largest buffer;
    a mixed batch holds strategies with and without ``fsdp`` (on 1M DeepSeek-V3 strategies,
    908k kinds with it, 863k without; 656k Llama-3.1-405B ones, 516k and 418k). Every figure
    of a strategy is a function of those fields, computed row by row: a row of each kind stands
    for the others, bit for bit. STATE_FIELDS come first, their combinations found on the way."""
    hands_over_enabled = bool(options.profile.pipeline_stage_output)
    # Per strategy its group's number: the groups come in the order of their keys (the
    # pipeline shape's values, the first field the most significant), so the numbers rank the
    # shapes as the six fields do, and a column of them numbers the combinations as those
    # fields would, with five columns' passes less (1M mixed DeepSeek-V3 strategies: ~4 ms).
    # (``group_of``: the groups' numbers where the caller has them.)
    keys = [key for key, _ in groups]
    in_key_order = all(a < b for a, b in itertools.pairwise(keys))
    numbered = group_of is None
    group_number = np.empty(len(batch), dtype=np.int64) if group_of is None else group_of
    all_moe_of = np.empty(len(groups), dtype=bool)
    for g, (key, rows) in enumerate(groups):
        shape = _group_shape(model, CODES["schedule"][key[0]], key[1], key[2], stage_layers, bool(key[4]),
                             bool(key[5]), hands_over_enabled, True)
        all_moe_of[g] = bool((shape.moe_per_stage > 0).all())
        if numbered:
            group_number[rows] = g
    read = _cp_kind_read(model, batch, options, all_moe_of[group_number])
    # The fields past STATE_FIELDS, in the order ``_KIND_FIELDS_FIRST`` leads with.
    others = {name: getattr(batch, name) for name in batch.array_fields()
              if name not in STATE_FIELDS and name not in UNREAD_FIELDS and name != "cp_kind"}
    others["cp_kind"] = np.where(read, batch.cp_kind, -1)
    others = {**{name: others.pop(name) for name in _KIND_FIELDS_FIRST}, **others}
    state_columns = _state_columns(batch)
    if in_key_order:
        state_columns = [group_number, *state_columns[len(PIPELINE_SHAPE):]]
    rows, kinds, static_code = distinct_columns([*state_columns, *others.values()], len(batch),
                                                prefix=len(state_columns))
    assert static_code is not None
    return static_code, None if 20 * len(rows) > 19 * len(batch) else (rows, kinds)


def _group_combinations(rows: np.ndarray, codes: np.ndarray, part: slice) -> tuple[np.ndarray, np.ndarray] | None:
    """``StrategyBatch.distinct``'s (a row of each combination, each row's combination) of the
    rows ``part`` alone, from those of the whole batch, whose combinations are numbered in the
    order of the fields' values: the pipeline shape, a group's key, comes first among
    STATE_FIELDS, so a group's combinations are one run of numbers, [low, high): checked, as
    every number of the run has its row in the group; None where that fails."""
    if part.start == part.stop:
        return None
    group_codes = codes[part]
    low, high = int(group_codes.min()), int(group_codes.max()) + 1
    group_rows = rows[low:high]
    if group_rows.min() < part.start or group_rows.max() >= part.stop:
        return None
    return group_rows - part.start, group_codes - low


def _gathered(values: np.ndarray, order: np.ndarray, *, unread: bool = False) -> np.ndarray:
    """values[order] (``ndplan.arrays.gathered``: from an int32 copy where the values fit, the
    one value broadcast where they hold one), or the first value broadcast (read-only) where the
    field is ``unread`` (1M mixed strategies: three fields' gathers less)."""
    if len(values) and unread:
        return np.broadcast_to(values[:1], (len(order),))
    return gathered(values, order)


def _repeated(values: np.ndarray, counts: list[int]) -> np.ndarray:
    """np.repeat(values, counts), or the one value broadcast (read-only) where all are one."""
    if len(values) and _one_value(values):
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
            if "stages" in out:  # the stages priced (``_pattern_leaders``), the others never the first peak
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


def _static_state(
    model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, shape: _GroupShape, *, scores: bool,
    kinds: dict[str, dict[str, np.ndarray]] | None = None, index: np.ndarray | None = None,
) -> _StaticState:
    """``_StaticState`` of a group's strategies (``scores``: with ``mlp_grads``); with ``kinds``,
    each kind's parameters, gradients and optimizer states are added to the breakdown's rows
    ``index``."""
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
    offload = batch.optimizer_offload[:, None] > 0
    states = {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes}
    out: dict[str, np.ndarray] = {}
    # Sum the kinds first: the search needs only totals, the breakdown prices each kind alike.
    n = len(batch)
    non_expert_total = _outer_sum(non_expert_terms, n, computed)
    expert_total = _outer_sum(expert_terms, n, computed)
    non_expert_stage, expert_stage = _to_stages(non_expert_total, chunks), _to_stages(expert_total, chunks)
    whole_embedding_grad_tp = makes_whole_embedding_grad(options.profile, batch.tp, batch.zero)
    grads_virtual = np.zeros((n, computed), order="F")
    for category, width in states.items():
        non_expert_div = getattr(shards, category)[:, None]
        expert_div = getattr(shards, f"expert_{category}")[:, None]
        if category == "grads":
            value = non_expert_total * (width / non_expert_div) + expert_total * (width / expert_div)
            # DTensor: once a second micro-batch's embedding gradient is added, the accumulated
            # gradient is the whole table, not the rank's vocabulary shard.
            whole_embedding_extra = whole_embedding_grad_extra(
                model, options.profile, batch.tp, batch.zero, batch.micro_batches_per_step) * width
            value[:, 0] += whole_embedding_extra
            grads_virtual = value
            value = _to_stages(value, chunks)
        else:
            value = non_expert_stage * (width / non_expert_div) + expert_stage * (width / expert_div)
        out[category] = np.where(offload, 0.0, value) if category == "optimizer" else value
        if kinds is None:
            continue
        for static_kind in STATIC_KINDS:
            elements_bytes = (
                _outer_sum([term for term in non_expert_terms if term[0] == static_kind], n, computed) * width / non_expert_div
                + _outer_sum([term for term in expert_terms if term[0] == static_kind], n, computed) * width / expert_div)
            if category == "grads" and static_kind == "embedding":
                elements_bytes[:, 0] += whole_embedding_extra  # the whole table's gradient is the embedding's
            share = _to_stages(elements_bytes, chunks)
            kinds["static"][static_kind][index, :pp] += shape.expand(
                np.where(offload, 0.0, share) if category == "optimizer" else share)

    # The quantised copies of the linear weights an fp8 runtime keeps across micro-batches: part
    # of the weights on the device (params).
    cache_factor = fp8_weight_cache_width(options.profile, precision.compute_dtype, batch.zero)[:, None]
    if cache_factor.any():
        linear = linear_weight_elements(model, tp, ep, etp)
        layers_of = {"dense": dense_layers, "moe": moe_layers}
        cache_terms: list[StaticTerm] = [(part, elements, layers_of[linear_kind])
                                         for linear_kind, parts in linear.items() for part, elements in parts.items()]
        cache_terms.append(("mtp", model.mtp_depth * (sum(linear[mtp_kind].values()) + mtp_extra_linear_elements(model, tp)),
                            last_virtual))
        out["params"] = out["params"] + _to_stages(_outer_sum(cache_terms, n, computed) * cache_factor, chunks)
        if kinds is not None:
            for static_kind in STATIC_KINDS:
                share = _outer_sum([term for term in cache_terms if term[0] == static_kind], n, computed) * cache_factor
                kinds["static"][static_kind][index, :pp] += shape.expand(_to_stages(share, chunks))

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
                       + model.mtp_depth * layers.expert[mtp_kind] * grad_bytes / shards.expert_grads)
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
    made_by_now = (batch.micro_batches_per_step == 1) & ~deferred & profile.grads_created_in_backward
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
                           + experts * (grad_bytes / shards.expert_grads))
    # Replicas without ZeRO or FSDP run DDP: where the runtime's reducer keeps buckets apart from
    # the gradients (PyTorch's, gradient_as_bucket_view off), they are as large again, allocated
    # when DDP wraps the model and kept (the comm buffers of every phase).
    ddp_buckets = (non_expert_stage + expert_stage) * ddp_bucket_width(profile, grad_bytes, batch.zero, batch.dp,
                                                                       batch.cp)[:, None]
    params_optimizer = out["params"] + out["optimizer"]
    # The optimizer step's temporaries of the update, in the dtype of the weights it updates.
    updated_bytes = precision.master_weight_bytes or precision.param_bytes
    optimizer_update = out["optimizer"] / max(optimizer_bytes, 1) * profile.optimizer_temp_copies * updated_bytes
    return _StaticState(
        params=out["params"], grads=out["grads"], optimizer=out["optimizer"], params_optimizer=params_optimizer,
        total=out["params"] + out["grads"] + out["optimizer"], optimizer_update=optimizer_update,
        grads_virtual=grads_virtual,
        unit_elements={kind: non_expert + expert for kind, (non_expert, expert) in unit_parts.items()}
        | {"tied": table * (model.tie_word_embeddings & ~apart)},
        unit_grads={kind: np.where(made_by_now, non_expert * grad_bytes / shards.grads
                                   + expert * grad_bytes / shards.expert_grads, 0.0)
                    for kind, (non_expert, expert) in unit_parts.items()},
        expert_elements=layers.expert["moe"], head_grad_bytes=head_grad_bytes, table_made_last=table_made_last,
        embedding_gradient=embedding_gradient, head_gradient=head_gradient, mlp_grads=mlp_grads,
        overhead=overhead_model(options.profile, batch, options.include_overhead),
        elements_virtual=non_expert_total + expert_total, stage_elements=non_expert_stage + expert_stage,
        ddp_buckets=ddp_buckets,
    )


@dataclass(frozen=True)
class _StaticState:
    """A group's parameters, gradients and optimizer states and what is made of them alone (all
    functions of STATIC_FIELDS), per combination of those fields: ``index`` gives each strategy's
    (None: one each, in order); ``at`` reads a figure per strategy.

    Per stage pattern [combinations, P] bytes: ``params``, ``grads`` and ``optimizer`` (0 where
    offloaded), ``params_optimizer`` = params + optimizer, ``total`` = params + grads +
    optimizer (summed in that order), ``optimizer_update`` = optimizer / max(optimizer bytes, 1)
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
    optimizer_update: np.ndarray
    grads_virtual: np.ndarray
    elements_virtual: np.ndarray
    stage_elements: np.ndarray
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


def _layer_working_set(acts: LayerActivations, recompute_on: np.ndarray, moe_here: bool,
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


def _mtp_module(acts: LayerActivations, kind: str, recompute_on: np.ndarray, full_recompute: np.ndarray,
                limited: np.ndarray) -> np.ndarray:
    """[n] bytes per token of an MTP module (its layer of MLP ``kind``) as the strategy keeps it;
    ``limited``: where full recompute has a limit (the block method, which skips the modules)."""
    layer = np.where(recompute_on & ~limited, acts.recomputed[kind], acts.full[kind])
    return np.where(full_recompute & ~limited, acts.mtp_checkpointed, acts.mtp_extra + layer)


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


def _layer_buffers(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, op_tokens: np.ndarray,
                   tokens: np.ndarray, pp: int, has_moe: np.ndarray, sp_div: np.ndarray) -> np.ndarray:
    """[n, P] bytes: the communication buffers alive while a layer runs (the sequence-parallel
    gather or the context-parallel K/V (Ulysses: Q/K/V/O) exchange, the larger, or on a stage
    with MoE layers the expert all-to-all's, if larger), and the pipeline's send and receive.

    The gather, the all-to-all and the pipeline's buffers carry the tokens of one op
    (``op_tokens``, a Seq1F1B sub-sequence's: ``_per_op``); the context-parallel exchange those of
    the micro-batch (``tokens``): under Seq1F1B a sub-sequence's attention reads the K/V of the
    sub-sequences before it, the last one the whole micro-batch's (no Seq1F1B implementation runs
    context parallelism to say otherwise: MindSpeed lists it as unsupported). ``sp_div``: tp
    where the activations are sequence-sharded, else 1."""
    act_bytes = batch.precision.activation_bytes
    h = model.hidden_size
    sp_gather, ep_buffers = _exchange_buffers(model, batch, options, op_tokens)
    cp_buffers = _cp_buffers(model, batch, tokens, batch.is_("cp_kind", "ulysses"))
    # Per stage max(gather or exchange, all-to-all where the stage holds MoE layers) + the
    # pipeline's buffers: two columns, one with the all-to-all and one without, each stage a copy
    # of its own (the bytes are finite and >= +0, so a stage without MoE layers, whose all-to-all
    # counts 0, takes the gather or exchange as it is; and without a pipeline nothing is added).
    without_moe = np.maximum(sp_gather, cp_buffers, out=sp_gather)
    with_moe = np.maximum(without_moe, ep_buffers, out=ep_buffers) if has_moe.any() else None
    if pp > 1:
        pp_buffers = 2 * op_tokens  # (in place, factor by factor in the order written: the same roundings)
        pp_buffers *= h
        pp_buffers *= act_bytes
        pp_buffers /= sp_div
        without_moe += pp_buffers
        if with_moe is not None:
            with_moe += pp_buffers
    # Column by column (see _outer_sum): the buffers alive while a layer runs, and with them the
    # pipeline's (the first two terms of the communication sum in _evaluate_group).
    buffers = np.empty((len(batch), len(has_moe)), order="F")
    for column, moe_here in enumerate(has_moe.tolist()):
        buffers[:, column] = with_moe if moe_here else without_moe
    return buffers


def _exchange_buffers(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions,
                      tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n] bytes of two of the buffers alive while a layer runs: the sequence-parallel gather
    (tokens · h · activation bytes) and, where the experts are spread over several ranks, the
    all-to-all dispatch and combine buffers (2 · tokens · top-k · h · activation bytes · the
    routed-token factor)."""
    act_bytes = batch.precision.activation_bytes
    h = model.hidden_size
    # (Products worked out in place, factor by factor in the order written: the same roundings,
    # fewer [n] temporaries; times 0 where a buffer does not exist, 0.0 as np.where gives: the
    # bytes are finite and not negative.)
    sp_gather = tokens * h
    sp_gather *= act_bytes
    sp_gather *= batch.sequence_parallel > 0
    if options.moe_dispatcher == "allgather":
        return sp_gather, allgather_dispatch_bytes(model, batch, tokens)[1]
    # All-to-all dispatch and combine buffers exist only across an expert-parallel group.
    ep_buffers = 2 * tokens
    for factor in (model.num_experts_per_tok, h, act_bytes, options.routed_token_factor):
        ep_buffers *= factor
    ep_buffers *= batch.ep > 1
    return sp_gather, ep_buffers


#: Bytes per element of the allgather dispatcher's combine: MoEAllGatherTokenDispatcher casts
#: the un-permuted output to the routing probabilities' dtype before its reduce-scatter
#: (``hidden_states.to(self.local_probs.dtype)``), fp32 as the profile's router keeps them
#: (``router_logits``, ``permuted_probs``: 4 bytes), and back to the activation dtype after.
ALLGATHER_COMBINE_BYTES = 4


def allgather_dispatch_bytes(model: ModelSpec, batch: StrategyBatch, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n] bytes of Megatron-Core's allgather token dispatcher (MoEAllGatherTokenDispatcher) for
    ``tokens`` of one op (a micro-batch's, unsharded): (its persistent buffer, its working set).

    A rank routes its own r tokens (tokens / tp under SP, all without TP; ``routes_own_tokens``)
    and the dispatcher gathers the G = r·etp·ep tokens of the expert-TP x EP group
    (gather_from_sequence_parallel_region over tp_ep_group), whatever the routing:

    * the gathered hidden states go into Megatron's global memory buffer
      (``use_global_buffer=True``), allocated at the first MoE layer's forward and kept for
      the run: G·h·activation bytes, beside every other tensor (static);
    * the combine un-permutes the experts' output into G rows (G·h·activation bytes), casts
      them to fp32 (G·h·4) and reduce-scatters that to the r rows of the rank (r·h·4) before
      the cast back; the backward runs the same shapes mirrored (the gradient's fp32 all-gather
      into G rows and its cast), so the working set while a layer runs is
      G·h·(activation bytes + 4) + r·h·4.

    Both are 0 where the group is one rank (etp·ep = 1: no gather)."""
    act_bytes = batch.precision.activation_bytes
    h = model.hidden_size
    tp, etp, ep = batch.tp.astype(float), batch.etp.astype(float), batch.ep.astype(float)
    own = tokens / np.where(routes_own_tokens(batch.sequence_parallel, tp) & (tp > 1), tp, 1.0)
    gathered = own * etp * ep
    group = (etp * ep) > 1
    persistent = np.where(group, gathered * h * act_bytes, 0.0)
    working = np.where(group, gathered * h * (act_bytes + ALLGATHER_COMBINE_BYTES) + own * h * ALLGATHER_COMBINE_BYTES,
                       0.0)
    return persistent, working


def _cp_buffers(model: ModelSpec, batch: StrategyBatch, tokens: np.ndarray, ulysses: Any) -> np.ndarray:
    """[n] bytes of the context-parallel exchange while a layer runs: per token 2 · (K + V)
    widths, under Ulysses (``ulysses``: bool, or per strategy) 2 · (Q + K + V + O), times the
    activation bytes / tp; 0 without context parallelism."""
    widths = model_symbols(model)
    per_token = np.where(ulysses, 2 * (widths["q"] + widths["k"] + widths["v"] + widths["o"]),
                         2 * (widths["k"] + widths["v"]))
    exchange = per_token * tokens  # (in place below, as in _exchange_buffers)
    exchange *= batch.precision.activation_bytes
    exchange /= batch.tp.astype(float)
    exchange *= batch.cp > 1
    return exchange


def _cp_kind_read(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, all_moe: np.ndarray) -> np.ndarray:
    """[n] bool: the strategies whose figures depend on their context-parallel kind, which the
    model reads only in the buffers alive while a layer runs (``_layer_buffers``): per stage
    max(sequence-parallel gather, context-parallel exchange, expert all-to-all where the stage
    holds MoE layers), the same bits whatever the kind without context parallelism, or where
    every kind's exchange is no larger than the larger other buffer on every stage
    (``all_moe`` [n]: every stage of the strategy's pipeline holds MoE layers; else the gather
    alone). The largest exchange is Ulysses' (Q and O on top of K and V per token): the same
    products of positive numbers, with a larger first factor, rounded, are no smaller."""
    tokens = (batch.micro_batch_size * batch.seq_length).astype(float)
    tokens /= batch.cp.astype(float)
    # As _layer_buffers reads them: the gather and the all-to-all per op (tokens / seq_chunks,
    # the same bits as _per_op's), the exchange per micro-batch.
    sp_gather, ep_buffers = _exchange_buffers(model, batch, options, tokens / batch.seq_chunks)
    largest = _cp_buffers(model, batch, tokens, True)
    ep_buffers *= all_moe
    floor = np.maximum(sp_gather, ep_buffers, out=sp_gather)
    return (batch.cp > 1) & ~(largest <= floor)


def _receive_buffers(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions, shape: _GroupShape,
                     tokens: np.ndarray, sp_div: np.ndarray) -> np.ndarray:
    """[n, P] bytes: the receive buffers torch.distributed.pipelining allocates up front, one per
    micro-batch, for the activations a later chunk receives and the gradients an earlier chunk
    receives; they stay for the whole step, the optimizer's included. Chunks next to each other
    on one rank (a V schedule's turn) hand tensors over directly: their up-front buffers are
    replaced by the tensors themselves. Zero for runtimes that keep no stage outputs. ``sp_div``:
    tp where the activations are sequence-sharded, else 1."""
    n, patterns = len(batch), len(shape.reps)
    virtual = len(shape.pattern_of) * shape.chunks.shape[1]
    if not (options.profile.pipeline_stage_output and virtual > 1):
        return np.zeros((n, patterns), order="F")
    directions = shape.receives_from_peer.astype(float) + shape.sends_to_peer
    one_receive = batch.num_micro_batches * tokens * model.hidden_size * batch.precision.activation_bytes / sp_div
    # Column by column (see _outer_sum): the same products, in passes over the strategies.
    receive_virtual = np.empty((n, len(directions)), order="F")
    for column, direction in enumerate(directions.tolist()):
        receive_virtual[:, column] = one_receive * direction
    return _to_stages(receive_virtual, shape.chunks)


@dataclass(frozen=True)
class _FsdpRequest:
    """A group's FSDP unit moments to price (``_fsdp_unit_phases``' arguments): its sharded
    rows' ``inputs``."""

    placement: Placement
    on_stage: np.ndarray
    stages: np.ndarray
    gather_bytes: int
    inputs: dict[str, Any]


def _fsdp_moments(requests: list[_FsdpRequest]) -> list[tuple[FsdpPhases, np.ndarray]]:
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
    static: _StaticState | None = None,
    limit: float | None = None,
) -> dict[str, np.ndarray]:
    """``_group_evaluation`` of one group alone, its FSDP unit moments priced on its own."""
    run = _group_evaluation(model, batch, options, key, index, kinds, stage_layers, acts, device_only=device_only,
                            static=static, limit=limit)
    try:
        request = next(run)
        run.send(_fsdp_moments([request])[0])
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
    static: _StaticState | None = None,
    limit: float | None = None,
    combinations: _Combinations | None = None,
) -> Generator[_FsdpRequest, tuple[FsdpPhases, np.ndarray], dict[str, np.ndarray]]:
    """(A generator: where the group has sharded strategies it yields their FSDP unit moments'
    arguments, ``_FsdpRequest``, to be sent (the moments, and per sharded strategy its row of
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

    Every term but the held activations is computed per stage pattern (see ``_GroupShape``):
    arrays [n, P] over patterns and [n, U] over the virtual stages they run, expanded to the pp
    stages where the held peak joins them.

    Those arrays are column-major (order="F"): they are filled and read column by column (see
    ``_outer_sum``), and a column-major column is contiguous, where a row-major one is strided
    through every cache line of the array; their transposes, the stage-major [P, n] rows that
    the held peak and ``_GroupShape.by_stage`` take, are then contiguous too. Elementwise
    results keep their operands' layout (one row-major operand makes them row-major), so the
    arrays made here are made column-major."""
    schedule_code, pp, vpp, seq_chunks, embedding_as_layer, output_as_layer = key
    schedule = CODES["schedule"][schedule_code]
    hands_over_enabled = bool(options.profile.pipeline_stage_output)
    shape = _group_shape(model, schedule, pp, vpp, stage_layers, bool(embedding_as_layer), bool(output_as_layer),
                         hands_over_enabled, kinds is None)
    placement = shape.placement
    virtual = pp * vpp
    computed, patterns = len(shape.used), len(shape.reps)  # virtual stages and stage patterns priced
    on_stage, chunks = shape.on_stage, shape.chunks
    first_stage, last_stage = on_stage[:, 0], on_stage[:, -1]
    receives_from_peer = shape.receives_from_peer
    hands_over = hands_over_enabled and schedule in V_SHAPE and virtual > 1
    hands_forward, hands_backward = shape.hands_forward, shape.hands_backward
    moe_per_stage = shape.moe_per_stage
    dense_layers, moe_layers = shape.dense, shape.moe  # per virtual stage computed

    precision = batch.precision
    tp, etp, cp = batch.tp.astype(float), batch.etp.astype(float), batch.cp.astype(float)
    grad_bytes = precision.grad_bytes
    n = len(batch)
    first_virtual, last_virtual = shape.first, shape.last
    mtp_kind = model.mtp_mlp_kind
    # The layer activations' figures by combination (see ``_Combinations``; per strategy where
    # the caller has no combinations).
    by_combination = combinations or (_Combinations(acts, batch, None) if acts is not None else None)
    # Only eager attention and SDPA's math path materialise the scores (most strategies: none):
    # looked for among the group's combinations where some has them.
    scores = by_combination is not None and any(
        bool(np.any(positive)) and bool(np.any(by_combination.rows(positive)))
        for positive in (by_combination.acts.attention_backward[k] > 0 for k in ("dense", "moe")))
    if static is None:
        static_of = batch.distinct(STATIC_FIELDS) if by_combination is not None and kinds is None else None
        if static_of is None or 2 * len(static_of[0]) > n:
            static = _static_state(model, batch, options, shape, scores=scores, kinds=kinds, index=index)
        else:
            # The static state is a function of STATIC_FIELDS, which a group's strategies share
            # many at a time (they differ in micro-batch size, recompute, sequence parallelism,
            # ...): priced once per combination and read through its index, where that is much
            # less than the group.
            static = replace(_static_state(model, batch.take(static_of[0]), options, shape, scores=scores),
                             index=static_of[1])
    overhead = replace(static.overhead, fixed_bytes=static.at(static.overhead.fixed_bytes))
    out: dict[str, np.ndarray] = {}

    if by_combination is None:
        # allocated >= params + grads + optimizer, and the device total grows with allocated.
        return {"device": shape.expand(overhead.reserved(static.at(static.total)) + overhead.fixed_bytes[:, None])}

    # ---- activations held across the schedule
    # (The figures of the layer activations and ACTIVATION_FIELDS alone worked out per
    # combination and gathered: 1M mixed DeepSeek-V3 strategies, at most 192 combinations.)
    table, table_recompute_on = by_combination.acts, by_combination.recompute_on()
    table_tp = by_combination.batch.tp.astype(float)
    tokens = (batch.micro_batch_size * batch.seq_length).astype(float) / cp
    recompute_on = ~batch.is_("recompute", "none")
    # Sequence parallelism shards the activations between layers over tp.
    table_sp_div = np.where(by_combination.batch.sequence_parallel > 0, table_tp, 1.0)
    sp_div = by_combination.rows(table_sp_div)
    t = tokens[:, None]
    # What one forward, backward or loss runs on (``_per_op``): a micro-batch, or under Seq1F1B
    # one of its seq_chunks sub-sequences, tokens / seq_chunks. The held activations stay per
    # micro-batch: the schedule counts a held sub-sequence as 1/seq_chunks of one.
    op_tokens = _per_op(tokens, seq_chunks)
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
    if limited.size or kinds is not None:
        # With a limit, only the first recompute_layers layers of each chunk are recomputed.
        rows = np.arange(len(batch)) if kinds is not None else limited
        plain_dense, plain_moe, recomputed_dense, recomputed_moe = _recomputed_layers(
            recompute_on[rows], batch.recompute_layers[rows], dense_layers, moe_layers)
        full, recomputed = by_combination.taken.full, by_combination.taken.recomputed
        plain = t[rows] * (plain_dense * full["dense"][rows, None] + plain_moe * full["moe"][rows, None])
        layers_held[rows] = plain + t[rows] * (
            recomputed_dense * recomputed["dense"][rows, None] + recomputed_moe * recomputed["moe"][rows, None]
        )
        if limited.size:
            plain_held = np.zeros((len(batch), computed))
            plain_held[rows] = np.where(recompute_on[rows, None], plain, 0.0)
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
        mtp_module = _mtp_module(by_combination.taken, mtp_kind, recompute_on, full_recompute, mtp_limited)
    else:  # (no limit read: a figure of the combinations)
        table_full_recompute = by_combination.batch.is_("recompute", "full")
        mtp_module = by_combination.rows(_mtp_module(table, mtp_kind, table_recompute_on, table_full_recompute,
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
    if _prices_sdpa_mask(model, options):
        checkpoint_mask = np.where(recompute_on, _sdpa_mask_bytes(model, batch, options), 0.0)
        checkpoint_mask_virtual = np.multiply(checkpoint_mask[:, None], ((dense_layers + moe_layers) > 0).astype(float),
                                              out=np.empty((n, computed), order="F"))
        per_b_virtual += checkpoint_mask_virtual
    profile = options.profile
    # Per virtual stage, for the breakdown by kind: the logits and the hidden states the pipeline
    # runtime keeps per micro-batch (below), the head's and the pipeline's.
    # (Zeros only where the breakdown by kind reads them: elsewhere an [n, U] fill for nothing.)
    kept_logits = kept_hidden = np.zeros_like(per_b_virtual) if kinds is not None else per_b_virtual[:, :0]
    if profile.pipeline_stage_output and virtual > 1:
        # A pipeline stage keeps its output until that micro-batch's backward: the hidden state
        # (sequence-sharded under SP) on every stage but the last, the logits on the last.
        vocab_div = table_tp if options.loss_parallel or (options.loss_parallel is None and profile.loss_parallel) else 1.0
        act_bytes = precision.activation_bytes
        # Every stage but the first also keeps the input it received, which needs a gradient;
        # where the previous chunk runs on the same rank (the turn of a V schedule) that input is
        # its output itself, passed by reference, already counted. Per virtual stage: the logits
        # and hidden states kept, per token, as counts times their elements per rank.
        logits_kept = last_virtual * ~hands_forward
        hidden_kept = (1.0 - last_virtual) * ~hands_forward + receives_from_peer
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
        if kinds is not None:
            kept_logits = np.multiply.outer(token_bytes * by_combination.rows(logits_per_token), logits_kept.astype(float))
            kept_hidden = np.multiply.outer(token_bytes * by_combination.rows(hidden_per_token),
                                            hidden_kept.astype(float))
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
    if grads_in_schedule:
        per_grads = static.at(static.grads_virtual)
        deferred_rows = np.flatnonzero(deferred)
        static_rows = np.flatnonzero(later_runs & ~deferred)
        if deferred_rows.size or static_rows.size:
            if static.index is None:  # (the static state's own array; gathered, it is a copy already)
                per_grads = per_grads.copy(order="F")
            per_grads[deferred_rows] = static.at(static.elements_virtual, deferred_rows) * (
                grad_bytes + _pending_split_grad_width(schedule, precision, profile, first_virtual)[None, :])
            per_grads[static_rows] = 0.0
        extra = [_chunk_column(per_grads, chunks, c) for c in range(vpp)]
    split = schedule in SPLIT_BACKWARD
    per_w_virtual: np.ndarray | None = None  # nothing waits for W without a split backward
    if not split:
        pass
    elif profile.weight_grad_holds == "all":
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
    # The frontier's columns are [held until B per chunk | held until W per chunk | gradients
    # per chunk | (V schedules) hand-overs]: their weights, one [n, pp] array each.
    weights: list[np.ndarray | None] = [_chunk_column(per_b_virtual, chunks, c) for c in range(vpp)]
    weights += [None if per_w_virtual is None else _chunk_column(per_w_virtual, chunks, c) for c in range(vpp)]
    # ---- transient: one layer's backward working set (+ what recompute rebuilds), or the loss
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
    scores_during, scores_grads = (np.empty((n, patterns), order="F"), np.empty((n, patterns), order="F")) if scores else (None, None)
    out["transient"] = np.empty((n, patterns), order="F")
    for column, (moe_here, dense_here, first, last) in enumerate(
            zip(has_moe.tolist(), has_dense.tolist(), first_stage.tolist(), last_stage.tolist(), strict=True)):
        layer = layer_by_kinds.get((moe_here, dense_here))
        if layer is None:
            per_token = _layer_working_set(table, table_recompute_on, moe_here, dense_here)
            layer_by_kinds[moe_here, dense_here], last_layer_by_kinds[moe_here, dense_here] = (
                op_tokens * by_combination.rows(values) for values in per_token)
            layer = layer_by_kinds[moe_here, dense_here]
        last_layer = last_layer_by_kinds[moe_here, dense_here]
        if scores_during is None or scores_grads is None:
            layer_transient[:, column] = last_layer
            out["transient"][:, column] = np.maximum(layer, loss_per_token * last)
            continue
        moment = scores_moments.get((moe_here, dense_here, first, last))
        if moment is None:
            moment = scores_moments[moe_here, dense_here, first, last] = _scores_backward_moments(
                by_combination.taken, {k: static.at(v) for k, v in static.mlp_grads.items()}, op_tokens,
                _per_op(output_held, seq_chunks),
                recompute_on,
                static.at(static.head_grad_bytes),
                kinds=tuple(k for k, here in (("dense", dense_here), ("moe", moe_here)) if here), last=last,
                table_grad=static.at(static.table_made_last) * first)
        scores_during[:, column], scores_grads[:, column] = moment.during, moment.grads_made
        layer_transient[:, column] = np.maximum(last_layer, moment.at_end)
        out["transient"][:, column] = np.maximum(np.maximum(layer, moment.during), loss_per_token * last)
    # From the second micro-batch on, the embedding's backward makes a whole new gradient of the
    # table (the scatter of token gradients is dense) and adds it to the kept one; by then that
    # micro-batch's first-chunk activations are gone. FSDP gradients are new each micro-batch
    # and priced with its unit buffers.
    accumulates = (batch.micro_batches_per_step > 1) & (batch.zero < 3)
    if profile.grads_created_in_backward and model.is_moe:
        # Likewise the fused experts' new gate_up gradient (one tensor for all local experts)
        # exists beside the kept one until it is added, with the output gradient it is computed
        # from; on the last stage that micro-batch's loss activations are freed by then. (Dense
        # layers' largest weights are a few percent of a layer's activations: not priced.)
        # Megatron fuses the accumulation into its main-grad buffer.
        local_experts = model.num_experts / np.maximum(batch.ep, 1)
        # (The output gradient is the rank's routed tokens' through experts 1/etp wide: k·2f/tp per
        # token where each rank routes its own tokens, as the profiles' expert_width shard.)
        routed_width = by_combination.rows(np.where(routes_own_tokens(by_combination.batch.sequence_parallel, table_tp),
                                                    table_tp, by_combination.batch.etp.astype(float)))
        expert_gradient = (
            2 * local_experts * model.moe_ffn_hidden_size * model.hidden_size / etp * precision.param_bytes
            + op_tokens * 2 * model.num_experts_per_tok * model.moe_ffn_hidden_size * precision.activation_bytes
            / routed_width
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
                np.maximum(out["transient"][:, column], new_gradient, out=out["transient"][:, column])
    # Under DTensor tensor parallelism that new gradient is the whole table, before it becomes
    # the rank's shard, with one micro-batch too (``_static_state``).
    embedding_gradient = static.at(static.embedding_gradient)
    embedding_accumulate = np.maximum(embedding_gradient - _per_op(per_b_virtual[:, 0], seq_chunks), 0.0)
    # Column by column (see _outer_sum): the same values, in passes over the strategies; on the
    # first stage alone (elsewhere its 0 bytes leave the transient, >= +0, as it is).
    for column, first in enumerate(first_stage.tolist()):
        if first:
            np.maximum(out["transient"][:, column], embedding_accumulate * first, out=out["transient"][:, column])
    # The head's, on the last stage (a split backward makes it in the W step: _weight_grad_step).
    head_gradient = static.at(static.head_gradient)
    if not split and np.any(head_gradient):
        head_moment = head_accumulate(model, precision.activation_bytes, head_gradient, op_tokens, tp,
                                      _per_op(output_held, seq_chunks))
        for column, last in enumerate(last_stage.tolist()):
            if last:
                out["transient"][:, column] = np.maximum(out["transient"][:, column], head_moment)
    if model.mtp_depth:
        # An MTP module checkpointed whole (full recompute, uniform) rebuilds its layer, norms and
        # eh_proj input at once in its backward, beside that layer's working set: more than one
        # decoder layer's rebuild, on the stage that holds the modules.
        mtp_rebuild = np.where(full_recompute & ~mtp_limited,
                               op_tokens * by_combination.rows(table.mtp_rebuilt + table.backward_extra[mtp_kind]), 0.0)
        for column, last in enumerate(last_stage.tolist()):
            if last:
                out["transient"][:, column] = np.maximum(out["transient"][:, column], mtp_rebuild)

    if split:
        # The frontier's columns after the gradients: each chunk's weight-gradient step while it
        # runs. Its working set takes the place of a layer backward's (the transient, added to
        # every row), so a column weighs what it allocates beyond that.
        # (Both kinds of columns are worked out at the full-recompute rows ``stepping`` alone and
        # placed among zeros: elsewhere a step and its gradients are 0, less a transient >= +0,
        # which the maximum with 0 makes +0.)
        stepping, steps, new_grads = _weight_grad_step(
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
            made_in_step = np.where(~whole_w[None, :], per_grads[stepping], 0.0)
            first_step = [None if step is None else _placed(np.maximum(_chunk_column(made_in_step, chunks, c) - new_grad, 0.0),
                                                            stepping, n)
                          for c, (step, new_grad) in enumerate(zip(steps, new_grads, strict=True))]
        extra += first_step
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
    # one of their pattern outweighs are left out (``_pattern_leaders``), the rows of the held
    # peak and of every sum after it are those of the stages ``leaders`` (DeepSeek-V3's search:
    # the 1F1B and GPipe groups of 16 and 32 stages price 4-5 each).
    leaders: np.ndarray | None = None
    priced_shape = shape
    if device_only:
        held_read = (batch.micro_batches_per_step == 1) & profile.grads_created_in_backward
        leaders = _pattern_leaders(schedule, pp, vpp, seq_chunks, batch.num_micro_batches, weights, extra,
                                   shape.pattern_of)
        if leaders is not None:
            priced_shape = replace(shape, pattern_of=shape.pattern_of[leaders])
    held, held_with_extra, chosen = _held_peak(  # stage-major [pp, n] (device_only: [len(leaders), n])
        schedule, pp, vpp, seq_chunks, batch.num_micro_batches, weights, extra, shape.pattern_of,
        keep_rows=kinds is not None, held_read=held_read, stages=leaders,
    )
    # What the weight-gradient steps add to the peak, reported with the transient (the rest of the
    # forward/backward peak): the same peak without their columns, subtracted. Not needed for the
    # device total alone.
    weight_step_extra: np.ndarray | None = None
    if split and extra is not None and not device_only and any(e is not None for e in extra[vpp:3 * vpp]):
        without = [*extra[:vpp], *([None] * (2 * vpp)), *extra[3 * vpp:]]
        _, without_steps, _ = _held_peak(
            schedule, pp, vpp, seq_chunks, batch.num_micro_batches, weights, without, shape.pattern_of)
        weight_step_extra = held_with_extra - without_steps
    if kinds is not None and chosen is not None:
        _activation_kinds(kinds, index, pp, vpp, placement, chosen, t, by_combination.taken, plain_dense, plain_moe,
                          recomputed_dense, recomputed_moe,
                          {"embedding": np.multiply.outer(embedding_held, first_virtual),
                           "output": np.multiply.outer(output_held, last_virtual) + kept_logits,
                           "mtp": np.multiply.outer(mtp_held, last_virtual),
                           "pipeline": kept_hidden,
                           "checkpoint_mask": np.zeros((n, computed), order="F") if checkpoint_mask_virtual is None
                           else checkpoint_mask_virtual},
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
    overlapping_with_pp = _layer_buffers(model, batch, options, op_tokens, tokens, pp, has_moe, sp_div)
    # Only FSDP strategies have unit moments: price those rows alone.
    sharded_rows = np.flatnonzero(zero3 if cut is None else zero3 & ~cut)
    if sharded_rows.size:
        def pick(values: Any) -> np.ndarray:
            return np.broadcast_to(np.asarray(values, dtype=float), (len(batch),))[sharded_rows]

        def pick_static(values: Any) -> np.ndarray:  # a figure of the static state
            return np.broadcast_to(np.asarray(static.at(values, sharded_rows), dtype=float), (len(sharded_rows),))

        # The per-token inputs worked out on the sharded rows alone, from their operands' rows:
        # the same element-wise operations on the same values, over a quarter of the rows or
        # fewer (1M mixed DeepSeek-V3 strategies: ~10 passes over each group less).
        # (Per token, a figure of the combinations: worked out on those, gathered to these rows.)
        tokens_at, deferred_at = pick(op_tokens), deferred[sharded_rows]
        table_etp = by_combination.batch.etp.astype(float)
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
            expert_elements=pick_static(static.expert_elements),
            unit_grads={kind: pick_static(grads) for kind, grads in static.unit_grads.items()},
            expert_working=tokens_at * by_combination.rows(_expert_weight_grad_working(
                model, precision.activation_bytes, table_etp, table_rebuilt["moe"],
                np.where(routes_own_tokens(by_combination.batch.sequence_parallel, table_tp), table_etp / table_tp, 1.0)),
                sharded_rows),
            # What an op frees: its micro-batch's, or under Seq1F1B its sub-sequence's, share.
            one_micro_batch=pick(_per_op(per_b_virtual[:, 0], seq_chunks)),
            one_micro_batch_layers=pick(_per_op(layers_held[:, 0], seq_chunks)),
            one_micro_batch_loss=pick(_per_op(output_held, seq_chunks)),
            kept_after_backward=deferred_at,
            # Under a V schedule torch keeps both of a rank's chunks gathered ahead (at most
            # three): 1 where the rank's other chunk sits beside a unit's moments (its units
            # stay gathered from its backward on), 2 where every unit does (never resharded
            # after forward).
            kept_beside=np.where(deferred_at & (schedule in V_SHAPE),
                                 np.where(batch.reshard_after_forward[sharded_rows] == 0, 2.0, 1.0), 0.0),
            kept_elements=_largest_chunks(static.at(static.elements_virtual, sharded_rows), chunks, vpp)
            if vpp > ACTIVE_CHUNKS else None,
        )
        # The moments, priced once per distinct row of these inputs (``_fsdp_moments``), with
        # those of the groups of this placement where the caller evaluates them side by side.
        sharded, rows_of = yield _FsdpRequest(placement, shape.full_on_stage, shape.reps, precision.param_gather_bytes,
                                              inputs)
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
    receive = _receive_buffers(model, batch, options, shape, tokens, sp_div)  # (its own array)
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
    if ddp_buckets is not None:
        optimizer_step += ddp_buckets
    optimizer_step += workspaces
    out["optimizer_step"] = optimizer_step

    # The static state per strategy: its sums, each gathered once, and its parts where the
    # figures of every category are kept.
    total = static.at(static.total)
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
            static_single, comm_single = total[single], out["comm"][single]
            grads_single = static.at(static.grads, single)
            loss_phase = expand(static_single - grads_single) + held[:, single]
            loss_phase += expand(comm_single)
            loss_phase += expand(out["transient"][single])
            loss_phase += expand(fsdp.grads_made.take(source[single], axis=0))
            # The embedding's backward comes last, when nothing is held.
            backward_end = static_single + comm_single + np.maximum(
                layer_transient[single], embedding_gradient[single, None] * first_stage[None, :])
            # Under FSDP the backward ends in the first unit's reduce, not the stage's worst one.
            backward_end = np.where(zero3[single, None], static_single + other_comm[single] + fsdp.last_unit.take(source[single], axis=0),
                                    backward_end)
            backward_end += overhead.workspace_bytes
            forward_backward[:, single] = np.maximum(loss_phase, expand(backward_end))
            # Where the scores are materialised, the first layer's attention backward: the loss's
            # activations are gone, the head's and that layer's MLP gradients made (FSDP prices
            # its moments with its units).
            if scores_during is not None and scores_grads is not None:
                scores_phase = expand(static_single - grads_single + comm_single + overhead.workspace_bytes
                                      + scores_during[single]
                                      + np.where(zero3[single, None], 0.0, scores_grads[single]))
                scores_phase += held[:, single]
                forward_backward[:, single] = np.maximum(forward_backward[:, single], scores_phase)
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


def _scores_backward_moments(acts: LayerActivations, mlp_grads: dict[str, np.ndarray], tokens: np.ndarray,
                             output_held: np.ndarray, recompute_on: np.ndarray, head_grad_bytes: np.ndarray,
                             kinds: tuple[str, ...], last: bool, table_grad: Any) -> ScoresMoments:
    """``ScoresMoments`` of a stage holding layers of ``kinds`` (``last``: the pipeline's last
    stage); ``mlp_grads``: per layer kind the gradient bytes of its MLP and second norm as the
    stage keeps them (``_StaticState``), ``head_grad_bytes`` the head's, ``table_grad`` the
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


def _expert_weight_grad_working(model: ModelSpec, activation_bytes: int, etp: np.ndarray,
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
                     run_chunk: list[int], index: int, before_index: int | None = None) -> np.ndarray:
    """Bytes of a stage's parameters gathered beside a moment of its run ``index`` that counts
    that run's unit gathered, and the unit of run ``before_index`` where given (``index`` itself:
    a second unit of the same run), per strategy by ``mode`` (``_fsdp_unit_phases``'
    ``kept_beside``): 0 nothing; 1 every unit of the rank's other chunks (less the neighbour
    counted, where it is theirs); 2 every unit of the stage less those counted."""
    if not mode.any():
        return np.zeros(len(mode))
    chunk_elements: dict[int, Any] = {}
    for (kind, count), v in zip(runs, run_chunk, strict=True):
        chunk_elements[v] = chunk_elements.get(v, 0.0) + count * size[kind]
    stage_elements = sum(chunk_elements.values(), np.zeros(len(mode)))
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
                         size, runs, run_chunk)

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
                for buf in (g * n_k + r * size[following], 2 * g * n_k + r * size[following], (g + r) * n_k):
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


#: Schedules whose every backward torch.distributed.pipelining splits into an input-gradient
#: step and a later weight-gradient step (I, W), on every stage but the first.
EVERY_BACKWARD_SPLIT = frozenset({"zbv"})


def _pending_split_grad_width(schedule: str, precision: Any, profile: RuntimeProfile,
                              first_virtual: np.ndarray) -> np.ndarray:
    """Bytes per element, per virtual stage, of the new unsharded gradient a chunk keeps beside
    its accumulated one under a deferred FSDP reduce and ZB-V's split backward.

    torch.distributed.pipelining turns FSDP2's gradient sync off until the chunk's REDUCE_GRAD;
    FSDP2's post-backward then only moves the parameter's gradient into its accumulator in the
    reduce dtype (``to_accumulated_grad_if_needed`` / ``accumulate_unsharded_grad_if_needed``).
    Under the split backward that hook runs in the input-gradient step before the micro-batch's
    weight gradients are accumulated, so each chunk holds, besides its fp32 accumulator, the last
    micro-batch's gradient in the parameter dtype until its next backward (traced on ZB-V: a
    decoder layer of llama-3.1-8b holds 4 + 2 bytes an element from its second backward on). Not
    where the two widths are one (the gradient is accumulated in place), nor on the pipeline's
    first stage where torch runs its W as a whole backward (the hook comes after the gradients),
    nor under DualPipeV, whose steady state runs full backwards (F&B overlapped: traced, no new
    gradient waits there; only its warm-up and cool-down split a backward)."""
    pending = float(precision.param_gather_bytes) if precision.grad_bytes != precision.param_gather_bytes else 0.0
    if schedule not in EVERY_BACKWARD_SPLIT or not profile.pipeline_defers_fsdp_reduce or not pending:
        return np.zeros(len(first_virtual))
    whole_w = (first_virtual > 0) if profile.first_stage_backward_at_w else np.zeros(len(first_virtual), dtype=bool)
    return np.where(whole_w, 0.0, pending)


def _weight_grad_step(
    model: ModelSpec, batch: StrategyBatch, combinations: _Combinations, profile: RuntimeProfile, t: np.ndarray,
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
        _, _, recomputed_dense, recomputed_moe = _recomputed_layers(
            recompute_on[rows], batch.recompute_layers[rows], dense_layers, moe_layers)
        copies, last_layer, last_is_moe = _weight_grad_step_per_token(
            model, combinations.taken, rows, recomputed_dense, recomputed_moe, head_chunk)
    else:  # every strategy's counts those of one without a limit, [1, U]
        _, _, recomputed_dense, recomputed_moe = _recomputed_layers(
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
    return rows, [_chunk_column(step, chunks, c) for c in range(vpp)], [_chunk_column(new_grad, chunks, c) for c in range(vpp)]


def _weight_grad_step_per_token(
    model: ModelSpec, acts: LayerActivations, select: np.ndarray | slice, recomputed_dense: np.ndarray,
    recomputed_moe: np.ndarray, head_chunk: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_weight_grad_step``'s terms per token, per row ``select`` of ``acts`` and virtual stage:
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


def _placed(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """[len(rows), k] values at ``rows`` (ascending) of an [n, k] array of zeros (``values``
    itself where those are every row)."""
    if len(rows) == n:
        return values
    out = np.zeros((n, values.shape[1]))
    out[rows] = values
    return out


def _activation_kinds(
    kinds: dict[str, dict[str, np.ndarray]], index: np.ndarray, pp: int, vpp: int, placement: Placement,
    chosen: np.ndarray, t: np.ndarray, acts: LayerActivations, plain_dense, plain_moe, recomputed_dense, recomputed_moe, per_virtual, per_w_virtual,
    model: ModelSpec,
) -> None:
    """Split the held peak by layer kind, at the instant of each stage's peak."""
    dense, moe = acts.dense_blocks, acts.moe_blocks
    per_kind_virtual = {
        "attention": t * (plain_dense * dense["attention"][:, None] + plain_moe * moe["attention"][:, None]),
        "norm": t * (plain_dense * dense["norm"][:, None] + plain_moe * moe["norm"][:, None]),
        "mlp": t * plain_dense * dense["mlp"][:, None],
        "moe": t * plain_moe * moe["moe"][:, None],
        "recompute": t * (recomputed_dense * acts.recomputed["dense"][:, None] + recomputed_moe * acts.recomputed["moe"][:, None])
        + per_virtual["checkpoint_mask"],
        "embedding": per_virtual["embedding"],
        "output": per_virtual["output"],
        "mtp": per_virtual["mtp"],
        "pipeline": per_virtual["pipeline"],
    }
    n = t.shape[0]
    for s in range(pp):
        held_b, held_w = chosen[:, s, :vpp], chosen[:, s, vpp:2 * vpp]
        chunks = np.flatnonzero(placement.stage_of == s)
        for kind, values in per_kind_virtual.items():
            amount = np.zeros(n)
            for v in chunks:
                amount += held_b[:, placement.chunk_of[v]] * values[:, v]
            kinds["activations"][kind][index, s] += amount
        w_amount = np.zeros(n)
        for v in chunks:
            w_amount += held_w[:, placement.chunk_of[v]] * per_w_virtual[:, v]
        # What waits for W (linear inputs and output gradients) is mostly MLP/expert tensors.
        kinds["activations"]["moe" if model.is_moe else "mlp"][index, s] += w_amount


__all__ = [
    "ACTIVATION_KINDS", "CATEGORIES", "STATIC_KINDS", "MemoryOptions", "RuntimeOverhead", "StageMemory",
    "peak_memory", "stage_memory",
]
