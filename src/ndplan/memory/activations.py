"""What each layer kind keeps for backward, in bytes per token per rank (``layer_activations``).

The figures come from the runtime profile's saved-tensor blocks, or from a census measured for
the model, sharded by tp, etp, sequence and context parallelism, under the strategy's recompute
policy and what it offloads. ``Combinations`` holds them per combination of ``activation_columns``,
a few hundred at most in a search, for the grouped estimator to gather per strategy.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache, reduce
from typing import Any

import numpy as np

from ndplan.arrays import one_value
from ndplan.census.record import CensusRecord, Recompute
from ndplan.errors import NdplanError
from ndplan.memory.fields import ACTIVATION_FIELDS
from ndplan.memory.options import MemoryOptions
from ndplan.memory.profile import FUSED_QKV_MODEL_TYPES, SHARDS, BlockBytes, block_coefficients
from ndplan.memory.terms import routes_own_tokens
from ndplan.model.heads import ulysses_kv_repeat
from ndplan.model.spec import MlpKind, ModelSpec
from ndplan.strategy.batch import StrategyBatch
from ndplan.strategy.strategy import OFFLOAD_MODULES, RECOMPUTE_MODULES


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
    #: (its norms: two, four with sandwich norms) and 'mlp' of a dense layer, 'attention', 'norm'
    #: and 'moe' of a MoE one. They
    #: sum to ``full``: net of what offload moves, and scaled to the measured layer where a census
    #: replaced the formulas (a census measures whole layers).
    dense_blocks: dict[str, np.ndarray]
    moe_blocks: dict[str, np.ndarray]
    #: A layer under the strategy's recompute, by the same blocks and 'recompute': selective
    #: recompute keeps most of each block (its 'kept' tensors, net of offload, in a census's
    #: proportions where one measured the layer), and 'recompute' holds what the checkpoint itself
    #: keeps (the layer input where the runtime saves it); full recompute keeps its input alone,
    #: all under 'recompute'. They sum to ``recomputed``.
    dense_recomputed_blocks: dict[str, np.ndarray]
    moe_recomputed_blocks: dict[str, np.ndarray]
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
        combinations (``activation_columns``), taken for thousands of strategies each, and a third
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
        return frozenset(key for key, value in self._figures.items() if len(value) and one_value(value))


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


@dataclass(frozen=True)
class Combinations:
    """The layer activations of a group's strategies by combination of ``activation_columns``:
    ``acts`` and ``batch`` (those fields' columns) one row per combination, and per strategy of
    the group its combination, ``index`` (None: ``acts`` and ``batch`` are the group's own, a
    row per strategy).

    A figure made of those alone (a layer's bytes as the strategy's recompute keeps them, the
    sequence-parallel divisor, ...) is worked out on their rows, a few hundred at most, and
    gathered to the strategies by ``rows``: one pass over the group's strategies instead of one
    per operation and per figure gathered. The same operations on the same values, row by row:
    the same bits. (1M mixed DeepSeek-V3 strategies, at most 192 combinations: warm peak_memory
    0.507-0.521 -> 0.467-0.474 s, alternated with the code before, with group_alike's group numbers.)"""

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
    mlp_kind = kind.removesuffix("-sliding")
    if mlp_kind in ("dense", "moe") and mlp_kind not in model.mlp_kinds:
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
                          f"{options.attention}: measure with `ndplan census --attention {'eager' if options.attention == 'eager' else 'sdpa'}` "
                          "or price --attention as measured")


def _check_census_model(record: CensusRecord, model: ModelSpec) -> None:
    """Refuse a record measured on another model. Its layer architecture decides where the record
    carries one (a checkpoint folder named Meta-Llama-3.1-8B measures the llama-3.1-8b preset's
    layers); an older record without it must carry the model's name, in any case."""
    advice = f"measure this model with `ndplan census {model.name}`, or leave out --census"
    where = f"the census record of layer kind '{record.layer_kind}' was measured on {record.model}"
    if record.architecture:
        # A field the record lacks came after it was written: it measured that field's default
        # (norm_placement 'pre' for a record older than post and sandwich norms).
        defaults = {name: field.default for name, field in ModelSpec.model_fields.items()}
        priced = dict(model.layer_architecture())
        measured = {**{name: defaults[name] for name in priced if name in defaults}, **dict(record.architecture)}
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


def _census_layer_mean(model: ModelSpec, kind: MlpKind, record: CensusRecord, sliding_record: CensusRecord | None,
                       linear_record: CensusRecord | None, seq: np.ndarray, masked_bytes: np.ndarray,
                       sdpa: bool) -> Callable[..., np.ndarray]:
    """How census records price the mean layer of MLP ``kind``: ``mean(value, masks)`` weighs
    ``value`` of the record measuring its full-attention layers, of the one measuring its
    sliding layers and of the one measuring its Gated DeltaNet layers by their counts. The census
    measures each layer with the mask the model hands it, and a sliding (Gated DeltaNet) layer's
    apart ('<kind>-sliding', '<kind>-linear') where the model has both; where every layer of the
    kind slides (or is a Gated DeltaNet), ``record`` measured them (no apart kind).

    A sliding layer keeps SDPA's masked-path tensors (the profile's ``sdpa_masked``,
    ``masked_bytes`` a token) from the window on, under transformers' SDPA alone (``sdpa``; a
    flash or flex kernel takes the window natively). With ``masks`` (the bytes a layer keeps, not
    what recompute keeps: those tensors are rebuilt) they are added where the priced layer keeps
    them and its record did not, and taken off the other way (the record's per-sequence slope
    follows the mask on one side of the window, not across it); a sliding layer priced from a
    full layer's record (a census that measured them as one) takes them where it keeps them."""
    sliding, layers = model.sliding_layers(kind)
    linear = model.linear_layers(kind)[0] if linear_record is not None else 0
    window = max(model.sliding_window, 1)
    reaches = ((seq >= window) & sdpa).astype(float)

    def mean(value: Callable[[CensusRecord], np.ndarray], masks: bool = False) -> np.ndarray:
        if linear:
            assert linear_record is not None
            return ((layers - linear) * softmax_mean(value, masks) + linear * value(linear_record)) / layers
        return softmax_mean(value, masks)

    def softmax_mean(value: Callable[[CensusRecord], np.ndarray], masks: bool = False) -> np.ndarray:
        """The mean over the kind's softmax attention layers (full and sliding)."""
        layers_softmax = layers - linear
        if not sliding:
            return value(record)
        own = sliding_record if sliding_record is not None else record if sliding == layers_softmax else None
        if own is None:  # measured as the full layers
            slid = value(record) + (reaches * masked_bytes if masks else 0.0)
        else:
            measured_mask = float(own.attention == "sdpa" and own.seq_length >= window)
            slid = value(own) + ((reaches - measured_mask) * masked_bytes if masks else 0.0)
        if sliding == layers_softmax:
            return slid
        return ((layers_softmax - sliding) * value(record) + sliding * slid) / layers_softmax

    return mean


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
        math = np.where(fp32 & grouped, 1.0 - model.linear_share(kind) - masked, 0.0)
        out[kind] = (masked, math)
    return out


def prices_sdpa_mask(model: ModelSpec, options: MemoryOptions) -> bool:
    """Whether any strategy keeps the mask of ``sdpa_mask_bytes`` (SDPA's, for sliding layers,
    where the runtime prices it)."""
    return options.attention == "sdpa" and "sdpa_masked" in options.profile.blocks and bool(model.sliding_layers()[0])


def sdpa_mask_bytes(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions) -> np.ndarray:
    """Bytes of the boolean mask transformers' SDPA path builds for sliding-window layers, per
    micro-batch: mbs·s² where seq >= window and the runtime prices that mask (``sdpa_masked``),
    else 0."""
    if not prices_sdpa_mask(model, options):
        return np.zeros(len(batch))
    seq = batch.seq_length.astype(float)
    return np.where(seq >= model.sliding_window, batch.micro_batch_size * seq * seq, 0.0)


def activation_columns(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions) -> list[np.ndarray]:
    """The columns ``layer_activations`` is a function of: ``ACTIVATION_FIELDS``, and the times
    a rank's KV heads are repeated before a Ulysses all-to-all (``ulysses_kv_repeat``, which
    the context-parallel fields set) where any strategy repeats them."""
    columns = [getattr(batch, name) for name in ACTIVATION_FIELDS]
    repeat = ulysses_kv_repeat(model, batch.tp, batch.ulysses_ranks, options.ulysses_kv_repeat)
    if np.any(repeat > 1):
        columns.append(np.rint(repeat).astype(np.int64))
    return columns


def layer_activations(model: ModelSpec, batch: StrategyBatch, options: MemoryOptions) -> LayerActivations:
    """Bytes per token per rank of each layer variant, per strategy (a function of
    ``activation_columns`` alone)."""
    profile = options.profile
    if model.has_linear_attention and "linear_attention" not in profile.blocks:
        raise NdplanError(f"{model.name} has Gated DeltaNet layers, and runtime '{profile.name}' does not say what "
                          "they keep for backward (its profile has no linear_attention block): price it under "
                          "runtime 'pytorch' (transformers with flash-linear-attention)")
    if model.attention_softcap and options.attention == "sdpa":
        raise NdplanError(f"{model.name} soft-caps its attention scores, which transformers' SDPA path cannot do (it "
                          "refuses the model): price --attention eager (transformers' default for it) or flash "
                          "(flash-attn's kernel caps them)")
    if (model.attention_softcap or model.final_softcap) and profile.name == "megatron":
        raise NdplanError(f"{model.name} soft-caps its attention scores or logits, which Megatron-Core's layers do "
                          "not: price it under runtime 'pytorch'")
    if model.norm_placement == "post" and profile.name == "megatron":
        raise NdplanError(f"{model.name} puts its norms after attention and MLP (norm_placement 'post'), which "
                          "Megatron-Core's layers do not build (their norms come first, fused into the next "
                          "linear): price it under runtime 'pytorch'")
    act_bytes = batch.precision.activation_bytes
    offload = batch.offload_modules
    # The profile's op_keep flags describe a dense layer with standard attention (its matmuls in
    # Llama's order); a MoE or MLA model keeps the runtime's own flags, an upper bound (its
    # matmuls come in another order, and the experts' grouped GEMMs are not in torchtitan's list),
    # as does a fused q/k/v projection (Phi-3: one matmul where Llama runs three, so every other
    # one is another; the census keeps 3,872 B a token of a tiny layer where the flags read 3,232).
    policy = options.recompute_policy
    if policy == "torchtitan-op" and (model.is_moe or model.is_mla or model.model_type in FUSED_QKV_MODEL_TYPES):
        policy = profile.selective_policy
    blocks = block_coefficients(model, profile, act_bytes, batch.recompute_modules, offload,
                                fp8=batch.precision.compute_dtype == "fp8", loss_upcast=options.loss_upcast,
                                selective_policy=policy, moe_dispatcher=options.moe_dispatcher,
                                compiled=options.compiled_layers(model), compiled_loss=options.compiled_loss(),
                                modules=options.modules)
    tp, etp = batch.tp.astype(float), batch.etp.astype(float)
    loss_parallel = options.vocab_parallel_loss
    sequence_sharded = (batch.sequence_parallel > 0) & (tp > 1)
    # Routed tokens: each rank routes its own tokens (its sequence shard under SP; all of its own
    # without TP) and the dispatcher gathers them over the expert-TP group (Megatron's all-to-all
    # dispatcher: gather_from_sequence_parallel_region over the etp group), etp/tp of the
    # sequence's, through experts 1/etp wide. Only TP without SP routes tokens every TP rank
    # holds (tensor-parallel experts, no gather).
    own_tokens = routes_own_tokens(batch.sequence_parallel, tp)
    kv_heads = float(model.split_kv_heads)
    divisors = {
        "tp": tp,
        "sp": np.where(sequence_sharded, tp, 1.0),
        "etp": etp / options.routed_token_factor,
        "expert_tokens": np.where(own_tokens, tp / etp, 1.0) / options.routed_token_factor,
        "expert_width": np.where(own_tokens, tp, etp) / options.routed_token_factor,
        # (whatever the routing: the allgather dispatcher keeps every gathered token's row)
        "gathered": np.where(own_tokens, tp / etp, 1.0),
        "vocab": tp if loss_parallel else np.ones_like(tp),
        "kv": np.minimum(tp, kv_heads),
        "attended_kv": np.minimum(tp, kv_heads) / ulysses_kv_repeat(model, tp, batch.ulysses_ranks,
                                                                    options.ulysses_kv_repeat),
        "kv_gathered": np.where(tp > kv_heads, 1.0, np.inf),
        "none": np.ones_like(tp),
    }
    seq = batch.seq_length.astype(float)
    empty = BlockBytes(*(dict.fromkeys(SHARDS, 0.0) for _ in range(4)))

    inverse = {rule: 1.0 / np.broadcast_to(divisor, tp.shape) for rule, divisor in divisors.items()}

    def block(name: str, part: str = "base") -> np.ndarray:
        return _per_rank(blocks.get(name, empty), inverse, seq, part)

    attention_name = "attention_mla" if model.is_mla else "attention"
    norm, norm_kept = block("norm"), block("norm", "kept")
    norms = model.norms_per_layer  # the layer's h-wide norms, each keeping the norm block's tensors
    # Per MLP kind: the kinds' layers may differ in attention span (sliding windows) and mixer (a
    # Gated DeltaNet on the 'linear' layers: a kind's layer is their mean, ``linear``'s share).
    linear = {k: model.linear_share(k) for k in ("dense", "moe")}
    softmax = {k: 1.0 - share for k, share in linear.items()}

    def mixer(part: str = "base") -> dict[str, np.ndarray]:
        return {k: softmax[k] * block(attention_name, part) + (linear[k] * block("linear_attention", part)
                                                                  if linear[k] else 0.0) for k in ("dense", "moe")}

    attention, attention_kept = mixer(), mixer("kept")
    # The attention backward's working set where the scores are materialised (s² per head), with
    # CUDA softmax's scratch where overhead is counted (fake tensors do not see it).
    attention_backward = dict.fromkeys(("dense", "moe"), 0.0 * tp)
    product = block("softmax_backward_product") if options.include_overhead else 0.0
    # Eager attention and both SDPA fallbacks repeat K and V to every query head: a copy where a
    # rank holds more than one KV head (with one, repeat_kv's reshape is a view).
    repeats = np.where(model.num_kv_heads / tp > 1, 1.0, 0.0)
    if options.attention == "eager":  # (its matmuls keep the repeated K and V: measured by the census)
        for k in ("dense", "moe"):
            attention[k] = attention[k] + softmax[k] * (block("eager_scores") + repeats * block("sdpa_repeated_kv"))
            attention_kept[k] = attention_kept[k] + softmax[k] * (block("eager_scores", "kept")
                                                                  + repeats * block("sdpa_repeated_kv", "kept"))
            attention_backward[k] = np.where(softmax[k] > 0, block("eager_backward_extra") + product, 0.0)
    sdpa_masked = block("sdpa_masked") + repeats * block("sdpa_repeated_kv")
    if options.attention == "sdpa":
        for k, (masked, math) in _sdpa_fallbacks(model, batch).items():
            attention[k] = (attention[k] + masked * block("sdpa_masked") + math * block("sdpa_math")
                            + (masked + math) * repeats * block("sdpa_repeated_kv"))
            attention_kept[k] = (attention_kept[k] + masked * block("sdpa_masked", "kept")
                                 + math * block("sdpa_math", "kept")
                                 + (masked + math) * repeats * block("sdpa_repeated_kv", "kept"))
            attention_backward[k] = np.where(math > 0, block("sdpa_math_backward_extra") + product, 0.0)
    mlp, moe = block("mlp"), block("moe")
    full = {"dense": norms * norm + attention["dense"] + mlp, "moe": norms * norm + attention["moe"] + moe}
    checkpoint_input = block("layer_input") if profile.selective_keeps_layer_input else 0.0
    # What a selectively recomputed layer keeps, by block (the breakdown by kind) and in all: a
    # census may replace the totals below, not these blocks.
    kept_by_block = {"dense": {"norm": norms * norm_kept, "attention": attention_kept["dense"],
                               "mlp": block("mlp", "kept")},
                     "moe": {"norm": norms * norm_kept, "attention": attention_kept["moe"], "moe": block("moe", "kept")}}
    selective = {k: _summed(kept_by_block[k]) + checkpoint_input for k in ("dense", "moe")}
    formula_selective = dict(selective)
    mixer_weight_input = mixer("weight_input")
    weight_input = {
        "dense": mixer_weight_input["dense"] + block("mlp", "weight_input"),
        "moe": mixer_weight_input["moe"] + block("moe", "weight_input"),
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
    # With more TP ranks than KV heads, the attention's backward holds the gradient of the QKV
    # output it gathered, whole, before reduce-scattering it: after the MLP's backward has freed
    # its working set, so the larger of the two.
    gathered_qkv = block("qkv_gather_backward_extra")
    if np.any(gathered_qkv > 0):
        backward_extra = {k: np.maximum(v, np.where(softmax[k] > 0, gathered_qkv, 0.0)) for k, v in backward_extra.items()}
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
    measured_kinds: set[str] = set()
    kind: MlpKind
    for kind in ("dense", "moe"):
        measured = _census_for(options, kind, model)
        sliding_record = _census_for(options, f"{kind}-sliding", model)
        linear_record = _census_for(options, f"{kind}-linear", model)
        if measured is None and sliding_record is not None:  # every layer of the kind slides
            measured, sliding_record = sliding_record, None
        linear_layers, kind_layers = model.linear_layers(kind)
        if measured is not None and 0 < linear_layers < kind_layers and linear_record is None:
            raise NdplanError(f"the census measured {model.name}'s {kind} layers but not its Gated DeltaNet ones "
                              f"(no '{kind}-linear' record): measure it again with `ndplan census`")
        if measured is not None:
            measured_kinds.add(kind)
            if offload:
                raise NdplanError("a census measures what a layer keeps on the device, not activation offload "
                                  f"({' '.join(offload)}): leave out one or the other")
            if batch.recompute_modules:
                raise NdplanError("a census measures the runtime's own selective recompute, not recompute modules "
                                  f"({' '.join(batch.recompute_modules)}): leave out one or the other")
            record = measured
            for each in (record, sliding_record, linear_record):
                if each is not None:
                    _check_census_runtime(each, batch, options)
            # Measured bytes replace the formulas; the TP split comes from the census's TP-2 run,
            # which splits heads and widths, experts' too, without sequence parallelism: where a
            # strategy shards otherwise (SP, experts by another degree) the formulas price it.
            applies = ~((batch.sequence_parallel > 0) & (tp > 1))
            if kind == "moe":
                applies &= np.where(batch.etp == 0, tp, batch.etp) == tp
            layers_of = _census_layer_mean(model, kind, record, sliding_record, linear_record, seq, sdpa_masked,
                                           options.attention == "sdpa")
            full[kind] = np.where(applies, layers_of(lambda r: _measured(r, tp, seq, r.seq_length), True), full[kind])
            # Its selective figures are torch's keep-every-matmul checkpointing: another policy
            # (Megatron's core-attention recompute) keeps the formulas'.
            if options.recompute_policy == CENSUS_SELECTIVE_POLICY:
                selective[kind] = np.where(
                    applies, layers_of(lambda r: _measured(r.selective, tp, seq, r.seq_length)), selective[kind])
            rebuilt_input[kind] = np.where(
                applies, layers_of(lambda r: _measured(r.full_recompute, tp, seq, r.seq_length)), rebuilt_input[kind])
            extra = max(r.backward_peak_extra_bytes_per_token for r in (record, sliding_record, linear_record)
                        if r is not None)
            backward_extra[kind] = np.where(applies, extra * backward_tp_share[kind], backward_extra[kind])
    is_full, is_selective = batch.is_("recompute", "full"), batch.is_("recompute", "selective")
    recomputed = {k: np.where(is_full, rebuilt_input[k], selective[k]) for k in ("dense", "moe")}
    # What no weight gradient of the layer reads: the whole layer (measured, where a census
    # replaced the formulas) less its weights' inputs.
    weight_unread = {k: np.maximum(full[k] - weight_input[k] - norms * block("norm", "weight_input"), 0.0)
                     for k in ("dense", "moe")}
    # What recompute rebuilds in backward lives on the device, offloaded or not: taken before
    # the offload is netted out below.
    rebuilt = {k: full[k] - recomputed[k] for k in ("dense", "moe")}
    offloaded = {k: np.zeros_like(tp) for k in ("dense", "moe")}
    by_block = {"dense": {"attention": attention["dense"], "norm": norms * norm, "mlp": mlp},
                "moe": {"attention": attention["moe"], "norm": norms * norm, "moe": moe}}
    for k in ("dense", "moe"):
        formula = sum(by_block[k].values())
        if k in measured_kinds:  # measured: the blocks in the formulas' proportions
            share = np.divide(full[k], formula, out=np.zeros_like(tp), where=formula > 0)
            by_block[k] = {name: value * share for name, value in by_block[k].items()}
    if offload:
        moved_by_block, moved_kept_by_block = _offloaded(model, block, attention_name, options.attention == "eager",
                                                         offload)
        moved_kept = {k: _summed(blocks) for k, blocks in moved_kept_by_block.items()}
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
    recomputed_blocks = _recomputed_by_block(kept_by_block, formula_selective, selective, recomputed, is_selective,
                                             moved_kept_by_block if offload else None)
    norms_read_last = norms * block("norm", "read_last")
    weight_read_last = {"dense": norms_read_last + block("mlp", "read_last"),
                        "moe": norms_read_last + block("moe", "read_last")}
    weight_past = {"dense": block("mlp", "past_weights"), "moe": block("moe", "past_weights")}
    embedding = 0.0 * tp + block("embedding")
    final_norm = block("final_norm")
    output = 0.0 * tp + final_norm + block("output")
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
    mtp_checkpointed = embedding + 2 * hidden_per_token + output - final_norm
    return LayerActivations(
        full=full, recomputed=recomputed, weight_input=weight_input, weight_grad_outputs=weight_grad_outputs,
        weight_unread=weight_unread, weight_read_last=weight_read_last, weight_past=weight_past,
        dense_blocks=by_block["dense"], moe_blocks=by_block["moe"],
        dense_recomputed_blocks=recomputed_blocks["dense"], moe_recomputed_blocks=recomputed_blocks["moe"],
        embedding=embedding, output=output,
        output_transient=np.maximum(block("output_transient"), block("output_backward_extra") + np.where(
            loss_parallel & (tp > 1), block("loss_parallel_backward_extra"), 0.0)),
        backward_extra=backward_extra, attention_backward=attention_backward, mtp_extra=mtp_extra,
        mtp_checkpointed=mtp_checkpointed, mtp_rebuilt=mtp_extra + full[model.mtp_mlp_kind] - mtp_checkpointed,
        rebuilt=rebuilt,
        offloaded=offloaded,
    )


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
               offload: tuple[str, ...]) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]:
    """Bytes per token per rank that ``offload`` moves to the host from one layer of each kind,
    by block as ``LayerActivations.dense_blocks`` and ``moe_blocks``: (of a layer that recomputes
    nothing; of one under the selective policy).

    The profile's entries name their modules; the norms of a layer share the ``norm`` block,
    so their owner is decided here: the attention norm moves with attn_norm where it is its own
    module (MLA's input norm) and with qkv_linear where Transformer Engine fuses it into the QKV
    linear (every other attention); the pre-MLP norm with mlp_norm in MoE layers (it feeds the
    router); a dense MLP's norm is fused into fc1, which no offload module names. Norms on a
    branch's output (post and sandwich norms) stand in no named module and stay."""
    has_pre_norms = model.norm_placement != "post"
    attention_side = has_pre_norms and ("attn_norm" if model.is_mla else "qkv_linear") in offload
    mlp_side = has_pre_norms and "mlp_norm" in offload
    out = []
    for part in ("offloaded", "offloaded_kept"):
        norm = block("norm", part)
        attention = block(attention_name, part) + (block("eager_scores", part) if eager else 0.0)
        out.append({
            # (in this order, so that the totals are the sums they were: norm + attention + MLP)
            "dense": {"norm": attention_side * norm, "attention": attention, "mlp": block("mlp", part)},
            "moe": {"norm": (attention_side + mlp_side) * norm, "attention": attention, "moe": block("moe", part)},
        })
    return out[0], out[1]


def _recomputed_by_block(
    kept: dict[str, dict[str, np.ndarray]], formula: dict[str, np.ndarray], selective: dict[str, np.ndarray],
    recomputed: dict[str, np.ndarray], is_selective: np.ndarray, moved: dict[str, dict[str, np.ndarray]] | None,
) -> dict[str, dict[str, np.ndarray]]:
    """``LayerActivations.dense_recomputed_blocks`` and ``moe_recomputed_blocks``: per layer kind,
    what a recomputed layer keeps, by block.

    Under selective recompute each block keeps its 'kept' tensors (``kept``), scaled by the
    census's total over the formula's (``selective`` / ``formula``, 1 without a census) and net
    of what offload moves from them (``moved``); 'recompute' is the rest of ``recomputed``, the
    checkpoint's own input where the runtime saves it, so that the blocks sum to it. Under full
    recompute the layer keeps its input alone: 'recompute' is all of it."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for k in ("dense", "moe"):
        share = np.divide(selective[k], formula[k], out=np.ones_like(formula[k]), where=formula[k] > 0)
        blocks = {name: np.where(is_selective, value * share - (moved[k][name] if moved is not None else 0.0), 0.0)
                  for name, value in kept[k].items()}
        blocks["recompute"] = recomputed[k] - _summed(blocks)
        out[k] = blocks
    return out


def _summed(blocks: dict[str, np.ndarray]) -> np.ndarray:
    """Σ of the blocks' bytes, added in their order."""
    return reduce(operator.add, blocks.values())
