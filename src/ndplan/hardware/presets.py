"""Find a Device: by preset name, or from a user's YAML/JSON file.

Every problem with the user's input becomes one ``NdplanError`` line that names
the file and the field, because the CLI prints exactly that line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ndplan.errors import NdplanError, by_name_or_object, did_you_mean, parse_nested, read_text, require_name
from ndplan.hardware.device import Device

_PRESET_FILE = "devices.yaml"
_FILE_SUFFIXES = (".yaml", ".yml", ".json")


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader (libyaml's where available) that also reads ``989.4e12`` and ``85e9`` as floats.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent, so
    the way people write hardware figures would otherwise arrive as strings.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
              |[0-9][0-9_]*[eE][-+]?[0-9]+
              |\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$""",
        re.X,
    ),
    list("-+0123456789."),
)


def list_devices() -> list[Device]:
    """Every packaged preset, in the order of ``devices.yaml``."""
    return list(_presets())


def get_device(name: str) -> Device:
    """The preset called ``name`` (case-insensitive).

    Raises:
        NdplanError: no preset has that name; the message lists the known ones.
    """
    wanted = require_name(name, "device name").strip().lower()
    for device in _presets():
        if device.name.lower() == wanted:
            return device
    names = [device.name for device in _presets()]
    raise NdplanError(f"unknown hardware '{name}'{did_you_mean(name, names)}; known: {', '.join(names)}")


def resolve_device(name_or_path: str) -> Device:
    """A preset name, or a path ending .yaml/.yml/.json that holds exactly one device."""
    if not require_name(name_or_path, "device").lower().endswith(_FILE_SUFFIXES):
        return get_device(name_or_path)
    loaded = load_device_file(name_or_path)
    if isinstance(loaded, Device):
        return loaded
    if len(loaded) != 1:
        names = ", ".join(device.name for device in loaded)
        raise NdplanError(f"{name_or_path}: holds {len(loaded)} devices ({names}); expected exactly one")
    return loaded[0]


def load_device_file(path: str | Path) -> Device | list[Device]:
    """Read devices from a user's YAML or JSON file, in the preset field names.

    The file may hold one device (a mapping), a list of devices, or a mapping
    with a ``devices:`` list like the packaged presets. Returns a ``Device`` for
    a single mapping and a list otherwise.

    Raises:
        NdplanError: unreadable or malformed file, or a missing, unknown or
            invalid field; the one-line message names the file and the field.
    """
    source = str(path)
    try:
        text = read_text(path)
    except OSError as exc:
        raise NdplanError(f"{source}: cannot read hardware file ({exc.strerror or exc})") from exc
    data = _parse(text, source, json_syntax=source.lower().endswith(".json"))
    return _devices_from_data(data, source)


@lru_cache(maxsize=1)
def _presets() -> tuple[Device, ...]:
    text = resources.files("ndplan.hardware").joinpath(_PRESET_FILE).read_text(encoding="utf-8")
    devices = _devices_from_data(_parse(text, _PRESET_FILE, json_syntax=False), _PRESET_FILE)
    return tuple(devices) if isinstance(devices, list) else (devices,)


def _parse(text: str, source: str, *, json_syntax: bool) -> Any:
    if json_syntax:
        try:
            return parse_nested(json.loads, text, source, "JSON")
        except json.JSONDecodeError as exc:
            raise NdplanError(
                f"{source}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from exc
    try:
        # _Loader is a SafeLoader: no object construction
        return parse_nested(lambda document: yaml.load(document, Loader=_Loader), text, source, "YAML")
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or "could not parse"
        raise NdplanError(f"{source}: malformed YAML{where}: {problem}") from exc


def _devices_from_data(data: Any, source: str) -> Device | list[Device]:
    if isinstance(data, Mapping) and set(data) == {"devices"}:
        data = data["devices"]
    if isinstance(data, Mapping):
        return _device_from_mapping(data, source, label=None)
    if isinstance(data, list) and data:
        devices = [_device_from_mapping(entry, source, label=f"#{i + 1}") for i, entry in enumerate(data)]
        _check_unique_names(devices, source)
        return devices
    raise NdplanError(f"{source}: expected a device (a mapping of fields) or a non-empty list of devices")


def _device_from_mapping(data: Any, source: str, *, label: str | None) -> Device:
    name = data.get("name") if isinstance(data, Mapping) else None
    if isinstance(name, str) and name:
        where = f"{source}: device '{name}'"
    elif label is not None:
        where = f"{source}: device {label}"
    else:
        where = source
    if not isinstance(data, Mapping):
        raise NdplanError(f"{where}: expected a mapping of field names to values, got {type(data).__name__}")
    try:
        return Device.model_validate(dict(data))
    except ValidationError as exc:
        raise NdplanError(f"{where}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    """All of pydantic's complaints, each naming its field, on one line."""
    known = ", ".join(Device.model_fields)
    parts = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(device)"
        if error["type"] == "missing":
            parts.append(f"field '{field}': missing required field")
        elif error["type"] == "extra_forbidden":
            parts.append(f"field '{field}': unknown field (known: {known})")
        else:
            message = error["msg"].removeprefix("Value error, ")
            value = error.get("input")
            # bools are ints to isinstance, and the bool check already says what it got
            scalar = isinstance(value, str | int | float) and not isinstance(value, bool)
            got = f" (got {value!r})" if scalar else ""
            parts.append(f"field '{field}': {message}{got}")
    return "; ".join(parts)


def _check_unique_names(devices: list[Device], source: str) -> None:
    seen: set[str] = set()
    for device in devices:
        key = device.name.lower()
        if key in seen:
            raise NdplanError(f"{source}: device name '{device.name}' appears more than once")
        seen.add(key)


def as_device(value: Device | str, what: str = "device") -> Device:
    """A Device, or one by preset name or file path (what the API's entry points accept)."""
    device: Device = by_name_or_object(value, Device, resolve_device, what, "device")
    return device
