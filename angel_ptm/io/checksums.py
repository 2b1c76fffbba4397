"""Checksums of byte streams by name, as a checkpoint's manifest records them.

    crc = checksums.function(checksums.PREFERRED)   # crc = f(data, crc) continues over the next bytes

"crc32c" (Castagnoli) runs in the native extension (SSE4.2 where the CPU has it, three interleaved chains:
17-28 GB/s here, 4-7x zlib's CRC-32 at ~4 GB/s) with the GIL released; it is what new checkpoints use when the
extension is built. "crc32" is zlib's, what checkpoints use without the extension and what older manifests imply.
Without the extension a "crc32c" checkpoint is still checked, by a pure-Python table loop of a few MB/s, with a
warning saying so.
"""

from __future__ import annotations

import logging
import zlib
from typing import Callable

from angel_ptm.io.engine import _native

log = logging.getLogger("angel_ptm.io")

Checksum = Callable[..., int]  # (data: a bytes-like object, value: int = 0) -> int


def _table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_TABLE: list[int] | None = None
_warned = False


def crc32c_python(data, value: int = 0) -> int:
    """CRC-32C in pure Python (the fallback: a few MB/s)."""
    global _TABLE, _warned
    if _TABLE is None:
        _TABLE = _table()
    if not _warned:
        _warned = True
        log.warning("angel_ptm: checking CRC-32C in pure Python (the native extension is not built): a few MB/s")
    table, crc = _TABLE, value ^ 0xFFFFFFFF
    for byte in memoryview(data).cast("B"):
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def _crc32c_native(data, value: int = 0) -> int:
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return _native.crc32c(view, value)


crc32c: Checksum = _crc32c_native if _native is not None and hasattr(_native, "crc32c") else crc32c_python


def copy_crc32c(dst, src, value: int = 0) -> int:
    """`src`'s bytes copied into `dst` (as many), and their CRC-32C continuing from `value`: natively one pass over
    memory, each piece checksummed while the cache still holds it (the GIL released), instead of a copy and then
    a checksum reading every byte again."""
    dst, src = memoryview(dst).cast("B"), memoryview(src).cast("B")
    if crc32c is _crc32c_native and hasattr(_native, "copy_crc32c"):
        return _native.copy_crc32c(dst, src, value)
    dst[:] = src
    return crc32c(dst, value)


def chained_crc32c(views, chain) -> list[int]:
    """The CRC-32C at the end of each of `views`, a checksum starting at each view whose `chain` flag is True and
    going on over the views after it while their flags are False."""
    sums, crc = [], 0
    for view, starts in zip(views, chain):
        crc = crc32c(view, 0 if starts else crc)
        sums.append(crc)
    return sums


ALGORITHMS: dict[str, Checksum] = {"crc32": zlib.crc32, "crc32c": crc32c}
PREFERRED = "crc32c" if crc32c is _crc32c_native else "crc32"


def function(name: str) -> Checksum:
    """The checksum called `name`; KeyError naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"unknown checksum {name!r} (known: {', '.join(sorted(ALGORITHMS))})") from None
