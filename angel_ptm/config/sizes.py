"""Byte sizes as people write them in config files ("64MiB", "2GB", 4096) and back ("64.0 MiB").

Units are case-insensitive. B/KB/MB/GB/TB are decimal (powers of 1000) because that is what disk vendors
and ``df -H`` mean; KiB/MiB/GiB/TiB and the bare K/M/G/T are binary (powers of 1024) because that is what
page sizes and GPU memory are counted in.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Annotated, Union

from angel_ptm.errors import ConfigTypeError, ConfigValueError

_UNIT_BYTES = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgt", start=1):
    _UNIT_BYTES[_letter] = 1024**_power
    _UNIT_BYTES[_letter + "ib"] = 1024**_power
    _UNIT_BYTES[_letter + "b"] = 1000**_power

# A signed decimal number (optionally with an exponent, so "1e9" works) followed by an optional unit.
_SIZE_PATTERN = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*")

_SIZE_EXAMPLES = 'an int or a string like "64MiB", "2GB", "4096"'
# The largest size a config may name: 1 EiB, a thousand times any machine's memory or disk today. Past it a size is
# a typo or an overflow ("1e400" reads as a 1330-bit integer), and it would go on to overflow the int64 byte counts
# of torch and the native I/O engine instead of being refused here.
MAX_BYTES = 2**60


def show_value(value: object) -> str:
    """``repr`` of a user-supplied value, cut short so every error message stays one readable line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_bytes(value: object, key: str) -> int:
    """Return ``value`` (int, whole float or size string) as a number of bytes from 0 to MAX_BYTES.

    ``key`` is the dotted config key, used only to name the culprit in errors.
    """
    return _at_most_max(_parse_size(value, key), value, key)


def _parse_size(value: object, key: str) -> int:
    """``value`` as a whole number of bytes >= 0, however large."""
    # bool is an int subclass; True bytes is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigTypeError(
            f"{key}: expected a byte size ({_SIZE_EXAMPLES}), got {show_value(value)} ({type(value).__name__})"
        )
    if isinstance(value, str):
        match = _SIZE_PATTERN.fullmatch(value.lower())
        if match is None or match.group(2) not in _UNIT_BYTES:
            raise ConfigValueError(f"{key}: not a byte size (expected {_SIZE_EXAMPLES}), got {show_value(value)}")
        # Fraction keeps "1.5GiB" exact instead of going through a float.
        size = Fraction(match.group(1)) * _UNIT_BYTES[match.group(2)]
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigValueError(f"{key}: must be a finite byte size, got {show_value(value)}")
        size = Fraction(value)
    else:
        size = Fraction(value)
    if size < 0:
        raise ConfigValueError(f"{key}: must be a size >= 0, got {show_value(value)}")
    if size.denominator != 1:
        raise ConfigValueError(f"{key}: must be a whole number of bytes, got {show_value(value)}")
    return int(size)


def parse_budget(value: object, key: str) -> Union[int, str]:
    """A tier budget: the string "auto" (resolved later, once the hardware is known) or a byte size."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, float) and not math.isfinite(value):  # YAML's .inf, or 1.0e400 read as a float
        raise ConfigValueError(f'{key}: must be "auto" or a finite size, got {show_value(value)}')
    try:
        size = _parse_size(value, key)
    except ConfigValueError:
        raise ConfigValueError(f'{key}: must be "auto" or a size >= 0, got {show_value(value)}') from None
    except ConfigTypeError:
        raise ConfigTypeError(
            f'{key}: expected "auto" or a byte size ({_SIZE_EXAMPLES}), '
            f"got {show_value(value)} ({type(value).__name__})"
        ) from None
    return _at_most_max(size, value, key)


def _at_most_max(size: int, value: object, key: str) -> int:
    if size > MAX_BYTES:
        raise ConfigValueError(f"{key}: must be at most 2**60 bytes (1 EiB), got {show_value(value)}")
    return size


def format_bytes(n: int) -> str:
    """``67108864`` -> ``"64.0 MiB"``; sizes under 1 KiB stay exact (``"512 B"``)."""
    for name, unit in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{int(n)} B"


# Field annotations for the schema: the second Annotated argument is the parser the loader applies, so a
# dataclass field says in its type both what it holds after loading and how it is read.
ByteSize = Annotated[int, parse_bytes]
Budget = Annotated[Union[int, str], parse_budget]

__all__ = ["MAX_BYTES", "Budget", "ByteSize", "format_bytes", "parse_budget", "parse_bytes", "show_value"]
