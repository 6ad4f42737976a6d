"""Pinned host memory (``memory.host``): what optimizer and activation offload fill on the host,
each device's share of its node's host memory (``Device.host_memory_bytes``), and the checks
``estimate`` and ``search`` make against it."""

from __future__ import annotations

import json

import pytest

from ndplan.cli import main
from ndplan.errors import NdplanError
from ndplan.hardware import get_device
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
    from ndplan.perf import step_time_batch
    from ndplan.search import default_space, run_search
    from search_brute import brute_force_ranking
    from test_layer_offload import SEARCH_MOE

    device = get_device("h100-sxm").model_copy(update={"node_host_memory_bytes": 64 * 2**20})
    space = default_space(SEARCH_MOE, device, 8, 16, 1024, get_precision("megatron-bf16"),
                          dims=("ep", "pp", "recompute", "offload_layers"))
    step_time = lambda m, b, c: step_time_batch(m, b, c, weight_grad_rebuilds=False)  # noqa: E731 (megatron runtime)
    limit = 2 * 2**30
    result = run_search(SEARCH_MOE, device, space, step_time, memory_limit_bytes=limit, options=MEGATRON,
                        top=10**9, block_size=97)
    assert result.rejected["over_host_memory"] > 0
    offloaded = {row["offload_layers"] for row in result.ranked}
    assert 0 in offloaded and 1 in offloaded and 6 not in offloaded
    assert [row["candidate"] for row in result.ranked] == brute_force_ranking(
        SEARCH_MOE, device, space, step_time, limit, MEGATRON)
    # Without host memory stated nothing is checked, and the reason is not listed.
    unstated = device.model_copy(update={"node_host_memory_bytes": None})
    free = run_search(SEARCH_MOE, unstated, space, step_time, memory_limit_bytes=limit, options=MEGATRON, top=10**9)
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
