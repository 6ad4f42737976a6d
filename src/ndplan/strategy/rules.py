"""Validity rules of a strategy for a model and a cluster, each written once.

A rule's ``holds`` works on a StrategyBatch and returns a boolean mask (True: the rule holds), so
the search applies it to millions of candidates at once; ``check_strategy`` runs the same
function on a batch of one and, where it fails, words the reason with the strategy's values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from ndplan.errors import NdplanError
from ndplan.model.spec import ModelSpec
from ndplan.strategy.batch import CODES, StrategyBatch
from ndplan.strategy.strategy import (
    MAX_DEGREE,
    VIRTUAL_SCHEDULES,
    Strategy,
    layer_offload_conflict,
    offload_conflict,
    optimizer_state_offload_conflict,
)


@dataclass(frozen=True)
class RuleContext:
    """What a rule may look at besides the strategies: the model and the cluster's device count
    (None when the cluster size is not fixed, e.g. for a single-node check)."""

    model: ModelSpec
    num_devices: int | None = None


Mask = np.ndarray


@dataclass(frozen=True)
class Rule:
    name: str
    holds: Callable[[StrategyBatch, RuleContext], Mask]
    explain: Callable[[Strategy, RuleContext], str]


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str


#: Batches from this size on look ``_divides`` up in a table of every (divisor, value) pair,
#: where there are at most ``_DIVIDES_TABLE`` of them.
_DIVIDES_LOOKUP_FROM = 4096
_DIVIDES_TABLE = 1 << 16


def _divides(divisor: np.ndarray, value: np.ndarray | int) -> Mask:
    """divisor | value, element-wise; a zero divisor divides nothing.

    A search's candidates draw both from a few small values: an integer division per candidate
    costs several times more than looking the answer up in a table of every pair in their ranges."""
    divisor, value = np.asarray(divisor), np.asarray(value)
    if divisor.size >= _DIVIDES_LOOKUP_FROM and divisor.dtype.kind in "iu" and value.dtype.kind in "iu":
        divisor_low, divisor_high = int(divisor.min()), int(divisor.max())
        value_low, value_high = int(value.min()), int(value.max())
        width = value_high - value_low + 1
        if divisor_low >= 0 and (divisor_high + 1) * width <= _DIVIDES_TABLE:
            table = _divides_each(np.arange(divisor_high + 1)[:, None], np.arange(value_low, value_high + 1)[None, :])
            if width == 1 and value.shape in ((), divisor.shape):
                return table[:, 0].take(divisor)
            return table.ravel().take(divisor * width + (value - value_low))
    return np.asarray(_divides_each(divisor, value))


def _divides_each(divisor: np.ndarray, value: np.ndarray | int) -> Mask:
    """``_divides`` by one integer division per element."""
    return (divisor > 0) & (np.mod(value, np.maximum(divisor, 1)) == 0)


def _max_layers_per_stage(s: Strategy, ctx: RuleContext) -> int:
    return -(-ctx.model.num_layers // s.num_virtual_stages)


def _offload_runs(b: StrategyBatch) -> Mask:
    """Where Megatron-Core runs the batch's activation offload as asked: ``offload_conflict``,
    which depends on the batch's shared modules and each strategy's schedule and recompute,
    tabulated over those two."""
    if not b.offload_modules:
        return np.ones(len(b), bool)
    runs = np.array([[not offload_conflict(b.offload_modules, recompute, b.recompute_modules, schedule)
                      for recompute in CODES["recompute"]] for schedule in CODES["schedule"]])
    return runs[b.schedule, b.recompute]


def _world(b: StrategyBatch) -> np.ndarray:
    return b.dp * b.tp * b.pp * b.cp


RULES: tuple[Rule, ...] = (
    Rule(
        "world_size",
        lambda b, c: np.ones(len(b), bool) if c.num_devices is None else _world(b) == c.num_devices,
        lambda s, c: f"dp·tp·pp·cp = {s.dp}·{s.tp}·{s.pp}·{s.cp} = {s.world_size} but the cluster has {c.num_devices} devices",
    ),
    Rule(
        "global_batch",
        lambda b, c: b.global_batch_size == b.dp * b.micro_batch_size * b.micro_batches_per_step,
        lambda s, c: (
            f"global_batch_size={s.global_batch_size} is not dp·micro_batch_size·num_micro_batches = "
            f"{s.dp}·{s.micro_batch_size}·{s.num_micro_batches} = {s.dp * s.micro_batch_size * s.num_micro_batches}"
            if s.pipeline_runs == 1 else
            f"global_batch_size={s.global_batch_size} is not dp·micro_batch_size·num_micro_batches·pipeline_runs = "
            f"{s.dp}·{s.micro_batch_size}·{s.num_micro_batches}·{s.pipeline_runs} = "
            f"{s.dp * s.micro_batch_size * s.micro_batches_per_step}"
        ),
    ),
    Rule(
        "pipeline_runs_need_pipeline",
        lambda b, c: (b.pipeline_runs == 1) | (b.pp > 1),
        lambda s, c: (f"pipeline_runs={s.pipeline_runs} needs a pipeline (pp > 1); without one a step is "
                      f"{s.micro_batches_per_step} micro-batches one after another: "
                      f"num_micro_batches={s.micro_batches_per_step}, pipeline_runs=1"),
    ),
    Rule(
        "tp_divides_heads",
        lambda b, c: _divides(b.tp, c.model.num_attention_heads),
        lambda s, c: f"tp={s.tp} does not divide num_attention_heads={c.model.num_attention_heads}",
    ),
    # Megatron-Core runs tp above the KV heads where they divide it (each rank gathers the QKV
    # output and keeps one KV head, Attention.get_query_key_value_tensors); torch's TP plans
    # split whole heads only (search.run.RUNTIME_LIMITS refuses tp > kv heads there).
    Rule(
        "tp_divides_kv_heads",
        lambda b, c: (np.ones(len(b), bool) if c.model.is_mla
                      else _divides(b.tp, c.model.num_kv_heads) | _divides(np.full(len(b), c.model.num_kv_heads), b.tp)),
        lambda s, c: (f"tp={s.tp} neither divides num_key_value_heads={c.model.num_kv_heads} nor is a multiple of it "
                      "(with more ranks than KV heads, Megatron-Core gives each KV head tp/num_key_value_heads ranks)"),
    ),
    Rule(
        "tp_divides_linear_heads",
        # A Gated DeltaNet layer is split over TP by its key heads (each with its value heads).
        lambda b, c: (_divides(b.tp, c.model.linear_num_key_heads) if c.model.has_linear_attention
                      else np.ones(len(b), bool)),
        lambda s, c: f"tp={s.tp} does not divide linear_num_key_heads={c.model.linear_num_key_heads} (Gated DeltaNet)",
    ),
    Rule(
        "cp_linear_attention",
        lambda b, c: (b.cp == 1) | (not c.model.has_linear_attention),
        lambda s, c: (f"cp={s.cp}: context parallelism over Gated DeltaNet layers (their recurrent state passed "
                      "between ranks) is not priced; use cp=1"),
    ),
    Rule(
        "tp_divides_ffn",
        lambda b, c: np.ones(len(b), bool) if not c.model.num_dense_layers else _divides(b.tp, c.model.ffn_hidden_size),
        lambda s, c: f"tp={s.tp} does not divide ffn_hidden_size={c.model.ffn_hidden_size}",
    ),
    Rule(
        "tp_divides_shared_experts",
        lambda b, c: _divides(b.tp, c.model.shared_expert_ffn_hidden_size) if c.model.num_shared_experts else np.ones(len(b), bool),
        lambda s, c: f"tp={s.tp} does not divide shared_expert_ffn_hidden_size={c.model.shared_expert_ffn_hidden_size}",
    ),
    Rule(
        "ep_needs_experts",
        lambda b, c: np.ones(len(b), bool) if c.model.is_moe else (b.ep == 1) & (b.etp == b.tp),
        lambda s, c: (f"ep={s.ep}" if s.ep != 1 else f"etp={s.etp} (other than tp={s.tp})")
        + f" needs a mixture-of-experts model; {c.model.name} has no experts",
    ),
    Rule(
        "ep_divides_experts",
        lambda b, c: _divides(b.ep, c.model.num_experts) if c.model.is_moe else np.ones(len(b), bool),
        lambda s, c: f"ep={s.ep} does not divide num_experts={c.model.num_experts}",
    ),
    Rule(
        "etp_divides_moe_ffn",
        lambda b, c: _divides(b.etp, c.model.moe_ffn_hidden_size) if c.model.is_moe else np.ones(len(b), bool),
        lambda s, c: f"etp={s.etp} does not divide moe_ffn_hidden_size={c.model.moe_ffn_hidden_size}",
    ),
    Rule(
        "expert_grid_fits",
        lambda b, c: _divides(b.ep * b.etp, b.dp * b.cp * b.tp),
        lambda s, c: f"ep·etp = {s.ep}·{s.etp} = {s.ep * s.etp} does not divide dp·cp·tp = {s.dp * s.cp * s.tp}, the ranks of a stage",
    ),
    Rule(
        "layers_cover_stages",
        # The embedding and the output head count as layers where the placement treats them so
        # (Megatron's account_for_embedding/loss_in_pipeline_split): 94 layers fill pp·vpp = 96
        # virtual stages, the first and last holding only the embedding and the head.
        lambda b, c: b.pp * b.vpp <= c.model.num_layers + b.embedding_as_layer + b.output_as_layer,
        lambda s, c: (
            f"pp·vpp = {s.pp}·{s.vpp} = {s.num_virtual_stages} virtual stages exceed num_layers={c.model.num_layers}"
            + (f" + {int(s.embedding_as_layer) + int(s.output_as_layer)} (the embedding and output head as layers)"
               if s.embedding_as_layer or s.output_as_layer else "")
        ),
    ),
    Rule(
        "vpp_needs_virtual_schedule",
        lambda b, c: (b.vpp == 1) | b.is_in("schedule", VIRTUAL_SCHEDULES),
        lambda s, c: f"vpp={s.vpp} needs one of the schedules {', '.join(VIRTUAL_SCHEDULES)}, not '{s.schedule}'",
    ),
    Rule(
        "interleaved_needs_vpp",
        lambda b, c: ~b.is_("schedule", "interleaved") | (b.vpp >= 2),
        lambda s, c: f"schedule 'interleaved' needs vpp >= 2, got vpp={s.vpp}",
    ),
    Rule(
        "v_schedule_needs_vpp2",
        lambda b, c: ~b.is_in("schedule", ("zbv", "dualpipev")) | (b.vpp == 2),
        lambda s, c: f"schedule '{s.schedule}' places two chunks per stage in a V: needs vpp=2, got vpp={s.vpp}",
    ),
    Rule(
        "virtual_schedule_needs_pp",
        lambda b, c: ~b.is_in("schedule", VIRTUAL_SCHEDULES) | (b.pp >= 2),
        lambda s, c: f"schedule '{s.schedule}' needs pp >= 2, got pp={s.pp}",
    ),
    Rule(
        "interleaved_micro_batches",
        # Megatron-LM's interleaved schedule runs micro-batches in groups of pp.
        lambda b, c: ~b.is_("schedule", "interleaved") | _divides(b.pp, b.num_micro_batches),
        lambda s, c: f"schedule 'interleaved' needs num_micro_batches={s.num_micro_batches} to be a multiple of pp={s.pp}",
    ),
    Rule(
        "dualpipev_micro_batches",
        # DualPipeV fills both arms of the V from the start: it needs at least 2·pp micro-batches.
        lambda b, c: ~b.is_("schedule", "dualpipev") | (b.num_micro_batches >= 2 * b.pp),
        lambda s, c: f"schedule 'dualpipev' needs num_micro_batches >= 2·pp = {2 * s.pp}, got {s.num_micro_batches}",
    ),
    Rule(
        "seq_chunks_need_seq1f1b",
        lambda b, c: b.is_("schedule", "seq1f1b") | (b.seq_chunks == 1),
        lambda s, c: f"seq_chunks={s.seq_chunks} needs schedule 'seq1f1b', not '{s.schedule}'",
    ),
    Rule(
        "seq_chunks_divide_seq",
        lambda b, c: _divides(b.seq_chunks * b.cp, b.seq_length),
        lambda s, c: f"seq_chunks·cp = {s.seq_chunks}·{s.cp} does not divide seq_length={s.seq_length}",
    ),
    Rule(
        "sp_needs_tp",
        lambda b, c: (b.sequence_parallel == 0) | (b.tp > 1),
        lambda s, c: "sequence_parallel needs tp > 1 (with tp=1 it changes nothing)",
    ),
    Rule(
        "sp_divides_seq",
        lambda b, c: (b.sequence_parallel == 0) | _divides(b.tp * b.cp, b.seq_length),
        lambda s, c: f"sequence parallel splits the sequence over tp·cp = {s.tp * s.cp} ranks; it does not divide seq_length={s.seq_length}",
    ),
    Rule(
        "cp_ring_divides_seq",
        # Ring attention gives each rank two mirrored chunks to balance the causal mask.
        lambda b, c: (b.cp == 1) | b.is_("cp_kind", "ulysses") | _divides(2 * b.cp, b.seq_length),
        lambda s, c: f"ring context parallelism needs seq_length={s.seq_length} divisible by 2·cp = {2 * s.cp}",
    ),
    Rule(
        "cp_ulysses_heads",
        lambda b, c: ~b.is_("cp_kind", "ulysses") | (b.cp == 1) | _divides(b.tp * b.cp, c.model.num_attention_heads),
        lambda s, c: f"Ulysses splits heads over tp·cp = {s.tp * s.cp}; it does not divide num_attention_heads={c.model.num_attention_heads}",
    ),
    Rule(
        "cp_ulysses_kv_heads",
        # Ulysses scatters a tensor-parallel rank's key and value heads over its all-to-all group
        # of u ranks (tp·u divides the KV heads), or, where the group outnumbers them, repeats them
        # to the rank's query heads first (MindSpeed; Transformer Engine refuses that: search.run's
        # runtime limits) so each rank of the group receives whole heads. Fewer ranks than the
        # rank's KV heads that do not divide them split a head. MLA expands its keys and values to
        # num_attention_heads heads, which cp_ulysses_heads checks.
        lambda b, c: np.ones(len(b), bool) if c.model.is_mla else (
            (b.ulysses_ranks == 1)
            | _divides(b.tp * b.ulysses_ranks, c.model.num_kv_heads)
            | (b.ulysses_ranks * np.minimum(b.tp, c.model.num_kv_heads) > c.model.num_kv_heads)),
        lambda s, c: (
            f"Ulysses splits the key/value heads over tp·{'ulysses_degree' if s.cp_kind == 'hybrid' else 'cp'} = "
            f"{s.tp * s.ulysses_ranks}; it does not divide num_key_value_heads={c.model.num_kv_heads}, and its "
            f"{s.ulysses_ranks} ranks are fewer than the {c.model.num_kv_heads // min(s.tp, c.model.num_kv_heads)} "
            "KV heads a tensor-parallel rank holds (where they outnumber them, MindSpeed repeats the heads)"),
    ),
    Rule(
        "cp_hybrid_degree",
        lambda b, c: np.where(
            b.is_("cp_kind", "hybrid"),
            _divides(b.ulysses_degree, b.cp) & _divides(b.tp * b.ulysses_degree, c.model.num_attention_heads),
            b.ulysses_degree == 1),
        lambda s, c: (
            f"hybrid context parallelism needs ulysses_degree={s.ulysses_degree} to divide cp={s.cp} and "
            f"tp·ulysses_degree={s.tp * s.ulysses_degree} to divide num_attention_heads={c.model.num_attention_heads}"
            if s.cp_kind == "hybrid" else
            f"ulysses_degree={s.ulysses_degree} needs cp_kind 'hybrid', not '{s.cp_kind}'"
        ),
    ),
    Rule(
        "fsdp_is_zero3",
        lambda b, c: (b.fsdp == 0) | (b.zero == 3),
        lambda s, c: f"fsdp shards parameters, gradients and optimizer states: it needs zero=3, got zero={s.zero}",
    ),
    Rule(
        "shard_group_divides_dp",
        lambda b, c: (b.shard_group == 0) | _divides(b.shard_group, b.dp * b.cp),
        lambda s, c: f"shard_group={s.shard_group} does not divide the dp·cp = {s.dp * s.cp} ranks that hold replicas",
    ),
    Rule(
        "shard_group_holds_expert_groups",
        lambda b, c: (b.shard_group == 0) | _divides(b.ep * b.etp, b.shard_group * b.tp),
        lambda s, c: f"shard_group={s.shard_group} · tp={s.tp} is not a multiple of ep·etp = {s.ep * s.etp}: "
                     f"the experts shard over the expert ranks inside a shard group, shard_group·tp/(ep·etp)",
    ),
    Rule(
        "shard_group_needs_zero",
        lambda b, c: (b.shard_group == 0) | (b.zero > 0),
        lambda s, c: f"shard_group={s.shard_group} has nothing to shard with zero=0",
    ),
    Rule(
        "recompute_layers_fit_stage",
        lambda b, c: b.recompute_layers <= -(-c.model.num_layers // (b.pp * b.vpp)),
        lambda s, c: f"recompute_layers={s.recompute_layers} exceeds the {_max_layers_per_stage(s, c)} layers of a stage",
    ),
    Rule(
        "offload_runs",
        lambda b, c: _offload_runs(b),
        lambda s, c: offload_conflict(s.offload_modules, s.recompute, s.recompute_modules, s.schedule),
    ),
    # (Strategy refuses these one by one; a batch built from columns is checked here.)
    Rule(
        "offload_layers_run",
        lambda b, c: (b.offload_layers == 0) | ((b.pp == 1) & b.is_("recompute", "none") & (not b.offload_modules)),
        lambda s, c: layer_offload_conflict(s.offload_layers, s.pp, s.recompute, s.offload_modules),
    ),
    Rule(
        "optimizer_states_offload_needs_distributed_optimizer",
        lambda b, c: (b.offload_optimizer_states == 0) | ((b.zero == 1) & (b.fsdp == 0) & (b.optimizer_offload == 0)),
        lambda s, c: optimizer_state_offload_conflict(s.offload_optimizer_states, s.zero, s.fsdp, s.optimizer_offload),
    ),
    Rule(
        "offload_layers_below_layers",
        lambda b, c: b.offload_layers < c.model.num_layers,
        lambda s, c: (f"offload_layers={s.offload_layers}: Megatron-Core offloads fewer layers than the model's "
                      f"num_layers={c.model.num_layers} (its last layer's activations feed the backward at once)"),
    ),
    Rule(
        "recompute_layers_need_recompute",
        lambda b, c: (b.recompute_layers == 0) | ~b.is_("recompute", "none"),
        lambda s, c: f"recompute_layers={s.recompute_layers} needs recompute 'selective' or 'full', not 'none'",
    ),
)

RULE_NAMES: tuple[str, ...] = tuple(rule.name for rule in RULES)


def rule_masks(batch: StrategyBatch, ctx: RuleContext) -> dict[str, Mask]:
    """Each rule's mask over the batch (True: the rule holds)."""
    return {rule.name: np.broadcast_to(rule.holds(batch, ctx), (len(batch),)) for rule in RULES}


def valid_mask(batch: StrategyBatch, ctx: RuleContext) -> Mask:
    mask = np.ones(len(batch), bool)
    for rule in RULES:
        mask &= rule.holds(batch, ctx)
    return mask


def _placement_violations(s: Strategy, ctx: RuleContext) -> list[Violation]:
    """Explicit layer placements are per strategy, so they are checked here and not in a batch."""
    if s.stage_layers is None:
        return []
    out = []
    if len(s.stage_layers) != s.num_virtual_stages:
        out.append(Violation(
            "stage_layers_length",
            f"stage_layers has {len(s.stage_layers)} entries but pp·vpp = {s.num_virtual_stages}",
        ))
    if sum(s.stage_layers) != ctx.model.num_layers:
        out.append(Violation(
            "stage_layers_sum",
            f"stage_layers sum to {sum(s.stage_layers)} but the model has num_layers={ctx.model.num_layers}",
        ))
    if any(n < 0 for n in s.stage_layers):
        out.append(Violation("stage_layers_negative", f"stage_layers has a negative count: {list(s.stage_layers)}"))
    if s.stage_layers and s.recompute_layers > max(s.stage_layers):
        out.append(Violation(
            "recompute_layers_fit_stage",
            f"recompute_layers={s.recompute_layers} exceeds the {max(s.stage_layers)} layers of the widest stage "
            f"of stage_layers {list(s.stage_layers)}"))
    return out


def check_strategy(strategy: Strategy, model: ModelSpec, num_devices: int | None = None) -> list[Violation]:
    """Every rule the strategy breaks, each with a one-line reason naming the values."""
    if not isinstance(strategy, Strategy) or not isinstance(model, ModelSpec):
        raise NdplanError(f"check_strategy(strategy, model, num_devices) takes a Strategy and a ModelSpec, got "
                          f"{type(strategy).__name__} and {type(model).__name__}")
    # A str, 0 or 1.5 read as "the cluster has N devices", 2^70 as an OverflowError.
    if num_devices is not None and (isinstance(num_devices, bool) or not isinstance(num_devices, Integral)
                                    or not 1 <= num_devices <= MAX_DEGREE):
        raise NdplanError(f"num_devices must be a whole number from 1 to {MAX_DEGREE}, got {num_devices!r}")
    ctx = RuleContext(model, num_devices)
    batch = StrategyBatch.of(strategy)
    # An explicit placement is checked by its own widest stage (_placement_violations), not the
    # uniform one's.
    skip = {"recompute_layers_fit_stage"} if strategy.stage_layers is not None else set()
    out = [Violation(rule.name, rule.explain(strategy, ctx)) for rule in RULES
           if rule.name not in skip and not rule.holds(batch, ctx)[0]]
    return out + _placement_violations(strategy, ctx)


def validate_strategy(strategy: Strategy, model: ModelSpec, num_devices: int | None = None) -> None:
    """Raise NdplanError with every violated rule, one per line."""
    violations = check_strategy(strategy, model, num_devices)
    if violations:
        raise NdplanError("; ".join(v.message for v in violations))
