"""Malformed inputs a fuzzing review found: each is an NdplanError naming the file and the field
(and what is allowed), never a traceback, a hang or a silently wrong number."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ndplan.census.measure import load_hf_config
from ndplan.census.measure_step import load_measurement
from ndplan.census.record import load_census_file
from ndplan.errors import NdplanError
from ndplan.io import read_config
from ndplan.memory.profile import get_profile
from ndplan.model.presets import load_model
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
])
def test_a_deeply_nested_file_is_an_error_naming_it(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    read = {"config.json": load_model, "model.yaml": load_model, "census.json": load_census_file,
            "measured.json": load_measurement, "hf.json": load_hf_config, "result.json": load_result,
            "profile.yaml": get_profile}.get(name, read_config)
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


def test_a_derived_head_dim_of_zero_names_the_fields_that_give_it(tmp_path: Path) -> None:
    with pytest.raises(NdplanError, match=r"config.json: no field 'head_dim', and hidden_size / num_attention_heads "
                                          r"= 16 / 32 gives 0; hidden_size must be at least num_attention_heads"):
        load_model(str(_hf(tmp_path, LLAMA, hidden_size=16)))


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
