"""Fills and copies of page buffers in CPU memory that stay off torch's intra-op thread pool.

torch's `zero_()` and `copy_()` of a CPU tensor past its grain size (32768 elements) run on the intra-op pool, whose
workers then spin on their cores for a while after the op. Compute needs that pool; the runtime's own byte moves do
not (they are memory-bound: one thread streams them at memory speed), and on a machine with few cores the core a
spinning worker holds is the one the I/O threads, the checkpoint's read-ahead or the copy thread needed. Measured
here (2 cores, a checkpoint load of 4 MiB pages): with the pages zero-filled by `zero_()` a second thread burned
~0.2 s of CPU per load and the load took 0.30 s; by libc's memset, 0.25 s.

Large CPU buffers therefore go through libc's `memset` / `memmove` by ctypes (a foreign call: the GIL is released
while it runs); everything else (small, strided, other devices, a dtype change) through torch's own op.
"""

from __future__ import annotations

import ctypes

import torch

# torch runs an elementwise op on one thread below 32768 elements; a uint8 view of a 32 KiB buffer is already that.
DIRECT_BYTES = 32 << 10


def _direct(t: torch.Tensor) -> int:
    """The bytes of `t` when it is a contiguous CPU tensor large enough for the direct path, else 0."""
    nbytes = t.numel() * t.element_size()
    return nbytes if nbytes >= DIRECT_BYTES and t.device.type == "cpu" and t.is_contiguous() else 0


def zero_(t: torch.Tensor) -> torch.Tensor:
    """`t.zero_()` (all bytes zero: +0.0 for floats), off the intra-op pool for a large CPU buffer."""
    nbytes = _direct(t)
    if nbytes:
        ctypes.memset(t.data_ptr(), 0, nbytes)
        return t
    return t.zero_()


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)`, off the intra-op pool when both are large CPU buffers of one dtype and shape."""
    nbytes = _direct(dst)
    if nbytes and dst.dtype == src.dtype and dst.shape == src.shape and _direct(src):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return dst
    return dst.copy_(src)
