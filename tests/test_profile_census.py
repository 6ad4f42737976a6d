"""The PyTorch runtime profile reproduces what the census measured on the real transformers code.

The census records ship with ndplan (src/ndplan/memory/census/, regenerate with
`python -m ndplan.census PRESET --out FILE`); test_census.py checks the census itself.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from ndplan.census.record import from_json
from ndplan.memory.activations import layer_activations
from ndplan.memory.options import MemoryOptions
from ndplan.model import get_preset
from ndplan.strategy import Strategy, StrategyBatch

MODELS = ["llama-3.1-8b", "qwen2.5-7b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite", "deepseek-v3"]


def records(name):
    text = resources.files("ndplan.memory").joinpath("census", f"{name}.json").read_text()
    return from_json(text)


@pytest.mark.parametrize("name", MODELS)
def test_profile_matches_census_at_tp1(name):
    model = get_preset(name)
    acts = layer_activations(model, StrategyBatch.of(Strategy(seq_length=4096)), MemoryOptions())
    for record in records(name):
        kind = record.layer_kind.split("-")[-1]
        ours = acts.output[0] if kind == "output" else acts.full[kind][0]
        assert ours == pytest.approx(record.saved_bytes_per_token, rel=2e-4), record.layer_kind


@pytest.mark.parametrize("name", MODELS)
def test_profile_tensor_parallel_split_close_to_census(name):
    """The census simulates TP 2 by halving heads and widths (vocabulary too, as a vocab-parallel
    loss does); its split and the profile's agree within 6% (the profile keeps the expert input
    copies and q/k/v biases replicated, the simulation halves them)."""
    model = get_preset(name)
    acts = layer_activations(model, StrategyBatch.of(Strategy(tp=2, seq_length=4096)), MemoryOptions(loss_parallel=True))
    for record in records(name):
        kind = record.layer_kind.split("-")[-1]
        ours = acts.output[0] if kind == "output" else acts.full[kind][0]
        measured = record.saved_replicated_bytes_per_token + record.saved_tp_scaled_bytes_per_token / 2
        assert ours == pytest.approx(measured, rel=0.06), record.layer_kind


def test_selective_and_full_recompute_match_census():
    model = get_preset("llama-3.1-8b")
    dense = next(r for r in records("llama-3.1-8b") if r.layer_kind == "dense")
    full = layer_activations(model, StrategyBatch.of(Strategy(recompute="full")), MemoryOptions())
    assert full.recomputed["dense"][0] == dense.full_recompute.saved_bytes_per_token


@pytest.mark.parametrize("name", MODELS)
def test_selective_recompute_matches_census(name):
    """Selective recompute (torch's checkpointing keeping matmul and attention outputs): the
    profile's keep flags reproduce the census to the byte. (A MoE block's input, a norm's output,
    was kept where the census rebuilds it and the router's logits not: Qwen3-30B-A3B's layers read
    4.6% over, Mixtral's 2.4%; MLA's kv down-projection output keeps its rope key too: DeepSeek-V3's
    MoE layers read 0.3% under.)"""
    model = get_preset(name)
    acts = layer_activations(model, StrategyBatch.of(Strategy(recompute="selective")), MemoryOptions())
    for record in records(name):
        kind = record.layer_kind.split("-")[-1]
        if kind != "output":
            assert acts.recomputed[kind][0] == record.selective.saved_bytes_per_token, kind


def test_a_census_of_another_model_is_refused() -> None:
    """A census's bytes per token belong to the layers it measured: given for another model (the
    same hidden size included: Llama-3.1-8B's for Qwen3-8B) the estimate refused nothing and
    priced the wrong layers (Llama-3.1-70B's activations 52.4 GiB read 25.5)."""
    from ndplan.errors import NdplanError
    from ndplan.memory import estimate

    text = resources.files("ndplan.memory").joinpath("census", "llama-3.1-8b.json").read_text()
    options = MemoryOptions(census=tuple(from_json(text)))
    estimate(get_preset("llama-3.1-8b"), Strategy(), None, options)  # its own model: fine
    for other in ("llama-3.1-70b", "qwen3-8b"):
        with pytest.raises(NdplanError, match=rf"measured on llama-3.1-8b \(hidden size 4096\), not on {other}"):
            estimate(get_preset(other), Strategy(), None, options)


def test_a_census_is_matched_by_layer_architecture_not_name() -> None:
    """A census of a checkpoint folder named after its HF repo (Meta-Llama-3.1-8B) was refused for
    the llama-3.1-8b preset, whose layers it measured: the record carries the layer architecture
    it measured, which decides whatever the names; a model with other layers is refused by field."""
    from dataclasses import replace

    from ndplan.census.measure import _architecture
    from ndplan.census.record import to_json
    from ndplan.errors import NdplanError
    from ndplan.memory import estimate
    from ndplan.model.presets import hf_config

    preset = get_preset("llama-3.1-8b")
    architecture = _architecture(hf_config("llama-3.1-8b"), "Meta-Llama-3.1-8B")
    assert architecture == preset.layer_architecture()
    text = resources.files("ndplan.memory").joinpath("census", "llama-3.1-8b.json").read_text()
    measured = [replace(r, model="Meta-Llama-3.1-8B", architecture=architecture) for r in from_json(text)]
    read_back = from_json(to_json(measured))
    assert read_back == measured
    options = MemoryOptions(census=tuple(read_back))
    plain = estimate(preset, Strategy(), None, MemoryOptions(census=tuple(from_json(text))))
    assert estimate(preset, Strategy(), None, options).peak_bytes == plain.peak_bytes
    with pytest.raises(NdplanError, match=r"whose layers differ from llama-3.1-70b's: ffn_hidden_size 14336 \(census\) "
                                          r"vs 28672, hidden_size 4096 \(census\) vs 8192, num_attention_heads 32"):
        estimate(get_preset("llama-3.1-70b"), Strategy(), None, options)
    # Only the stack differs (fewer layers): the same layers, accepted.
    estimate(preset.model_copy(update={"num_layers": 16, "layer_mlp_kinds": ("dense",) * 16,
                                       "layer_attention_spans": ("full",) * 16, "name": "mine"}),
             Strategy(), None, options)


def test_a_census_older_than_a_model_field_measured_its_default() -> None:
    """A record written before norm_placement existed lacks it in its architecture: it measured a
    pre-norm model, so it prices one (it was refused: 'norm_placement unset (census) vs pre') and
    is refused for Gemma-style sandwich norms, which it did not measure."""
    from dataclasses import replace

    from ndplan.errors import NdplanError
    from ndplan.memory import estimate

    preset = get_preset("llama-3.1-8b")
    older = tuple((name, value) for name, value in preset.layer_architecture() if name != "norm_placement")
    text = resources.files("ndplan.memory").joinpath("census", "llama-3.1-8b.json").read_text()
    options = MemoryOptions(census=tuple(replace(r, architecture=older) for r in from_json(text)))
    estimate(preset, Strategy(), None, options)
    sandwich = preset.model_copy(update={"norm_placement": "sandwich"})
    with pytest.raises(NdplanError, match=r"norm_placement pre \(census\) vs sandwich"):
        estimate(sandwich, Strategy(), None, options)


def test_a_census_architecture_field_is_checked() -> None:
    from ndplan.census.record import to_json
    from ndplan.errors import NdplanError

    text = resources.files("ndplan.memory").joinpath("census", "llama-3.1-8b.json").read_text()
    data = json.loads(to_json(from_json(text)))
    data["records"][0]["architecture"] = ["hidden_size", 4096]
    with pytest.raises(NdplanError, match=r"record 0: field 'architecture' must be an object of model fields"):
        from_json(json.dumps(data))
