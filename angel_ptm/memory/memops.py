"""Fills and copies of page buffers in CPU memory that stay off torch's intra-op thread pool.

torch's `zero_()` and `copy_()` of a CPU tensor past its grain size (32768 elements) run on the intra-op pool, whose
workers then spin on their cores for a while after the op. Compute needs that pool; the runtime's own byte moves do
not (they are memory-bound: one thread streams them at memory speed), and on a machine with few cores the core a
spinning worker holds is the one the I/O threads, the checkpoint's read-ahead or another rank needed. Measured
here (2 cores, a checkpoint load of 4 MiB pages): with the pages zero-filled by `zero_()` an intra-op worker burned
~0.17 s of CPU per load beside the loading thread's ~0.16 s; by libc's memset, none (the load's wall time on an
otherwise idle machine: the same within noise, ~0.27 s).

Contiguous CPU buffers from 32 KiB therefore go through libc's `memset` / `memmove` by ctypes, with the GIL kept
below 1 MiB (handing it to another Python thread for a few microseconds of work costs this one a wait to get it
back, up to the interpreter's switch interval: the collectives' waiter threads are there to take it) and released
from 1 MiB; everything else (small, strided, other devices, a dtype change, no libc) through torch's own op.
"""

from __future__ import annotations

import ctypes

import torch

# torch runs an elementwise op on one thread below 32768 elements; a uint8 view of a 32 KiB buffer is already that.
DIRECT_BYTES = 32 << 10
RELEASE_GIL_BYTES = 1 << 20


def _libc(loader) -> tuple | None:
    """(memset, memmove) of the C library this process runs with, loaded by `loader` (PyDLL: the GIL kept during
    a call; CDLL: released); None where there is none to load (the torch op serves then)."""
    try:
        lib = loader(None)
        memset, memmove = lib.memset, lib.memmove
    except (OSError, AttributeError, TypeError):
        return None
    memset.argtypes, memset.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], ctypes.c_void_p
    memmove.argtypes, memmove.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p
    return memset, memmove


_HOLD, _RELEASE = _libc(ctypes.PyDLL), _libc(ctypes.CDLL)


def _calls(nbytes: int) -> tuple | None:
    return _RELEASE if nbytes >= RELEASE_GIL_BYTES else _HOLD


def _direct(t: torch.Tensor) -> int:
    """The bytes of `t` when it is a contiguous CPU tensor large enough for the direct path, else 0."""
    nbytes = t.numel() * t.element_size()
    return nbytes if nbytes >= DIRECT_BYTES and t.device.type == "cpu" and t.is_contiguous() else 0


def zero_(t: torch.Tensor) -> torch.Tensor:
    """`t.zero_()` (all bytes zero: +0.0 for floats), off the intra-op pool for a large CPU buffer."""
    nbytes = _direct(t)
    calls = _calls(nbytes) if nbytes else None
    if calls is not None:
        calls[0](t.data_ptr(), 0, nbytes)
        return t
    return t.zero_()


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)`, off the intra-op pool when both are large CPU buffers of one dtype and shape."""
    nbytes = _direct(dst)
    calls = _calls(nbytes) if nbytes and dst.dtype == src.dtype and dst.shape == src.shape and _direct(src) else None
    if calls is not None:
        calls[1](dst.data_ptr(), src.data_ptr(), nbytes)
        return dst
    return dst.copy_(src)
