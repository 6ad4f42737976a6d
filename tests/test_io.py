"""Reading real launch configs of each framework, and one-line errors for malformed ones."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ndplan.errors import NdplanError
from ndplan.io import detect_format, emit, read_config
from ndplan.io.cli import (
    add_from_argument,
    add_inspect_arguments,
    cmd_inspect,
    inspect_summary,
    merge_settings,
    model_for,
    read_from_args,
)
from ndplan.memory.options import MemoryOptions
from ndplan.model import count_parameters, get_preset, hf_config
from ndplan.strategy import Strategy, check_strategy

FIXTURES = Path(__file__).parent / "fixtures" / "io"
DSV3_PARAMS = count_parameters(get_preset("deepseek-v3")).total


def fixture(name: str) -> Path:
    return FIXTURES / name


# ---------------------------------------------------------------- Megatron-LM / MindSpeed-LLM
def test_megatron_llama3_70b_script():
    result = read_config(fixture("megatron_llama3_70b.sh"), model="llama-3.1-70b")
    s = result.strategy()
    assert (s.dp, s.tp, s.pp, s.vpp, s.cp, s.schedule) == (2, 8, 4, 4, 1, "interleaved")
    assert s.sequence_parallel and s.zero == 1 and not s.fsdp
    assert (s.micro_batch_size, s.num_micro_batches, s.global_batch_size, s.seq_length) == (1, 256, 512, 8192)
    assert s.recompute == "selective" and s.precision.name == "megatron-bf16"
    assert s.stage_layers is None and not s.embedding_as_layer  # 80 layers, 16 chunks of 5
    assert result.devices == 64 and result.devices_per_node == 8
    # Megatron pads Llama-3's 128256-entry vocabulary to a multiple of 128·tp.
    assert result.model is not None and result.model.vocab_size == 129024
    assert any("padded to 129024" in n for n in result.notes)
    assert result.warnings == []
    assert check_strategy(s, result.model) == []
    # --overlap-grad-reduce, --overlap-param-gather and --tp-comm-overlap are the step time's switches.
    assert result.runtime_settings["overlap"] == {"dp_grad_reduce": True, "dp_param_gather": True, "tp": True}


def test_megatron_overlap_flags_become_the_step_time_switches(tmp_path):
    """Megatron hides nothing it is not told to: a script without the flags prices exposed
    gradient reduction; the flex dispatcher (DeepEP) crosses the network once per node."""
    from ndplan.perf import parse_overlap

    ds = read_config(fixture("megatron_deepseek_v3.sh")).runtime_settings["overlap"]
    assert ds == {"dp_grad_reduce": True, "dp_param_gather": True, "tp": False, "ep_dispatch": "node_dedup"}
    mindspeed = read_config(fixture("mindspeed_deepseek3.sh")).runtime_settings["overlap"]
    assert "ep_dispatch" not in mindspeed  # --moe-token-dispatcher-type alltoall
    script = tmp_path / "train.sh"
    text = fixture("megatron_llama3_70b.sh").read_text()
    script.write_text(text.replace("    --overlap-grad-reduce\n", "").replace("    --tp-comm-overlap\n", ""))
    bare = parse_overlap(read_config(script, model="llama-3.1-70b").runtime_settings["overlap"])
    assert bare is not None and not bare.dp_grad_reduce and not bare.tp and bare.dp_param_gather


def test_megatron_script_without_vocab_needs_a_model():
    result = read_config(fixture("megatron_llama3_70b.sh"))
    assert result.model is None
    assert any("vocab_size not stated" in w for w in result.warnings)
    assert result.strategy().short() == "dp2 tp8 sp pp4 vpp4 zero1 mbs1 m256 interleaved rc-selective"


def test_megatron_deepseek_v3_script_builds_the_model_from_flags():
    result = read_config(fixture("megatron_deepseek_v3.sh"))
    model, s = result.model, result.strategy()
    assert model is not None and count_parameters(model).total == DSV3_PARAMS
    assert model.is_mla and model.mtp_depth == 1 and model.layer_mlp_kinds[:4] == ("dense",) * 3 + ("moe",)
    assert (s.dp, s.tp, s.pp, s.ep, s.etp) == (32, 2, 16, 64, 1)
    # The layout "Et*3|(t*4|)*14,t*2mL" is the even split with embedding and loss counted as layers.
    assert s.stage_layers is None and s.embedding_as_layer and s.output_as_layer
    assert s.precision.name == "megatron-fp8" and s.recompute == "selective"
    assert s.num_micro_batches == 256 and s.seq_length == 4096
    assert s.recompute_modules == ("layernorm", "moe_act", "mla_up_proj")  # Megatron's order, as read
    assert result.warnings == []
    assert check_strategy(s, model) == []


def test_megatron_flags_win_over_the_model_with_a_warning():
    result = read_config(fixture("megatron_deepseek_v3.sh"), model="deepseek-v2-lite")
    assert result.model is not None and result.model.name == "deepseek-v2-lite"
    assert result.model.num_layers == 61 and result.model.hidden_size == 7168
    assert any(w.startswith("--hidden-size sets hidden_size=7168 but deepseek-v2-lite has 2048") for w in result.warnings)


def test_mindspeed_deepseek3_script_with_noop_layers():
    result = read_config(fixture("mindspeed_deepseek3.sh"))
    model, s = result.model, result.strategy()
    assert model is not None and count_parameters(model).total == DSV3_PARAMS
    assert (s.dp, s.tp, s.pp, s.vpp, s.ep, s.schedule) == (64, 1, 8, 4, 64, "interleaved")
    # 64 layer slots in 32 chunks of 2; no-op layers 47, 62, 63 empty parts of chunks 23 and 31.
    assert s.stage_layers == (2,) * 23 + (1,) + (2,) * 7 + (0,)
    assert not s.sequence_parallel  # tp=1
    assert s.recompute == "full" and s.recompute_layers == 0 and s.zero == 1
    assert s.global_batch_size == 7680 and s.num_micro_batches == 120
    flagged = {w.split(": ")[1] for w in result.warnings}
    assert flagged == {"--reuse-fp32-param", "--share-mtp-embedding-and-output-weight"}
    assert check_strategy(s, model) == []


def test_megatron_attention_backend_sets_the_attention_kernel(tmp_path, capsys):
    """TE's unfused attention and Megatron's own keep the s x s scores (--attention eager); flash,
    cuDNN's fused attention and auto keep O(s) statistics. An --attention flag still wins."""
    from ndplan.cli import main

    script = tmp_path / "train.sh"
    base = ("torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
            "--seq-length 512 --padded-vocab-size 256 --position-embedding-type rope --micro-batch-size 1 "
            "--global-batch-size 8 --bf16 ")
    for backend, kernel in (("unfused", "eager"), ("local", "eager"), ("flash", None), ("fused", None), ("auto", None)):
        script.write_text(base + f"--attention-backend {backend}\n")
        result = read_config(script, devices=8)
        assert result.runtime_settings.get("attention") == kernel and result.warnings == []
    script.write_text(base + "--use-legacy-models\n")  # legacy models: flash only with --use-flash-attn
    assert read_config(script, devices=8).runtime_settings.get("attention") == "eager"
    script.write_text(base + "--use-legacy-models --use-flash-attn\n")
    assert "attention" not in read_config(script, devices=8).runtime_settings
    script.write_text(base + "--attention-backend AttnBackend.unfused\n")  # as an argument dump writes it
    assert read_config(script, devices=8).runtime_settings.get("attention") == "eager"
    script.write_text(base + "--attention-backend sdpa\n")
    unknown = read_config(script, devices=8)
    assert "attention" not in unknown.runtime_settings
    assert any("--attention-backend 'sdpa' is not one ndplan knows (auto, flash, fused, unfused, local); priced as "
               "flash attention" in w for w in unknown.warnings)

    def estimate(*extra: str) -> dict:
        assert main(["estimate", "--from", str(script), "--hardware", "h100-sxm", "--devices", "8", "--json", *extra]) == 0
        data: dict = json.loads(capsys.readouterr().out)
        return data

    script.write_text(base + "--attention-backend unfused\n")
    unfused = estimate()
    assert unfused["attention"] == "eager" and estimate("--attention", "flash")["attention"] == "flash"
    script.write_text(base)
    flash = estimate()
    assert flash["attention"] == "flash" and flash["peak_bytes"] < unfused["peak_bytes"]


def test_mindspeed_runs_flash_attention_only_with_use_flash_attn(tmp_path):
    """A script with a flag only MindSpeed defines runs on MindSpeed: the NPU's fused attention
    with --use-flash-attn (whatever --transformer-impl says; on an NPU every layer is Megatron's
    own), else Megatron's DotProductAttention, which keeps the s x s scores. A Megatron script
    with the same model keeps reading as flash (Transformer Engine's auto backend)."""
    script = tmp_path / "train.sh"
    base = ("torchrun pretrain_gpt.py --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
            "--seq-length 512 --padded-vocab-size 256 --position-embedding-type rope --micro-batch-size 1 "
            "--global-batch-size 8 --bf16 ")
    script.write_text(base + "--use-fused-rmsnorm --use-fused-swiglu\n")
    unfused = read_config(script, devices=8)
    assert unfused.runtime_settings.get("attention") == "eager"
    assert any("MindSpeed (--use-fused-rmsnorm) without --use-flash-attn: attention keeps its s x s softmax" in n
               for n in unfused.notes)
    script.write_text(base + "--use-fused-rmsnorm --use-flash-attn --transformer-impl local\n")
    assert "attention" not in read_config(script, devices=8).runtime_settings
    script.write_text(base)  # no MindSpeed flag: Megatron-Core with TE picks a fused kernel
    assert "attention" not in read_config(script, devices=8).runtime_settings
    assert "attention" not in read_config(fixture("mindspeed_deepseek3.sh")).runtime_settings
    # Telling MindSpeed apart reads no flag: --swap-attention still warns that it is not modelled,
    # and MindSpeed's --attention-backend (its attention follows --use-flash-attn) is no unknown flag.
    script.write_text(base + "--use-flash-attn --swap-attention --attention-backend sdpa\n")
    warned = read_config(script, devices=8).warnings
    assert any("--swap-attention" in w and "not modelled" in w for w in warned)
    assert not any("--attention-backend" in w for w in warned)


def test_megatron_argument_file(tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({
        "tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2, "world_size": 32,
        "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
        "group_query_attention": True, "num_query_groups": 8, "swiglu": True, "normalization": "RMSNorm",
        "add_bias_linear": False, "untie_embeddings_and_output_weights": True, "padded_vocab_size": 128256,
        "position_embedding_type": "rope", "sequence_parallel": True, "use_distributed_optimizer": True,
        "micro_batch_size": 2, "global_batch_size": 256, "seq_length": 8192, "bf16": True, "fp16": False,
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 4,
        "overlap_grad_reduce": True, "lr": 3e-4, "train_iters": 1000,
    }, indent=2))
    result = read_config(path)
    s = result.strategy()
    assert (s.dp, s.tp, s.pp, s.num_micro_batches) == (4, 4, 2, 32)
    assert s.recompute == "full" and s.recompute_layers == 4
    assert result.model is not None and count_parameters(result.model).total == count_parameters(get_preset("llama-3.1-8b")).total
    assert result.warnings == []


def test_megatron_launch_of_glm_4_5_counts_as_its_hf_config(tmp_path):
    """GLM-4.5 as Megatron builds it from the flags (q/k/v biases, q/k norms, 3 dense layers by
    --moe-layer-freq, one shared expert, an MTP layer): every block the same count as the HF
    config's preset, which transformers' build pins."""
    path = tmp_path / "glm.sh"
    path.write_text(
        "torchrun --nproc_per_node 8 --nnodes 32 pretrain_gpt.py \\\n"
        "  --num-layers 92 --hidden-size 5120 --ffn-hidden-size 12288 --num-attention-heads 96 \\\n"
        "  --group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm --add-qkv-bias \\\n"
        "  --disable-bias-linear --swiglu --normalization RMSNorm --position-embedding-type rope \\\n"
        "  --rotary-percent 0.5 --untie-embeddings-and-output-weights --vocab-size 151552 \\\n"
        "  --num-experts 160 --moe-ffn-hidden-size 1536 --moe-shared-expert-intermediate-size 1536 \\\n"
        "  --moe-router-topk 8 --moe-layer-freq \"([0]*3+[1]*89)\" --moe-router-score-function sigmoid \\\n"
        "  --moe-router-enable-expert-bias --moe-grouped-gemm --mtp-num-layers 1 \\\n"
        "  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 8 \\\n"
        "  --decoder-first-pipeline-num-layers 8 --decoder-last-pipeline-num-layers 12 \\\n"
        "  --expert-model-parallel-size 16 --use-distributed-optimizer --micro-batch-size 1 \\\n"
        "  --global-batch-size 1024 --seq-length 4096 --bf16\n")
    result = read_config(path)
    assert result.model is not None and result.model.mtp_depth == 1
    assert count_parameters(result.model).blocks() == count_parameters(get_preset("glm-4.5")).blocks()
    assert result.strategy().stage_layers == (8, 12, 12, 12, 12, 12, 12, 12)


def test_megatron_launch_says_it_cannot_write_projection_wide_qk_norms(tmp_path):
    """MiniMax-M2's q/k norms span every head; Megatron's --qk-layernorm normalises each head: the
    launch says what it cannot express, and read back it counts the per-head norms it writes."""
    from ndplan.model import spec_from_hf_config

    model = spec_from_hf_config(dict(model_type="minimax_m2", hidden_size=256, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=8, num_local_experts=8,
                                     vocab_size=1024), name="m2")
    text = emit(model, Strategy(dp=2, micro_batch_size=1, num_micro_batches=2), "megatron")
    assert "not expressible" in text and "q/k norms over the whole projection" in text
    path = tmp_path / "run.sh"
    path.write_text(text)
    back = read_config(path).model
    assert back is not None and back.qk_norm and back.qk_norm_width == "head"


@pytest.mark.parametrize("preset,placement", [("gemma-3-1b", "sandwich norms (4 a layer"),
                                             ("olmo-2-7b", "post norms (2 a layer")])
def test_megatron_launch_says_it_cannot_write_post_or_sandwich_norms(preset, placement):
    """Megatron's layers norm before attention and MLP alone: a launch of Gemma 3 or OLMo 2 says
    so instead of silently writing a pre-norm model."""
    from ndplan.model import get_preset

    text = emit(get_preset(preset), Strategy(dp=2, micro_batch_size=1, num_micro_batches=2), "megatron")
    assert "not expressible" in text and placement in text


def test_megatron_full_recompute_of_zero_layers(tmp_path):
    """Megatron-Core checks only that --recompute-num-layers is given: with block, 0 recomputes
    the first 0 layers of each stage (none); with uniform its loop never advances."""
    base = ("--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 --seq-length 4096 "
            "--recompute-granularity full --recompute-num-layers 0 ")
    path = tmp_path / "block.sh"
    path.write_text(base + "--recompute-method block\n")
    result = read_config(path, model="llama-3.1-8b", devices=8)
    assert result.strategy().recompute == "none"
    assert any("checkpoints no layer" in w and "priced as no recompute" in w for w in result.warnings)
    path.write_text(base + "--recompute-method uniform\n")
    with pytest.raises(NdplanError, match="uniform loop advances by that many layers and never ends"):
        read_config(path, model="llama-3.1-8b", devices=8)


def test_megatron_cp_comm_types_are_one_per_layer(tmp_path):
    path = tmp_path / "cp.sh"
    flags = "--context-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --cp-comm-type"
    path.write_text(f"{flags} p2p a2a\n")  # Megatron-Core asserts one type per layer when several are given
    with pytest.raises(NdplanError, match="--cp-comm-type: 2 types, one per layer, but the model has 32 layers"):
        read_config(path, model="llama-3.1-8b", devices=8)
    path.write_text(f"{flags} {' '.join(['a2a'] * 32)}\n")
    assert read_config(path, model="llama-3.1-8b", devices=8).strategy().cp_kind == "ulysses"
    path.write_text(f"{flags} {' '.join(['a2a'] * 31)} a2b\n")
    with pytest.raises(NdplanError, match="--cp-comm-type: unknown type 'a2b'; known: p2p, a2a, allgather, a2a\\+p2p"):
        read_config(path, model="llama-3.1-8b", devices=8)


def test_megatron_cp_comm_types_that_differ_per_layer_price_the_most_layers_type(tmp_path):
    """Gemma 3 under Transformer Engine runs its sliding-window layers under a2a (or allgather)
    alone and may run the ring (p2p) on its full layers: the most layers' type prices every layer,
    said with the counts, so the launch is not read as a ring the runtime would refuse."""
    from ndplan.hardware import get_device
    from ndplan.search.run import runtime_refusals

    model = get_preset("gemma-3-27b")
    spans = model.layer_attention_spans
    assert (spans.count("sliding"), spans.count("full")) == (52, 10)
    types = " ".join("p2p" if span == "full" else "a2a" for span in spans)
    path = tmp_path / "gemma.sh"
    path.write_text("--context-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --seq-length 32768 "
                    f"--tensor-model-parallel-size 2 --sequence-parallel --cp-comm-type {types}\n")
    read = read_config(path, model="gemma-3-27b", devices=8)
    assert read.strategy().cp_kind == "ulysses"
    assert any(w.endswith("--cp-comm-type differs per layer (a2a ×52, p2p ×10); ndplan prices 'a2a', the type of "
                          "the most layers, for every layer") for w in read.warnings)
    assert runtime_refusals(read.strategy(), MemoryOptions(runtime="megatron"), model, get_device("h100-sxm")) == []


def test_megatron_unknown_and_unmodelled_flags_are_warnings(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text("torchrun --nproc_per_node 8 pretrain_gpt.py \\\n  --tensor-model-parallel-size 2 \\\n"
                    "  --micro-batch-size 1 --seq-length 4096 \\\n  --distribute-saved-activations \\\n"
                    "  --my-custom-flag 3 \\\n  --log-interval 1\n")
    warnings = read_config(path).warnings
    assert any(w.endswith("train.sh:4: --distribute-saved-activations: recomputation inputs split over the "
                          "tensor-parallel group are not modelled") for w in warnings)
    assert any("train.sh:5: --my-custom-flag: unknown to ndplan" in w for w in warnings)
    assert not any("--log-interval" in w for w in warnings)


def test_megatron_flags_that_hold_more_than_priced_warn(tmp_path):
    """A micro-batch group other than pp deepens Megatron's interleaved warm-up, and deferred
    embedding weight gradients keep the head's input and logits gradient per deferred micro-batch:
    both hold more than ndplan prices, so reading them warns (they were read as no effect)."""
    path = tmp_path / "train.sh"
    path.write_text("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \\\n"
                    "  --num-layers-per-virtual-pipeline-stage 2 --micro-batch-size 1 --seq-length 4096 \\\n"
                    "  --microbatch-group-size-per-virtual-pipeline-stage 8 \\\n"
                    "  --defer-embedding-wgrad-compute --wgrad-deferral-limit 4\n")
    warnings = read_config(path, model="llama-3.1-8b", devices=16).warnings
    assert any("--microbatch-group-size-per-virtual-pipeline-stage: the interleaved schedule's micro-batch group"
               in w and "(vpp - 1)·(g - pp) more" in w for w in warnings), warnings
    assert any("--defer-embedding-wgrad-compute: deferred output-layer weight gradients are not modelled" in w
               for w in warnings), warnings


def test_megatron_world_size_from_devices_when_the_script_has_none(tmp_path):
    path = tmp_path / "args.sh"
    path.write_text("--tensor-model-parallel-size 2 \\\n--micro-batch-size 1 --global-batch-size 16 --seq-length 2048\n")
    result = read_config(path, devices=8)
    assert result.strategy().dp == 4 and result.strategy().num_micro_batches == 4
    without = read_config(path)
    assert "dp" not in without.strategy_settings and any("--devices" in w for w in without.warnings)
    assert without.strategy(devices=16).dp == 8


def test_mindspeed_layer_list_and_ulysses(tmp_path):
    path = tmp_path / "pretrain.sh"
    path.write_text("python -m torch.distributed.launch --nproc_per_node 8 --nnodes 2 pretrain_gpt.py \\\n"
                    "  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \\\n"
                    "  --num-layer-list 7,8,9,8 --context-parallel-size 2 \\\n"
                    "  --context-parallel-algo ulysses_cp_algo --micro-batch-size 1 --global-batch-size 8 \\\n"
                    "  --seq-length 4096 --bf16\n")
    s = read_config(path, model="llama-3.1-8b").strategy()
    assert s.stage_layers == (7, 8, 9, 8) and (s.cp, s.cp_kind, s.dp) == (2, "ulysses", 1)


# ---------------------------------------------------------------- torchtitan
def test_torchtitan_defaults_checkpoint_every_second_layer(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8\n')
    result = read_config(path)
    s = result.strategy()
    assert s.recompute == "full" and s.recompute_layers == 16  # torchtitan's default: selective, every 2nd layer
    assert (s.micro_batch_size, s.seq_length) == (8, 2048)  # local_batch_size 8, seq_len 2048 by default
    assert any("selective_ac_option 2 checkpoints one layer in 2" in w for w in result.warnings)


@pytest.mark.parametrize("option, recompute, layers, words", [
    ("0", "full", 0, None),  # `not every`: every layer
    ("32", "full", 1, "checkpoints one layer in 32"),
    ("100", "none", 0, "which holds at most 32: no layer is checkpointed"),  # 32 % 100 never 0
])
def test_torchtitan_layer_frequency_edges(option, recompute, layers, words, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8\n'
                    f'[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "{option}"\n')
    result = read_config(path)
    s = result.strategy()
    assert (s.recompute, s.recompute_layers) == (recompute, layers)
    assert words is None or any(words in w for w in result.warnings)


def test_torchtitan_per_op_checkpointing_prices_its_own_policy(tmp_path, capsys):
    """selective_ac_option "op" is torchtitan's per-op policy (every second matmul rebuilt): the
    reader says so, and memory and step time both price it, below and above the pytorch runtime's
    own keep-every-matmul policy."""
    from ndplan.cli import main

    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8\n'
                    '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n')
    result = read_config(path)
    assert result.strategy().recompute == "selective"
    assert result.runtime_settings["selective_policy"] == "torchtitan-op"

    def estimate(*extra: str) -> dict:
        assert main(["estimate", "--from", str(path), "--hardware", "h100-sxm", "--json", *extra]) == 0
        data: dict = json.loads(capsys.readouterr().out)
        return data

    op, matmuls = estimate(), estimate("--selective-policy", "keep-matmuls")
    assert op["peak_bytes"] < matmuls["peak_bytes"] and op["time"]["step_s"] > matmuls["time"]["step_s"]
    # k, o_proj's output and up of each of 32 layers, 8 x 2048 tokens, bf16: what the op policy rebuilds
    per_layer = (1024 + 4096 + 14336) * 2 * 8 * 2048
    assert matmuls["stages"][0]["activations_bytes"] - op["stages"][0]["activations_bytes"] == 32 * per_layer
    with pytest.raises(NdplanError, match="selective_policy 'torchtitan-op' is not one runtime 'megatron' prices; "
                                          "allowed: megatron"):
        MemoryOptions(runtime="megatron", selective_policy="torchtitan-op")
    # The config's policy where the runtime cannot price it (or a census replaces the formulas):
    # the runtime's own, not an error; only the flag's is refused.
    assert estimate("--runtime", "megatron")["selective_policy"] is None
    assert main(["estimate", "--from", str(path), "--hardware", "h100-sxm", "--runtime", "megatron",
                 "--selective-policy", "torchtitan-op"]) == 2
    capsys.readouterr()
    # --emit torchtitan writes the per-op policy: a plan priced otherwise says what it left out
    from ndplan.io import emit

    text = emit(get_preset("llama-3.1-8b"), result.strategy(), "torchtitan", selective_policy="keep-matmuls")
    assert text.startswith("# ndplan: not expressible in torchtitan, left out: selective recompute as keep-matmuls")
    assert "not expressible" not in emit(get_preset("llama-3.1-8b"), result.strategy(), "torchtitan",
                                         selective_policy="torchtitan-op")

def test_torchtitan_llama3_fsdp_tp_pp():
    result = read_config(fixture("torchtitan_llama3_70b.toml"), devices=256)
    s = result.strategy()
    assert result.model is not None and result.model.name == "llama-3.1-70b"
    assert (s.dp, s.tp, s.pp, s.vpp, s.schedule) == (8, 8, 4, 2, "interleaved")
    assert s.zero == 3 and s.fsdp and s.shard_group == 0 and s.sequence_parallel
    assert not s.reshard_after_forward  # "default" keeps parameters gathered under PP
    assert s.embedding_as_layer and s.output_as_layer  # torchtitan's first/last stage weights of 1
    # local batch 16 in micro-batches of 1, global 1024 over dp 8: 8 accumulation steps, each one
    # run of the pipeline schedule over 16 micro-batches (torchtitan's train step).
    assert (s.micro_batch_size, s.num_micro_batches, s.pipeline_runs, s.global_batch_size, s.seq_length) == (
        1, 16, 8, 1024, 8192)
    assert any("8 gradient-accumulation steps, each one run of the pipeline schedule over 16" in n for n in result.notes)
    # The runs follow the data-parallel degree and the global batch, known later or changed by flags:
    # a run's micro-batches are the local batch's.
    unsized = read_config(fixture("torchtitan_llama3_70b.toml"))
    assert unsized.strategy(256).short() == s.short()
    from ndplan.cli_args import strategy_from_settings

    # A new micro-batch size splits the local batch anew; a new pipeline degree keeps it; given runs
    # or micro-batches win; without a pipeline a step is one run.
    for flags, short in (({"devices": 256, "gbs": 512}, "m16x4"), ({"devices": 512}, "m16x4"), ({"dp": 8}, "m16x8"),
                         ({"devices": 256, "mbs": 2}, "mbs2 m8x8"), ({"devices": 256, "pp": 2}, "m16x4"),
                         ({"devices": 256, "pipeline_runs": 2}, "m64x2"), ({"devices": 256, "num_micro_batches": 32},
                                                                         "m32x4"),
                         ({"devices": 256, "pp": 1, "vpp": 1, "schedule": "1f1b"}, "mbs1 m32 ")):
        merged = merge_settings(unsized, flags)
        assert short in strategy_from_settings(merged).short() + " ", flags
    with pytest.raises(NdplanError, match="--mbs 3 does not divide the config's local batch of 16"):
        merge_settings(unsized, {"devices": 256, "mbs": 3})
    assert s.recompute == "full" and s.precision.name == "fsdp-bf16"
    # enable_async_tensor_parallel = true: the TP collectives overlap their GEMMs in the step time.
    assert result.runtime_settings == {"loss_parallel": True, "overlap": {"preset": "torchtitan", "tp": True},
                                       "torch_compile": "model+loss"}  # [compile] enable, default components
    assert result.warnings == []
    assert check_strategy(s, result.model) == []


def test_torchtitan_needs_the_world_size_for_dp_shard_minus_one():
    result = read_config(fixture("torchtitan_llama3_70b.toml"))
    assert "dp" not in result.strategy_settings and any("--devices" in w for w in result.warnings)


def test_torchtitan_deepseek_v3_hsdp_ep():
    result = read_config(fixture("torchtitan_deepseek_v3_16b.toml"))
    s = result.strategy()
    assert result.model is not None and result.model.name == "deepseek-v2-lite"
    assert (s.dp, s.ep, s.etp, s.tp) == (64, 8, 1, 1)
    assert s.zero == 3 and s.fsdp and s.shard_group == 32  # HSDP: 2 replicas of 32-way shards
    assert s.recompute == "selective" and s.precision.compute_dtype == "fp8"
    assert (s.micro_batch_size, s.global_batch_size) == (4, 256)
    assert result.devices == 64
    assert check_strategy(s, result.model) == []


def test_torchtitan_deepseek_671b_flavour_has_no_mtp(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "deepseek_v3"\nflavor = "671B"\n[parallelism]\n'
                    "data_parallel_shard_degree = 64\nexpert_parallel_degree = 64\n")
    result = read_config(path)
    assert result.model is not None and result.model.mtp_depth == 0 and result.model.num_experts == 256


def test_torchtitan_optimizer_settings_that_move_memory_warn(tmp_path):
    """The optimizer section is quiet but for what changes what a device holds: another optimizer
    than Adam, and early_step_in_backward, whose per-parameter steps free each gradient as it is
    made (ndplan holds them until the step). The warnings name the line."""
    path = tmp_path / "job.toml"
    head = ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8\n'
            '[activation_checkpoint]\nmode = "none"\n[optimizer]\n')
    path.write_text(head + 'name = "AdamW"\nimplementation = "fused"\n')
    assert read_config(path).warnings == []
    path.write_text(head + 'name = "AdamW"\nearly_step_in_backward = true\n')
    assert read_config(path).warnings == [
        f"{path}:10: optimizer.early_step_in_backward: torchtitan steps each parameter as its gradient is made and "
        "frees the gradient, where ndplan holds every gradient until the step: the memory estimate is high by about "
        "the gradients' bytes"]
    path.write_text(head + 'name = "Lion"\nearly_step_in_backward = false\n')
    assert read_config(path).warnings == [f"{path}:9: optimizer.name Lion: ndplan prices Adam's two optimizer states"]


# ---------------------------------------------------------------- HyperParallel and MindFormers
def test_hyperparallel_hsdp_job():
    result = read_config(fixture("hyperparallel_qwen3_moe_hsdp.yaml"))
    s = result.strategy()
    assert result.model is not None and result.model.name == "qwen3-30b-a3b"
    assert (s.dp, s.tp, s.pp, s.cp, s.cp_kind, s.ep, s.etp) == (8, 2, 2, 2, "ulysses", 4, 1)
    assert s.zero == 3 and s.fsdp and s.shard_group == 8 and s.reshard_after_forward
    assert (s.micro_batch_size, s.num_micro_batches, s.global_batch_size, s.seq_length) == (1, 32, 256, 8192)
    assert s.recompute == "full" and s.sequence_parallel
    p = s.precision
    assert (p.param_bytes, p.grad_bytes, p.master_weight_bytes, p.optimizer_state_bytes) == (2, 2, 4, 4)
    assert result.runtime_settings == {"loss_parallel": True, "attention": "sdpa"}  # attn_implementation sdpa
    assert len(result.warnings) == 1 and "edp_shard_size" in result.warnings[0]
    assert check_strategy(s, result.model) == []


def test_hyperparallel_cp_algorithm_from_plan_overrides(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(
        "model:\n  pretrained_model_name_or_path: Qwen/Qwen3-8B\n  torch_dtype: bfloat16\n"
        "training:\n  global_batch_size: 8\n  micro_batch_size: 1\n"
        "accelerator:\n  tp_size: 2\n  cp_size: 4\n  sequence_parallel: true\n"
        "fsdp_config:\n  dp_shard_size: 2\n  reshard_after_forward: false\n"
        "plan_overrides:\n  - match: '*.self_attn'\n    when: cp\n    inner_wrapper:\n"
        "      _target_: hyper_parallel.cp_wrappers.sdpa_hf_hybrid_cp_wrapper\n      ulysses_degree: 2\n"
        "activation_checkpoint:\n  mode: off\n"
        "dataset:\n  data_config:\n    seq_length: 4096\n")
    result = read_config(path, devices=8)
    s = result.strategy()
    assert result.model is not None and result.model.name == "qwen3-8b"
    assert (s.dp, s.cp, s.cp_kind, s.ulysses_degree) == (1, 4, "hybrid", 2)
    assert s.zero == 3 and s.shard_group == 2 and not s.reshard_after_forward and s.recompute == "none"
    assert s.num_micro_batches == 8 and s.precision.name == "bf16-pure"


def test_mindformers_deepseek3_yaml():
    result = read_config(fixture("mindformers_deepseek3_671b.yaml"))
    model, s = result.model, result.strategy()
    assert model is not None and count_parameters(model).total == DSV3_PARAMS
    assert (s.dp, s.tp, s.pp, s.ep, s.etp) == (16, 4, 16, 8, 1) and s.sequence_parallel
    # 61 layers + 1 MTP unit: 15 stages of 4, and the last holds 1 layer and the MTP module.
    assert s.stage_layers == (4,) * 15 + (1,)
    assert s.zero == 3 and not s.fsdp and s.precision.name == "fsdp-bf16"
    assert s.recompute == "full" and s.recompute_layers == 3
    assert (s.num_micro_batches, s.global_batch_size, s.seq_length) == (32, 512, 4096)
    assert result.devices == 1024
    assert len(result.warnings) == 2 and "per-stage counts" in result.warnings[0]
    assert "recompute_slice_activation splits the saved recompute inputs" in result.warnings[1]
    assert check_strategy(s, model) == []


@pytest.mark.parametrize("counts, recompute, layers", [
    ("[5, 5]", "full", 5), ("[16, 16]", "full", 0), ("[20, 16]", "full", 0),
    # Not one count: the first stage's, whether below its 16 layers or all of them.
    ("[15, 5]", "full", 15), ("[16, 5]", "full", 0), ("[16, 0]", "full", 0), ("[0, 16]", "none", 0),
])
def test_mindformers_per_stage_recompute_counts(counts, recompute, layers, tmp_path):
    path = tmp_path / "mf.yaml"
    path.write_text("parallel_config: {data_parallel: 2, model_parallel: 2, pipeline_stage: 2, micro_batch_num: 4}\n"
                    f"recompute_config: {{recompute: {counts}}}\nmodel: {{model_config: {{seq_length: 4096}}}}\n")
    result = read_config(path, model="llama-3.1-8b")  # 32 layers: 16 per stage
    assert (result.strategy().recompute, result.strategy().recompute_layers) == (recompute, layers)
    representable = counts in ("[5, 5]", "[16, 16]", "[20, 16]")
    assert representable == (not any("not representable" in w for w in result.warnings))


def test_mindformers_gradient_accumulation_has_no_effect_under_a_pipeline(tmp_path):
    """MindFormers: under pipeline parallelism gradient accumulation does not take effect
    (micro_batch_num plays its part; docs/feature_cards/Training_Algorithms.md): said, not priced."""
    text = fixture("mindformers_deepseek3_671b.yaml").read_text()
    piped = tmp_path / "piped.yaml"
    piped.write_text(text.replace("  batch_size: 1\n", "  batch_size: 1\n  gradient_accumulation_steps: 4\n", 1))
    result = read_config(piped)
    assert result.strategy().num_micro_batches == 32 and result.strategy().global_batch_size == 512
    assert any("gradient_accumulation_steps 4 does not take effect with pipeline parallelism" in w
               for w in result.warnings)


def test_hf_config_is_a_model_only(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config("qwen3-8b")))
    result = read_config(path)
    assert result.format == "hf" and result.model is not None and result.strategy_settings == {}
    assert count_parameters(result.model).total == count_parameters(get_preset("qwen3-8b")).total


@pytest.mark.parametrize("name, fmt", [
    ("megatron_llama3_70b.sh", "megatron"), ("torchtitan_llama3_70b.toml", "torchtitan"),
    ("hyperparallel_qwen3_moe_hsdp.yaml", "hyperparallel"), ("mindformers_deepseek3_671b.yaml", "mindformers"),
])
def test_detect_format(name, fmt):
    assert detect_format(fixture(name))[0] == fmt


# ---------------------------------------------------------------- one-line errors
CASES = [
    # (file name, content, expected "file:line: field" prefix, words the message contains)
    ("train.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py \\\n  --tensor-model-parallel-size eight\n",
     "train.sh:2: --tensor-model-parallel-size", "expected an integer"),
    ("train.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py \\\n  --micro-batch-size 1 \\\n"
                 "  --pipeline-model-parallel-size $PP\n",
     "train.sh:3: --pipeline-model-parallel-size", "$PP is not set"),
    ("train.sh", 'ARGS="--tensor-model-parallel-size 2\ntorchrun pretrain_gpt.py $ARGS\n',
     "train.sh:1: malformed shell script", "unterminated double quote"),
    ("train.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py \\\n  --micro-batch-size 3 \\\n"
                 "  --global-batch-size 100 --seq-length 8\n",
     "train.sh:3: --global-batch-size", "not divisible by dp·micro-batch size = 8·3"),
    ("train.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 3\n",
     "train.sh:1: world size", "not divisible by tp·pp·cp"),
    ("train.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 30 \\\n"
                 "  --pipeline-model-parallel-size 4 --micro-batch-size 1\n",
     "train.sh:1: --num-layers", "do not split evenly"),
    ("train.sh", "torchrun --nproc_per_node 8 pretrain_gpt.py --micro-batch-size 1 \\\n"
                 "  --recompute-granularity full\n",
     "train.sh:2: --recompute-method", "needs --recompute-method uniform or block"),
    ("args.json", '{\n  "tensor_model_parallel_size": 2,\n  "micro_batch_size": ,\n}\n',
     "args.json:3: malformed JSON", "Expecting value"),
    ("args.yaml", "tensor_model_parallel_size: 2\nmicro_batch_size: two\nseq_length: 4096\n",
     "args.yaml:2: --micro-batch-size", "expected an integer"),
    ("job.toml", "[parallelism]\ntensor_parallel_degree = 2\npipeline_parallel_degree = = 2\n",
     "job.toml:3: malformed TOML", ""),
    ("job.toml", "[model]\nname = \"llama3\"\nflavor = \"8B\"\n\n[parallelism]\ndata_parallel_shard_degree = 4\n"
                 "tensor_paralel_degree = 2\n",
     "job.toml:7: parallelism.tensor_paralel_degree", "unknown field"),
    ("job.toml", "[parallelisms]\ntensor_parallel_degree = 2\n", "job.toml:1: parallelisms", "unknown section"),
    ("job.toml", "[parallelism]\ndata_parallel_shard_degree = 2\npipeline_parallel_degree = 2\n"
                 "pipeline_parallel_schedule = \"Loop\"\n",
     "job.toml:4: parallelism.pipeline_parallel_schedule", "unknown schedule 'Loop'"),
    ("job.toml", "[training]\nlocal_batch_size = 3\nglobal_batch_size = 100\n[parallelism]\n"
                 "data_parallel_shard_degree = 4\n",
     "job.toml:3: training.global_batch_size", "not divisible"),
    ("job.toml", "[parallelism]\ndata_parallel_replicate_degree = 2\n",
     "job.toml:1: parallelism.data_parallel_shard_degree", "give --devices"),
    ("train.yaml", "model:\n  _target_: x.y\naccelerator:\n  tp_size: 2\n  pp_sise: 2\n",
     "train.yaml:5: accelerator.pp_sise", "unknown field"),
    ("train.yaml", "context:\n  device_num: 12\naccelerator:\n  tp_size: 8\n",
     "train.yaml:2: context.device_num", "not divisible by tp·pp = 8"),
    ("train.yaml", "context:\n  device_num: 8\ntraining:\n  global_batch_size: 64\n  micro_batch_size: 1\n"
                   "  micro_batch_num: 4\naccelerator:\n  tp_size: 2\n",
     "train.yaml:4: training.global_batch_size", "dp·micro_batch_size·micro_batch_num = 4·1·4 = 16"),
    ("mf.yaml", "parallel_config:\n  data_parallel: 2\n  model_paralel: 2\n",
     "mf.yaml:3: parallel_config.model_paralel", "unknown field"),
    ("mf.yaml", "parallel_config:\n  data_parallel: 1\n  pipeline_stage: 4\nmodel:\n  model_config:\n"
                "    num_layers: 30\n    hidden_size: 1024\n    num_heads: 8\n    vocab_size: 1000\n"
                "    offset: [1, 0, 0, 0]\n",
     "mf.yaml:10: model.model_config.offset", "must sum to 30 % (pp·vpp = 4) = 2"),
    ("mf.yaml", "parallel_config:\n  data_parallel: 2\n    model_parallel: 2\n", "mf.yaml:3: malformed YAML", ""),
    ("config.json", '{"model_type": "llama", "num_hidden_layers": 2,\n "hidden_size": 64,\n}',
     "config.json:3: malformed JSON", ""),
]


@pytest.mark.parametrize("name, content, prefix, words", CASES, ids=[c[2].split(": ", 1)[-1] + "|" + c[0] for c in CASES])
def test_malformed_files_give_one_line_errors(tmp_path, name, content, prefix, words):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(NdplanError) as info:
        read_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(tmp_path / prefix)), message
    assert words in message


def test_devices_that_contradict_the_file(tmp_path):
    with pytest.raises(NdplanError, match=r"megatron_llama3_70b\.sh:\d+: world size: the launch command gives 64"):
        read_config(fixture("megatron_llama3_70b.sh"), devices=32)
    with pytest.raises(NdplanError, match=r"mindformers_deepseek3_671b\.yaml:\d+: parallel_config.data_parallel"):
        read_config(fixture("mindformers_deepseek3_671b.yaml"), devices=512)


def test_unrecognised_files(tmp_path):
    path = tmp_path / "notes.yaml"
    path.write_text("hello: world\n")
    with pytest.raises(NdplanError, match="cannot tell which framework"):
        read_config(path)
    with pytest.raises(NdplanError, match="no such file"):
        read_config(tmp_path / "missing.sh")
    script = tmp_path / "run.sh"
    script.write_text("echo hello\n")
    with pytest.raises(NdplanError, match="no Megatron-LM launch command found"):
        read_config(script)


# ---------------------------------------------------------------- writing
@pytest.mark.parametrize("fmt", ["megatron", "torchtitan", "hyperparallel", "mindformers"])
def test_emitted_configs_parse_as_their_syntax(fmt, tmp_path):
    model = get_preset("deepseek-v3")
    s = Strategy(dp=8, tp=2, pp=4, vpp=2, schedule="interleaved", ep=8, etp=1, sequence_parallel=True, zero=1,
                 micro_batch_size=1, num_micro_batches=16, stage_layers=(8, 8, 8, 8, 8, 8, 8, 5),
                 recompute="full", seq_length=4096)
    text = emit(model, s, fmt)
    assert text.startswith("#")
    if fmt == "megatron":
        assert '"${PARALLEL_ARGS[@]}"' in text and "--pipeline-model-parallel-layout" in text
        if shutil.which("bash"):
            path = tmp_path / "run.sh"
            path.write_text(text)
            subprocess.run(["bash", "-n", str(path)], check=True)
    elif fmt == "torchtitan":
        import tomllib

        data = tomllib.loads(text)
        assert data["parallelism"]["expert_parallel_degree"] == 8
        assert len(data["parallelism"]["module_fqns_per_model_part"]) == 8
    else:
        assert isinstance(yaml.safe_load(text), dict)
    assert emit(s, model, fmt) == text  # either argument order


def test_megatron_emit_says_a_launch_it_writes_as_planned_will_be_refused():
    """A strategy Megatron refuses (expert beside tensor parallelism without SP) is written as
    planned: its header says Megatron will refuse the launch, not that something was left out."""
    s = Strategy(dp=2, tp=2, ep=2, micro_batch_size=1, num_micro_batches=4)
    text = emit(get_preset("mixtral-8x7b"), s, "megatron")
    assert ("# ndplan: Megatron-LM will refuse this launch: ep=2 with tp=2 without sequence parallelism" in text)
    assert "left out: ep=2" not in text and "--expert-model-parallel-size 2" in text


def test_torchtitan_emit_says_settings_its_parallel_dims_refuse():
    """torchtitan lays experts over the data-parallel shards (ParallelDims._validate): plain DDP
    (no shards) with ep 4 is refused there, and seq_len must divide by tp·2·cp; the written job
    says so (search --emit skipped such rows, estimate --emit wrote them silently)."""
    ddp = Strategy(dp=16, ep=4, micro_batch_size=1, num_micro_batches=1, global_batch_size=16)
    text = emit(get_preset("mixtral-8x7b"), ddp, "torchtitan")
    assert "# ndplan: torchtitan will refuse these settings: expert_parallel_degree 4 with etp 1" in text
    fsdp = ddp.model_copy(update={"zero": 3, "fsdp": True})
    assert "will refuse" not in emit(get_preset("mixtral-8x7b"), fsdp, "torchtitan")
    odd = Strategy(dp=2, tp=4, sequence_parallel=True, seq_length=4100, micro_batch_size=1, num_micro_batches=1,
                   global_batch_size=2)
    assert "seq_len 4100: torchtitan needs it divisible by tp·2·cp = 8" in emit(get_preset("llama-3.1-8b"), odd,
                                                                                 "torchtitan")


def test_emit_lists_what_the_format_cannot_express():
    s = Strategy(dp=2, tp=2, pp=2, schedule="gpipe", micro_batch_size=1, num_micro_batches=4, precision="fsdp-bf16")
    text = emit(get_preset("llama-3.1-8b"), s, "megatron")
    assert "# ndplan: not expressible in Megatron-LM, left out: schedule 'gpipe'" in text
    assert "precision 'fsdp-bf16'" in text
    with pytest.raises(NdplanError, match="unknown output format"):
        emit(None, s, "deepspeed")
    # Megatron refuses torch FSDP2 beside a pipeline: kept-gathered FSDP is written as
    # Megatron-FSDP, which reshards, and said; and the runs a step of torchtitan's takes are lost.
    kept = Strategy(dp=4, pp=2, zero=3, fsdp=True, reshard_after_forward=False, num_micro_batches=4, pipeline_runs=2)
    text = emit(get_preset("llama-3.1-8b"), kept, "megatron")
    assert "--use-megatron-fsdp" in text and "--torch-fsdp2-no-reshard-after-forward" not in text
    assert "written as Megatron-FSDP, which reshards" in text and "pipeline_runs=2" in text


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan", "hyperparallel", "mindformers"])
def test_emit_takes_a_preset_name_for_the_model(fmt):
    """A fuzzing review: emit("llama-3.1-8b", ...) dropped the name and wrote a model-less file."""
    s = Strategy(dp=2, tp=2, pp=2, micro_batch_size=1, num_micro_batches=4)
    assert emit("llama-3.1-8b", s, fmt) == emit(get_preset("llama-3.1-8b"), s, fmt)
    with pytest.raises(NdplanError, match="emit's model must be a ModelSpec, a preset name or a model file path, "
                                          "got int"):
        emit(8, s, fmt)  # type: ignore[arg-type]


# ---------------------------------------------------------------- CLI pieces
def _inspect_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_inspect_arguments(parser)
    return parser.parse_args(list(argv))


def test_inspect_json_summary(capsys):
    code = cmd_inspect(_inspect_args(str(fixture("torchtitan_llama3_70b.toml")), "--devices", "256", "--json"))
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["format"] == "torchtitan" and data["model"]["name"] == "llama-3.1-70b"
    assert data["cluster"]["devices"] == 256
    assert data["strategy"]["short"] == "dp8 tp8 sp pp4 vpp2 fsdp3 mbs1 m16x8 interleaved rc-full"


def test_inspect_table_and_conversion(capsys):
    assert cmd_inspect(_inspect_args(str(fixture("megatron_deepseek_v3.sh")))) == 0
    out = capsys.readouterr().out
    assert "dp32 tp2 sp pp16 ep64 etp1 zero1 mbs1 m256 1f1b rc-selective(layernorm+moe_act+mla_up_proj)" in out
    assert "1024 devices = 128 nodes × 8" in out
    # the runtime settings the config states, beside the strategy
    assert "runtime settings: overlap dp_grad_reduce=True, dp_param_gather=True, tp=False, ep_dispatch=node_dedup; " \
           "runtime megatron" in " ".join(out.split())
    assert cmd_inspect(_inspect_args(str(fixture("megatron_deepseek_v3.sh")), "--to", "torchtitan")) == 0
    converted = capsys.readouterr()
    assert "expert_parallel_degree = 64" in converted.out and converted.err == ""
    assert "left out: Megatron's recompute modules (layernorm moe_act mla_up_proj)" in converted.out


def test_inspect_summary_of_an_incomplete_config(tmp_path, capsys):
    summary = inspect_summary(read_config(fixture("torchtitan_llama3_70b.toml")))
    assert summary["strategy"] is None and summary["cluster"]["devices"] is None
    # An incomplete strategy's precision (a policy, not a preset's name) is shown as a complete one's.
    path = tmp_path / "fp16.sh"
    path.write_text("--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 --fp16\n")
    assert cmd_inspect(_inspect_args(str(path))) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "strategy: incomplete" in out
    assert "megatron-fp16-grad16 (param 2 B, grad 2 B, master 4 B, optimizer 2×4 B, fp16)" in out


def test_from_argument_and_merging():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--devices", type=int)
    add_from_argument(parser)
    args = parser.parse_args(["--from", str(fixture("megatron_llama3_70b.sh")), "--model", "llama-3.1-70b"])
    result = read_from_args(args)
    assert result is not None and result.format == "megatron"
    # A flag for tp makes the file's dp (world / (tp·pp·cp)) stale: it is dropped and re-derived.
    merged = merge_settings(result, {"tp": 4, "model": "llama-3.1-70b", "pp": None})
    assert merged["tp"] == 4 and "dp" not in merged and "num_micro_batches" not in merged
    assert merged["devices"] == 64 and merged["pp"] == 4 and merged["gbs"] == 512
    assert model_for(merged, result).vocab_size == 129024
    assert model_for({"model": "llama-3.1-8b"}, None).name == "llama-3.1-8b"
    with pytest.raises(NdplanError, match="missing --model"):
        model_for({}, read_config(fixture("megatron_llama3_70b.sh")))
    assert read_from_args(parser.parse_args([])) is None


def test_a_files_uneven_split_survives_model_as_base(tmp_path):
    """--model is the base the file's flags build on, so the file's layer split (which counts
    that model's layers) is kept; a flag for pp or vpp makes it stale."""
    script = tmp_path / "run.sh"
    script.write_text("torchrun pretrain_gpt.py --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 "
                      "--decoder-first-pipeline-num-layers 19 --decoder-last-pipeline-num-layers 19 "
                      "--micro-batch-size 1 --global-batch-size 256 --seq-length 4096 --bf16\n")
    result = read_config(script, model="llama-3.1-70b", devices=64)
    assert merge_settings(result, {"model": "llama-3.1-70b"})["stage_layers"] == (19, 21, 21, 19)
    assert "stage_layers" not in merge_settings(result, {"model": "llama-3.1-70b", "pp": 2})


@pytest.mark.parametrize("flags,grad_bytes", [
    ("--fp16", 2), ("--fp16 --accumulate-allreduce-grads-in-fp32", 4), ("--bf16", 4), ("--bf16 --grad-reduce-in-bf16", 2),
])
def test_megatron_gradient_width_follows_its_precision_rules(flags, grad_bytes, tmp_path):
    """Megatron forces fp32 gradient accumulation under bf16 only: fp16 keeps fp16 gradients
    unless --accumulate-allreduce-grads-in-fp32 (Megatron-LM's own GPT-3 175B example sets it)."""
    script = tmp_path / "run.sh"
    script.write_text(f"torchrun pretrain_gpt.py --micro-batch-size 1 --global-batch-size 8 --seq-length 512 {flags}\n")
    strategy = read_config(script, model="llama-3.1-8b", devices=8).strategy()
    assert strategy.precision.grad_bytes == grad_bytes
    assert "--accumulate-allreduce-grads-in-fp32" not in " ".join(read_config(script, model="llama-3.1-8b", devices=8).warnings)


def test_megatron_fp8_parameters_read_and_written_back(tmp_path):
    """--fp8-param-gather keeps the linear weights in fp8 (megatron-fp8-param-grad16 with
    --grad-reduce-in-bf16), which the launch writer writes back; without --fp8-format it keeps
    none, and the reader says it ignores the flag."""
    script = tmp_path / "run.sh"
    script.write_text("torchrun pretrain_gpt.py --micro-batch-size 1 --global-batch-size 8 --seq-length 512 "
                      "--bf16 --fp8-format hybrid --fp8-param-gather --grad-reduce-in-bf16\n")
    result = read_config(script, model="llama-3.1-8b", devices=8)
    strategy = result.strategy()
    assert strategy.precision.name == "megatron-fp8-param-grad16" and strategy.precision.fp8_params
    assert not [w for w in result.warnings if "fp8" in w]
    text = emit(get_preset("llama-3.1-8b"), strategy, "megatron")
    assert "--fp8-param-gather" in text
    again = tmp_path / "again.sh"
    again.write_text(text)
    assert read_config(again, model="llama-3.1-8b", devices=8).strategy().precision.name == "megatron-fp8-param-grad16"
    script.write_text("torchrun pretrain_gpt.py --micro-batch-size 1 --global-batch-size 8 --seq-length 512 "
                      "--bf16 --fp8-param-gather\n")
    plain = read_config(script, model="llama-3.1-8b", devices=8)
    assert not plain.strategy().precision.fp8_params
    assert any("--fp8-param-gather without --fp8-format keeps no fp8 weights; ignored" in w for w in plain.warnings)


def test_megatron_default_ffn_applies_over_a_base_model(tmp_path):
    """An architecture without --ffn-hidden-size gets Megatron's default (SwiGLU: int(4h·2/3/64)·64)
    even with --model, with a warning where the base differs, as every other Megatron default."""
    script = tmp_path / "run.sh"
    script.write_text("torchrun pretrain_gpt.py --num-layers 80 --hidden-size 8192 --num-attention-heads 64 "
                      "--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm "
                      "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope "
                      "--micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --bf16\n")
    result = read_config(script, model="llama-2-70b", devices=8)
    assert result.model is not None and result.model.ffn_hidden_size == 21824
    assert any("Megatron's default --ffn-hidden-size sets ffn_hidden_size=21824 but llama-2-70b has 28672" in w
               for w in result.warnings)


def test_framework_spellings_the_readers_used_to_miss(tmp_path):
    """MindSpeed's kvallgather CP (all-gather CP, no warning), MindFormers' 'swiglu' (gated SiLU), and
    torchtitan's fp8 FSDP all-gather (one byte per gathered weight, and written back)."""
    script = tmp_path / "run.sh"
    script.write_text("torchrun pretrain_gpt.py --context-parallel-size 2 --context-parallel-algo kvallgather_cp_algo "
                      "--micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --bf16\n")
    result = read_config(script, model="llama-3.1-8b", devices=8)
    assert result.strategy().cp_kind == "allgather" and not any("kvallgather" in w for w in result.warnings)
    toml = tmp_path / "train.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["float8"]\n[training]\nlocal_batch_size = 1\n'
                    'seq_len = 8192\nmixed_precision_param = "bfloat16"\ndata_parallel_shard_degree = -1\n'
                    '[float8]\nenable_fsdp_float8_all_gather = true\n')
    read = read_config(toml, devices=8)
    assert read.strategy().precision.param_gather_bytes == 1
    again = tmp_path / "again.toml"
    again.write_text(emit(read.model, read.strategy(), "torchtitan"))
    assert read_config(again, devices=8).strategy().precision.param_gather_bytes == 1
    yaml_text = fixture("mindformers_deepseek3_671b.yaml").read_text()
    assert "hidden_act" not in yaml_text
    config = tmp_path / "mf.yaml"
    config.write_text(yaml_text.replace("    hidden_size: 7168\n", "    hidden_size: 7168\n    hidden_act: 'swiglu'\n"))
    model = read_config(config).model
    assert model is not None and model.activation == "silu" and model.gated_mlp


def test_an_argument_file_of_any_name_and_a_folder(tmp_path):
    """Lines of Megatron flags are detected whatever the file's extension or first flag; a folder
    is named as one."""
    args = tmp_path / "args.txt"
    args.write_text("--num-layers 4\n--hidden-size 256\n--micro-batch-size 1\n")
    assert read_config(args).format == "megatron"
    with pytest.raises(NdplanError, match="a folder; give the config file in it"):
        read_config(tmp_path)


@pytest.mark.parametrize("dp, mp, ep, words, shard_group", [
    # dp16·tp4 = 64 expert ranks over ep 8 and etp 1: ndplan's groups of 8 hold 8·4/8 = 4 expert
    # ranks each; MindSpore shards each expert over 8 of its 8 data-parallel ranks.
    (16, 4, 8, "MindSpore shards the experts' states over 8 of their 8 data-parallel ranks "
               "(optimizer_weight_shard_size 8); ndplan prices 4", 8),
    # tp 1, ep 16: a shard group of 8 cannot hold an expert group of 16 ranks; the smallest that
    # can, 16, is every data-parallel rank of dp 16 (priced without groups) or half of dp 32
    (16, 1, 16, "optimizer_weight_shard_size 8: ndplan shards over whole expert groups "
                "(shard_group·tp a multiple of ep·etp = 16); priced over all 16 data-parallel ranks", 0),
    (32, 1, 16, "priced over shard groups of 16", 16),
])
def test_mindformers_shard_size_with_expert_parallelism_is_priced_and_said(tmp_path, dp, mp, ep, words, shard_group):
    """MindSpore shards each parameter over its own data-parallel group; ndplan's shard groups
    hold whole expert groups (torchtitan, Megatron). Where they differ the reader says so, and
    a size that cannot hold an expert group is priced over every data-parallel rank."""
    text = fixture("mindformers_deepseek3_671b.yaml").read_text()
    text = text.replace("  data_parallel: &dp 16\n", f"  data_parallel: &dp {dp}\n")
    text = text.replace("  model_parallel: 4\n", f"  model_parallel: {mp}\n")
    text = text.replace("  expert_parallel: 8\n", f"  expert_parallel: {ep}\n")
    text = text.replace("    gradient_accumulation_shard: True\n",
                        "    gradient_accumulation_shard: True\n    optimizer_weight_shard_size: 8\n")
    config = tmp_path / "mf.yaml"
    config.write_text(text)
    result = read_config(config)
    s = result.strategy()
    assert any(words in w for w in result.warnings), result.warnings
    assert s.shard_group == shard_group and check_strategy(s, result.model) == []


def test_flags_repeating_a_config_value_keep_what_it_derives():
    """--devices equal to the file's own world size changes nothing, so the file's shard group
    (derived from the degrees) stays; a different device count drops it to be derived again."""
    from ndplan.io.cli import merge_settings

    result = read_config(fixture("hyperparallel_qwen3_moe_hsdp.yaml"))
    assert merge_settings(result, {"devices": 64})["shard_group"] == 8
    assert merge_settings(result, {"devices": 64, "tp": 2})["shard_group"] == 8
    assert "shard_group" not in merge_settings(result, {"devices": 128})


def test_torchtitan_with_a_deepseek_model_given_builds_no_mtp(tmp_path):
    """A fuzzing review: --model deepseek-v3 over a torchtitan file priced MTP, which torchtitan's
    DeepSeek-V3 does not build (and the emit check could not see the difference)."""
    text = (Path(__file__).parent / "fixtures" / "io" / "torchtitan_deepseek_v3_16b.toml").read_text()
    path = tmp_path / "job.toml"
    path.write_text(text.replace('flavor = "16B"', 'flavor = "671B"'))
    read = read_config(path, model="deepseek-v3")
    assert read.model is not None and read.model.mtp_depth == 0
    assert any("torchtitan's deepseek_v3 model builds no MTP module; --model deepseek-v3's mtp_depth 1 is left out"
               in w for w in read.warnings), read.warnings
    # the emit check now sees it: the file runs mtp_depth 0 where MTP was priced
    from ndplan.cli_emit import read_back
    from ndplan.hardware import Cluster, resolve_device

    model, device = get_preset("deepseek-v3"), resolve_device("h100-sxm")
    s = Strategy(dp=64, pp=16, ep=64, zero=3, fsdp=True, recompute="full", num_micro_batches=32,
                 global_batch_size=2048, precision="fsdp-bf16")
    check = read_back(model, s, emit(model, s, "torchtitan"), "torchtitan", Cluster(device=device, num_devices=1024),
                      MemoryOptions(runtime="pytorch"), device.memory_bytes)
    assert "mtp_depth 0 (priced 1)" in check["differs"]


def test_an_unset_node_count_leaves_the_world_size_to_devices(tmp_path):
    """A fuzzing review: `--nnodes $NNODES` (unset) read as one node, so --devices 16, which the
    warning advised, was refused as "the launch command gives 8 devices"."""
    path = tmp_path / "launch.sh"
    path.write_text("torchrun --nproc_per_node 8 --nnodes $NNODES pretrain_gpt.py --num-layers 32\n")
    read = read_config(path, model="llama-3.1-8b", devices=16)
    assert read.devices == 16 and read.strategy(16).dp == 16
    assert any("--nnodes ''" in w and "give --devices" in w for w in read.warnings), read.warnings
    with pytest.raises(NdplanError, match="--devices 12 is not a whole number of nodes of --nproc_per_node 8 devices"):
        read_config(path, model="llama-3.1-8b", devices=12)


@pytest.mark.parametrize("parallel, precision", [
    ("data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 4\n", "fp32"),
    ("data_parallel_replicate_degree = 4\ndata_parallel_shard_degree = 1\npipeline_parallel_degree = 2\n", "fp32"),
    ("data_parallel_replicate_degree = 8\ndata_parallel_shard_degree = 1\n", "fsdp-bf16"),  # DDP: autocast
    ("data_parallel_shard_degree = 2\ntensor_parallel_degree = 4\n", "fsdp-bf16"),  # FSDP's policy
])
def test_torchtitan_tp_or_pp_without_fsdp_trains_in_fp32(parallel, precision, tmp_path):
    # torchtitan/distributed/utils.py maybe_enable_amp: without FSDP, TP or PP disables mixed
    # precision ("Mixed precision training with TP or PP is only supported when FSDP/HSDP/CP is enabled").
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nmixed_precision_param = "bfloat16"\n'
                    f"[parallelism]\n{parallel}")
    result = read_config(path, devices=8)
    assert result.strategy_settings["precision"] == precision
    assert (precision == "fp32") == any("mixed precision" in w for w in result.warnings)


def test_torchtitan_emit_says_bf16_without_fsdp_under_tp_runs_fp32():
    text = emit("llama-3.1-8b", Strategy(dp=2, tp=4, sequence_parallel=True, precision="fsdp-bf16"), "torchtitan")
    assert "disables it under TP or PP without FSDP" in text
    assert "without FSDP" not in emit("llama-3.1-8b", Strategy(dp=8, precision="fsdp-bf16"), "torchtitan")
    assert "without FSDP" not in emit("llama-3.1-8b", Strategy(dp=2, tp=4, sequence_parallel=True, zero=3, fsdp=True,
                                                                precision="fsdp-bf16"), "torchtitan")


@pytest.mark.parametrize("name, vpp, schedule", [
    ("PipelineScheduleSingle", 1, "1f1b"), ("PipelineScheduleMulti", 2, "interleaved"),
    ("pipelineschedulemulti", 2, "interleaved"),  # torch's get_schedule_class is case-insensitive
])
def test_torchtitan_csv_schedule_names(name, vpp, schedule, tmp_path):
    # torchtitan's pipeline_parallel_schedule_csv "must be either PipelineScheduleSingle,
    # PipelineScheduleMulti, or _PipelineScheduleRuntime" (job_config.py); the name decides the
    # stages per rank (single: 1, multi: 2) while the CSV's actions run.
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\n[parallelism]\n'
                    f'data_parallel_shard_degree = 2\npipeline_parallel_degree = 4\npipeline_parallel_schedule = "{name}"\n'
                    'pipeline_parallel_schedule_csv = "sched.csv"\n')
    result = read_config(path)
    s = result.strategy()
    assert (s.vpp, s.schedule) == (vpp, schedule)
    assert any("CSV schedule is priced as" in w for w in result.warnings)
    path.write_text(path.read_text().replace('pipeline_parallel_schedule_csv = "sched.csv"\n', ""))
    with pytest.raises(NdplanError, match=r"pipeline_parallel_schedule.*pipeline_parallel_schedule_csv"):
        read_config(path)


@pytest.mark.parametrize("pp, micro", [(1, 1), (2, 4)])
def test_mindformers_micro_batch_interleave_multiplies_the_batch(pp, micro, tmp_path):
    # MindFormers base_trainer (_check_global_batch_size_for_auto_parallel): global_batch_size =
    # batch_size · data_parallel · micro_batch_num · micro_batch_interleave_num (pipeline) or
    # batch_size · data_parallel · micro_batch_interleave_num · gradient_accumulation_steps; each
    # micro-batch of batch_size·n is split n ways by MicroBatchInterleaved inside one graph.
    path = tmp_path / "mf.yaml"
    path.write_text(f"parallel_config: {{data_parallel: 4, model_parallel: 2, pipeline_stage: {pp}, "
                    f"micro_batch_num: {micro}}}\nmicro_batch_interleave_num: 2\nrunner_config: {{batch_size: 3}}\n"
                    "model: {model_config: {seq_length: 4096}}\n")
    result = read_config(path, model="llama-3.1-8b")
    s = result.strategy()
    assert s.global_batch_size == 3 * 4 * micro * 2
    assert (s.micro_batch_size, s.num_micro_batches) == (6, micro)
    assert any("micro_batch_interleave_num 2" in w for w in result.warnings)


def test_mindformers_hybrid_cp_defaults_to_one_ulysses_rank(tmp_path):
    # TransformerOpParallelConfig(..., context_parallel_algo="colossalai_cp", ulysses_degree_in_cp=1):
    # hybrid_cp without ulysses_degree_in_cp runs with its default of 1, which MindFormers accepts.
    path = tmp_path / "mf.yaml"
    path.write_text("parallel_config: {data_parallel: 2, model_parallel: 1, context_parallel: 4, "
                    "context_parallel_algo: hybrid_cp}\nmodel: {model_config: {seq_length: 8192}}\n")
    s = read_config(path, model="llama-3.1-8b").strategy()
    assert (s.cp, s.cp_kind, s.ulysses_degree) == (4, "hybrid", 1)


@pytest.mark.parametrize("compile_, refused", [
    ("", True), ("[compile]\nenable = false\n", True), ('[compile]\nenable = true\ncomponents = ["loss"]\n', True),
    ("[compile]\nenable = true\n", False), ('[compile]\nenable = true\ncomponents = ["model"]\n', False),
])
def test_torchtitan_async_tp_needs_the_model_compiled(compile_, refused, tmp_path):
    # torchtitan's parallelize functions: `if parallelism.enable_async_tensor_parallel and not
    # model_compile_enabled: raise RuntimeError("Async TP requires torch.compile")`, with
    # model_compile_enabled = compile.enable and "model" in compile.components (default model, loss).
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 2\n'
                    f"tensor_parallel_degree = 4\nenable_async_tensor_parallel = true\n{compile_}")
    if refused:
        with pytest.raises(NdplanError, match=r"enable_async_tensor_parallel.*\[compile\] enable"):
            read_config(path)
    else:
        assert read_config(path).runtime_settings["overlap"]["tp"] is True


def test_mindformers_a_bad_params_dtype_is_named_as_written(tmp_path):
    path = tmp_path / "mf.yaml"
    path.write_text("parallel_config: {data_parallel: 8}\nmodel: {model_config: {seq_length: 4096, params_dtype: int8}}\n")
    with pytest.raises(NdplanError, match=r"model\.model_config\.params_dtype: expected float32, bfloat16 or float16"):
        read_config(path, model="llama-3.1-8b")


def test_megatron_ddp_bucket_size_reaches_the_step_time(tmp_path):
    """--ddp-bucket-size is the gradient bucket the step time leaves exposed at the end of the
    backward (parameters); unset, Megatron-Core's default stands (no switch)."""
    from ndplan.perf import parse_overlap

    script = tmp_path / "train.sh"
    text = fixture("megatron_llama3_70b.sh").read_text()
    script.write_text(text.replace("    --overlap-grad-reduce\n", "    --overlap-grad-reduce\n    --ddp-bucket-size 80000000\n"))
    overlap = parse_overlap(read_config(script, model="llama-3.1-70b").runtime_settings["overlap"])
    assert overlap is not None and overlap.dp_bucket_params == 80_000_000 and overlap.dp_grad_reduce
    plain = parse_overlap(read_config(fixture("megatron_llama3_70b.sh"), model="llama-3.1-70b").runtime_settings["overlap"])
    assert plain is not None and plain.dp_bucket_params is None


@pytest.mark.parametrize("compile_, compiled", [
    ("", "off"), ("[compile]\nenable = false\n", "off"), ("[compile]\nenable = true\n", "model+loss"),
    ('[compile]\nenable = true\ncomponents = ["model"]\n', "model"),
    ('[compile]\nenable = true\ncomponents = ["loss"]\n', "loss"),
    ('[compile]\nenable = true\ncomponents = "model,loss"\n', "model+loss"),
    ("[training]\ncompile = true\n", "model"),  # before [compile]: each block compiled, the loss eager
])
def test_torchtitan_compile_is_read_for_the_step_time(compile_, compiled, tmp_path):
    """What torchtitan compiles reaches the runtime options (torch_compile), and an emitted job
    writes it back as it was read."""
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8\n{compile_}')
    result = read_config(path)
    assert result.runtime_settings["torch_compile"] == compiled
    text = emit(get_preset("llama-3.1-8b"), result.strategy(8), "torchtitan", torch_compile=compiled)
    again = tmp_path / "again.toml"
    again.write_text(text)
    assert read_config(again).runtime_settings["torch_compile"] == compiled
    if compiled != "off":
        assert "[compile]" in text and "left out: torch.compile" not in text
        assert f"left out: torch.compile of the {compiled.replace('+', ' and ')}" in emit(
            get_preset("llama-3.1-8b"), result.strategy(8), "megatron", torch_compile=compiled)


def test_a_config_json_replaced_by_the_model_given_is_still_read_and_said(tmp_path):
    """`--from config.json --model X`: X replaces the file's model, as --model completes or
    overrides any config's; the file is read all the same (a broken one is an error) and a
    warning says which model is priced where the two differ (it was ignored unread)."""
    from ndplan.model import hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config("llama-3.1-8b")))
    assert read_config(path, model="llama-3.1-8b", fmt="hf").warnings == []  # the same model
    result = read_config(path, model="llama-3.1-70b", fmt="hf")
    assert result.model.name == "llama-3.1-70b"
    assert "the model given (llama-3.1-70b) replaces the one this config describes" in result.warnings[0]
    assert "32 layers, hidden 4096); leave out --model" in result.warnings[0]
    path.write_text('{"model_type": "llama", "hidden_size": "wide"}')
    with pytest.raises(NdplanError, match="config.json"):
        read_config(path, model="llama-3.1-70b", fmt="hf")


def test_a_megatron_launch_runs_the_clusters_devices_per_node(tmp_path):
    """torchrun's --nproc_per_node is the node's device count: 4 on a GB200 tray (it was always 8,
    a launch of 64 eight-GPU nodes for 256 GB200s), 8 by default, the whole job on one node where
    it is smaller; a launch read and written again keeps its own."""
    model = get_preset("llama-3.1-8b")
    launch = {world: emit(model, Strategy(dp=world, micro_batch_size=1, num_micro_batches=1), "megatron",
                          devices_per_node=per_node).splitlines()[-1]
              for world, per_node in ((256, 4), (16, None), (2, 4), (12, 8))}
    assert launch[256].startswith("torchrun --nproc_per_node 4 --nnodes 64 ")
    assert launch[16].startswith("torchrun --nproc_per_node 8 --nnodes 2 ")
    assert launch[2].startswith("torchrun --nproc_per_node 2 --nnodes 1 ")
    assert launch[12].startswith("torchrun --nproc_per_node 12 --nnodes 1 ")  # no whole number of 8-device nodes
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc_per_node 4 --nnodes 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\\n"
                      "  --micro-batch-size 1 --global-batch-size 8\n")
    result = read_config(script, model="llama-3.1-8b")
    text = emit(result.model, result.strategy(), "megatron", devices_per_node=result.devices_per_node)
    assert text.splitlines()[-1].startswith("torchrun --nproc_per_node 4 --nnodes 4 ")


def test_a_megatron_launch_with_mindspeeds_flags_says_it_runs_under_mindspeed():
    """DualPipeV (--schedules-method) and no-op layers are MindSpeed's flags, which Megatron-LM's
    parser refuses: the launch's header says so; a plain launch says nothing of MindSpeed."""
    model = get_preset("deepseek-v3")
    dualpipe = emit(model, Strategy(dp=2, pp=2, vpp=2, schedule="dualpipev", ep=2, micro_batch_size=1,
                                    num_micro_batches=8), "megatron")
    header = [line for line in dualpipe.splitlines() if line.startswith("# ndplan:")]
    assert ("# ndplan: --noop-layers and --schedules-method are MindSpeed's (Megatron-LM's parser refuses them): "
            "run this launch under MindSpeed") in header
    plain = emit(model, Strategy(dp=2, pp=2, ep=2, micro_batch_size=1, num_micro_batches=8), "megatron")
    assert "MindSpeed" not in plain


def test_mindspeeds_mc2_reads_as_tp_comm_overlap(tmp_path):
    """--use-mc2 (or --use-ascend-mc2) fuses the sequence-parallel linears' TP collectives into
    their matmuls: TP comm overlap, as the accuracy page prices MindSpeed-LLM's runs; without
    sequence parallelism it has nothing to fuse, and says so."""
    base = ("torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4 --hidden-size 1024 --num-attention-heads 8 "
            "--tensor-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 8 --seq-length 2048 "
            "--use-flash-attn --bf16 ")
    for flags, overlapped in (("--sequence-parallel --use-mc2", True), ("--sequence-parallel --use-ascend-mc2", True),
                              ("--use-mc2", False)):
        script = tmp_path / "train.sh"
        script.write_text(base + flags + "\n")
        result = read_config(script)
        assert result.runtime_settings["overlap"]["tp"] is overlapped, flags
        said = [note for note in result.notes if "mc2" in note]
        assert len(said) == 1 and ("priced as TP comm overlap" in said[0]) is overlapped, said


def test_a_launch_for_ascend_npus_is_written_for_mindspeed():
    """On an NPU (device runtime 'cann') the Megatron launch is MindSpeed's: TP overlap as
    --use-mc2 (not Megatron-LM's CUDA --tp-comm-overlap), fused attention with --use-flash-attn;
    read back, it prices the same overlap and kernel. A GPU launch is unchanged."""
    from ndplan.perf import parse_overlap

    model = get_preset("llama-3.1-8b")
    strategy = Strategy(dp=1, tp=8, sequence_parallel=True, micro_batch_size=1, num_micro_batches=8)
    overlap = parse_overlap({"tp": True})
    npu = emit(model, strategy, "megatron", overlap, device_runtime="cann")
    gpu = emit(model, strategy, "megatron", overlap, device_runtime="cuda")
    assert "--use-mc2" in npu and "--use-flash-attn" in npu and "--tp-comm-overlap" not in npu
    assert "--tp-comm-overlap" in gpu and "--use-mc2" not in gpu and "MindSpeed" not in gpu
    assert "# ndplan: --use-mc2 is MindSpeed's (Megatron-LM's parser refuses it): run this launch under MindSpeed" in npu
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train.sh"
        script.write_text(npu)
        back = read_config(script, model="llama-3.1-8b")
    assert back.runtime_settings["overlap"]["tp"] is True and back.runtime_settings.get("attention", "flash") == "flash"
    plain = emit(model, Strategy(dp=8), "megatron", device_runtime="cann")  # no TP: nothing MindSpeed-only
    assert "--use-flash-attn" in plain and "written for MindSpeed on Ascend NPUs" in plain
