"""Megatron-Core's --recompute-modules: validation, hand-derived bytes, replay time, config I/O."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from ndplan.errors import NdplanError
from ndplan.hardware import Cluster, get_device
from ndplan.io import read_config
from ndplan.io.megatron_emit import emit_megatron
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


def _selective_bytes(model: ModelSpec, *modules: str, tp: int = 1) -> float:
    """Bytes per token the MoE layer keeps under selective recompute with ``modules``."""
    strategy = Strategy(tp=tp, sequence_parallel=tp > 1, recompute="selective", recompute_modules=modules)
    return float(layer_activations(model, StrategyBatch.of(strategy), MEGATRON).recomputed["moe"][0])


def test_modules_are_validated_and_spelled_one_way():
    s = Strategy(recompute="selective", recompute_modules=("moe_act", "layernorm", "moe_act"))
    assert s.recompute_modules == ("layernorm", "moe_act")  # Megatron's order, no repeats
    assert s.short().endswith("rc-selective(layernorm+moe_act)")
    with pytest.raises(ValidationError, match="needs recompute 'selective', not 'full'"):
        Strategy(recompute="full", recompute_modules=("moe_act",))
    with pytest.raises(ValidationError, match="'core_attn', 'layernorm', 'moe_act'"):
        Strategy(recompute="selective", recompute_modules=("attention",))
    with pytest.raises(ValueError, match="one set of recompute modules"):
        StrategyBatch.of([s, Strategy(recompute="selective", recompute_modules=("moe",))])
    batch = StrategyBatch.of([s, Strategy()])  # no recompute beside it: one batch
    assert batch.row(0) == s and batch.row(1) == Strategy() and batch.take(np.array([0])).recompute_modules == s.recompute_modules


def test_megatron_module_bytes_by_hand():
    """Megatron profile, bf16, tp 1, per token of the MoE layer (h 64, top-2, expert ffn 32,
    shared ffn 48): layernorm drops the router's input (the pre-MLP norm's output, 2h = 128);
    moe_act the experts' activation output (2·topk·ffn_e = 128); shared_experts the shared
    expert's fc1 output and activation (2·2·48 + 2·48 = 288); moe everything the block keeps but
    its input: router logits 4·2·8 = 64, the permuted copies 2·2h = 256 and their routing
    probabilities (fp32) 4·2 = 8, the experts' fc1 output and activation 2·2·2·32 + 128 = 384,
    and the shared expert's 288."""
    default = _selective_bytes(TINY_MOE)
    assert _selective_bytes(TINY_MOE, "core_attn") == default  # Megatron's default list
    assert default - _selective_bytes(TINY_MOE, "core_attn", "layernorm") == 128
    assert default - _selective_bytes(TINY_MOE, "core_attn", "moe_act") == 128
    assert default - _selective_bytes(TINY_MOE, "core_attn", "shared_experts") == 288
    assert default - _selective_bytes(TINY_MOE, "core_attn", "moe") == 64 + 256 + 8 + 384 + 288
    # Overlapping modules drop a tensor once.
    assert _selective_bytes(TINY_MOE, "core_attn", "moe", "moe_act", "shared_experts") == _selective_bytes(
        TINY_MOE, "core_attn", "moe")
    # Without core_attn the softmax statistics stay (4 bytes per head).
    assert _selective_bytes(TINY_MOE, "moe_act") - _selective_bytes(TINY_MOE, "core_attn", "moe_act") == 4 * 4


def test_more_modules_never_keep_more():
    model = get_preset("deepseek-v3")  # MLA, dense and MoE layers, shared experts
    names = ("core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts")
    for tp in (1, 4):
        previous = float("inf")
        for n in range(1, len(names) + 1):
            strategy = Strategy(tp=tp, sequence_parallel=tp > 1, recompute="selective", recompute_modules=names[:n])
            acts = layer_activations(model, StrategyBatch.of(strategy), MEGATRON)
            kept = float(acts.recomputed["dense"][0] + acts.recomputed["moe"][0])
            assert kept <= previous
            assert acts.recomputed["moe"][0] <= acts.full["moe"][0]
            previous = kept


def test_modules_need_the_megatron_runtime():
    strategy = Strategy(recompute="selective", recompute_modules=("moe_act",))
    with pytest.raises(NdplanError, match="runtime 'pytorch' recomputes by its own selective policy only"):
        estimate(TINY_MOE, strategy)


def test_replay_time_grows_with_what_is_replayed():
    model = get_preset("qwen3-30b-a3b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=16)
    base = dict(dp=8, ep=8, pp=2, tp=1, num_micro_batches=16)

    def step(**extra: object) -> tuple[float, float]:
        report = estimate_time(model, Strategy(**base, **extra), cluster)  # type: ignore[arg-type]
        return report.step_s, float(report.breakdown["comm_exposed"]["ep"])

    none, _ = step()
    attention_only, _ = step(recompute="selective")
    light, light_ep = step(recompute="selective", recompute_modules=("layernorm", "moe_act"))
    whole, whole_ep = step(recompute="selective", recompute_modules=("moe",))
    full, _ = step(recompute="full")
    # The attention core at 4,096 tokens costs more to replay than a norm and the experts' activation.
    assert none < light < attention_only < full and light < whole < full
    assert step(recompute="selective", recompute_modules=("core_attn",))[0] == pytest.approx(attention_only)
    assert whole_ep > light_ep  # the whole MoE block re-runs its dispatch and combine


def test_megatron_flags_round_trip(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(
        "torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
        "--seq-length 128 --padded-vocab-size 256 --position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
        "--num-experts 8 --moe-ffn-hidden-size 32 --moe-router-topk 2 --expert-model-parallel-size 2 "
        "--micro-batch-size 1 --global-batch-size 8 --bf16 --moe-grouped-gemm "  # (moe_act recompute needs it)
        "--recompute-granularity selective --recompute-modules moe_act layernorm\n")
    result = read_config(script, devices=2)
    strategy = result.strategy()
    assert strategy.recompute == "selective" and strategy.recompute_modules == ("layernorm", "moe_act")
    assert result.warnings == []
    assert "--recompute-modules layernorm moe_act" in emit_megatron(result.model, strategy)
    script.write_text(script.read_text().replace("moe_act layernorm", "moe_act bogus"))
    with pytest.raises(NdplanError, match="unknown module 'bogus'; known: core_attn, layernorm"):
        read_config(script, devices=2)


def test_modelzoo_layouts_that_ran_on_80gb():
    """Megatron-MoE-ModelZoo ran Qwen3-235B-A22B on 80 GB H100s at tp2 sp pp8 vpp4 ep32 and at
    tp2 sp pp32 vpp3 ep8 with `--recompute-modules layernorm moe_act`. Modelling that recompute
    lowers ndplan's largest stage by 7-8 GiB; both layouts fit the device's 79.2 GiB (the pp32 one
    was 4.2 GiB over while the profile kept the un-permute's copy of the experts' output, which
    Megatron-Core no longer saves). These figures pin where they stand."""
    model = get_preset("qwen3-235b-a22b")
    common = dict(tp=2, sequence_parallel=True, etp=1, zero=1, schedule="interleaved", micro_batch_size=1,
                  seq_length=4096, embedding_as_layer=True, output_as_layer=True)
    layouts = {"ep32": dict(dp=16, pp=8, vpp=4, ep=32, num_micro_batches=128),
               "pp32": dict(dp=4, pp=32, vpp=3, ep=8, num_micro_batches=512)}
    expected_gib = {"ep32": (71.0, 63.8), "pp32": (75.4, 67.3)}
    for name, layout in layouts.items():
        peaks = []
        for extra in ({}, {"recompute": "selective", "recompute_modules": ("layernorm", "moe_act")}):
            report = estimate(model, Strategy(**common, **layout, **extra), get_device("h100-sxm"),  # type: ignore[arg-type]
                              MemoryOptions(runtime="megatron"), num_devices=256)
            peaks.append(max(stage.peak_bytes for stage in report.stages) / 2**30)
        assert peaks == pytest.approx(expected_gib[name], abs=0.05)
        assert peaks[1] < get_device("h100-sxm").memory_bytes / 2**30
    assert get_device("h100-sxm").memory_bytes / 2**30 == pytest.approx(79.18, abs=0.01)


def test_search_prices_its_selective_candidates_with_the_modules():
    from ndplan.search import default_space, run_search

    model, device = get_preset("qwen3-30b-a3b"), get_device("h100-sxm")
    fixed = {"tp": 1, "pp": 2, "ep": 8, "zero": 1, "mbs": 1, "schedule": "1f1b", "recompute": "selective"}
    options = MemoryOptions(runtime="megatron")
    plain = run_search(model, device, default_space(model, device, 16, 256, 4096, fixed=fixed), options=options)
    light = run_search(model, device, default_space(model, device, 16, 256, 4096, fixed=fixed,
                                                    recompute_modules=("moe_act", "layernorm")), options=options)
    assert plain.best is not None and light.best is not None
    assert light.best["label"] == plain.best["label"] + "(layernorm+moe_act)"
    # The experts' activation and the router's input are rebuilt instead of the attention core:
    # less memory, and less to replay.
    assert light.best["peak_bytes"] < plain.best["peak_bytes"] and light.best["step_s"] < plain.best["step_s"]


def test_balanced_plans_keep_the_modules_on_selective_layers_only():
    from ndplan.balance import balance
    from ndplan.balance.build import plan_strategy

    model = get_preset("qwen3-30b-a3b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=16)
    strategy = Strategy(dp=8, ep=8, pp=2, num_micro_batches=16, recompute="selective",
                        recompute_modules=("layernorm", "moe_act"))
    assert strategy.with_recompute("full", 2).recompute_modules == ()
    assert strategy.with_recompute("selective").recompute_modules == ("layernorm", "moe_act")
    result = balance(model, strategy, cluster, 60 * 2**30, MemoryOptions(runtime="megatron"), exact=False)
    assert "selective" in {option for _, _, option in result.plan.ranges()}
    for plan in (result.plan, result.baseline[0]) + ((result.settings[0],) if result.settings else ()):
        placed = plan_strategy(strategy, plan)
        assert placed.recompute_modules == (strategy.recompute_modules if placed.recompute == "selective" else ())


def test_hardware_flops_follow_the_modules():
    """HFU counts what the backward replays: layernorm and moe_act replay no matmul; moe replays
    the router, experts and shared experts (2·M·N·K each, forward), core_attn the attention core."""
    from ndplan.perf.flops import (
        Sharding,
        attention_core_flops,
        gemm_flops,
        layer_gemms,
        model_flops_per_micro_batch,
    )

    model = get_preset("qwen3-30b-a3b")
    seq = 4096.0

    def replayed(*modules: str) -> float:
        flops = model_flops_per_micro_batch(model, 1.0, seq, recompute_selective_fraction=1.0, recompute_modules=modules)
        return float(flops.recompute_forward)

    sh = Sharding(1.0, seq)
    moe_block = sum(gemm_flops([g]) for g in layer_gemms(model, sh, "moe") if g.name in ("router", "experts_up", "experts_down"))
    assert replayed("layernorm", "moe_act") == 0.0
    assert replayed("core_attn") == pytest.approx(model.num_layers * attention_core_flops(model, sh))
    assert replayed("moe") == pytest.approx(model.num_layers * moe_block)
    assert replayed("core_attn") == pytest.approx(float(model_flops_per_micro_batch(
        model, 1.0, seq, recompute_selective_fraction=1.0).recompute_forward))  # Megatron's default
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=16)
    report = estimate_time(model, Strategy(dp=8, ep=8, pp=2, num_micro_batches=16, recompute="selective",
                                           recompute_modules=("layernorm", "moe_act")), cluster)
    assert report.hfu == pytest.approx(report.mfu)


@pytest.mark.parametrize("name, layout", [
    ("qwen3-30b-a3b", dict(tp=1, pp=2, ep=4, dp=4, num_micro_batches=8)),  # MoE layers only
    ("deepseek-v3", dict(tp=2, sequence_parallel=True, pp=8, ep=32, etp=1, dp=64, num_micro_batches=16)),  # MLA, dense + MoE
])
def test_no_module_set_raises_the_peak(name, layout):
    """Every one of the 127 module sets peaks at most as high as no recompute, and adding a module
    never raises the peak (the rebuild transient is the layer's own kind's)."""
    from itertools import combinations

    from ndplan.memory.stages import peak_memory
    from ndplan.strategy.strategy import RECOMPUTE_MODULES

    model = get_preset(name)
    peaks = {}
    for size in range(len(RECOMPUTE_MODULES) + 1):
        for modules in combinations(RECOMPUTE_MODULES, size):
            extra = {"recompute": "selective", "recompute_modules": modules} if modules else {}
            batch = StrategyBatch.of(Strategy(**layout, **extra))  # type: ignore[arg-type]
            peaks[frozenset(modules)] = float(peak_memory(model, batch, MEGATRON)[0][0])
    for modules, peak in peaks.items():
        assert peak <= peaks[frozenset()] * (1 + 1e-12)
        for more in set(RECOMPUTE_MODULES) - modules:
            assert peaks[modules | {more}] <= peak * (1 + 1e-12), (sorted(modules), more)


def test_replayed_modules_rerun_their_collectives_and_launches():
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=128)
    dense = get_preset("llama-3.1-70b")
    base = dict(tp=8, sequence_parallel=True, pp=4, dp=4, num_micro_batches=16)

    def tp_exposed(**extra: object) -> float:
        return float(estimate_time(dense, Strategy(**base, **extra), cluster).breakdown["comm_exposed"]["tp"])  # type: ignore[arg-type]

    none, mlp, full = tp_exposed(), tp_exposed(recompute="selective", recompute_modules=("mlp",)), tp_exposed(recompute="full")
    assert mlp - none == pytest.approx((full - none) / 2)  # the MLP block's collective of the layer's two
    # The MoE block's replay cannot run faster than the host launches its experts again.
    moe = get_preset("qwen3-30b-a3b")
    small = Cluster(device=get_device("h100-sxm"), num_devices=16)
    plain = estimate_time(moe, Strategy(dp=8, ep=8, pp=2, num_micro_batches=16), small)
    replayed = estimate_time(moe, Strategy(dp=8, ep=8, pp=2, num_micro_batches=16, recompute="selective",
                                           recompute_modules=("moe",)), small)
    eff = replayed.efficiency
    floor = eff.host_moe_layer_s + (moe.num_experts / 8) * eff.host_expert - eff.host_layer_s
    layers_per_micro_batch = moe.num_layers / 2  # a stage's layers, one micro-batch each
    extra_compute = replayed.breakdown["compute"] - plain.breakdown["compute"]
    assert extra_compute >= 16 * layers_per_micro_batch * floor * 0.99


def test_mla_up_projection_recompute_by_hand():
    """DeepSeek-V3 (q_lora 1536, kv_lora 512, 128 heads, q 128·192, k 128·192, o 128·128), bf16, tp 1:
    mla_up_proj drops q, k and v (2·(24576 + 24576 + 16384)) and the latents' norm outputs
    (2·(1536 + 512)), per token and layer."""
    model = get_preset("deepseek-v3")
    acts = [layer_activations(model, StrategyBatch.of(Strategy(recompute="selective", recompute_modules=m)), MEGATRON)
            for m in (("core_attn",), ("core_attn", "mla_up_proj"))]
    dropped = float(acts[0].recomputed["moe"][0] - acts[1].recomputed["moe"][0])
    assert dropped == 2 * (24576 + 24576 + 16384) + 2 * (1536 + 512)


def test_search_balance_prices_the_selective_option_with_the_modules():
    """``search --balance`` balances candidates that recompute nothing too: their selective option
    re-runs the space's modules, and the settings it writes carry them where selective."""
    from ndplan.balance import build_problem
    from ndplan.balance.build import plan_strategy
    from ndplan.balance.problem import uniform_plan

    model = get_preset("qwen3-30b-a3b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=16)
    candidate = Strategy(dp=8, ep=8, pp=2, num_micro_batches=16)  # as the search's rows give it
    modules = ("layernorm", "moe_act")
    options = MemoryOptions(runtime="megatron")
    own = build_problem(model, candidate, cluster, 60 * 2**30, options)
    searched = build_problem(model, candidate, cluster, 60 * 2**30, options, selective_modules=modules)
    with_modules = build_problem(model, candidate.with_recompute("selective", modules=modules), cluster, 60 * 2**30, options)
    assert searched.costs[("moe", "selective")] == with_modules.costs[("moe", "selective")]
    assert searched.costs[("moe", "selective")] != own.costs[("moe", "selective")]
    placed = plan_strategy(candidate, uniform_plan(searched, "selective"), modules)
    assert placed.recompute == "selective" and placed.recompute_modules == modules
    assert plan_strategy(candidate, uniform_plan(searched, "full"), modules).recompute_modules == ()


def test_a_searched_module_set_the_model_does_not_have_is_refused():
    """A review found rc-selective(mla_up_proj) ranked beside each Llama candidate without it,
    with the same figures (the set re-runs nothing); an offload set likewise moves nothing."""
    from ndplan.search import default_space

    model, device = get_preset("llama-3.1-8b"), get_device("h100-sxm")
    with pytest.raises(NdplanError, match="recompute module set 'mla_up_proj': mla_up_proj recomputes nothing in "
                                          "llama-3.1-8b .*; its modules: core_attn, mlp"):
        default_space(model, device, 8, 32, 4096, recompute_modules=[(), ("mla_up_proj",)])
    with pytest.raises(NdplanError, match="offload module set 'expert_fc1': expert_fc1 offloads nothing"):
        default_space(model, device, 8, 32, 4096, offload_modules=[(), ("expert_fc1",)])
    assert default_space(model, device, 8, 32, 4096, recompute_modules=[(), ("mlp",)]).recompute_modules == ((), ("mlp",))


def test_deprecated_moe_layer_recompute_is_read_as_megatron_core_runs_it(tmp_path):
    """--moe-layer-recompute: Megatron-Core's TransformerConfig sets the granularity selective and
    adds "moe" to --recompute-modules (default core_attn); beside full recompute it raises. The
    MoE layer (h 64, 4 heads, top-2 of 8 experts of width 32, no dropout, tp 1, flash) then keeps,
    per token: its two norms' inputs and rsigma 2·(128 + 4) = 264, the attention's normed input,
    q, k, v and output 5·128 = 640 (core_attn drops the 16 B of softmax statistics), and of the
    MoE block only the checkpoint's input, the router's input 128: 1,032 B, where no recompute
    keeps 1,760 (the block's 840: router input 128, logits 4·2·8 = 64, permuted copies 256,
    their probabilities 8, expert fc1 output 256 and activation 128)."""
    script = tmp_path / "train.sh"
    base = ("torchrun pretrain_gpt.py --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
            "--seq-length 128 --padded-vocab-size 256 --position-embedding-type rope --swiglu --normalization RMSNorm "
            "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --num-experts 8 --moe-ffn-hidden-size 32 "
            "--moe-router-topk 2 --micro-batch-size 1 --global-batch-size 8 --bf16 --moe-grouped-gemm ")
    script.write_text(base + "--moe-layer-recompute\n")
    result = read_config(script, devices=1)
    strategy = result.strategy()
    assert strategy.recompute == "selective" and strategy.recompute_modules == ("core_attn", "moe")
    assert not any("moe-layer-recompute" in w for w in result.warnings)
    acts = layer_activations(result.model, StrategyBatch.of(strategy), MEGATRON)
    assert float(acts.recomputed["moe"][0]) == 264 + 640 + 128
    assert float(acts.full["moe"][0]) == 264 + 640 + 16 + 840
    assert "--recompute-modules core_attn moe" in emit_megatron(result.model, strategy)
    # Added to the modules a script names.
    script.write_text(base + "--recompute-granularity selective --recompute-modules layernorm --moe-layer-recompute\n")
    assert read_config(script, devices=1).strategy().recompute_modules == ("layernorm", "moe")
    # Refused beside full recompute: priced as full, with a warning.
    script.write_text(base + "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
                             "--moe-layer-recompute\n")
    result = read_config(script, devices=1)
    assert result.strategy().recompute == "full"
    assert any("--moe-layer-recompute with --recompute-granularity full: Megatron-Core refuses" in w
               for w in result.warnings)


def test_shared_expert_recompute_beside_its_overlap_is_refused(tmp_path):
    """TransformerConfig raises for --recompute-modules shared_experts with
    --moe-shared-expert-overlap on a model with shared experts (MoELayer only checkpoints shared
    experts it computes itself, not those the dispatcher overlaps): the reader warns."""
    script = tmp_path / "train.sh"
    base = ("torchrun pretrain_gpt.py --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
            "--seq-length 128 --padded-vocab-size 256 --position-embedding-type rope --swiglu --normalization RMSNorm "
            "--disable-bias-linear --num-experts 8 --moe-ffn-hidden-size 32 --moe-router-topk 2 "
            "--moe-shared-expert-intermediate-size 48 --micro-batch-size 1 --global-batch-size 8 --bf16 "
            "--moe-grouped-gemm --recompute-granularity selective --recompute-modules shared_experts ")
    script.write_text(base + "\n")
    assert not any("refuses" in w for w in read_config(script, devices=1).warnings)
    script.write_text(base + "--moe-shared-expert-overlap\n")
    warnings = read_config(script, devices=1).warnings
    assert any("--recompute-modules shared_experts with --moe-shared-expert-overlap: Megatron-Core refuses it" in w
               for w in warnings)


def test_selective_recompute_with_a_layer_count_is_refused(tmp_path):
    """TransformerConfig raises for --recompute-num-layers beside --recompute-granularity
    selective ('recompute_num_layers must be None'): the reader warns and prices every layer
    selective, as the granularity says."""
    script = tmp_path / "train.sh"
    script.write_text(
        "torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
        "--seq-length 128 --padded-vocab-size 256 --micro-batch-size 1 --global-batch-size 8 --bf16 "
        "--recompute-granularity selective --recompute-num-layers 2\n")
    result = read_config(script, devices=1)
    assert result.strategy().recompute == "selective" and result.strategy().recompute_layers == 0
    assert any("--recompute-num-layers with --recompute-granularity selective: Megatron-Core refuses it" in w
               for w in result.warnings)


def test_uniform_recompute_of_layer_groups_beside_mtp_is_refused(tmp_path):
    """Megatron-Core's MTP layer asserts 'recompute_num_layers must be 1 for MTP recompute' under
    --recompute-method uniform: with --mtp-num-layers the reader warns beside its note on groups."""
    script = tmp_path / "train.sh"
    base = ("torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
            "--seq-length 128 --padded-vocab-size 256 --micro-batch-size 1 --global-batch-size 8 --bf16 "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2 ")
    refused = "--recompute-num-layers 2 and MTP layers: Megatron-Core refuses it"
    script.write_text(base + "\n")
    assert not any(refused in w for w in read_config(script, devices=1).warnings)
    script.write_text(base + "--mtp-num-layers 1\n")
    result = read_config(script, devices=1)
    assert result.model.mtp_depth == 1 and result.strategy().recompute == "full"
    assert any(refused in w for w in result.warnings)
