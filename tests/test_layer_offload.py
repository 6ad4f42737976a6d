"""Megatron-Core's layer offload (--cpu-offloading-num-layers, ``Strategy.offload_layers``): what
Megatron refuses, what stays on the device, the copies' time, and how launches carry it. By
hand on Llama-3.1-8B (32 layers), one micro-batch of 4096 tokens, no pipeline."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.io import emit, read_config
from ndplan.memory import MemoryOptions, estimate
from ndplan.memory.activations import layer_activations
from ndplan.memory.layer_offload import first_layers, held_away
from ndplan.model import get_preset
from ndplan.perf import OverlapConfig, default_efficiency
from ndplan.perf.layer import LayerContext, piece_times
from ndplan.perf.step import compute_rates, strategy_columns
from ndplan.perf.topology import Fabric
from ndplan.strategy import RULES, RuleContext, Strategy, StrategyBatch

LLAMA = get_preset("llama-3.1-8b")
MEGATRON = MemoryOptions(runtime="megatron")
SEQ = 4096


def _strategy(layers: int, **fields) -> Strategy:
    return Strategy(seq_length=SEQ, precision="megatron-bf16", offload_layers=layers, **fields)


@pytest.mark.parametrize("fields,words", [
    ({"pp": 2}, "no support for pipeline parallelism with CPU offloading"),
    ({"recompute": "selective"}, "does not work when activation recomputation is enabled"),
    ({"offload_modules": ("core_attn",)}, "fine-grained activation offloading or layer offloading"),
])
def test_megatron_refuses_it_beside_a_pipeline_recompute_or_module_offload(fields, words):
    with pytest.raises(ValidationError, match=words):
        _strategy(4, **fields)
    # A batch built from columns is checked by the rule instead.
    columns = {"pp": np.array([1, 2]), "offload_layers": np.array([4, 4]), "num_micro_batches": np.array([1, 2])}
    batch = StrategyBatch.from_columns(columns)
    runs = next(r for r in RULES if r.name == "offload_layers_run")
    assert runs.holds(batch, RuleContext(LLAMA)).tolist() == [True, False]


def test_first_layers_take_a_models_leading_dense_layers_first():
    dsv3 = get_preset("deepseek-v3")  # 3 dense layers, then 58 MoE
    dense, moe = first_layers(dsv3, np.array([0, 2, 3, 10, 61]))
    assert dense.tolist() == [0, 2, 3, 3, 3] and moe.tolist() == [0, 0, 0, 7, 58]
    assert [a.tolist() for a in held_away(dsv3, np.array([0, 1, 4]))] == [[0, 0, 3], [0, 0, 0]]


def test_all_but_one_offloaded_layer_leave_the_device_at_the_peak():
    """8 of 32 layers offloaded: 7 layers' activations fewer on the device (the eighth is
    reloaded at the backward's start), all 8 on the host; the breakdown still sums to the total."""
    full = float(layer_activations(LLAMA, StrategyBatch.of(_strategy(0)), MEGATRON).full["dense"][0])
    plain = estimate(LLAMA, _strategy(0), "h100-sxm", MEGATRON).stages[0]
    offloaded = estimate(LLAMA, _strategy(8), "h100-sxm", MEGATRON).stages[0]
    assert plain.activations_bytes - offloaded.activations_bytes == pytest.approx(7 * full * SEQ)
    assert offloaded.host_activation_bytes == pytest.approx(8 * full * SEQ)
    assert sum(offloaded.activations_by_kind.values()) == pytest.approx(offloaded.activations_bytes)
    assert plain.host_activation_bytes == 0


def _dense_piece(layers: int, device: str = "h100-sxm") -> dict:
    cluster = Cluster(device=get_device(device), num_devices=1)
    batch = StrategyBatch.of(_strategy(layers))
    eff = default_efficiency(cluster.device)
    fabric = Fabric.of(cluster, eff)
    overlap = OverlapConfig()
    ctx = LayerContext(LLAMA, compute_rates(cluster, batch, eff), fabric, eff, overlap, batch.precision)
    seconds = piece_times(ctx, strategy_columns(LLAMA, batch, overlap))["dense"].seconds
    return {key: float(np.ravel(value)[0]) for key, value in seconds.items()} | {"host_bw": fabric.host_bw}


def test_a_layer_waits_for_its_share_of_the_copies_beyond_its_compute():
    """Per layer, each pass: max(0, (N/L)·c - its other seconds), c one layer's saved bytes over
    the host link (PCIe Gen5 on an H100: 64 GB/s at the profile's efficiency). With all but one
    of 32 layers offloaded the copies outrun the compute; with none nothing is priced."""
    full = float(layer_activations(LLAMA, StrategyBatch.of(_strategy(0)), MEGATRON).full["dense"][0])
    piece = _dense_piece(31)
    copy = 31 / 32 * full * SEQ / piece["host_bw"]
    passes = {key: value for key, value in piece.items() if isinstance(key, tuple) and key[1] != "offload"}
    forward = sum(v for (p, _), v in passes.items() if p == "F")
    backward = sum(v for (p, _), v in passes.items() if p in ("B", "W"))
    assert piece[("F", "offload")] == pytest.approx(max(copy - forward, 0.0)) and piece[("F", "offload")] > 0
    assert piece[("B", "offload")] == pytest.approx(max(copy - backward, 0.0))
    assert ("F", "offload") not in _dense_piece(0) or _dense_piece(0)[("F", "offload")] == 0


def test_torch_runtimes_have_no_layer_offload():
    with pytest.raises(NdplanError, match="offload_layers is Megatron-Core's --cpu-offloading-num-layers"):
        estimate(LLAMA, _strategy(4), "h100-sxm", MemoryOptions())
    from ndplan.search.run import runtime_refusals

    assert runtime_refusals(_strategy(4), MemoryOptions(), LLAMA) == [
        "offload_layers=4: the pytorch runtime has no layer offload (Megatron-Core's --cpu-offloading-num-layers)"]
    assert runtime_refusals(_strategy(4), MEGATRON, LLAMA) == []


def test_megatron_launches_carry_it_and_other_formats_say_they_lose_it(tmp_path):
    path = tmp_path / "run.sh"
    flags = "--micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --bf16"
    path.write_text(f"{flags} --cpu-offloading --cpu-offloading-num-layers 8\n")
    read = read_config(path, model="llama-3.1-8b", devices=8)
    assert read.strategy().offload_layers == 8 and not any("cpu-offloading" in w for w in read.warnings)
    text = emit(LLAMA, read.strategy(), "megatron")
    assert "--cpu-offloading-num-layers 8" in text
    path.write_text(f"{flags} --pipeline-model-parallel-size 2 --cpu-offloading-num-layers 8\n")
    with pytest.raises(NdplanError, match="--cpu-offloading-num-layers.*no support for pipeline parallelism"):
        read_config(path, model="llama-3.1-8b", devices=8)
    assert "left out: layer offload (Megatron-Core only): the first 8 layers' activations" in emit(
        LLAMA, _strategy(8, dp=8), "torchtitan")


SEARCH_MOE = LLAMA.model_copy(update={
    "name": "tiny-moe-8", "num_layers": 8, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 8,
    "num_kv_heads": 4, "head_dim": 32, "vocab_size": 1024, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_ffn_hidden_size": 128, "layer_mlp_kinds": ("dense",) + ("moe",) * 7})


def offload_layer_space(device):
    """The small MoE model's space on 8 devices with layer offload searched beside EP, PP and recompute."""
    from ndplan.search import default_space
    from ndplan.strategy import get_precision

    return default_space(SEARCH_MOE, device, 8, 16, 1024, get_precision("megatron-bf16"),
                         dims=("ep", "pp", "recompute", "offload_layers"))


def test_search_over_offloaded_layers_equals_brute_force():
    """The opt-in dimension offload_layers (0, and 1/8 to 6/8 of the layers): the ranked list
    equals a loop over the space with the single-strategy API; candidates with a pipeline or
    recompute beside it fail rule offload_layers_run (the Strategy refuses them as it is built)."""
    from ndplan.search.space import offload_layer_counts
    from search_brute import search_as_brute_force

    assert offload_layer_counts(SEARCH_MOE) == (0, 1, 2, 3, 4, 5, 6)
    assert offload_layer_counts(LLAMA) == (0, 4, 8, 12, 16, 20, 24)
    device = get_device("h100-sxm")
    result = search_as_brute_force(SEARCH_MOE, device, offload_layer_space(device), 2 * 2**30, MEGATRON,
                                   block_size=97)
    assert result.rejected["offload_layers_run"] > 0
    offloaded = [row for row in result.ranked if row["offload_layers"]]
    assert {row["offload_layers"] for row in offloaded} == {1, 2, 3, 4, 5, 6}
    assert all(row["pp"] == 1 and row["recompute"] == "none" for row in offloaded)


def test_the_balancer_has_nothing_to_balance_under_layer_offload():
    from ndplan.balance import balance

    with pytest.raises(NdplanError, match="offload_layers=8: the balancer plans layers per stage and recompute"):
        balance(LLAMA, _strategy(8, dp=8), "h100-sxm", "60GiB", options=MEGATRON)
