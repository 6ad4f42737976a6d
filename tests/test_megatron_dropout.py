"""Dropout, GeLU MLPs and unfused attention in the Megatron-Core profile, by hand, and how the
Megatron reader states them (docs/accuracy_megatron.md measured the whole against Megatron-LM's
own tests)."""

from __future__ import annotations

import pytest

from ndplan.errors import NdplanError
from ndplan.io import read_config
from ndplan.memory.activations import layer_activations
from ndplan.memory.options import MemoryOptions
from ndplan.model.spec import ModelSpec
from ndplan.strategy import Strategy, StrategyBatch

H, FFN, HEADS, SEQ, VOCAB = 512, 2048, 8, 1024, 50304
GPT = dict(name="gpt-tiny", num_layers=12, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS,
           num_kv_heads=HEADS, head_dim=H // HEADS, vocab_size=VOCAB, tie_word_embeddings=True, norm="layernorm",
           norm_bias=True, activation="gelu", gated_mlp=False, qkv_bias=True, o_bias=True, mlp_bias=True)


def _dense_bytes(attention: str, **fields: object) -> float:
    """Bytes per token one dense layer keeps, Megatron profile, TP 1, bf16 activations."""
    model = ModelSpec(**{**GPT, **fields})  # type: ignore[arg-type]
    batch = StrategyBatch.of(Strategy(seq_length=SEQ, precision="bf16-pure"))
    acts = layer_activations(model, batch, MemoryOptions(runtime="megatron", attention=attention))
    return float(acts.full["dense"][0])


def test_a_gelu_mlp_keeps_one_width_of_its_first_projection():
    # fc1's input h, its output ffn (GeLU's input), fc2's input ffn: bf16 each
    gelu = _dense_bytes("flash")
    swiglu = _dense_bytes("flash", activation="silu", gated_mlp=True)
    assert swiglu - gelu == pytest.approx(2 * FFN)  # SwiGLU's fc1 output is two widths


def test_hidden_dropout_keeps_a_byte_mask_after_each_residual_branch():
    assert _dense_bytes("flash", hidden_dropout=0.1) - _dense_bytes("flash") == pytest.approx(2 * H)



def test_the_embedding_dropout_keeps_its_mask_on_the_first_stage():
    """Megatron's embedding applies hidden_dropout after the scatter to the sequence-parallel
    region: a byte per element of [s/tp, b, h] beside the int64 token ids, on the first stage of a
    pipeline (and per MTP module); the last stage holds none of it."""
    from ndplan.memory.stages import stage_memory

    tp, mbs = 4, 2
    strategy = Strategy(tp=tp, pp=2, sequence_parallel=True, micro_batch_size=mbs, num_micro_batches=4,
                        seq_length=SEQ, precision="bf16-pure")
    kept = {}
    for dropout in (0.0, 0.1):
        model = ModelSpec(**{**GPT, "hidden_dropout": dropout})  # type: ignore[arg-type]
        options = MemoryOptions(runtime="megatron")
        acts = layer_activations(model, StrategyBatch.of(strategy), options)
        assert float(acts.embedding[0]) == (H / tp if dropout else 0.0)
        kept[dropout] = stage_memory(model, StrategyBatch.of(strategy), options, breakdown=True)
    tokens = mbs * SEQ
    in_flight = 2  # 1F1B: the first of two stages holds two micro-batches at its peak
    first = kept[0.1].by_kind["activations"]["embedding"][0] - kept[0.0].by_kind["activations"]["embedding"][0]
    assert first[0] == pytest.approx(in_flight * tokens * H / tp) and first[1] == 0.0


def test_unfused_attention_keeps_the_softmax_and_with_dropout_its_mask_and_output():
    # Per token: heads x seq probabilities; the softmax's bf16 output (2 bytes), and under dropout
    # the 1-byte mask and the dropped bf16 probabilities (2 + 1 + 2 = Korthikanti et al.'s 5as^2b).
    scores = HEADS * SEQ
    assert _dense_bytes("eager") - _dense_bytes("flash") == pytest.approx(2 * scores, rel=1e-3)
    with_dropout = _dense_bytes("eager", attention_dropout=0.1) - _dense_bytes("flash", attention_dropout=0.1)
    assert with_dropout == pytest.approx(5 * scores, rel=1e-3)
    # flash attention draws its dropout from the RNG state: nothing more kept
    assert _dense_bytes("flash", attention_dropout=0.1) == _dense_bytes("flash")


BASE = ("torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --bf16 ")


def test_the_reader_takes_megatrons_dropout_defaults_and_gpt2_vocabulary(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(BASE + "--vocab-file vocab.json --merge-file merges.txt\n")
    result = read_config(script, devices=8)
    assert result.model is not None
    assert (result.model.hidden_dropout, result.model.attention_dropout) == (0.1, 0.1)
    assert any("--hidden-dropout not given: Megatron's default 0.1" in n for n in result.notes)
    assert result.model.vocab_size == 50304  # GPT-2's 50,257 tokens padded to a multiple of 128
    script.write_text(BASE + "--hidden-dropout 0.0 --attention-dropout 0 --tokenizer-type GPT2BPETokenizer\n")
    model = read_config(script, devices=8).model
    assert model is not None and (model.hidden_dropout, model.attention_dropout, model.vocab_size) == (0.0, 0.0, 50304)


@pytest.mark.parametrize("flags, message", [
    ("--hidden-dropout 1.5", "--hidden-dropout.*must be a probability in \\[0, 1\\), got 1.5"),
    ("--attention-dropout lots", "--attention-dropout.*expected a number, got 'lots'"),
])
def test_the_reader_names_a_bad_value(tmp_path, flags, message):
    script = tmp_path / "train.sh"
    script.write_text(BASE + "--padded-vocab-size 256 " + flags + "\n")
    with pytest.raises(NdplanError, match=message):
        read_config(script, devices=8)


def test_an_unknown_transformer_impl_is_a_warning(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(BASE + "--padded-vocab-size 256 --transformer-impl fast\n")
    result = read_config(script, devices=8)
    assert any("--transformer-impl 'fast' is not one ndplan knows" in w for w in result.warnings)


def test_megatrons_local_layers_keep_the_softmax(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text(BASE + "--padded-vocab-size 256 --transformer-impl local\n")
    result = read_config(script, devices=8)
    assert result.runtime_settings["attention"] == "eager"
    assert any("--transformer-impl local" in n for n in result.notes)


def test_unfused_attention_time_reads_the_dropout_bytes_only_with_dropout():
    from ndplan.perf.flops import Sharding
    from ndplan.perf.memory_ops import unfused_score_bytes

    sharding = Sharding(micro_batch=1.0, seq=float(SEQ), tp=1.0, cp=1.0)
    elements = HEADS * SEQ * SEQ
    # scores written 2, softmax read 2 written 2; dropout reads 2, writes 2 and a 1-byte mask
    assert unfused_score_bytes(ModelSpec(**GPT), sharding) == pytest.approx(6 * elements)  # type: ignore[arg-type]
    assert unfused_score_bytes(ModelSpec(**{**GPT, "attention_dropout": 0.1}), sharding) == pytest.approx(11 * elements)  # type: ignore[arg-type]


def test_experts_without_grouped_gemm_hold_no_grouped_gemm_workspaces(tmp_path):
    """Megatron's experts run TE's grouped GEMM (four workspaces of its own) only with
    --moe-grouped-gemm; SequentialMLP takes none, which the reader passes on."""
    from ndplan.cli_args import runtime_options
    from ndplan.memory import estimate

    script = tmp_path / "train.sh"
    moe = BASE + "--padded-vocab-size 256 --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 "
    script.write_text(moe + "\n")
    sequential = read_config(script, devices=8)
    assert sequential.runtime_settings["grouped_gemm"] is False
    script.write_text(moe + "--moe-grouped-gemm\n")
    grouped = read_config(script, devices=8)
    assert "grouped_gemm" not in grouped.runtime_settings
    assert sequential.model is not None
    peaks = []
    for result in (sequential, grouped):
        import argparse

        options = runtime_options(argparse.Namespace(), None, result.runtime_settings)
        peaks.append(estimate(sequential.model, result.strategy(8), None, options).stages[-1].allocated_bytes)
    assert peaks[1] - peaks[0] == 128 * 2**20
