"""A share of the optimizer on the CPU (``Strategy.optimizer_offload_fraction``: Megatron-Core's
--optimizer-offload-fraction, its HybridDeviceOptimizer): that share of the rank's parameters
updated by the CPU with its states on the host, the rest on the device, beside it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.io import emit, read_config
from ndplan.memory import MemoryOptions, estimate
from ndplan.model import get_preset
from ndplan.perf import estimate_time
from ndplan.strategy import Strategy, StrategyBatch

LLAMA = get_preset("llama-3.1-8b")
LLAMA_PARAMS = 8_030_261_248
MEGATRON = MemoryOptions(runtime="megatron")


def _strategy(fraction: float | None, **fields) -> Strategy:
    """Llama-3.1-8B over dp 8 with the distributed optimizer (megatron-bf16: 2·4 B of Adam states
    and a 4 B master weight an element); ``fraction`` None: no offload."""
    base = {"dp": 8, "zero": 1, "seq_length": 4096, "precision": "megatron-bf16"} | fields
    if fraction is None:
        return Strategy(**base)
    return Strategy(**base, optimizer_offload=True, optimizer_offload_fraction=fraction)


@pytest.mark.parametrize("fraction", [1.0, 0.75, 0.5, 0.1])
def test_the_device_keeps_the_rest_and_the_host_the_share(fraction):
    """The rank's shard is 8.03e9/8 elements: 12 B each on the device without offload; with it,
    (1 - f) of that stays, and the host pins f of the shard at 16 B (the states, the fp32 weight
    the CPU updates and its gradient's copy)."""
    shard = LLAMA_PARAMS / 8
    kept = estimate(LLAMA, _strategy(None), "h100-sxm", MEGATRON).stages[0]
    split = estimate(LLAMA, _strategy(fraction), "h100-sxm", MEGATRON).stages[0]
    assert kept.optimizer_bytes == pytest.approx(shard * 12)
    assert split.optimizer_bytes == pytest.approx((1 - fraction) * shard * 12)
    assert split.host_optimizer_bytes == pytest.approx(fraction * shard * 16)
    assert split.params_bytes == kept.params_bytes and split.grads_bytes == kept.grads_bytes


def test_more_on_the_cpu_never_holds_more_on_the_device():
    peaks = [estimate(LLAMA, _strategy(f), "h100-sxm", MEGATRON).peak_bytes for f in (0.2, 0.4, 0.6, 0.8, 1.0)]
    assert peaks == sorted(peaks, reverse=True)
    assert estimate(LLAMA, _strategy(None), "h100-sxm", MEGATRON).peak_bytes > peaks[0]


def test_the_step_runs_the_two_shares_side_by_side():
    """On one device (no gradient-norm all-reduce), the update takes max(f · the CPU's whole
    step, (1 - f) · the device's whole update): the device's kernels are launched first and run
    while the CPU copies and steps its share."""
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=1)

    def update(fraction: float | None) -> float:
        return estimate_time(LLAMA, _strategy(fraction, dp=1), cluster, options=MEGATRON).breakdown["optimizer"]

    on_device, on_cpu = update(None), update(1.0)
    assert on_cpu > on_device > 0
    for fraction in (0.9, 0.5, 0.1, 0.01):
        assert update(fraction) == pytest.approx(max(fraction * on_cpu, (1 - fraction) * on_device), rel=1e-9)


def test_a_share_needs_the_offload_and_a_runtime_that_splits_it():
    with pytest.raises(ValidationError, match="optimizer_offload_fraction 0.5 without optimizer_offload"):
        Strategy(optimizer_offload_fraction=0.5)
    for share in (0.0, 1.5, float("nan")):
        with pytest.raises(ValidationError, match="optimizer_offload_fraction"):
            Strategy(optimizer_offload=True, optimizer_offload_fraction=share)
    fsdp = Strategy(dp=8, zero=3, fsdp=True, optimizer_offload=True, optimizer_offload_fraction=0.5)
    with pytest.raises(NdplanError, match="runtime 'pytorch' offloads the whole optimizer"):
        estimate(LLAMA, fsdp, "h100-sxm", MemoryOptions(runtime="pytorch"))
    with pytest.raises(ValueError, match="share one optimizer_offload_fraction"):
        StrategyBatch.of([_strategy(0.5), _strategy(0.25)])
    batch = StrategyBatch.of([_strategy(0.5), _strategy(None)])  # (the share of the ones that offload)
    assert [s.optimizer_offload_fraction for s in batch.rows()] == [0.5, 1.0]


def test_megatron_launches_carry_it_and_torchtitan_says_it_loses_it(tmp_path):
    path = tmp_path / "run.sh"
    flags = ("--micro-batch-size 1 --global-batch-size 8 --seq-length 4096 --bf16 --use-distributed-optimizer "
             "--optimizer-cpu-offload --use-precision-aware-optimizer")
    path.write_text(f"{flags} --optimizer-offload-fraction 0.4\n")
    read = read_config(path, model="llama-3.1-8b", devices=8)
    strategy = read.strategy()
    assert strategy.optimizer_offload and strategy.optimizer_offload_fraction == 0.4
    assert not any("fraction" in w for w in read.warnings)
    text = emit(LLAMA, strategy, "megatron")
    assert "--optimizer-offload-fraction 0.4" in text
    path.write_text(text)
    assert read_config(path, model="llama-3.1-8b", devices=8).strategy() == strategy
    assert "--optimizer-offload-fraction" not in emit(LLAMA, _strategy(1.0), "megatron")
    path.write_text(f"{flags} --optimizer-offload-fraction 1.2\n")
    with pytest.raises(NdplanError, match=r"--optimizer-offload-fraction.*not a share in \(0, 1\]"):
        read_config(path, model="llama-3.1-8b", devices=8)
    fsdp = Strategy(dp=8, zero=3, fsdp=True, optimizer_offload=True, optimizer_offload_fraction=0.5)
    assert "offloading 0.5 of the optimizer" in emit(LLAMA, fsdp, "torchtitan")


def test_a_search_carries_a_launchs_share_to_the_candidates_that_offload():
    from ndplan.search import default_space
    from ndplan.strategy import get_precision
    from search_brute import search_as_brute_force

    tiny = LLAMA.model_copy(update={"num_layers": 4, "layer_mlp_kinds": ("dense",) * 4})
    space = default_space(tiny, get_device("h100-sxm"), 8, 16, 1024, get_precision("megatron-bf16"),
                          dims=("pp", "zero"), carried={"optimizer_offload": True, "optimizer_offload_fraction": 0.5})
    assert space.optimizer_offload_fraction == 0.5
    # (the vectorised search's ranking, held to every candidate priced alone)
    result = search_as_brute_force(tiny, get_device("h100-sxm"), space, 30 * 2**30, MEGATRON)
    offloading = [row for row in result.ranked if row["optimizer_offload"]]
    assert offloading and all(row["strategy"]["optimizer_offload_fraction"] == 0.5 for row in offloading)
    with pytest.raises(NdplanError, match="carried optimizer_offload_fraction=2"):
        default_space(tiny, get_device("h100-sxm"), 8, 16, 1024, get_precision("megatron-bf16"),
                      carried={"optimizer_offload_fraction": 2})


def test_the_cli_takes_it_and_explains_both_halves(capsys):
    args = ["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--zero", "1",
            "--runtime", "megatron", "--optimizer-offload", "--optimizer-offload-fraction", "0.5", "--explain"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "optimizer-cpu0.5" in out
    assert "0.5 of it offloaded to pinned host memory" in out and "the rest on the device" in out
    assert "0.5 of the shard there beside the rest on the device: max(f · CPU, (1 - f) · device)" in out
    assert main(args[:-4] + ["--optimizer-offload-fraction", "0.5"]) == 2
    assert "without optimizer_offload" in capsys.readouterr().err


def test_the_report_reproduces_it():
    from test_offload_io import reproduced

    strategy = _strategy(0.3, num_micro_batches=4)
    command, parsed = reproduced(strategy)
    assert "--optimizer-offload-fraction 0.3" in command and parsed == strategy
