"""Hardware presets, user hardware files, and the Device/Cluster models."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from ndplan.errors import NdplanError
from ndplan.hardware import (
    DTYPES,
    Cluster,
    Device,
    get_device,
    list_devices,
    load_device_file,
    resolve_device,
)
from ndplan.perf.efficiency import default_efficiency

PRESET_NAMES = [
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h200",
    "b200",
    "gb200-nvl72",
    "gb300-nvl72",
    "mi300x",
    "mi325x",
    "mi355x",
    "ascend-910b",
    "ascend-910c",
]

GIB = 2**30


def _h100_like(**changes: Any) -> dict[str, Any]:
    """A valid user device as plain data, with some fields changed or removed (None)."""
    data: dict[str, Any] = {
        "name": "my-gpu",
        "runtime": "cuda",
        "memory_bytes": 85_000_000_000,
        "peak_flops": {"bf16": 989.4e12, "fp8": 1978.9e12},
        "hbm_bandwidth_bytes_per_s": 3.35e12,
        "scaleup_bandwidth_bytes_per_s": 450e9,
        "scaleup_domain_size": 8,
        "scaleout_bandwidth_bytes_per_s": 50e9,
        "devices_per_node": 8,
        "host_link_bandwidth_bytes_per_s": 64e9,
    }
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return data


def _write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _one_line_error(excinfo: pytest.ExceptionInfo[NdplanError]) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# --- presets ---------------------------------------------------------------


def test_every_preset_loads_in_file_order() -> None:
    assert [device.name for device in list_devices()] == PRESET_NAMES


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_is_sane(name: str) -> None:
    device = get_device(name)
    assert device.name == name
    assert "bf16" in device.dtypes
    assert set(device.dtypes) <= set(DTYPES)
    # Dense bf16 never beats fp8, and tensor-core bf16 beats plain fp32.
    if "fp8" in device.dtypes:
        assert device.peak_flops_for("fp8") == pytest.approx(2 * device.peak_flops_for("bf16"), rel=0.01)
    if "fp32" in device.dtypes:
        assert device.peak_flops_for("fp32") < device.peak_flops_for("bf16")
    # Memory bandwidth outruns the scale-up link, which outruns the NIC.
    assert device.hbm_bandwidth_bytes_per_s > device.scaleup_bandwidth_bytes_per_s
    assert device.scaleup_bandwidth_bytes_per_s > device.scaleout_bandwidth_bytes_per_s
    assert device.scaleup_domain_size >= device.devices_per_node


def test_preset_lookup_is_case_insensitive() -> None:
    assert get_device("  H100-SXM ") is get_device("h100-sxm")


def test_h100_figures() -> None:
    h100 = get_device("h100-sxm")
    assert h100.runtime == "cuda"
    assert h100.peak_flops_for("bf16") == pytest.approx(989.4e12, rel=0.005)
    assert h100.peak_flops_for("fp8") == pytest.approx(1978.9e12, rel=0.005)
    assert h100.peak_flops_for("tf32") == pytest.approx(494.7e12, rel=0.005)
    assert h100.hbm_bandwidth_bytes_per_s == pytest.approx(3.35e12)
    # NVLink4: 900 GB/s bidirectional is 450 GB/s each way.
    assert h100.scaleup_bandwidth_bytes_per_s == pytest.approx(450e9)
    assert h100.scaleout_bandwidth_bytes_per_s == pytest.approx(50e9)  # one 400 Gb/s NIC per GPU
    assert h100.host_link_bandwidth_bytes_per_s == pytest.approx(64e9)  # PCIe Gen5 x16
    # torch reports ~79.2 GiB, not the marketing 80 GB nor NVML's 81559 MiB.
    assert h100.memory_bytes == 81082 * 2**20
    assert 79.0 * GIB < h100.memory_bytes < 80 * GIB


def test_h200_is_an_h100_with_more_and_faster_memory() -> None:
    h100, h200 = get_device("h100-sxm"), get_device("h200")
    assert h200.peak_flops == h100.peak_flops
    # "141 GB" class: 143156 MiB = 139.8 GiB as torch sees it (NVIDIA's "GB" here is ~GiB)
    assert h200.memory_bytes == 143156 * 2**20
    assert 139 * GIB < h200.memory_bytes < 141 * GIB
    assert h200.hbm_bandwidth_bytes_per_s == pytest.approx(4.8e12)


def test_a100_figures() -> None:
    a40, a80 = get_device("a100-40gb"), get_device("a100-80gb")
    for a100 in (a40, a80):
        assert a100.peak_flops_for("bf16") == pytest.approx(312e12)
        assert a100.peak_flops_for("fp32") == pytest.approx(19.5e12)
        assert "fp8" not in a100.dtypes  # Ampere has no FP8
        assert a100.scaleup_bandwidth_bytes_per_s == pytest.approx(300e9)
        assert a100.host_link_bandwidth_bytes_per_s == pytest.approx(32e9)  # PCIe Gen4 x16
    assert a40.memory_bytes == 42_298_834_944
    assert a40.hbm_bandwidth_bytes_per_s == pytest.approx(1555e9)
    assert a80.hbm_bandwidth_bytes_per_s == pytest.approx(2039e9)
    assert 79 * GIB < a80.memory_bytes < 80 * GIB


def test_b200_mi300x_and_ascend_figures() -> None:
    b200 = get_device("b200")
    assert b200.peak_flops_for("bf16") == pytest.approx(2.25e15)
    assert b200.scaleup_bandwidth_bytes_per_s == pytest.approx(900e9)
    assert b200.scaleup_domain_size == 8  # HGX B200, not NVL72
    assert b200.memory_bytes == 182631 * 2**20  # "180 GB" HGX B200, 178.4 GiB in torch
    assert 178 * GIB < b200.memory_bytes < 180 * GIB

    mi300x = get_device("mi300x")
    assert mi300x.runtime == "rocm"
    assert mi300x.peak_flops_for("bf16") == pytest.approx(1307.4e12)
    assert mi300x.peak_flops_for("fp8") == pytest.approx(2614.9e12)
    assert mi300x.memory_bytes == 201_310_208 * 1024  # rocminfo pool, 191.98 GiB
    assert mi300x.scaleup_bandwidth_bytes_per_s == pytest.approx(7 * 64e9)
    mi325x, mi355x = get_device("mi325x"), get_device("mi355x")
    assert mi325x.memory_bytes == 268_419_072 * 1024  # rocminfo pool, 255.98 GiB
    assert mi355x.memory_bytes == 309_220_868_096  # rocm-smi VRAM total, 287.98 GiB
    assert mi355x.peak_flops_for("bf16") == pytest.approx(1024 * 2.4e9 * 1024, rel=1e-4)  # the blog's 2516.6 TF
    assert mi355x.peak_flops_for("fp8") == pytest.approx(2 * mi355x.peak_flops_for("bf16"), rel=1e-4)
    assert mi355x.scaleup_bandwidth_bytes_per_s == pytest.approx(7 * 76.8e9)
    from ndplan.perf.efficiency import device_family

    assert [device_family(d) for d in (mi300x, mi325x, mi355x)] == ["cdna3", "cdna3", "cdna4"]

    b, c = get_device("ascend-910b"), get_device("ascend-910c")
    assert b.runtime == c.runtime == "cann"
    assert "fp8" not in b.dtypes and "fp8" not in c.dtypes
    assert b.memory_bytes == 62432 * 2**20
    assert b.scaleup_domain_size == 8
    # One 910C device is one die (what CANN/torch_npu call a device): 16 per node,
    # 384 packages x 2 dies in a CloudMatrix384 supernode, half the package's 752 TFLOPS.
    assert c.devices_per_node == 16
    assert c.scaleup_domain_size == 768
    assert c.peak_flops_for("bf16") == pytest.approx(752e12 / 2)


def test_nvl72_rack_figures() -> None:
    """GB200/GB300 NVL72: one GPU a device, 4 a compute tray (node), 72 on one NVLink switch
    fabric across 18 trays. Every figure per GPU: the rack's 576 TB/s HBM and 130 TB/s NVLink
    over 72, the rack's sparse FP8 (720 PFLOPS) and BF16 (360) over 72 and halved."""
    gb200, gb300 = get_device("gb200-nvl72"), get_device("gb300-nvl72")
    for rack in (gb200, gb300):
        assert rack.runtime == "cuda"
        assert rack.scaleup_domain_size == 72
        assert rack.devices_per_node == 4
        assert rack.scaleup_bandwidth_bytes_per_s == pytest.approx(130e12 / 72 / 2, rel=0.02)  # 900 GB/s each way
        assert rack.hbm_bandwidth_bytes_per_s == pytest.approx(576e12 / 72)
        assert rack.peak_flops_for("fp8") == pytest.approx(720e15 / 72 / 2)
        assert rack.peak_flops_for("bf16") == pytest.approx(360e15 / 72 / 2)
        assert rack.host_link_bandwidth_bytes_per_s == pytest.approx(900e9 / 2 / 2)  # C2C: one Grace, two GPUs
    # CUDA's total on a GB200 (CUDA 13.0), 741 MiB under NVML's 189471 MiB
    assert gb200.memory_bytes == 197_897_748_480 == (189471 - 741) * 2**20
    assert gb300.memory_bytes == (284208 - 741) * 2**20  # NVML's GB300 total less the same reserve
    assert gb200.scaleout_bandwidth_bytes_per_s == pytest.approx(400e9 / 8)  # ConnectX-7, one per GPU
    assert gb300.scaleout_bandwidth_bytes_per_s == pytest.approx(800e9 / 8)  # ConnectX-8, one per GPU
    assert default_efficiency(gb200).family == default_efficiency(gb300).family == "blackwell"


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(NdplanError) as excinfo:
        get_device("tpu-v9")
    message = _one_line_error(excinfo)
    assert message.startswith("unknown hardware 'tpu-v9'; known: a100-40gb, a100-80gb, h100-sxm")
    assert all(name in message for name in PRESET_NAMES)


def test_presets_cannot_be_changed() -> None:
    h100 = get_device("h100-sxm")
    with pytest.raises(ValidationError):
        h100.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        h100.peak_flops["bf16"] = 1.0  # type: ignore[index]
    assert get_device("h100-sxm").peak_flops_for("bf16") == pytest.approx(989.4e12)


def test_devices_are_hashable_and_compare_by_value() -> None:
    h100 = get_device("h100-sxm")
    copy = Device.model_validate(h100.model_dump())
    assert copy == h100
    assert {h100: "x"}[copy] == "x"
    assert copy != get_device("h200")


# --- peak_flops_for ---------------------------------------------------------


def test_peak_flops_for_is_case_insensitive() -> None:
    assert get_device("h100-sxm").peak_flops_for("BF16") == pytest.approx(989.4e12)


def test_peak_flops_for_missing_dtype_names_dtype_and_what_exists() -> None:
    with pytest.raises(NdplanError) as excinfo:
        get_device("a100-80gb").peak_flops_for("fp8")
    message = _one_line_error(excinfo)
    assert "'fp8'" in message
    assert "a100-80gb" in message
    assert "fp32, tf32, bf16, fp16" in message


# --- user files ---------------------------------------------------------------


def test_user_yaml_round_trip(tmp_path: Path) -> None:
    original = get_device("mi300x")
    path = _write_yaml(tmp_path / "mine.yaml", original.model_dump())
    loaded = load_device_file(path)
    assert loaded == original
    assert resolve_device(str(path)) == original


def test_user_yaml_accepts_unsigned_exponents(tmp_path: Path) -> None:
    # PyYAML alone would read 989.4e12 as a string (YAML 1.1 wants 989.4e+12).
    lines = [f"{key}: {value}" for key, value in _h100_like().items() if key != "peak_flops"]
    text = "\n".join(lines) + "\npeak_flops:\n  bf16: 989.4e12\n  fp8: 1978.9e12\n"
    text = text.replace("memory_bytes: 85000000000", "memory_bytes: 85e9")
    path = tmp_path / "hand-written.yml"
    path.write_text(text, encoding="utf-8")
    device = load_device_file(path)
    assert isinstance(device, Device)
    assert device.memory_bytes == 85_000_000_000
    assert device.peak_flops_for("bf16") == pytest.approx(989.4e12)


def test_user_json_file(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(_h100_like(name="json-gpu")), encoding="utf-8")
    device = resolve_device(str(path))
    assert device.name == "json-gpu"
    assert device.scaleup_bandwidth_bytes_per_s == pytest.approx(450e9)


def test_user_file_with_device_list(tmp_path: Path) -> None:
    data = {"devices": [_h100_like(name="a"), _h100_like(name="b", devices_per_node=4)]}
    path = _write_yaml(tmp_path / "two.yaml", data)
    loaded = load_device_file(path)
    assert isinstance(loaded, list)
    assert [device.name for device in loaded] == ["a", "b"]
    assert loaded[1].devices_per_node == 4
    with pytest.raises(NdplanError, match=r"holds 2 devices \(a, b\); expected exactly one"):
        resolve_device(str(path))


def test_duplicate_names_in_a_list(tmp_path: Path) -> None:
    path = _write_yaml(tmp_path / "dup.yaml", [_h100_like(name="x"), _h100_like(name="X")])
    with pytest.raises(NdplanError, match="device name 'X' appears more than once"):
        load_device_file(path)


def test_malformed_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\npeak_flops: {bf16: 1e12\n", encoding="utf-8")
    with pytest.raises(NdplanError) as excinfo:
        load_device_file(path)
    message = _one_line_error(excinfo)
    assert message.startswith(f"{path}: malformed YAML at line ")


def test_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",', encoding="utf-8")
    with pytest.raises(NdplanError, match=r"broken\.json: malformed JSON at line 1"):
        load_device_file(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(NdplanError, match=r"absent\.yaml: cannot read hardware file"):
        resolve_device(str(path))


def test_file_that_is_not_a_device(tmp_path: Path) -> None:
    path = _write_yaml(tmp_path / "scalar.yaml", 42)
    with pytest.raises(NdplanError, match="expected a device"):
        load_device_file(path)
    path = _write_yaml(tmp_path / "list.yaml", [_h100_like(), "oops"])
    with pytest.raises(NdplanError, match=r"device #2: expected a mapping of field names to values, got str"):
        load_device_file(path)


def test_missing_field(tmp_path: Path) -> None:
    path = _write_yaml(tmp_path / "m.yaml", _h100_like(devices_per_node=None))
    with pytest.raises(NdplanError) as excinfo:
        load_device_file(path)
    message = _one_line_error(excinfo)
    assert message == f"{path}: device 'my-gpu': field 'devices_per_node': missing required field"


def test_unknown_field(tmp_path: Path) -> None:
    path = _write_yaml(tmp_path / "u.yaml", _h100_like(colour="green"))
    with pytest.raises(NdplanError) as excinfo:
        load_device_file(path)
    message = _one_line_error(excinfo)
    assert message.startswith(
        f"{path}: device 'my-gpu': field 'colour': unknown field (known: name, runtime,"
    )


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"hbm_bandwidth_bytes_per_s": -3.35e12}, "hbm_bandwidth_bytes_per_s", "greater than or equal to 1000000"),
        ({"scaleout_bandwidth_bytes_per_s": 0}, "scaleout_bandwidth_bytes_per_s", "greater than or equal to 1000000"),
        ({"memory_bytes": "lots"}, "memory_bytes", "cannot read 'lots' as a size"),
        ({"devices_per_node": True}, "devices_per_node", "expected a number, got True"),
        ({"runtime": "opencl"}, "runtime", "'cuda', 'rocm' or 'cann'"),
        ({"peak_flops": {"fp16": 1e12}}, "peak_flops", "'bf16' is required"),
        ({"peak_flops": {"bf16": 1e12, "fp4": 2e12}}, "peak_flops", "unknown dtype 'fp4'"),
        ({"peak_flops": {"bf16": -1e12}}, "peak_flops.bf16", "greater than or equal to 1000000000"),
    ],
)
def test_invalid_value_names_the_field(
    tmp_path: Path, changes: dict[str, Any], field: str, reason: str
) -> None:
    path = _write_yaml(tmp_path / "bad.yaml", _h100_like(**changes))
    with pytest.raises(NdplanError) as excinfo:
        load_device_file(path)
    message = _one_line_error(excinfo)
    assert message.startswith(f"{path}: device 'my-gpu': field '{field}': ")
    assert reason in message


@pytest.mark.parametrize(
    ("written", "expected"),
    [("80GB", 80_000_000_000), ("81082 MiB", 81082 * 2**20), ("79.18GiB", int(79.18 * GIB)), (85e9, 85_000_000_000)],
)
def test_memory_takes_a_size_with_its_unit(tmp_path: Path, written: Any, expected: int) -> None:
    # The same sizes --memory-limit reads: a device file's "80GB" was "not a valid integer".
    path = _write_yaml(tmp_path / "unit.yaml", _h100_like(memory_bytes=written))
    device = load_device_file(path)
    assert isinstance(device, Device) and device.memory_bytes == expected


@pytest.mark.parametrize("written", [80, 80.0, "80"])
def test_memory_without_a_unit_below_a_mebibyte_is_refused(tmp_path: Path, written: Any) -> None:
    # memory_bytes: 80 (meant as 80 GB) was read as 80 bytes: every plan "over 80 B by 36.96 GiB".
    path = _write_yaml(tmp_path / "bytes.yaml", _h100_like(memory_bytes=written))
    with pytest.raises(NdplanError) as excinfo:
        load_device_file(path)
    message = _one_line_error(excinfo)
    assert message.startswith(f"{path}: device 'my-gpu': field 'memory_bytes': ")
    assert "is 80 bytes; give a unit, e.g. 80GiB or 80GB" in message


def test_negative_bandwidth_reports_the_value(tmp_path: Path) -> None:
    path = _write_yaml(tmp_path / "neg.yaml", _h100_like(scaleup_bandwidth_bytes_per_s=-450e9))
    with pytest.raises(NdplanError, match=re.escape("(got -450000000000.0)")):
        load_device_file(path)


def test_every_problem_is_reported_on_one_line(tmp_path: Path) -> None:
    path = _write_yaml(
        tmp_path / "many.yaml",
        _h100_like(memory_bytes=-1, runtime="metal", host_link_bandwidth_bytes_per_s=None),
    )
    with pytest.raises(NdplanError) as excinfo:
        load_device_file(path)
    message = _one_line_error(excinfo)
    for field in ("memory_bytes", "runtime", "host_link_bandwidth_bytes_per_s"):
        assert f"field '{field}'" in message


def test_names_without_a_file_suffix_are_presets(tmp_path: Path) -> None:
    with pytest.raises(NdplanError, match="unknown hardware"):
        resolve_device(str(tmp_path / "mine.toml"))
    assert resolve_device("B200").name == "b200"


# --- Cluster -------------------------------------------------------------------


def test_cluster_uses_the_device_node_size() -> None:
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=1024)
    assert cluster.node_size == 8
    assert cluster.num_nodes == 128
    assert cluster.scaleup_domain_size == 8


def test_cluster_node_size_override_and_partial_nodes() -> None:
    cluster = Cluster(device=get_device("h100-sxm"), num_devices=10, devices_per_node=4)
    assert cluster.node_size == 4
    assert cluster.num_nodes == 3
    small = Cluster(device=get_device("ascend-910c"), num_devices=64)
    assert small.num_nodes == 4
    assert small.scaleup_domain_size == 64  # the whole job sits inside the supernode


def test_a_smaller_node_holds_a_smaller_scaleup_domain() -> None:
    """An H100's NVLink domain is its 8-GPU node: a 4-GPU instance of it has a domain of 4 (it
    stayed 8, so TP 8 over two such nodes was priced on NVLink). A domain that spans nodes
    (CloudMatrix384's 768 dies over nodes of 16) is not bounded by the node size."""
    h100 = get_device("h100-sxm")
    assert Cluster(device=h100, num_devices=8, devices_per_node=4).scaleup_domain_size == 4
    assert Cluster(device=h100, num_devices=8, devices_per_node=1).scaleup_domain_size == 1
    assert Cluster(device=h100, num_devices=16, devices_per_node=16).scaleup_domain_size == 8
    assert Cluster(device=h100, num_devices=2, devices_per_node=4).scaleup_domain_size == 2
    assert Cluster(device=get_device("ascend-910c"), num_devices=64, devices_per_node=8).scaleup_domain_size == 64


@pytest.mark.parametrize(
    ("name", "num_devices", "domain"),
    [
        ("gb200-nvl72", 64, 64), ("gb200-nvl72", 72, 72), ("gb200-nvl72", 144, 72),
        ("gb200-nvl72", 256, 64), ("gb200-nvl72", 8192, 64), ("gb200-nvl72", 5120, 64),
        ("gb200-nvl72", 96, 48), ("gb300-nvl72", 128, 64),
        ("gb200-nvl72", 76, 72),  # 19 trays: no even share of half a rack or more; fill in order
        ("ascend-910c", 1024, 512), ("ascend-910c", 1536, 768), ("ascend-910c", 800, 400),
    ],
)
def test_a_job_over_rack_scale_domains_takes_an_even_share_of_each(name: str, num_devices: int, domain: int) -> None:
    """The rank layout is aligned on the devices the job takes from each domain: 256 GPUs on
    NVL72 racks run as 4 x 64 (16 trays a rack), so EP 64 and TP 16 groups each sit in one
    rack; aligned on 72 (the old domain) the fifth 16-group and the second 64-group straddled
    two racks, and every 16- or 64-group was priced over the NIC's latency."""
    assert Cluster(device=get_device(name), num_devices=num_devices).scaleup_domain_size == domain


@pytest.mark.parametrize("changes", [{"num_devices": 0}, {"devices_per_node": -8}, {"racks": 2}])
def test_cluster_rejects_bad_input(changes: dict[str, Any]) -> None:
    arguments: dict[str, Any] = {"device": get_device("h100-sxm"), "num_devices": 8, **changes}
    with pytest.raises(ValidationError):
        Cluster(**arguments)


@pytest.mark.parametrize(("typed", "suggested"), [("h100", "h100-sxm"), ("H200x", "h200"), ("a100-80", "a100-80gb")])
def test_unknown_preset_suggests_the_closest_name(typed: str, suggested: str) -> None:
    with pytest.raises(NdplanError, match=rf"unknown hardware '{typed}' \(did you mean '{suggested}'\?\); known: "):
        get_device(typed)
