"""torch.compile'd decoder layers keep fewer tensors for backward than eager ones: the pytorch
profile's compiled pricing against what compiled tiny layers saved on a CPU
(tests/data/measured/compiled/layers.json, benchmarks/accuracy/compiled_layers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndplan.memory.activations import layer_activations
from ndplan.memory.options import MemoryOptions
from ndplan.memory.report import estimate
from ndplan.model import get_preset
from ndplan.model.hf import spec_from_hf_config
from ndplan.strategy import Strategy
from ndplan.strategy.batch import StrategyBatch

MEASURED = json.loads((Path(__file__).parent / "data" / "measured" / "compiled" / "layers.json").read_text())
POLICIES = ("none", "torchtitan-op", "keep-matmuls")


def _priced(config: dict, policy: str, compiled: bool = True) -> float:
    spec = spec_from_hf_config({**config, "num_hidden_layers": 1, "vocab_size": 128}, name="tiny")
    strategy = Strategy(dp=1, seq_length=MEASURED["seq_length"], micro_batch_size=1, global_batch_size=1,
                        recompute="none" if policy == "none" else "selective")
    options = MemoryOptions(runtime="pytorch", include_overhead=False, attention="sdpa",
                            torch_compile="model" if compiled else "off",
                            **({} if policy == "none" else {"selective_policy": policy}))
    acts = layer_activations(spec, StrategyBatch.of(strategy), options)
    return float((acts.full if policy == "none" else acts.recomputed)["dense"][0])


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha", "llama-wide-heads", "qwen3", "olmo2", "gemma3"])
@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_layers_price_what_they_saved(name: str, policy: str) -> None:
    """To the byte: a compiled norm keeps its bf16 input and statistic (not eager's fp32 copy and
    normalised output), q/k norms likewise, the MLP's activation is rebuilt, a pre-norm layer
    under selective recompute rebuilds the MLP's input too, and Gemma 3's sandwich layer the
    residual before its pre-MLP norm."""
    layer = MEASURED["layers"][name]
    assert _priced(layer["config"], policy) == layer["bytes_per_token"][policy]


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_phi3_is_priced_at_or_above_what_it_saved(policy: str) -> None:
    """Phi-3's fused qkv under the per-op policy is priced with keep-matmuls' flags (its matmuls
    come in another order): 384 bytes a token over, an upper bound; to the byte otherwise."""
    layer = MEASURED["layers"]["phi3"]
    over = 384.0 if policy == "torchtitan-op" else 0.0
    assert _priced(layer["config"], policy) == layer["bytes_per_token"][policy] + over


def test_compiled_layers_keep_less_than_eager() -> None:
    """What compiling saves, measured: 30% of a Llama layer's bytes without recompute, 13% under
    the per-op policy, 8% under keep-matmuls."""
    config = MEASURED["layers"]["llama-gqa"]["config"]
    saved = {policy: 1 - _priced(config, policy) / _priced(config, policy, compiled=False) for policy in POLICIES}
    assert saved == pytest.approx({"none": 0.3045, "torchtitan-op": 0.1294, "keep-matmuls": 0.0807}, abs=5e-4)


def test_what_is_not_measured_compiled_is_priced_eager_and_said() -> None:
    """MoE, MLA and Gated DeltaNet models keep the eager pricing under --compile (transformers'
    MoE blocks break the compiled graph; the others were not measured), and the loss's blocks
    always do."""
    options = MemoryOptions(runtime="pytorch", torch_compile="model")
    for name, reason in (("qwen3-30b-a3b", "experts"), ("deepseek-v2-lite", "multi-head latent attention"),
                         ("qwen3.5-27b", "Gated DeltaNet layers")):
        model = get_preset(name)
        assert not options.compiled_layers(model)
        assert reason in options.compiled_layers_gap(model)
    dense = get_preset("llama-3.1-8b")
    assert options.compiled_layers(dense) and options.compiled_layers_gap(dense) == ""
    assert "does not say what compiled layers keep" in MemoryOptions(
        runtime="megatron", torch_compile="model").compiled_layers_gap(dense)
    assert not MemoryOptions(runtime="pytorch", torch_compile="loss").compiled_layers(dense)
    strategy = Strategy(dp=8, seq_length=4096, micro_batch_size=1, global_batch_size=8)
    eager = estimate(dense, strategy, "h100-sxm", MemoryOptions(runtime="pytorch")).stages[0]
    compiled = estimate(dense, strategy, "h100-sxm", options).stages[0]
    assert compiled.activations_by_kind["output"] == eager.activations_by_kind["output"]
    # (the norms keep their bf16 inputs, the MLP no activation; attention keeps what it kept)
    assert compiled.activations_by_kind["attention"] == eager.activations_by_kind["attention"]
    assert compiled.activations_by_kind["norm"] < eager.activations_by_kind["norm"] / 2
    assert compiled.activations_by_kind["mlp"] < eager.activations_by_kind["mlp"]


def test_a_compiled_loss_keeps_bf16_logits_and_two_statistics() -> None:
    """torchtitan's cross-entropy on an fp32 copy of the logits keeps, eager, the fp32 log-softmax
    (4 bytes a logit) and the labels; compiled, the bf16 logits, each token's fp32 max and
    log-sum-exp, and the labels (the 1e-2 bytes: a scalar over the measured tokens). Not priced
    compiled where the loss is vocabulary-parallel, and the final norm before it stays eager."""
    measured = MEASURED["loss"]
    vocab = measured["vocab_size"]
    spec = spec_from_hf_config({**MEASURED["layers"]["llama-gqa"]["config"], "num_hidden_layers": 1,
                                "vocab_size": vocab}, name="tiny")
    strategy = StrategyBatch.of(Strategy(dp=1, seq_length=MEASURED["seq_length"], micro_batch_size=1,
                                         global_batch_size=1))
    head_input = 2 * spec.hidden_size  # the LM head's input, outside the loss function

    def output(**flags) -> float:
        options = MemoryOptions(runtime="pytorch", include_overhead=False, attention="sdpa", **flags)
        return float(layer_activations(spec, strategy, options).output[0]) - head_input - final_norm

    final_norm = 4 * spec.hidden_size + 4 + 2 * spec.hidden_size  # eager: fp32 input, statistic, normalised
    assert output() == pytest.approx(measured["bytes_per_token"]["eager"], abs=0.02)
    assert output(torch_compile="model+loss") == pytest.approx(measured["bytes_per_token"]["compiled"], abs=0.02)
    assert output(torch_compile="loss") == output(torch_compile="model+loss")
    assert output(torch_compile="model") == output()
    assert output(torch_compile="model+loss", loss_parallel=True) == output()


@pytest.mark.parametrize("name", sorted(set(MEASURED["float8_layers"]) - {"torchao"}))
@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_float8_layers_rebuild_their_linears_inputs(name: str, policy: str) -> None:
    """With torchao's Float8 linears (tensorwise, fp8 GEMMs) a compiled layer without recompute
    rebuilds the inputs its norms make for the linears (q/k/v's, the MLP's; OLMo 2's post-norm MLP
    input, the residual, stays) and the down projection's, for their fp8 casts: 2h·2 + 2·ffn
    bytes a token less than a bf16 compiled layer (2h + 2·ffn for OLMo 2); under selective
    recompute it keeps what the bf16 one keeps. To the byte, beside the Float8 scales (a scalar a
    linear: 0.1 bytes a token over the measured tokens, not priced)."""
    from ndplan.strategy.precision import PrecisionPolicy

    config = MEASURED["layers"][name]["config"]
    spec = spec_from_hf_config({**config, "num_hidden_layers": 1, "vocab_size": 128}, name="tiny")
    float8 = PrecisionPolicy(name="torchao-float8", param_bytes=4, grad_bytes=4, master_weight_bytes=0,
                             optimizer_state_bytes=4, param_gather_bytes=1, compute_dtype="fp8")
    strategy = Strategy(dp=1, seq_length=MEASURED["seq_length"], micro_batch_size=1, global_batch_size=1,
                        recompute="none" if policy == "none" else "selective", precision=float8)
    options = MemoryOptions(runtime="pytorch", include_overhead=False, attention="sdpa", torch_compile="model",
                            **({} if policy == "none" else {"selective_policy": policy}))
    acts = layer_activations(spec, StrategyBatch.of(strategy), options)
    priced = float((acts.full if policy == "none" else acts.recomputed)["dense"][0])
    assert priced == pytest.approx(MEASURED["float8_layers"][name][policy], abs=0.15)
    # (eager Float8 linears keep their bf16 inputs: the bf16 layer's bytes)
    eager = layer_activations(spec, StrategyBatch.of(strategy), MemoryOptions(
        runtime="pytorch", include_overhead=False, attention="sdpa",
        **({} if policy == "none" else {"selective_policy": policy})))
    assert float((eager.full if policy == "none" else eager.recomputed)["dense"][0]) == _priced(config, policy, False)


def test_a_compiled_loss_s_working_sets_are_its_bf16_tensors() -> None:
    """Around the loss (the larger of the forward's and the backward's working sets): eager, the
    bf16 logits and their fp32 copy (6 bytes a logit) or, in the backward, two fp32 gradients of
    the logits (8); compiled, the forward reads the bf16 logits in one fused kernel (2) and the
    backward writes the bf16 gradient beside an fp32 row sum a token (2 a logit + 4), as Inductor's
    generated code for the compiled loss runs them."""
    vocab = 1000
    spec = spec_from_hf_config({**MEASURED["layers"]["llama-gqa"]["config"], "num_hidden_layers": 1,
                                "vocab_size": vocab}, name="tiny")
    strategy = StrategyBatch.of(Strategy(dp=1, seq_length=512, micro_batch_size=1, global_batch_size=1))

    def transient(**flags) -> float:
        options = MemoryOptions(runtime="pytorch", include_overhead=False, attention="sdpa", **flags)
        return float(layer_activations(spec, strategy, options).output_transient[0])

    assert transient() == 8 * vocab
    assert transient(torch_compile="loss") == 2 * vocab + 4
    assert transient(torch_compile="model") == 8 * vocab
