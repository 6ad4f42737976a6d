"""Malformed inputs a fuzzing review found: each is an NdplanError naming the file and the field
(and what is allowed), never a traceback, a hang or a silently wrong number."""

from __future__ import annotations

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
