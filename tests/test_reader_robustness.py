"""Malformed inputs a fuzzing review found: each is an NdplanError naming the file and the field
(and what is allowed), never a traceback, a hang or a silently wrong number."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ndplan.census.measure import load_hf_config
from ndplan.census.measurement import load_measurement
from ndplan.census.record import load_census_file
from ndplan.errors import NdplanError
from ndplan.hardware.presets import load_device_file
from ndplan.io import read_config
from ndplan.memory.profile import get_profile
from ndplan.model.presets import load_model
from ndplan.perf.calibrate import load_runs
from ndplan.perf.efficiency import load_efficiency
from ndplan.report.cli import load_result

DEEP_JSON = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name, text", [
    ("config.json", DEEP_JSON),
    ("model.yaml", DEEP_JSON),
    ("megatron_args.json", DEEP_JSON),
    ("mindformers.yaml", "a:\n" + "".join(" " * i + "b:\n" for i in range(1, 3000))),
    ("job.toml", "a = " + DEEP_JSON),
    ("census.json", DEEP_JSON),
    ("measured.json", DEEP_JSON),
    ("hf.json", DEEP_JSON),
    ("result.json", DEEP_JSON),
    ("profile.yaml", DEEP_JSON),
    ("device.json", DEEP_JSON),
    ("device.yaml", DEEP_JSON),
    ("efficiency.yaml", DEEP_JSON),
    ("runs.json", DEEP_JSON),
    ("runs.yaml", DEEP_JSON),
])
def test_a_deeply_nested_file_is_an_error_naming_it(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    read = {"config.json": load_model, "model.yaml": load_model, "census.json": load_census_file,
            "measured.json": load_measurement, "hf.json": load_hf_config, "result.json": load_result,
            "profile.yaml": get_profile, "device.json": load_device_file, "device.yaml": load_device_file,
            "efficiency.yaml": load_efficiency, "runs.json": load_runs, "runs.yaml": load_runs}.get(name, read_config)
    with pytest.raises(NdplanError, match=rf"{name}(:\d+)?: malformed (runtime profile )?(JSON|YAML|TOML)"):
        read(str(path))


# ---------------------------------------------------------------- Hugging Face config.json
LLAMA = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
}
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
    "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
}


def _hf(tmp_path: Path, base: dict[str, object], **fields: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **fields}))
    return path


def test_a_model_type_that_is_not_a_name_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(NdplanError, match=r"config.json: unsupported model_type \['llama'\]; supported: llama"):
        load_model(str(_hf(tmp_path, LLAMA, model_type=["llama"])))


@pytest.mark.parametrize("value", [5, [[1]], "0,1", [True]])
def test_mlp_only_layers_must_list_layer_indices(tmp_path: Path, value: object) -> None:
    for model_type in ("qwen3_moe", "qwen2_moe"):
        path = _hf(tmp_path, QWEN3_MOE, model_type=model_type, mlp_only_layers=value)
        with pytest.raises(NdplanError, match=r"config.json: field 'mlp_only_layers' must be a list of layer indices"):
            load_model(str(path))


def test_mlp_only_layers_makes_those_layers_dense(tmp_path: Path) -> None:
    kinds = load_model(str(_hf(tmp_path, QWEN3_MOE, mlp_only_layers=[0, 1]))).layer_mlp_kinds
    assert kinds[:3] == ("dense", "dense", "moe")


@pytest.mark.parametrize("value, message", [
    (True, "must be an integer, got True"),
    ("128", "must be an integer, got '128'"),
    (-5, "must be at least 1, got -5"),
    (2**70, "must be at most 4,294,967,296, got 1180591620717411303424"),
])
def test_head_dim_is_checked_like_every_other_size(tmp_path: Path, value: object, message: str) -> None:
    with pytest.raises(NdplanError, match=rf"config.json: field 'head_dim' {message}"):
        load_model(str(_hf(tmp_path, LLAMA, head_dim=value)))


def test_head_dim_null_or_zero_is_derived_as_transformers_does(tmp_path: Path) -> None:
    assert load_model(str(_hf(tmp_path, LLAMA, head_dim=None))).head_dim == 128
    assert load_model(str(_hf(tmp_path, LLAMA, head_dim=0))).head_dim == 128
    assert load_model(str(_hf(tmp_path, LLAMA, head_dim=96))).head_dim == 96


@pytest.mark.parametrize("field, value", [("hidden_size", 2**40), ("vocab_size", 10**30), ("num_experts", 10**12)])
def test_sizes_past_what_the_estimator_prices_are_refused(tmp_path: Path, field: str, value: int) -> None:
    with pytest.raises(NdplanError, match=rf"config.json: field '{field}' must be at most 4,294,967,296"):
        load_model(str(_hf(tmp_path, QWEN3_MOE, **{field: value})))


def test_hidden_act_must_be_a_name(tmp_path: Path) -> None:
    with pytest.raises(NdplanError, match=r"config.json: field 'hidden_act' must be an activation name"):
        load_model(str(_hf(tmp_path, LLAMA, hidden_act=["silu"])))


def test_a_hidden_size_below_the_head_count_names_the_fields(tmp_path: Path) -> None:
    with pytest.raises(NdplanError, match=r"config.json: hidden_size \(16\) is not a multiple of "
                                          r"num_attention_heads \(32\); transformers rejects that"):
        load_model(str(_hf(tmp_path, LLAMA, hidden_size=16)))
    with pytest.raises(NdplanError, match=r"config.json: no field 'head_dim', and hidden_size \(16\) is not a "
                                          r"multiple of num_attention_heads \(32\); give head_dim"):
        load_model(str(_hf(tmp_path, QWEN3_MOE, hidden_size=16, head_dim=None)))


def test_a_huge_layer_count_is_refused_at_once(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(NdplanError, match=r"config.json: field 'num_hidden_layers' must be at most 100,000, "
                                          r"got 2147483648"):
        load_model(str(_hf(tmp_path, LLAMA, num_hidden_layers=2**31)))
    assert time.monotonic() - start < 5


def test_an_own_spec_with_a_huge_layer_count_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_text("num_layers: 2147483648\nhidden_size: 64\nffn_hidden_size: 128\nnum_attention_heads: 4\n"
                    "num_kv_heads: 4\nhead_dim: 16\nvocab_size: 1000\n")
    start = time.monotonic()
    with pytest.raises(NdplanError, match=r"model.yaml: field 'num_layers': Input should be less than or equal to "
                                          r"100000"):
        load_model(str(path))
    assert time.monotonic() - start < 5
    path.write_text(path.read_text().replace("2147483648", "2").replace("64", str(2**40)))
    with pytest.raises(NdplanError, match=r"model.yaml: field 'hidden_size' must be at most 4,294,967,296"):
        load_model(str(path))


# ---------------------------------------------------------------- framework configs
FIXTURES = Path(__file__).parent / "fixtures" / "io"


def _variant(tmp_path: Path, fixture: str, old: str, new: str) -> Path:
    text = (FIXTURES / fixture).read_text()
    assert old in text
    path = tmp_path / fixture
    path.write_text(text.replace(old, new))
    return path


def _refused_quickly(path: Path, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(NdplanError, match=rf"{path.name}:\d+: {message}"):
        read_config(path)
    assert time.monotonic() - start < 5


def test_a_huge_layer_count_in_a_launch_script_is_refused(tmp_path: Path) -> None:
    path = _variant(tmp_path, "mindspeed_deepseek3.sh", "NUM_LAYERS=64", "NUM_LAYERS=2147483648")
    _refused_quickly(path, r"--num-layers: must be >= 1 and <= 100,000, got 2147483648")


def test_a_huge_parallel_degree_in_a_launch_script_is_refused(tmp_path: Path) -> None:
    path = _variant(tmp_path, "megatron_llama3_70b.sh", "PP=4", "PP=99999999999")
    _refused_quickly(path, r"--pipeline-model-parallel-size: must be >= 1 and <= 1,048,576, got 99999999999")


@pytest.mark.parametrize("flag, value", [("--micro-batch-size", "0"), ("--seq-length", "-5"),
                                         ("--ffn-hidden-size", "0"), ("--num-attention-heads", "0")])
def test_an_out_of_range_flag_without_an_upper_bound_names_the_flag(tmp_path: Path, flag: str, value: str) -> None:
    path = tmp_path / "launch.sh"
    path.write_text(f"torchrun --nproc_per_node 8 pretrain_gpt.py {flag} {value}\n")
    _refused_quickly(path, rf"{flag}: must be >= 1, got {value}")


def test_a_huge_layer_count_in_mindformers_yaml_is_refused(tmp_path: Path) -> None:
    path = _variant(tmp_path, "mindformers_deepseek3_671b.yaml", "num_layers: 61", "num_layers: 99999999999999999999")
    _refused_quickly(path, r"model.model_config.num_layers: must be <= 100,000, got 99999999999999999999")


def test_a_huge_pipeline_degree_in_torchtitan_toml_is_refused(tmp_path: Path) -> None:
    path = _variant(tmp_path, "torchtitan_llama3_70b.toml", "pipeline_parallel_degree = 4",
                    "pipeline_parallel_degree = 99999999999999999999")
    _refused_quickly(path, r"parallelism.pipeline_parallel_degree: must be <= 1,048,576")


@pytest.mark.parametrize("value", ['"8"', "8.0", "true"])
def test_torchtitan_degrees_are_whole_numbers(tmp_path: Path, value: str) -> None:
    path = _variant(tmp_path, "torchtitan_llama3_70b.toml", "tensor_parallel_degree = 8",
                    f"tensor_parallel_degree = {value}")
    with pytest.raises(NdplanError, match=r"parallelism.tensor_parallel_degree: expected an integer, got"):
        read_config(path)


@pytest.mark.parametrize("value", ["nan", "[1]", "3"])
def test_torchtitan_converters_must_be_names(tmp_path: Path, value: str) -> None:
    path = _variant(tmp_path, "torchtitan_deepseek_v3_16b.toml", 'converters = ["quantize.linear.float8"]',
                    f"converters = {value}")
    with pytest.raises(NdplanError, match=r":18: model.converters: expected a list of names \(strings\) or one "
                                          r"comma-separated string"):
        read_config(path)


def test_torchtitan_split_points_must_be_names(tmp_path: Path) -> None:
    path = _variant(tmp_path, "torchtitan_llama3_70b.toml", "pipeline_parallel_degree = 4",
                    "pipeline_parallel_degree = 4\npipeline_parallel_split_points = 5")
    with pytest.raises(NdplanError, match=r"parallelism.pipeline_parallel_split_points: expected a list of names"):
        read_config(path)


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.sh"
    path.write_text(text + "\ntorchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 32 --hidden-size 1024 "
                           "--num-attention-heads 16 --seq-length 4096 --micro-batch-size 1 --global-batch-size 8 "
                           "--vocab-size 32000 --ffn-hidden-size 4096 $EXTRA\n")
    return path


def test_a_huge_pipeline_layout_is_refused_before_it_is_built(tmp_path: Path) -> None:
    path = _script(tmp_path, "EXTRA=\"--pipeline-model-parallel-size 2 "
                             "--pipeline-model-parallel-layout Et*99999999999|t*16L\"")
    _refused_quickly(path, r"--pipeline-model-parallel-layout: expands to over 100,000 layer symbols")


def test_a_variable_built_from_itself_is_refused_quickly(tmp_path: Path) -> None:
    path = _script(tmp_path, "A=x\n" + "A=$A$A$A$A$A$A$A$A\n" * 8 + "EXTRA=")
    _refused_quickly(path, r"malformed shell script: expands to over 100,000 characters")


def test_an_array_built_from_itself_is_refused_quickly(tmp_path: Path) -> None:
    path = _script(tmp_path, "B=(a b)\n" + 'B=( "${B[@]}" "${B[@]}" )\n' * 30 + "EXTRA=")
    _refused_quickly(path, r"malformed shell script: expands to over 100,000 characters")


def test_a_huge_power_is_not_evaluated(tmp_path: Path) -> None:
    start = time.monotonic()
    result = read_config(_script(tmp_path, "EXTRA=--train-iters=$((9**9**9**9))"))
    assert time.monotonic() - start < 5
    assert result.model is not None


@pytest.mark.parametrize("pp, flags, message", [
    (2, "--decoder-first-pipeline-num-layers 40",
     r"--decoder-first-pipeline-num-layers 40 is more than the 32 layers of --num-layers"),
    (4, "--decoder-first-pipeline-num-layers 20 --decoder-last-pipeline-num-layers 20",
     r"--decoder-first-pipeline-num-layers 20 \+ --decoder-last-pipeline-num-layers 20 is more than the 32 layers"),
    (2, "--decoder-first-pipeline-num-layers 10 --decoder-last-pipeline-num-layers 10",
     r"pp=2 leaves no middle stage, so --decoder-first-pipeline-num-layers 10 \+ "
     r"--decoder-last-pipeline-num-layers 10 must be the 32 layers of --num-layers, not 20"),
])
def test_uneven_first_and_last_stages_say_what_is_wrong(tmp_path: Path, pp: int, flags: str, message: str) -> None:
    path = _script(tmp_path, f'EXTRA="--pipeline-model-parallel-size {pp} {flags}"')
    with pytest.raises(NdplanError, match=rf"train.sh:\d+: --decoder-first-pipeline-num-layers: {message}"):
        read_config(path)


def test_uneven_first_and_last_stages_that_fit_are_read(tmp_path: Path) -> None:
    path = _script(tmp_path, 'EXTRA="--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 10 '
                             '--decoder-last-pipeline-num-layers 22"')
    assert read_config(path).strategy_settings["stage_layers"] == (10, 22)


def test_inspect_shows_a_long_stage_list_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file with a million pipeline stages (the cap): its layer count per stage is shown as its
    first items and a count, not as pages the table took 16 s to lay out."""
    from ndplan.cli import main

    path = _variant(tmp_path, "torchtitan_llama3_70b.toml", "pipeline_parallel_degree = 4",
                    "pipeline_parallel_degree = 1048576")
    main(["inspect", str(path)])
    assert "2,097,088 more: 2,097,152 in all)" in capsys.readouterr().out


@pytest.mark.parametrize("base, exponent, value", [(2, 33, 2**33), (2, 62, 2**62), (10, 17, 10**17), (-2, 63, -(2**63)),
                                                   (2, 63, None), (3, 40, None), (9, 9**9, None)])
def test_shell_powers_are_those_bash_holds(base: int, exponent: int, value: int | None) -> None:
    """Bash's arithmetic is 64-bit: a power it holds is evaluated (2**33 was refused by a bound
    that overestimated the bits), one it does not is left unevaluated, without computing it."""
    from ndplan.io.shell import _power

    if value is None:
        with pytest.raises(ValueError):
            _power(base, exponent)
    else:
        assert _power(base, exponent) == value
