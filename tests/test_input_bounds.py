"""Values too large (or too small, or not finite) to compute with: each is refused with a message
that names the field or flag and its range, rather than wrapping int64, dividing into inf or NaN,
or running out of time and memory."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

import ndplan
from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.schedule.ops import MAX_SIMULATED_PASSES
from ndplan.strategy import Strategy
from ndplan.strategy.strategy import MAX_DEGREE, MAX_SEQ_LENGTH, MAX_SEQUENCES

LLAMA = ["--model", "llama-3.1-8b", "--hardware", "h100-sxm"]
HUGE = "99999999999999999999"  # past 2^63


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("field, value, bound", [
    ("tp", 2**70, MAX_DEGREE), ("dp", 2**63, MAX_DEGREE), ("vpp", MAX_DEGREE + 1, MAX_DEGREE),
    ("recompute_layers", 2**63, MAX_DEGREE), ("seq_length", 2**63 - 1, MAX_SEQ_LENGTH),
    ("micro_batch_size", 2**62, MAX_SEQUENCES), ("num_micro_batches", 2**40, MAX_SEQUENCES),
    ("global_batch_size", 2**62, MAX_SEQUENCES),
])
def test_strategy_fields_are_bounded(field, value, bound):
    with pytest.raises(ValidationError, match=f"(?s){field}.*less than or equal to {bound}"):
        Strategy(**{field: value})


def test_the_global_batch_the_factors_make_is_bounded():
    with pytest.raises(ValidationError, match=r"dp·micro_batch_size·num_micro_batches·pipeline_runs = "
                                              r"1048576·1048576·1·1 = 1099511627776 .* at most 1073741824"):
        Strategy(dp=2**20, micro_batch_size=2**20)


def test_a_huge_micro_batch_no_longer_prices_zero_activations():
    model, device = ndplan.get_preset("llama-3.1-8b"), ndplan.get_device("h100-sxm")
    with pytest.raises(ValidationError, match="micro_batch_size"):
        ndplan.estimate(model, Strategy(micro_batch_size=2**62), device)
    # at the bound the numbers are finite and grow with the batch
    small = ndplan.estimate(model, Strategy(micro_batch_size=1), device)
    big = ndplan.estimate(model, Strategy(micro_batch_size=MAX_SEQUENCES), device)
    assert small.peak_bytes < big.peak_bytes < float("inf")


@pytest.mark.parametrize("flag, field", [
    ("--tp", "tp"), ("--pp", "pp"), ("--ulysses-degree", "ulysses_degree"), ("--seq-chunks", "seq_chunks"),
    ("--shard-group", "shard_group"), ("--seq", "seq_length"), ("--mbs", "micro_batch_size"),
    ("--num-micro-batches", "num_micro_batches"), ("--pipeline-runs", "pipeline_runs"),
])
def test_cli_strategy_flags_past_int64_are_one_line(flag, field, capsys):
    code, _, err = run(["estimate", *LLAMA, "--devices", "8", flag, HUGE], capsys)
    assert code == 2 and f"field '{field}'" in err and "less than or equal to" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command, flag, bound", [
    ("estimate", "--devices", MAX_DEGREE), ("estimate", "--gbs", MAX_SEQUENCES),
    ("search", "--devices", MAX_DEGREE), ("search", "--gbs", MAX_SEQUENCES), ("search", "--seq", MAX_SEQ_LENGTH),
])
def test_cli_cluster_and_batch_flags_are_bounded(command, flag, bound, capsys):
    # (estimate's --seq goes to the Strategy, whose message names seq_length: tested above)
    argv = [command, *LLAMA, "--devices", "8", "--gbs", "8", flag, "9223372036854775807"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: expected 1 to {bound}" in err, err


def test_plan_file_values_are_bounded(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    for text, words in [("tp: 99999999999999999999", "field 'tp': Input should be less than or equal to 1048576"),
                        ("devices: 99999999999999999999", "setting 'devices' must be 1 to 1048576"),
                        ("gbs: 99999999999999999999", "setting 'gbs' must be 1 to 1073741824")]:
        plan.write_text(f"model: llama-3.1-8b\nhardware: h100-sxm\ndevices: 8\n{text}\n")
        code, _, err = run(["estimate", "--plan", str(plan)], capsys)
        assert code == 2 and words in err, err



def test_the_schedule_simulation_is_bounded(capsys):
    # A billion sequences on 8 devices once simulated 125M micro-batches op by op (22 GB, no end).
    code, _, err = run(["estimate", *LLAMA, "--devices", "8", "--gbs", "1000000000"], capsys)
    assert code == 2 and f"at most {MAX_SIMULATED_PASSES} micro-batch passes" in err, err
    assert f"at most {MAX_SIMULATED_PASSES} micro-batches per pipeline run" in err
    model, device = ndplan.get_preset("llama-3.1-8b"), ndplan.get_device("h100-sxm")
    most = MAX_SIMULATED_PASSES // 4
    with pytest.raises(NdplanError, match=rf"num_micro_batches={most + 1}: .* at pp·vpp·seq_chunks = 4·1·1 at most "
                                          rf"{most} micro-batches per pipeline run.*pipeline_runs"):
        ndplan.estimate(model, Strategy(pp=4, num_micro_batches=most + 1), device)


@pytest.mark.parametrize("field, value, words", [
    ("peak_flops", {"bf16": 1e-300}, "peak_flops.bf16': Input should be greater than or equal to 1000000000"),
    ("hbm_bandwidth_bytes_per_s", 1e-300, "hbm_bandwidth_bytes_per_s': Input should be greater than or equal to 1000000"),
    ("scaleup_bandwidth_bytes_per_s", 1e-300, "scaleup_bandwidth_bytes_per_s': Input should be greater than or equal"),
    ("scaleout_bandwidth_bytes_per_s", 1.0, "scaleout_bandwidth_bytes_per_s': Input should be greater than or equal"),
])
def test_device_rates_have_a_physical_floor(field, value, words, tmp_path, capsys):
    # A rate of 1e-300 passed validation and made the step time and MFU NaN.
    import yaml

    device = ndplan.get_device("h100-sxm").model_dump(mode="json") | {"name": "tiny", field: value}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(device))
    for command in ("estimate", "search"):
        code, _, err = run([command, "--model", "llama-3.1-8b", "--hardware", str(path), "--devices", "8",
                            "--gbs", "8"], capsys)
        assert code == 2 and words in err, err


@pytest.mark.parametrize("flag, words", [
    ("--moe-capacity-factor", "moe_capacity_factor must be a finite number > 0 and <= 1024, got 1e+300"),
    ("--moe-imbalance", "moe_imbalance must be a finite number >= 1.0 and <= 1024"),
])
def test_moe_factors_are_bounded(flag, words, capsys):
    # 1e300 printed 'inf TiB' with overflow warnings, and --json an OverflowError traceback.
    for extra in ([], ["--json"]):
        code, out, err = run(["estimate", "--model", "mixtral-8x7b", "--hardware", "h100-sxm", "--devices", "8",
                              "--ep", "8", "--gbs", "8", flag, "1e300", *extra], capsys)
        assert code == 2 and words in err and not out, err
    with pytest.raises(NdplanError, match="moe_capacity_factor must be a finite number > 0 and <= 1024, got '2'"):
        ndplan.MemoryOptions(moe_capacity_factor="2")


@pytest.mark.parametrize("tolerance", ["nan", "inf"])
def test_verify_tolerance_is_finite(tolerance, capsys):
    # nan printed "exceeds ±nan%", inf "within ±inf%".
    code, _, err = run(["verify", "llama-3.1-8b", "--layers", "1", "--seq", "256", "--tolerance", tolerance], capsys)
    assert code == 2 and f"--tolerance must be a finite number >= 0 (percent), got {tolerance}" in err, err


@pytest.mark.parametrize("measured", ["{step_s: .inf}", "{tokens_per_s_per_device: .inf}",
                                      "{tflops_per_device: .inf, flops_formula: ndplan}", "{step_s: .nan}"])
def test_calibrate_measured_figures_are_finite(measured, tmp_path):
    # step_s: .inf reached log() in the fit: "ValueError: math domain error".
    from ndplan.perf import load_runs

    runs = tmp_path / "runs.yaml"
    runs.write_text("runs:\n  - {id: r, source: s, model: llama-3.1-8b, device: h100-sxm, num_devices: 8,\n"
                    f"     strategy: {{dp: 8}}, measured: {measured}}}\n")
    field = measured[1:measured.index(":")]
    with pytest.raises(NdplanError, match=f"run r.*measured.{field}.*finite number"):
        load_runs(runs)


@pytest.mark.parametrize("num_devices", ["1", 0, -8, 1.5, True, 2**70])
def test_num_devices_is_a_whole_number_in_range(num_devices):
    # "1" said "dp·tp·pp·cp = 1·1·1·1 = 1 but the cluster has 1 devices".
    model, device = ndplan.get_preset("llama-3.1-8b"), ndplan.get_device("h100-sxm")
    with pytest.raises(NdplanError, match=rf"num_devices must be a whole number from 1 to {MAX_DEGREE}, got "):
        ndplan.estimate(model, Strategy(), device, num_devices=num_devices)
    with pytest.raises(NdplanError, match="num_devices must be a whole number"):
        ndplan.check_strategy(Strategy(), model, num_devices)
    assert ndplan.check_strategy(Strategy(dp=8), model, 8) == []


def test_sizes_read_in_the_unit_their_bound_is_said_in(capsys):
    # '7EiB' was "cannot read as a size" while the bound said "below 8 EiB".
    from ndplan.units import parse_bytes

    assert parse_bytes("7EiB") == 7 * 2**60 and parse_bytes("1.5 EB") == 15 * 10**17
    with pytest.raises(NdplanError, match="below 8 EiB, got '8EiB'"):
        parse_bytes("8EiB")
    code, _, err = run(["search", *LLAMA, "--devices", "8", "--gbs", "8", "--memory-limit", "8EiB"], capsys)
    assert code == 2 and "--memory-limit: a size must be a finite number of bytes below 8 EiB" in err, err
    code, out, err = run(["search", *LLAMA, "--devices", "8", "--gbs", "8", "--memory-limit", "7EiB", "--json"], capsys)
    assert code == 0, err


def test_search_explain_past_the_simulator_says_why(capsys):
    """A search ranks a pipeline in closed form whatever its micro-batches; --explain prices the
    winner with the single-strategy API, which simulates the schedule and refuses one too long:
    the ranking stands and a note says why the explanation is missing."""
    code, out, err = run(["search", *LLAMA, "--devices", "8", "--gbs", str(2**25), "--dims", "pp", "zero", "recompute",
                          "--fix", "mbs=1", "tp=1", "--explain", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ranked"] and "explain" not in data
    note = next(note for note in data["notes"] if note.startswith("--explain"))
    assert f"at most {MAX_SIMULATED_PASSES} micro-batch passes" in note and "raise micro_batch_size or dp" in note


def test_search_balance_and_emit_past_the_simulator_rank_and_write(capsys):
    """--balance builds a problem per pipeline candidate and --emit reads the settings back with
    the full estimators; both simulate the schedule, which once aborted the whole search on one
    candidate too long to simulate. Such candidates keep the search's closed-form figures (counted
    in a note) and their settings are written with a note that they are not checked."""
    argv = ["search", "--model", "llama-2-7b", "--hardware", "h100-sxm", "--devices", "4", "--gbs", str(2**22),
            "--seq", "64", "--fix", "pp=2", "tp=2", "mbs=1", "--runtime", "megatron", "--json"]
    code, out, err = run([*argv, "--balance"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ranked"], err
    assert all(row["pp"] == 2 and "balanced_settings" not in row for row in data["ranked"])
    note = next(note for note in data["notes"] if note.startswith("--balance"))
    assert "0 balanced" in note and f"longer than the simulator takes: {MAX_SIMULATED_PASSES:,}" in note
    unsimulated = int(note.split(" ranked unbalanced")[0].split(", ")[-1].replace(",", ""))
    assert unsimulated >= len(data["ranked"])

    code, out, err = run([*argv, "--emit", "megatron"], capsys)
    data = json.loads(out)
    assert code == 0 and "--pipeline-model-parallel-size 2" in data["emitted"], err
    check = data["emitted_check"]
    assert check["same"] and check["peak_bytes"] is None and check["step_s"] is None
    assert f"at most {MAX_SIMULATED_PASSES} micro-batch passes" in check["unpriced"]
    assert any(note.startswith("--emit megatron: the settings written are not checked") for note in data["notes"])


def test_balance_names_a_small_limit_in_its_own_unit(capsys):
    code, _, err = run(["balance", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "64",
                        "--gbs", "256", "--pp", "4", "--tp", "8", "--memory-limit", "1MiB"], capsys)
    assert code != 0 and "fits 1.00 MiB per device" in err and "0.00 GiB" not in err


def test_inspect_bounds_devices(capsys):
    from pathlib import Path

    config = str(Path(__file__).parent / "fixtures" / "io" / "torchtitan_llama3_70b.toml")
    with pytest.raises(SystemExit):
        main(["inspect", config, "--devices", HUGE])
    assert f"--devices: expected 1 to {MAX_DEGREE}" in capsys.readouterr().err
