"""Collectives against hand-computed alpha-beta times, and which network level a group uses."""

from __future__ import annotations

import numpy as np
import pytest

from ndplan.hardware import get_device
from ndplan.hardware.device import Cluster
from ndplan.perf import collectives as coll
from ndplan.perf.efficiency import default_efficiency
from ndplan.perf.topology import (
    Fabric,
    fits_in_domain,
    group_link,
    members_per_domain,
    pipeline_crossing_share,
)

LINK = coll.Link(bandwidth=100e9, latency=5e-6)
GB = 1e9


def test_ring_all_reduce_moves_2_n_minus_1_over_n():
    # 4 ranks, 1 GB: 2·3 steps of 5 µs + 2·(3/4)·1 GB / 100 GB/s
    assert coll.all_reduce_s(GB, 4, LINK) == pytest.approx(6 * 5e-6 + 1.5 * GB / 100e9)


def test_reduce_scatter_and_all_gather_move_n_minus_1_over_n():
    expected = 3 * 5e-6 + 0.75 * GB / 100e9
    assert coll.reduce_scatter_s(GB, 4, LINK) == pytest.approx(expected)
    assert coll.all_gather_s(GB, 4, LINK) == pytest.approx(expected)


def test_all_to_all_and_p2p():
    assert coll.all_to_all_s(GB, 8, LINK) == pytest.approx(7 * 5e-6 + (7 / 8) * GB / 100e9)
    assert coll.p2p_s(GB, LINK) == pytest.approx(5e-6 + GB / 100e9)


def test_a_group_of_one_costs_nothing():
    for f in (coll.all_reduce_s, coll.reduce_scatter_s, coll.all_gather_s, coll.all_to_all_s):
        assert f(GB, 1, LINK) == 0.0
    sizes = np.array([1.0, 2.0])
    assert coll.all_reduce_s(GB, sizes, LINK).tolist() == [0.0, pytest.approx(2 * 5e-6 + GB / 100e9)]


H100 = Fabric.of(Cluster(device=get_device("h100-sxm"), num_devices=64), default_efficiency(get_device("h100-sxm")))


def test_a_group_inside_one_node_uses_the_scaleup_link():
    up = 450e9 * 0.8
    link = group_link(8, 1, H100)  # TP over 8 consecutive ranks: one NVLink island
    assert float(link.bandwidth) == pytest.approx(up)
    assert float(link.latency) == H100.scaleup_latency
    link = group_link(2, 4, H100)  # 2 ranks 4 apart: span 8, still one node
    assert float(link.bandwidth) == pytest.approx(up)


def test_a_group_across_nodes_uses_the_scaleout_link():
    out = 50e9 * 0.85
    link = group_link(8, 8, H100)  # DP across 8 nodes with tp=8: one member per node
    assert float(link.bandwidth) == pytest.approx(out)
    assert float(link.latency) == H100.scaleout_latency
    assert float(group_link(2, 8, H100, "p2p").bandwidth) == pytest.approx(out)  # PP neighbours on two nodes


def test_a_ring_spanning_nodes_uses_every_members_nic():
    # 16 consecutive ranks = 2 nodes × 8: NCCL rings cross nodes over all 8 NICs per node
    link = group_link(16, 1, H100)
    assert float(link.bandwidth) == pytest.approx(min(450e9 * 0.8, 8 * 50e9 * 0.85))
    # an all-to-all of 16 sends 7/16 inside the node and 8/16 over the device's own NIC
    a2a = group_link(16, 1, H100, "all_to_all")
    per_byte = max((7 / 16) / (450e9 * 0.8), (8 / 16) / (50e9 * 0.85))
    assert coll.all_to_all_s(GB, 16, a2a) == pytest.approx(15 * a2a.latency + GB * per_byte)


def test_tensor_parallelism_over_smaller_nodes_crosses_them():
    """On H100 instances of 4 GPUs (devices_per_node=4) TP 8 spans two nodes: a ring over 4
    members' NICs, min(450e9·0.8, 4·50e9·0.85) = 170 GB/s at the 10 µs scale-out latency, not
    the NVLink rate of an 8-GPU node."""
    device = get_device("h100-sxm")
    fabric = Fabric.of(Cluster(device=device, num_devices=8, devices_per_node=4), default_efficiency(device))
    assert fabric.domain == 4
    link = group_link(8, 1, fabric)
    assert float(link.bandwidth) == pytest.approx(4 * 50e9 * 0.85, rel=1e-12)
    assert float(link.latency) == 10e-6


def test_misaligned_groups_do_not_fit():
    assert fits_in_domain(np.array([8.0, 3.0, 4.0, 16.0]), np.array([1.0, 1.0, 2.0, 1.0]), 8).tolist() == [
        True, False, True, False,
    ]
    assert members_per_domain(np.array([16.0, 4.0]), np.array([2.0, 16.0]), 8).tolist() == [4.0, 1.0]


def test_full_mesh_gives_a_small_group_only_its_direct_links():
    mi300 = get_device("mi300x")
    fabric = Fabric.of(Cluster(device=mi300, num_devices=8), default_efficiency(mi300))
    full = float(group_link(8, 1, fabric).bandwidth)
    pair = float(group_link(2, 1, fabric).bandwidth)
    assert pair == pytest.approx(full / 7)


@pytest.mark.parametrize(("name", "link_one_way"), [("mi300x", 64e9), ("ascend-910b", 28e9)])
@pytest.mark.parametrize(("num_devices", "node"), [(2, None), (4, None), (16, None), (8, 4)])
def test_a_mesh_pair_gets_one_link_however_few_devices_the_job_has(
    name: str, link_one_way: float, num_devices: int, node: int | None
) -> None:
    """A full mesh's per-device figure sums its D-1 direct links (MI300X: 7 xGMI links of 64 GB/s
    each way, Ascend 910B: 7 HCCS links of 28 GB/s). A pair of devices talks over one of them
    whether the job holds 2, 4 or 16 devices: the share was (n-1)/(domain-1) of the cluster's
    capped domain, so a 2-device MI300X job priced its pair at all 7 links (448 GB/s, 7x)."""
    device = get_device(name)
    eff = default_efficiency(device)
    fabric = Fabric.of(Cluster(device=device, num_devices=num_devices, devices_per_node=node), eff)
    assert device.scaleup_bandwidth_bytes_per_s == pytest.approx(7 * link_one_way)
    one = link_one_way * eff.scaleup_efficiency
    assert float(group_link(2, 1, fabric).bandwidth) == pytest.approx(one)
    assert float(group_link(2, 1, fabric, "p2p").bandwidth) == pytest.approx(one)
    if fabric.domain >= 4:
        assert float(group_link(4, 1, fabric).bandwidth) == pytest.approx(3 * one)


GB200 = get_device("gb200-nvl72")
# 256 GPUs on GB200 NVL72 racks: a job takes the same number of GPUs from each rack, the most
# (a multiple of the 4-GPU tray) that splits it evenly: 4 racks of 64 (16 trays), as NVIDIA's
# MLPerf Training GB200 runs (8,192 and 5,120 GPUs) do. NVLink 900e9·0.78 = 702 GB/s, 3 µs a
# step; ConnectX-7 50e9·0.85 = 42.5 GB/s, 10 µs a step (Blackwell profile).
NVL72 = Fabric.of(Cluster(device=GB200, num_devices=256), default_efficiency(GB200))


def test_an_nvl72_group_of_64_or_16_stays_on_nvlink():
    """EP 64 and TP 16 inside one NVL72 rack: NVLink bandwidth and latency. With the rank layout
    aligned on 72-GPU racks, 72 % 64 and 72 % 16 left both groups 'not fitting': every step paid
    the NIC's 10 µs (EP 64: 2.032 ms for 1 GB instead of 1.591 ms) and TP 16's ring was capped
    at 16 NICs (680 GB/s)."""
    assert NVL72.domain == 64, "a rack holds 64 of the job's ranks"
    ep = group_link(64, 1, NVL72, "all_to_all")
    # 63 steps x 3 µs + 63/64 of 1 GB at 702 GB/s
    assert coll.all_to_all_s(1e9, 64, ep) == pytest.approx(1.591244e-3, rel=1e-6)
    tp = group_link(16, 1, NVL72)
    # 2·15 steps x 3 µs + 2·15/16 of 1 GB at 702 GB/s
    assert coll.all_reduce_s(1e9, 16, tp) == pytest.approx(2.760940e-3, rel=1e-6)
    ep16 = group_link(16, 4, NVL72, "all_to_all")  # EP 16 at stride etp 4: span 64, one rack
    assert float(ep16.bandwidth) == pytest.approx(702e9) and float(ep16.latency) == 3e-6


def test_an_nvl72_group_across_racks_takes_the_nic():
    # DP over the 4 racks (stride 64): one member a rack, each ring step on its own NIC
    dp = group_link(4, 64, NVL72)
    assert coll.all_reduce_s(1e9, 4, dp) == pytest.approx(35.35412e-3, rel=1e-6)  # 6 x 10 µs + 1.5 GB / 42.5 GB/s
    # EP 128 over two racks: 63/128 of the buffer on NVLink, 64/128 over the NIC, which sets the time
    ep = group_link(128, 1, NVL72, "all_to_all")
    assert coll.all_to_all_s(1e9, 128, ep) == pytest.approx(13.03471e-3, rel=1e-6)  # 127 x 10 µs + 0.5 GB / 42.5 GB/s


def test_pipeline_hops_on_nvl72_cross_only_between_racks():
    """pp 16 at stride 16 (tp 2 · dp 8) over 256 GPUs: 4 stages a 64-GPU rack share, so 3 of
    the 15 hops of a 1F1B chain cross racks. Aligned on 72 (no multiple of 16) every hop was
    priced over the NIC (share 1.0). A stride of 128 puts every stage in its own rack."""
    assert pipeline_crossing_share("1f1b", 16, 1, 16, NVL72.domain) == pytest.approx(3 / 15)
    assert pipeline_crossing_share("1f1b", 2, 1, 128, NVL72.domain) == 1.0
