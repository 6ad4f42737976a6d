"""Shipped model presets (HF config.json files in the package) and loading a model by name or path."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ndplan.errors import NdplanError, by_name_or_object, did_you_mean, parse_nested, read_text, require_name
from ndplan.model.hf import first_validation_error, spec_from_hf_config
from ndplan.model.spec import ModelSpec

_PRESET_DIR = "presets"


def _preset_files() -> dict[str, Any]:
    folder = resources.files("ndplan.model").joinpath(_PRESET_DIR)
    return {
        entry.name.removesuffix(".json"): entry
        for entry in folder.iterdir()
        if entry.name.endswith(".json") and entry.name != "index.json"
    }


@lru_cache(maxsize=1)
def preset_names() -> tuple[str, ...]:
    """The names of the shipped model presets, sorted."""
    return tuple(sorted(_preset_files()))


@lru_cache(maxsize=1)
def preset_index() -> dict[str, dict[str, Any]]:
    """Per preset: the HF repository, a display name and published parameter counts with source."""
    index = resources.files("ndplan.model").joinpath(_PRESET_DIR, "index.json")
    if not index.is_file():
        return {}
    data: dict[str, dict[str, Any]] = json.loads(index.read_text())
    return data


def hf_config(name: str) -> dict[str, Any]:
    """The shipped Hugging Face config.json of a preset, as a dict."""
    files = _preset_files()
    key = name.lower()
    if key not in files:
        raise NdplanError(f"unknown model '{name}'{did_you_mean(name, preset_names())}; presets: "
                          f"{', '.join(preset_names())} (or give a path to a config file)")
    config: dict[str, Any] = json.loads(files[key].read_text())
    return config


@lru_cache(maxsize=64)
def get_preset(name: str) -> ModelSpec:
    """The shipped preset called ``name`` (case-insensitive), read from its Hugging Face config."""
    key = require_name(name, "preset name").lower()
    return spec_from_hf_config(hf_config(key), name=key, source=f"preset {key}")


def read_structured_file(path: Path) -> Any:
    """Parse a JSON or YAML file; a syntax error names the file and line."""
    if not path.is_file():
        what = "a folder, not a file" if path.is_dir() else "not a regular file" if path.exists() else "no such file"
        raise NdplanError(f"{path}: {what}")
    text = read_text(path)
    try:
        if path.suffix.lower() == ".json":
            return parse_nested(json.loads, text, path, "JSON")
        return parse_nested(yaml.safe_load, text, path, "YAML")
    except json.JSONDecodeError as error:
        raise NdplanError(f"{path}:{error.lineno}: malformed JSON: {error.msg}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise NdplanError(f"{path}{line}: malformed YAML: {problem}") from None


def load_model_file(path: str | Path) -> ModelSpec:
    """A Hugging Face config.json (recognised by ``model_type`` + ``num_hidden_layers``) or a spec
    in ndplan's own field names (JSON or YAML)."""
    path = Path(path)
    data = read_structured_file(path)
    if not isinstance(data, dict):
        raise NdplanError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    odd = next((key for key in data if not isinstance(key, str)), None)
    if odd is not None:  # (YAML reads `1:` as a number; ModelSpec(**data) raised a TypeError traceback)
        raise NdplanError(f"{path}: field names are text; {odd!r} is not a field")
    name = path.parent.name if path.name == "config.json" else path.stem
    if "num_hidden_layers" in data or "model_type" in data and "num_layers" not in data:
        return spec_from_hf_config(data, name=name, source=str(path))
    try:
        return ModelSpec(**{"name": name, **data})
    except ValidationError as error:
        raise NdplanError(f"{path}: {first_validation_error(error)}") from None


#: The extensions of the model files ``load_model`` reads (JSON or YAML).
MODEL_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name, a path to a config file, or a model folder holding a config.json (as a
    Hugging Face checkpoint is laid out)."""
    if require_name(name_or_path, "model").lower() in preset_names():
        return get_preset(name_or_path)
    if not name_or_path.strip():  # Path("") is the current folder
        raise NdplanError(f"model: the name is empty; give a preset ({', '.join(preset_names()[:3])}, ...), "
                          "a config file or a model folder")
    if Path(name_or_path).suffix.lower() in MODEL_FILE_SUFFIXES:
        return load_model_file(name_or_path)
    if Path(name_or_path).is_file():
        suffix = Path(name_or_path).suffix
        raise NdplanError(f"{name_or_path}: a model file is read by its extension, {', '.join(MODEL_FILE_SUFFIXES)} "
                          f"(a config.json or a spec in ndplan's field names); "
                          + (f"'{suffix}' is not one of them" if suffix else "this one has none"))
    if Path(name_or_path).is_dir():
        config = Path(name_or_path) / "config.json"
        if not config.is_file():
            raise NdplanError(f"{name_or_path}: a model folder needs a config.json (Hugging Face layout); none there")
        return load_model_file(config)
    raise NdplanError(
        f"unknown model '{name_or_path}'{did_you_mean(name_or_path, preset_names())}; presets: "
        f"{', '.join(preset_names())} (or give a path to a config file)"
    )


def as_model(value: ModelSpec | str, what: str = "model") -> ModelSpec:
    """A ModelSpec, or one by preset name, config path or model folder (``load_model``)."""
    model: ModelSpec = by_name_or_object(value, ModelSpec, load_model, what, "model")
    return model
