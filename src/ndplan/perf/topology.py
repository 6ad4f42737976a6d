"""Rank layout and which network level a parallel group's collectives use.

Layout (documented order, innermost first): global rank
    r = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank))
so a TP group is tp consecutive ranks (stride 1), a CP group has stride tp, the data-parallel
replicas of a parameter (dp·cp ranks, which reduce gradients together) stride tp, and a PP group
stride tp·cp·dp. Experts are folded over the dp·cp·tp ranks of one stage with etp innermost: an
expert-tensor group is etp consecutive ranks, an expert-parallel group ep ranks at stride etp,
and the expert-data-parallel group (replicas of one expert shard) stride ep·etp.

Network levels: devices within one scale-up domain (NVLink/xGMI/HCCS/UB island of
``Cluster.scaleup_domain_size`` devices, aligned in rank order; for a domain of several nodes,
as an NVL72 rack, the even share of it a larger job takes) talk over scale-up links, others
over each device's own scale-out NIC. For a group of n ranks at stride st (span n·st):

* fits: the span divides the domain size -> every group lies inside one domain: scale-up.
  Switched fabrics give each device its full scale-up bandwidth; a full mesh (MI300X, Ascend
  910B) gives a group of n only its n-1 direct links: (n-1)/(D-1) of it, D the device's own
  ``scaleup_domain_size`` (its D-1 links are what the per-device figure sums), not the
  cluster's domain, which a small job or a smaller node caps.
* spans domains with g = members per domain: ring collectives (all-reduce, reduce-scatter,
  all-gather) cross domains once per ring, and NCCL-style multi-channel rings spread those
  crossings over the g members' NICs: bandwidth min(scale-up, g·scale-out). All-to-all sends
  (g-1)/n of its data inside the domain and (n-g)/n over the device's own NIC:
  time = max(inside/scale-up, outside/scale-out). Point-to-point: one NIC.
* latency: scale-up latency inside a domain, scale-out latency otherwise.

Pipeline hops (``pipeline_crossing_share``): a pipeline's stages at stride st = tp·cp·dp put
q = domain/st consecutive stages in one domain where st divides the domain, so only some hops
cross it; a transfer on the critical path costs the mean over the hops the chain of virtual
stages takes (each hop alike in the fill, the drain and every steady-state round trip).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

import numpy as np

from ndplan.hardware.device import Cluster
from ndplan.perf.collectives import Link
from ndplan.perf.efficiency import EfficiencyProfile
from ndplan.schedule.ops import model_chunk_table

Array = np.ndarray
Pattern = Literal["ring", "all_to_all", "p2p"]


@dataclass(frozen=True)
class Fabric:
    """Effective per-device rates of a cluster for one efficiency profile."""

    domain: int
    scaleup_bw: float
    scaleout_bw: float
    scaleup_latency: float
    scaleout_latency: float
    mesh: bool
    #: device-to-host link, bytes/s per direction (activation and optimizer offload)
    host_bw: float = 0.0
    #: direct links per device in a full mesh (the device's own domain less one), over which
    #: ``scaleup_bw`` is summed; 0: ``domain - 1``
    mesh_links: int = 0

    @classmethod
    def of(cls, cluster: Cluster, eff: EfficiencyProfile) -> Fabric:
        device = cluster.device
        return cls(
            domain=cluster.scaleup_domain_size,
            scaleup_bw=device.scaleup_bandwidth_bytes_per_s * eff.scaleup_efficiency,
            scaleout_bw=device.scaleout_bandwidth_bytes_per_s * eff.scaleout_efficiency,
            scaleup_latency=eff.scaleup_latency_s,
            scaleout_latency=eff.scaleout_latency_s,
            mesh=eff.scaleup_topology == "mesh",
            host_bw=device.host_link_bandwidth_bytes_per_s * eff.host_link_efficiency,
            mesh_links=max(device.scaleup_domain_size - 1, 1),
        )

    def at_scaleup_rate(self) -> Fabric:
        """This fabric with every link at the scale-up rate and no latency (a switched domain):
        what its collectives' bytes take at that rate (``collective_sm_share``)."""
        return replace(self, scaleout_bw=self.scaleup_bw, scaleup_latency=0.0, scaleout_latency=0.0, mesh=False)


@lru_cache(maxsize=64)
def _divides_domain(domain: int) -> Array:
    """Lookup table: entry v is True when v <= domain and v divides domain (entries 0 and
    domain + 1, where larger spans are clipped to, False)."""
    table = np.zeros(domain + 2, dtype=bool)
    for v in range(1, domain + 1):
        table[v] = domain % v == 0
    table.flags.writeable = False
    return table


def fits_in_domain(size: Array | float, stride: Array | float, domain: int) -> Array:
    """True where every group of ``size`` ranks at ``stride`` lies inside one aligned domain."""
    span = np.asarray(size * stride, dtype=np.float64)
    if domain <= (1 << 16):
        index = np.minimum(span, domain + 1.0).astype(np.int64)
        exact = span == np.floor(span)
        return np.asarray(_divides_domain(domain)[index] & exact)
    return np.asarray((span <= domain) & (np.mod(domain, np.maximum(span, 1.0)) == 0))


def members_per_domain(size: Array | float, stride: Array | float, domain: int) -> Array:
    """g: how many ranks of a group share one domain (1 when the stride jumps domains)."""
    stride = np.asarray(stride, dtype=np.float64)
    per = np.floor(domain / np.maximum(stride, 1.0))
    return np.asarray(np.maximum(np.minimum(per, size), 1.0))  # np.clip's overhead is ~5x a maximum


def _inside_bw(fabric: Fabric, members: Array | float) -> Array | float:
    """Scale-up bandwidth a group of ``members`` devices in one domain reaches (one number
    for every group on a switched domain, which the callers broadcast)."""
    if not fabric.mesh or fabric.domain <= 1:
        return fabric.scaleup_bw
    links = np.maximum(np.asarray(members, dtype=np.float64) - 1.0, 1.0)
    # per link: the device's figure over ITS links; a 2-device job's pair still has one of 7
    return fabric.scaleup_bw * links / (fabric.mesh_links or fabric.domain - 1)


def inside_bandwidth(fabric: Fabric, members: Array | float) -> Array | float:
    """Scale-up bandwidth of ``members`` devices of one domain talking among themselves."""
    return _inside_bw(fabric, members)


def group_link(size: Array | float, stride: Array | float, fabric: Fabric, pattern: Pattern = "ring") -> Link:
    """The effective link of a group of ``size`` ranks at ``stride`` for a collective pattern."""
    size = np.asarray(size, dtype=np.float64)
    fits = fits_in_domain(size, stride, fabric.domain)
    g = members_per_domain(size, stride, fabric.domain)
    if pattern == "p2p":
        inside = _inside_bw(fabric, 2.0)
        outside: Array | float = fabric.scaleout_bw
    elif pattern == "ring":
        inside = _inside_bw(fabric, size)
        outside = np.where(g > 1, np.minimum(_inside_bw(fabric, g), g * fabric.scaleout_bw), fabric.scaleout_bw)
    else:
        inside = _inside_bw(fabric, size)
        n = np.maximum(size, 2.0)
        # seconds per byte of the send buffer, scaled so that (n-1)/n·S/bw is the time
        per_byte = np.maximum((g - 1.0) / n / _inside_bw(fabric, g), (n - g) / n / fabric.scaleout_bw)
        outside = (n - 1.0) / n / per_byte
    bandwidth = np.where(fits, inside, outside)
    latency = np.where(fits, fabric.scaleup_latency, fabric.scaleout_latency)
    return Link(bandwidth=bandwidth, latency=latency)


@lru_cache(maxsize=1024)
def pipeline_crossing_share(schedule: str, pp: int, vpp: int, stride: int, domain: int) -> float:
    """Share of the pipeline's hops that leave a scale-up domain, over the chain of its pp·vpp
    virtual stages in forward order (``schedule.model_chunk_table``): consecutive virtual stages
    on different stages are one hop each (an interleaved chunk's last stage back to stage 0
    included; a V's turn on its last stage is no hop). Stage j of a pipeline of ranks
    r0 + j·stride (r0 < stride) lies in domain j // (domain/stride) where the stride divides the
    domain; a stride the domain does not hold a multiple of crosses at every hop, and one that
    fits the whole pipeline at none (``fits_in_domain``, as ``group_link`` decides)."""
    if pp <= 1:
        return 0.0
    if (pp * stride <= domain and domain % (pp * stride) == 0) or stride <= 0:
        return 0.0
    if stride >= domain or domain % stride:
        return 1.0
    per_domain = domain // stride
    stage_of = [0] * (pp * vpp)
    for stage, chunks in enumerate(model_chunk_table(schedule, pp, vpp)):
        for virtual in chunks:
            stage_of[virtual] = stage
    hops = crossing = 0
    for a, b in zip(stage_of[:-1], stage_of[1:], strict=True):
        if a != b:
            hops += 1
            crossing += a // per_domain != b // per_domain
    return crossing / hops if hops else 0.0


def scaleup_link(fabric: Fabric) -> Link:
    """Every byte at the device's scale-up rate, without latency: ``collective_sm_share``'s yardstick."""
    return Link(bandwidth=fabric.scaleup_bw, latency=0.0)


def collective_sm_share(eff: EfficiencyProfile, full_rate_s: Array | float, seconds: Array | float) -> Array | float:
    """Share of the SMs a data-parallel collective's kernels hold while it runs, which the
    compute it hides under loses. NCCL runs one block per channel, each on an SM of its own, and
    opens the fewest channels that reach the link's rate (NVIDIA/nccl#689: 2 SMs for one NIC,
    16 for a DGX's eight), so the SMs held go with the bandwidth driven:
    ``eff.dp_comm_compute_share`` at the full scale-up rate, times the rate reached,
    ``full_rate_s / seconds`` (the same bytes at that rate over the collective's time; at most 1)."""
    share = eff.dp_comm_compute_share
    if not share:
        return 0.0
    seconds = np.asarray(seconds, dtype=np.float64)
    ratio = np.divide(full_rate_s, seconds, out=np.zeros_like(seconds), where=seconds > 0)
    return share * np.minimum(ratio, 1.0)
