"""The balancer's stage memory against the full estimator of the written plan, where recompute
grows with the layers a stage recomputes (docs/balance.md, "The problem in numbers")."""

from __future__ import annotations

import numpy as np
import pytest

from ndplan.balance import build_problem, evaluate
from ndplan.balance.build import _leading_layers_plan, plan_stage_bytes
from ndplan.hardware import Cluster, get_device
from ndplan.memory.options import MemoryOptions
from ndplan.model import get_preset
from ndplan.strategy import Strategy

GIB = 2**30


def _both(name: str, runtime: str, modules: tuple[str, ...] | None, layers: tuple[int, ...], option: str, k: int,
          **fields: object) -> tuple[np.ndarray, np.ndarray]:
    model, strategy, options = get_preset(name), Strategy(**fields), MemoryOptions(runtime=runtime)
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=strategy.world_size)
    problem = build_problem(model, strategy, cluster, 80 * GIB, options, modules)
    plan = _leading_layers_plan(layers, option, k)
    return evaluate(problem, plan).stage_memory_bytes, plan_stage_bytes(model, strategy, plan, options, modules)


LLAMA_8B_ZBH1 = dict(dp=2, tp=2, sequence_parallel=True, pp=4, schedule="zb-h1", num_micro_batches=32)
MIXTRAL_DUALPIPEV = dict(dp=8, tp=2, sequence_parallel=True, pp=4, vpp=2, schedule="dualpipev", ep=8, zero=1,
                         num_micro_batches=16)
LLAMA_70B_DUALPIPEV = dict(dp=2, tp=8, sequence_parallel=True, pp=4, vpp=2, schedule="dualpipev", zero=1,
                           num_micro_batches=16)


def test_one_recomputed_layer_per_chunk_under_a_split_backward() -> None:
    """ZB-H1 under PyTorch, full recompute on one layer per stage: the weight-gradient step's
    rebuilt copies grow with the recomputed layers, so the transient of every layer recomputing
    over-stated it (48.77 GiB on stage 1 against the estimator's 35.37). Now per recomputed layer:
    within 0.1% on every stage but the last (the head's, over by 3.8%: conservative)."""
    balancer, estimator = _both("llama-3.1-8b", "pytorch", None, (8,) * 4, "full", 1, **LLAMA_8B_ZBH1)
    assert np.allclose(balancer[:3], estimator[:3], rtol=1e-3)
    assert (balancer >= estimator * (1 - 1e-6)).all() and (balancer <= estimator * 1.05).all()


@pytest.mark.parametrize(("name", "fields"), [
    ("mixtral-8x7b", MIXTRAL_DUALPIPEV),
    ("llama-3.1-8b", dict(dp=2, tp=2, sequence_parallel=True, pp=4, vpp=2, schedule="dualpipev", num_micro_batches=32)),
])
def test_a_stage_left_with_two_layers_under_full_recompute(name: str, fields: dict[str, object]) -> None:
    """DualPipeV, full recompute, stage 1 left with one layer in each chunk: the rebuilt layer's
    working set is held once however few layers recompute. Priced per layer it read 5.991 GiB
    against the estimator's 6.366 on Mixtral (−5.9%; Llama-3.1-8B 5.388 against 5.585, −3.5%);
    now a constant per stage: exact there, and on the stages that took its layers."""
    balancer, estimator = _both(name, "megatron", None, (4, 1, 5, 5, 5, 5, 1, 6), "full", 0, **fields)
    assert np.allclose(balancer[1:], estimator[1:], rtol=1e-6)
    assert balancer[0] >= estimator[0] * 0.975  # the first and last chunks' stage: the peak's row moves


def test_uniform_selective_on_a_v_schedule() -> None:
    """Mixtral DualPipeV under Megatron, selective recompute on every layer: the selective
    option no longer pays full recompute's transient (25.20 GiB against 22.46); exact."""
    balancer, estimator = _both("mixtral-8x7b", "megatron", ("layernorm", "moe"), (4,) * 8, "selective", 0,
                                **MIXTRAL_DUALPIPEV)
    assert np.allclose(balancer, estimator, rtol=1e-6)


def test_a_longer_chunk_under_full_recompute_is_seen() -> None:
    """Llama-3.1-70B DualPipeV, full recompute, a chunk one layer longer than uniform: its
    rebuilt copies grow, which a per-stage constant missed (41.76 GiB against 43.00). Per
    recomputed layer of the stage, 42.41 (−1.4%; stage 3, whose chunk is one shorter, 40.25
    against 40.84): the estimator's copies grow with the stage's longest chunk, 1.16 GiB a layer
    (``build.chunk_copy_bytes``). Priced at the longest chunk (``recompute_chunk_bytes``):
    42.99 and 40.84, within 0.05%."""
    balancer, estimator = _both("llama-3.1-70b", "pytorch", None, (10, 10, 10, 9, 10, 10, 11, 10), "full", 0,
                                **LLAMA_70B_DUALPIPEV)
    assert balancer[1] > 42.9 * GIB  # the repro's limit: the plan no longer looks as if it fits
    assert np.allclose(balancer, estimator, rtol=1e-3)


def test_short_chunks_beside_a_long_one_under_zbv() -> None:
    """Llama-3.1-8B ZB-V under PyTorch, full recompute, stage 3 left with chunks of 2 and 1
    layers: the W step of its 2-layer chunk holds 2 copies (2.36 GiB each), where per recomputed
    layer of the stage (half a chunk's copies at uniform, 4 + 4 layers) it read 1.5: 15.88 GiB
    against the estimator's 17.16 (−7.5%). Priced at the longest chunk, 17.06 (−0.6%, what is
    left reads as low with no recompute). Stage 2 (chunks of 5 and 6 layers) now reads 48.80
    against 47.65 (+2.4%, was −0.06%): the 5-layer chunk's step instant holds less than the
    peak, so its longest chunk's copies raise the peak less than they are (conservative). Both
    later rose by the 32 input gradients ZB-V's B's leave on stage 3's receiving chunk (0.53
    GiB): 17.59 against 17.69, 49.88 against 48.70."""
    fields = dict(dp=2, tp=2, sequence_parallel=True, pp=4, vpp=2, schedule="zbv", num_micro_batches=32)
    balancer, estimator = _both("llama-3.1-8b", "pytorch", None, (5, 6, 5, 2, 1, 6, 6, 1), "full", 0, **fields)
    assert balancer[3] == pytest.approx(17.59 * GIB, rel=1e-3)
    assert balancer[3] >= estimator[3] * 0.99
    assert balancer[2] >= estimator[2]


@pytest.mark.parametrize("option", ["none", "full"])
def test_uniform_plans_stay_exact(option: str) -> None:
    balancer, estimator = _both("llama-3.1-70b", "pytorch", None, (10,) * 8, option, 0, **LLAMA_70B_DUALPIPEV)
    assert np.allclose(balancer, estimator, rtol=1e-9)
