"""The optimizer states and master weights on the host between steps
(``Strategy.offload_optimizer_states``: Megatron-Core's --offload-optimizer-states, MindSpeed's
--swap-optimizer): off the device through the forward and backward, back for the step."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.io import emit, read_config
from ndplan.memory import MemoryOptions, estimate
from ndplan.model import get_preset
from ndplan.perf import default_efficiency, estimate_time
from ndplan.strategy import RULES, RuleContext, Strategy, StrategyBatch

LLAMA = get_preset("llama-3.1-8b")
LLAMA_PARAMS = 8_030_261_248
MEGATRON = MemoryOptions(runtime="megatron")


def _strategy(offload: bool, **fields) -> Strategy:
    return Strategy(**({"dp": 8, "zero": 1, "seq_length": 4096, "precision": "megatron-bf16"} | fields),
                    offload_optimizer_states=offload)


def test_the_forward_and_backward_hold_no_optimizer_state_and_the_step_all_of_it():
    """megatron-bf16 keeps 2·4 B of Adam states and a 4 B master weight an element: a rank's
    shard of Llama-3.1-8B over dp 8 is 8.03e9/8 · 12 B, on the host through the forward and
    backward and on the device at the step."""
    kept = estimate(LLAMA, _strategy(False), "h100-sxm", MEGATRON).stages[0]
    moved = estimate(LLAMA, _strategy(True), "h100-sxm", MEGATRON).stages[0]
    shard = LLAMA_PARAMS / 8 * 12
    assert kept.optimizer_bytes == moved.optimizer_bytes == pytest.approx(shard)
    assert kept.forward_backward_bytes - moved.forward_backward_bytes == pytest.approx(shard)
    assert moved.step_peak_bytes == kept.step_peak_bytes  # the step holds every state again
    assert moved.host_optimizer_bytes == pytest.approx(shard) and kept.host_bytes == 0
    assert moved.unmade_bytes == pytest.approx(shard)  # counted in its category, absent at the fwd/bwd peak
    assert moved.peak_bytes < kept.peak_bytes


def test_the_step_peak_bounds_what_it_saves():
    """With short sequences the activations are small: freed of the states, the forward and
    backward fall below the optimizer step, which holds them all again and sets the peak."""
    kept = estimate(LLAMA, _strategy(False, seq_length=256), "h100-sxm", MEGATRON).stages[0]
    moved = estimate(LLAMA, _strategy(True, seq_length=256), "h100-sxm", MEGATRON).stages[0]
    shard = LLAMA_PARAMS / 8 * 12
    assert kept.forward_backward_bytes - moved.forward_backward_bytes == pytest.approx(shard)
    assert moved.forward_backward_bytes < moved.step_peak_bytes == moved.allocated_bytes
    assert 0 < kept.allocated_bytes - moved.allocated_bytes < shard


def test_it_needs_megatrons_distributed_optimizer():
    for fields, said in (({"zero": 0}, "zero=0"), ({"zero": 2}, "zero=2"), ({"zero": 3, "fsdp": True}, "zero=3 and fsdp"),
                         ({"optimizer_offload": True}, "not both")):
        with pytest.raises(ValidationError, match=said):
            _strategy(True, **fields)
    batch = StrategyBatch.from_columns({"dp": np.array([8, 8]), "zero": np.array([0, 1]),
                                        "offload_optimizer_states": np.array([1, 1])})
    rule = next(r for r in RULES if r.name == "optimizer_states_offload_needs_distributed_optimizer")
    assert rule.holds(batch, RuleContext(LLAMA, 8)).tolist() == [False, True]


def test_torch_runtimes_have_no_such_feature():
    with pytest.raises(NdplanError, match="offload_optimizer_states is Megatron-Core's --offload-optimizer-states"):
        estimate(LLAMA, _strategy(True), "h100-sxm", MemoryOptions())
    from ndplan.search.run import runtime_refusals

    assert runtime_refusals(_strategy(True), MemoryOptions(), LLAMA) == [
        "offload_optimizer_states: the pytorch runtime has no such feature (Megatron-Core's "
        "--offload-optimizer-states, MindSpeed's --swap-optimizer)"]
    assert runtime_refusals(_strategy(True), MEGATRON, LLAMA) == []


def test_the_step_waits_for_the_states_to_come_back():
    """The reload before the update: the rank's shard of states and master weights (12 B an
    element) over PCIe Gen5 (64 GB/s) at the profile's host-link efficiency."""
    device = get_device("h100-sxm")
    cluster = Cluster(device=device, num_devices=8)
    host_bw = device.host_link_bandwidth_bytes_per_s * default_efficiency(device).host_link_efficiency
    kept = estimate_time(LLAMA, _strategy(False), cluster, options=MEGATRON)
    moved = estimate_time(LLAMA, _strategy(True), cluster, options=MEGATRON)
    assert moved.breakdown["optimizer"] - kept.breakdown["optimizer"] == pytest.approx(LLAMA_PARAMS / 8 * 12 / host_bw)
    assert moved.step_s - kept.step_s == pytest.approx(LLAMA_PARAMS / 8 * 12 / host_bw)


def test_megatron_and_mindspeed_launches_carry_it_and_other_formats_say_they_lose_it(tmp_path):
    path = tmp_path / "run.sh"
    flags = "--micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --bf16 --use-distributed-optimizer"
    path.write_text(f"{flags} --offload-optimizer-states\n")
    read = read_config(path, model="llama-3.1-8b", devices=8)
    assert read.strategy().offload_optimizer_states and not read.strategy().optimizer_offload
    assert not any("offload-optimizer-states" in w for w in read.warnings)
    text = emit(LLAMA, read.strategy(), "megatron")
    assert "--offload-optimizer-states" in text and "--use-distributed-optimizer" in text
    path.write_text(f"{flags} --swap-optimizer --swap-optimizer-times 16\n")
    read = read_config(path, model="llama-3.1-8b", devices=8)
    assert read.strategy().offload_optimizer_states and not read.strategy().optimizer_offload
    assert any("--swap-optimizer: MindSpeed keeps the optimizer states" in n for n in read.notes)
    assert not any("swap-optimizer" in w for w in read.warnings)
    path.write_text("--micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --bf16 --offload-optimizer-states\n")
    with pytest.raises(NdplanError, match="distributed optimizer"):
        read_config(path, model="llama-3.1-8b", devices=8).strategy()
    for fmt in ("torchtitan", "hyperparallel", "mindformers"):
        assert "the optimizer states on the host between steps" in emit(LLAMA, _strategy(True), fmt)


def _tiny_space(**fields):
    from ndplan.search import default_space
    from ndplan.strategy import get_precision

    tiny = get_preset("llama-3.1-8b").model_copy(update={"num_layers": 4, "layer_mlp_kinds": ("dense",) * 4})
    space = default_space(tiny, get_device("h100-sxm"), 8, 16, 1024, get_precision("megatron-bf16"), **fields)
    return tiny, space


def _ranked_as_brute_force(model, space):
    from search_brute import search_as_brute_force

    return search_as_brute_force(model, get_device("h100-sxm"), space, 30 * 2**30, MEGATRON)


def test_a_launchs_setting_is_carried_to_the_candidates_with_the_distributed_optimizer():
    tiny, space = _tiny_space(dims=("pp", "zero", "recompute"), carried={"offload_optimizer_states": True})
    result = _ranked_as_brute_force(tiny, space)
    assert result.rejected["optimizer_states_offload_needs_distributed_optimizer"] == 0
    zeros = {(row["zero"], row["offload_optimizer_states"]) for row in result.ranked}
    assert zeros == {(0, False), (1, True), (2, False), (3, False)}


def test_the_search_weighs_it_as_an_opt_in_dimension():
    tiny, space = _tiny_space(dims=("pp", "zero", "recompute", "offload_optimizer_states"))
    assert space.offload_optimizer_states == (0, 1)
    result = _ranked_as_brute_force(tiny, space)
    assert result.rejected["optimizer_states_offload_needs_distributed_optimizer"] > 0
    assert {row["offload_optimizer_states"] for row in result.ranked} == {False, True}
    assert all(row["zero"] == 1 for row in result.ranked if row["offload_optimizer_states"])
    fixed = _tiny_space(dims=("pp",), fixed={"offload_optimizer_states": "on"})[1]
    assert fixed.offload_optimizer_states == (1,)


def test_the_cli_names_what_it_needs(capsys):
    from ndplan.cli import main

    assert main(["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--dp", "8",
                 "--offload-optimizer-states", "--runtime", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "offload_optimizer_states with zero=0" in err and "--use-distributed-optimizer" in err


def test_the_report_reproduces_it():
    from test_offload_io import reproduced

    strategy = _strategy(True, num_micro_batches=4)
    command, parsed = reproduced(strategy)
    assert "--offload-optimizer-states" in command and parsed == strategy
