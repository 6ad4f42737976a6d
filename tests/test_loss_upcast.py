"""A loss on the logits' own dtype (--no-loss-upcast) against one on an fp32 copy of them."""

from __future__ import annotations

import json

import pytest

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.io import read_config
from ndplan.memory.activations import layer_activations
from ndplan.memory.options import MemoryOptions
from ndplan.model import get_preset
from ndplan.perf.flops import Sharding
from ndplan.perf.memory_ops import head_bytes
from ndplan.strategy import Strategy, StrategyBatch

MODEL = get_preset("qwen3-30b-a3b")  # vocabulary 151,936: the logits dominate the head
BF16 = Strategy(precision="bf16-pure")


def _output(runtime: str, upcast: bool) -> tuple[float, float]:
    """(kept, transient) bytes per token of the final norm, head and loss."""
    acts = layer_activations(MODEL, StrategyBatch.of(BF16), MemoryOptions(runtime=runtime, loss_upcast=upcast))
    return float(acts.output[0]), float(acts.output_transient[0])


@pytest.mark.parametrize("runtime,transient_upcast,transient_plain", [
    # F.cross_entropy: around the loss the logits (2) and their fp32 copy (4), or the logits
    # alone; its backward two fp32 gradients (4 + 4), or two bf16 ones (2 + 2).
    ("pytorch", 8, 4),
    # Megatron's own loss: the bf16 logits (2) beside its fp32 copy, which it turns into the kept
    # softmax in place; its backward casts the gradient back (2). TE's writes the gradient into
    # the bf16 logits in the forward and keeps them (counted as kept): nothing more.
    ("megatron", 2, 0),
])
def test_a_loss_without_upcast_keeps_bf16_logits(runtime, transient_upcast, transient_plain):
    """Kept for backward: the fp32 (log-)softmax, 4 bytes a logit, against 2 on the bf16 logits."""
    vocab = MODEL.vocab_size
    kept_fp32, transient_fp32 = _output(runtime, True)
    kept_bf16, transient_bf16 = _output(runtime, False)
    assert kept_fp32 - kept_bf16 == pytest.approx(2 * vocab)
    assert (transient_fp32, transient_bf16) == pytest.approx((transient_upcast * vocab, transient_plain * vocab))


@pytest.mark.parametrize("upcast", [True, False])
def test_the_profile_matches_what_torch_saves_for_the_loss(upcast):
    """The pytorch profile's head and loss against the tensors autograd saves for a bf16 head and
    F.cross_entropy, on the logits or on an fp32 copy (distinct storages, per token). Two
    vocabularies: the difference is the loss's bytes per logit, whatever else both keep."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    tokens, hidden = 16, 64

    def measured(vocab: int) -> float:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))
        storages: dict[int, int] = {}

        def pack(t):  # type: ignore[no-untyped-def]
            pointer = t.untyped_storage().data_ptr()
            if pointer != weight.untyped_storage().data_ptr():  # a parameter, not a saved activation
                storages[pointer] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = x @ weight.t()
            F.cross_entropy(logits.float() if upcast else logits, labels)
        return sum(storages.values()) / tokens

    def profiled(vocab: int) -> float:
        model = MODEL.model_copy(update={"hidden_size": hidden, "vocab_size": vocab})
        return float(layer_activations(model, StrategyBatch.of(BF16), MemoryOptions(loss_upcast=upcast)).output[0])

    assert profiled(3000) - profiled(1000) == pytest.approx(measured(3000) - measured(1000))
    assert measured(3000) - measured(1000) == 2000 * (4 if upcast else 2)


def test_head_time_reads_fewer_bytes_without_upcast():
    sharding = Sharding(micro_batch=1.0, seq=4096.0, tp=1.0, cp=1.0)
    logits = 4096 * MODEL.vocab_size
    upcast = head_bytes(MODEL, sharding, 0.0, 2.0)
    plain = head_bytes(MODEL, sharding, 0.0, 2.0, loss_upcast=False)
    assert upcast - plain == pytest.approx(4.0 * logits)  # 10 bytes a logit against 6


def test_megatron_reader_takes_te_cross_entropy_as_no_upcast(tmp_path):
    script = tmp_path / "train.sh"
    base = ("torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
            "--seq-length 128 --padded-vocab-size 256 --position-embedding-type rope --micro-batch-size 1 --global-batch-size 8 --bf16 ")
    script.write_text(base + "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te\n")
    result = read_config(script, devices=8)
    assert result.runtime_settings["loss_upcast"] is False and result.warnings == []
    script.write_text(base + "--cross-entropy-loss-fusion\n")  # Megatron's native fused loss upcasts
    assert "loss_upcast" not in read_config(script, devices=8).runtime_settings
    script.write_text(base + "--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear\n")
    linear = read_config(script, devices=8)
    assert "loss_upcast" not in linear.runtime_settings
    assert any("linear" in w and "upper bound" in w for w in linear.warnings)
    script.write_text(base + "--cross-entropy-loss-fusion --cross-entropy-fusion-impl triton\n")
    with pytest.raises(NdplanError, match="--cross-entropy-fusion-impl.*unknown implementation 'triton'; "
                                          "known: native, te, linear"):
        read_config(script, devices=8)


def test_cli_flag_reaches_memory_time_and_json(capsys):
    args = ["estimate", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "8", "--ep", "8",
            "--mbs", "2", "--seq", "4096", "--json"]
    assert main(args) == 0
    upcast = json.loads(capsys.readouterr().out)
    assert main([*args, "--no-loss-upcast"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert upcast["loss_upcast"] is True and plain["loss_upcast"] is False
    assert plain["peak_bytes"] < upcast["peak_bytes"]
    assert plain["time"]["step_s"] < upcast["time"]["step_s"]


def test_emitted_megatron_launch_reads_back_without_upcast(tmp_path):
    """--emit megatron writes Transformer Engine's cross-entropy, which reads back as no upcast;
    torchtitan's loss always upcasts, which its config's header says."""
    from ndplan.io import emit

    model = get_preset("llama-3.1-8b")
    strategy = Strategy(dp=8)
    script = tmp_path / "train.sh"
    script.write_text(emit(model, strategy, "megatron", loss_upcast=False))
    assert read_config(script, devices=8).runtime_settings["loss_upcast"] is False
    script.write_text(emit(model, strategy, "megatron"))
    assert "loss_upcast" not in read_config(script, devices=8).runtime_settings
    assert "left out: the loss on the bf16 logits" in emit(model, strategy, "torchtitan", loss_upcast=False)


def test_search_records_the_loss_and_emits_it(capsys):
    """The option reaches a search's JSON (which `report` re-estimates with) and its emitted
    Megatron launch; a --from config's TE loss is overridden by --loss-upcast."""
    args = ["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "64",
            "--seq", "8192", "--runtime", "megatron", "--top", "1", "--dims", "tp", "mbs", "--emit", "megatron", "--json"]
    assert main([*args, "--no-loss-upcast"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["loss_upcast"] is False and "--cross-entropy-fusion-impl te" in data["emitted"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["loss_upcast"] is True and "--cross-entropy-fusion-impl" not in data["emitted"]


def test_loss_upcast_overrides_a_config_with_te_cross_entropy(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text("torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 "
                      "--num-attention-heads 4 --seq-length 128 --padded-vocab-size 256 --position-embedding-type rope "
                      "--micro-batch-size 1 --global-batch-size 8 --bf16 --cross-entropy-loss-fusion "
                      "--cross-entropy-fusion-impl te\n")
    base = ["estimate", "--from", str(script), "--hardware", "h100-sxm", "--devices", "8", "--json"]
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["loss_upcast"] is False
    assert main([*base, "--loss-upcast"]) == 0
    assert json.loads(capsys.readouterr().out)["loss_upcast"] is True
