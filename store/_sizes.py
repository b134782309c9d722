"""Human-readable sizes: ``"4GiB"``, ``"512 MB"``, ``1 << 20``."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

MAX_SIZE = (1 << 63) - 1
"""A size must fit in an int64: numpy offsets and the LMDB map size are 64-bit signed."""


def positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive ``int`` (not a bool), else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def parse_size(value: int | str) -> int:
    """Return a byte count from an int or a string like ``"4GiB"``, ``"1.5 GB"`` or ``"0"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB)
    powers of 1024. The result must be a whole number of bytes (``"1.5GiB"`` is, ``"1.5"``
    and ``"0.3KiB"`` are not) up to :data:`MAX_SIZE`. Raises ``ValueError`` for anything
    else: negative numbers, fractions of a byte, unknown units, floats, bools.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"not a size: {value!r} (give an int of bytes or a string like '4GiB')")
    if isinstance(value, int):
        return _in_range(value, value)
    match = _SIZE_RE.match(value)
    if match is None:
        if value.strip().startswith("-"):
            raise ValueError(f"size must not be negative: {value!r}")
        raise ValueError(f"not a size: {value!r} (try '4GiB' or '512MB')")
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}")
    exact = Fraction(number) * scale  # exact: with floats, int(0.57 * 100) is 56
    if exact.denominator != 1:
        raise ValueError(f"{value!r} is not a whole number of bytes ({float(exact)} bytes)")
    return _in_range(int(exact), value)


def _in_range(size: int, given: int | str) -> int:
    if size < 0:
        raise ValueError(f"size must not be negative: {given!r}")
    if size > MAX_SIZE:
        raise ValueError(f"size {given!r} is more than {MAX_SIZE} bytes")
    return size
