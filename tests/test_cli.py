"""The ndplan command: outputs, JSON, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.model import get_preset, load_model
from ndplan.strategy import RULES, Strategy

LLAMA = ["--model", "llama-3.1-8b"]
MIXTRAL = ["--model", "mixtral-8x7b"]


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_models_json_lists_every_preset(capsys):
    code, out, _ = run(["models", "--json"], capsys)
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["llama-3.1-8b"]["total_params"] == 8_030_261_248
    assert rows["deepseek-v3"]["blocks"]["mtp"] > 0
    assert {"name", "model_type", "total_params", "active_params", "blocks"} <= set(rows["qwen3-30b-a3b"])


def test_models_for_a_config_file(tmp_path, capsys):
    from ndplan.model import hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config("mistral-7b")))
    code, out, _ = run(["models", "--model", str(path), "--json"], capsys)
    assert code == 0 and json.loads(out)["total_params"] == 7_241_732_096


def test_models_table(capsys):
    code, out, _ = run(["models"], capsys)
    assert code == 0 and "deepseek-v3" in out and "671.03B" in out


def test_check_valid(capsys):
    code, out, _ = run(["check", *LLAMA, "--devices", "8", "--tp", "2", "--gbs", "64", "--mbs", "2", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["valid"] and data["strategy"]["dp"] == 4 and data["strategy"]["num_micro_batches"] == 8


def test_plan_file_stage_layers_as_the_flag_takes_them(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    for layers, words in (('"16,16"', None), ("[16, 16]", None),
                          ('"16,x"', "plan.yaml: setting 'stage_layers': expected comma-separated integers, got '16,x'"),
                          ("16", "plan.yaml: setting 'stage_layers' must be a list of whole numbers")):
        plan.write_text(f"model: llama-3.1-8b\ndevices: 8\npp: 2\nstage_layers: {layers}\n")
        code, out, err = run(["check", "--plan", str(plan), "--json"], capsys)
        if words is None:
            assert code == 0 and json.loads(out)["strategy"]["stage_layers"] == [16, 16]
        else:
            assert code == 2 and words in err


def test_check_plan_file_and_flags_override(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("model: llama-3.1-8b\ndevices: 16\ntp: 4\npp: 2\nsp: true\ngbs: 32\n")
    code, out, _ = run(["check", "--plan", str(plan), "--tp", "8", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["strategy"]["tp"] == 8 and data["strategy"]["dp"] == 1


# Each rule, reached from the command line: (argv, the rule's name, words of its message).
RULE_CASES = [
    ([*LLAMA, "--devices", "8", "--tp", "2", "--dp", "2"], "world_size", "but the cluster has 8 devices"),
    ([*LLAMA, "--dp", "2", "--mbs", "2", "--num-micro-batches", "3", "--gbs", "16"], "global_batch", "global_batch_size=16"),
    ([*LLAMA, "--dp", "2", "--pp", "2", "--num-micro-batches", "4", "--pipeline-runs", "3", "--gbs", "16"], "global_batch",
     "is not dp·micro_batch_size·num_micro_batches·pipeline_runs = 2·1·4·3 = 24"),
    ([*LLAMA, "--dp", "2", "--num-micro-batches", "4", "--pipeline-runs", "2"], "pipeline_runs_need_pipeline",
     "pipeline_runs=2 needs a pipeline (pp > 1); without one a step is 8 micro-batches"),
    ([*LLAMA, "--tp", "3"], "tp_divides_heads", "tp=3 does not divide num_attention_heads=32"),
    ([*LLAMA, "--offload-layers", "32"], "offload_layers_below_layers",
     "offload_layers=32: Megatron-Core offloads fewer layers than the model's num_layers=32"),
    (["--model", "MODEL_KV6", "--tp", "4"], "tp_divides_kv_heads",
     "tp=4 neither divides num_key_value_heads=6 nor is a multiple of it"),
    (["--model", "MODEL_FFN24", "--tp", "16"], "tp_divides_ffn", "tp=16 does not divide ffn_hidden_size=24"),
    (["--model", "MODEL_SHARED", "--tp", "16"], "tp_divides_shared_experts", "shared_expert_ffn_hidden_size=24"),
    ([*LLAMA, "--ep", "2", "--dp", "2"], "ep_needs_experts", "needs a mixture-of-experts model"),
    ([*LLAMA, "--etp", "2", "--dp", "2"], "ep_needs_experts", "etp=2 (other than tp=1) needs a mixture-of-experts"),
    ([*MIXTRAL, "--ep", "3", "--dp", "3"], "ep_divides_experts", "ep=3 does not divide num_experts=8"),
    ([*MIXTRAL, "--etp", "3", "--dp", "3"], "etp_divides_moe_ffn", "etp=3 does not divide moe_ffn_hidden_size=14336"),
    ([*MIXTRAL, "--ep", "8", "--dp", "2"], "expert_grid_fits", "does not divide dp·cp·tp = 2"),
    ([*LLAMA, "--pp", "64"], "layers_cover_stages", "exceed num_layers=32"),
    ([*LLAMA, "--pp", "2", "--vpp", "2"], "vpp_needs_virtual_schedule", "vpp=2 needs one of the schedules"),
    ([*LLAMA, "--pp", "2", "--schedule", "interleaved"], "interleaved_needs_vpp", "needs vpp >= 2"),
    ([*LLAMA, "--pp", "2", "--vpp", "4", "--schedule", "zbv"], "v_schedule_needs_vpp2", "needs vpp=2, got vpp=4"),
    ([*LLAMA, "--vpp", "2", "--schedule", "interleaved"], "virtual_schedule_needs_pp", "needs pp >= 2"),
    ([*LLAMA, "--pp", "4", "--vpp", "2", "--schedule", "interleaved", "--num-micro-batches", "6"],
     "interleaved_micro_batches", "multiple of pp=4"),
    ([*LLAMA, "--pp", "4", "--vpp", "2", "--schedule", "dualpipev", "--num-micro-batches", "4"],
     "dualpipev_micro_batches", "needs num_micro_batches >= 2·pp = 8"),
    ([*LLAMA, "--seq-chunks", "2"], "seq_chunks_need_seq1f1b", "needs schedule 'seq1f1b'"),
    ([*LLAMA, "--schedule", "seq1f1b", "--seq-chunks", "3"], "seq_chunks_divide_seq", "does not divide seq_length=4096"),
    ([*LLAMA, "--sp"], "sp_needs_tp", "sequence_parallel needs tp > 1"),
    ([*LLAMA, "--tp", "8", "--sp", "--seq", "4100"], "sp_divides_seq", "does not divide seq_length=4100"),
    ([*LLAMA, "--cp", "4", "--seq", "4100"], "cp_ring_divides_seq", "divisible by 2·cp = 8"),
    ([*LLAMA, "--cp", "3", "--cp-kind", "ulysses", "--seq", "6144"], "cp_ulysses_heads", "num_attention_heads=32"),
    (["--model", "phi-4", "--cp", "4", "--cp-kind", "ulysses"], "cp_ulysses_kv_heads",
     "its 4 ranks are fewer than the 10 KV heads"),
    ([*LLAMA, "--cp", "4", "--cp-kind", "hybrid", "--ulysses-degree", "3"], "cp_hybrid_degree", "ulysses_degree=3"),
    ([*LLAMA, "--cp", "2", "--ulysses-degree", "2"], "cp_hybrid_degree", "ulysses_degree=2 needs cp_kind 'hybrid', not 'ring'"),
    ([*LLAMA, "--dp", "8", "--fsdp", "--zero", "1"], "fsdp_is_zero3", "needs zero=3, got zero=1"),
    ([*LLAMA, "--dp", "8", "--zero", "3", "--shard-group", "3"], "shard_group_divides_dp", "shard_group=3 does not divide"),
    ([*LLAMA, "--dp", "8", "--shard-group", "4"], "shard_group_needs_zero", "nothing to shard with zero=0"),
    ([*MIXTRAL, "--dp", "8", "--ep", "4", "--zero", "3", "--shard-group", "2"], "shard_group_holds_expert_groups",
     "shard_group=2 · tp=1 is not a multiple of ep·etp = 4"),
    ([*LLAMA, "--recompute", "full", "--recompute-layers", "40"], "recompute_layers_fit_stage", "exceeds the 32 layers"),
    ([*LLAMA, "--recompute-layers", "2"], "recompute_layers_need_recompute", "needs recompute 'selective' or 'full'"),
    ([*LLAMA, "--pp", "2", "--stage-layers", "10,10,12"], "stage_layers_length", "has 3 entries but pp·vpp = 2"),
    ([*LLAMA, "--pp", "2", "--stage-layers", "10,10"], "stage_layers_sum", "sum to 20 but the model has num_layers=32"),
    (["--model", "qwen3.5-27b", "--devices", "16", "--tp", "2", "--cp", "2"], "cp_linear_attention",
     "cp=2: context parallelism over Gated DeltaNet layers"),
    (["--model", "MODEL_LINEAR", "--tp", "8"], "tp_divides_linear_heads",
     "tp=8 does not divide linear_num_key_heads=4 (Gated DeltaNet)"),
]


@pytest.fixture()
def model_files(tmp_path):
    ffn24 = tmp_path / "ffn24.yaml"
    ffn24.write_text("num_layers: 4\nhidden_size: 64\nffn_hidden_size: 24\nnum_attention_heads: 16\n"
                     "num_kv_heads: 16\nhead_dim: 4\nvocab_size: 100\n")
    shared = tmp_path / "shared.yaml"
    shared.write_text("num_layers: 4\nhidden_size: 64\nffn_hidden_size: 32\nnum_attention_heads: 16\n"
                      "num_kv_heads: 16\nhead_dim: 4\nvocab_size: 100\nnum_experts: 4\nnum_experts_per_tok: 2\n"
                      "moe_ffn_hidden_size: 32\nnum_shared_experts: 1\nshared_expert_ffn_hidden_size: 24\n")
    linear = tmp_path / "linear.yaml"
    linear.write_text("num_layers: 4\nhidden_size: 64\nffn_hidden_size: 32\nnum_attention_heads: 16\n"
                      "num_kv_heads: 16\nhead_dim: 4\nvocab_size: 100\n"
                      "layer_attention_spans: [linear, linear, linear, full]\nlinear_num_key_heads: 4\n"
                      "linear_num_value_heads: 8\nlinear_key_head_dim: 8\nlinear_value_head_dim: 8\n"
                      "linear_conv_kernel: 4\n")
    kv6 = tmp_path / "kv6.yaml"
    kv6.write_text("num_layers: 4\nhidden_size: 48\nffn_hidden_size: 32\nnum_attention_heads: 12\n"
                   "num_kv_heads: 6\nhead_dim: 4\nvocab_size: 100\n")
    return {"MODEL_FFN24": str(ffn24), "MODEL_SHARED": str(shared), "MODEL_LINEAR": str(linear), "MODEL_KV6": str(kv6)}


@pytest.mark.parametrize("argv,rule,words", RULE_CASES, ids=[c[1] for c in RULE_CASES])
def test_every_rule_is_reported_with_exit_2(argv, rule, words, model_files, capsys):
    argv = [model_files.get(a, a) for a in argv]
    code, out, _ = run(["check", *argv, "--json"], capsys)
    data = json.loads(out)
    assert code == 2 and not data["valid"]
    messages = {v["rule"]: v["message"] for v in data["violations"]}
    assert rule in messages and words in messages[rule], messages


def test_rule_cases_cover_every_rule():
    # offload_runs, offload_layers_run and the optimizer states' rule serve batches built from
    # columns: one Strategy refuses the same settings as it is built (its message comes out as the
    # CLI's error line; tests/test_offload*.py, tests/test_layer_offload.py,
    # tests/test_optimizer_state_offload.py).
    built = {"offload_runs", "offload_layers_run", "optimizer_states_offload_needs_distributed_optimizer"}
    assert {r.name for r in RULES} - built <= {case[1] for case in RULE_CASES}


def test_check_human_output_lists_violations(capsys):
    code, out, _ = run(["check", *LLAMA, "--tp", "3", "--devices", "8"], capsys)
    assert code == 2 and "tp_divides_kv_heads" in out and "world_size" in out


def test_check_says_which_runtime_runs_more_tp_ranks_than_kv_heads(capsys):
    """Llama-3.1-8B has 8 KV heads: tp 16 gives each two ranks, which Megatron-Core runs (it
    gathers the QKV output) and torch's tensor-parallel plans do not (they split whole heads)."""
    code, out, _ = run(["check", *LLAMA, "--tp", "16", "--devices", "16", "--runtime", "pytorch"], capsys)
    assert code == 2 and "not_runnable" in out and "tp=16 above the model's KV heads" in out
    code, out, _ = run(["check", *LLAMA, "--tp", "16", "--devices", "16", "--runtime", "megatron"], capsys)
    assert code == 0, out


BAD_INPUTS = [
    (["check", "--model", "llama-9"], "unknown model 'llama-9'"),
    (["check"], "missing --model"),
    (["check", *LLAMA, "--tp", "0"], "field 'tp'"),
    (["check", *LLAMA, "--mbs", "-1"], "field 'micro_batch_size'"),
    (["check", *LLAMA, "--seq", "0"], "field 'seq_length'"),
    (["check", *LLAMA, "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["check", *LLAMA, "--schedule", "bogus"], "invalid choice: 'bogus'"),
    (["check", *LLAMA, "--tp", "two"], "invalid int value: 'two'"),
    (["check", *LLAMA, "--stage-layers", "1,x"], "expected comma-separated integers"),
    (["check", *LLAMA, "--precision", "fp9"], "invalid choice: 'fp9'"),
    (["models", "--model", "nope.json"], "nope.json: no such file"),
    (["hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv,words", BAD_INPUTS)
def test_bad_input_one_line_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) if argv[0] == "frobnicate" or "--schedule" in argv or "two" in argv \
            or "1,x" in argv or "fp9" in argv else _no_exit():
        code = main(argv)
        assert code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


class _no_exit:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


BAD_FILES = [
    ("bad.json", '{"model_type": "llama", "hidden_size": 8,,}', "malformed JSON"),
    ("bad.yaml", "num_layers: [1, 2\nhidden_size: 3\n", "malformed YAML"),
    ("list.yaml", "- 1\n- 2\n", "expected a mapping of fields"),
    ("config.json", '{"model_type": "gpt_neox", "num_hidden_layers": 2}', "unsupported model_type 'gpt_neox'"),
    ("config.json", '{"model_type": "qwen2", "num_hidden_layers": 2}', "missing field 'hidden_size'"),
    ("spec.yaml", "num_layers: 2\nhidden_size: 8\n", "field 'ffn_hidden_size': Field required"),
    ("spec.yaml", "num_layers: 2\nhidden_size: 8\nffn_hidden_size: 8\nnum_attention_heads: 2\nnum_kv_heads: 2\n"
                  "head_dim: 4\nvocab_size: 10\nwarp_factor: 9\n",
     "field 'warp_factor': unknown field; allowed: name, model_type, num_layers, hidden_size, ffn_hidden_size, "),
    # (a review: "Extra inputs are not permitted" named neither the field meant nor the allowed ones)
    ("spec.yaml", "num_layer: 2\nhidden_size: 8\nffn_hidden_size: 8\nnum_attention_heads: 2\nnum_kv_heads: 2\n"
                  "head_dim: 4\nvocab_size: 10\n",
     "field 'num_layer': unknown field (did you mean 'num_layers'?); allowed: name, model_type, num_layers, "),
]


@pytest.mark.parametrize("name,text,words", BAD_FILES)
def test_bad_model_files(name, text, words, tmp_path, capsys):
    path = tmp_path / name
    path.write_text(text)
    code, _, err = run(["models", "--model", str(path)], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_bad_plan_files(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("model: llama-3.1-8b\ntensor_parallel: 4\n")
    code, _, err = run(["check", "--plan", str(plan)], capsys)
    assert code == 2 and "unknown setting 'tensor_parallel'" in err
    # Values ndplan does arithmetic on before the Strategy validates them.
    for text, words in [("tp: two", "setting 'tp' must be a whole number, got 'two'"),
                        ("devices: 8.0", "setting 'devices' must be a whole number, got 8.0"),
                        ("devices: 0", "setting 'devices' must be at least 1, got 0"),
                        ("gbs: 0", "setting 'gbs' must be at least 1, got 0"),  # was read as not given
                        ("sp: true\ngbs: yes", "setting 'gbs' must be a whole number, got True"),
                        # a quoted "false" once turned ZeRO-3 on: fsdp decides zero before validation
                        ('fsdp: "false"', "setting 'fsdp' must be true or false, got 'false'")]:
        plan.write_text(f"model: llama-3.1-8b\nhardware: h100-sxm\n{text}\n")
        code, _, err = run(["estimate", "--plan", str(plan)], capsys)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["estimate", "check", "balance", "report"])
@pytest.mark.parametrize("key", ["tp", "pp", "cp", "dp", "mbs"])
def test_a_null_degree_in_a_plan_file_is_named(key, command, tmp_path, capsys):
    """A fuzzing review: ``tp: null`` was int(None), a TypeError traceback; null is refused with
    the setting's name (as ``zero: null`` was, by the Strategy), not read as "not given"."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"{key}: null\n")
    code, _, err = run([command, "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8",
                        "--gbs", "32", "--plan", str(plan)], capsys)
    assert code == 2 and f"setting '{key}' must be a whole number, got null" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_plan_file_names_must_be_text(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("hardware: 5\n")
    code, _, err = run(["check", "--model", "llama-3.1-8b", "--devices", "8", "--plan", str(plan)], capsys)
    assert code == 2 and "setting 'hardware' must be a name or a path, got 5" in err


@pytest.mark.parametrize("flag", ["--model", "--hardware", "--plan", "--efficiency", "--census"])
def test_a_file_that_is_not_text_is_named(flag, tmp_path, capsys):
    binary = tmp_path / "blob.json"
    binary.write_bytes(b"\xff\xfe\x00bad")
    argv = {"--model": "llama-3.1-8b", "--hardware": "h100-sxm"}
    argv[flag] = str(binary)
    flags = [x for pair in argv.items() for x in pair]
    code, _, err = run(["estimate", *flags, "--devices", "8", "--gbs", "8"], capsys)
    assert code == 2 and f"{binary}: not a UTF-8 text file" in err and len(err.strip().splitlines()) == 1, err


def test_bad_numbers_and_paths_are_one_line_errors(tmp_path, capsys):
    for command in (["estimate", "--model", "llama-3.1-8b", "--devices", "-8"],
                    ["search", "--model", "llama-3.1-8b", "--devices", "8", "--gbs", "0"],
                    ["estimate", "--model", "llama-3.1-8b", "--devices", "8", "--gbs", "0"]):  # was ignored
        with pytest.raises(SystemExit) as exit_:
            main(command)
        assert exit_.value.code == 2 and "expected at least 1" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8",
                        "--gbs", "8", "--plot", str(blocker / "sub" / "memory.png")], capsys)
    assert code == 2 and err.startswith(f"ndplan: error: {blocker}") and len(err.strip().splitlines()) == 1, err


def test_console_script_never_prints_a_traceback():
    result = subprocess.run([sys.executable, "-m", "ndplan.cli", "check", "--model", "x.json"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "ndplan: error: x.json: no such file"


def test_verify_reads_a_launch_script(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc_per_node 2 pretrain_gpt.py --tensor-model-parallel-size 1 \\\n"
                      "    --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 4 --seq-length 512\n")
    code, out, _ = run(["verify", "llama-3.1-8b", "--from", str(script), "--layers", "2", "--dp", "1",
                        "--precision", "bf16-pure", "--json"], capsys)
    data = json.loads(out)
    assert code == 0
    assert data["strategy"]["pp"] == 2 and data["strategy"]["seq_length"] == 512


def test_balance_names_a_one_layer_recompute_range_as_one_layer(capsys):
    """A review: the 70B balance printed 'layers 18-18 none' for a range of one layer."""
    argv = ["balance", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--tp", "8", "--pp", "4",
            "--sp", "--zero", "1", "--gbs", "256", "--memory-limit", "36GiB"]
    code, out, _ = run(argv, capsys)
    line = next(line for line in out.splitlines() if line.startswith("recompute: "))
    data = json.loads(run([*argv, "--json"], capsys)[1])
    single = [r["first"] for r in data["recompute_ranges"] if r["count"] == 1]
    assert code == 0 and single  # the plan has one-layer ranges, named so
    assert all(f"layer {first} " in line for first in single)
    assert not re.search(r"layers (\d+)-\1\b", line)


def test_balance_says_what_emit_changes_in_its_pricing(capsys):
    """A review: balance --emit megatron priced the strategy as given at 18.080 s (20.362 s without
    --emit: the loss vocabulary-parallel, as Megatron runs it) and, unlike estimate and search, did
    not say so."""
    argv = ["balance", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--tp", "2", "--sp", "--pp", "2",
            "--zero", "1", "--gbs", "32", "--memory-limit", "60GiB"]
    code, plain, _ = run(argv, capsys)
    assert code == 0 and "loss priced" not in plain
    code, emitted, _ = run([*argv, "--emit", "megatron"], capsys)
    assert code == 0
    assert ("loss priced vocabulary-parallel under TP (the pytorch runtime's own: on whole logits; set with "
            "--loss-parallel/--no-loss-parallel)") in emitted
    given = [json.loads(run([*argv, *extra, "--json"], capsys)[1])["given"]["step_s"] for extra in ([], ["--emit", "megatron"])]
    assert given[1] < given[0]  # what the note explains


def test_balance_checks_its_plan_with_the_full_estimator(capsys):
    argv = ["balance", *LLAMA, "--hardware", "h100-sxm", "--devices", "32", "--tp", "2", "--pp", "4", "--vpp", "2",
            "--schedule", "zbv", "--num-micro-batches", "16", "--seq", "4096", "--gbs", "64", "--memory-limit", "48GiB"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert "check: the full estimator, with the settings --emit writes" in out and ": fits" in out
    code, out, _ = run([*argv, "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and max(data["estimated_stage_bytes"]) <= 48 * 2**30
    # What --emit writes (one recompute setting) is priced too: between the per-layer plan and
    # the uniform full-recompute baseline.
    settings = data["as_settings"]
    if settings is not None:
        assert "as one recompute setting, what --emit writes" in run(argv, capsys)[1]
        assert data["after"]["step_s"] <= settings["step_s"] <= data["before"]["step_s"] and settings["fits"]
    # The full step estimate of what --emit writes (DP, p2p and the optimizer too), as the API gives it.
    from ndplan.balance import balance, plan_strategy
    from ndplan.hardware import Cluster, get_device
    from ndplan.memory import MemoryOptions
    from ndplan.model import get_preset
    from ndplan.perf import estimate_time
    from ndplan.strategy import Strategy

    strategy = Strategy(**data["strategy"])
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=32)
    result = balance(get_preset("llama-3.1-8b"), strategy, cluster, 48 * 2**30, MemoryOptions())
    emitted = plan_strategy(strategy, result.emitted_plan, result.emitted_modules)
    expected = estimate_time(get_preset("llama-3.1-8b"), emitted, cluster, **MemoryOptions().time_keywords()).step_s
    assert data["estimated_step_s"] == pytest.approx(expected, rel=1e-12)
    # ... and the strategy as given (its own recompute, uniform), by the same estimators
    given = estimate_time(get_preset("llama-3.1-8b"), strategy, cluster, **MemoryOptions().time_keywords()).step_s
    assert data["given"]["step_s"] == pytest.approx(given, rel=1e-12) and isinstance(data["given"]["fits"], bool)
    assert f"its step, with DP, p2p and the optimizer: {expected:.3f} s" in " ".join(run(argv, capsys)[1].split())


def test_balance_reads_back_what_it_emits_and_says_when_the_given_strategy_wins(capsys):
    """MindSpeed splits DualPipeV's layer slots evenly: a Megatron launch carries the balanced
    placement as more slots, no-op layers padding the chunks that hold fewer, and the file read
    back (as --from reads it) is the plan priced. Where the strategy as given fits and the full
    estimators find the balanced settings no faster, the verdict is to keep it."""
    argv = ["balance", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--pp", "4", "--vpp", "2", "--schedule",
            "dualpipev", "--gbs", "64", "--recompute", "full", "--runtime", "megatron", "--memory-limit", "50GiB",
            "--emit", "megatron"]
    code, out, _ = run([*argv, "--json"], capsys)
    data = json.loads(out)
    check = data["emitted_check"]
    placed = data["balanced"]["strategy"]["stage_layers"]
    assert code == 0 and check["same"] is True and check["stage_layers"] == placed and len(set(placed)) > 1
    assert "--noop-layers" in data["emitted"] and data["recommended"] == "balanced"
    assert check["step_s"] == pytest.approx(data["estimated_step_s"], rel=1e-12)
    keep = ["balance", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--tp", "8", "--gbs", "8", "--recompute",
            "none", "--runtime", "megatron", "--memory-limit", "79GiB", "--emit", "megatron"]
    text = " ".join(run(keep, capsys)[1].split())
    assert "verdict: keep the strategy as given: it fits" in text

def test_overlap_switches_reach_the_step_time(capsys):
    """--overlap sets what hides: TP overlap removes exposed TP time, the JSON names the
    switches used, and the text says whether they are defaults."""
    base = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--tp", "8", "--sp", "--gbs", "16"]
    code, out, _ = run([*base, "--json"], capsys)
    default = json.loads(out)["time"]
    code, out, _ = run([*base, "--overlap", "megatron,tp=on", "--json"], capsys)
    hidden = json.loads(out)["time"]
    assert code == 0 and default["overlap"]["tp"] is False and hidden["overlap"]["tp"] is True
    assert hidden["breakdown"]["comm_exposed"]["tp"] < default["breakdown"]["comm_exposed"]["tp"]
    assert hidden["step_s"] < default["step_s"]
    code, out, _ = run([*base, "--overlap", "plain"], capsys)
    assert code == 0 and "overlap (as given): hidden: nothing; expert dispatch all-to-all" in out
    code, out, _ = run([*base, "--overlap", "plain,ep_routing=contiguous"], capsys)
    assert code == 0 and "all-to-all (contiguous routing moves the same bytes through it)" in out


@pytest.mark.parametrize("spec,words", [
    ("tp=maybe", "overlap: tp must be on or off, got 'maybe'"),
    ("speed=on", "overlap: unknown switch 'speed'; known: dp_grad_reduce"),
    ("ep_dispatch=nvlink", "overlap: ep_dispatch must be one of all_to_all, node_dedup, got 'nvlink'"),
    ("ep_routing=random", "overlap: ep_routing must be one of uniform, contiguous, got 'random'"),
    ("fastest", "unknown overlap preset 'fastest'; known: megatron"),
])
def test_bad_overlap_is_a_one_line_error(spec, words, capsys):
    code, out, err = run(["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--overlap", spec], capsys)
    assert code == 2 and words in err and "Traceback" not in err


def test_plan_file_overlap_and_search_use_it(tmp_path, capsys):
    """A plan file's overlap mapping applies like the flag; the search prices its candidates with
    the switches given (Mixtral's expert dispatch over nodes; two micro-batches, since one has
    no partner to overlap with)."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("overlap: {tp: true}\n")
    base = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--tp", "8", "--sp", "--gbs", "16", "--json"]
    code, out, _ = run([*base, "--plan", str(plan)], capsys)
    assert code == 0 and json.loads(out)["time"]["overlap"]["tp"] is True
    search = ["search", *MIXTRAL, "--hardware", "h100-sxm", "--devices", "32", "--gbs", "64", "--seq", "4096",
              "--fix", "ep=8", "tp=1", "pp=1", "mbs=1", "--top", "1", "--json"]
    code, out, _ = run(search, capsys)
    plain = json.loads(out)["ranked"][0]
    code, out, _ = run([*search, "--overlap", "ep=on"], capsys)
    hidden = json.loads(out)
    assert code == 0 and hidden["ranked"][0]["step_s"] < plain["step_s"] and hidden["overlap"]["ep"] is True


# Bad input the CLI audit found ending in a traceback, a hang or a silent wrong answer: each is now
# one line on stderr that names the field and what it allows.
SEARCH_8 = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32"]
ESTIMATE_8 = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8"]


@pytest.mark.parametrize("argv,words", [
    ([*ESTIMATE_8, "--tp", "0"], "field 'tp': Input should be greater than or equal to 1"),
    ([*ESTIMATE_8, "--pp", "0"], "field 'pp': Input should be greater than or equal to 1"),
    ([*ESTIMATE_8, "--mbs", "0", "--gbs", "8"], "field 'micro_batch_size'"),
    ([*SEARCH_8, "--memory-limit", "inf"], "a size must be a finite number of bytes"),
    ([*SEARCH_8, "--memory-limit", "nan"], "a size must be a finite number of bytes"),
    ([*SEARCH_8, "--memory-limit", "70"], "'70' is 70 bytes; give a unit, e.g. 70GiB or 70GB"),
    ([*SEARCH_8, "--fix", "tp=abc"], "--fix tp=abc: a whole number is needed"),
    ([*SEARCH_8, "--fix", "tp=0"], "--fix tp=0: tp must be at least 1"),
    ([*SEARCH_8, "--fix", "zero=5"], "--fix zero=5: zero must be 0–3"),
    ([*SEARCH_8, "--fix", "recompute=partial"], "--fix recompute=partial: allowed values are none, selective, full"),
    ([*SEARCH_8, "--fix", "cp_kind=bogus"], "allowed values are ring, ulysses"),
    ([*SEARCH_8, "--fix", "sp=maybe"], "--fix sp=maybe: write one of 1, true, yes, on or 0, false, no, off"),
    ([*SEARCH_8, "--fix", "tp=2", "tp=4"], "--fix tp is given twice (2 and 4)"),
    # past int64 these overflowed in numpy; a long --seq hung listing its context-parallel divisors
    ([*SEARCH_8, "--fix", "tp=99999999999999999999"], "--fix tp=99999999999999999999: tp must be at least 1 and at "
                                                      "most 1,048,576"),
    ([*SEARCH_8, "--seq", "100000000000000"], "--seq: expected 1 to 16777216, got 100000000000000"),
    ([*SEARCH_8, "--devices", "4611686018427387904"], "--devices: expected 1 to 1048576, got 4611686018427387904"),
    ([*SEARCH_8, "--gbs", "1099511627776"], "--gbs: expected 1 to 1073741824, got 1099511627776"),
    ([*SEARCH_8, "--top", "0"], "--top must be at least 1, got 0"),
    ([*ESTIMATE_8, "--moe-imbalance", "nan"], "moe_imbalance must be a finite number >= 1.0"),
    ([*ESTIMATE_8, "--moe-capacity-factor", "inf"], "moe_capacity_factor must be a finite number > 0 and <= 1024, got inf"),
    # routing cannot load a rank more than with every token's copies on its experts (once: 2.75 TiB)
    (["estimate", *MIXTRAL, "--hardware", "h100-sxm", "--devices", "8", "--ep", "8", "--moe-imbalance", "100"],
     "busiest rank holds at most 4× a balanced share"),
    (["estimate", *MIXTRAL, "--hardware", "h100-sxm", "--devices", "8", "--moe-imbalance", "1.2"],
     "with ep=1 every rank holds all 8 experts"),
    (["balance", *MIXTRAL, "--hardware", "h100-sxm", "--devices", "8", "--pp", "2", "--gbs", "64",
      "--moe-imbalance", "3", "--memory-limit", "80GiB"], "with ep=1 every rank holds all 8 experts"),
])
def test_bad_values_are_one_line_errors(argv, words, capsys):
    try:
        code = main(argv)
    except SystemExit as exit:  # a flag's own type refuses it while argparse reads it
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


def test_flex_attention_keeps_flashs_memory_and_runs_slower(capsys):
    """--attention flex: PyTorch's FlexAttention keeps what a flash kernel keeps (the same peak)
    and its attention core runs at its developer's share of the flash kernel's speed on H100
    (a slower step); --json says the kernel."""
    base = [*ESTIMATE_8, "--seq", "8192", "--gbs", "32", "--json"]
    flash = json.loads(run(base, capsys)[1])
    code, out, _ = run([*base, "--attention", "flex"], capsys)
    flex = json.loads(out)
    assert code == 0 and flex["attention"] == "flex"
    assert flex["peak_bytes"] == flash["peak_bytes"]
    assert flex["time"]["step_s"] > flash["time"]["step_s"]


def test_a_calibrated_profile_reaches_estimate_search_and_balance(tmp_path, capsys):
    """--efficiency PROFILE (what `ndplan calibrate` writes) replaces the family's figures in every
    command that prices time, as a device YAML's own 'efficiency:' mapping does."""
    profile = tmp_path / "fitted.yaml"
    profile.write_text("# ndplan calibrate ...\ngemm_efficiency: 0.4\n")
    base = [*ESTIMATE_8, "--gbs", "32", "--json"]
    default = json.loads(run(base, capsys)[1])["time"]["step_s"]
    code, out, _ = run([*base, "--efficiency", str(profile)], capsys)
    fitted = json.loads(out)
    assert code == 0 and fitted["time"]["step_s"] > 1.3 * default and fitted["efficiency"] == str(profile)
    device = tmp_path / "h100-fitted.yaml"
    preset = get_device_dict("h100-sxm")
    device.write_text(yaml.safe_dump({**preset, "name": "h100-sxm-fitted", "efficiency": {"gemm_efficiency": 0.4}}))
    code, out, _ = run(["estimate", *LLAMA, "--hardware", str(device), "--devices", "8", "--gbs", "32", "--json"], capsys)
    assert code == 0 and json.loads(out)["time"]["step_s"] == pytest.approx(fitted["time"]["step_s"], rel=1e-12)
    code, out, _ = run([*SEARCH_8, "--efficiency", str(profile), "--top", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["ranked"][0]["step_s"] > default
    bad = tmp_path / "bad.yaml"
    bad.write_text("gemm_efficiency: 4\n")
    code, _, err = run([*ESTIMATE_8, "--efficiency", str(bad)], capsys)
    assert code == 2 and "bad.yaml: field 'gemm_efficiency': Input should be less than or equal to 1" in err
    bad.write_text("family: ampere\ngemm_efficiency: 0.7\n")  # fitted on A100s, given to an H100
    code, _, err = run([*ESTIMATE_8, "--efficiency", str(bad)], capsys)
    assert code == 2 and "a profile of the ampere family, and h100-sxm is hopper" in err
    device.write_text(yaml.safe_dump({**preset, "name": "h100-sxm-fitted", "efficiency": {"gemm_speed": 0.4}}))
    code, _, err = run(["estimate", *LLAMA, "--hardware", str(device), "--devices", "8"], capsys)
    assert code == 2 and "device h100-sxm-fitted: efficiency field 'gemm_speed'" in err


def get_device_dict(name):
    from ndplan.hardware import get_device

    return get_device(name).model_dump(mode="json", exclude={"efficiency"})


@pytest.mark.parametrize("command", ["balance", "search"])
def test_memory_limit_errors_name_the_flag_and_a_limit_above_the_device_is_said(command, capsys):
    argv = [command, *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "16"]
    argv += ["--pp", "2"] if command == "balance" else ["--dims", "tp", "zero"]
    # A negative size after a space: argparse had taken it for an option ("expected one argument").
    for bad, message in (("abc", "cannot read 'abc' as a size"), ("0GiB", "a size must be positive"),
                         ("-5GiB", "a size must be positive")):
        code, _, err = run([*argv, "--memory-limit", bad], capsys)
        assert code == 2 and err.strip() == f"ndplan: error: --memory-limit: {message}" + (
            "; write e.g. 70GiB, 80GB or 85899345920" if bad == "abc" else f", got '{bad}'")
    code, _, err = run([*argv, "--memory-limit", "300GiB", "--json"], capsys)
    assert code == 0
    assert "ndplan: warning: --memory-limit 300.00 GiB is above the h100-sxm's 79.18 GiB" in err


def test_search_from_a_config_keeps_the_dimensions_it_does_not_search(capsys, tmp_path):
    """search --from FILE --dims recompute searches recompute around the file's strategy, not
    around ndplan's defaults (tp1 pp1); --fix still wins over the file."""
    from ndplan.io import emit
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    model = get_preset("llama-3.1-8b")
    path = tmp_path / "run.toml"
    path.write_text(emit(model, Strategy(dp=1, tp=2, sequence_parallel=True, pp=4, num_micro_batches=16,
                                         global_batch_size=16), "torchtitan"))
    argv = ["search", "--from", str(path), "--hardware", "h100-sxm", "--dims", "recompute", "--json"]
    code, out, _ = run(argv, capsys)
    rows = json.loads(out)["ranked"]
    assert code == 0 and len(rows) == 3 and {(r["tp"], r["pp"]) for r in rows} == {(2, 4)}
    code, out, _ = run([*argv, "--fix", "pp=2"], capsys)
    assert {(r["tp"], r["pp"]) for r in json.loads(out)["ranked"]} == {(2, 2)}


def test_balance_and_estimate_read_a_config_alike(capsys, tmp_path):
    """A torchtitan TOML's runtime settings (loss parallelism) reach balance as they reach
    estimate: the strategy as given has one peak whichever command reads it."""
    from ndplan.io import emit
    from ndplan.model import get_preset
    from ndplan.strategy import Strategy

    path = tmp_path / "run.toml"
    path.write_text(emit(get_preset("llama-3.1-8b"), Strategy(dp=1, tp=2, sequence_parallel=True, pp=4,
                                                             recompute="full", num_micro_batches=64,
                                                             global_batch_size=64), "torchtitan"))
    code, out, _ = run(["estimate", "--from", str(path), "--hardware", "h100-sxm", "--json"], capsys)
    estimated = json.loads(out)["peak_bytes"]
    code, out, _ = run(["balance", "--from", str(path), "--hardware", "h100-sxm", "--heuristic", "--json"], capsys)
    assert code == 0 and json.loads(out)["given"]["peak_bytes"] == estimated


def test_balance_says_slower_and_neither_plainly(capsys):
    """Where the baseline (uniform full recompute) does not fit, the plan may be slower than it:
    said as 'x% slower; the baseline does not fit', never '-x% faster'; and where neither the
    given strategy nor the balanced settings fit by the full estimator, the verdict says so."""
    import re

    from ndplan.balance.cli import _faster

    assert (_faster(2.0, 2.2), _faster(2.2, 2.0)) == ("10.0% slower", "9.1% faster")
    argv = ["balance", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--pp", "4", "--vpp", "2", "--schedule",
            "dualpipev", "--gbs", "64", "--recompute", "full", "--zero", "1", "--memory-limit", "53GiB"]
    data = json.loads(run([*argv, "--json"], capsys)[1])
    assert not data["before"]["fits"]
    assert not data["given"]["fits"] and max(data["estimated_stage_bytes"]) > 53 * 2**30
    assert data["recommended"] == "neither"
    code, out, _ = run(argv, capsys)
    text = " ".join(out.split())
    assert code == 0 and not re.search(r"-\d+\.\d% (faster|slower)", text)
    assert "than the baseline, uniform full recompute; the baseline does not fit), composed from the stage times" in text
    assert "verdict: neither the strategy as given nor the balanced settings fit by the full estimators" in text


def test_balance_emit_chooses_settings_the_format_can_write(capsys):
    """torchtitan has no first-k-layers recompute: balanced for --emit torchtitan, the settings
    are ones it writes back whole (placement and recompute), where for Megatron they were
    rc-full:2 (Llama-3.1-8B tp2 pp4 under 30 GiB)."""
    argv = ["balance", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--tp", "2", "--pp", "4", "--gbs", "64",
            "--recompute", "full", "--runtime", "megatron", "--memory-limit", "30GiB", "--json"]
    megatron = json.loads(run([*argv, "--emit", "megatron"], capsys)[1])
    assert megatron["balanced"]["strategy"]["recompute_layers"] > 0 and megatron["emitted_check"]["same"]
    titan = json.loads(run([*argv, "--emit", "torchtitan"], capsys)[1])
    settings = titan["balanced"]["strategy"]
    assert settings["recompute_layers"] == 0
    assert titan["emitted_check"]["stage_layers"] == list(settings["stage_layers"] or [])
    assert titan["emitted_check"]["strategy"].endswith(settings["recompute"] if settings["recompute"] != "none" else "1f1b")


def test_search_balance_for_torchtitan_ranks_settings_torchtitan_writes(capsys):
    """search --balance one-setting --emit torchtitan ranks plans torchtitan can write (no
    first-k-layers recompute), where for Megatron the same search ranks rc-full:k first. (--emit
    torchtitan prices selective recompute as torchtitan's per-op policy, which it writes, unless
    told otherwise: both searches price the runtime's own here, and one precision, so that only
    what each can write differs.)"""
    argv = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "64", "--fix", "tp=2", "pp=4",
            "schedule=1f1b", "--memory-limit", "30GiB", "--balance", "one-setting", "--json",
            "--selective-policy", "keep-matmuls", "--precision", "megatron-bf16"]
    megatron = json.loads(run([*argv, "--emit", "megatron"], capsys)[1])["ranked"][0]
    titan = json.loads(run([*argv, "--emit", "torchtitan"], capsys)[1])["ranked"][0]
    assert megatron["balanced_settings"]["strategy"]["recompute_layers"] > 0
    assert titan["balanced_settings"]["strategy"]["recompute_layers"] == 0
    assert titan["step_s"] >= megatron["step_s"]


def test_search_emit_prices_the_precision_the_format_writes(capsys):
    """MindSpore keeps parameters, gradients and states in one dtype: --emit mindformers prices the
    candidates so (fsdp-bf16) unless --precision says otherwise, and then the check prices the file
    in its own precision and says it is not as priced (it said "same", 69.8 GiB, where the file
    runs 83.5 GiB, over the device)."""
    argv = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64", "--json",
            "--emit", "mindformers"]
    native = json.loads(run(argv, capsys)[1])
    assert native["emitted_check"]["precision"] == "fsdp-bf16" and native["emitted_check"]["same"]
    assert native["emitted_check"]["fits"]
    forced = json.loads(run([*argv, "--precision", "megatron-bf16"], capsys)[1])
    check = forced["emitted_check"]
    assert check["precision"] == "fsdp-bf16" and not check["same"] and not check["fits"]


def test_search_emit_says_when_the_format_reads_back_under_another_runtime(capsys):
    """balance said so; search did not: a Megatron launch reads back under the megatron runtime,
    a torchtitan TOML under pytorch (its memory and step differ from what was ranked)."""
    argv = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64", "--top", "1", "--json"]
    notes = json.loads(run([*argv, "--emit", "megatron"], capsys)[1])["notes"]
    assert any("priced for the pytorch runtime; megatron's settings read back under the megatron runtime" in n
               for n in notes)
    notes = json.loads(run([*argv, "--emit", "megatron", "--runtime", "megatron"], capsys)[1])["notes"]
    assert not any("read back under" in n for n in notes)


def test_balance_recommends_only_settings_the_written_file_fits(capsys):
    """balance --emit mindformers balanced in Megatron's precision and recommended settings whose
    file (one fp32 dtype) ran 37.3 GiB over a 36 GiB limit. Now it balances in the precision the
    file writes, and where told another, the verdict counts what the file runs; the read-back
    prices what `estimate --from` would (torchtitan's loss vocabulary-parallel under TP)."""
    argv = ["balance", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--tp", "8",
            "--pp", "4", "--sp", "--zero", "1", "--gbs", "256", "--memory-limit", "37GiB", "--json"]
    native = json.loads(run([*argv, "--emit", "mindformers"], capsys)[1])
    assert native["recommended"] == "balanced" and native["emitted_check"]["same"] and native["emitted_check"]["fits"]
    forced = json.loads(run([*argv, "--emit", "mindformers", "--precision", "megatron-bf16"], capsys)[1])
    assert forced["recommended"] == "neither" and not forced["emitted_check"]["fits"]
    assert "precision fsdp-bf16" in forced["emitted_check"]["differs"]
    titan = json.loads(run([*argv, "--emit", "torchtitan"], capsys)[1])["emitted_check"]
    assert titan["differs"] == [f"the strategy, {titan['strategy']}"]  # ZeRO-1 written as FSDP, nothing else


def test_balance_for_torchtitan_prices_the_precision_the_strategy_runs_in(capsys):
    """torchtitan applies bf16 through FSDP only: without it, TP or PP trains in fp32. balance
    --emit torchtitan took the precision torchtitan writes for one device (bf16 under FSDP), so
    Llama-3.1-8B tp2 pp4 vpp2 ZB-V (dp1) under 44 GiB was balanced in bf16 to 43.45 GiB and
    recommended, and the file written read back fp32, 51.48 GiB. Now it balances in fp32 as the
    file runs: no plan fits 44 GiB (the least 61.41 GiB); under 70 GiB the plan it writes reads
    back in the precision priced, and fits."""
    argv = ["balance", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--tp", "2", "--pp", "4", "--vpp", "2",
            "--schedule", "zbv", "--gbs", "64", "--emit", "torchtitan", "--json"]
    code, _, err = run([*argv, "--memory-limit", "44GiB"], capsys)
    assert code == 2 and "no placement and recompute plan fits 44.00 GiB" in err
    data = json.loads(run([*argv, "--memory-limit", "70GiB"], capsys)[1])
    assert data["balanced"]["strategy"]["precision"]["name"] == "fp32"
    check = data["emitted_check"]
    assert check["fits"] and not any(d.startswith("precision") for d in check["differs"])
    assert check["peak_bytes"] <= 70 * 2**30 and data["recommended"] == "balanced"


def test_balance_verdict_names_the_file_written_where_only_it_runs_over(capsys):
    """Llama-3.1-70B tp8 pp4 under 37 GiB, --emit mindformers with Megatron's precision forced:
    the check puts the balanced settings at 35.81 GiB ("fits") and the file, one fp32 dtype,
    reads back at 37.86 GiB. The verdict said "neither ... fit by the full estimators (see the
    check)", pointing at a check line that fits; it now names the file read back."""
    argv = ["balance", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--tp", "8",
            "--pp", "4", "--sp", "--zero", "1", "--gbs", "256", "--memory-limit", "37GiB", "--emit", "mindformers",
            "--precision", "megatron-bf16"]
    code, out, _ = run(argv, capsys)
    text = " ".join(out.split())
    assert code == 1
    assert "puts the largest stage at 35.81 GiB: fits" in text
    assert ("verdict: neither the strategy as given nor the balanced settings fit: the mindformers settings written "
            "run over the limit as they read back (37.86 GiB; below)") in text
    assert "(see the check)" not in text


def test_the_read_back_keeps_what_no_file_states_and_compares_what_prices(capsys):
    """A review of the read-back: it dropped --no-overhead (balance then said 'neither fits' under
    a check line that fit), and it compared every model field, so a Mixtral launch read as not
    priced (ffn_hidden_size of a model without dense layers). A search's JSON names its precision."""
    argv = ["balance", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--tp", "8",
            "--pp", "4", "--sp", "--zero", "1", "--gbs", "256", "--memory-limit", "34GiB", "--no-overhead",
            "--emit", "megatron", "--runtime", "megatron", "--json"]
    data = json.loads(run(argv, capsys)[1])
    assert data["emitted_check"]["same"] and data["emitted_check"]["fits"] and data["recommended"] == "balanced"
    argv = ["balance", "--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--devices", "16", "--pp", "2", "--ep", "8",
            "--zero", "1", "--gbs", "64", "--runtime", "megatron", "--memory-limit", "60GiB", "--emit", "megatron",
            "--json"]
    assert json.loads(run(argv, capsys)[1])["emitted_check"]["differs"] == []
    search = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "64", "--top", "1", "--json"]
    assert json.loads(run([*search, "--emit", "torchtitan"], capsys)[1])["precision"] == "fsdp-bf16"
    assert json.loads(run(search, capsys)[1])["precision"] == "megatron-bf16"


def test_the_read_back_of_a_census_search_for_torchtitan_does_not_fail(capsys):
    """With --census the search prices the runtime's own selective policy; the torchtitan file it
    writes runs the per-op one, which a census cannot price: the read-back raised that error and
    the command failed (a review). It now prices the file without the census and says so; and the
    torchtitan file's overlap, which it states, is compared with the one priced."""
    census = Path(__file__).parents[1] / "src" / "ndplan" / "memory" / "census" / "llama-3.1-8b.json"
    argv = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32", "--census", str(census),
            "--fix", "recompute=selective", "--emit", "torchtitan", "--top", "1", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert any(d.startswith("the census left out") for d in json.loads(out)["emitted_check"]["differs"])
    argv = ["balance", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--pp", "4", "--tp", "8",
            "--sp", "--fsdp", "--num-micro-batches", "8", "--recompute", "full", "--emit", "torchtitan",
            "--memory-limit", "60GiB", "--overlap", "plain", "--json"]
    check = json.loads(run(argv, capsys)[1])["emitted_check"]
    assert not check["same"] and any(d.startswith("overlap ") for d in check["differs"])


def test_emitting_torchtitan_prices_the_selective_policy_it_writes(capsys):
    """--emit torchtitan writes selective recompute as torchtitan's per-op policy, so the command
    prices that policy unless --selective-policy names another; other emitters keep the runtime's."""
    argv = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "64", "--top", "1", "--json"]
    assert json.loads(run([*argv, "--emit", "torchtitan"], capsys)[1])["selective_policy"] == "torchtitan-op"
    assert json.loads(run([*argv, "--emit", "megatron"], capsys)[1])["selective_policy"] is None
    chosen = run([*argv, "--emit", "torchtitan", "--selective-policy", "keep-matmuls"], capsys)[1]
    assert json.loads(chosen)["selective_policy"] == "keep-matmuls"

def test_emitting_a_vocabulary_parallel_loss_says_so_beside_the_peak(capsys):
    """--emit megatron prices the loss Megatron runs (vocabulary-parallel under TP), which moves
    the peak: the estimate says why, and says nothing where the runtime's own loss is priced."""
    argv = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--tp", "2", "--gbs", "16"]
    said = "loss priced vocabulary-parallel under TP (the pytorch runtime's own: on whole logits"
    assert said in run([*argv, "--emit", "megatron"], capsys)[1]
    assert "loss priced" not in run(argv, capsys)[1]


def test_emitted_settings_are_printed_unwrapped(capsys):
    """Settings to paste are never wrapped at the console's width: a wrapped Megatron line split
    its --recompute-modules (a shell syntax error) and a wrapped TOML comment broke the file."""
    argv = ["estimate", "--model", "deepseek-v3", "--hardware", "h100-sxm", "--devices", "512", "--tp", "2",
            "--pp", "8", "--vpp", "2", "--schedule", "interleaved", "--ep", "64", "--etp", "1", "--gbs", "1024",
            "--sp", "--zero", "1", "--runtime", "megatron", "--recompute", "selective",
            "--recompute-modules", "mla_up_proj", "moe_act", "layernorm", "--emit", "megatron"]
    out = run(argv, capsys)[1]
    header = [line for line in out.splitlines() if line.startswith("# Megatron-LM arguments written by ndplan")]
    assert len(header) == 1 and header[0].endswith("rc-selective(layernorm+moe_act+mla_up_proj)")
    assert any(len(line) > 160 for line in out.splitlines())  # longer than the console's 160 columns


def test_search_with_a_fixed_value_no_cluster_allows_says_so(capsys):
    """tp=3 divides none of Llama's 32 heads: more devices cannot help, and the search says that
    rather than "no strategy fits even on 512 devices", after trying counts tp=3 divides
    (multiples of 24 up to 528; powers of two alone never could hold it)."""
    code, out, _ = run(["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "64", "--seq", "4096",
                        "--fix", "tp=3"], capsys)
    text = " ".join(out.split())
    assert "no candidate is valid on up to 528 devices either: more devices do not help" in text
    assert "fits even on" not in text


def test_search_table_says_its_pipeline_steps_are_closed_forms(capsys):
    """A ranked pipeline's step is the closed-form makespan, which `ndplan estimate` (the schedule
    simulated) does not repeat exactly: the table says so where it lists a pipeline, only there."""
    base = ["search", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--gbs", "256", "--top", "3"]
    caption = "step: a pipeline's makespan in closed form (mean error within 2% of the simulated schedule"
    code, out, _ = run([*base, "--fix", "pp=4"], capsys)
    assert code == 0 and caption in " ".join(out.split())
    code, out, _ = run([*base, "--fix", "pp=1"], capsys)
    assert code == 0 and "closed form" not in out


def test_estimate_names_the_kernels_its_runtime_prices(capsys):
    """The step time prices the runtime's kernels: the pytorch runtime states its own (eager
    elementwise ops, one grouped GEMM, foreach AdamW); Megatron's are the device profile's."""
    base = ["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8"]
    code, out, _ = run(base, capsys)
    assert code == 0
    assert ("kernels (pytorch runtime; another runtime with --runtime): elementwise_passes 4.5, expert_gemm grouped, "
            "optimizer_kernel foreach, tp_overlap_backward all-gathers, fsdp_stream_copies on, fsdp_cpu_offload on, "
            "fp8_tp_gather on") in " ".join(out.split())
    code, out, _ = run([*base, "--runtime", "megatron"], capsys)
    assert code == 0 and "kernels (" not in out


def test_a_calibrated_moe_imbalance_prices_memory_and_time_alike(tmp_path, capsys):
    """An --efficiency profile holding moe_imbalance (calibrate can fit it) raises the busiest
    rank's expert memory as --moe-imbalance does, not the step time alone; an explicit
    --moe-imbalance wins over the file for both."""
    profile = tmp_path / "fitted.yaml"
    profile.write_text("moe_imbalance: 1.6\n")
    base = ["estimate", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "8", "--ep", "8",
            "--gbs", "16", "--json"]

    def figures(*extra: str) -> tuple[float, float]:
        code, out, _ = run([*base, *extra], capsys)
        assert code == 0
        data = json.loads(out)
        return data["peak_bytes"], data["time"]["step_s"]

    plain, fitted = figures(), figures("--efficiency", str(profile))
    assert figures("--moe-imbalance", "1.6") == fitted
    assert fitted[0] > plain[0] and fitted[1] > plain[1]
    assert figures("--efficiency", str(profile), "--moe-imbalance", "1.0") == plain


def test_search_emits_the_fastest_candidate_the_framework_writes_as_priced(capsys):
    """torchtitan shards with FSDP only: where the fastest candidates use ZeRO-1 or ZeRO-2, --emit
    writes the first ranked one that reads back as priced, and says which and why; with
    Megatron, #1."""
    argv = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "64", "--seq", "8192",
            "--top", "30", "--json"]
    titan = json.loads(run([*argv, "--emit", "torchtitan", "--precision", "fsdp-bf16"], capsys)[1])
    rank = titan["emitted_rank"]
    assert rank > 1 and titan["ranked"][0]["strategy"]["zero"] in (1, 2)
    assert titan["emitted_check"]["same"] and titan["ranked"][rank - 1]["strategy"]["zero"] in (0, 3)
    assert titan["emitted_check"]["strategy"] == titan["ranked"][rank - 1]["label"]
    assert any(f"the fastest candidate torchtitan writes as priced is #{rank}" in note for note in titan["notes"])
    megatron = json.loads(run([*argv, "--emit", "megatron", "--runtime", "megatron"], capsys)[1])
    assert megatron["emitted_rank"] == 1 and megatron["emitted_check"]["same"]
    # Priced under the pytorch runtime, the launch reads back under Megatron's: not as priced.
    other = json.loads(run([*argv, "--emit", "megatron"], capsys)[1])["emitted_check"]
    assert not other["same"] and "runtime 'megatron' (priced 'pytorch')" in other["differs"]


def test_search_emit_says_when_no_ranked_candidate_is_written_as_priced(capsys, monkeypatch):
    """Every candidate ZeRO-2, which torchtitan cannot write: the winner's settings are written,
    with what they run instead (FSDP), and the note says none of the ranked ones round-trips.
    A format whose reader refuses what was written (Megatron's even split, DeepSeek-V3's 61
    layers under DualPipeV, before no-op layers padded it) is skipped the same way, never fatal."""
    argv = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "64", "--seq", "8192",
            "--top", "3", "--fix", "zero=2", "--emit", "torchtitan", "--precision", "fsdp-bf16", "--json"]
    data = json.loads(run(argv, capsys)[1])
    assert data["emitted_rank"] == 0 and not data["emitted_check"]["same"]
    assert "fsdp3" in data["emitted_check"]["strategy"]
    # --emit reads back up to 20 ranked candidates, whatever --top lists
    assert any("none of the first 20 ranked candidates is written as priced" in note for note in data["notes"])
    assert len(data["ranked"]) == 3
    # A reader that refuses what was written (as Megatron's refused an uneven DualPipeV split
    # before no-op layers padded it) skips the candidate, never fatal; no temporary file named.
    import ndplan.cli_emit as cli_emit

    def refuse(*_: object, **__: object) -> None:
        raise NdplanError("/tmp/tmpabc/emitted.sh:5: --num-layers: 61 layers do not split evenly")

    monkeypatch.setattr(cli_emit, "_read_written", refuse)
    code, out, _ = run(argv, capsys)
    refused = json.loads(out)
    assert code == 0 and refused["emitted_rank"] == 0 and refused["emitted_check"]["step_s"] is None
    assert refused["emitted_check"]["strategy"] == ("settings its reader refuses (--num-layers: 61 layers do not split "
                                                    "evenly)")


def test_search_rows_carry_the_model_dependent_caveats(capsys):
    """A ranked row's caveats are the estimate's, model-dependent ones included (Megatron's MoE
    tests read low)."""
    argv = ["search", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32",
            "--runtime", "megatron", "--top", "2", "--json"]
    rows = json.loads(run(argv, capsys)[1])["ranked"]
    assert rows and all(any("1.6-5.6% low" in c for c in row["caveats"]) for row in rows)



def test_megatron_writes_dualpipev_with_noop_layers_that_read_back_as_priced(capsys):
    """MindSpeed's DualPipeV splits layer slots evenly over its 2·pp chunks: DeepSeek-V3's 61 layers
    over pp 8 are written as 64 slots with no-op layers at the end of the chunks that hold fewer,
    which the reader drops again: the README's search writes its winner as priced."""
    from ndplan.io import emit

    strategy = Strategy(dp=64, pp=8, vpp=2, schedule="dualpipev", ep=64, num_micro_batches=32, seq_length=4096)
    text = emit(get_preset("deepseek-v3"), strategy, "megatron")
    assert "--num-layers 64" in text and "--noop-layers 55,59,63" in text and "not expressible" not in text
    # a MindSpeed launch (DualPipeV, no-op layers) runs fused attention only with --use-flash-attn
    assert "--use-flash-attn" in text
    argv = ["search", "--model", "deepseek-v3", "--hardware", "h100-sxm", "--devices", "4096", "--gbs", "4096",
            "--seq", "4096", "--runtime", "megatron", "--emit", "megatron", "--top", "2", "--json"]
    data = json.loads(run(argv, capsys)[1])
    assert data["ranked"][0]["schedule"] == "dualpipev" and data["emitted_rank"] == 1 and data["emitted_check"]["same"]


def test_a_path_of_the_wrong_kind_is_named_as_such(tmp_path, capsys):
    """A fuzzing review: a folder or /dev/null as --plan said "no such file", a model file with
    another extension "unknown model ...; presets: ...", a JSON runtime profile "unknown runtime",
    --model "" "a model folder needs a config.json", --plot-dir /dev/null "File exists"."""
    (tmp_path / "model.txt").write_text("{}")
    (tmp_path / "model").write_text("{}")
    (tmp_path / "profile.json").write_text("{}")
    check = ["check", "--model", "llama-3.1-8b", "--devices", "8"]
    cases = [
        ([*check, "--plan", str(tmp_path)], f"{tmp_path}: a folder, not a file"),
        ([*check, "--plan", os.devnull], f"{os.devnull}: not a regular file"),
        (["models", "--model", str(tmp_path / "model.txt")],
         "model.txt: a model file is read by its extension, .json, .yaml, .yml (a config.json or a spec in ndplan's "
         "field names); '.txt' is not one of them"),
        (["models", "--model", str(tmp_path / "model")], "; this one has none"),
        ([*ESTIMATE_8, "--runtime", str(tmp_path / "profile.json")],
         "profile.json: a runtime profile is a YAML file (.yaml or .yml); known runtimes: megatron, pytorch"),
        (["report", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--plot-dir", os.devnull],
         f"{os.devnull}: not a folder; the figures are written into one"),
    ]
    for argv, words in cases:
        code, _, err = run(argv, capsys)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    with pytest.raises(NdplanError, match="model: the name is empty; give a preset"):
        load_model("")  # the CLI refuses an empty --model before (test_an_empty_value_names_its_option)


@pytest.mark.parametrize("argv,words", [
    ([*SEARCH_8, "--memory-limit", ""], "--memory-limit is empty; give a value (see `ndplan search --help`) or leave it out"),
    ([*SEARCH_8, "--memory-limit="], "--memory-limit is empty"),
    ([*SEARCH_8, "--csv", ""], "--csv is empty"),
    ([*SEARCH_8, "--runtime", ""], "--runtime is empty"),
    ([*SEARCH_8, "--efficiency", ""], "--efficiency is empty"),
    ([*SEARCH_8, "--fix", "tp=2", " "], "--fix is empty"),
    (["hardware", ""], "an argument of `ndplan hardware` is empty; give a value (see `ndplan hardware --help`) or "
                       "leave it out"),
    (["models", "--model", ""], "--model is empty; give a value (see `ndplan models --help`) or leave it out"),
    (["check", "--model", "", "--devices", "8"], "--model is empty"),
    # a path option once read "" as the current folder
    (["report", "result.json", "-o", "report.html", "--plot-dir", ""], "--plot-dir is empty"),
])
def test_an_empty_value_names_its_option(argv, words, capsys):
    """A fuzzing review: an empty value was read as a missing one (no limit, no CSV, the default
    runtime and profile; `hardware ""` and `models --model ""` listed everything)."""
    code, out, err = run(argv, capsys)
    assert code == 2 and words in err and not out, err


def test_overlap_switches_given_twice_and_fixed_dims_are_said(capsys):
    """--overlap tp=on,tp=off took the last silently (--fix refuses a repeat); --dims tp with
    --fix tp=2 searched tp=2 alone without a word."""
    code, _, err = run([*ESTIMATE_8, "--overlap", "megatron,tp=on,tp=off"], capsys)
    assert code == 2 and "overlap: 'tp' is given twice (on and off); give each switch once" in err
    code, out, _ = run([*SEARCH_8, "--dims", "tp", "pp", "--fix", "tp=2", "--top", "1", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ranked"][0]["tp"] == 2 and "--dims tp: fixed by --fix tp=2, so not searched" in data["notes"]


def test_a_list_option_given_twice_keeps_both(capsys):
    """--fix cp=2 --fix tp=2 kept the last alone (argparse's nargs '+' replaces): the search ran
    with cp free. Every list option now extends; a name fixed twice is still refused."""
    code, out, _ = run([*SEARCH_8, "--fix", "cp=2", "--fix", "tp=2", "--top", "3", "--json"], capsys)
    ranked = json.loads(out)["ranked"]
    assert code == 0 and ranked and all(row["cp"] == 2 and row["tp"] == 2 for row in ranked)
    code, out, _ = run([*SEARCH_8, "--dims", "tp", "--dims", "pp", "--top", "50", "--json"], capsys)
    ranked = json.loads(out)["ranked"]
    assert code == 0 and {row["tp"] for row in ranked} != {1} and {row["pp"] for row in ranked} != {1}
    code, _, err = run([*SEARCH_8, "--fix", "tp=2", "--fix", "tp=4"], capsys)
    assert code == 2 and "--fix tp is given twice (2 and 4)" in err


def test_runs_derived_from_the_global_batch_are_not_quoted_as_given(capsys):
    """--pipeline-runs 0 (as many runs as the global batch holds): a global batch that is no whole
    number of runs was refused quoting pipeline_runs 2, a count the user never gave."""
    argv = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--pp", "2", "--pipeline-runs", "0",
            "--num-micro-batches", "3"]
    code, _, err = run([*argv, "--gbs", "32"], capsys)
    assert code == 2 and "pipeline_runs 0 runs the pipeline as often as the global batch needs, but " \
        "global_batch_size=32 is not a whole number of runs of dp·micro_batch_size·num_micro_batches = 4·1·3 = 12" in err
    assert run([*argv, "--gbs", "24"], capsys)[0] == 0


def test_an_fp8_mfu_says_which_peak_it_is_of(capsys):
    """MFU is taken against the compute dtype's peak: an fp8 step's reads about half a bf16 one's."""
    argv = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "16"]
    assert "(of the fp8 peak)" in run([*argv, "--precision", "megatron-fp8"], capsys)[1]
    assert "(of the fp8 peak)" not in run(argv, capsys)[1]
    search = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "16", "--top", "1"]
    assert "MFU: of the fp8 peak" in run([*search, "--precision", "megatron-fp8"], capsys)[1]
    assert "MFU: of the fp8 peak" not in run(search, capsys)[1]


def test_search_says_where_a_missing_setting_comes_from(capsys):
    """A fuzzing review: search said "give it ... in the --plan file", but search has no --plan."""
    code, _, err = run(["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8"], capsys)
    assert code == 2 and "missing --gbs (give it as a flag, or --from a config that sets it)" in err, err
    assert "--plan" not in err
    code, _, err = run(["search", "--model", "llama-3.1-8b", "--devices", "8", "--gbs", "8"], capsys)
    assert code == 2 and "missing --hardware (give it as a flag)" in err, err
    code, _, err = run(["estimate", "--model", "llama-3.1-8b", "--devices", "8"], capsys)
    assert code == 2 and "missing --hardware (give it as a flag or in the --plan file)" in err, err


def test_search_csv_with_nothing_fitting_has_the_header(tmp_path, capsys):
    """A fuzzing review: --csv wrote an empty file (not even the header) when nothing fit."""
    fits, empty = tmp_path / "fits.csv", tmp_path / "empty.csv"
    base = ["search", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32"]
    run([*base, "--csv", str(fits)], capsys)
    run([*base, "--memory-limit", "1GiB", "--csv", str(empty)], capsys)
    assert empty.read_text().splitlines() == [fits.read_text().splitlines()[0]]


def test_search_emit_torchtitan_prices_deepseek_without_mtp(capsys):
    """A fuzzing review: search --emit torchtitan ranked deepseek-v3 with MTP (38.99 GiB, 26.589 s)
    though the file it writes builds none (33.11 GiB, 24.175 s by `estimate --from`; 34.96 GiB
    since a deferred FSDP reduce without resharding prices the stage's gathered units beside
    the loss, as measured)."""
    code, out, _ = run(["search", "--model", "deepseek-v3", "--hardware", "h100-sxm", "--devices", "1024", "--gbs",
                        "2048", "--fix", "ep=64", "pp=16", "tp=1", "cp=1", "schedule=1f1b", "recompute=full",
                        "zero=3", "mbs=1", "--emit", "torchtitan", "--json"], capsys)
    data = json.loads(out)
    best, check = data["ranked"][0], data["emitted_check"]
    assert code == 0 and check["same"], check
    assert best["peak_bytes"] == pytest.approx(check["peak_bytes"], rel=1e-3)
    assert round(best["peak_bytes"] / 2**30, 2) == 34.96
    assert any("priced without MTP (mtp_depth 0)" in note for note in data["notes"])


def test_zero_flag_overrides_a_files_fsdp(capsys):
    """A fuzzing review: --from a config with FSDP, --zero 1 was refused ("fsdp ... needs zero=3,
    got zero=1") though the user never typed --fsdp, and no flag turns FSDP off: the flag wins."""
    config = str(Path(__file__).parent / "fixtures" / "io" / "torchtitan_llama3_70b.toml")
    code, out, err = run(["estimate", "--from", config, "--hardware", "h100-sxm", "--devices", "64", "--zero", "1",
                          "--json"], capsys)
    assert code == 0, err
    strategy = json.loads(out)["strategy"]
    assert strategy["zero"] == 1 and strategy["fsdp"] is False
    code, out, err = run(["estimate", "--from", config, "--hardware", "h100-sxm", "--devices", "64", "--json"], capsys)
    assert code == 0 and json.loads(out)["strategy"]["fsdp"] is True, err


_STEP_UP_ARGV = ["balance", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--tp", "8",
                 "--pp", "4", "--sp", "--zero", "1", "--gbs", "256", "--emit", "mindformers"]


def test_balance_emit_steps_up_a_setting_the_full_estimator_finds_over_the_limit(capsys, tmp_path):
    """The balancer's memory model put rc-full:16 under 36 GiB; the full estimator, reading the
    written file back, 29.55 MiB over (it exited 1). One more recomputed layer a stage fits
    (35.11 GiB): written, said, and exit 0."""
    argv = [*_STEP_UP_ARGV, "--memory-limit", "36GiB"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "stepped up from rc-full:16 to rc-full:17: the balancer's plan was 29.55 MiB over by the full estimator" in out
    code, out, err = run([*argv, "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["stepped_up"]["from"] == "rc-full:16" and data["stepped_up"]["to"] == "rc-full:17", err
    assert data["stepped_up"]["estimated_peak_bytes"] > 36 * 2**30 and data["emitted_check"]["fits"] is True
    assert data["balanced"]["strategy"]["recompute_layers"] == 17 and data["recommended"] == "balanced"
    # The file written, read back and priced by the full estimator: it fits.
    config = tmp_path / "emitted.yaml"
    config.write_text(data["emitted"])
    code, out, err = run(["estimate", "--model", "llama-3.1-70b", "--from", str(config), "--hardware", "h100-sxm",
                          "--devices", "64", "--json"], capsys)
    estimated = json.loads(out)
    assert code == 0 and estimated["strategy"]["recompute_layers"] == 17, err
    assert estimated["peak_bytes"] <= 36 * 2**30


def test_balance_emit_exits_nonzero_when_no_step_up_fits(capsys):
    """At 34 GiB the written rc-full:18 is over by the full estimator and so is every setting
    saving more on its placement (rc-full:19, :20, every layer): the warning, exit status 1."""
    argv = [*_STEP_UP_ARGV, "--memory-limit", "34GiB"]
    code, out, err = run(argv, capsys)
    assert code == 1 and "the mindformers settings written run over the limit as they read back" in err, err
    assert "stepped up" not in out
    code, out, _ = run([*argv, "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["emitted_check"]["fits"] is False and data["stepped_up"] is None


def _ranked_row(out: str, strategy: dict) -> dict:
    """The ranked row of a search's JSON whose strategy is ``strategy`` (an estimate's)."""
    for row in json.loads(out)["ranked"]:
        if all(row["strategy"][name] == strategy[name] for name in row["strategy"] if name != "stage_layers"):
            return row
    raise AssertionError(f"no ranked row runs {strategy}")


def _search_matches_estimate(argv, capsys, step_rel=1e-9):
    code, out, _ = run(["search", *argv, "--json"], capsys)
    assert code == 0
    code, estimated, _ = run(["estimate", *[a for a in argv if a not in ("--dims", "tp")], "--json"], capsys)
    assert code == 0
    estimate = json.loads(estimated)
    row = _ranked_row(out, estimate["strategy"])
    assert row["peak_bytes"] == estimate["peak_bytes"]
    assert row["step_s"] == pytest.approx(estimate["time"]["step_s"], rel=step_rel)
    return json.loads(out), row


def test_search_from_carries_the_hsdp_shard_group(capsys):
    """A fuzzing review: search --from a HyperParallel HSDP file ranked its strategy with
    shard_group 0 (26.10 GiB / 8.521 s where `estimate --from` gives 32.63 GiB / 8.565 s)."""
    config = str(Path(__file__).parent / "fixtures" / "io" / "hyperparallel_qwen3_moe_hsdp.yaml")
    result, row = _search_matches_estimate(["--from", config, "--hardware", "h100-sxm", "--dims", "tp"], capsys)
    assert row["strategy"]["shard_group"] == 8 and row["peak_bytes"] == 35019242317
    assert any("every candidate keeps these settings of the file" in note and "shard_group 8" in note
               for note in result["notes"]), result["notes"]
    assert not any("cannot carry" in note for note in result["notes"]), result["notes"]


def test_search_from_hsdp_rejects_the_pipelines_the_shard_group_does_not_divide(capsys):
    """pp searched: at pp 8 the dp·cp = 4 replicas hold no shard group of 8, which the rule rejects."""
    config = str(Path(__file__).parent / "fixtures" / "io" / "hyperparallel_qwen3_moe_hsdp.yaml")
    code, out, _ = run(["search", "--from", config, "--hardware", "h100-sxm", "--dims", "pp", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["rejected"]["shard_group_divides_dp"] == 2
    assert {row["strategy"]["shard_group"] for row in result["ranked"]} == {8}
    assert {row["pp"] for row in result["ranked"]} == {1, 2, 4}


def _megatron_recompute_script(tmp_path: Path, layers: int) -> str:
    text = (Path(__file__).parent / "fixtures" / "io" / "megatron_llama3_70b.sh").read_text()
    assert "    --recompute-activations\n" in text
    path = tmp_path / "pretrain_recompute_block.sh"
    path.write_text(text.replace("    --recompute-activations\n", "    --recompute-granularity full --recompute-method "
                                 f"block --recompute-num-layers {layers}\n"))
    return str(path)


def test_search_from_carries_megatron_block_recompute(capsys, tmp_path):
    """--recompute-num-layers 2 (block) was searched as full recompute of every layer."""
    script = _megatron_recompute_script(tmp_path, 2)
    argv = ["--from", script, "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--dims", "tp"]
    # (estimate --from times this script 1 ms longer than the search, with or without the limit.)
    _, row = _search_matches_estimate(argv, capsys, step_rel=1e-4)
    assert row["strategy"]["recompute"] == "full" and row["strategy"]["recompute_layers"] == 2
    code, out, _ = run(["search", *argv[:-1], "recompute", "--json"], capsys)
    limits = {row["recompute"]: row["strategy"]["recompute_layers"] for row in json.loads(out)["ranked"]}
    assert code == 0 and limits == {"none": 0, "selective": 2, "full": 2}, limits


def test_search_from_recompute_limit_rejects_the_stages_it_exceeds(capsys, tmp_path):
    """pp searched: a limit of 4 layers exceeds pp 8's stages (80 layers in 32 virtual stages:
    3 at most), which the rule rejects; the others keep it."""
    script = _megatron_recompute_script(tmp_path, 4)
    code, out, _ = run(["search", "--from", script, "--model", "llama-3.1-70b", "--hardware", "h100-sxm",
                        "--dims", "pp", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["rejected"]["recompute_layers_fit_stage"] == 1
    assert {(row["pp"], row["strategy"]["recompute_layers"]) for row in result["ranked"]} == {(2, 4), (4, 4)}


def test_check_names_what_the_runtime_cannot_run(tmp_path, capsys):
    """`ndplan check` agreed with a plan the search refuses for its runtime: expert with tensor
    parallelism without SP passed for Megatron, whose ModelParallelConfig stops at it, and 1F1B
    with fewer micro-batches than stages passed for PyTorch, whose Schedule1F1B raises. With
    --runtime (or a Megatron launch read with --from) they are violations, worded as the search
    counts them; without a runtime only the general rules apply."""
    mixtral = ["--model", "mixtral-8x7b", "--devices", "16", "--dp", "8", "--tp", "2", "--ep", "8"]
    code, out, _ = run(["check", *mixtral, "--runtime", "megatron", "--json"], capsys)
    data = json.loads(out)
    assert code == 2 and not data["valid"]
    assert [v["rule"] for v in data["violations"]] == ["not_runnable_in_runtime"]
    assert "needs sequence_parallel" in data["violations"][0]["message"]
    assert run(["check", *mixtral, "--runtime", "megatron", "--sp"], capsys)[0] == 0
    assert run(["check", *mixtral], capsys)[0] == 0
    assert run(["check", *mixtral, "--runtime", "pytorch"], capsys)[0] == 0
    code, out, _ = run(["check", *LLAMA, "--devices", "8", "--pp", "8", "--num-micro-batches", "4",
                        "--runtime", "pytorch"], capsys)
    assert code == 2 and "Schedule1F1B" in out
    assert run(["check", *LLAMA, "--devices", "8", "--pp", "8", "--num-micro-batches", "4", "--runtime", "megatron"],
               capsys)[0] == 0
    code, out, _ = run(["check", *LLAMA, "--devices", "8", "--pp", "8", "--schedule", "zb-h1", "--runtime", "megatron"],
                       capsys)
    assert code == 2 and "does not run the zb-h1 schedule" in out
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 2 \\\n"
                      "    --expert-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 4 --seq-length 512\n")
    code, out, _ = run(["check", "--model", "mixtral-8x7b", "--from", str(script), "--json"], capsys)
    assert code == 2 and [v["rule"] for v in json.loads(out)["violations"]] == ["not_runnable_in_runtime"]


def test_search_emit_torchtitan_skips_what_its_parallel_dims_refuse(capsys):
    """torchtitan's ParallelDims._validate lays the experts over the data-parallel shards: with
    ep > 1, etp = tp needs ep % cp == 0 and (dp_shard·cp) % ep == 0. DDP (zero 0: dp_shard 1) with
    ep 4 was written as the winner's settings though torchtitan stops at them (ndplan's reader
    takes experts over any ranks, so the read-back passed them). Such settings are now refused
    and the next ranked candidate is written; where none is, the note says why."""
    base = ["search", "--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--devices", "16", "--gbs", "64",
            "--emit", "torchtitan", "--json"]
    code, out, _ = run([*base, "--fix", "zero=0", "pp=1"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ranked"][0]["ep"] > 1 and data["ranked"][0]["zero"] == 0
    assert data["emitted_rank"] == 0
    assert any("settings torchtitan refuses (expert_parallel_degree" in note for note in data["notes"])
    from ndplan.search.cli import _torchtitan_refuses

    code, out, _ = run([*base, "--fix", "pp=1", "--dims", "tp", "sp", "ep", "etp", "zero"], capsys)
    data = json.loads(out)
    assert data["emitted_rank"] >= 1 and _torchtitan_refuses(data["emitted"], 16) == ""
    ddp = "[parallelism]\ndata_parallel_replicate_degree = 4\ndata_parallel_shard_degree = 1\n" \
          "tensor_parallel_degree = 4\nexpert_parallel_degree = 4\nexpert_tensor_parallel_degree = 4\n"
    assert "dividing data_parallel_shard_degree·cp = 1" in _torchtitan_refuses(ddp, 16)
    fsdp = ddp.replace("replicate_degree = 4", "replicate_degree = 1").replace("shard_degree = 1", "shard_degree = -1")
    assert _torchtitan_refuses(fsdp, 16) == ""
    assert "a multiple of cp·tp = 4" in _torchtitan_refuses(
        fsdp.replace("expert_tensor_parallel_degree = 4", "expert_tensor_parallel_degree = 1")
        .replace("expert_parallel_degree = 4", "expert_parallel_degree = 2"), 16)
    assert "divisible by tp·2·cp = 8" in _torchtitan_refuses("[training]\nseq_len = 4100\n" + fsdp, 16)
    assert _torchtitan_refuses("[training]\nseq_len = 4096\n" + fsdp, 16) == ""
    assert "supports 1 or tensor_parallel_degree" in _torchtitan_refuses(
        fsdp.replace("expert_tensor_parallel_degree = 4", "expert_tensor_parallel_degree = 2"), 16)


def test_moe_dispatcher_flag_and_a_megatron_launch_without_one(tmp_path, capsys):
    """A Megatron launch that states no --moe-token-dispatcher-type runs the allgather dispatcher
    (priced so: its 8 MiB global buffer and its fp32 combine raise the peak of the golden
    8experts2parallel layout, 3,018.4 MiB allocated against 2,988.1 as all-to-all);
    --moe-dispatcher overrides it, and another runtime, which has no such dispatcher, refuses it."""
    path = tmp_path / "launch.sh"
    path.write_text("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 12 --hidden-size 512 "
                    "--num-attention-heads 8 --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 "
                    "--max-position-embeddings 1024 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                    "--moe-grouped-gemm --disable-bias-linear --sequence-parallel --num-experts 8 --moe-router-topk 1 "
                    "--bf16 --tokenizer-type GPT2BPETokenizer\n")
    base = ["estimate", "--from", str(path), "--hardware", "h100-sxm", "--devices", "8"]

    def stage(*extra):
        code, out, _ = run([*base, *extra, "--json"], capsys)
        assert code == 0
        return json.loads(out)["stages"][0]

    gathered, plain = stage(), stage("--moe-dispatcher", "alltoall")
    # buffer G·h·2 = 8 MiB and working set G·h·6 + r·h·4 = 28 MiB against the all-to-all's 8 MiB
    assert gathered["comm_bytes"] - plain["comm_bytes"] == 28 * 2**20
    code, out, _ = run([*base], capsys)
    assert "token dispatcher allgather" in out
    code, out, _ = run([*base, "--runtime", "pytorch"], capsys)  # priced as its own, the all-to-all's
    assert code == 0 and "token dispatcher allgather" not in out
    code, _, err = run([*base, "--runtime", "pytorch", "--moe-dispatcher", "allgather"], capsys)
    assert code == 2 and "states no such dispatcher" in err


@pytest.mark.parametrize("command,on,off", [
    ("estimate", "--sp", "--no-sp"),
    ("estimate", "--loss-parallel", "--no-loss-parallel"),
    ("estimate", "--loss-upcast", "--no-loss-upcast"),
    ("search", "--no-loss-upcast", "--loss-upcast"),
    ("report", "--no-sp", "--sp"),
])
def test_contradicting_switches_are_refused(command, on, off, capsys):
    """A review: `--sp --no-sp` was accepted, the last flag winning silently. Both orders are
    refused, one line naming both flags; the same flag twice is no contradiction."""
    base = [command, *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "8"]
    for pair in ([on, off], [off, on]):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, *pair])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"{pair[0]} and {pair[1]} contradict each other" in err, err
    from ndplan.cli import build_parser

    args = build_parser().parse_args(["estimate", *LLAMA, on, on])
    assert getattr(args, on.lstrip("-").removeprefix("no-").replace("-", "_")) is (not on.startswith("--no-"))


def test_estimate_fits_against_the_memory_limit(tmp_path, capsys):
    """A review: `estimate` had no --memory-limit, so "fits" was always against the whole device
    (this strategy's 44.40 GiB peak "fits" an 80 GB H100 with 34.78 GiB free). The limit, as
    search and balance read it, decides the fits line, --json's fits and the report's headroom."""
    base = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--tp", "2", "--gbs", "16",
            "--zero", "1", "--recompute", "full"]
    code, out, _ = run([*base, "--memory-limit", "40GiB", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["peak_bytes"] == pytest.approx(44.40 * 2**30, rel=1e-3)
    assert data["memory_limit_bytes"] == 40 * 2**30 and data["fits"] is False
    assert data["capacity_bytes"] == 85_020_639_232  # the device's, as before
    code, out, _ = run([*base, "--memory-limit", "40GiB"], capsys)
    assert "does not fit: stage 0 needs 44.40 GiB, over the 40.00 GiB memory limit by 4.40 GiB" in out, out
    code, out, _ = run([*base, "--memory-limit", "50GiB"], capsys)
    assert "fits: peak 44.40 GiB on stage 0 of the 50.00 GiB memory limit (5.60 GiB free)" in out, out
    code, out, _ = run(base, capsys)  # no limit: the device, as before
    assert "fits: peak 44.40 GiB on stage 0 of 79.18 GiB (34.78 GiB free)" in out, out
    code, out, _ = run([*base, "--json"], capsys)
    assert json.loads(out)["fits"] is True and "memory_limit_bytes" not in json.loads(out)
    # the report of the saved result: the limit's headroom, not the device's
    from ndplan.report.data import prepare

    code, out, _ = run([*base, "--memory-limit", "40GiB", "--json"], capsys)
    prepared = prepare(json.loads(out))
    assert prepared["fits"] is False and prepared["user_limit"] and prepared["limit_bytes"] == 40 * 2**30
    assert prepared["memory"][0]["capacity_bytes"] == 40 * 2**30
    code, _, err = run([*base, "--memory-limit", "forty"], capsys)
    assert code == 2 and "--memory-limit" in err and len(err.strip().splitlines()) == 1


def test_settings_that_change_nothing_say_so(tmp_path, capsys):
    """A review: --loss-parallel at tp 1 still printed "loss priced vocabulary-parallel under TP",
    --selective-policy without selective recompute "priced as torchtitan-op", --cp-kind at cp 1
    said nothing (as --moe-imbalance on a dense model does, each is now a caution, in --json's
    caveats too); where the setting applies, it is priced and said as before."""
    base = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "8"]
    code, out, _ = run([*base, "--loss-parallel"], capsys)
    assert code == 0 and "loss priced vocabulary-parallel" not in out, out
    assert "caution: --loss-parallel changes nothing at tp 1" in out, out
    code, out, _ = run([*base, "--loss-parallel", "--json"], capsys)
    assert any(c.startswith("--loss-parallel changes nothing at tp 1") for c in json.loads(out)["caveats"])
    code, out, _ = run([*base, "--tp", "2", "--loss-parallel"], capsys)  # applies: priced and said
    assert "loss priced vocabulary-parallel under TP" in out and "changes nothing" not in out, out
    code, out, _ = run([*base, "--selective-policy", "torchtitan-op"], capsys)
    assert code == 0 and "priced as torchtitan-op" not in out, out
    assert ("caution: --selective-policy torchtitan-op changes nothing: the strategy has no selective recompute "
            "(recompute none; the policy applies to --recompute selective)") in out, out
    code, out, _ = run([*base, "--selective-policy", "torchtitan-op", "--recompute", "selective"], capsys)
    assert "selective recompute priced as torchtitan-op" in out and "changes nothing" not in out, out
    code, out, _ = run([*base, "--cp-kind", "ulysses"], capsys)
    assert code == 0 and "caution: --cp-kind ulysses changes nothing at cp 1" in out, out
    code, out, _ = run([*base, "--cp-kind", "ulysses", "--cp", "2"], capsys)
    assert code == 0 and "changes nothing" not in out, out
    code, out, _ = run(["balance", *base[1:], "--pp", "2", "--zero", "1", "--cp-kind", "hybrid", "--loss-parallel"], capsys)
    assert code == 0 and "caution: --cp-kind hybrid changes nothing at cp 1" in out, out
    assert "caution: --loss-parallel changes nothing at tp 1" in out, out
    # balancing chooses the recompute per layer: a selective policy may apply whatever the strategy's own
    code, out, _ = run(["balance", *base[1:], "--pp", "2", "--zero", "1", "--selective-policy", "torchtitan-op"], capsys)
    assert code == 0 and "changes nothing" not in out and "selective recompute priced as torchtitan-op" in out, out
    # an empty census measures nothing: refused, not priced as if none were given
    for text in ("[]", '{"schema_version": 1, "records": []}'):
        census = tmp_path / "census.json"
        census.write_text(text)
        code, _, err = run([*base, "--census", str(census)], capsys)
        assert code == 2 and f"census file {census}: holds no records" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["estimate", "check", "balance"])
def test_a_config_without_a_world_size_needs_devices(command, capsys):
    """A review: `estimate --from` a torchtitan TOML with data_parallel_shard_degree -1 and no
    --devices warned, then priced dp1 tp8 pp4 on 32 devices, while `inspect` called the same
    strategy incomplete. Refused, one line naming --devices; with it (or --dp) it prices."""
    config = str(Path(__file__).parent / "fixtures" / "io" / "torchtitan_llama3_70b.toml")
    base = [command, "--from", config, "--hardware", "h100-sxm"][: 3 if command == "check" else 5]
    code, out, err = run([*base, "--json"], capsys)
    assert code == 2 and out == "", out
    assert err.strip() == (f"ndplan: error: {config}: the data-parallel degree depends on the world size, which the "
                           "file does not state; give --devices (or --dp)"), err
    if command == "estimate":
        code, out, _ = run([*base, "--devices", "256", "--json"], capsys)
        assert code == 0 and json.loads(out)["strategy"]["dp"] == 8 and json.loads(out)["devices"] == 256
        code, out, _ = run([*base, "--dp", "2", "--json"], capsys)
        assert code == 0 and json.loads(out)["devices"] == 64


@pytest.mark.parametrize("command", ["verify", "estimate", "check", "balance", "search"])
def test_from_help_says_what_the_command_does_with_the_config(command, capsys):
    """A review: `verify --help` described --from with search-only text ("in a search with --dims,
    the dimensions not searched keep the file's values ..."); each command now says its own."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("in a search with --dims" in text or "with --dims, the dimensions not searched" in text) == (command == "search")
    assert "--from CONFIG" in text
    if command == "verify":
        assert "refused" in text and "with --measured, the model, strategy and runtime come from it" in text, text


def test_compile_prices_fused_layers_and_a_torchtitan_config_states_it(tmp_path, capsys):
    """--compile model fuses the decoder layers' elementwise ops in the step time, and prices what
    compiled layers keep in memory (less: tests/test_compiled_layers.py), model+loss the loss's
    too (bf16 logits, not an fp32 log-softmax); a torchtitan job's [compile] states it, and
    --compile off overrides the file."""
    base = ["estimate", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--dp", "8", "--zero", "3", "--fsdp",
            "--mbs", "2", "--gbs", "16", "--seq", "8192"]

    def priced(argv):
        code, out, _ = run([*argv, "--json"], capsys)
        assert code == 0
        data = json.loads(out)
        return data["time"]["step_s"], data["stages"][0]["peak_bytes"]

    (eager, peak), (model, peak_model), (both, peak_both) = (priced(base), priced([*base, "--compile", "model"]),
                                                             priced([*base, "--compile", "model+loss"]))
    assert both < model < 0.9 * eager and peak_both < peak_model < 0.85 * peak
    code, out, _ = run([*base, "--compile", "model"], capsys)
    assert "torch.compile of the model (--compile): elementwise_passes 1 in the decoder layers, 4.5 in the final" in out
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 2\nseq_len = 8192\n'
                   '[parallelism]\ndata_parallel_shard_degree = 8\n[activation_checkpoint]\nmode = "none"\n'
                   '[compile]\nenable = true\ncomponents = ["model"]\n')
    from_file = ["estimate", "--from", str(job), "--hardware", "h100-sxm"]
    assert priced(from_file)[0] == pytest.approx(priced([*from_file, "--compile", "model"])[0], rel=1e-12)
    assert priced([*from_file, "--compile", "off"])[0] > 1.1 * priced(from_file)[0]
    plan = tmp_path / "plan.yaml"
    plan.write_text("model: llama-3.1-8b\ncompile: model\n")
    code, _, err = run(["estimate", "--plan", str(plan), "--hardware", "h100-sxm", "--devices", "8"], capsys)
    assert code == 2 and "'compile' is a flag, not a plan setting: give --compile" in err


def test_search_refuses_a_csv_it_cannot_write_before_searching(tmp_path, capsys):
    """`search --csv missing/x.csv` searched for seconds, then failed to open the file: a path
    that cannot be written is named first (a folder given as the file, a file where a folder
    should be), and missing folders are made, as --plot and report's -o make theirs."""
    base = ["search", *LLAMA, "--hardware", "h100-sxm", "--devices", "8", "--gbs", "32"]
    code, _, err = run([*base, "--csv", str(tmp_path)], capsys)
    assert code == 2 and "a folder; give the CSV file's name" in err
    (tmp_path / "notes.txt").write_text("x")
    code, _, err = run([*base, "--csv", str(tmp_path / "notes.txt" / "x.csv")], capsys)
    assert code == 2 and f"{tmp_path / 'notes.txt'} is a file, not a folder" in err
    code, _, _ = run([*base, "--csv", str(tmp_path / "new" / "deeper" / "x.csv")], capsys)
    assert code == 0 and (tmp_path / "new" / "deeper" / "x.csv").read_text().startswith("candidate,")


@pytest.mark.parametrize("command", [["census", "llama-3.1-8b", "--out"], ["measure", "llama-3.1-8b", "--layers", "1", "--out"],
                                     ["measure", "llama-3.1-8b", "--layers", "1", "--timeline"]])
def test_census_and_measure_name_an_output_they_cannot_write_before_measuring(command, tmp_path, capsys):
    """`census --out missing/c.json` measured, then said 'cannot write census file ...: No such
    file or directory': a file where a folder should be is named first, and a missing folder is
    made."""
    (tmp_path / "notes.txt").write_text("x")
    code, _, err = run([*command, str(tmp_path / "notes.txt" / "out")], capsys)
    assert code == 2 and f"{command[-1]} {tmp_path / 'notes.txt' / 'out'}: {tmp_path / 'notes.txt'} is a file" in err


def test_one_device_asked_for_is_its_object_as_one_model_is(capsys):
    """`hardware h100-sxm --json` printed a list of one where `models --model X --json` prints the
    object: both give the object now, and the lists stay lists."""
    code, out, _ = run(["hardware", "h100-sxm", "--json"], capsys)
    assert code == 0 and json.loads(out)["name"] == "h100-sxm"
    code, out, _ = run(["hardware", "--json"], capsys)
    assert code == 0 and "h100-sxm" in [d["name"] for d in json.loads(out)]
    code, out, _ = run(["models", "--model", "llama-3.1-8b", "--json"], capsys)
    assert code == 0 and isinstance(json.loads(out), dict)


@pytest.mark.parametrize(("flags", "words"), [(["--top", "0"], "--top must be at least 1, got 0"),
                                               (["--max-points", "5"], "--max-points must be at least 10, got 5")])
def test_report_names_the_count_it_refuses(flags, words, tmp_path, capsys):
    """`report --top 0` said '--top must be >= 1 and --max-points >= 10', naming neither the flag
    at fault nor its value."""
    code, _, err = run(["report", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--gbs", "16",
                        *flags, "-o", str(tmp_path / "r.html")], capsys)
    assert code == 2 and words in err
