"""Searching what selective recompute re-runs (Megatron-Core's --recompute-modules) as a dimension."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.hardware import Cluster, get_device
from ndplan.memory import MemoryOptions, estimate
from ndplan.model import ModelSpec, get_preset
from ndplan.perf import step_time_batch
from ndplan.search import default_space, run_search
from ndplan.search.run import DUPLICATE
from ndplan.search.space import applicable_modules, module_sets, parse_module_set
from ndplan.strategy import StrategyBatch, check_strategy, get_precision

TINY_MOE = ModelSpec(
    name="tiny-moe", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_kv_heads=4,
    head_dim=32, vocab_size=1024, num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=128,
    layer_mlp_kinds=("dense", "moe", "moe", "moe"),
)
DEVICE = get_device("h100-sxm")
MEGATRON = MemoryOptions(runtime="megatron")
SETS = ((), ("layernorm", "moe_act"), ("moe",))


def _space(sets=SETS, dims=("tp", "sp", "ep", "pp", "zero", "recompute")):
    return default_space(TINY_MOE, DEVICE, 8, 16, 1024, get_precision("megatron-bf16"), dims=dims,
                         recompute_modules=sets)


def test_search_over_module_sets_equals_brute_force():
    """The same set and order as a loop over the space with the single-strategy API, each
    candidate priced with its own modules; non-selective candidates once, under the first set."""
    space = _space()
    assert space.recompute_modules == SETS
    limit = 2 * 2**30
    step_time = lambda m, b, c: step_time_batch(m, b, c, weight_grad_rebuilds=False)  # noqa: E731 (the megatron runtime)
    result = run_search(TINY_MOE, DEVICE, space, step_time, memory_limit_bytes=limit, options=MEGATRON,
                        top=10**9, block_size=389)
    cluster = Cluster(device=DEVICE, num_devices=space.num_devices)
    duplicates = space.duplicates(np.arange(space.size))
    expected = []
    for candidate in range(space.size):
        strategy = space.strategy(candidate)
        if duplicates[candidate] or check_strategy(strategy, TINY_MOE, space.num_devices):
            continue
        if strategy.zero in (1, 2) and strategy.dp * strategy.cp == 1:
            continue  # ZeRO 0 under another name: a duplicate
        if strategy.tp > 1 and not strategy.sequence_parallel:
            continue  # Megatron-Core refuses MoE layers under tensor parallelism without SP: not runnable
        peak = estimate(TINY_MOE, strategy, DEVICE, MEGATRON, num_devices=space.num_devices).peak_bytes
        if peak <= limit:
            step = float(step_time(TINY_MOE, StrategyBatch.of(strategy), cluster)["step_s"][0])
            expected.append((step, peak, candidate))
    expected.sort()
    assert [row["candidate"] for row in result.ranked] == [c for _, _, c in expected]
    modules_ranked = {row["recompute_modules"] for row in result.ranked if row["recompute"] == "selective"}
    assert modules_ranked == {"", "layernorm+moe_act", "moe"}
    assert all(row["recompute_modules"] == "" for row in result.ranked if row["recompute"] != "selective")
    for row, (step, peak, _) in zip(result.ranked, expected, strict=True):
        assert row["step_s"] == pytest.approx(step, rel=1e-12)
        assert row["peak_bytes"] == round(peak)
    # Every candidate that recomputes nothing or everything is listed once per set: all but the
    # first are duplicates.
    recompute = [space.strategy(c).recompute for c in range(space.size)]
    repeated = sum(1 for c in range(space.size) if recompute[c] != "selective" and c % len(SETS) > 0)
    assert result.rejected[DUPLICATE] >= repeated > 0
    assert sum(result.rejected.values()) + result.fitting == space.size
    # Module sets with recompute fixed to another mode would price nothing of theirs (every set
    # but the first only duplicates): refused, as a search told to vary nothing would mislead.
    with pytest.raises(NdplanError, match="recompute is fixed to full"):
        default_space(TINY_MOE, DEVICE, 8, 16, 1024, dims=("tp", "pp"), fixed={"recompute": "full"},
                      recompute_modules=SETS)


def test_blocks_hold_one_module_set_and_cover_the_space():
    space = _space()
    seen = []
    for index, batch in space.blocks(block_size=100):
        sets = set((index % len(SETS)).tolist())
        assert len(sets) == 1 and batch.recompute_modules == SETS[sets.pop()]
        reference = space.batch(index)
        for name in batch.array_fields():
            np.testing.assert_array_equal(getattr(batch, name), getattr(reference, name))
        seen.append(index)
    # Every candidate once, but those that do not recompute selectively under the second and
    # third sets: duplicates, counted without being listed.
    recompute = np.array([space.strategy(c).recompute for c in range(space.size)])
    unlisted = np.flatnonzero((recompute != "selective") & (np.arange(space.size) % len(SETS) > 0))
    assert space.unlisted_duplicates == len(unlisted) > 0 and space.duplicates(unlisted).all()
    np.testing.assert_array_equal(np.sort(np.concatenate([*seen, unlisted])), np.arange(space.size))
    mixed = np.array([0, 1, 2])
    with pytest.raises(ValueError, match="several recompute module sets"):
        space.batch(mixed)
    parts = list(space.batches(mixed))
    assert [batch.recompute_modules for _, batch in parts] == list(SETS)
    assert space.strategy(4).recompute_modules in ((), SETS[1])


def test_one_module_set_leaves_the_space_and_its_indices_as_before():
    """Without module sets the dimension has one value: the indices are those of the other
    dimensions alone, and nothing is charged as a duplicate for it."""
    plain = _space(sets=())
    one = _space(sets=("layernorm", "moe_act"))
    assert plain.recompute_modules == ((),) and one.recompute_modules == (("layernorm", "moe_act"),)
    assert plain.size == one.size == _space(sets=SETS).size // 3
    assert one.strategy(5).model_dump(exclude={"recompute_modules"}) == plain.strategy(5).model_dump(
        exclude={"recompute_modules"})
    # Not searched by default even where the dimension is named nowhere; named in dims, the
    # common sets for the model.
    assert default_space(TINY_MOE, DEVICE, 8, 16, 1024).recompute_modules == ((),)
    common = _space(sets=(), dims=("recompute", "recompute_modules")).recompute_modules
    assert common == module_sets(TINY_MOE, "common") and len(common) == 5
    fixed = default_space(TINY_MOE, DEVICE, 8, 16, 1024, dims=("recompute", "recompute_modules"),
                          fixed={"recompute_modules": "moe_act+layernorm"})
    assert fixed.recompute_modules == (("layernorm", "moe_act"),)


def test_module_sets_follow_the_model():
    deepseek, llama = get_preset("deepseek-v3"), get_preset("llama-3.1-8b")
    # Megatron fuses a dense layer's norms into the next linear layer: nothing for "layernorm".
    assert applicable_modules(llama) == ("core_attn", "mlp")
    assert applicable_modules(deepseek) == ("core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe",
                                            "shared_experts")
    # () is the default, the attention core alone: ("core_attn",) is not listed again.
    assert module_sets(llama, "common") == ((), ("mlp",), ("core_attn", "mlp"))
    every = module_sets(deepseek, "all")
    # 2^7 - 1 subsets, less the 48 that name the MoE block beside its activation or shared
    # experts and the attention core alone.
    assert len(every) == 1 + 127 - 48 - 1 == len(set(every))
    assert not any("moe" in s and "moe_act" in s for s in every) and ("core_attn",) not in every
    assert module_sets(llama, "all") == ((), ("mlp",), ("core_attn", "mlp"))
    # What each set keeps differs for the model (the runtime's bytes per token).
    from ndplan.memory.activations import layer_activations
    from ndplan.strategy import Strategy

    kept = {s: float(layer_activations(deepseek, StrategyBatch.of(Strategy(recompute="selective", recompute_modules=s)),
                                        MEGATRON).recomputed["moe"][0]) for s in module_sets(deepseek, "common")}
    assert len(set(kept.values())) == len(kept)


def test_module_set_labels_and_errors():
    assert parse_module_set("moe_act+layernorm") == ("layernorm", "moe_act")
    assert parse_module_set("core_attn, mlp") == ("core_attn", "mlp")
    assert parse_module_set("default") == ()
    with pytest.raises(NdplanError, match="unknown module 'norm'.*known: core_attn, layernorm"):
        parse_module_set("norm+moe_act")
    with pytest.raises(NdplanError, match="known: common, all"):
        module_sets(TINY_MOE, "some")
    with pytest.raises(NdplanError, match="unknown recompute module 'attn'"):
        _space(sets=(("attn",), ()))


ARGS = ["search", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "256",
        "--seq", "4096", "--fix", "tp=1", "pp=2", "ep=8", "schedule=1f1b", "zero=1", "mbs=1"]


def test_cli_searches_module_sets(capsys):
    code = main([*ARGS, "--runtime", "megatron", "--recompute-module-sets", "default", "layernorm+moe_act",
                 "--memory-limit", "60GiB", "--top", "50", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {row["recompute_modules"] for row in data["ranked"]} >= {"", "layernorm+moe_act"}
    light = next(row for row in data["ranked"] if row["recompute_modules"] == "layernorm+moe_act")
    assert light["strategy"]["recompute_modules"] == ["layernorm", "moe_act"]
    assert light["label"].endswith("rc-selective(layernorm+moe_act)")


def test_cli_module_set_errors(capsys):
    assert main([*ARGS, "--runtime", "megatron", "--recompute-modules", "moe", "--recompute-module-sets", "common"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([*ARGS, "--runtime", "megatron", "--recompute-module-sets", "layernorm+act"]) == 2
    assert "unknown module 'act'" in capsys.readouterr().err
    # The PyTorch runtime has no modules to re-run: said, not a traceback.
    assert main([*ARGS, "--recompute-module-sets", "common"]) == 2
    assert "use runtime megatron" in capsys.readouterr().err


def test_cli_balanced_search_over_module_sets(capsys):
    code = main([*ARGS, "--runtime", "megatron", "--recompute-module-sets", "common", "--memory-limit", "40GiB",
                 "--balance", "--top", "3", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ranked"]
    for row in data["ranked"]:
        settings = row.get("balanced_settings")
        if settings and settings["strategy"]["recompute"] == "selective":
            assert "+".join(settings["strategy"]["recompute_modules"]) in {"+".join(s) for s in
                                                                          module_sets(get_preset("qwen3-30b-a3b"))}


# ---------------------------------------------------------------- balance: each selective policy
QWEN = ["balance", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "16", "--pp", "2", "--ep", "8",
        "--zero", "1", "--gbs", "256", "--runtime", "megatron"]


def test_balance_tries_each_selective_policy_and_keeps_the_fastest():
    from ndplan.balance import balance
    from ndplan.balance.build import plan_stage_bytes, plan_strategy
    from ndplan.strategy import Strategy

    model = get_preset("qwen3-30b-a3b")
    strategy = Strategy(dp=8, ep=8, pp=2, zero=1, num_micro_batches=32, global_batch_size=256)
    cluster = Cluster(device=DEVICE, num_devices=16)
    limit = 60 * 2**30
    policies = (("layernorm",), ("moe_act",), ("layernorm", "moe_act"))
    alone = {p: balance(model, strategy, cluster, limit, MEGATRON, selective_policies=()) if p == () else
             balance(model, strategy.with_recompute("selective", modules=p), cluster, limit, MEGATRON)
             for p in ((), *policies)}
    result = balance(model, strategy, cluster, limit, MEGATRON, selective_policies=policies)
    steps = {p: r.cost.step_s for p, r in alone.items()}
    # The winner is the fastest policy balanced on its own, and says which it is.
    assert result.cost.step_s == min(steps.values())
    assert result.selective_modules == min(policies, key=lambda p: steps[p])
    assert result.policy_steps is not None and len(result.policy_steps) == 4
    assert result.policy_steps["layernorm+moe_act"][0] == steps[("layernorm", "moe_act")]
    # Here the one-setting plan runs selective recompute: --emit carries that policy's modules,
    # and the estimator's check of it is the one reported.
    emitted = plan_strategy(strategy, result.emitted_plan, result.emitted_modules)
    assert emitted.recompute == "selective" and emitted.recompute_modules == result.emitted_modules != ()
    np.testing.assert_array_equal(
        result.estimated_stage_bytes, plan_stage_bytes(model, strategy, result.emitted_plan, MEGATRON, result.emitted_modules))
    assert float(result.estimated_stage_bytes.max()) <= limit
    # Without policies nothing changes: the strategy's own selective recompute, no policy table.
    plain = balance(model, strategy, cluster, limit, MEGATRON)
    assert plain.policy_steps is None and plain.selective_modules is None
    assert plain.cost.step_s == alone[()].cost.step_s


def test_cli_balance_with_module_sets(capsys):
    assert main([*QWEN, "--memory-limit", "60GiB", "--recompute-module-sets", "common", "--emit", "megatron", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["policy_steps"]) == {"default", "layernorm+moe_act", "core_attn+layernorm+moe_act", "layernorm+moe",
                                         "core_attn+layernorm+moe"}
    best = min(v["step_s"] for v in data["policy_steps"].values())
    assert data["after"]["step_s"] == best
    modules = data["as_settings"]["selective_modules"] if data["as_settings"] else data["selective_modules"]
    assert modules and "--recompute-modules " + " ".join(modules) in data["emitted"]
    assert main([*QWEN, "--memory-limit", "60GiB", "--recompute-module-sets", "common"]) == 0
    assert "selective policies balanced" in capsys.readouterr().out
    # PyTorch has no modules: a clear error.
    args = [a for a in QWEN if a not in ("--runtime", "megatron")]
    assert main([*args, "--recompute-module-sets", "layernorm"]) == 2
    assert "use runtime megatron" in capsys.readouterr().err
