"""Balancing: the exact solvers equal brute force, the heuristic never breaks memory, never slower than uniform."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ndplan.balance import (
    BalanceProblem,
    LayerCost,
    build_problem,
    evaluate,
    solve_brute_force,
    solve_exact,
    solve_heuristic,
    solve_milp,
    uniform_plan,
)
from ndplan.hardware import Cluster, get_device
from ndplan.model import get_preset
from ndplan.strategy import Strategy

GIB = 2**30


def make_problem(kinds, pp, limit, m=8, seed=0, vpp=1):
    rng = np.random.default_rng(seed)
    costs = {}
    for kind in sorted(set(kinds)):
        base_t, act, static = rng.uniform(1, 2), rng.uniform(0.5, 1.5) * GIB, rng.uniform(0.5, 1.0) * GIB
        costs[(kind, "none")] = LayerCost(base_t, act, static)
        costs[(kind, "selective")] = LayerCost(base_t * 1.05, act * 0.5, static)
        costs[(kind, "full")] = LayerCost(base_t * 1.33, act * 0.05, static)
    virtual = pp * vpp
    stage_of = np.array([v % pp for v in range(virtual)])
    chunk_of = np.array([v // pp for v in range(virtual)])
    in_flight = np.array([[max(1, pp - s) for _ in range(vpp)] for s in range(pp)], dtype=float)
    return BalanceProblem(
        layer_kinds=tuple(kinds), options=("none", "selective", "full"), costs=costs,
        stage_of=stage_of, chunk_of=chunk_of, peak_in_flight=in_flight, num_micro_batches=m,
        first_extra=LayerCost(0.3, 0.1 * GIB, 1.0 * GIB), last_extra=LayerCost(1.5, 1.0 * GIB, 1.0 * GIB),
        fixed_bytes=np.full(pp, 0.5 * GIB), memory_limit_bytes=limit,
        recompute_transient_bytes=rng.uniform(0.1, 0.6, pp) * GIB,
    )


@pytest.mark.parametrize("kinds,pp,limit", [
    (("dense",) * 8, 2, 12 * GIB),
    (("dense",) * 8, 4, 8 * GIB),
    (("dense", "dense", "moe", "moe", "moe", "moe", "moe"), 3, 10 * GIB),
    (("moe",) * 9, 3, 7 * GIB),
])
def test_exact_and_milp_equal_brute_force(kinds, pp, limit):
    problem = make_problem(kinds, pp, limit)
    brute = solve_brute_force(problem)
    exact = solve_exact(problem)  # the DP: one virtual stage per stage
    milp = solve_milp(problem)
    assert brute is not None and exact is not None and milp is not None
    assert exact[1].step_s == pytest.approx(brute[1].step_s, rel=1e-9)
    assert milp[1].step_s == pytest.approx(brute[1].step_s, rel=1e-6)  # HiGHS' own tolerance
    assert exact[1].fits and milp[1].fits


def test_infeasible_problem_has_no_plan():
    problem = make_problem(("dense",) * 6, 2, 1 * GIB)
    assert solve_exact(problem) is None and solve_brute_force(problem) is None and solve_heuristic(problem) is None


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(4, 12), pp=st.integers(2, 4), limit_gib=st.floats(4, 30), seed=st.integers(0, 1000),
       moe_from=st.integers(0, 4))
def test_heuristic_never_violates_memory_and_beats_uniform_full(layers, pp, limit_gib, seed, moe_from):
    if layers < pp:
        return
    kinds = tuple("dense" if i < moe_from else "moe" for i in range(layers))
    problem = make_problem(kinds, pp, limit_gib * GIB, seed=seed)
    found = solve_heuristic(problem)
    uniform_full = evaluate(problem, uniform_plan(problem, "full"))
    if found is None:
        assert solve_brute_force(problem) is None
        return
    plan, cost = found
    assert cost.fits and np.all(cost.stage_memory_bytes <= problem.memory_limit_bytes)
    assert sum(plan.stage_layers) == layers and min(plan.stage_layers) >= 1
    if uniform_full.fits:
        assert cost.step_s <= uniform_full.step_s + 1e-9


def test_plan_ranges_group_recompute_runs():
    from ndplan.balance import Plan

    plan = Plan((2, 2), ("full", "full", "none", "selective"))
    assert plan.ranges() == [(0, 2, "full"), (2, 1, "none"), (3, 1, "selective")]


def test_built_problem_reproduces_the_estimator_for_the_uniform_plan():
    """With uniform placement and no or full recompute, the linear stage model equals the estimator."""
    from ndplan.balance import build_problem
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import estimate
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("llama-3.1-70b")
    strategy = Strategy(dp=2, tp=8, pp=4, sequence_parallel=True, zero=1, num_micro_batches=16)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=64)
    problem = build_problem(model, strategy, cluster, 80 * GIB)
    for option in ("none", "full"):
        cost = evaluate(problem, uniform_plan(problem, option))
        uniform = strategy.model_copy(update={"recompute": option})
        expected = [stage.peak_bytes for stage in estimate(model, uniform, cluster.device).stages]
        np.testing.assert_allclose(cost.stage_memory_bytes, expected, rtol=1e-9)


@pytest.mark.parametrize("kinds,pp,vpp,limit,options", [
    (("dense",) * 8, 2, 1, 12 * GIB, ("none", "selective", "full")),
    (("dense", "dense", "moe", "moe", "moe", "moe", "moe", "moe"), 2, 2, 10 * GIB, ("none", "selective", "full")),
    (("moe",) * 12, 3, 1, 9 * GIB, ("none", "full")),
])
def test_settings_plan_is_one_setting_and_between_the_plan_and_uniform(kinds, pp, vpp, limit, options):
    """What --emit writes: one recompute setting (collapsing it changes nothing), runnable,
    fitting, no faster than the per-layer optimum and no slower than uniform full recompute."""
    from dataclasses import replace

    from ndplan.balance.build import best_settings_plan, settings_plan

    problem = replace(make_problem(kinds, pp, limit, vpp=vpp), options=options)
    plan, cost = solve_brute_force(problem)
    uniform = uniform_plan(problem, "full")
    settings, settings_cost = best_settings_plan(problem, plan, uniform)
    assert settings_plan(settings) == settings and set(settings.recompute) <= set(options)
    again = evaluate(problem, settings)
    assert settings_cost.fits and settings_cost.step_s == again.step_s
    np.testing.assert_array_equal(settings_cost.stage_memory_bytes, again.stage_memory_bytes)
    assert cost.step_s <= settings_cost.step_s + 1e-12 <= evaluate(problem, uniform).step_s + 1e-12


def test_balance_fits_and_is_never_slower_than_uniform_full_recompute():
    from ndplan.balance import balance
    from ndplan.hardware import Cluster, get_device
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("deepseek-v2-lite")
    strategy = Strategy(dp=2, pp=4, ep=2, etp=1, zero=1, num_micro_batches=16)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=8)
    for limit in (47 * GIB, 60 * GIB):
        for exact in (True, False):
            result = balance(model, strategy, cluster, limit, exact=exact)
            assert result.cost.fits and result.cost.stage_memory_bytes.max() <= limit
            assert result.cost.step_s <= result.baseline[1].step_s + 1e-12
            assert sum(result.plan.stage_layers) == model.num_layers


def test_split_backward_plans_under_pytorch_never_use_selective_and_are_checked():
    """PyTorch refuses selective checkpointing under a split backward, so a ZB-V plan for the
    pytorch runtime recomputes fully or not at all; every plan is also priced by the full
    estimator with the plan as framework settings, beside the balancer's own memory figures."""
    from ndplan.balance import balance
    from ndplan.balance.build import runnable_options
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    zbv = Strategy(dp=4, tp=2, pp=4, vpp=2, schedule="zbv", num_micro_batches=16, seq_length=4096)
    assert runnable_options(zbv, MemoryOptions()) == ("none", "full")
    assert runnable_options(zbv, MemoryOptions(runtime="megatron")) == ("none", "selective", "full")
    assert "selective" in runnable_options(zbv.model_copy(update={"schedule": "interleaved"}), MemoryOptions())
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=32)
    result = balance(get_preset("llama-3.1-8b"), zbv, cluster, 44 * GIB)
    assert "selective" not in result.plan.recompute and "full" in result.plan.recompute
    assert result.estimated_stage_bytes is not None and len(result.estimated_stage_bytes) == 4
    assert result.to_dict()["estimated_stage_bytes"] == result.estimated_stage_bytes.round().tolist()


def test_the_balancer_prices_layers_with_the_runtimes_overlap():
    """The overlap switches of the options reach the balancer's layer times (TP overlap: less
    exposed TP per layer), as they reach the step time."""
    from ndplan.balance import build_problem
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.perf import parse_overlap
    from ndplan.strategy import Strategy

    strategy = Strategy(tp=8, pp=4, sequence_parallel=True, num_micro_batches=8)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=32)
    model = get_preset("llama-3.1-70b")
    plain = build_problem(model, strategy, cluster, 80 * GIB, MemoryOptions())
    hidden = build_problem(model, strategy, cluster, 80 * GIB, MemoryOptions(overlap=parse_overlap("tp=on")))
    for option in ("none", "full"):
        assert hidden.costs[("dense", option)].time_s < plain.costs[("dense", option)].time_s


def test_problems_built_in_one_batch_equal_those_built_one_at_a_time():
    """``build_problems`` (what search --balance runs on a chunk of candidates) gives each
    strategy exactly the problem ``build_problem`` gives it alone: no row of the batch leaks
    into another's, whatever their pipeline shapes, schedules and recompute."""
    import dataclasses

    from ndplan.balance import build_problem, build_problems
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("qwen3-30b-a3b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=32)
    strategies = [
        Strategy(dp=8, tp=1, pp=4, ep=8, num_micro_batches=8, recompute="full"),
        Strategy(dp=4, tp=2, pp=4, sequence_parallel=True, ep=4, etp=1, zero=1, num_micro_batches=16, vpp=2,
                 schedule="interleaved"),
        Strategy(dp=8, tp=1, pp=4, vpp=2, schedule="zbv", ep=8, num_micro_batches=8, recompute="selective"),
        Strategy(dp=2, tp=4, pp=4, sequence_parallel=True, ep=2, zero=3, micro_batch_size=2, num_micro_batches=4),
    ]
    options = MemoryOptions(runtime="megatron")
    together = build_problems(model, strategies, cluster, 60 * GIB, options)
    for strategy, batched in zip(strategies, together, strict=True):
        alone = build_problem(model, strategy, cluster, 60 * GIB, options)
        for field in dataclasses.fields(alone):
            mine, theirs = getattr(batched, field.name), getattr(alone, field.name)
            if isinstance(mine, np.ndarray):
                np.testing.assert_array_equal(mine, theirs, err_msg=field.name)
            elif field.name in ("recompute_layer_bytes", "recompute_option_bytes"):  # option -> [pp]
                assert mine.keys() == theirs.keys(), field.name
                for option in mine:
                    np.testing.assert_array_equal(mine[option], theirs[option], err_msg=field.name)
            else:
                assert mine == theirs, field.name
    # Different strategies do give different problems (the comparison above can fail).
    assert together[0].costs != together[3].costs


def test_balance_takes_names_and_sizes_and_names_a_bad_limit():
    """A fuzzing review: balance(..., "30GiB") raised ValueError, None TypeError, a device name
    for the cluster AttributeError, and limits 0, -1 and NaN were balanced and reported as
    "fits -0.00 GiB" / "fits nan GiB". Now as run_search: sizes and names read, the rest named."""
    from ndplan.balance import balance
    from ndplan.errors import NdplanError
    from ndplan.hardware import Cluster, get_device
    from ndplan.strategy import Strategy

    strategy = Strategy(dp=2, pp=4, zero=1, num_micro_batches=8, seq_length=2048)
    by_name = balance("llama-3.1-8b", strategy, "h100-sxm", "60GiB", exact=False)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=8)
    assert by_name.plan == balance("llama-3.1-8b", strategy, cluster, 60 * GIB, exact=False).plan
    for limit in (None, 0, -1, float("nan"), float("inf"), [1], True):
        with pytest.raises(NdplanError, match=r"memory_limit_bytes must be > 0 and below 8 EiB: a number of bytes "
                                              r"or a size such as '70GiB'; got"):
            balance("llama-3.1-8b", strategy, cluster, limit)
    with pytest.raises(NdplanError, match="memory_limit_bytes: a size must be positive, got '-3GiB'"):
        balance("llama-3.1-8b", strategy, cluster, "-3GiB")
    with pytest.raises(NdplanError, match="cluster must be a Device or a device name, got int"):
        balance("llama-3.1-8b", strategy, 8, 40 * GIB)
    with pytest.raises(NdplanError, match="balance needs a Strategy, got dict"):
        balance("llama-3.1-8b", {"pp": 4}, cluster, 40 * GIB)
    with pytest.raises(NdplanError, match="options must be a MemoryOptions"):
        balance("llama-3.1-8b", strategy, cluster, 40 * GIB, "megatron")


def test_stepped_settings_step_toward_more_memory_saving_along_the_settings_axis():
    """The steps ``step_up_settings`` tries, nearest first: rc-full:k to k + 1 ... every layer;
    selective to full; none to selective (where runnable) then full; full everywhere: none."""
    from ndplan.balance.build import _leading_layers_plan, _one_setting, stepped_settings

    layers = (3, 4)
    def settings(plan):
        return [_one_setting(p) for p in stepped_settings(plan)]
    assert settings(_leading_layers_plan(layers, "full", 2)) == [("full", 3), ("full", 0)]
    assert settings(_leading_layers_plan(layers, "full", 3)) == [("full", 0)]
    assert settings(_leading_layers_plan(layers, "full", 0)) == []
    assert settings(_leading_layers_plan(layers, "selective", 0)) == [("full", 0)]
    assert settings(_leading_layers_plan(layers, "none", 0)) == [("selective", 0), ("full", 0)]
    assert [_one_setting(p) for p in stepped_settings(_leading_layers_plan(layers, "none", 0), ("none", "full"))] == [
        ("full", 0)]
    assert all(p.stage_layers == layers for p in stepped_settings(_leading_layers_plan(layers, "full", 1)))


def test_a_layers_static_bytes_carry_the_fp8_weight_copies():
    """The balancer moves a layer's static bytes with it: under Megatron's fp8 GEMMs they include
    the quantised weight copies Transformer Engine keeps (2 bytes per linear weight element,
    Llama-3.1-8B: 4096·6144 + 4096·4096 + 3·4096·14336 per layer, / tp 2), as the estimator's
    stages hold them."""
    from ndplan.balance import build_problem
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions
    from ndplan.memory.overhead import DEFAULTS
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("llama-3.1-8b")
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=8)
    options = MemoryOptions(runtime="megatron")
    static = [build_problem(model, Strategy(dp=2, tp=2, pp=2, zero=1, num_micro_batches=4, seq_length=2048,
                                            precision=precision), cluster, 80 * GIB, options)
              .costs[("dense", "none")].static_bytes for precision in ("megatron-bf16", "megatron-fp8")]
    slack = 1.0 + {**DEFAULTS, **options.profile.overhead}["allocator_slack"]
    linear = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336
    assert static[1] - static[0] == pytest.approx(2 * linear / 2 * slack, rel=1e-12)


def test_a_layers_static_bytes_carry_the_ddp_buckets():
    """Under DDP (the pytorch runtime's replicas without ZeRO or FSDP) a layer's gradients have a
    copy in the reducer's buckets that moves with the layer: 4 bytes per element more than one
    replica's (fp32 gradients of megatron-bf16), Llama-3.1-8B's 218,112,000 elements a layer."""
    from ndplan.balance import build_problem
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions
    from ndplan.memory.overhead import DEFAULTS
    from ndplan.memory.static import layer_elements
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("llama-3.1-8b")
    options = MemoryOptions(runtime="pytorch")
    static = [build_problem(model, Strategy(dp=dp, pp=2, num_micro_batches=4, seq_length=2048),
                            Cluster(device=get_device("h100-sxm"), num_devices=2 * dp), 80 * GIB, options)
              .costs[("dense", "none")].static_bytes for dp in (1, 2)]
    slack = 1.0 + {**DEFAULTS, **options.profile.overhead}["allocator_slack"]
    elements = float(layer_elements(model, np.ones(1), np.ones(1), np.ones(1)).non_expert["dense"][0])
    assert elements == 218_112_000
    assert static[1] - static[0] == pytest.approx(4 * elements * slack, rel=1e-12)


def test_the_heuristics_milp_fallback_is_bounded_by_nodes_not_seconds(monkeypatch) -> None:
    """Where the heuristic's plans all fail to fit, its MILP stops after a number of
    branch-and-bound nodes, not after a second: the same problem gets the same plan however busy
    the machine. DeepSeek-V2-Lite, pp 8 with ZB-V on 64 H100s at 0.45 of their memory: the
    one-second limit gave 14.86 s on one run and 19.35 s on the next; 2,000 nodes reach the
    MILP's optimum (3,175 nodes to prove it), 14.92 s once its recompute is dealt."""
    import scipy.optimize

    from ndplan.balance.solve import FALLBACK_MILP_NODES, FALLBACK_MILP_SECONDS

    device = get_device("h100-sxm")
    strategy = Strategy(dp=8, pp=8, vpp=2, ep=8, micro_batch_size=1, num_micro_batches=64, schedule="zbv",
                        seq_length=4096)
    problem = build_problem(get_preset("deepseek-v2-lite"), strategy, Cluster(device=device, num_devices=64),
                            0.45 * device.memory_bytes)
    limits = []
    real = scipy.optimize.milp

    def spy(*args, **kwargs):
        limits.append(dict(kwargs["options"]))  # (scipy takes its entries out)
        return real(*args, **kwargs)

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    found = solve_heuristic(problem)
    assert limits == [{"time_limit": FALLBACK_MILP_SECONDS, "node_limit": FALLBACK_MILP_NODES}]
    assert found is not None and found[1].fits
    assert found[1].step_s == pytest.approx(14.9235, rel=1e-4)
