"""Strategy search: equal to a brute-force loop over the same space, every rejection reachable."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.hardware import Cluster, get_device
from ndplan.memory import MemoryOptions, estimate
from ndplan.model import ModelSpec, get_preset
from ndplan.perf import step_time_batch
from ndplan.schedule import SPLIT_BACKWARD
from ndplan.search import OVER_MEMORY, default_space, pareto_front, run_search, runtime_step_time
from ndplan.search.run import DUPLICATE, NOT_RUNNABLE
from ndplan.search.screen import fields_read, screened_blocks
from ndplan.search.space import DIMENSIONS, FIELD_DIMENSIONS
from ndplan.strategy import RULES, Strategy, StrategyBatch, check_strategy, get_precision
from ndplan.strategy.rules import RuleContext

TINY_MOE = ModelSpec(
    name="tiny-moe", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_kv_heads=4,
    head_dim=32, vocab_size=1024, num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=128,
    layer_mlp_kinds=("dense", "moe", "moe", "moe"),
)
DEVICE = get_device("h100-sxm")
#: The runtime the balanced rankings run (fused kernels: recompute is cheap enough that balanced
#: plans reach the top) and its step time; a balanced ranking and its reference use the same.
BALANCE_OPTIONS = MemoryOptions(runtime="megatron")
RUNTIME_TIME = runtime_step_time(BALANCE_OPTIONS)


def _space(devices=8, gbs=16, seq=1024, dims=None):
    return default_space(TINY_MOE, DEVICE, devices, gbs, seq, get_precision("megatron-bf16"), dims=dims)


@pytest.mark.parametrize("dims", [
    ("tp", "sp", "ep", "etp", "pp", "schedule", "zero", "recompute"),
    ("ep", "pp", "schedule", "zero", "pipeline_runs"),  # runs of the schedule a step (opt-in)
])
def test_search_equals_brute_force_with_the_single_strategy_api(dims):
    space = _space(dims=dims)
    limit = 2 * 2**30
    options = MemoryOptions()
    result = run_search(TINY_MOE, DEVICE, space, step_time_batch, memory_limit_bytes=limit, options=options,
                        top=10**9, block_size=97)
    cluster = Cluster(device=DEVICE, num_devices=space.num_devices)
    expected = []
    duplicates = space.duplicates(np.arange(space.size))
    for candidate in range(space.size):
        strategy = space.strategy(candidate)
        if duplicates[candidate] or check_strategy(strategy, TINY_MOE, space.num_devices):
            continue
        if strategy.schedule in SPLIT_BACKWARD and strategy.recompute == "selective":
            continue  # PyTorch cannot run it (the default runtime): rejected as not runnable
        if strategy.schedule not in options.profile.schedules:
            continue  # nor a schedule torch.distributed.pipelining does not have (zb-h1, seq1f1b)
        if strategy.schedule == "1f1b" and strategy.num_micro_batches < strategy.pp:
            continue  # nor 1F1B with fewer micro-batches than stages (its Schedule1F1B raises)
        if strategy.zero in (1, 2) and strategy.dp * strategy.cp == 1:
            continue  # ZeRO 0 under another name: nothing to shard over (a duplicate)
        if strategy.tp > TINY_MOE.num_kv_heads:
            continue  # nor more TP ranks than KV heads (torch's TP plans split whole heads)
        report = estimate(TINY_MOE, strategy, DEVICE, options, num_devices=space.num_devices)
        if report.peak_bytes > limit:
            continue
        times = step_time_batch(TINY_MOE, StrategyBatch.of(strategy), cluster)
        figures = {k: float(v[0]) for k, v in times.items()} | {"peak_stage": report.peak_stage}
        expected.append((figures["step_s"], report.peak_bytes, candidate, figures))
    expected.sort(key=lambda e: e[:3])
    assert [row["candidate"] for row in result.ranked] == [c for _, _, c, _ in expected]
    assert result.rejected[NOT_RUNNABLE] > 0
    assert len(expected) > 50 and result.fitting == len(expected)
    assert result.evaluated > 97  # the survivors were priced in several calls: each row's figures are its own
    for row, (step, peak, _, times) in zip(result.ranked, expected, strict=True):
        assert row["step_s"] == pytest.approx(step, rel=1e-12)
        assert row["peak_bytes"] == round(peak)
        assert {k: row[k] for k in times} == pytest.approx(times, rel=1e-12)  # peak_stage exactly
    if "pipeline_runs" in dims:
        assert {row["pipeline_runs"] for row in result.ranked} == set(space.pipeline_runs) == {1, 2, 4, 8}


def _above_kv_heads(space, model=TINY_MOE):
    """Candidates of ``space`` no rule refuses, not duplicates, with more TP ranks than the model
    has KV heads: the pytorch runtime's not runnable (torch's TP plans split whole heads), which
    Megatron-Core runs."""
    every = np.arange(space.size)
    batch = space.batch(every)
    context = RuleContext(model, space.num_devices)
    valid = ~space.duplicates(every) & (batch.tp > model.num_kv_heads)
    for rule in RULES:
        valid &= rule.holds(batch, context)
    return int(np.count_nonzero(valid))


def _megatron_refuses_what_pytorch_ranks(space, refused):
    """The megatron search ranks no row ``refused`` says it refuses, and counts as not runnable at
    least as many as the pytorch search (which runs them) ranks, beside those with more TP ranks
    than KV heads, which the pytorch search counts and Megatron runs."""
    megatron = run_search(TINY_MOE, DEVICE, space, RUNTIME_TIME, memory_limit_bytes=2 * 2**30, top=10**9,
                          options=BALANCE_OPTIONS)
    pytorch = run_search(TINY_MOE, DEVICE, space, step_time_batch, memory_limit_bytes=2 * 2**30, top=10**9,
                         options=MemoryOptions())
    assert megatron.ranked and not any(refused(row) for row in megatron.ranked)
    allowed = sum(refused(row) for row in pytorch.ranked)
    assert allowed > 0
    above = _above_kv_heads(space)
    assert pytorch.rejected[NOT_RUNNABLE] >= above
    assert megatron.rejected[NOT_RUNNABLE] - (pytorch.rejected[NOT_RUNNABLE] - above) >= allowed


def test_megatron_search_never_ranks_expert_and_tensor_parallelism_without_sequence_parallelism():
    """Megatron-Core's ModelParallelConfig refuses ep > 1 beside tp > 1 without sequence
    parallelism, so a search under the megatron runtime must not rank such a strategy (it did, and
    --emit megatron wrote a launch Megatron stops at); they count as not runnable. PyTorch's runtime
    runs them."""
    space = _space(dims=("tp", "sp", "ep", "pp", "zero"))

    def refused(row):
        return row["ep"] > 1 and row["tp"] > 1 and not row["sp"]

    _megatron_refuses_what_pytorch_ranks(space, refused)


def test_progress_counts_candidates_once_their_survivors_are_priced():
    """Survivors wait until a block's worth has gathered; the progress reported never runs ahead
    of the pricing, never goes back, and ends at the space's size. The result is the same
    whatever the block size (survivors priced in one batch or in many)."""
    space = _space(dims=("tp", "sp", "ep", "pp", "schedule", "zero", "recompute"))
    calls: list[tuple[int, int]] = []
    small = run_search(TINY_MOE, DEVICE, space, step_time_batch, top=10**9, block_size=97,
                       progress=lambda done, size: calls.append((done, size)))
    done = [d for d, _ in calls]
    assert all(size == space.size for _, size in calls)
    assert done == sorted(done) and done[-1] == space.size and len(calls) > 3
    large = run_search(TINY_MOE, DEVICE, space, step_time_batch, top=10**9, block_size=1 << 16)
    assert [r["candidate"] for r in small.ranked] == [r["candidate"] for r in large.ranked]
    assert small.rejected == large.rejected and small.evaluated == large.evaluated


@pytest.mark.parametrize("inner", [1, 3, 7, 500, 5000])
def test_periodic_column_is_the_digit_of_each_position(inner):
    from ndplan.search.space import _periodic

    values = np.array([5, 1, 9], dtype=np.int64)
    for start, stop in [(0, 1), (0, 6000), (4, 5), (499, 1501), (1234, 20000), (14999, 15001)]:
        position = np.arange(start, stop)
        np.testing.assert_array_equal(_periodic(values, inner, start, stop), values[(position // inner) % 3])


def test_blocks_cover_every_candidate_once_with_its_own_index():
    """Blocks run pipeline-shape first, but each candidate keeps its index in the product: the
    blocks together are a permutation of the space, and each row is that index's strategy."""
    space = _space(dims=("tp", "sp", "ep", "pp", "schedule", "zero", "mbs", "recompute"))
    seen, shapes_per_block = [], []
    for index, batch in space.blocks(block_size=1000):
        seen.append(index)
        reference = space.batch(index)
        for name in batch.array_fields():
            np.testing.assert_array_equal(getattr(batch, name), getattr(reference, name))
        shapes_per_block.append(len({(int(p), int(s)) for p, s in zip(batch.pp, batch.schedule, strict=True)}))
    every = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(every), np.arange(space.size))
    # Pipeline shapes come in runs of size / pipelines candidates, so a block of 1000 spans at
    # most ceil(1000 / run) + 1 of them rather than all.
    pipelines = len(space.pp) * len(space.schedule)
    run = space.size // pipelines
    assert max(shapes_per_block) <= -(-1000 // run) + 1 < pipelines


RULES_MODEL = TINY_MOE.model_copy(update={
    "hidden_size": 320, "num_attention_heads": 20, "num_kv_heads": 2, "head_dim": 16, "ffn_hidden_size": 480,
    "moe_ffn_hidden_size": 45,
})


def test_every_rejection_reason_is_reachable_and_counted():
    space = default_space(RULES_MODEL, DEVICE, 24, 36, 1026, get_precision("megatron-bf16"))
    result = run_search(RULES_MODEL, DEVICE, space, step_time_batch, memory_limit_bytes=300 * 2**20)
    assert sum(result.rejected.values()) + result.fitting == space.size
    reached = {name for name, count in result.rejected.items() if count}
    unreachable_here = {"shard_group_divides_dp", "shard_group_needs_zero", "shard_group_holds_expert_groups",
                        "recompute_layers_fit_stage",
                        "recompute_layers_need_recompute", "seq_chunks_need_seq1f1b", "fsdp_is_zero3",
                        "cp_hybrid_degree", "tp_divides_ffn", "tp_divides_shared_experts", "ep_needs_experts",
                        "vpp_needs_virtual_schedule", "interleaved_needs_vpp", "v_schedule_needs_vpp2",
                        "offload_runs", "pipeline_runs_need_pipeline", "tp_divides_linear_heads",
                        "cp_linear_attention", "tp_divides_kv_heads", "offload_layers_run",
                        "offload_layers_below_layers", "optimizer_states_offload_needs_distributed_optimizer",
                        "cp_ulysses_kv_heads"}
    # The space never draws these combinations (it pairs schedules with their vpp, sets fsdp with
    # zero 3, has no shard groups, recompute layer counts or offload; the model has no Gated
    # DeltaNet layers; a tp that divides the 20 heads divides its 2 KV heads or is a multiple of
    # them, and any Ulysses group divides or repeats a rank's 1 or 2 KV heads; no layer offload,
    # which no dimension searches; no optimizer states offloaded, which a space carries alone);
    # test_strategy/test_cli (test_offload for offload_runs,
    # test_layer_offload for offload_layers_run, test_optimizer_state_offload for the states) reach each.
    assert {r.name for r in RULES} - unreachable_here | {OVER_MEMORY, DUPLICATE} <= reached


def test_best_never_breaks_a_rule_or_the_limit():
    space = _space()
    limit = 1 * 2**30
    result = run_search(TINY_MOE, DEVICE, space, step_time_batch, memory_limit_bytes=limit)
    assert result.best is not None
    for row in result.ranked:
        strategy = space.strategy(row["candidate"])
        assert not check_strategy(strategy, TINY_MOE, space.num_devices)
        assert row["peak_bytes"] <= limit


def test_pareto_front_is_not_dominated():
    rng = np.random.default_rng(1)
    time_s, peak = rng.random(500), rng.random(500)
    front = pareto_front(time_s, peak)
    for i in front:
        assert not np.any((time_s <= time_s[i]) & (peak <= peak[i]) & ((time_s < time_s[i]) | (peak < peak[i])))
    assert np.all(np.diff(time_s[front]) >= 0)


def test_order_by_time_then_peak_is_the_stable_lexsort():
    """Ties in time (and NaNs) are re-sorted by peak apart; the order is lexsort's, ties in both
    by position."""
    from ndplan.search.run import by_time_then_peak

    rng = np.random.default_rng(2)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        time_s = rng.integers(0, int(rng.integers(1, 50)), n).astype(float)
        peak = rng.integers(0, 5, n).astype(float)
        if trial % 3 == 0:
            time_s[rng.random(n) < 0.1] = np.nan
        if trial % 5 == 0:
            peak[rng.random(n) < 0.1] = np.nan
        np.testing.assert_array_equal(by_time_then_peak(time_s, peak), np.lexsort((peak, time_s)))


def test_fixed_dimensions_are_respected():
    space = default_space(TINY_MOE, DEVICE, 8, 16, 1024, get_precision("megatron-bf16"), fixed={"tp": 2, "schedule": "1f1b"})
    result = run_search(TINY_MOE, DEVICE, space, step_time_batch)
    assert result.ranked and all(r["tp"] == 2 and r["schedule"] == "1f1b" for r in result.ranked)


def test_cli_search_json_and_nothing_fits(capsys):
    code = main(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32",
                 "--seq", "4096", "--dims", "tp", "pp", "zero", "recompute", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ranked"] and data["ranked"][0]["step_s"] > 0
    assert data["ranked"][0]["peak_bytes"] <= data["memory_limit_bytes"]
    code = main(["search", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "8",
                 "--dims", "tp", "zero", "--memory-limit", "20GiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and not data["ranked"]
    assert any("smallest peak" in note for note in data["notes"])


def test_cli_search_says_why_nothing_is_ranked(capsys):
    """Nothing valid is not "nothing fits"; and a global batch that does not divide by the
    device factor still lets larger clusters be tried (dp need not grow with them)."""
    code = main(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "8",
                 "--fix", "tp=16", "--dims", "tp", "pp", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["evaluated"] == 0
    # tp=16 breaks a rule on every cluster (8 KV heads): more devices do not help, and the note says so
    assert data["notes"][0].startswith("no candidate is valid")
    assert any("valid on up to 512 devices either: more devices do not help" in note for note in data["notes"])
    assert data["notes"][-1] == "--dims tp: fixed by --fix tp=16, so not searched"
    code = main(["search", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "9",
                 "--dims", "tp", "pp", "zero", "recompute", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and "smallest peak" in data["notes"][0]
    # the limit it names is rounded up, so that it fits: a search with it ranks something
    limit = data["notes"][0].split("--memory-limit ")[1].split(" ")[0]
    assert main(["search", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "9",
                 "--dims", "tp", "pp", "zero", "recompute", "--memory-limit", limit, "--json"]) == 0
    capsys.readouterr()
    # the fewest devices: doubling to 16 (none) and 32 (some), then bisection over nodes of 8: 24
    assert data["notes"][-1].startswith("with 24 devices (the fewest that fit, in whole nodes of 8")
    assert main(["search", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "24", "--gbs", "9",
                 "--dims", "tp", "pp", "zero", "recompute", "--json"]) == 0
    capsys.readouterr()
    # A count that is no whole number of nodes: whole nodes are tried (28 + 8k skipped 32, which fits).
    assert main(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "28", "--gbs", "8",
                 "--memory-limit", "10GiB", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["notes"][-1].startswith("with 32 devices (the fewest that fit")
    assert main(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "24", "--gbs", "8",
                 "--memory-limit", "10GiB", "--json"]) == 1
    capsys.readouterr()
    assert main(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "32", "--gbs", "8",
                 "--memory-limit", "10GiB", "--json"]) == 0


def test_static_bound_never_exceeds_the_peak_and_keeps_the_smallest_peak_exact():
    """The search rejects first by the static state alone: a lower bound of every strategy's
    peak. With nothing fitting, the smallest peak it reports is still the exact minimum."""
    from ndplan.memory.stages import peak_memory, static_lower_bound

    space = _space(dims=("tp", "sp", "ep", "etp", "pp", "schedule", "zero", "recompute"))
    batch = space.batch(np.arange(space.size))
    valid = np.array([not check_strategy(s, TINY_MOE, space.num_devices) for s in batch.rows()])
    valid &= ~space.duplicates(np.arange(space.size))
    valid &= ~(batch.is_in("schedule", sorted(SPLIT_BACKWARD)) & batch.is_("recompute", "selective"))
    valid &= batch.is_in("schedule", list(MemoryOptions().profile.schedules))  # what the runtime runs
    valid &= ~(batch.is_("schedule", "1f1b") & (batch.num_micro_batches < batch.pp))  # Schedule1F1B's minimum
    valid &= ~(np.isin(batch.zero, (1, 2)) & (batch.dp * batch.cp == 1))  # ZeRO 0 under another name
    valid &= batch.tp <= TINY_MOE.num_kv_heads  # torch's TP plans split whole KV heads
    batch = batch.take(np.flatnonzero(valid))
    peak, _ = peak_memory(TINY_MOE, batch, MemoryOptions())
    lower = static_lower_bound(TINY_MOE, batch, MemoryOptions())
    assert np.all(lower <= peak) and np.any(lower < peak)
    # A limit between the smallest bound and the smallest peak: the bound rejects some, none fit.
    limit = int(min(peak.min() - 1, np.sort(lower)[len(lower) // 2]))
    result = run_search(TINY_MOE, DEVICE, space, step_time_batch, memory_limit_bytes=limit, block_size=997)
    assert result.fitting == 0
    assert result.smallest_peak_bytes == pytest.approx(float(peak.min()))
    assert result.rejected[OVER_MEMORY] == len(batch)


@pytest.mark.parametrize("fitting", ["some", "none"])
def test_pricing_cut_short_over_the_limit_changes_no_search_result(monkeypatch, fitting):
    """The search prices a candidate's memory only until it is certainly over the limit
    (``peak_memory``'s limit): the same result, bit for bit, as pricing every one in full, where
    some fit and where none does. There the limit is a byte above the static bound of the
    candidate with the smallest peak, whose partial sum is over it: cut short, and priced again
    in full for the smallest peak (``_smallest_peak``), as those the static bound rejected are."""
    import ndplan.search.run as search_run
    from ndplan.memory.stages import static_lower_bound

    space = _space(dims=("tp", "sp", "ep", "etp", "pp", "schedule", "zero", "recompute", "mbs"))
    every = run_search(TINY_MOE, DEVICE, space, step_time_batch, top=5)  # the device's memory: all fit
    peaks = every.candidates_peak_bytes
    smallest = int(np.argmin(peaks))
    if fitting == "some":
        limit = int(np.sort(peaks)[len(peaks) // 3])
    else:
        limit = int(static_lower_bound(TINY_MOE, space.batch(every.candidates_index[[smallest]]))[0]) + 1
    priced_in_full = search_run.peak_memory
    cut: list[np.ndarray] = []

    def counted(model, batch, options=None, *, limit=None):
        peak, stage = priced_in_full(model, batch, options, limit=limit)
        cut.append(peak[stage < 0])
        return peak, stage

    monkeypatch.setattr(search_run, "peak_memory", counted)
    short = run_search(TINY_MOE, DEVICE, space, step_time_batch, memory_limit_bytes=limit, top=5, block_size=997)
    monkeypatch.setattr(search_run, "peak_memory", lambda model, batch, options=None, *, limit=None:
                        priced_in_full(model, batch, options))
    full = run_search(TINY_MOE, DEVICE, space, step_time_batch, memory_limit_bytes=limit, top=5, block_size=997)
    cut_short = np.concatenate(cut)
    assert (short.fitting > 0) == (fitting == "some")
    if fitting == "some":
        assert len(cut_short) > short.rejected[OVER_MEMORY] // 4
    else:  # the smallest peak's candidate among those cut, its lower bound below its peak
        assert full.smallest_peak_bytes == peaks[smallest] and np.any(cut_short < peaks[smallest])
    for name in ("evaluated", "fitting", "rejected", "ranked", "pareto", "smallest_peak_bytes", "notes"):
        assert getattr(short, name) == getattr(full, name), name
    for name in ("candidates_time_s", "candidates_peak_bytes", "candidates_index"):
        np.testing.assert_array_equal(getattr(short, name), getattr(full, name))


@pytest.mark.parametrize("runtime", ["pytorch", "megatron"])
def test_static_bound_is_a_function_of_the_static_fields(runtime):
    """static_lower_bound prices one strategy of each combination of STATIC_FIELDS for all of
    them: equal to pricing every strategy, over strategies that differ in every other field."""
    from ndplan.memory.fields import STATIC_FIELDS
    from ndplan.memory.stages import _sorted_groups, static_lower_bound
    from ndplan.strategy import RuleContext, valid_mask

    space = _space()
    batch = space.batch(np.arange(space.size))
    batch = batch.take(np.flatnonzero(valid_mask(batch, RuleContext(TINY_MOE, space.num_devices))))
    rng = np.random.default_rng(0)
    varied = {"recompute_layers": rng.integers(0, 3, len(batch)), "reshard_after_forward": rng.integers(0, 2, len(batch)),
              "seq_length": rng.choice([1024, 2048], len(batch)), "ulysses_degree": rng.choice([1, 2], len(batch))}
    batch = StrategyBatch(**{name: varied.get(name, getattr(batch, name)) for name in batch.array_fields()},
                          precision=batch.precision)
    options = MemoryOptions(runtime=runtime)
    each = np.zeros(len(batch))
    for _key, index, out, _ in _sorted_groups(TINY_MOE, batch, options, None, static_only=True):
        each[index] = out["device"].max(axis=1)
    assert len(batch.distinct(STATIC_FIELDS)[0]) < len(batch) // 4
    np.testing.assert_array_equal(static_lower_bound(TINY_MOE, batch, options), each)


@pytest.mark.parametrize("runtime", ["pytorch", "megatron"])
def test_peak_memory_prices_strategies_alike_once_and_the_same(runtime):
    """peak_memory prices one strategy of each kind alike in every field that the model reads
    (the context-parallel kind counts only where its exchange is the largest buffer): the same
    peaks and stages, bit for bit, as pricing each strategy on its own."""
    from ndplan.memory.fields import PIPELINE_SHAPE
    from ndplan.memory.grouping import group_alike
    from ndplan.memory.stages import _sorted_groups, peak_memory
    from ndplan.strategy import valid_mask

    space = _space(devices=16, seq=8192, dims=("tp", "sp", "cp", "ep", "pp", "schedule", "zero", "recompute"))
    batch = space.batch(np.arange(space.size))
    batch = batch.take(np.flatnonzero(valid_mask(batch, RuleContext(TINY_MOE, space.num_devices))))
    cp = np.flatnonzero(batch.cp > 1)
    batch = batch.take(np.sort(np.random.default_rng(0).choice(cp, 60, replace=False)))
    # Every strategy in each kind of context parallelism, and one twice: some alike, some not.
    batch = StrategyBatch.concat([
        StrategyBatch(**{**{name: getattr(batch, name) for name in batch.array_fields()},
                         "cp_kind": np.full(len(batch), kind)}, precision=batch.precision)
        for kind in range(3)] + [batch.take(np.arange(1))])
    options = MemoryOptions(runtime=runtime)
    _, alike = group_alike(TINY_MOE, batch, options, batch.groups(PIPELINE_SHAPE), None)
    if runtime == "megatron":
        assert alike is not None and len(batch) // 3 < len(alike[0]) < len(batch)
        assert any(of is not None for *_, of in _sorted_groups(TINY_MOE, batch, options, None, device_only=True))
    else:
        # torch's ring holds its all-gathered keys and values, the largest buffer of every
        # strategy here: each reads its context-parallel kind, so none are priced alike.
        assert alike is None
    peak, stage = peak_memory(TINY_MOE, batch, options)
    for i in range(len(batch)):
        alone = peak_memory(TINY_MOE, batch.take(np.arange(i, i + 1)), options)
        assert (peak[i], stage[i]) == (alone[0][0], alone[1][0]), batch.row(i)


@pytest.mark.parametrize("runtime", ["pytorch", "megatron"])
def test_memory_reads_none_of_the_unread_fields(runtime):
    """Strategies that differ only in UNREAD_FIELDS have the same figures, every one of every
    stage (so ``group_alike`` may price them once), and peak_memory prices them alike."""
    from ndplan.memory.fields import PIPELINE_SHAPE, UNREAD_FIELDS
    from ndplan.memory.grouping import group_alike
    from ndplan.memory.stages import peak_memory, stage_memory
    from ndplan.strategy import valid_mask

    space = _space(devices=16, seq=8192, dims=("tp", "sp", "cp", "ep", "pp", "schedule", "zero", "recompute"))
    batch = space.batch(np.arange(space.size))
    batch = batch.take(np.flatnonzero(valid_mask(batch, RuleContext(TINY_MOE, space.num_devices))))
    batch = batch.take(np.sort(np.random.default_rng(0).choice(len(batch), 60, replace=False)))
    rng = np.random.default_rng(1)
    varied = {"fsdp": (batch.zero == 3) & (rng.random(len(batch)) < 0.5),
              "global_batch_size": rng.choice([64, 128], len(batch))}
    assert set(varied) == set(UNREAD_FIELDS)
    perturbed = StrategyBatch(**{name: varied.get(name, getattr(batch, name)) for name in batch.array_fields()},
                              precision=batch.precision)
    options = MemoryOptions(runtime=runtime)
    every, every_perturbed = (stage_memory(TINY_MOE, b, options, breakdown=True) for b in (batch, perturbed))
    for name in ("device", "activations", "transient", "comm", "optimizer_step"):
        np.testing.assert_array_equal(getattr(every, name), getattr(every_perturbed, name))
    both = StrategyBatch.concat([batch, perturbed])
    _, alike = group_alike(TINY_MOE, both, options, both.groups(PIPELINE_SHAPE), None)
    assert alike is not None and len(alike[0]) <= len(batch)
    peak, stage = peak_memory(TINY_MOE, both, options)
    np.testing.assert_array_equal(peak[:len(batch)], peak[len(batch):])
    np.testing.assert_array_equal(stage[:len(batch)], stage[len(batch):])
    np.testing.assert_array_equal(peak[:len(batch)], every.device.max(axis=1))


def _balance_every_candidate(model, space, result, limit, top, *, one_setting=False):
    """(shown step, candidate) of the ``top`` rows balancing every fitting candidate gives: each
    pipeline balanced by the heuristic (as one recompute setting with ``one_setting``), its step
    scaled by the plan's composed step over the uniform plan's where that gains; the plan kept
    only where what --emit writes of it fits by the full memory estimator and, where that is the
    plan itself, the full time estimator finds it faster than the candidate (else its step with
    the schedule simulated, scaled alike, does). One row per plan (the
    first by composed step, then index); the ``walk_width(top)`` first re-ranked by the step shown
    (the full estimate of a one-setting plan, else the plan's step with the schedule simulated on the
    balancer's stage times, scaled like the composed one), cut to ``top``."""
    from ndplan.balance import build_problem, evaluate, simulated_step_s, solve_heuristic, uniform_plan
    from ndplan.balance.build import best_settings_plan, plan_stage_bytes, plan_strategy, settings_plan
    from ndplan.perf import estimate_time
    from ndplan.search.balanced import plan_key, walk_width

    cluster = Cluster(device=DEVICE, num_devices=space.num_devices)
    every = []
    for candidate, step in zip(result.candidates_index, result.candidates_time_s, strict=True):
        strategy = space.strategy(int(candidate))
        value = shown = float(step)
        if strategy.pp >= 2:
            modules = space.selective_modules(int(candidate))
            problem = build_problem(model, strategy, cluster, limit, BALANCE_OPTIONS)
            found = solve_heuristic(problem)
            if found is not None and one_setting:
                found = best_settings_plan(problem, found[0], uniform_plan(problem, "full"))
                assert settings_plan(found[0]) == found[0]
            ran = uniform_plan(problem, strategy.recompute)
            if found is not None:  # scaled from the same layout without recompute, where it gains
                plain = StrategyBatch.of(strategy.with_recompute("none").model_copy(
                    update={"precision": space.precision}))
                reference = float(RUNTIME_TIME(model, plain, cluster)["step_s"][0])
                scaled = reference * (found[1].step_s / evaluate(problem, uniform_plan(problem, "none")).step_s)
                settings, _ = best_settings_plan(problem, found[0], uniform_plan(problem, "full"))
                # a plan that is the candidate as it runs is no balancing
                fits = (scaled < value and plan_key(strategy, found[0], modules) != plan_key(strategy, ran, modules)
                        and plan_stage_bytes(model, strategy, settings, BALANCE_OPTIONS, modules).max() <= limit)
                estimated = estimate_time(model, plan_strategy(strategy, settings, modules), cluster,
                                          **BALANCE_OPTIONS.time_keywords()).step_s if fits else value
                own = estimate_time(model, strategy.model_copy(update={"precision": space.precision}), cluster,
                                    **BALANCE_OPTIONS.time_keywords()).step_s
                simulated = reference * simulated_step_s(problem, found[0], strategy.schedule) / simulated_step_s(
                    problem, uniform_plan(problem, "none"), strategy.schedule)
                # a one-setting plan beats the candidate's step and its own estimate (both simulated)
                if fits and ((estimated < min(value, own)) if settings == found[0] else (simulated < value)):
                    value, ran = scaled, found[0]
                    shown = estimated if settings == found[0] else simulated
            key = plan_key(strategy, ran, modules)
        else:
            key = (int(candidate),)
        every.append((value, int(candidate), key, shown))
    # one row per plan: the first of those that run the same plan
    seen, unique = set(), []
    for _value, candidate, key, shown in sorted(every):
        if key not in seen:
            seen.add(key)
            unique.append((shown, candidate))
    return sorted(unique[:walk_width(top)])[:top]


def test_balanced_ranking_equals_balancing_every_candidate():
    """search --balance walks candidates by a lower bound of their balanced step and stops early;
    its top must equal balancing every fitting pipeline and ranking them all."""
    from ndplan.search.balanced import rank_balanced

    space = _space(dims=("tp", "sp", "pp", "schedule", "recompute", "mbs"))
    # Tight enough that a balanced plan makes the top (at 3 GiB its only "balanced" rows were
    # plans equal to their candidates, a rounding below them, their simulated step shown).
    limit = 2**30
    result = run_search(TINY_MOE, DEVICE, space, RUNTIME_TIME, memory_limit_bytes=limit, top=10,
                        options=BALANCE_OPTIONS)
    every = _balance_every_candidate(TINY_MOE, space, result, limit, 10)
    rows, balanced, *_ = rank_balanced(TINY_MOE, DEVICE, space, result, RUNTIME_TIME, memory_limit_bytes=limit,
                                       top=10, options=BALANCE_OPTIONS)
    assert len(rows) == len(every)
    for row, (_, candidate) in zip(rows, every, strict=True):
        if row["candidate"] != candidate:
            # A tie: the row balances another candidate into the reference candidate's own plan
            # (selective recompute on every layer balanced to none), the same step up to rounding.
            assert row["label"].startswith(space.strategy(candidate).short() + " (balanced"), (row["label"], candidate)
    assert [r["step_s"] for r in rows] == pytest.approx([v for v, _ in every], rel=1e-12)
    # one row per plan: no two rows run the same placement and recompute
    assert len({(r["label"], str(r.get("balanced_stage_layers"))) for r in rows}) == len(rows)
    pipelines = sum(1 for c in result.candidates_index if space.strategy(int(c)).pp >= 2)
    assert 0 < balanced < pipelines  # the bound spared some balancing
    # Every balanced row carries the full estimator's check of its plan beside the balancer's own figure.
    balanced_rows = [r for r in rows if "balanced_settings" in r]
    assert balanced_rows and all(0 < r["balanced_settings"]["estimated_peak_bytes"] <= limit for r in balanced_rows)
    # The row is the balanced plan's throughout: its peak (what its step is), its throughput, the
    # full estimators' where the plan is one recompute setting, else the balancer's composed ones;
    # the uniform candidate's figures that the plan does not share are kept apart as unbalanced_*.
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    for r in balanced_rows:
        estimated = r["figures"] == "estimated"
        assert estimated == r["balanced_settings"]["is_the_plan"]
        assert r["peak_bytes"] == (r["balanced_settings"]["estimated_peak_bytes"] if estimated
                                   else r["composed_peak_bytes"])
        if estimated:
            assert r["step_s"] == r["balanced_settings"]["estimated_step_s"]
        assert r["step_s"] < r["unbalanced_step_s"]
        assert r["composed_step_s"] < r["unbalanced_step_s"] and r["composed_peak_bytes"] <= limit
        assert ("hfu" in r) == estimated  # the estimate's; a composed plan's recompute FLOPs are not priced
    for r in balanced_rows:
        assert "unbalanced_peak_bytes" in r and r["recompute"] == "per-layer"
        assert r["tokens_per_s_per_device"] * space.num_devices == pytest.approx(r["tokens_per_s"], rel=1e-12)
        assert r["tokens_per_s"] * r["step_s"] == pytest.approx(
            r["unbalanced_tokens_per_s"] * r["unbalanced_step_s"] if "unbalanced_tokens_per_s" in r
            else space.global_batch_size * space.seq_length, rel=1e-12)
        assert "compute_s" not in r and "unbalanced_compute_s" in r and "unbalanced_hfu" in r
        # the candidate's own strategy too (it read as the row's, recompute full, no placement)
        assert "strategy" not in r and r["unbalanced_strategy"]["recompute"] == r["unbalanced_recompute"]
    # The label states the plan's recompute, layer counts per option, not the candidate's setting.
    for row in balanced_rows:
        options = [r["option"] for r in row["balanced_recompute"] for _ in range(r["count"])]
        counts = ", ".join(f"{options.count(o)} {o}" for o in ("none", "selective", "full") if o in options)
        assert row["label"].endswith(f" (balanced; recompute per layer: {counts})") and " rc-" not in row["label"]
    # ... and what one recompute setting (--emit) makes of it, a Strategy of the same parallelism.
    from ndplan.strategy import Strategy

    for row in balanced_rows:
        one = row["balanced_settings"]
        strategy = Strategy(**one["strategy"])
        assert sum(strategy.stage_layers) == TINY_MOE.num_layers and list(strategy.stage_layers) == one["stage_layers"]
        assert (strategy.tp, strategy.pp, strategy.vpp) == (row["tp"], row["pp"], row["vpp"]) and one["step_s"] > 0
        if one["is_the_plan"]:  # the plan took one setting already: the same composed step
            assert one["step_s"] == pytest.approx(row["composed_step_s"], rel=1e-12)
        # the full estimator's step of those settings, as `ndplan estimate` gives it
        from ndplan.hardware import Cluster
        from ndplan.perf import estimate_time

        cluster = Cluster(device=DEVICE, num_devices=space.num_devices)
        assert one["estimated_step_s"] == pytest.approx(estimate_time(TINY_MOE, strategy.model_copy(
            update={"precision": space.precision}), cluster, **BALANCE_OPTIONS.time_keywords()).step_s, rel=1e-12)


def test_one_setting_ranking_equals_balancing_every_candidate_to_one_setting():
    """search --balance one-setting ranks by the fastest plan one recompute setting expresses
    (what Megatron runs); pruned by the same bound, it equals pricing every candidate that way.
    Llama-3.1-8B on 8 devices under 30 GiB: there the per-layer ranking differs."""
    from ndplan.search.balanced import rank_balanced
    from ndplan.strategy import Strategy

    model = get_preset("llama-3.1-8b")
    space = default_space(model, DEVICE, 8, 32, 4096, get_precision("megatron-bf16"),
                          dims=("tp", "pp", "schedule", "recompute", "zero"))
    limit = 30 * 2**30
    result = run_search(model, DEVICE, space, RUNTIME_TIME, memory_limit_bytes=limit, top=5, options=BALANCE_OPTIONS)
    every = _balance_every_candidate(model, space, result, limit, 5, one_setting=True)
    rows = rank_balanced(model, DEVICE, space, result, RUNTIME_TIME, memory_limit_bytes=limit, top=5,
                         one_setting=True, options=BALANCE_OPTIONS).rows
    assert [r["candidate"] for r in rows] == [c for _, c in every]
    assert [r["step_s"] for r in rows] == pytest.approx([v for v, _ in every], rel=1e-12)
    for row in rows:
        if "balanced_settings" in row:  # the ranked plan is itself one setting: the full estimators' figures
            assert row["balanced_settings"]["is_the_plan"] and row["figures"] == "estimated"
            Strategy(**row["balanced_settings"]["strategy"])
    per_layer = rank_balanced(model, DEVICE, space, result, RUNTIME_TIME, memory_limit_bytes=limit, top=5,
                              options=BALANCE_OPTIONS).rows
    assert [r["candidate"] for r in per_layer] != [r["candidate"] for r in rows]
    # Per layer, rows that recompute per layer show the plan's step with the schedule simulated on
    # the balancer's stage times, not the composition (which read this top's interleaved plans up
    # to 3% apart either way and ranked them otherwise).
    every = _balance_every_candidate(model, space, result, limit, 5)
    assert [r["candidate"] for r in per_layer] == [c for _, c in every]
    assert [r["step_s"] for r in per_layer] == pytest.approx([v for v, _ in every], rel=1e-12)
    mixed = [r for r in per_layer if r.get("figures") == "composed"]
    assert mixed and any(abs(r["step_s"] / r["composed_step_s"] - 1) > 0.01 for r in mixed)
    for r in mixed:
        assert r["tokens_per_s"] * r["step_s"] == pytest.approx(space.global_batch_size * space.seq_length, rel=1e-12)


def test_search_balance_shows_what_estimate_gives_for_one_setting_plans(capsys):
    """A balanced row whose plan is one recompute setting (what --emit writes) shows the full
    estimators' figures of it, as `ndplan estimate` gives them, and the rows are ranked by them;
    no row lists a plan whose written settings run over the limit by the full memory estimator.
    Llama-3.1-8B at tp2 pp4 on 16 devices: the balancer's composed step was 7% below the
    estimate there, and ranked #1 a plan that the estimate put behind #4."""
    argv = ["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64",
            "--fix", "tp=2", "sp=1", "pp=4", "--balance", "--top", "5", "--runtime", "megatron", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    rows, limit = data["ranked"], data["memory_limit_bytes"]
    assert len(rows) == 5 and [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    settings = [r["balanced_settings"] for r in rows if "balanced_settings" in r]
    assert settings and all(s["estimated_peak_bytes"] <= limit for s in settings)
    assert all(r["peak_bytes"] <= limit for r in rows)
    written = [r for r in rows if r.get("balanced_settings", {}).get("is_the_plan")]
    assert written
    for row in written:
        assert row["figures"] == "estimated" and row["composed_step_s"] > 0
        strategy = row["balanced_settings"]["strategy"]
        flags = ["--dp", "--tp", "--pp", "--vpp", "--zero", "--mbs", "--num-micro-batches", "--recompute-layers"]
        fields = ["dp", "tp", "pp", "vpp", "zero", "micro_batch_size", "num_micro_batches", "recompute_layers"]
        assert strategy["cp"] == 1 and strategy["sequence_parallel"] and not strategy["shard_group"]  # flags below
        assert main(["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64",
                     "--sp", *(["--fsdp"] if strategy["fsdp"] else []), "--schedule", strategy["schedule"],
                     "--recompute", strategy["recompute"],
                     "--stage-layers", ",".join(map(str, strategy["stage_layers"])),
                     *[x for flag, name in zip(flags, fields, strict=True) for x in (flag, str(strategy[name]))],
                     "--runtime", "megatron", "--json"]) == 0
        estimated = json.loads(capsys.readouterr().out)
        assert row["step_s"] == pytest.approx(estimated["time"]["step_s"], rel=1e-9)
        assert row["tokens_per_s"] == pytest.approx(estimated["time"]["tokens_per_s"], rel=1e-9)
        assert row["mfu"] == pytest.approx(estimated["time"]["mfu"], rel=1e-9)


def test_search_balance_lists_no_plan_over_the_limit_by_the_full_estimator(capsys):
    """Llama-3.1-70B on 64 devices: plans the balancer's per-layer figures put at 78.8-79.0 GiB
    wrote settings the full memory estimator puts over the 79.18 GiB limit; those candidates kept
    their uniform form instead of being listed as fitting, or stepped up to a setting that fits:
    pp2 vpp4 interleaved's rc-full:5 (85.94 GB, over 85.02) was written as rc-full:6. With the
    chunks weighed by the in-flight table's prefix peaks (``balance.build.chunk_weights``) the
    balancer no longer reads those plans low: it picks rc-full:6 itself (75.95 GB by the full
    estimator) and no row steps up. (Held to pp 2: since the SMs hidden data-parallel traffic
    holds are priced, its plans rank below the top 20 of the whole space.)"""
    assert main(["search", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--gbs", "256",
                 "--balance", "--top", "20", "--runtime", "megatron", "--fix", "pp=2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows, limit = data["ranked"], data["memory_limit_bytes"]
    assert len(rows) == 20 and [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert all(r.get("balanced_settings", r)["estimated_peak_bytes" if "balanced_settings" in r else "peak_bytes"]
               <= limit for r in rows)
    assert not [r for r in rows if "stepped_up_from" in r.get("balanced_settings", {})]
    assert any(" pp2 vpp4 " in r["label"] and r["balanced_settings"]["label"].endswith("rc-full:6")
               for r in rows if "balanced_settings" in r)


def test_cli_balance_one_setting_emits_what_it_ranked(capsys):
    argv = ["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32",
            "--dims", "tp", "schedule", "recompute", "zero", "--fix", "pp=2", "--memory-limit", "30GiB", "--top", "3",
            "--runtime", "megatron"]
    assert main([*argv, "--balance", "one-setting", "--json", "--emit", "megatron"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["ranked"][0]
    assert "one recompute setting per plan" in " ".join(data["notes"])
    assert best["balanced_settings"]["is_the_plan"]  # a pipeline, balanced to one setting, and written so
    assert f"llama-3.1-8b: {best['balanced_settings']['label']}\n" in data["emitted"]
    assert sum(best["balanced_settings"]["stage_layers"]) == 32
    assert main([*argv, "--balance"]) == 0 and "one setting" in capsys.readouterr().out


def test_search_csv_has_every_column_and_json_for_nested_values(tmp_path, capsys):
    import csv

    out = tmp_path / "ranked.csv"
    assert main(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32",
                 "--dims", "tp", "pp", "schedule", "recompute", "zero", "--memory-limit", "30GiB", "--top", "20",
                 "--balance", "--csv", str(out)]) == 0
    capsys.readouterr()
    rows = list(csv.DictReader(out.open()))
    assert 10 <= len(rows) <= 20 and "balanced_settings" in rows[0] and "caveats" in rows[0]
    balanced = [r for r in rows if r["balanced_settings"]]
    unbalanced = [r for r in rows if not r["balanced_settings"]]
    assert balanced and unbalanced  # pipelines and not: the header has the union of their columns
    for row in balanced:
        assert sum(json.loads(row["balanced_settings"])["stage_layers"]) == 32
        assert all(r["option"] in ("none", "selective", "full") for r in json.loads(row["balanced_recompute"]))
    assert all(isinstance(json.loads(r["caveats"]), list) for r in rows)


def test_without_a_pipeline_only_1f1b_is_ranked():
    """At pp = 1 a step is gradient accumulation: GPipe, ZB-H1 and Seq1F1B there are 1F1B under
    another name, counted as duplicates rather than ranked beside it."""
    space = _space(dims=("pp", "schedule", "mbs"))
    result = run_search(TINY_MOE, DEVICE, space, step_time_batch)
    schedules_at_pp1 = {space.strategy(int(c)).schedule for c in result.candidates_index
                        if space.strategy(int(c)).pp == 1}
    assert schedules_at_pp1 == {"1f1b"}
    assert result.rejected[DUPLICATE] > 0


def test_cli_search_explains_the_winner(capsys):
    """--explain prices the winner again with the single-strategy API: the same peak and step as
    its ranked row, term by term."""
    args = ["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64",
            "--fix", "tp=2", "--explain"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best, explained = data["ranked"][0], data["explain"]
    assert round(explained["peak_bytes"]) == best["peak_bytes"]
    assert explained["step_s"] == pytest.approx(best["step_s"], rel=1e-12)
    assert any(line.startswith("peak ") for line in explained["memory"])
    assert any(line.startswith("step = compute") for line in explained["time"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"the winner, {best['label']}, explained" in out and "MFU = model FLOPs" in out


def test_a_moe_imbalance_routing_cannot_produce_rejects_its_candidates():
    """moe_imbalance 3 on Mixtral (top-2 of 8): only ep 4 and ep 8 can load a rank three times a
    balanced share (ep·min(2, 8/ep)/2 = 1, 2, 4, 4 for ep 1, 2, 4, 8); the others are counted
    under their own reason, and every ranked candidate prices an imbalance it can have."""
    from ndplan.memory import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.search.run import IMPOSSIBLE_IMBALANCE

    model = get_preset("mixtral-8x7b")
    space = default_space(model, DEVICE, 16, 64, 4096, get_precision("megatron-bf16"))
    result = run_search(model, DEVICE, space, step_time_batch, options=MemoryOptions(moe_imbalance=3.0), top=20)
    assert result.rejected[IMPOSSIBLE_IMBALANCE] > 0 and result.ranked
    assert sum(result.rejected.values()) + result.fitting == space.size
    assert all(space.strategy(row["candidate"]).ep >= 4 for row in result.ranked)
    assert IMPOSSIBLE_IMBALANCE not in run_search(model, DEVICE, space, step_time_batch, top=1).rejected


def test_fsdp_candidates_reshard_under_a_pipeline_as_the_runtime_does():
    """torchtitan's default policy keeps parameters gathered after forward under a pipeline (the
    pytorch runtime: torch pipelining keeps them gathered for the run anyway); Megatron-FSDP
    reshards. The space follows the runtime it is given, and the CLI gives its runtime."""
    from ndplan.search.space import runtime_reshard_under_pipeline

    assert runtime_reshard_under_pipeline(MemoryOptions(runtime="pytorch")) is False
    assert runtime_reshard_under_pipeline(MemoryOptions(runtime="megatron")) is True
    for reshard in (False, True):
        space = default_space(TINY_MOE, DEVICE, 8, 16, 1024, dims=("pp", "zero"), reshard_under_pipeline=reshard)
        batch = space.batch(np.arange(space.size))
        sharded = batch.zero == 3
        assert np.all(batch.reshard_after_forward[sharded & (batch.pp == 1)] == 1)
        assert np.all(batch.reshard_after_forward[sharded & (batch.pp > 1)] == int(reshard))
        assert np.all(batch.reshard_after_forward[~sharded] == 1)  # nothing to reshard: the canonical value
        assert (sharded & (batch.pp > 1)).any()


def test_long_sequences_search_as_many_context_ranks_as_keep_8k_tokens_each():
    """Context parallelism was capped at 16 ranks: a 1M-token Llama-3.1-8B fitted nowhere, and
    the search said so for any cluster size (with --fix cp=64, 32 strategies fit)."""
    from ndplan.model import get_preset

    model = get_preset("llama-3.1-8b")
    assert default_space(model, DEVICE, 512, 32, 4096, get_precision("megatron-bf16")).cp[-1] == 16
    space = default_space(model, DEVICE, 512, 32, 1 << 20, get_precision("megatron-bf16"))
    assert space.cp[-1] == 128
    result = run_search(model, DEVICE, space, step_time_batch, top=1)
    assert result.fitting > 0 and result.ranked[0]["strategy"]["cp"] >= 32


def _small_space(**values):
    """A space of every dimension, each over a few values (the rules reject many candidates)."""
    space = default_space(RULES_MODEL, DEVICE, 24, 36, 1026, get_precision("megatron-bf16"), dims=DIMENSIONS)
    few = {"tp": (1, 2, 4), "cp": (1, 2), "ep": (1, 2), "pp": (1, 2, 4), "zero": (1, 3), "mbs": (1, 2),
           "pipeline_runs": (1, 2), "recompute_modules": space.recompute_modules[:2],
           "offload_modules": space.offload_modules[:2]}
    return dataclasses.replace(space, **(few | values))


def test_each_field_depends_on_its_field_dimensions_alone():
    """``FIELD_DIMENSIONS`` agrees with the batches a space builds: candidates that share their
    values of a field's dimensions share the field (fields named nowhere take one value)."""
    space = _small_space(offload_modules=((),), reshard_under_pipeline=False)
    candidates = np.arange(space.size)
    digits = dict(zip(DIMENSIONS, np.unravel_index(candidates, space.sizes), strict=True))
    fields = {name: [] for name in StrategyBatch.array_fields()}
    for positions, batch in space.batches(candidates):
        for name in fields:
            fields[name].append(np.zeros(space.size, dtype=np.int64))
            fields[name][-1][positions] = getattr(batch, name)
    for name, parts in fields.items():
        dims = FIELD_DIMENSIONS.get(name, ())
        key = np.ravel_multi_index([digits[d] for d in dims], [len(getattr(space, d)) for d in dims]) if dims else 0
        pairs = np.unique(np.stack(np.broadcast_arrays(key, sum(parts))), axis=1)
        assert len(np.unique(pairs[0])) == pairs.shape[1], name


@pytest.mark.parametrize("block_size", [37, 1000, 1 << 18])
def test_screened_blocks_equal_each_rule_on_each_candidate(block_size):
    """Screening decides each rule on the combinations of the dimensions it reads: the same
    survivors, in the same order, and the same first rejection of each candidate, as every rule
    on every candidate of ``blocks``."""
    space = _small_space(zero=(1,), mbs=(1,))
    context = RuleContext(RULES_MODEL, space.num_devices)
    checks = [lambda batch, rule=rule: rule.holds(batch, context) for rule in RULES]
    screened = list(screened_blocks(space, checks, block_size))
    listed = list(space.blocks(block_size))
    assert len(screened) == len(listed)
    for block, (index, batch) in zip(screened, listed, strict=True):
        first = np.full(len(index), len(RULES) + 1)
        for code, check in reversed(list(enumerate(checks, start=1))):
            first = np.where(~check(batch), code, first)
        first[space.duplicates(index)] = 0
        assert block.listed == len(index)
        np.testing.assert_array_equal(block.rejected, np.bincount(first, minlength=len(RULES) + 2)[:-1])
        survive = first == len(RULES) + 1
        np.testing.assert_array_equal(block.index, index[survive])
        for name in batch.array_fields():
            np.testing.assert_array_equal(getattr(block.batch, name), getattr(batch, name)[survive], err_msg=name)
        assert (block.batch.recompute_modules, block.batch.offload_modules) == (batch.recompute_modules,
                                                                                batch.offload_modules)


def test_fields_read_follows_properties_and_lookups():
    batch = StrategyBatch.of(Strategy())
    assert fields_read(lambda b: b.micro_batches_per_step > 1, batch) == {"num_micro_batches", "pipeline_runs"}
    assert fields_read(lambda b: b.is_("schedule", "1f1b") | (b.tp > 1), batch) == {"schedule", "tp"}


def test_a_space_with_an_empty_value_list_enumerates_nothing():
    """A hand-built SearchSpace may leave a list empty; the screened enumeration crashed on it
    (a reduction over an empty table) where the plain loop found an empty space."""
    space = default_space("llama-3.1-8b", "h100-sxm", 8, 8, 4096, get_precision("megatron-bf16"), dims=("tp", "pp"))
    for name in ("tp", "schedule"):
        result = run_search("llama-3.1-8b", "h100-sxm", dataclasses.replace(space, **{name: ()}), top=1)
        assert (result.space_size, result.evaluated, result.fitting, result.ranked) == (0, 0, 0, [])


def test_zero_without_a_group_to_shard_over_is_ranked_once():
    """A review: with dp·cp = 1, ZeRO 1 and 2 rows were ranked beside ZeRO 0 with every figure the
    same. The ZeRO 0 candidate stands for them (charged as duplicates), unless it is not searched."""
    model = get_preset("llama-3.1-8b")
    space = default_space(model, DEVICE, 8, 16, 4096, dims=("zero", "recompute"), fixed={"tp": 4, "pp": 2})
    result = run_search(model, DEVICE, space, step_time_batch)
    assert {row["zero"] for row in result.ranked} == {0, 3}
    assert result.rejected[DUPLICATE] == 2 * 3  # zero 1 and 2, under each recompute
    only = run_search(model, DEVICE, default_space(model, DEVICE, 8, 16, 4096, fixed={"tp": 4, "pp": 2, "zero": 1}),
                      step_time_batch)
    assert {row["zero"] for row in only.ranked} == {1}


def test_a_winner_inside_the_margin_its_caution_asks_for_says_so(capsys):
    """A review: the search ranked a Megatron MoE winner at 79.16 of 79.18 GiB under a caution
    to treat plans within ~6% of the limit as unverified; it now names the limit that leaves it."""
    from ndplan.memory.report import headroom

    assert headroom(Strategy(dp=8, zero=3, fsdp=True), MemoryOptions()) == 0.30
    assert headroom(Strategy(dp=8, ep=8), MemoryOptions(runtime="megatron"), TINY_MOE) == 0.06
    assert headroom(Strategy(dp=8), MemoryOptions(runtime="megatron"), get_preset("llama-3.1-8b")) == 0.0
    assert main(["search", "--model", "deepseek-v3", "--hardware", "h100-sxm", "--devices", "4096", "--gbs", "4096",
                 "--seq", "4096", "--runtime", "megatron", "--top", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "less than the 6% the memory caution above asks for; --memory-limit 74.43GiB ranks only strategies that leave it" in out


def test_a_fixed_vpp_narrows_the_pipeline_options_or_makes_one(tmp_path, capsys):
    """A launch file's vpp 5 (80 layers, pp 4, 4 layers a virtual stage) was none of the searched
    pipeline options: `search --from FILE --dims zero` ranked its layout at vpp 2 and 4 and never
    priced the file's own. The file's vpp and seq_chunks now stay with its schedule, and
    --fix vpp / seq_chunks narrow the options (or, with the schedule fixed, make one)."""
    from pathlib import Path

    source = Path(__file__).parent / "fixtures" / "io" / "megatron_llama3_70b.sh"
    launch = tmp_path / "vpp5.sh"
    launch.write_text(source.read_text().replace("LAYERS_PER_VP=5", "LAYERS_PER_VP=4"))
    assert main(["search", "--from", str(launch), "--model", "llama-3.1-70b", "--hardware", "h100-sxm",
                 "--dims", "zero", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and {row["strategy"]["vpp"] for row in ranked} == {5}
    llama = get_preset("llama-3.1-8b")
    space = default_space(llama, DEVICE, 8, 16, 4096, dims=["pp", "schedule"], fixed={"vpp": 4})
    assert space.schedule == (("interleaved", 4, 1),)
    space = default_space(llama, DEVICE, 8, 16, 4096, dims=["pp"], fixed={"schedule": "interleaved", "vpp": 8})
    assert space.schedule == (("interleaved", 8, 1),)
    with pytest.raises(NdplanError, match=r"--fix vpp=5: no pipeline option of this space has it .*fix the schedule"):
        default_space(llama, DEVICE, 8, 16, 4096, dims=["pp", "schedule"], fixed={"vpp": 5})


def test_hybrid_context_parallelism_is_not_taken_as_a_fixed_kind():
    """--fix cp_kind=hybrid searched ring attention labelled hybrid (Ulysses degree 1: the
    search does not vary the degree): refused, naming the kinds it takes."""
    with pytest.raises(NdplanError, match="--fix cp_kind=hybrid: allowed values are ring, ulysses"):
        default_space(get_preset("llama-3.1-8b"), DEVICE, 8, 16, 4096, dims=["tp"], fixed={"cp": 2, "cp_kind": "hybrid"})


def test_module_sets_bring_selective_recompute_with_them():
    """Fixing or searching the recompute module sets with recompute neither searched nor fixed
    priced no module set at all (no candidate was selective); now selective joins, and a
    recompute fixed to another mode is refused."""
    llama = get_preset("llama-3.1-8b")
    space = default_space(llama, DEVICE, 8, 16, 4096, dims=["tp"], fixed={"recompute_modules": "mlp"})
    assert space.recompute == ("selective",) and space.recompute_modules == (("mlp",),)
    space = default_space(llama, DEVICE, 8, 16, 4096, dims=["tp", "recompute_modules"])
    assert space.recompute == ("none", "selective") and len(space.recompute_modules) > 1
    with pytest.raises(NdplanError, match="recompute is fixed to full: fix recompute=selective"):
        default_space(llama, DEVICE, 8, 16, 4096, dims=["tp"], fixed={"recompute": "full", "recompute_modules": "mlp"})


def test_carried_settings_apply_where_they_mean_something_and_the_rules_judge_the_rest():
    """A space's carried settings (a --from file's) are every candidate's where they mean
    something; a hybrid cp_kind is a whole setting with a carried Ulysses degree, and the cp
    values it does not divide are rejected by the rule."""
    model, device = get_preset("llama-3.1-8b"), get_device("h100-sxm")
    space = default_space(model, device, 64, 64, 32768, dims=("cp", "zero", "recompute"),
                          fixed={"cp_kind": "hybrid", "tp": 2},
                          carried={"ulysses_degree": 2, "shard_group": 4, "recompute_layers": 3,
                                   "optimizer_offload": True})
    batch = StrategyBatch.concat([b for _, b in space.blocks()])
    hybrid, recomputes = batch.is_("cp_kind", "hybrid"), ~batch.is_("recompute", "none")
    assert hybrid.all() and (batch.ulysses_degree == 2).all()
    assert ((batch.shard_group == 4) == (batch.zero > 0)).all()
    assert ((batch.recompute_layers == 3) == recomputes).all()
    assert (batch.optimizer_offload == 1).all()
    result = run_search(model, device, space)
    assert result.rejected["cp_hybrid_degree"] > 0 and result.rejected["shard_group_needs_zero"] == 0
    for row in result.ranked:
        strategy = Strategy(**row["strategy"])
        assert strategy.cp >= 2 and strategy.ulysses_degree == 2 and strategy.optimizer_offload
        assert check_strategy(strategy, model, 64) == []
    with pytest.raises(NdplanError, match="did you mean 'shard_group'"):
        default_space(model, device, 64, 64, 4096, carried={"shardgroup": 2})
    with pytest.raises(NdplanError, match="allowed values are ring, ulysses"):
        default_space(model, device, 64, 64, 4096, fixed={"cp_kind": "hybrid"})


def test_pytorch_search_never_ranks_1f1b_with_fewer_micro_batches_than_stages():
    """torch.distributed.pipelining's Schedule1F1B raises "Number of microbatches (m) must be
    greater than or equal to the number of stages (pp)": under the pytorch runtime a 1F1B
    pipeline with fewer micro-batches than stages is not runnable (it was ranked: 16 sequences on
    dp 2 at mbs 4 are 2 micro-batches for 4 stages). Megatron's 1F1B runs them (its warm-up is
    min(pp - rank - 1, m)); GPipe under PyTorch too."""
    space = _space(dims=("pp", "mbs", "schedule"), gbs=16)

    def refused(row):
        return row["schedule"] == "1f1b" and row["num_micro_batches"] < row["pp"]

    pytorch = run_search(TINY_MOE, DEVICE, space, step_time_batch, memory_limit_bytes=2 * 2**30, top=10**9,
                         options=MemoryOptions())
    megatron = run_search(TINY_MOE, DEVICE, space, RUNTIME_TIME, memory_limit_bytes=2 * 2**30, top=10**9,
                          options=BALANCE_OPTIONS)
    assert pytorch.ranked and not any(refused(row) for row in pytorch.ranked)
    assert any(refused(row) for row in megatron.ranked)
    assert any(row["schedule"] == "gpipe" and row["num_micro_batches"] < row["pp"] for row in pytorch.ranked)


@pytest.mark.parametrize("runtime", ["pytorch", "megatron"])
def test_runtime_refusals_word_what_the_search_counts_not_runnable(runtime):
    """`ndplan check --runtime` words, strategy by strategy, the same limits the search applies as
    a mask (RUNTIME_LIMITS): over a space's pipelines, a strategy has a reason exactly where the
    search would charge it to not_runnable_in_runtime."""
    from ndplan.search.run import _runnable, runtime_refusals

    options = MemoryOptions(runtime=runtime)
    space = _space(dims=("tp", "sp", "ep", "pp", "schedule", "mbs", "recompute"))
    batch = space.batch(np.arange(space.size))
    piped = np.flatnonzero(batch.pp > 1)
    mask = _runnable(batch, list(options.profile.schedules), runtime)[piped]
    refused = np.array([bool(runtime_refusals(s, options)) for s in space.strategies(piped)])
    assert refused.any() and (~refused).any()
    assert np.array_equal(refused, ~mask)


def test_megatron_search_never_ranks_experts_under_tensor_parallelism_without_sequence_parallelism():
    """Megatron-Core's MoELayer.forward raises in training under tensor parallelism without
    sequence parallelism whatever the expert parallelism: at ep 1 too, the megatron search counts
    tp > 1 without SP on an MoE model as not runnable (it ranked them, and --emit megatron wrote a
    launch Megatron stops at); `ndplan check`'s reason says so; PyTorch's runtime runs them, and
    a dense model under Megatron too."""
    from ndplan.search.run import runtime_refusals

    space = _space(dims=("tp", "sp", "pp"))

    def refused(row):
        return row["tp"] > 1 and not row["sp"]

    _megatron_refuses_what_pytorch_ranks(space, refused)
    strategy = Strategy(tp=2, dp=4)
    assert runtime_refusals(strategy, BALANCE_OPTIONS, TINY_MOE) == [
        "experts with tp=2 need sequence_parallel: Megatron-Core's MoE layer refuses to train under tensor "
        "parallelism without it (MoELayer.forward)"]
    dense = get_preset("llama-3.1-8b")
    assert not dense.is_moe and runtime_refusals(strategy, BALANCE_OPTIONS, dense) == []
    assert runtime_refusals(strategy, MemoryOptions(), TINY_MOE) == []


def test_megatron_search_never_ranks_ulysses_with_an_odd_half_chunk():
    """Megatron runs Ulysses as --cp-comm-type a2a: its batch is cut into 2·cp chunks as for the
    ring, and Transformer Engine's A2A attention asserts "Sequence length per GPU needs to be
    divisible by 2!". 1020 tokens split over cp 4 (255 a rank) run under PyTorch's Ulysses but not
    Megatron's on GPUs; MindSpeed's ulysses_cp_algo (Ascend) cuts it into cp contiguous chunks and
    runs them."""
    from ndplan.hardware import get_device
    from ndplan.search.run import runtime_refusals

    odd = Strategy(dp=2, cp=4, cp_kind="ulysses", seq_length=1020)
    assert "divisible by 2·cp = 8" in runtime_refusals(odd, BALANCE_OPTIONS, TINY_MOE, get_device("h100-sxm"))[0]
    assert runtime_refusals(odd, BALANCE_OPTIONS, TINY_MOE, get_device("ascend-910b")) == []
    space = default_space(TINY_MOE, DEVICE, 8, 16, 1020, get_precision("megatron-bf16"),
                          dims=("cp", "cp_kind", "tp"), fixed={"cp_kind": "ulysses"})
    megatron = run_search(TINY_MOE, DEVICE, space, RUNTIME_TIME, top=10**9, options=BALANCE_OPTIONS)
    pytorch = run_search(TINY_MOE, DEVICE, space, step_time_batch, top=10**9, options=MemoryOptions())
    assert any(row["cp"] == 4 for row in pytorch.ranked)
    assert megatron.ranked and not any(1020 % (2 * row["cp"]) for row in megatron.ranked)


def test_what_would_fit_tries_device_counts_the_fixed_degrees_divide(capsys):
    """With cp fixed to 3, no power-of-two multiple of 8 devices holds a candidate, and the search
    said "no candidate is valid on up to 512 devices either: more devices do not help", though 24
    devices run Llama-3.1-8B at cp 3. The counts tried are multiples of the fixed tp·pp·cp too."""
    argv = ["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--gbs", "16", "--seq", "6144",
            "--fix", "cp=3", "--json"]
    assert main([*argv, "--devices", "8"]) == 1
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes[-1].startswith("with 24 devices (the fewest that fit, in multiples of 24, as the fixed tp·pp·cp = 3")
    assert main([*argv, "--devices", "24"]) == 0


def test_deepseek_v3_on_gb200_nvl72_ranks_expert_parallelism_inside_a_rack(capsys):
    """256 GPUs on GB200 NVL72 are 4 racks of 64 (Cluster.scaleup_domain_size). The fastest plan
    keeps its EP group (ep·etp consecutive ranks) on one rack's NVLink: dp64 tp2 pp2 vpp2 ep64
    dualpipev, 8.503 s (8.605 s before the paired passes' all-to-alls were priced phase by phase,
    the host floor's slack first). With ranks aligned on 72-GPU racks the same plan's EP 64
    all-to-alls paid the NIC's latency every step and it read 8.934 s."""
    assert main(["search", "--model", "deepseek-v3", "--hardware", "gb200-nvl72", "--devices", "256",
                 "--gbs", "2048", "--seq", "4096", "--runtime", "megatron", "--top", "1", "--json"]) == 0
    top = json.loads(capsys.readouterr().out)["ranked"][0]
    strategy = top["strategy"]
    span = strategy["ep"] * max(strategy["etp"], 1)
    assert span > 8 and 64 % span == 0  # EP beyond an HGX node, inside one rack's 64
    assert (strategy["ep"], strategy["tp"], strategy["pp"], strategy["schedule"]) == (64, 2, 2, "dualpipev")
    assert top["step_s"] == pytest.approx(8.503, rel=0.01)
    assert top["peak_bytes"] <= 197_897_748_480


def test_a_dualpipev_plan_under_megatron_on_gpus_says_it_is_mindspeeds():
    """The megatron runtime's DualPipeV is MindSpeed's (Ascend); Megatron-LM on GPUs has none, so
    a GPU plan with it carries a caution naming the fix; an NPU's, or another schedule, none."""
    from ndplan.search.run import schedule_cautions

    dualpipe = Strategy(dp=1, pp=2, vpp=2, schedule="dualpipev", num_micro_batches=8)
    (caution,) = schedule_cautions(dualpipe, "megatron", "blackwell")
    assert "MindSpeed's schedule" in caution and "--fix schedule=interleaved" in caution
    assert schedule_cautions(dualpipe, "megatron", "davinci-switch") == []
    assert schedule_cautions(dualpipe, "pytorch", "hopper") == []  # torch.distributed.pipelining has it
    assert schedule_cautions(Strategy(dp=1, pp=2, num_micro_batches=8), "megatron", "hopper") == []


def test_megatron_runs_a_moe_model_with_linear_biases_at_expert_tp_one_alone():
    """Megatron's add_bias_linear covers every linear layer but the QKV projection's own switch,
    and its TransformerConfig asserts "Bias in Moe is only supported when ETP==1": gpt-oss (biases
    on its attention output and experts) runs under Megatron with etp 1 alone; Qwen3-30B-A3B (no
    biases) at any etp; PyTorch's gpt-oss at any etp. The launch written for etp 2 says so."""
    from ndplan.io import emit
    from ndplan.search.run import runtime_refusals

    megatron = MemoryOptions(runtime="megatron")
    oss, qwen = get_preset("gpt-oss-20b"), get_preset("qwen3-30b-a3b")
    assert oss.biases_beyond_qkv and not qwen.biases_beyond_qkv
    spread = Strategy(dp=4, tp=2, sequence_parallel=True, ep=4, etp=2, num_micro_batches=4)
    assert runtime_refusals(spread, megatron, oss) == [
        "etp=2 on gpt-oss-20b, whose linear layers have biases: Megatron-Core's TransformerConfig asserts 'Bias in "
        "Moe is only supported when ETP==1'"]
    assert runtime_refusals(spread.model_copy(update={"etp": 1}), megatron, oss) == []
    assert runtime_refusals(spread, megatron, qwen) == []
    assert runtime_refusals(spread, MemoryOptions(), oss) == []
    assert "Megatron-LM will refuse this launch: etp=2 with the model's linear biases" in emit(oss, spread, "megatron")
    space = default_space(oss, DEVICE, 8, 16, 4096, get_precision("megatron-bf16"), dims=("tp", "etp", "ep"),
                          fixed={"sp": 1})
    result = run_search(oss, DEVICE, space, RUNTIME_TIME, top=10**9, options=megatron)
    assert result.ranked and {row["etp"] for row in result.ranked} == {1}
    assert result.rejected[NOT_RUNNABLE] > 0


def test_megatron_runs_fp8_weights_with_the_distributed_optimizer_or_fsdp_alone():
    """validate_args asserts "--fp8-param-gather only supported with distributed optimizer, torch
    fsdp2, megatron fsdp, or inference mode": fp8 weights (precision megatron-fp8-param-grad16)
    under Megatron need ZeRO; the launch written without it says so."""
    from ndplan.io import emit
    from ndplan.search.run import runtime_refusals

    megatron = MemoryOptions(runtime="megatron")
    model = get_preset("llama-3.1-8b")
    ddp = Strategy(dp=8, zero=0, precision="megatron-fp8-param-grad16", num_micro_batches=2)
    assert runtime_refusals(ddp, megatron, model) == [
        "precision megatron-fp8-param-grad16 (fp8 weights, --fp8-param-gather) with zero=0: Megatron-LM runs fp8 "
        "weights only with the distributed optimizer or FSDP (validate_args)"]
    assert runtime_refusals(ddp.model_copy(update={"zero": 1}), megatron, model) == []
    assert runtime_refusals(ddp.model_copy(update={"precision": get_precision("megatron-fp8-grad16")}), megatron,
                            model) == []
    assert "Megatron-LM will refuse this launch: fp8 weights (--fp8-param-gather)" in emit(model, ddp, "megatron")
    space = default_space(model, DEVICE, 8, 16, 4096, get_precision("megatron-fp8-param-grad16"), dims=("zero",))
    result = run_search(model, DEVICE, space, RUNTIME_TIME, top=10**9, options=megatron)
    assert result.ranked and 0 not in {row["zero"] for row in result.ranked}
    assert result.rejected[NOT_RUNNABLE] > 0
