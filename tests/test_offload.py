"""Megatron-Core's fine-grained activation offload: validation, hand-derived bytes, peak and time."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from ndplan.balance import balance, build_problem, evaluate, uniform_plan
from ndplan.balance.build import baseline_option, runnable_options
from ndplan.errors import NdplanError
from ndplan.hardware import Cluster, get_device
from ndplan.memory import MemoryOptions, estimate
from ndplan.memory.activations import layer_activations
from ndplan.model import ModelSpec, get_preset
from ndplan.perf.report import estimate_time
from ndplan.strategy import Strategy, StrategyBatch

MEGATRON = MemoryOptions(runtime="megatron", include_overhead=False)
# One MoE layer (h 64, 4 heads of 16, top-2 of 8 experts of width 32, a shared expert of 48).
TINY_MOE = ModelSpec(
    name="tiny-moe", num_layers=1, hidden_size=64, ffn_hidden_size=0, num_attention_heads=4, num_kv_heads=4,
    head_dim=16, vocab_size=100, num_experts=8, num_experts_per_tok=2, moe_ffn_hidden_size=32,
    num_shared_experts=1, shared_expert_ffn_hidden_size=48,
)
TINY_DENSE = ModelSpec(name="tiny-dense", num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_kv_heads=4, head_dim=16, vocab_size=100)


def _moved(model: ModelSpec, *modules: str, kind: str = "moe", **fields: object) -> float:
    """Bytes per token one layer of ``kind`` moves to the host (tp 1, bf16)."""
    strategy = Strategy(offload_modules=modules, **fields)  # type: ignore[arg-type]
    return float(layer_activations(model, StrategyBatch.of(strategy), MEGATRON).offloaded[kind][0])


def test_pairs_megatron_refuses_are_named():
    assert Strategy(offload_modules=("moe_act", "core_attn", "moe_act")).offload_modules == ("core_attn", "moe_act")
    with pytest.raises(ValidationError, match="attn_proj needs core_attn"):
        Strategy(offload_modules=("attn_proj",))
    with pytest.raises(ValidationError, match="Megatron-Core then skips its offload"):
        Strategy(recompute="selective", offload_modules=("core_attn",))  # Megatron's default list re-runs it
    with pytest.raises(ValidationError, match="nothing to offload"):
        Strategy(recompute="full", offload_modules=("expert_fc1",))
    with pytest.raises(ValidationError, match="cannot go with recompute_modules moe"):
        Strategy(recompute="selective", recompute_modules=("moe",), offload_modules=("moe_act",))
    with pytest.raises(ValidationError, match="schedules 1f1b, interleaved, not 'zbv'"):
        Strategy(pp=2, vpp=2, schedule="zbv", offload_modules=("expert_fc1",))
    with pytest.raises(ValidationError, match="'attn_norm', 'qkv_linear', 'core_attn'"):
        Strategy(offload_modules=("fused_group_mlp",))
    with pytest.raises(ValueError, match="one set of offload modules"):
        StrategyBatch.of([Strategy(offload_modules=("moe_act",)), Strategy()])
    assert Strategy(offload_modules=("core_attn", "attn_proj")).short().endswith("offload(core_attn+attn_proj)")


def test_moved_bytes_by_hand():
    """bf16, tp 1, per token: expert_fc1 the experts' permuted input (topk·h·2 = 256); moe_act
    their fc1 output (2·topk·ffn_e·2 = 256); core_attn q, k, v (3·64·2 = 384); attn_proj the
    core's output (64·2 = 128); qkv_linear, TE's fused norm + QKV linear, the norm's input and
    the linear's input (2·64·2 = 256); mlp_norm the MoE pre-MLP norm's input (128). The norms'
    rsigma and the softmax statistics (under a million elements) stay."""
    assert _moved(TINY_MOE, "expert_fc1") == 256
    assert _moved(TINY_MOE, "moe_act") == 256
    assert _moved(TINY_MOE, "core_attn") == 384
    assert _moved(TINY_MOE, "core_attn", "attn_proj") == 384 + 128
    assert _moved(TINY_MOE, "qkv_linear") == 256
    assert _moved(TINY_MOE, "mlp_norm") == 128
    assert _moved(TINY_MOE, "attn_norm") == 0  # fused into the QKV linear: an IdentityOp in Megatron
    every = ("qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
    assert _moved(TINY_MOE, *every) == 256 + 384 + 128 + 128 + 256 + 256
    # A dense MLP's norm is fused into fc1: nothing of the MLP moves.
    assert _moved(TINY_DENSE, "mlp_norm", "expert_fc1", "moe_act", kind="dense") == 0
    # Under SP at tp 2 the norm and linear inputs are sequence-sharded, q/k/v head-sharded: all halve.
    assert _moved(TINY_MOE, "qkv_linear", "core_attn", tp=2, sequence_parallel=True) == (256 + 384) / 2


def test_what_moves_leaves_the_device_and_two_layers_stay():
    plain = layer_activations(TINY_MOE, StrategyBatch.of(Strategy()), MEGATRON)
    off = layer_activations(TINY_MOE, StrategyBatch.of(Strategy(offload_modules=("expert_fc1", "moe_act"))), MEGATRON)
    assert off.full["moe"][0] == plain.full["moe"][0] - 512
    assert off.backward_extra["moe"][0] == plain.backward_extra["moe"][0] + 2 * 512
    assert off.rebuilt["moe"][0] == plain.rebuilt["moe"][0]
    # the breakdown by block loses the same bytes, from the MoE block
    assert sum(off.moe_blocks.values())[0] == off.full["moe"][0]
    assert off.moe_blocks["moe"][0] == plain.moe_blocks["moe"][0] - 512


@pytest.mark.parametrize("offload", [("expert_fc1",), ("core_attn", "attn_proj"), ("qkv_linear", "mlp_norm", "moe_act")])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_breakdown_by_kind_leaves_out_what_is_offloaded(offload, recompute):
    """Each stage's activations by layer kind sum to its held activations, net of the offload."""
    strategy = Strategy(dp=2, pp=2, ep=2, zero=1, num_micro_batches=8, recompute=recompute, offload_modules=offload,
                        recompute_modules=("layernorm", "moe_act") if recompute == "selective" else ())
    for stage in estimate(get_preset("qwen3-30b-a3b"), strategy, None, MEGATRON).stages:
        assert sum(stage.activations_by_kind.values()) == pytest.approx(stage.activations_bytes, rel=1e-12)


def test_selective_recompute_moves_only_what_it_keeps():
    """moe_act recompute keeps the fc1 output (the checkpoint's input), which moe_act offload
    moves; MLA's up-projected q, k, v are rebuilt under mla_up_proj, so core_attn moves none."""
    kept = _moved(TINY_MOE, "moe_act", "mlp_norm", recompute="selective", recompute_modules=("layernorm", "moe_act"))
    assert kept == 256 + 128
    model = get_preset("deepseek-v3")
    rebuilt = _moved(model, "core_attn", recompute="selective", recompute_modules=("mla_up_proj",))
    assert rebuilt == 0 < _moved(model, "core_attn")
    # MLA's input norm is its own module: attn_norm moves its input (h·2 bytes), qkv_linear the projections' inputs.
    assert _moved(model, "attn_norm") == model.hidden_size * 2


def test_more_offload_never_raises_the_peak():
    model = get_preset("qwen3-30b-a3b")
    device = get_device("h100-sxm")
    base = dict(dp=2, pp=4, ep=2, zero=1, num_micro_batches=16, recompute="selective",
                recompute_modules=("layernorm", "moe_act"))
    order = ("expert_fc1", "moe_act", "mlp_norm", "core_attn", "attn_proj", "qkv_linear")
    previous = float("inf")
    for n in range(len(order) + 1):
        strategy = Strategy(**base, offload_modules=order[:n])  # type: ignore[arg-type]
        report = estimate(model, strategy, device, MEGATRON, num_devices=8)
        assert report.peak_bytes <= previous
        previous = report.peak_bytes
        stage = report.stages[0]
        held = sum(c.peak_in_flight * c.offloaded_bytes_per_micro_batch for c in stage.chunks)
        assert stage.host_activation_bytes == held and (held > 0) == (n > 0)
    assert any("pinned host memory" in line for line in report.explain())


def test_runtimes_without_the_feature_say_so():
    strategy = Strategy(dp=8, offload_modules=("expert_fc1",))
    with pytest.raises(NdplanError, match="runtime 'pytorch' has no such feature"):
        estimate(TINY_MOE, strategy, get_device("h100-sxm"), MemoryOptions(), num_devices=8)


def _device(host_link_bytes_per_s: float):
    return get_device("h100-sxm").model_copy(update={"host_link_bandwidth_bytes_per_s": host_link_bytes_per_s})


def test_copies_cost_only_what_outlasts_the_pass():
    """A link so fast that no copy outlasts its pass changes nothing; one so slow that the copies
    dwarf the compute costs, per layer and micro-batch, the copy each way (bytes / (link · 0.8))
    less the pass it runs beside."""
    model = get_preset("qwen3-30b-a3b")
    strategy = Strategy(dp=8, ep=8, num_micro_batches=2, offload_modules=("expert_fc1", "moe_act"))
    plain = estimate_time(model, strategy.model_copy(update={"offload_modules": ()}), Cluster(device=_device(64e9), num_devices=8))
    fast = estimate_time(model, strategy, Cluster(device=_device(1e18), num_devices=8))
    assert fast.breakdown["comm_exposed"]["offload"] == 0.0
    assert fast.step_s == pytest.approx(plain.step_s, rel=1e-12)
    slow_link = 1e9
    slow = estimate_time(model, strategy, Cluster(device=_device(slow_link), num_devices=8))
    tokens = strategy.seq_length
    per_token = _moved(model, "expert_fc1", "moe_act", ep=8, dp=8)
    copy_s = per_token * tokens / (slow_link * 0.8)
    forward = plain.details["stage_forward_s"] / model.num_layers
    backward = (plain.details["stage_backward_s"] + plain.details["stage_weight_grad_s"]) / model.num_layers
    expected = strategy.num_micro_batches * model.num_layers * ((copy_s - forward) + (copy_s - backward))
    # The embedding and the head add their passes to the stage totals, which the per-layer split
    # above spreads over the layers: close, not exact.
    assert slow.breakdown["comm_exposed"]["offload"] == pytest.approx(expected, rel=0.02)
    assert slow.step_s == pytest.approx(plain.step_s + slow.breakdown["comm_exposed"]["offload"], rel=0.02)


SEARCH_MOE = ModelSpec(
    name="tiny-moe-4", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_kv_heads=4,
    head_dim=32, vocab_size=1024, num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=128,
    layer_mlp_kinds=("dense", "moe", "moe", "moe"),
)


def test_search_over_offload_sets_equals_brute_force():
    """The ranked list equals a loop over the space with the single-strategy API, each candidate
    priced with its own offload and recompute modules; candidates with full recompute, Megatron's
    default selective policy beside core_attn, or a schedule Megatron does not offload under are
    rejected by rule ``offload_runs``."""
    from ndplan.perf import step_time_batch
    from ndplan.search import default_space, run_search
    from ndplan.strategy import get_precision
    from search_brute import brute_force_ranking

    device = get_device("h100-sxm")
    options = MemoryOptions(runtime="megatron")
    sets = ((), ("core_attn", "expert_fc1"), ("expert_fc1", "moe_act"))
    space = default_space(SEARCH_MOE, device, 8, 16, 1024, get_precision("megatron-bf16"),
                          dims=("ep", "pp", "schedule", "recompute"), offload_modules=sets,
                          recompute_modules=((), ("layernorm", "moe_act")))
    assert space.offload_modules == sets and len(space.recompute_modules) == 2
    step_time = lambda m, b, c: step_time_batch(m, b, c, weight_grad_rebuilds=False)  # noqa: E731 (megatron runtime)
    limit = 2 * 2**30
    result = run_search(SEARCH_MOE, device, space, step_time, memory_limit_bytes=limit, options=options, top=10**9,
                        block_size=97)
    assert result.rejected["offload_runs"] > 0

    def selective_modules(candidate: int, strategy: Strategy) -> None:  # the digit arithmetic under the offload digit
        if strategy.recompute == "selective":
            assert space.selective_modules(candidate) == strategy.recompute_modules

    expected = brute_force_ranking(SEARCH_MOE, device, space, step_time, limit, options, selective_modules)
    assert expected and [row["candidate"] for row in result.ranked] == expected
    assert {row["offload_modules"] for row in result.ranked} == {"", "core_attn+expert_fc1", "expert_fc1+moe_act"}
    assert "full" not in {row["recompute"] for row in result.ranked if row["offload_modules"]}
    assert {row["schedule"] for row in result.ranked if row["offload_modules"]} <= {"1f1b", "interleaved"}
    with pytest.raises(NdplanError, match="unknown offload module 'fused_group_mlp'; known: attn_norm"):
        default_space(SEARCH_MOE, device, 8, 16, 1024, offload_modules=("fused_group_mlp",))


def test_offload_sets_worth_searching():
    from ndplan.search.space import offload_sets, parse_offload_set

    assert offload_sets(get_preset("llama-3.1-8b")) == ((), ("core_attn", "attn_proj"), ("qkv_linear", "core_attn", "attn_proj"))
    deepseek = offload_sets(get_preset("deepseek-v3"))
    assert deepseek[:2] == ((), ("expert_fc1", "moe_act")) and deepseek[-1][0] == "attn_norm" and len(deepseek) == 5
    assert parse_offload_set("moe_act+expert_fc1") == ("expert_fc1", "moe_act") and parse_offload_set("none") == ()
    with pytest.raises(NdplanError, match="unknown offload module 'mlp'"):
        parse_offload_set("mlp")


BALANCED = Strategy(dp=2, pp=4, ep=2, zero=1, num_micro_batches=16, recompute="selective",
                    recompute_modules=("layernorm", "moe_act"), offload_modules=("expert_fc1", "moe_act"))


def test_the_balancer_offers_what_megatron_runs_beside_the_offload():
    """Offload runs the same modules in every layer; a layer may recompute selectively (where
    Megatron accepts the pair) but not fully, which would leave nothing to offload."""
    megatron = MemoryOptions(runtime="megatron")
    assert runnable_options(BALANCED, megatron) == ("none", "selective")
    core = Strategy(offload_modules=("core_attn",))
    assert runnable_options(core, megatron) == ("none",)  # Megatron's default selective re-runs core_attn
    assert runnable_options(core, megatron, selective_modules=("layernorm",)) == ("none", "selective")
    assert runnable_options(Strategy(), megatron) == ("none", "selective", "full")


def test_balanced_problem_with_offload_reproduces_the_estimator_and_plans_fit():
    model = get_preset("qwen3-30b-a3b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=8)
    options = MemoryOptions(runtime="megatron")
    problem = build_problem(model, BALANCED, cluster, 80 * 2**30, options)
    assert baseline_option(problem) == "selective"
    cost = evaluate(problem, uniform_plan(problem, "none"))
    plain = BALANCED.with_recompute("none")
    expected = [stage.peak_bytes for stage in estimate(model, plain, cluster.device, options).stages]
    np.testing.assert_allclose(cost.stage_memory_bytes, expected, rtol=1e-9)
    limit = 0.5 * (cost.stage_memory_bytes.max() + evaluate(problem, uniform_plan(problem, "selective")).stage_memory_bytes.max())
    for exact in (True, False):
        result = balance(model, BALANCED, cluster, limit, options, exact=exact)
        assert result.cost.fits and set(result.plan.recompute) <= {"none", "selective"}
        assert result.cost.step_s <= result.baseline[1].step_s + 1e-12
        assert result.to_dict()["before"]["recompute"] == "selective"
        assert result.estimated_stage_bytes is not None


def test_search_cli_takes_offload_sets(capsys):
    import json

    from ndplan.cli import main

    argv = ["search", "--model", "qwen3-30b-a3b", "--devices", "16", "--hardware", "h100-sxm", "--gbs", "64",
            "--runtime", "megatron", "--dims", "ep", "pp", "recompute", "--json"]
    assert main([*argv, "--offload-module-sets", "none", "expert_fc1+moe_act"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert {row["offload_modules"] for row in ranked} == {"", "expert_fc1+moe_act"}
    assert main([*argv, "--offload-modules", "moe_act", "--offload-module-sets", "none"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([*argv, "--offload-module-sets", "none", "expert_fc2"]) == 2
    assert "unknown offload module 'expert_fc2'" in capsys.readouterr().err
    assert main([*argv, "--fix", "offload_modules=moe_act+expert_fc1"]) == 0
    assert {row["offload_modules"] for row in json.loads(capsys.readouterr().out)["ranked"]} == {"expert_fc1+moe_act"}
    searched = [a for a in argv if a != "--json"] + ["offload_modules", "--top", "1000", "--json"]
    assert main(searched) == 0  # --dims naming the dimension searches offload_sets(model)
    assert len({row["offload_modules"] for row in json.loads(capsys.readouterr().out)["ranked"]}) == 5


def test_a_batch_prices_each_offloaded_strategy_as_alone():
    """The batch path (the search's) prices activations once per combination of a few fields;
    with offload the bytes must still depend on those alone: equal to one estimate each."""
    from ndplan.memory import stage_memory

    model = get_preset("deepseek-v2-lite")
    device = get_device("h100-sxm")
    options = MemoryOptions(runtime="megatron")
    # MLA's up-projected q, k, v: offloaded by core_attn, rebuilt by mla_up_proj (moved only where kept)
    offload = ("core_attn", "attn_proj", "expert_fc1")
    selective = {"recompute": "selective", "recompute_modules": ("layernorm", "mla_up_proj")}
    strategies = [
        Strategy(**{"dp": 2, "pp": 4, "ep": 2, "zero": 1, "num_micro_batches": 8, "offload_modules": offload, **extra})
        for extra in ({}, selective, {**selective, "recompute_layers": 2},
                      {"pp": 2, "vpp": 2, "dp": 4, "schedule": "interleaved"})
    ]
    # A batch shares its recompute modules: the plain strategies take the selective ones' set too.
    batch = StrategyBatch.of(strategies)
    peaks = stage_memory(model, batch, options).device.max(axis=1)
    for strategy, peak in zip(strategies, peaks, strict=True):
        assert peak == pytest.approx(estimate(model, strategy, device, options, num_devices=8).peak_bytes, rel=1e-12)


def test_report_labels_and_time_segments_name_the_offload():
    from ndplan.report.data import strategy_short
    from ndplan.report.style import TIME_SEGMENTS

    strategy = Strategy(dp=8, ep=8, zero=1, offload_modules=("expert_fc1", "moe_act")).model_dump(mode="json")
    assert "offload=expert_fc1+moe_act" in strategy_short(strategy)
    assert "offload=core_attn" in strategy_short({"dp": 2, "offload_modules": "core_attn"})  # a search row's spelling
    assert "offload" not in strategy_short(Strategy(dp=8).model_dump(mode="json"))
    assert "offload" in {key for key, _, _ in TIME_SEGMENTS}


def test_time_explain_states_the_copy_formula():
    model = get_preset("qwen3-30b-a3b")
    strategy = Strategy(dp=8, ep=8, num_micro_batches=2, offload_modules=("expert_fc1", "moe_act"))
    report = estimate_time(model, strategy, Cluster(device=get_device("h100-sxm"), num_devices=8))
    line = next(line for line in report.explain() if "offload (expert_fc1 moe_act)" in line)
    # top-k·h·2 + 2·top-k·ffn_e·2 = 8·2048·2 + 2·8·768·2 = 57,344 bytes per token, · 4096 tokens = 224 MiB
    assert "224.0 MiB each way per layer and micro-batch" in line and "host_link_efficiency 0.80" in line


def test_html_stage_table_shows_host_memory_only_with_offload():
    from ndplan.report.data import memory_stages
    from ndplan.report.html import stage_table

    model, device = get_preset("qwen3-30b-a3b"), get_device("h100-sxm")
    for offload in ((), ("expert_fc1", "moe_act")):
        strategy = Strategy(dp=4, pp=2, ep=4, zero=1, num_micro_batches=8, offload_modules=offload)
        report = estimate(model, strategy, device, MEGATRON, num_devices=8).to_dict()
        stages = memory_stages(report["stages"])
        html = stage_table({"stages": stages, "capacity_bytes": report["capacity_bytes"]})
        assert ("host (offload)" in html) == bool(offload)
        assert (stages[0]["host_activation_bytes"] > 0) == bool(offload)


def test_offloading_the_core_attention_moves_eager_scores_too():
    """Under eager attention the core keeps its s x s scores (Megatron's unfused softmax: fp32 and
    the activation-width probabilities per head); offloading core_attn moves them with q, k, v.
    Before, only the per-token part moved and the scores stayed on the device."""
    eager = MemoryOptions(runtime="megatron", attention="eager", include_overhead=False)
    seq = 64
    strategy = Strategy(offload_modules=("core_attn",), seq_length=seq)
    moved = float(layer_activations(TINY_DENSE, StrategyBatch.of(strategy), eager).offloaded["dense"][0])
    flash = float(layer_activations(TINY_DENSE, StrategyBatch.of(strategy), MEGATRON).offloaded["dense"][0])
    scores = moved - flash
    assert scores > 0
    model = TINY_DENSE.model_copy(update={"num_layers": 4})
    plain = estimate(model, Strategy(seq_length=seq), None, eager).stages[0]
    offloaded = estimate(model, strategy, None, eager).stages[0]
    assert plain.activations_bytes - offloaded.activations_bytes > 2 * scores * seq  # all but the two kept layers
