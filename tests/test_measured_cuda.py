"""The estimator against real training steps measured on an NVIDIA H200.

tests/data/measured/cuda holds, per case of benchmarks/accuracy/cuda_steps.py, a real one-GPU step
(``ndplan measure --backend cuda``: torch.cuda.max_memory_allocated/reserved; torch 2.11,
transformers 5.24, CUDA 13) and, for 17 of the cases, the same step on fake tensors
(``--backend fake``). These tests read the files; none needs a GPU.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from ndplan.census.measurement import load_measurement
from ndplan.census.verify import verify
from ndplan.errors import NdplanError
from ndplan.model import load_model
from ndplan.strategy import Strategy

DATA = Path(__file__).parent / "data" / "measured" / "cuda"
REAL = sorted(DATA.glob("*-cuda.json"))
MiB = 2**20

#: Cases whose attention materialises the s x s scores: fp32 with grouped KV heads (SDPA's math
#: path) and eager attention. CUDA's softmax backward keeps a temporary product beside its output
#: there, which fake tensors do not see (benchmarks/accuracy/cuda_probe.py's allocator record).
FP32_GQA = "llama8b-s4k-fp32"
SCORES = {FP32_GQA: 32, "llama8b-s4k-eager": 32, "llama8b-s8k-eager-full": 32}  # case -> heads


def _case(path: Path) -> str:
    return path.name.rsplit("-", 1)[0]


def _verified(path: Path):
    measurement = load_measurement(path)
    return verify(load_model(measurement.model), measurement)


def _error(result, key: str) -> float:
    row = result.stages[0].row(key)
    assert row is not None and row.error_pct is not None
    return row.error_pct


def test_the_data_is_there():
    assert len(REAL) == 28
    assert len(list(DATA.glob("*-fake.json"))) == 28


@pytest.mark.parametrize("path", REAL, ids=_case)
def test_peak_allocated_of_a_real_step_within_one_percent(path):
    # Before the sliding-window mask was priced, Mistral at 8k/16k tokens missed by -4.1/-7.8%;
    # before the cuBLAS workspace, every case was ~64 MiB short; before the attention backward's
    # working set where the scores are materialised, fp32 GQA read -5.0% and eager attention under
    # full recompute at 8k -37.9%.
    assert abs(_error(_verified(path), "allocated")) <= 1.0


@pytest.mark.parametrize("path", sorted(DATA.glob("*-fake.json")), ids=_case)
def test_the_same_steps_on_fake_tensors_within_one_percent(path):
    # verify compares a fake step without what fake kernels never allocate (cuBLAS's workspace,
    # CUDA softmax's backward product), as `--no-overhead` prices it
    assert abs(_error(_verified(path), "allocated")) <= 1.0


def test_real_steps_median_error_is_a_tenth_of_a_percent():
    errors = [abs(_error(_verified(p), "allocated")) for p in REAL]
    assert statistics.median(errors) <= 0.1


def test_fp32_grouped_heads_probabilities_and_their_backward_priced():
    result = _verified(DATA / f"{FP32_GQA}-cuda.json")
    assert abs(_error(result, "activations")) <= 0.1  # 2 GiB of fp32 probabilities per layer
    # The peak is the last layer's attention backward: the probabilities' gradient, softmax's
    # gradient and CUDA's temporary product, 3 x 2 GiB, beside the head's and MLP's gradients.
    assert abs(_error(result, "allocated")) <= 0.3


@pytest.mark.parametrize("case", ["gpt-oss-20b-s2k-eager", "llama8b-s4k-eager"])
def test_eager_attention_activations_as_measured(case):
    """What eager steps keep on an H200, priced from census-checked formulas: K and V repeated to
    every query head, no log-sum-exp; gpt-oss's bf16 softmax over its sink column, its clamped
    SwiGLU's three more tensors a routed copy, its fp32 norm products. gpt-oss read +45% and Llama
    -0.98% before (the forty-seventh session)."""
    assert abs(_error(_verified(DATA / f"{case}-cuda.json"), "activations")) <= 0.1


@pytest.mark.parametrize("path", [p for p in REAL if load_measurement(p).num_layers >= 12], ids=_case)
def test_reserved_at_depth_within_five_percent(path):
    # Whole models (12-36 layers): the allocator kept 0.5-7% beyond allocated; the profile's slack is 5%.
    assert abs(_error(_verified(path), "reserved")) <= 5.0


def test_fake_step_sees_everything_but_the_workspace():
    """Each real step allocated the fake step's bytes plus cuBLAS's 64 MiB workspace (within
    512-byte block rounding and, for MLA, what the memory-efficient kernel takes besides its
    outputs: 36 MiB at two layers, 103 MiB at twelve under full recompute); where the scores are
    materialised, at most CUDA softmax's temporary product more (heads·s² fp32)."""
    for fake_path in sorted(DATA.glob("*-fake.json")):
        case = _case(fake_path)
        fake, real = load_measurement(fake_path), load_measurement(DATA / f"{case}-cuda.json")
        assert fake.on_fake_tensors and not real.on_fake_tensors
        fake_rank, real_rank = fake.ranks[0], real.ranks[0]
        assert real_rank.categories["activations"] == pytest.approx(fake_rank.categories["activations"], rel=0.012)
        extra = real_rank.allocated_bytes - fake_rank.allocated_bytes
        product = SCORES.get(case, 0) * real.strategy.seq_length**2 * 4
        kernel = 110 * MiB if real.model == "deepseek-v2-lite" else 36 * MiB
        assert 63 * MiB <= extra <= 64 * MiB + kernel + product, case


def test_verify_adds_the_workspace_only_for_real_steps():
    real = load_measurement(DATA / "llama8b-s4k-cuda.json")
    fake = load_measurement(DATA / "llama8b-s4k-fake.json")
    model = load_model(real.model)
    for_real = verify(model, real).stages[0].row("allocated")
    for_fake = verify(model, fake).stages[0].row("allocated")
    assert for_real is not None and for_fake is not None
    assert for_real.estimate - for_fake.estimate == 64 * MiB


def test_cuda_backend_refuses_what_one_gpu_cannot_run():
    from ndplan.census.measure_cuda import check_single_device

    with pytest.raises(NdplanError, match=r"runs one GPU: tp=2 needs --backend fake"):
        check_single_device(Strategy(tp=2))
    with pytest.raises(NdplanError, match=r"precision must be one of bf16-pure, fp32, got 'fsdp-bf16'"):
        check_single_device(Strategy(precision="fsdp-bf16"))
    check_single_device(Strategy(precision="fp32"))


def test_checkpoints_keep_the_boolean_sliding_mask_once_per_micro_batch():
    """Under recompute the sliding layers' bias and repeated K/V are rebuilt, but each chunk's
    checkpoints keep the boolean mask they were given: mbs·s² bytes per micro-batch in flight
    (the real Mistral step at 8k with selective recompute read -0.76% before it was priced)."""
    from ndplan.memory import MemoryOptions, estimate

    mistral = load_model("mistral-7b")
    for recompute, expected in (("selective", 8192**2), ("full", 8192**2), ("none", None)):
        strategy = Strategy(seq_length=8192, recompute=recompute)
        sdpa, flash = (estimate(mistral, strategy, None, MemoryOptions(attention=a, include_overhead=False))
                       for a in ("sdpa", "flash"))
        extra = sdpa.stages[0].activations_bytes - flash.stages[0].activations_bytes
        if expected is not None:
            assert extra == expected
        else:  # without recompute the layers keep their bias and repeated K/V instead: 224 MiB a layer
            assert extra == 32 * 224 * MiB
    result = _verified(DATA / "mistral-s8k-sel-cuda.json")
    assert abs(_error(result, "allocated")) <= 0.1


def test_estimate_names_the_per_stage_sliding_share_gap():
    from ndplan.memory import MemoryOptions
    from ndplan.memory.report import known_gaps
    from ndplan.model import spec_from_hf_config

    qwen = spec_from_hf_config({"model_type": "qwen2", "num_hidden_layers": 8, "hidden_size": 64,
                                "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 100, "use_sliding_window": True, "sliding_window": 16,
                                "max_window_layers": 4}, name="q")
    sdpa = MemoryOptions(attention="sdpa")
    pipelined = Strategy(pp=2, seq_length=32, num_micro_batches=2, global_batch_size=2)
    assert any("not per stage" in gap for gap in known_gaps(pipelined, sdpa, qwen))
    assert not any("not per stage" in gap for gap in known_gaps(Strategy(seq_length=32), sdpa, qwen))
    assert not any("not per stage" in gap for gap in known_gaps(pipelined, MemoryOptions(), qwen))
    assert not any("not per stage" in gap for gap in known_gaps(pipelined, sdpa, load_model("mistral-7b")))


def test_the_generated_page_is_current(tmp_path):
    """docs/accuracy_cuda.md is cuda_steps.py's report of these files: a change to the estimator
    that moves a figure must regenerate it (a review found Mixtral's fwd/bwd row stale by 5 points)."""
    import importlib.util

    script = Path(__file__).parents[1] / "benchmarks" / "accuracy" / "cuda_steps.py"
    spec = importlib.util.spec_from_file_location("cuda_steps", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = tmp_path / "accuracy_cuda.md"
    module.report(DATA, page)
    assert page.read_text() == (Path(__file__).parents[1] / "docs" / "accuracy_cuda.md").read_text()


@pytest.mark.parametrize("path", sorted(DATA.glob("*-fake.json")), ids=_case)
def test_the_allocator_replay_of_each_fake_step_within_three_percent_of_the_measured_reserved(path):
    """The fake step's allocations replayed through the caching allocator (ndplan.census.allocator)
    reach the reserved peak the real step measured: -1.5% to +2.9% over the 28 cases, where the
    estimate's fixed 5% slack reads -15% to +4.5% (docs/accuracy_cuda.md)."""
    replayed = load_measurement(path).ranks[0].replayed_reserved_bytes
    measured = load_measurement(DATA / f"{_case(path)}-cuda.json").ranks[0].reserved_bytes
    assert replayed is not None and measured is not None
    assert abs(replayed / measured - 1) <= 0.03
