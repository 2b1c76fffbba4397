"""Asynchronous SSD I/O: the native O_DIRECT engine (or its thread fallback) and preallocated slot files."""

from angel_ptm.io.engine import (
    READ,
    WRITE,
    IOHandle,
    NativeEngine,
    ThreadEngine,
    create_engine,
    native_available,
)
from angel_ptm.io.slot_file import ALIGNMENT, SlotFile, aligned_empty, open_direct

__all__ = [
    "READ", "WRITE", "IOHandle", "NativeEngine", "ThreadEngine", "create_engine", "native_available",
    "ALIGNMENT", "SlotFile", "aligned_empty", "open_direct",
]
