"""What the written configs say of the runtime settings priced beside the strategy: the attention
kernel and the vocabulary-parallel loss. Each format writes them where it has a setting and reads
them back; where it has none, the header says so (nothing dropped silently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndplan.cli import main
from ndplan.io import emit, read_config
from ndplan.model import get_preset
from ndplan.strategy import Strategy

SUFFIX = {"megatron": ".sh", "torchtitan": ".toml", "hyperparallel": ".yaml", "mindformers": ".yaml"}
MODEL = get_preset("qwen3-8b")
TP2 = Strategy(dp=4, tp=2, sequence_parallel=True, micro_batch_size=1, num_micro_batches=2, precision="fsdp-bf16")
# torchtitan applies bf16 mixed precision through FSDP; TP without it trains in fp32 (said in the header).
TP2_FSDP = TP2.model_copy(update={"zero": 3, "fsdp": True})


def _read(text: str, fmt: str, tmp_path: Path):
    path = tmp_path / f"config{SUFFIX[fmt]}"
    path.write_text(text)
    return read_config(path, model=MODEL, fmt=fmt)


def _lost(text: str) -> list[str]:
    return [line for line in text.splitlines() if "not expressible" in line]


@pytest.mark.parametrize("fmt", ["hyperparallel", "mindformers"])
def test_eager_attention_is_written_and_read_back(fmt: str, tmp_path: Path) -> None:
    """--attention eager --emit hyperparallel|mindformers wrote nothing about attention and read
    back as flash (qwen3-8b dp8 tp2: 146.8 GiB priced, 90.1 GiB read back)."""
    text = emit(MODEL, TP2, fmt, attention="eager")
    assert ("attn_implementation: eager" if fmt == "hyperparallel" else "use_flash_attention: false") in text
    assert _lost(text) == []
    assert _read(text, fmt, tmp_path).runtime_settings["attention"] == "eager"
    flash = emit(MODEL, TP2, fmt)
    assert "attention" not in _read(flash, fmt, tmp_path).runtime_settings


def test_hyperparallel_reads_attn_implementation(tmp_path: Path) -> None:
    """transformers' names: eager and sdpa as themselves, the flash kernels as flash, flex_attention
    as flex (and written back so); one ndplan does not know is priced as flash, with a warning
    naming the line."""
    text = emit(MODEL, TP2, "hyperparallel", attention="sdpa")
    assert "attn_implementation: sdpa" in text and _lost(text) == []
    assert _read(text, "hyperparallel", tmp_path).runtime_settings["attention"] == "sdpa"
    for name, kernel in (("flash_attention_2", "flash"), ("flash_attention_3", "flash"), ("flex_attention", "flex")):
        result = _read(text.replace("attn_implementation: sdpa", f"attn_implementation: {name}"), "hyperparallel",
                       tmp_path)
        assert result.runtime_settings["attention"] == kernel and result.warnings == []
    flex = emit(MODEL, TP2, "hyperparallel", attention="flex")
    assert "attn_implementation: flex_attention" in flex and _lost(flex) == []
    assert _read(flex, "hyperparallel", tmp_path).runtime_settings["attention"] == "flex"
    odd = _read(text.replace("attn_implementation: sdpa", "attn_implementation: paged"), "hyperparallel", tmp_path)
    assert "attention" not in odd.runtime_settings
    assert any("model.attn_implementation 'paged'" in w and "priced as flash" in w for w in odd.warnings)


@pytest.mark.parametrize("attention", ["eager", "sdpa", "flex"])
def test_torchtitan_says_it_has_no_attention_setting(attention: str, tmp_path: Path) -> None:
    """torchtitan's job config has no attention setting (its models call SDPA): a kernel other
    than flash is a header line, and the file reads back as flash."""
    text = emit(MODEL, TP2_FSDP, "torchtitan", attention=attention)
    lost = _lost(text)
    assert len(lost) == 1 and f"{attention} attention" in lost[0] and "no attention setting" in lost[0]
    assert "attention" not in _read(text, "torchtitan", tmp_path).runtime_settings
    assert _lost(emit(MODEL, TP2_FSDP, "torchtitan")) == []


def test_megatron_and_mindformers_say_they_run_no_flex_attention() -> None:
    """FlexAttention is PyTorch's: a Megatron launch and a MindFormers YAML run their fused
    attention, and say so."""
    for fmt, kernel in (("megatron", "fused attention"), ("mindformers", "use_flash_attention")):
        said = [line for line in _lost(emit(MODEL, TP2, fmt, attention="flex")) if "flex attention" in line]
        assert len(said) == 1 and kernel in said[0]


def test_mindformers_says_it_runs_no_sdpa(tmp_path: Path) -> None:
    text = emit(MODEL, TP2, "mindformers", attention="sdpa")
    assert "use_flash_attention: true" in text
    assert len(_lost(text)) == 1 and "sdpa attention" in _lost(text)[0]


@pytest.mark.parametrize("loss_parallel", [True, False])
@pytest.mark.parametrize("fmt", ["torchtitan", "hyperparallel"])
def test_loss_parallel_is_written_and_read_back(fmt: str, loss_parallel: bool, tmp_path: Path) -> None:
    """emit had no loss-parallel argument: HyperParallel never wrote accelerator.loss_parallel
    (read back off: 76.6 -> 78.4 GiB under the megatron runtime), torchtitan never wrote
    disable_loss_parallel (--no-loss-parallel: 90.1 -> 86.5 GiB)."""
    text = emit(MODEL, TP2_FSDP if fmt == "torchtitan" else TP2, fmt, loss_parallel=loss_parallel)
    assert _lost(text) == []
    assert _read(text, fmt, tmp_path).runtime_settings["loss_parallel"] is loss_parallel
    # Without TP there is no vocabulary to shard: nothing is written.
    plain = emit(MODEL, Strategy(dp=8, micro_batch_size=1, num_micro_batches=2), fmt, loss_parallel=False)
    assert "loss_parallel" not in plain


@pytest.mark.parametrize("fmt", ["megatron", "mindformers"])
def test_an_always_vocabulary_parallel_loss_says_so(fmt: str, tmp_path: Path) -> None:
    """Megatron's and MindFormers' cross-entropy is always vocabulary-parallel over TP: the loss
    priced on whole logits is a header line, and the file reads back as vocabulary-parallel (a
    Megatron launch read with --runtime pytorch priced whole logits, which Megatron never runs)."""
    text = emit(MODEL, TP2, fmt, loss_parallel=False)
    assert any("the loss on whole logits (--no-loss-parallel)" in line for line in _lost(text))
    assert _read(text, fmt, tmp_path).runtime_settings["loss_parallel"] is True
    assert not any("whole logits" in line for line in _lost(emit(MODEL, TP2, fmt, loss_parallel=True)))
    assert not any("whole logits" in line for line in _lost(emit(MODEL, TP2, fmt)))


def test_mindformers_vocab_emb_dp_keeps_whole_logits(tmp_path: Path) -> None:
    """vocab_emb_dp true (MindFormers' default) keeps the head whole over model_parallel: its
    logits are not vocabulary-parallel."""
    text = emit(MODEL, TP2, "mindformers").replace("vocab_emb_dp: false", "vocab_emb_dp: true")
    assert _read(text, "mindformers", tmp_path).runtime_settings["loss_parallel"] is False


def _peak(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[float, str]:
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    return data["peak_bytes"], data.get("emitted", "")


@pytest.mark.parametrize(("fmt", "flags"), [
    ("hyperparallel", ["--attention", "eager"]), ("mindformers", ["--attention", "eager"]),
    ("hyperparallel", ["--runtime", "megatron"]), ("hyperparallel", ["--loss-parallel"]),
    ("torchtitan", ["--no-loss-parallel", "--fsdp"]), ("megatron", ["--runtime", "pytorch", "--precision", "megatron-bf16"]),
])
def test_estimate_emit_reads_back_at_the_priced_peak(fmt: str, flags: list[str], capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    """estimate --emit FMT, then estimate --from the file with the same runtime: the same peak."""
    base = ["--model", "qwen3-8b", "--hardware", "h100-sxm", "--devices", "16"]
    runtime = flags[flags.index("--runtime") + 1] if "--runtime" in flags else "pytorch"
    precision = [] if "--precision" in flags else ["--precision", "fsdp-bf16"]
    priced, text = _peak(["estimate", *base, *precision, "--tp", "2", "--sp", "--gbs", "64", "--seq", "4096", *flags,
                          "--emit", fmt], capsys)
    assert _lost(text) == []
    path = tmp_path / f"emitted{SUFFIX[fmt]}"
    path.write_text(text)
    ran, _ = _peak(["estimate", "--from", str(path), *base, "--runtime", runtime], capsys)
    assert ran == priced


def test_an_expert_capacity_factor_is_written_and_read_back(tmp_path: Path) -> None:
    """A review: --moe-capacity-factor was neither written (the read-back priced dropless routing,
    26.86 -> 25.08 GB) nor read from Megatron's --moe-expert-capacity-factor (a warning said token
    dropping was not modelled, though it is priced)."""
    model = get_preset("qwen3-30b-a3b")
    strategy = Strategy(dp=8, ep=8, etp=1, micro_batch_size=1, num_micro_batches=8, seq_length=4096)
    path = tmp_path / "train.sh"
    path.write_text(emit(model, strategy, "megatron", moe_capacity_factor=1.25))
    read = read_config(path, model=model)
    assert read.runtime_settings["moe_capacity_factor"] == 1.25
    assert not any("capacity" in w for w in read.warnings)
    unpadded = tmp_path / "unpadded.sh"
    unpadded.write_text(path.read_text().replace("--moe-pad-expert-input-to-capacity", ""))
    assert any("an upper bound" in n for n in read_config(unpadded, model=model).notes)
    toml = emit(model, strategy, "torchtitan", moe_capacity_factor=1.25)
    assert "left out: an expert capacity factor of 1.25 (--moe-capacity-factor" in toml


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan", "mindformers", "hyperparallel"])
def test_a_priced_routing_imbalance_is_stated_in_the_emitted_file(fmt: str, tmp_path: Path) -> None:
    """A pricing assumption no framework sets: said at the top, so a read-back is priced alike."""
    model = get_preset("qwen3-30b-a3b")
    strategy = Strategy(dp=8, ep=8, etp=1, micro_batch_size=1, num_micro_batches=8, seq_length=4096)
    text = emit(model, strategy, fmt, moe_imbalance=1.3)
    assert "# ndplan: priced with --moe-imbalance 1.3 (the busiest rank's routed tokens" in text
    assert "--moe-imbalance" not in emit(model, strategy, fmt)
    path = tmp_path / {"megatron": "train.sh", "torchtitan": "job.toml"}.get(fmt, "job.yaml")
    path.write_text(text)
    assert read_config(path, model=model).strategy(8).ep == 8  # still reads as the same launch


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_megatron_token_dispatcher_is_written_and_read_back(dispatcher: str, tmp_path: Path) -> None:
    """--emit megatron writes the dispatcher priced (MemoryOptions.moe_dispatcher), for every MoE
    model: a launch without --moe-token-dispatcher-type runs Megatron's default, allgather, which
    the reader prices so (it was priced as the all-to-all's buffers, the golden
    gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel -5.4%, -4.0% as allgather)."""
    from ndplan.perf import OverlapConfig

    moe = get_preset("qwen3-30b-a3b")
    for strategy in (Strategy(dp=4, tp=2, sequence_parallel=True, ep=8, etp=1, num_micro_batches=2),
                     Strategy(dp=8, num_micro_batches=2)):  # ep 1: written too
        text = emit(moe, strategy, "megatron", OverlapConfig(), moe_dispatcher=dispatcher)
        assert f"--moe-token-dispatcher-type {dispatcher}" in text
        path = tmp_path / "launch.sh"
        path.write_text(text)
        read = read_config(path, model=moe, fmt="megatron")
        assert read.runtime_settings.get("moe_dispatcher", "alltoall") == dispatcher
    unstated = "torchrun --nproc-per-node 8 pretrain_gpt.py --num-experts 8 --expert-model-parallel-size 2 --bf16\n"
    path.write_text(unstated)
    assert read_config(path, model=moe, fmt="megatron", devices=8).runtime_settings["moe_dispatcher"] == "allgather"
    flex = unstated.replace("--bf16", "--bf16 --moe-token-dispatcher-type flex")
    path.write_text(flex)
    settings = read_config(path, model=moe, fmt="megatron", devices=8).runtime_settings
    assert "moe_dispatcher" not in settings and settings["overlap"]["ep_dispatch"] == "node_dedup"


def test_a_megatron_launch_without_p2p_overlap_waits_for_its_interleaved_sends(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron-Core's interleaved schedule overlaps its pipeline sends unless
    --no-overlap-p2p-communication (then batch_p2p_comm and its device sync, as 1F1B): the reader
    says so, and the estimate of that launch prices its sends waited."""
    looped = Strategy(dp=2, tp=2, sequence_parallel=True, pp=2, vpp=2, schedule="interleaved", micro_batch_size=1,
                      num_micro_batches=8, precision="megatron-bf16")
    text = emit(MODEL, looped, "megatron")
    waiting = text.replace("    --sequence-parallel\n", "    --sequence-parallel\n    --no-overlap-p2p-communication\n", 1)
    assert waiting != text
    assert "p2p_wait" not in _read(text, "megatron", tmp_path).runtime_settings
    result = _read(waiting, "megatron", tmp_path)
    assert result.runtime_settings["p2p_wait"] == "1f1b+interleaved"
    assert any("--no-overlap-p2p-communication" in note for note in result.notes) and result.warnings == []
    for body, waited in ((text, False), (waiting, True)):
        path = tmp_path / "launch.sh"
        path.write_text(body)
        assert main(["estimate", "--from", str(path), "--model", "qwen3-8b", "--hardware", "h100-sxm", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["time"]["sends_waited"] is waited
    path = tmp_path / "launch.sh"
    path.write_text(waiting)
    assert main(["estimate", "--from", str(path), "--model", "qwen3-8b", "--hardware", "h100-sxm"]) == 0
    assert "pipeline sends waited for in the 1f1b and interleaved schedules (the launch's" in capsys.readouterr().out


def test_a_launch_without_gradient_accumulation_fusion_adds_every_linear_weight_per_micro_batch(tmp_path, capsys):
    """A Megatron launch with --no-gradient-accumulation-fusion is priced with the separate adds:
    Llama-3.1-8B on 8 H100s (DP 8, 4 micro-batches of 4,096 tokens, compute-bound GEMMs) pays
    4 · 10 B · (its decoder layers' and head's linear weights) / (HBM · 0.8) more compute a step
    (bf16 gradients written, fp32 buffers read and written), and nothing else changes."""
    import json

    from ndplan.cli import main
    from ndplan.hardware import get_device
    from ndplan.model import get_preset
    from ndplan.perf import default_efficiency

    model = get_preset("llama-3.1-8b")
    h, kv, f = model.hidden_size, model.num_kv_heads * model.head_dim, model.ffn_hidden_size
    linear = model.num_layers * (2 * h * h + 2 * h * kv + 3 * h * f) + model.vocab_size * h
    flags = ("--micro-batch-size 1 --global-batch-size 32 --seq-length 4096 --bf16 "
             "--use-distributed-optimizer --overlap-grad-reduce")
    steps = {}
    for name, extra in (("fused", ""), ("unfused", " --no-gradient-accumulation-fusion")):
        path = tmp_path / f"{name}.sh"
        path.write_text(flags + extra + "\n")
        assert main(["estimate", "--from", str(path), "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
                     "--devices", "8", "--json"]) == 0
        time = json.loads(capsys.readouterr().out)["time"]
        steps[name] = time["breakdown"]
    device = get_device("h100-sxm")
    hbm = device.hbm_bandwidth_bytes_per_s * default_efficiency(device).hbm_efficiency
    assert steps["unfused"]["compute"] - steps["fused"]["compute"] == pytest.approx(4 * 10 * linear / hbm, rel=1e-6)
    assert steps["unfused"]["comm_exposed"] == steps["fused"]["comm_exposed"]
    # The flag prices the same compute without a launch, and overrides a launch's statement.
    base = ["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32",
            "--seq", "4096", "--zero", "1", "--runtime", "megatron", "--json"]
    assert main([*base, "--no-gradient-accumulation-fusion"]) == 0
    assert json.loads(capsys.readouterr().out)["time"]["breakdown"]["compute"] == steps["unfused"]["compute"]
    assert main(["estimate", "--from", str(tmp_path / "unfused.sh"), "--model", "llama-3.1-8b", "--hardware",
                 "h100-sxm", "--devices", "8", "--gradient-accumulation-fusion", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time"]["breakdown"] == steps["fused"]
    # A search from that launch writes the flag back, and the launch read back is what was priced.
    assert main(["search", "--from", str(tmp_path / "unfused.sh"), "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
                 "--devices", "8", "--emit", "megatron", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert "    --no-gradient-accumulation-fusion" in found["emitted"]
    assert found["emitted_check"]["same"] is True
