"""Alpha-beta time of one collective over a group of n devices.

A collective of an algorithm with k steps that moves V bytes through each device's link costs

    time = k · alpha + V / beta

alpha: seconds per step (latency), beta: the link's effective bandwidth in bytes/s (one
direction, after efficiency; see topology.py for which link a group uses). Per algorithm, with
S the size of the full (unsharded) buffer in bytes:

    all-reduce (ring):      k = 2(n-1),  V = 2(n-1)/n · S
    reduce-scatter (ring):  k = n-1,     V = (n-1)/n · S     (S: the full input)
    all-gather (ring):      k = n-1,     V = (n-1)/n · S     (S: the full output)
    all-to-all (pairwise):  k = n-1,     V = (n-1)/n · S     (S: one device's send buffer)
    point-to-point:         k = 1,       V = S

A group of one costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Array = np.ndarray


@dataclass(frozen=True)
class Link:
    """The link a group's collectives run over: effective bytes/s and seconds per step."""

    bandwidth: Array | float
    latency: Array | float


def _ring(steps: Array | float, volume: Array | float, n: Array | float, link: Link) -> Array | float:
    return np.where(np.asarray(n) > 1, steps * link.latency + volume / link.bandwidth, 0.0)


def all_reduce_s(nbytes: Array | float, n: Array | float, link: Link) -> Array | float:
    """Ring all-reduce of an S-byte buffer: 2(n-1)·alpha + 2(n-1)/n·S/beta."""
    return _ring(2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes, n, link)


def reduce_scatter_s(nbytes: Array | float, n: Array | float, link: Link) -> Array | float:
    """Ring reduce-scatter of an S-byte input: (n-1)·alpha + (n-1)/n·S/beta."""
    return _ring(n - 1.0, (n - 1.0) / n * nbytes, n, link)


def all_gather_s(nbytes: Array | float, n: Array | float, link: Link) -> Array | float:
    """Ring all-gather into an S-byte output: (n-1)·alpha + (n-1)/n·S/beta."""
    return _ring(n - 1.0, (n - 1.0) / n * nbytes, n, link)


def all_to_all_s(nbytes: Array | float, n: Array | float, link: Link) -> Array | float:
    """Pairwise all-to-all of an S-byte send buffer: (n-1)·alpha + (n-1)/n·S/beta."""
    return _ring(n - 1.0, (n - 1.0) / n * nbytes, n, link)


def p2p_s(nbytes: Array | float, link: Link) -> Array | float:
    """One send of S bytes: alpha + S/beta."""
    return link.latency + nbytes / link.bandwidth
