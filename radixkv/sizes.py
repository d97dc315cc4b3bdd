"""Byte sizes written by people: ``8GiB``, ``512 MB``, ``64M``, ``1048576``.

One parser for every place a size is read (store and tier config, tier URLs, environment variables),
so a size valid in one is valid in all: units ``KiB MiB GiB TiB`` (powers of 1024), ``KB MB GB TB``
and ``K M G T`` (powers of 1000), case-insensitive, or none (bytes).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from radixkv.errors import ConfigError

__all__ = ["parse_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


_MAX_BYTES = (1 << 63) - 1  # a signed 64-bit byte count: the largest size any tier or OS call takes


def parse_bytes(value: Any, what: str = "size") -> int:
    """An int >= 0 from an int, a whole float, or a size string (``"8GiB"`` -> 8589934592).

    Raises :class:`ConfigError` naming ``what`` and the value, with the accepted forms."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is not a size: give bytes as an integer or a string like '8GiB'")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{what}={value!r} is not a size: write bytes (1048576) or a number with a unit: "
                "KiB MiB GiB TiB (1024-based), KB MB GB TB or K M G T (1000-based), e.g. 8GiB"
            )
        x = Fraction(m.group(1)) * _UNITS[unit]  # exact: 1.001KB is 1001 bytes, not 1000.9999...
        if x.denominator != 1:
            raise ConfigError(f"{what}={value!r} is not a whole number of bytes; round it, e.g. "
                              f"{math.floor(x)} or {math.ceil(x)}")
        n = int(x)
    else:
        raise ConfigError(f"{what}={value!r} is not a size: give bytes as an integer or a string like '8GiB'")
    if n < 0:
        raise ConfigError(f"{what}={value!r} must be >= 0 bytes")
    if n > _MAX_BYTES:
        # No medium holds more; a value this large is a unit slip (1e30 for 1e3), not a budget.
        raise ConfigError(f"{what}={value!r} is more than 8 EiB (2^63 - 1 bytes); give a real size, "
                          "or 0 where 0 means unbounded (a Redis tier)")
    return n
