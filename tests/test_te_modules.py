"""NeMo AutoModel's Transformer Engine modules (``MemoryOptions.modules`` 'te') against the
pytorch profile's eager ones: what a norm and a MoE block keep for backward, hand-derived."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.memory import MemoryOptions, estimate
from ndplan.memory.profile import block_coefficients, get_profile
from ndplan.model import get_preset
from ndplan.strategy import Strategy

PYTORCH = get_profile("pytorch")
SHIPPED_CENSUS = str(Path(__file__).resolve().parents[1] / "src" / "ndplan" / "memory" / "census" / "qwen3-30b-a3b.json")


def _per_token(model_name: str, block: str, modules: str) -> float:
    """Bytes a token keeps in one block at TP 1 (every shard rule undivided), bf16 activations."""
    table = block_coefficients(get_preset(model_name), PYTORCH, 2, modules=modules)[block]
    return sum(table.base.values())


@pytest.mark.parametrize("model_name,eager,te", [
    # Llama-style norm (casts, then multiplies): an fp32 copy of the input (4h), the inverse RMS
    # (4) and the bf16 normalised input (2h), against TE's bf16 input (2h) and inverse RMS (4).
    ("qwen3-30b-a3b", 4 * 2048 + 4 + 2 * 2048, 2 * 2048 + 4),
    # gpt-oss's norm multiplies in fp32 first: its normalised input is kept in fp32 (4h).
    ("gpt-oss-20b", 4 * 2880 + 4 + 4 * 2880, 2 * 2880 + 4),
])
def test_a_te_norm_keeps_its_bf16_input_and_one_statistic(model_name, eager, te):
    assert _per_token(model_name, "norm", "eager") == eager
    assert _per_token(model_name, "norm", "te") == te


@pytest.mark.parametrize("model_name,saved", [
    # Qwen3-30B-A3B (h 2048, experts 768 wide, top-8, bf16 routing weights): the eager block also
    # keeps SiLU's output (8·768·2), the experts' outputs it weighs (8·2048·2) and the gathered
    # bf16 weights (8·2); the fused activation keeps the fp32 probabilities instead (8·4).
    ("qwen3-30b-a3b", 8 * 768 * 2 + 8 * 2048 * 2 + 8 * 2 - 8 * 4),
    # gpt-oss-20b (h 2880, experts 2880 wide, top-4): its clamped SwiGLU's three more tensors too.
    ("gpt-oss-20b", 4 * 2880 * 2 * (1 + 3) + 4 * 2880 * 2 + 4 * 2 - 4 * 4),
])
def test_weighted_experts_keep_the_activation_input_and_fp32_probabilities(model_name, saved):
    assert _per_token(model_name, "moe", "eager") - _per_token(model_name, "moe", "te") == saved


def test_te_modules_lower_gpt_oss_peak_by_what_its_layers_keep():
    """gpt-oss-20b on 8 GPUs, EP 8, FSDP, no recompute, one micro-batch of 2 x 4096 in flight:
    every layer's difference (two norms and the MoE block), times the tokens and layers."""
    model = get_preset("gpt-oss-20b")
    strategy = Strategy(dp=8, ep=8, zero=3, fsdp=True, micro_batch_size=2, num_micro_batches=1, seq_length=4096,
                        precision="bf16-pure")
    eager = estimate(model, strategy, "h100-sxm", MemoryOptions(include_overhead=False)).stages[0]
    te = estimate(model, strategy, "h100-sxm", MemoryOptions(include_overhead=False, modules="te")).stages[0]
    per_layer = 2 * (_per_token("gpt-oss-20b", "norm", "eager") - _per_token("gpt-oss-20b", "norm", "te")) + (
        _per_token("gpt-oss-20b", "moe", "eager") - _per_token("gpt-oss-20b", "moe", "te"))
    assert eager.params_bytes == te.params_bytes and eager.comm_bytes == te.comm_bytes
    # (the final norm's difference too: one more norm on the last stage)
    expected = 2 * 4096 * (model.num_layers * per_layer + _per_token("gpt-oss-20b", "norm", "eager")
                           - _per_token("gpt-oss-20b", "norm", "te"))
    assert eager.activations_bytes - te.activations_bytes == pytest.approx(expected, rel=1e-12)


def test_modules_are_refused_where_the_runtime_describes_its_own():
    with pytest.raises(NdplanError, match="runtime 'megatron' describes its own modules"):
        MemoryOptions(runtime="megatron", modules="te")
    with pytest.raises(NdplanError, match="modules must be one of eager, te, got 'apex'"):
        MemoryOptions(modules="apex")  # type: ignore[arg-type]
    with pytest.raises(NdplanError, match="a census measures the modules it ran"):
        MemoryOptions(modules="te", census=SHIPPED_CENSUS)


def test_the_flag_reaches_the_estimate_and_its_json(capsys):
    args = ["estimate", "--model", "gpt-oss-20b", "--hardware", "h100-sxm", "--devices", "8", "--ep", "8",
            "--zero", "3", "--fsdp", "--mbs", "2", "--seq", "4096", "--json"]
    assert main(args) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*args, "--modules", "te"]) == 0
    te = json.loads(capsys.readouterr().out)
    assert eager["modules"] == "eager" and te["modules"] == "te"
    assert te["peak_bytes"] < eager["peak_bytes"]
    assert te["time"]["step_s"] == eager["time"]["step_s"]  # memory alone
    assert main([*args, "--modules", "te", "--runtime", "megatron"]) != 0
    assert "describes its own modules" in capsys.readouterr().err


def test_explain_says_which_modules_it_priced(capsys):
    args = ["estimate", "--model", "gpt-oss-20b", "--hardware", "h100-sxm", "--devices", "8", "--ep", "8",
            "--zero", "3", "--fsdp", "--mbs", "2", "--seq", "4096", "--explain"]
    assert main([*args, "--modules", "te"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Transformer Engine's norms and weighted experts" in out
    assert "modules te: in memory, Transformer Engine's RMSNorm" in out
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Transformer Engine's norms" not in out and "modules te" not in out


def test_a_report_of_the_estimate_reproduces_the_modules(capsys):
    """The estimate's JSON records the option; the report's command gives it back."""
    from ndplan.report.data import prepare
    from ndplan.report.html import reproduce_command

    assert main(["estimate", "--model", "gpt-oss-20b", "--hardware", "h100-sxm", "--devices", "8", "--ep", "8",
                 "--zero", "3", "--fsdp", "--mbs", "2", "--seq", "4096", "--modules", "te", "--json"]) == 0
    data = prepare(json.loads(capsys.readouterr().out))
    command, missing = reproduce_command(data["inputs"])
    assert "--modules te" in command and missing == []


@pytest.mark.parametrize("reshard", [True, False])
def test_experts_outside_fsdp_keep_bf16_gradients_and_no_gathered_copy(reshard):
    """NeMo AutoModel leaves the routed experts out of FSDP where their shard group is one rank
    (EP 8 over dp 8): Qwen3-30B-A3B's rank holds E = 48 layers · 16 experts · 3 · 2048 · 768
    expert elements, their gradients at the parameters' 2 B, not the reduce dtype's 4 (2·E bytes
    less), and where FSDP keeps every unit gathered after forward (reshard_after_forward off)
    there is no gathered copy of them either (2·E less in comm). With EP 8 over dp 16 the
    experts' shard group is two ranks: FSDP shards them, and nothing changes."""
    model = get_preset("qwen3-30b-a3b")
    experts = 48 * 16 * 3 * 2048 * 768

    def stage(options: MemoryOptions, dp: int = 8):
        strategy = Strategy(dp=dp, ep=8, zero=3, fsdp=True, reshard_after_forward=reshard, micro_batch_size=1,
                            num_micro_batches=2, seq_length=4096, precision="megatron-bf16")
        return estimate(model, strategy, "h100-sxm", options).stages[0]

    inside, outside = stage(MemoryOptions(include_overhead=False)), stage(
        MemoryOptions(include_overhead=False, experts_outside_fsdp=True))
    assert inside.grads_bytes - outside.grads_bytes == pytest.approx(2 * experts)
    assert inside.comm_bytes - outside.comm_bytes == pytest.approx(0 if reshard else 2 * experts)
    assert (inside.params_bytes, inside.optimizer_bytes) == (outside.params_bytes, outside.optimizer_bytes)
    sharded = stage(MemoryOptions(include_overhead=False), dp=16)
    assert stage(MemoryOptions(include_overhead=False, experts_outside_fsdp=True), dp=16).peak_bytes == sharded.peak_bytes


def test_the_experts_flag_reaches_the_json_and_the_explain(capsys):
    args = ["estimate", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "8", "--ep", "8",
            "--fsdp", "--no-reshard", "--mbs", "1", "--seq", "4096", "--precision", "megatron-bf16"]
    assert main([*args, "--json"]) == 0
    inside = json.loads(capsys.readouterr().out)
    assert main([*args, "--json", "--experts-outside-fsdp"]) == 0
    outside = json.loads(capsys.readouterr().out)
    assert outside["experts_outside_fsdp"] is True and inside["experts_outside_fsdp"] is False
    assert outside["peak_bytes"] < inside["peak_bytes"]
    assert main([*args, "--explain", "--experts-outside-fsdp"]) == 0
    assert "the routed experts out of FSDP, their shard group one rank" in " ".join(capsys.readouterr().out.split())
