"""Accelerator descriptions: presets with sourced figures, user files, clusters."""

from ndplan.hardware.device import DTYPES, Cluster, Device
from ndplan.hardware.presets import as_device, get_device, list_devices, load_device_file, resolve_device

__all__ = [
    "DTYPES",
    "as_device",
    "Cluster",
    "Device",
    "get_device",
    "list_devices",
    "load_device_file",
    "resolve_device",
]
