"""Model descriptions: ModelSpec, Hugging Face config reading, presets and parameter counts."""

from ndplan.model.hf import spec_from_hf_config
from ndplan.model.params import LayerParams, ParameterCounts, count_parameters, layer_params
from ndplan.model.presets import as_model, get_preset, hf_config, load_model, preset_names
from ndplan.model.spec import ModelSpec

__all__ = [
    "LayerParams",
    "ModelSpec",
    "ParameterCounts",
    "as_model",
    "count_parameters",
    "get_preset",
    "hf_config",
    "layer_params",
    "load_model",
    "preset_names",
    "spec_from_hf_config",
]
