"""Formatting of bytes, counts and times for people. Computation stays in bytes, seconds, FLOPs."""

from __future__ import annotations

import math

GIB = 1024**3
MIB = 1024**2


def format_bytes(value: float) -> str:
    """Binary units, as allocators and nvidia-smi report: 1 GiB = 2^30 bytes."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"


def format_count(value: float) -> str:
    """Decimal units for parameter counts: 8.03B, 671.03B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:,.2f}{unit}"
    return f"{value:,.0f}"


def parse_bytes(text: str) -> int:
    """'70GiB', '80 GB', '1.5TiB', '123456' -> bytes. GB/TB are decimal, GiB/TiB binary. Up to
    EiB/EB, since the bound (below 2^63 bytes, 8 EiB) is said in EiB."""
    from ndplan.errors import NdplanError

    units = {"eib": 1024**6, "pib": 1024**5, "tib": 1024**4, "gib": GIB, "mib": MIB, "kib": 1024,
             "eb": 10**18, "pb": 10**15, "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}
    cleaned = text.strip().lower().replace(" ", "").replace("_", "")
    number, size = cleaned, 1
    for suffix, unit_size in units.items():
        if cleaned.endswith(suffix):
            number, size = cleaned[: -len(suffix)], unit_size
            break
    try:
        value = float(number)
    except ValueError:
        raise NdplanError(f"cannot read '{text}' as a size; write e.g. 70GiB, 80GB or 85899345920") from None
    if not math.isfinite(value) or value * size >= 2**63:
        raise NdplanError(f"a size must be a finite number of bytes below 8 EiB, got '{text}'")
    if value <= 0:
        raise NdplanError(f"a size must be positive, got '{text}'")
    if number == cleaned and value < MIB:  # no unit: bytes, and too few to be meant
        raise NdplanError(f"'{text}' is {value:g} bytes; give a unit, e.g. {text.strip()}GiB or {text.strip()}GB")
    return int(value * size)


def memory_limit(value: object, what: str, none_means: str = "") -> float:
    """A memory limit an API caller gives: bytes (a number > 0 below 8 EiB) or a size as
    ``parse_bytes`` reads it ("70GiB", as the CLI does). Else an NdplanError naming argument
    ``what`` (and what None stands for where the caller takes it): NaN, inf or a list leaked as
    OverflowError or TypeError from deep inside, and 0, -1 or NaN were "fits -0.00 GiB"."""
    from numbers import Real

    from ndplan.errors import NdplanError

    if isinstance(value, str):
        try:
            return float(parse_bytes(value))
        except NdplanError as error:
            raise NdplanError(f"{what}: {error}") from None
    # Compared as it is, not as a float: a huge int overflowed float() (an OverflowError).
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < 2**63:  # type: ignore[operator]
        default = f", or None for {none_means}" if none_means else ""
        raise NdplanError(f"{what} must be > 0 and below 8 EiB: a number of bytes or a size such as '70GiB'{default}; "
                          f"got {value!r}")
    return float(value)
