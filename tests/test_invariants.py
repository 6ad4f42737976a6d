"""What every estimate must satisfy, whatever the strategy: checked on random valid strategies.

A sweep of this kind found, in the twelfth session, breakdowns by layer kind that fell short of
their stage totals (the whole embedding gradient, the stage outputs torch pipelining keeps, the
bytes activation offload moves) and a negative comm figure; each has its own test too.
"""

from __future__ import annotations

import math
import random

import pytest

from ndplan.errors import NdplanError
from ndplan.hardware import Cluster, get_device
from ndplan.memory import MemoryOptions, estimate
from ndplan.model import get_preset
from ndplan.perf import estimate_time
from ndplan.strategy import Strategy, check_strategy, get_precision

MODELS = ("llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b", "qwen2.5-7b")
DEVICE = get_device("h100-sxm")
OFFLOAD = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj")


def _random_strategies(seed: int, wanted: int) -> list[tuple[str, str, Strategy]]:
    """``wanted`` (model, runtime, strategy) triples that validate, drawn over every dimension."""
    rng = random.Random(seed)
    found: list[tuple[str, str, Strategy]] = []
    while len(found) < wanted:
        name = rng.choice(MODELS)
        model = get_preset(name)
        runtime = rng.choice(["pytorch", "megatron"])
        settings = dict(tp=rng.choice([1, 2, 4, 8]), pp=rng.choice([1, 2, 4]), dp=rng.choice([1, 2, 4, 8]),
                        cp=rng.choice([1, 1, 2]), micro_batch_size=rng.choice([1, 2]),
                        num_micro_batches=rng.choice([1, 2, 4, 8, 16]), seq_length=rng.choice([2048, 4096]),
                        zero=rng.choice([0, 1, 2, 3]), recompute=rng.choice(["none", "selective", "full"]),
                        sequence_parallel=rng.choice([False, True]))
        if model.is_moe:
            settings["ep"] = rng.choice([1, 2, 4, 8])
        if settings["zero"] == 3:
            settings["fsdp"] = rng.choice([True, False])
        if settings["pp"] > 1:
            settings["schedule"] = rng.choice(["1f1b", "interleaved", "zbv", "dualpipev", "gpipe", "1f1b"])
            if settings["schedule"] in ("interleaved", "zbv", "dualpipev"):
                settings["vpp"] = 2
        if settings["cp"] > 1:
            settings["cp_kind"] = rng.choice(["ring", "ulysses"])
        if runtime == "megatron" and rng.random() < 0.4:
            settings["offload_modules"] = tuple(rng.sample(OFFLOAD, rng.randint(1, 3)))
        if runtime == "megatron" and settings["recompute"] == "selective" and rng.random() < 0.5:
            settings["recompute_modules"] = tuple(rng.sample(RECOMPUTE_MODULES, rng.randint(1, 2)))
        precision = get_precision("megatron-bf16" if runtime == "megatron" else "fsdp-bf16")
        try:
            strategy = Strategy(**settings, precision=precision)
        except (NdplanError, ValueError):  # pydantic's errors are ValueErrors: pairs a Strategy refuses
            continue
        if check_strategy(strategy, model, strategy.world_size):
            continue
        found.append((name, runtime, strategy))
    return found


@pytest.mark.parametrize("seed", [1, 2])
def test_every_estimate_adds_up(seed: int) -> None:
    for name, runtime, strategy in _random_strategies(seed, 30):
        model, options = get_preset(name), MemoryOptions(runtime=runtime)
        try:
            memory = estimate(model, strategy, DEVICE, options, num_devices=strategy.world_size)
            time = estimate_time(model, strategy, Cluster(device=DEVICE, num_devices=strategy.world_size),
                                 **options.time_keywords())
        except NdplanError:  # a census or runtime that refuses the combination says so
            continue
        where = f"{name} {runtime} {strategy.short()}"
        for stage in memory.stages:
            static = stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes
            assert math.isclose(sum(stage.static_by_kind.values()), static, rel_tol=1e-9, abs_tol=1), where
            assert math.isclose(sum(stage.activations_by_kind.values()), stage.activations_bytes,
                                rel_tol=1e-9, abs_tol=1), where
            for value in (stage.params_bytes, stage.grads_bytes, stage.optimizer_bytes, stage.activations_bytes,
                          stage.comm_bytes, stage.transient_bytes):
                assert value >= 0, where
            assert math.isclose(stage.allocated_bytes, max(stage.forward_backward_bytes,
                                                           static + stage.optimizer_step_bytes), rel_tol=1e-9), where
            assert stage.peak_bytes >= stage.allocated_bytes, where
        parts = time.breakdown
        total = parts["compute"] + sum(parts["comm_exposed"].values()) + parts["bubble"] + parts["optimizer"]
        assert math.isclose(total, time.step_s, rel_tol=1e-9), where
        tokens = strategy.global_batch_size * strategy.seq_length
        assert math.isclose(time.tokens_per_s, tokens / time.step_s, rel_tol=1e-9), where
        assert 0 < time.mfu <= time.hfu + 1e-12 and time.mfu <= 1, where
        assert memory.explain() and time.explain(), where
