"""Unit conversions, used only at the edges (files, CLI, reports). Inside the code: SI.

Bandwidth in files is in bit/s multiples (as networks are sold), inside in bytes/s.
"""

from __future__ import annotations

KIB = 1024
MIB = 1024**2
GIB = 1024**3

_BIT_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def mbit_per_s_to_bytes_per_s(mbit_per_s: float) -> float:
    return mbit_per_s * 1e6 / 8.0


def gbit_per_s_to_bytes_per_s(gbit_per_s: float) -> float:
    return gbit_per_s * 1e9 / 8.0


def bytes_per_s_to_mbit_per_s(bytes_per_s: float) -> float:
    return bytes_per_s * 8.0 / 1e6


def rate_field_to_bytes_per_s(field: str, value: float) -> float:
    """``bandwidth_mbit_per_s = 100`` -> 12.5e6 bytes/s. ``field`` is the key's unit part."""
    unit = field.removeprefix("bandwidth_").removesuffix("_per_s")
    if unit in _BIT_RATE:
        return value * _BIT_RATE[unit] / 8.0
    if unit == "bytes":
        return float(value)
    raise KeyError(field)


def time_field_to_s(field: str, value: float) -> float:
    """``latency_ms = 20`` -> 0.02 s."""
    unit = field.rsplit("_", 1)[-1]
    if unit in _TIME:
        return value * _TIME[unit]
    raise KeyError(field)


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    if bits >= 1e9:
        return f"{bits / 1e9:.1f} Gbit/s"
    if bits < 0.9995e6:  # a slow link (files allow 1 kbit/s) is not "0 Mbit/s"
        return f"{bits / 1e3:.0f} kbit/s"
    return f"{bits / 1e6:.0f} Mbit/s"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"
