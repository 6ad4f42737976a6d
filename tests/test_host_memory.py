"""Pinned host memory (``memory.host``): what optimizer and activation offload fill on the host,
each device's share of its node's host memory (``Device.host_memory_bytes``), and the checks
``estimate`` and ``search`` make against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.memory import MemoryOptions, estimate
from ndplan.memory.static_state import host_optimizer_width
from ndplan.model import get_preset
from ndplan.strategy import Strategy, get_precision

LLAMA = get_preset("llama-3.1-8b")
LLAMA_PARAMS = 8_030_261_248  # Llama-3.1-8B, untied embeddings (the Hub's safetensors index)
MEGATRON = MemoryOptions(runtime="megatron")


def test_host_bytes_per_element_of_an_offloaded_optimizer():
    """States + the weight the CPU step updates + its gradient at that weight's width."""
    assert host_optimizer_width(get_precision("megatron-bf16")) == 2 * 4 + 4 + 4  # fp32 master copy
    assert host_optimizer_width(get_precision("fsdp-bf16")) == 2 * 4 + 4 + 4  # fp32 sharded parameters
    assert host_optimizer_width(get_precision("bf16-pure")) == 2 * 2 + 2 + 2


def test_an_offloaded_optimizer_fills_its_shard_times_16_bytes_on_the_host():
    kept = Strategy(dp=8, zero=1, seq_length=4096, precision="megatron-bf16")
    offloaded = kept.model_copy(update={"optimizer_offload": True})
    on_device = estimate(LLAMA, kept, "h100-sxm", MEGATRON).stages[0]
    moved = estimate(LLAMA, offloaded, "h100-sxm", MEGATRON).stages[0]
    assert on_device.optimizer_bytes == pytest.approx(LLAMA_PARAMS / 8 * 12)
    assert on_device.host_bytes == 0
    assert moved.optimizer_bytes == 0
    assert moved.host_optimizer_bytes == pytest.approx(LLAMA_PARAMS / 8 * 16)
    assert moved.host_activation_bytes == 0
    assert moved.host_bytes == moved.host_optimizer_bytes


def test_each_device_gets_its_share_of_the_node_host_memory():
    h100 = get_device("h100-sxm")  # DGX H100: 2 TB using 32 DIMMs, 8 GPUs
    assert h100.node_host_memory_bytes == 2 * 2**40
    assert h100.host_memory_bytes == 2**40 / 4
    assert get_device("gb200-nvl72").host_memory_bytes == 960e9 / 4  # two Graces of 480 GB a 4-GPU tray
    assert get_device("ascend-910b").host_memory_bytes is None  # no shipped figure found
    assert h100.model_copy(update={"node_host_memory_bytes": None}).host_memory_bytes is None
    written = h100.model_dump() | {"node_host_memory_bytes": "1.5TiB"}
    assert type(h100).model_validate(written).node_host_memory_bytes == int(1.5 * 2**40)


def test_fits_host_against_the_share_and_unknown_without_one():
    strategy = Strategy(dp=8, zero=1, seq_length=4096, precision="megatron-bf16", optimizer_offload=True)
    need = LLAMA_PARAMS / 8 * 16  # 16.06 GB a device
    h100 = get_device("h100-sxm")
    assert estimate(LLAMA, strategy, h100, MEGATRON).fits_host is True
    small = h100.model_copy(update={"node_host_memory_bytes": int(8 * need) - 8})
    report = estimate(LLAMA, strategy, small, MEGATRON)
    assert report.host_peak_bytes == pytest.approx(need)
    assert report.fits_host is False and report.fits is True  # the device's own memory is another check
    unknown = estimate(LLAMA, strategy, "ascend-910b", MEGATRON)
    assert unknown.fits_host is None
    nothing = estimate(LLAMA, strategy.model_copy(update={"optimizer_offload": False}), "ascend-910b", MEGATRON)
    assert nothing.fits_host is True and nothing.host_peak_bytes == 0
    data = report.to_dict()
    assert data["fits_host"] is False and data["host_capacity_bytes"] == round(small.host_memory_bytes)
    assert data["stages"][0]["host_optimizer_bytes"] == round(need)


def test_the_search_rejects_what_overfills_the_host_as_the_single_strategy_api_does():
    """A node of 64 MiB of host memory (8 MiB a device) keeps the offload counts whose first
    layers fit; the ranking equals a loop over the space with ``estimate``'s fits_host."""
    from ndplan.search import run_search
    from search_brute import megatron_step_time, search_as_brute_force
    from test_layer_offload import SEARCH_MOE, offload_layer_space

    device = get_device("h100-sxm").model_copy(update={"node_host_memory_bytes": 64 * 2**20})
    space = offload_layer_space(device)
    limit = 2 * 2**30
    result = search_as_brute_force(SEARCH_MOE, device, space, limit, MEGATRON, block_size=97)
    assert result.rejected["over_host_memory"] > 0
    offloaded = {row["offload_layers"] for row in result.ranked}
    assert 0 in offloaded and 1 in offloaded and 6 not in offloaded
    # Without host memory stated nothing is checked, and the reason is not listed.
    unstated = device.model_copy(update={"node_host_memory_bytes": None})
    free = run_search(SEARCH_MOE, unstated, space, megatron_step_time, memory_limit_bytes=limit, options=MEGATRON,
                      top=10**9)
    assert "over_host_memory" not in free.rejected
    assert len(free.ranked) == len(result.ranked) + result.rejected["over_host_memory"]


def test_estimate_says_whether_the_host_memory_fits(capsys):
    args = ["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--dp", "8", "--zero", "1",
            "--optimizer-offload", "--seq", "4096", "--gbs", "8", "--runtime", "megatron"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps at the terminal's width)
    assert "host fits" in out and "14.96 GiB of pinned host memory per device (optimizer, stage 0)" in out
    assert main([*args, "--host-memory", "64GiB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "host memory does not fit" in out and "over its 8.00 GiB share of a node's 64.00 GiB over 8 devices" in out
    assert main([*args, "--host-memory", "64GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits_host"] is False and data["host_capacity_bytes"] == 8 * 2**30
    assert data["host_peak_bytes"] == round(LLAMA_PARAMS / 8 * 16)
    assert main([*args[:4], "ascend-910b", *args[5:]]) == 0
    assert "host memory not checked" in capsys.readouterr().out


def test_a_bad_host_memory_names_the_flag(capsys):
    assert main(["estimate", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--host-memory", "lots"]) == 2
    assert "--host-memory" in capsys.readouterr().err


def test_a_device_file_with_a_bad_host_memory_is_refused():
    with pytest.raises((NdplanError, ValueError), match="node_host_memory_bytes"):
        get_device("h100-sxm").model_validate(get_device("h100-sxm").model_dump() | {"node_host_memory_bytes": -1})


def test_the_html_report_shows_the_host_memory_and_whether_it_fits(tmp_path):
    page = tmp_path / "plan.html"
    args = ["report", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--dp", "8", "--zero", "1",
            "--optimizer-offload", "--seq", "4096", "--gbs", "8", "--runtime", "megatron", "-o", str(page)]
    assert main([*args, "--host-memory", "64GiB"]) == 0
    text = page.read_text()
    assert "pinned host memory (offload)</div><div class=\"v bad\">14.96 GiB" in text
    assert "of its 8.00 GiB share of the node&#x27;s" in text
    assert main([a for a in args if a != "--optimizer-offload"]) == 0  # no optimizer offload: nothing on the host, no such figure
    assert "pinned host memory (offload)" not in page.read_text()


def test_balance_says_whether_its_settings_overfill_the_host(capsys):
    args = ["balance", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "16", "--pp", "2", "--dp", "8",
            "--zero", "1", "--gbs", "64", "--optimizer-offload", "--runtime", "megatron", "--host-memory", "32GiB"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    # about half of 8.03e9 parameters a stage, over 8 ranks, at 16 B: ~7.9 GiB against 32 GiB / 8 devices
    assert "balanced settings' host memory does not fit" in out and "over its 4.00 GiB share" in out


def _fsdp(offload: bool, **fields) -> Strategy:
    return Strategy(**({"dp": 8, "zero": 3, "fsdp": True, "seq_length": 512, "precision": "fsdp-bf16",
                        "optimizer_offload": offload} | fields))


def test_fsdp2_cpu_offload_keeps_the_parameter_and_gradient_shards_on_the_host():
    """torchtitan's enable_cpu_offload is FSDP2's CPUOffloadPolicy: the fp32 parameter shards,
    their gradients and the Adam states live on the host (16 B an element of the shard), and
    the device holds what FSDP gathers. Megatron's CPU optimizer keeps its bf16 parameters and
    fp32 gradient buffer on the device."""
    pytorch = MemoryOptions()
    kept = estimate(LLAMA, _fsdp(False), "h100-sxm", pytorch).stages[0]
    moved = estimate(LLAMA, _fsdp(True), "h100-sxm", pytorch).stages[0]
    shard = LLAMA_PARAMS / 8
    assert kept.params_bytes == pytest.approx(shard * 4) and kept.grads_bytes == pytest.approx(shard * 4)
    assert moved.params_bytes == moved.grads_bytes == moved.optimizer_bytes == 0
    assert moved.host_optimizer_bytes == pytest.approx(shard * 16)
    # At least the parameters and states the peak held (4 + 8 B); the gradients, with one
    # micro-batch, are not all made at its moment.
    assert kept.peak_bytes - moved.peak_bytes > shard * 12
    megatron = estimate(LLAMA, Strategy(dp=8, zero=1, seq_length=512, optimizer_offload=True), "h100-sxm", MEGATRON)
    assert megatron.stages[0].params_bytes == pytest.approx(LLAMA_PARAMS * 2)
    assert megatron.stages[0].grads_bytes == pytest.approx(LLAMA_PARAMS * 4)


def test_fsdp2_cpu_offload_copies_the_shards_with_each_gather_and_reduce():
    """Each gather copies the unit's shard in, each reduce-scatter its gradient out, over the
    host link; the CPU's Adam then finds its operands there: the step's own copies, priced
    where the shards stay on the device, go (their seconds exactly)."""
    from ndplan.perf import default_efficiency, estimate_time

    device = get_device("h100-sxm")
    cluster = Cluster(device=device, num_devices=8)
    host_bw = device.host_link_bandwidth_bytes_per_s * default_efficiency(device).host_link_efficiency
    on = estimate_time(LLAMA, _fsdp(True), cluster, options=MemoryOptions())
    off = estimate_time(LLAMA, _fsdp(True), cluster, options=MemoryOptions(), software={"fsdp_cpu_offload": False})
    local = LLAMA_PARAMS / 8
    assert off.breakdown["optimizer"] - on.breakdown["optimizer"] == pytest.approx(local * (4 + 4) / host_bw)
    copies = local * (4 + 4 + 4) / host_bw  # a micro-batch: in for the forward and the backward's gather, out
    exposed = on.breakdown["comm_exposed"]["dp"] - off.breakdown["comm_exposed"]["dp"]
    assert 0 < exposed <= copies * (1 + 1e-9)


def test_torchtitan_cpu_offload_is_read_and_written_as_fsdp2s(tmp_path):
    from ndplan.io import emit, read_config

    source = (Path(__file__).parent / "fixtures" / "io" / "torchtitan_llama3_70b.toml").read_text()
    path = tmp_path / "job.toml"
    path.write_text(source.replace("[training]\n", "[training]\nenable_cpu_offload = true\n", 1))
    read = read_config(path, devices=256)
    assert read.strategy().optimizer_offload and read.strategy().zero == 3
    assert not any("enable_cpu_offload" in w for w in read.warnings)
    text = emit(get_preset("llama-3.1-70b"), read.strategy(), "torchtitan")
    assert "enable_cpu_offload = true" in text and "left out" not in text.split("enable_cpu_offload")[0][-200:]
    assert "optimizer offload without FSDP" in emit(LLAMA, Strategy(dp=8, zero=1, optimizer_offload=True), "torchtitan")


def test_the_search_weighs_an_optimizer_on_the_cpu_where_the_runtime_runs_one():
    """--dims ... optimizer_offload: FSDP2's CPU offload under the pytorch runtime (zero 3
    alone), Megatron-Core's CPU optimizer on its distributed optimizer (zero 1 alone); the
    others are not runnable there. On a node's 2 TiB, Llama-3.1-70B on 8 H100s fits only so:
    with the shards and states on the host, FSDP over 8 holds what it gathers."""
    from ndplan.search import default_space
    from ndplan.search.run import runtime_step_time
    from search_brute import search_as_brute_force

    tiny = get_preset("llama-3.1-8b").model_copy(update={"num_layers": 4, "layer_mlp_kinds": ("dense",) * 4})
    device = get_device("h100-sxm")
    for options, zero in ((MemoryOptions(), 3), (MEGATRON, 1)):
        space = default_space(tiny, device, 8, 16, 1024, get_precision("megatron-bf16"),
                              dims=("pp", "zero", "optimizer_offload"))
        result = search_as_brute_force(tiny, device, space, 30 * 2**30, options, step_time=runtime_step_time(options))
        assert result.rejected["not_runnable_in_runtime"] > 0
        assert {row["zero"] for row in result.ranked if row["optimizer_offload"]} == {zero}
    from ndplan.search import run_search

    big = get_preset("llama-3.1-70b")
    space = default_space(big, device, 8, 8, 4096, get_precision("fsdp-bf16"),
                          dims=("tp", "pp", "zero", "recompute", "optimizer_offload"))
    best = run_search(big, device, space, options=MemoryOptions()).best
    assert best is not None and best["optimizer_offload"] and best["zero"] == 3
