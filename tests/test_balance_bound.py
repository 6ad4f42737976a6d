"""The vectorised lower bound of a balanced step: sound against the balancer, exact on uniform."""

from __future__ import annotations

import numpy as np
import pytest

from ndplan.balance import build_problem, evaluate, solve_exact, uniform_plan
from ndplan.balance.bound import composed_bounds
from ndplan.hardware import Cluster, get_device
from ndplan.memory import MemoryOptions
from ndplan.model import get_preset
from ndplan.strategy import Strategy, StrategyBatch, get_precision

PRECISION = get_precision("megatron-bf16")


@pytest.mark.parametrize("name,devices,strategies", [
    ("llama-3.1-8b", 64, [
        dict(dp=8, tp=2, pp=4, num_micro_batches=8, recompute="none"),
        dict(dp=8, tp=2, pp=4, num_micro_batches=8, recompute="full"),
        dict(dp=4, tp=2, pp=8, num_micro_batches=16, recompute="selective"),
        dict(dp=8, tp=1, pp=8, vpp=2, schedule="interleaved", num_micro_batches=16, recompute="full"),
        # a split backward under full recompute: W's rebuilds per parameter group priced alike
        dict(dp=16, tp=1, pp=4, vpp=2, schedule="zbv", num_micro_batches=8, recompute="full"),
    ]),
    ("qwen3-30b-a3b", 64, [
        dict(dp=16, ep=8, pp=4, num_micro_batches=8, recompute="full"),
        dict(dp=16, ep=8, pp=4, num_micro_batches=16, recompute="none"),
    ]),
])
def test_bound_is_below_every_balanced_plan_and_uniform_is_the_balancers(name, devices, strategies):
    model = get_preset(name)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=devices)
    items = [Strategy(**s, seq_length=4096, global_batch_size=s["dp"] * s["num_micro_batches"], precision=PRECISION)
             for s in strategies]
    runtime = MemoryOptions().time_keywords()  # build_problem's runtime
    assert runtime["weight_grad_rebuilds"]
    lower, uniform = composed_bounds(model, StrategyBatch.of(items), cluster, **runtime)
    for strategy, low, uni in zip(items, lower, uniform, strict=True):
        for limit in (1e15, 70 * 2**30):
            problem = build_problem(model, strategy, cluster, limit, MemoryOptions())
            assert uni == pytest.approx(evaluate(problem, uniform_plan(problem, strategy.recompute)).step_s, rel=1e-9)
            found = solve_exact(problem)
            if found is not None:
                assert low <= found[1].step_s * (1 + 1e-12)
        assert 0 < low < uni
    assert np.all(lower > 0)
