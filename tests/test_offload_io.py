"""Fine-grained activation offload (``Strategy.offload_modules``) through config I/O and the command line:
the Megatron reader and emitter, what the other formats say they lose, the CLI flag and the report."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.io import emit, read_config
from ndplan.io.megatron_emit import emit_megatron
from ndplan.model import get_preset
from ndplan.strategy import Strategy
from ndplan.strategy.strategy import OFFLOAD_MODULES

MIXTRAL = get_preset("mixtral-8x7b")
HEAD = ("torchrun --nproc_per_node 8 pretrain_gpt.py \\\n"
        "  --tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 --seq-length 4096 "
        "--global-batch-size 64 \\\n")


def script(tmp_path: Path, *lines: str) -> Path:
    """A launch script: the common head (lines 1-2), then one flag line each from line 3."""
    path = tmp_path / "train.sh"
    path.write_text(HEAD + " \\\n".join(f"  {line}" for line in lines) + "\n")
    return path


def offload_warnings(warnings: list[str]) -> list[str]:
    return [w for w in warnings if "offload" in w]


# ------------------------------------------------------------------ the Megatron reader
def test_flags_read_into_offload_modules_in_canonical_order(tmp_path):
    path = script(tmp_path, "--fine-grained-activation-offloading", "--offload-modules expert_fc1 attn_proj core_attn")
    result = read_config(path, model=MIXTRAL)
    assert result.strategy().offload_modules == ("core_attn", "attn_proj", "expert_fc1")
    assert result.strategy_settings["offload_modules"] == ("core_attn", "attn_proj", "expert_fc1")
    assert offload_warnings(result.warnings) == []


def test_underscore_spellings_are_the_same_flags(tmp_path):
    path = script(tmp_path, "--fine_grained_activation_offloading", "--offload_modules mlp_norm attn_norm")
    result = read_config(path, model=MIXTRAL)
    assert result.strategy().offload_modules == ("attn_norm", "mlp_norm")
    assert result.warnings == []


def test_argument_file_form(tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text("tensor_model_parallel_size: 2\nmicro_batch_size: 1\nseq_length: 4096\nglobal_batch_size: 64\n"
                    "world_size: 8\nfine_grained_activation_offloading: true\n"
                    "offload_modules: [qkv_linear, moe_act]\nmin_offloaded_tensor_size: 1048576\n"
                    "activation_offload_fraction: 1.0\ndelta_offload_bytes_across_pp_ranks: 0\n"
                    "delay_offload_until_cuda_graph: false\nsequence_parallel: true\n")
    result = read_config(path, model=MIXTRAL)
    assert result.strategy().offload_modules == ("qkv_linear", "moe_act")
    assert result.warnings == []  # every tuning knob at Megatron's default


def test_argument_file_with_offload_off(tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text("tensor_model_parallel_size: 2\nmicro_batch_size: 1\nseq_length: 4096\nworld_size: 8\n"
                    "fine_grained_activation_offloading: false\noffload_modules: []\nsequence_parallel: true\n")
    result = read_config(path, model=MIXTRAL)
    assert result.strategy().offload_modules == ()
    assert result.warnings == []


def test_modules_without_the_enabling_flag_are_ignored_with_a_warning(tmp_path):
    path = script(tmp_path, "--offload-modules core_attn")
    result = read_config(path, model=MIXTRAL)
    assert result.strategy().offload_modules == ()
    assert offload_warnings(result.warnings) == [
        f"{path}:3: --offload-modules core_attn: Megatron ignores it without --fine-grained-activation-offloading; "
        "nothing is offloaded"]


def test_enabling_flag_without_modules_is_an_error(tmp_path):
    path = script(tmp_path, "--fine-grained-activation-offloading")
    with pytest.raises(NdplanError) as error:
        read_config(path, model=MIXTRAL)
    message = str(error.value)
    assert message.startswith(f"{path}:3: --fine-grained-activation-offloading: offload_modules is empty")
    assert ", ".join(OFFLOAD_MODULES) in message and "\n" not in message


def test_an_empty_module_list_in_an_argument_file_is_an_error(tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text("tensor_model_parallel_size: 2\nmicro_batch_size: 1\nseq_length: 4096\nworld_size: 8\n"
                    "fine_grained_activation_offloading: true\noffload_modules: []\n")
    with pytest.raises(NdplanError, match=r"args.yaml:6: --offload-modules: offload_modules is empty"):
        read_config(path, model=MIXTRAL)


@pytest.mark.parametrize("name", ["bogus", "core-attn", "mlp"])
def test_unknown_module_is_an_error_naming_the_allowed_ones(tmp_path, name):
    path = script(tmp_path, "--fine-grained-activation-offloading", f"--offload-modules core_attn {name}")
    with pytest.raises(NdplanError) as error:
        read_config(path, model=MIXTRAL)
    message = str(error.value)
    assert message.startswith(f"{path}:4: --offload-modules: unknown module '{name}' for offload_modules; allowed: ")
    assert ", ".join(OFFLOAD_MODULES) in message


@pytest.mark.parametrize("name", ["fused_group_mlp", "shortcut_post_norm"])
def test_modules_ndplan_does_not_price_are_left_out_with_a_warning(tmp_path, name):
    path = script(tmp_path, "--fine-grained-activation-offloading", f"--offload-modules {name} expert_fc1")
    result = read_config(path, model=MIXTRAL)
    assert result.strategy().offload_modules == ("expert_fc1",)
    assert offload_warnings(result.warnings) == [
        f"{path}:4: --offload-modules {name}: ndplan does not price this module's offload and leaves it out"]


def test_only_unpriced_modules_leave_nothing_offloaded(tmp_path):
    path = script(tmp_path, "--fine-grained-activation-offloading", "--offload-modules fused_group_mlp")
    result = read_config(path, model=MIXTRAL)
    assert result.strategy().offload_modules == ()
    assert len(offload_warnings(result.warnings)) == 1


KNOBS = [
    ("--min-offloaded-tensor-size 4096", "whatever the threshold"),
    ("--activation-offload-fraction 0.8", "ndplan assumes fraction 1.0: every layer offloads"),
    ("--delta-offload-bytes-across-pp-ranks 1073741824", "the same bytes on every pipeline stage"),
    ("--fine-grained-offloading-max-inflight-offloads 2", "waits for each copy that falls behind"),
    ("--delay-offload-until-cuda-graph", "no CUDA graphs"),
]


@pytest.mark.parametrize("flag,words", KNOBS)
def test_unmodelled_knobs_away_from_their_defaults_are_one_warning_each(tmp_path, flag, words):
    path = script(tmp_path, "--fine-grained-activation-offloading", "--offload-modules expert_fc1", flag)
    result = read_config(path, model=MIXTRAL)
    assert result.strategy().offload_modules == ("expert_fc1",)
    found = offload_warnings(result.warnings)
    assert len(found) == 1 and found[0].startswith(f"{path}:5: {flag}: ") and words in found[0], found


@pytest.mark.parametrize("flag", ["--min-offloaded-tensor-size 1048576", "--activation-offload-fraction 1.0",
                                  "--delta-offload-bytes-across-pp-ranks 0"])
def test_knobs_at_their_defaults_are_silent(tmp_path, flag):
    path = script(tmp_path, "--fine-grained-activation-offloading", "--offload-modules expert_fc1", flag)
    assert read_config(path, model=MIXTRAL).warnings == []


def test_knobs_without_offload_are_notes_not_warnings(tmp_path):
    path = script(tmp_path, "--activation-offload-fraction 0.5", "--delay-offload-until-cuda-graph")
    result = read_config(path, model=MIXTRAL)
    assert result.warnings == []
    assert "--activation-offload-fraction has no effect without --fine-grained-activation-offloading" in result.notes
    assert "--delay-offload-until-cuda-graph has no effect without --fine-grained-activation-offloading" in result.notes


@pytest.mark.parametrize("value,words", [("1.5", "must be in [0, 1], got 1.5"), ("half", "expected a number")])
def test_a_bad_fraction_is_an_error(tmp_path, value, words):
    path = script(tmp_path, "--fine-grained-activation-offloading", "--offload-modules expert_fc1",
                  f"--activation-offload-fraction {value}")
    with pytest.raises(NdplanError) as error:
        read_config(path, model=MIXTRAL)
    assert str(error.value).startswith(f"{path}:5: --activation-offload-fraction: ") and words in str(error.value)


CONFLICTS = [
    (["--offload-modules attn_proj"], "offload_modules attn_proj needs core_attn too"),
    (["--offload-modules core_attn", "--recompute-granularity selective"],
     "offload_modules core_attn: the attention core is recomputed"),
    (["--offload-modules expert_fc1", "--recompute-granularity selective", "--recompute-modules moe"],
     "offload_modules expert_fc1/moe_act cannot go with recompute_modules moe"),
    (["--offload-modules core_attn", "--recompute-granularity full", "--recompute-method uniform",
      "--recompute-num-layers 1"], "full recompute keeps only each layer's input"),
    (["--offload-modules core_attn", "--schedules-method dualpipev", "--pipeline-model-parallel-size 2"],
     "under the schedules 1f1b, interleaved, not 'dualpipev'"),
]


@pytest.mark.parametrize("flags,words", CONFLICTS)
def test_pairs_megatron_refuses_are_located_one_line_errors(tmp_path, flags, words):
    path = script(tmp_path, "--fine-grained-activation-offloading", *flags)
    with pytest.raises(NdplanError) as error:
        read_config(path, model=MIXTRAL)
    message = str(error.value)
    assert message.startswith(f"{path}:4: --offload-modules: offload_modules ") and words in message, message
    assert "\n" not in message


def test_selective_recompute_of_other_modules_goes_with_core_attn_offload(tmp_path):
    path = script(tmp_path, "--fine-grained-activation-offloading", "--offload-modules core_attn attn_proj",
                  "--recompute-granularity selective", "--recompute-modules layernorm moe_act")
    s = read_config(path, model=MIXTRAL).strategy()
    assert s.offload_modules == ("core_attn", "attn_proj") and s.recompute_modules == ("layernorm", "moe_act")


def test_inspect_json_shows_the_field(tmp_path, capsys):
    path = script(tmp_path, "--fine-grained-activation-offloading", "--offload-modules core_attn")
    assert main(["inspect", str(path), "--model", "mixtral-8x7b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["strategy"]["offload_modules"] == ["core_attn"]
    assert "offload(core_attn)" in data["strategy"]["short"]


# ------------------------------------------------------------------ emitters
def read_back(text: str, tmp_path: Path, model=MIXTRAL) -> Strategy:
    path = tmp_path / "emitted.sh"
    path.write_text(text)
    result = read_config(path, model=model)
    assert result.warnings == []
    return result.strategy()


@pytest.mark.parametrize("fields", [
    {"offload_modules": ("core_attn", "attn_proj", "expert_fc1")},
    {"offload_modules": tuple(OFFLOAD_MODULES)},
    {"offload_modules": ("attn_norm", "mlp_norm", "moe_act"), "recompute": "selective",
     "recompute_modules": ("layernorm",)},
    {"offload_modules": ("core_attn", "attn_proj", "qkv_linear"), "recompute": "selective",
     "recompute_modules": ("moe_act",), "pp": 2, "vpp": 2, "schedule": "interleaved", "num_micro_batches": 4},
])
def test_megatron_emitter_round_trip(tmp_path, fields):
    # (sequence parallelism: Megatron-Core refuses EP with TP without it)
    strategy = Strategy(dp=2, tp=2, ep=2, sequence_parallel=True, **{"num_micro_batches": 2, **fields})
    text = emit_megatron(MIXTRAL, strategy)
    assert "--fine-grained-activation-offloading" in text and "not expressible" not in text
    assert f"--offload-modules {' '.join(strategy.offload_modules)}" in text
    assert read_back(text, tmp_path).offload_modules == strategy.offload_modules
    assert read_back(text, tmp_path) == read_back(emit_megatron(MIXTRAL, read_back(text, tmp_path)), tmp_path)


def test_megatron_emitter_writes_nothing_without_offload():
    text = emit_megatron(MIXTRAL, Strategy(dp=8))
    assert "offload" not in text


@pytest.mark.parametrize("fmt", ["torchtitan", "hyperparallel", "mindformers"])
def test_other_formats_say_they_lose_the_offload(fmt):
    strategy = Strategy(dp=8, offload_modules=("core_attn", "attn_proj"))
    text = emit(MIXTRAL, strategy, fmt)
    assert "left out: activation offload (Megatron-Core only): core_attn attn_proj" in text
    assert "offload_modules" not in text and "--offload" not in text  # no invented flag or key
    assert "activation offload" not in emit(MIXTRAL, Strategy(dp=8), fmt)


# ------------------------------------------------------------------ the command line
def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


LLAMA = ["--model", "llama-3.1-8b", "--devices", "8"]


def test_check_reads_the_flag(capsys):
    code, out, _ = run(["check", *LLAMA, "--offload-modules", "attn_proj", "core_attn", "--json"], capsys)
    assert code == 0 and json.loads(out)["strategy"]["offload_modules"] == ["core_attn", "attn_proj"]


@pytest.mark.parametrize("command", ["estimate", "check", "balance"])
@pytest.mark.parametrize("extra,words", [
    (["--offload-modules", "attn_proj"], "offload_modules attn_proj needs core_attn too"),
    (["--offload-modules", "core_attn", "--recompute", "full"], "full recompute keeps only each layer's input"),
    (["--offload-modules", "core_attn", "--pp", "2", "--schedule", "zbv", "--vpp", "2"],
     "not 'zbv'"),
])
def test_invalid_combinations_are_one_clean_line(command, extra, words, capsys):
    code, _, err = run([command, *LLAMA, "--hardware", "h100-sxm", *extra], capsys)
    err = err.strip()
    assert code == 2 and err.startswith("ndplan: error: ") and words in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_an_unknown_module_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", *LLAMA, "--hardware", "h100-sxm", "--offload-modules", "fused_group_mlp"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "invalid choice: 'fused_group_mlp'" in err and all(f"'{m}'" in err for m in OFFLOAD_MODULES)


def test_search_offloads_every_candidate(capsys):
    argv = ["search", "--model", "qwen3-30b-a3b", "--devices", "16", "--hardware", "h100-sxm", "--gbs", "64",
            "--offload-modules", "expert_fc1", "--dims", "tp", "ep", "pp", "recompute", "--json"]
    code, out, _ = run([*argv, "--runtime", "megatron"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ranked"]
    assert {row["offload_modules"] for row in data["ranked"]} == {"expert_fc1"}
    assert "full" not in {row["recompute"] for row in data["ranked"]} and data["rejected"]["offload_runs"] > 0
    code, _, err = run(argv, capsys)  # the default runtime, PyTorch, has no such feature
    assert code == 2 and "runtime 'pytorch' has no such feature" in err and "Traceback" not in err


def test_plan_file_key(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("model: llama-3.1-8b\ndevices: 8\noffload_modules: [mlp_norm, attn_norm]\n")
    code, out, _ = run(["check", "--plan", str(plan), "--json"], capsys)
    assert code == 0 and json.loads(out)["strategy"]["offload_modules"] == ["attn_norm", "mlp_norm"]


def test_from_a_megatron_config_with_flags_that_contradict_it(tmp_path, capsys):
    path = script(tmp_path, "--fine-grained-activation-offloading", "--offload-modules core_attn")
    code, out, _ = run(["check", "--from", str(path), "--model", "mixtral-8x7b", "--json"], capsys)
    assert code == 0 and json.loads(out)["strategy"]["offload_modules"] == ["core_attn"]
    code, _, err = run(["check", "--from", str(path), "--model", "mixtral-8x7b", "--recompute", "full"], capsys)
    assert code == 2 and "full recompute keeps only each layer's input" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run(["check", "--from", str(path), "--model", "mixtral-8x7b", "--offload-modules", "mlp_norm",
                        "--json"], capsys)
    assert code == 0 and json.loads(out)["strategy"]["offload_modules"] == ["mlp_norm"]  # the flag wins


# ------------------------------------------------------------------ the report
def reproduced(strategy: Strategy) -> tuple[str, Strategy]:
    """The HTML report's reproduce command for ``strategy`` (llama-3.1-8b on 8 H100s; nothing
    left unsaid), and the strategy its flags parse back to."""
    from ndplan.cli_args import add_strategy_arguments, gather_settings, strategy_from_settings
    from ndplan.report.html import reproduce_command

    command, missing = reproduce_command({"model": "llama-3.1-8b", "hardware": "h100-sxm", "devices": 8,
                                          "strategy": strategy.model_dump(mode="json")})
    assert missing == []
    parser = argparse.ArgumentParser()
    add_strategy_arguments(parser)
    return command, strategy_from_settings(gather_settings(parser.parse_args(shlex.split(command)[2:])))


def test_report_reproduce_command_carries_the_modules():
    from ndplan.report.data import ROW_PRIORITY

    strategy = Strategy(dp=4, tp=2, recompute="selective", recompute_modules=("layernorm",),
                        offload_modules=("core_attn", "attn_proj"), num_micro_batches=4)
    command, parsed = reproduced(strategy)
    assert "--offload-modules core_attn attn_proj" in command and parsed == strategy
    assert ROW_PRIORITY.index("offload_modules") == ROW_PRIORITY.index("recompute_modules") + 1
