"""Launches that add their weight gradients apart though Megatron fuses the accumulation by
default (``ndplan.perf.accumulation``): which ones, and that a search, one estimate and the
written launch read back price them alike."""

from __future__ import annotations

import json

import pytest

from ndplan.cli import main
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.memory.options import MemoryOptions
from ndplan.model import get_preset
from ndplan.perf import default_efficiency, estimate_time
from ndplan.perf.accumulation import (
    FUSED,
    MEGATRON_FSDP_EXPERT_DP,
    MEGATRON_FSDP_NPU,
    TORCH_FSDP2,
    launch_efficiency,
    strategy_code,
)
from ndplan.perf.step import evaluate
from ndplan.strategy import Strategy, StrategyBatch

LLAMA = get_preset("llama-3.1-8b")
QWEN_MOE = get_preset("qwen3-30b-a3b")
BATCH = {"micro_batch_size": 1, "num_micro_batches": 4, "seq_length": 4096}
FSDP2 = Strategy(dp=8, zero=3, fsdp=True, reshard_after_forward=False, **BATCH)
MEGATRON_FSDP = Strategy(dp=8, zero=3, fsdp=True, **BATCH)
ZERO1 = Strategy(dp=8, zero=1, **BATCH)


@pytest.mark.parametrize(("model", "strategy", "npu", "code"), [
    (LLAMA, ZERO1, False, FUSED),
    (LLAMA, MEGATRON_FSDP, False, FUSED),  # dense, on GPUs
    (LLAMA, FSDP2, False, TORCH_FSDP2),  # validate_args refuses torch FSDP2 with the fusion
    (LLAMA, FSDP2, True, TORCH_FSDP2),
    # where Megatron cannot run torch FSDP2, Megatron-FSDP (dense, GPUs: fused)
    (LLAMA.model_copy(update={"tie_word_embeddings": True}), FSDP2, False, FUSED),
    (LLAMA, FSDP2.model_copy(update={"precision": "megatron-fp16"}), False, FUSED),
    (LLAMA, FSDP2.model_copy(update={"shard_group": 4}), False, FUSED),
    (LLAMA, FSDP2.model_copy(update={"pp": 2, "dp": 4}), False, FUSED),
    # MindSpeed's Megatron-FSDP, ZeRO-2 and ZeRO-3
    (LLAMA, MEGATRON_FSDP, True, MEGATRON_FSDP_NPU),
    (LLAMA, Strategy(dp=8, zero=2, **BATCH), True, MEGATRON_FSDP_NPU),
    (LLAMA, ZERO1, True, FUSED),
    # experts: Megatron-FSDP beside expert data parallelism (dp·cp·tp / (ep·etp) ranks)
    (QWEN_MOE, Strategy(dp=16, ep=8, zero=3, fsdp=True, **BATCH), False, MEGATRON_FSDP_EXPERT_DP),  # 2 ranks
    (QWEN_MOE, Strategy(dp=16, ep=8, zero=2, **BATCH), False, MEGATRON_FSDP_EXPERT_DP),
    (QWEN_MOE, Strategy(dp=8, ep=8, zero=3, fsdp=True, **BATCH), False, FUSED),  # 1 rank
    (QWEN_MOE, Strategy(dp=8, ep=4, etp=2, tp=2, sequence_parallel=True, zero=3, fsdp=True, **BATCH), False,
     MEGATRON_FSDP_EXPERT_DP),  # 8·2 / (4·2) = 2 ranks
    (QWEN_MOE, Strategy(dp=16, ep=8, zero=1, **BATCH), False, FUSED),
    (QWEN_MOE, Strategy(dp=16, ep=8, zero=3, fsdp=True, reshard_after_forward=False, **BATCH), False,
     MEGATRON_FSDP_EXPERT_DP),  # experts: no torch FSDP2
])
def test_which_megatron_launches_run_without_the_fusion(model, strategy, npu, code) -> None:
    fp16 = strategy.precision == "megatron-fp16"
    assert strategy_code(model, strategy, fp16, npu) == code


def _step(strategies: list[Strategy], options: MemoryOptions, devices: int = 8):
    keywords = options.time_keywords()
    return evaluate(LLAMA, StrategyBatch.of(strategies), Cluster(device=get_device("h100-sxm"), num_devices=devices),
                    pipeline="simulate", details=True, weight_grad_rebuilds=keywords["weight_grad_rebuilds"],
                    software=keywords["software"], overlap=keywords["overlap"])


def test_a_batch_prices_each_row_as_its_own_launch() -> None:
    """In one batch (a search's), the torch FSDP2 row is priced as the same strategy launched
    without the fusion, and the other rows as they were (fused): each as its estimate alone,
    whose efficiency says the fusion is off and why."""
    megatron = MemoryOptions(runtime="megatron")
    rows = [FSDP2, MEGATRON_FSDP, ZERO1]
    together = _step(rows, megatron)["step_s"]
    for i, strategy in enumerate(rows):
        alone = estimate_time(LLAMA, strategy, get_device("h100-sxm"), options=megatron)
        assert together[i] == pytest.approx(alone.step_s, rel=1e-12)
        assert alone.efficiency.gradient_accumulation_fusion is (strategy is not FSDP2)
    unfused = estimate_time(LLAMA, FSDP2, get_device("h100-sxm"),
                            options=MemoryOptions(runtime="megatron", gradient_accumulation_fusion=False))
    assert together[0] == pytest.approx(unfused.step_s, rel=1e-12)
    fused = estimate_time(LLAMA, MEGATRON_FSDP, get_device("h100-sxm"), options=MemoryOptions(runtime="pytorch"))
    assert fused.efficiency.gradient_accumulation_fusion  # no rules: the pytorch runtime's own
    _, why = launch_efficiency(default_efficiency(get_device("h100-sxm")).replace(
        gradient_accumulation_rules="megatron"), LLAMA, FSDP2)
    assert why == "Megatron runs this FSDP as torch FSDP2, which validate_args refuses beside gradient-accumulation fusion"


def test_the_forced_adds_cost_what_the_flag_costs() -> None:
    """Llama-3.1-8B, torch FSDP2 over 8 H100s, 4 micro-batches of 4,096 tokens (compute-bound
    GEMMs): the rules add 4 · 10 B · (the linear weights, whole under FSDP) / (HBM · 0.8) of
    compute a step (bf16 gradients written, fp32 buffers read and written), against the same
    strategy priced fused."""
    h, kv, f = LLAMA.hidden_size, LLAMA.num_kv_heads * LLAMA.head_dim, LLAMA.ffn_hidden_size
    linear = LLAMA.num_layers * (2 * h * h + 2 * h * kv + 3 * h * f) + LLAMA.vocab_size * h
    device = get_device("h100-sxm")
    hbm = device.hbm_bandwidth_bytes_per_s * default_efficiency(device).hbm_efficiency
    ruled = _step([FSDP2], MemoryOptions(runtime="megatron"))
    fused = _step([FSDP2], MemoryOptions(runtime="megatron", gradient_accumulation_fusion=True))
    # (a stated fusion is the launch's: still refused for torch FSDP2, the rules still apply)
    assert ruled["compute_s"][0] == fused["compute_s"][0]
    keywords = MemoryOptions(runtime="megatron").time_keywords()
    no_rules = evaluate(LLAMA, StrategyBatch.of(FSDP2), Cluster(device=device, num_devices=8), pipeline="simulate",
                        software={**keywords["software"], "gradient_accumulation_rules": None},
                        overlap=keywords["overlap"])
    assert ruled["compute_s"][0] - no_rules["compute_s"][0] == pytest.approx(4 * 10 * linear / hbm, rel=1e-6)
    assert ruled["step_s"][0] > no_rules["step_s"][0]


def test_a_search_prices_its_launch_as_written(capsys) -> None:
    """A Megatron search of Qwen3-30B-A3B with Megatron-FSDP over EP 8 and 16 H100s (2 expert
    data-parallel ranks) writes --no-gradient-accumulation-fusion, and the launch read back costs
    what the plan was ranked at: the read-back check finds nothing different (before, the search
    priced the fused accumulation and the check listed the fusion, 1.808 s ranked, 1.826 s read back)."""
    assert main(["search", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64",
                 "--seq", "4096", "--fix", "zero=3", "ep=8", "tp=1", "pp=1", "cp=1", "--runtime", "megatron",
                 "--top", "3", "--emit", "megatron", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert "    --no-gradient-accumulation-fusion" in found["emitted"]
    assert "as the megatron runtime prices such a plan" in found["emitted"]
    n = len(found["ranked"])  # all Megatron-FSDP over EP 8 beside 2+ expert data-parallel ranks
    assert any(note.startswith(f"{n} of the {n} ranked plans are priced with each weight gradient added to its buffer by "
                               "a kernel of its own") for note in found["notes"]), found["notes"]
    check, ranked = found["emitted_check"], found["ranked"][found["emitted_rank"] - 1]
    assert check["same"] is True and check["differs"] == []
    assert check["step_s"] == pytest.approx(ranked["step_s"], rel=1e-12)


def test_estimate_says_why_its_launch_adds_apart(capsys) -> None:
    base = ["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32",
            "--seq", "4096", "--zero", "3", "--runtime", "megatron"]
    assert main([*base, "--no-reshard"]) == 0
    out = capsys.readouterr().out
    assert ("weight gradients added to their buffers by a kernel of their own after the GEMM (priced): Megatron runs "
            "this FSDP as torch FSDP2") in out
    assert main([*base, "--no-reshard", "--json"]) == 0
    time = json.loads(capsys.readouterr().out)["time"]
    assert time["gradient_accumulation_fusion"] is False and "torch FSDP2" in time["unfused_why"]
    assert main([*base, "--json"]) == 0  # Megatron-FSDP, dense, on GPUs: fused
    time = json.loads(capsys.readouterr().out)["time"]
    assert time["gradient_accumulation_fusion"] is True and "unfused_why" not in time


def test_the_report_notes_why_its_launch_adds_apart(tmp_path, capsys) -> None:
    out = tmp_path / "report.html"
    assert main(["report", "-o", str(out), "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8",
                 "--gbs", "32", "--seq", "4096", "--zero", "3", "--no-reshard", "--runtime", "megatron"]) == 0
    capsys.readouterr()
    assert ("weight gradients added to their buffers by a kernel of their own after the GEMM (priced): Megatron runs "
            "this FSDP as torch FSDP2") in out.read_text()


def test_balance_says_why_its_launch_adds_apart(capsys) -> None:
    """Megatron-FSDP over EP 8 and 16 data-parallel ranks (2 expert data-parallel ranks), pp 2."""
    assert main(["balance", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "32", "--gbs", "64",
                 "--seq", "4096", "--dp", "16", "--ep", "8", "--pp", "2", "--zero", "3", "--runtime", "megatron"]) == 0
    assert ("weight gradients added to their buffers by a kernel of their own after the GEMM (priced): Megatron-Core's "
            "Megatron-FSDP refuses gradient-accumulation fusion beside expert data parallelism (2 ranks)"
            ) in " ".join(capsys.readouterr().out.split())
