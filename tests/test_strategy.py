"""Strategy validation: every rule, the array form against the single form, clear messages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ndplan.errors import NdplanError
from ndplan.model import get_preset
from ndplan.strategy import (
    CP_KINDS,
    RECOMPUTES,
    RULES,
    SCHEDULES,
    RuleContext,
    Strategy,
    StrategyBatch,
    check_strategy,
    get_precision,
    rule_masks,
    valid_mask,
    validate_strategy,
)

LLAMA = get_preset("llama-3.1-8b")
MIXTRAL = get_preset("mixtral-8x7b")
DSV3 = get_preset("deepseek-v3")


def test_valid_strategy_has_no_violations():
    s = Strategy(dp=4, tp=2, sequence_parallel=True, micro_batch_size=2, num_micro_batches=8, global_batch_size=64)
    assert check_strategy(s, LLAMA, 8) == []
    assert s.world_size == 8 and s.global_batch_size == 64


def test_defaults_fill_etp_and_global_batch():
    s = Strategy(dp=2, tp=4, micro_batch_size=3, num_micro_batches=5)
    assert s.etp == 4 and s.global_batch_size == 30


def test_validate_raises_with_every_reason():
    s = Strategy(tp=3, dp=2, pp=3)
    with pytest.raises(NdplanError) as info:
        validate_strategy(s, LLAMA, 64)
    text = str(info.value)
    assert "tp=3 does not divide num_attention_heads=32" in text
    assert "tp=3 neither divides num_key_value_heads=8 nor is a multiple of it" in text
    assert "dp·tp·pp·cp = 2·3·3·1 = 18 but the cluster has 64 devices" in text


def test_named_precision():
    assert Strategy(precision="fsdp-bf16").precision.param_bytes == 4
    assert get_precision("megatron-bf16").optimizer_bytes == 12
    with pytest.raises(NdplanError, match="unknown precision policy 'fp9'"):
        get_precision("fp9")


def test_batch_round_trip_and_masks():
    strategies = [
        Strategy(dp=2, tp=2, pp=2, vpp=2, schedule="interleaved", num_micro_batches=4, zero=1),
        Strategy(tp=4, cp=2, cp_kind="ulysses", ep=1, recompute="full", recompute_layers=2),
    ]
    batch = StrategyBatch.of(strategies)
    assert list(batch.rows()) == strategies
    assert batch.is_("schedule", "interleaved").tolist() == [True, False]
    masks = rule_masks(batch, RuleContext(LLAMA))
    assert set(masks) == {r.name for r in RULES}
    assert valid_mask(batch, RuleContext(LLAMA)).tolist() == [True, True]


def test_concat_keeps_order_and_refuses_mixed_batch_fields():
    a = [Strategy(dp=2, tp=2), Strategy(dp=4)]
    b = [Strategy(dp=8, recompute="full")]
    joined = StrategyBatch.concat([StrategyBatch.of(a), StrategyBatch.of(b)])
    assert list(joined.rows()) == a + b
    assert StrategyBatch.concat([StrategyBatch.of(a)]) is not None
    with pytest.raises(ValueError, match="share one precision policy"):
        StrategyBatch.concat([StrategyBatch.of(a), StrategyBatch.of([Strategy(precision="fsdp-bf16")])])
    with pytest.raises(ValueError, match="no batches"):
        StrategyBatch.concat([])


def test_from_columns_broadcasts_scalars_and_names():
    batch = StrategyBatch.from_columns({"tp": np.array([1, 2, 4]), "schedule": "gpipe", "dp": 2})
    assert len(batch) == 3 and batch.etp.tolist() == [1, 2, 4]
    assert batch.global_batch_size.tolist() == [2, 2, 2]
    assert {s.schedule for s in batch.rows()} == {"gpipe"}


# Random strategies, valid or not, over small value sets so that every rule fires sometimes.
strategy_values = st.fixed_dictionaries({
    "dp": st.sampled_from([1, 2, 3, 4, 8]),
    "tp": st.sampled_from([1, 2, 3, 4, 8, 16]),
    "pp": st.sampled_from([1, 2, 4, 8, 64]),
    "cp": st.sampled_from([1, 2, 3, 4]),
    "cp_kind": st.sampled_from(CP_KINDS),
    "ulysses_degree": st.sampled_from([1, 2, 3]),
    "ep": st.sampled_from([1, 2, 4, 8, 3]),
    "etp": st.sampled_from([0, 1, 2, 3]),
    "sequence_parallel": st.booleans(),
    "vpp": st.sampled_from([1, 2, 3, 4]),
    "schedule": st.sampled_from(SCHEDULES),
    "seq_chunks": st.sampled_from([1, 2, 3]),
    "zero": st.integers(0, 3),
    "fsdp": st.booleans(),
    "shard_group": st.sampled_from([0, 2, 3, 4]),
    "recompute": st.sampled_from(RECOMPUTES),
    "recompute_layers": st.sampled_from([0, 1, 2, 40]),
    "micro_batch_size": st.sampled_from([1, 2]),
    "num_micro_batches": st.sampled_from([1, 3, 4, 8, 16]),
    "pipeline_runs": st.sampled_from([1, 1, 2]),
    "seq_length": st.sampled_from([2048, 4096, 4100, 6144]),
})


@settings(max_examples=150, deadline=None)
@given(values=st.lists(strategy_values, min_size=1, max_size=12),
       model=st.sampled_from([LLAMA, MIXTRAL, DSV3]), devices=st.sampled_from([None, 8, 64]))
def test_array_rules_agree_with_single_strategy_rules(values, model, devices):
    strategies = [Strategy(**v) for v in values]
    ctx = RuleContext(model, devices)
    masks = rule_masks(StrategyBatch.of(strategies), ctx)
    for i, s in enumerate(strategies):
        broken = {v.rule for v in check_strategy(s, model, devices)}
        assert broken == {name for name, mask in masks.items() if not mask[i]}
    valid = valid_mask(StrategyBatch.of(strategies), ctx)
    assert valid.tolist() == [not check_strategy(s, model, devices) for s in strategies]


def test_more_parallelism_never_breaks_world_size_when_product_matches():
    for tp in (1, 2, 4, 8):
        s = Strategy(dp=8 // tp, tp=tp)
        assert not [v for v in check_strategy(s, LLAMA, 8) if v.rule == "world_size"]


@pytest.mark.parametrize("scale", [1, 1 << 40])  # small values map densely; huge ones by sorting
def test_distinct_combinations_stand_for_their_rows(scale):
    rng = np.random.default_rng(0)
    batch = StrategyBatch.from_columns({
        "tp": rng.choice([1, 2, 4], 200), "seq_length": rng.choice([1024, 4096], 200) * scale,
        "micro_batch_size": rng.choice([1, 2, 3], 200), "dp": rng.choice([1, 8], 200),
    })
    names = ("tp", "seq_length", "micro_batch_size")
    rows, codes = batch.distinct(names)
    columns = np.stack([getattr(batch, name) for name in names], axis=1)
    assert len(rows) == len(np.unique(columns, axis=0)) == codes.max() + 1
    # Every row's combination is the one its code's representative has, and codes are one-to-one.
    np.testing.assert_array_equal(columns[rows[codes]], columns)
    assert len(np.unique(columns[rows], axis=0)) == len(rows)
    assert [len(x) for x in StrategyBatch.from_columns({"tp": np.zeros(0, dtype=np.int64)}).distinct(names)] == [0, 0]


def test_distinct_renumbers_when_many_fields_span_a_large_key():
    # Eight fields of six values each span 6^8 = 1.7M keys, past the table of the batch's length:
    # the combinations so far are renumbered on the way, and must still stand for their rows.
    rng = np.random.default_rng(1)
    names = ("tp", "pp", "dp", "cp", "ep", "micro_batch_size", "num_micro_batches", "seq_length")
    batch = StrategyBatch.from_columns({name: rng.choice([1, 2, 3, 5, 8, 13], 5000) for name in names})
    rows, codes = batch.distinct(names)
    columns = np.stack([getattr(batch, name) for name in names], axis=1)
    assert len(rows) == len(np.unique(columns, axis=0)) == codes.max() + 1
    np.testing.assert_array_equal(columns[rows[codes]], columns)


@pytest.mark.parametrize("in_runs", [True, False])
def test_groups_in_key_order_with_ascending_rows(in_runs):
    # Rows that run group by group (in any order of the groups) are split without a sort: the
    # same groups, in the same order, as the sort gives rows spread over the batch.
    rng = np.random.default_rng(3)
    keys = rng.permutation([(tp, pp) for tp in (1, 2, 4) for pp in (1, 3)])
    counts = rng.integers(1, 50, len(keys))
    columns = {"tp": np.repeat(keys[:, 0], counts), "pp": np.repeat(keys[:, 1], counts)}
    if not in_runs:
        order = rng.permutation(int(counts.sum()))
        columns = {name: values[order] for name, values in columns.items()}
    batch = StrategyBatch.from_columns(columns)
    groups = batch.groups(("tp", "pp"))
    assert [key for key, _ in groups] == sorted({(int(tp), int(pp)) for tp, pp in keys})
    for (tp, pp), index in groups:
        np.testing.assert_array_equal(index, np.flatnonzero((batch.tp == tp) & (batch.pp == pp)))


def test_divides_by_lookup_matches_one_division_per_element():
    from ndplan.strategy.rules import _divides, _divides_each

    rng = np.random.default_rng(2)
    divisor = rng.integers(0, 40, 6000)  # zeros included: a zero divisor divides nothing
    value = rng.integers(-50, 200, 6000)
    np.testing.assert_array_equal(_divides(divisor, value), _divides_each(divisor, value))
    for scalar in (0, 1, 24, 4096, -12):
        np.testing.assert_array_equal(_divides(divisor, scalar), _divides_each(divisor, scalar))
    assert _divides(divisor, value).shape == divisor.shape


def test_embedding_and_head_as_layers_fill_extra_virtual_stages():
    """Megatron's account_for_embedding/loss_in_pipeline_split: 32 layers + embedding + head fill
    pp·vpp = 34 virtual stages (the first holds only the embedding, the last only the head);
    without the flags, 34 stages exceed the layers and the rule names both counts."""
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import estimate
    from ndplan.perf import estimate_time
    from ndplan.placement import place_layers

    common = dict(pp=17, vpp=2, schedule="interleaved", num_micro_batches=34)
    with_ends = Strategy(**common, embedding_as_layer=True, output_as_layer=True)
    assert check_strategy(with_ends, LLAMA, 17) == []
    one_end = Strategy(**common, embedding_as_layer=True)
    assert [v.rule for v in check_strategy(one_end, LLAMA, 17)] == ["layers_cover_stages"]
    assert "exceed num_layers=32 + 1 (the embedding and output head as layers)" in check_strategy(one_end, LLAMA, 17)[0].message
    plain = Strategy(**common)
    assert "34 virtual stages exceed num_layers=32" in check_strategy(plain, LLAMA, 17)[0].message
    # Both models price the empty first and last virtual stages.
    placement = place_layers(LLAMA, 17, 2, "interleaved", embedding_as_layer=True, output_as_layer=True)
    assert placement.layers[0] == 0 and placement.layers[-1] == 0 and placement.layers.sum() == 32
    report = estimate(LLAMA, with_ends)
    # Stage 0 runs virtual stages 0 (embedding only) and 17, stage 16 runs 16 and 33 (head only).
    assert [stage.layers for stage in report.stages] == [1] + [2] * 15 + [1]
    assert all(stage.peak_bytes > 0 for stage in report.stages)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=17)
    assert estimate_time(LLAMA, with_ends, cluster).step_s > 0


def test_recompute_layers_are_checked_against_an_explicit_placement():
    """An uneven placement's widest stage bounds recompute_layers, not the uniform one's:
    DeepSeek-V3's balanced pp8 vpp4 plan recomputes 3 layers of chunks that hold up to 4."""
    from ndplan.model import get_preset
    from ndplan.strategy.rules import check_strategy

    model = get_preset("deepseek-v3")
    layers = (4, *[2] * 22, 1, 2, 1, 1, 1, 2, 2, 2, 1)
    base = dict(dp=128, pp=8, vpp=4, schedule="interleaved", ep=64, zero=1, num_micro_batches=8, recompute="full",
                stage_layers=layers)
    assert check_strategy(Strategy(**base, recompute_layers=3), model, 1024) == []
    broken = check_strategy(Strategy(**base, recompute_layers=5), model, 1024)
    assert [v.rule for v in broken] == ["recompute_layers_fit_stage"]
    assert "exceeds the 4 layers of the widest stage" in broken[0].message


def test_ulysses_splits_the_key_value_heads_over_its_group():
    """Ulysses scatters each tensor-parallel rank's key/value heads over its all-to-all group,
    or, where the group outnumbers them, repeats them to the query heads first (MindSpeed;
    Transformer Engine refuses that, a runtime limit): Llama-3.1-8B's 8 KV heads, 1 per rank at
    tp 8, are repeated over cp 2. A group of fewer ranks than a rank's heads that does not divide
    them would split a head: Phi-4's 10 KV heads over 4. Ring attention sends whole KV blocks;
    MLA's keys and values have num_attention_heads heads."""
    assert check_strategy(Strategy(tp=8, cp=2, cp_kind="ulysses"), LLAMA, 16) == []
    assert check_strategy(Strategy(tp=4, cp=4, cp_kind="hybrid", ulysses_degree=4), LLAMA, 16) == []
    phi = get_preset("phi-4")  # 40 query heads, 10 KV heads
    broken = check_strategy(Strategy(cp=4, cp_kind="ulysses"), phi, 4)
    assert [v.rule for v in broken] == ["cp_ulysses_kv_heads"]
    assert ("tp·cp = 4; it does not divide num_key_value_heads=10, and its 4 ranks are fewer than the 10 KV "
            "heads a tensor-parallel rank holds" in broken[0].message)
    hybrid = check_strategy(Strategy(cp=8, cp_kind="hybrid", ulysses_degree=4), phi, 8)
    assert [v.rule for v in hybrid] == ["cp_ulysses_kv_heads"]
    assert "tp·ulysses_degree = 4" in hybrid[0].message
    # at tp 2 a rank holds 5: 4 ranks split them, 10 repeat them (and divide the 20 query heads)
    assert [v.rule for v in check_strategy(Strategy(tp=2, cp=4, cp_kind="ulysses"), phi, 8)] == ["cp_ulysses_kv_heads"]
    assert check_strategy(Strategy(tp=2, cp=10, cp_kind="ulysses", seq_length=4000), phi, 20) == []
    assert check_strategy(Strategy(tp=8, cp=4, cp_kind="ulysses", ep=8, etp=1), DSV3, 32) == []
