"""What one accelerator can do, and how many of them a job runs on.

Every quantity carries its unit in its name: ``*_bytes`` are bytes,
``*_bytes_per_s`` are bytes per second in ONE direction, and ``peak_flops``
holds dense (no sparsity) FLOP per second for each dtype the device supports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from ndplan.errors import NdplanError

#: The dtypes ndplan knows peak rates for, in the order they are listed to users.
DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")

#: Every device must have this one: mixed-precision training defaults to it.
REQUIRED_DTYPE = "bf16"

Runtime = Literal["cuda", "rocm", "cann"]

PositiveInt = Annotated[int, Field(gt=0)]
# Rates are divided by: a tiny positive one (1e-300) made every time inf and the step's sums
# NaN. The floors are far below any accelerator (a GFLOP/s, a MB/s) and keep times finite.
#: Least peak rate, FLOP/s.
MIN_FLOPS = 1e9
#: Least bandwidth, bytes/s.
MIN_BYTES_PER_S = 1e6
FlopRate = Annotated[float, Field(ge=MIN_FLOPS, allow_inf_nan=False)]
ByteRate = Annotated[float, Field(ge=MIN_BYTES_PER_S, allow_inf_nan=False)]

_NUMERIC_FIELDS = (
    "memory_bytes",
    "hbm_bandwidth_bytes_per_s",
    "scaleup_bandwidth_bytes_per_s",
    "scaleup_domain_size",
    "scaleout_bandwidth_bytes_per_s",
    "devices_per_node",
    "host_link_bandwidth_bytes_per_s",
    "node_host_memory_bytes",
)


def _reject_bool(value: Any) -> Any:
    # Pydantic's lax mode reads True as 1; in a hardware file that is always a typo.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return value


class Device(BaseModel):
    """One accelerator as a training framework sees it.

    Attributes:
        name: preset or user-chosen name, e.g. ``"h100-sxm"``.
        runtime: software stack, ``"cuda"``, ``"rocm"`` or ``"cann"``.
        memory_bytes: device memory the framework reports as its total, in bytes; a file may
            write it as a size with its unit, as ``--memory-limit`` takes it ("80GB", "81082MiB").
        peak_flops: dense peak FLOP/s per dtype (keys from ``DTYPES``; ``bf16`` required).
        hbm_bandwidth_bytes_per_s: peak device-memory bandwidth, bytes/s.
        scaleup_bandwidth_bytes_per_s: this device's NVLink/xGMI/HCCS/UB bandwidth,
            bytes/s, one direction, summed over its links.
        scaleup_domain_size: devices reachable over the scale-up fabric.
        scaleout_bandwidth_bytes_per_s: this device's share of the inter-node
            network, bytes/s, one direction.
        devices_per_node: devices in one server.
        host_link_bandwidth_bytes_per_s: device-to-host link (PCIe or equivalent),
            bytes/s, one direction; bounds CPU offload.
        node_host_memory_bytes: the host (CPU) memory of one node, shared by its
            ``devices_per_node`` devices, in bytes (a size with its unit, as ``memory_bytes``);
            what activation and optimizer offload fill is checked against each device's share
            (``host_memory_bytes``). None where unknown: then nothing is checked.
        efficiency: figures of the step-time model's efficiency profile that replace the device
            family's (``ndplan.perf.efficiency``; e.g. what ``ndplan calibrate`` fitted), or None.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    runtime: Runtime
    memory_bytes: PositiveInt
    peak_flops: Mapping[str, FlopRate]
    hbm_bandwidth_bytes_per_s: ByteRate
    scaleup_bandwidth_bytes_per_s: ByteRate
    scaleup_domain_size: PositiveInt
    scaleout_bandwidth_bytes_per_s: ByteRate
    devices_per_node: PositiveInt
    host_link_bandwidth_bytes_per_s: ByteRate
    node_host_memory_bytes: PositiveInt | None = None
    efficiency: Mapping[str, Any] | None = None

    @field_validator(*_NUMERIC_FIELDS, mode="before")
    @classmethod
    def _no_bools(cls, value: Any) -> Any:
        return _reject_bool(value)

    @field_validator("memory_bytes", "node_host_memory_bytes", mode="before")
    @classmethod
    def _memory_size(cls, value: Any) -> Any:
        # A size with its unit ("80GB", "79.18GiB") as --memory-limit reads it; a bare number is
        # bytes, and one below a MiB is a size whose unit was left out (80 meant as 80 GB), not
        # a device: refused as parse_bytes refuses it, not priced as "over 80 B".
        from ndplan.units import MIB, parse_bytes

        if isinstance(value, str):
            try:
                return parse_bytes(value)
            except NdplanError as error:
                raise ValueError(str(error)) from None
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < MIB:
            raise ValueError(f"{value!r} is {value:g} bytes; give a unit, e.g. {value:g}GiB or {value:g}GB")
        return value

    @field_validator("peak_flops", mode="before")
    @classmethod
    def _no_bool_rates(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            for rate in value.values():
                _reject_bool(rate)
        return value

    @field_validator("peak_flops")
    @classmethod
    def _known_dtypes(cls, value: Mapping[str, float]) -> Mapping[str, float]:
        unknown = [dtype for dtype in value if dtype not in DTYPES]
        if unknown:
            raise ValueError(f"unknown dtype {unknown[0]!r} (known: {', '.join(DTYPES)})")
        if REQUIRED_DTYPE not in value:
            raise ValueError(f"'{REQUIRED_DTYPE}' is required (have: {', '.join(value) or 'none'})")
        # Read-only and in canonical order, so a frozen Device really cannot change.
        return MappingProxyType({dtype: value[dtype] for dtype in DTYPES if dtype in value})

    @field_serializer("peak_flops")
    def _plain_dict(self, value: Mapping[str, float]) -> dict[str, float]:
        # model_dump() must give plain data that yaml/json can write back out.
        return dict(value)

    def __hash__(self) -> int:
        # Pydantic's frozen hash would hash the peak_flops mapping, which is unhashable.
        fields = tuple(
            tuple(value.items()) if isinstance(value, Mapping) else value for value in self.__dict__.values()
        )
        return hash(fields)

    @property
    def host_memory_bytes(self) -> float | None:
        """One device's share of its node's host memory, node_host_memory_bytes / devices_per_node
        (bytes; None where the node's is unknown)."""
        if self.node_host_memory_bytes is None:
            return None
        return self.node_host_memory_bytes / self.devices_per_node

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes this device has a peak rate for, in ``DTYPES`` order."""
        return tuple(self.peak_flops)

    def peak_flops_for(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (case-insensitive).

        Raises:
            NdplanError: the device has no published rate for ``dtype``.
        """
        key = dtype.strip().lower()
        if key not in self.peak_flops:
            raise NdplanError(
                f"hardware '{self.name}' has no peak rate for dtype '{dtype}'; "
                f"it has: {', '.join(self.dtypes)}"
            )
        return self.peak_flops[key]


class Cluster(BaseModel):
    """``num_devices`` identical devices, grouped into nodes.

    ``devices_per_node`` overrides the device's own figure (e.g. a 4-GPU cloud
    instance of an 8-GPU part); read the effective value from ``node_size``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: Device
    num_devices: PositiveInt
    devices_per_node: PositiveInt | None = None

    @property
    def node_size(self) -> int:
        """Devices per node: the override if given, else the device's figure."""
        return self.devices_per_node if self.devices_per_node is not None else self.device.devices_per_node

    @property
    def num_nodes(self) -> int:
        """Nodes needed to hold ``num_devices``; a partly filled last node counts."""
        return math.ceil(self.num_devices / self.node_size)

    @property
    def scaleup_domain_size(self) -> int:
        """Devices that share one scale-up fabric, capped by the cluster's size.

        A domain no larger than the part's node (an HGX baseboard's NVLink) lies inside one
        node, so a node of fewer devices (``devices_per_node``: a 4-GPU instance of an 8-GPU
        part) holds a domain of that many: min(domain, node size). A domain that spans nodes
        (CloudMatrix384's UB fabric across its 16-NPU nodes) joins nodes, and a node size does
        not bound it.

        A job larger than such a rack-scale domain takes the same number of devices from each
        domain it uses (Slurm's ``--segment``; Huawei MindCluster's ``sp-block``, a logical SuperPoD of
        HCCS inside and RoCE between): the most, a whole number of nodes and at least
        half the domain, that divide the job. This is the domain the rank layout is aligned
        on: 256 GPUs on GB200 NVL72 racks are 4 racks of 64 (16 of 18 trays, as NVIDIA's MLPerf
        Training GB200 NVL72 runs of 8,192 and 5,120 GPUs), so an EP 64 or TP 16 group sits in
        one rack; 144 are 2 of 72. Where no such share exists (76 GPUs) the job fills domains
        in rank order and the last one holds the rest."""
        domain = self.device.scaleup_domain_size
        if domain <= self.device.devices_per_node:
            return min(domain, self.node_size, self.num_devices)
        if self.num_devices <= domain:
            return self.num_devices
        node = self.node_size
        for share in range(domain - domain % node, (domain + 1) // 2 - 1, -node):
            if share > 0 and self.num_devices % share == 0:
                return share
        return domain
