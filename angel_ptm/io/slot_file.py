"""A preallocated file of page-sized slots, opened with O_DIRECT where the filesystem allows it.

Space is reserved with posix_fallocate when slots are added, so a full disk is reported when the tier grows
(before any page is written there), not halfway through a transfer.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import mmap
import os
import sys
import weakref

import torch

from angel_ptm.errors import DiskFullError, PageIOError

log = logging.getLogger("angel_ptm.io")

ALIGNMENT = 4096
_buffered_announced: set[str] = set()


def open_direct(path: str) -> tuple[int, bool]:
    """Open (creating) `path` for O_DIRECT I/O; where the filesystem refuses it, buffered I/O, said once."""
    flags = os.O_RDWR | os.O_CREAT
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            fd = os.open(path, flags | direct, 0o600)
            if _direct_io_works(fd):
                return fd, True
            os.close(fd)
        except OSError as exc:
            if exc.errno not in (errno_mod.EINVAL, errno_mod.EOPNOTSUPP):
                raise PageIOError(f"cannot open {path}: {exc.strerror}", errno=exc.errno or 0, path=path) from exc
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in _buffered_announced:
        _buffered_announced.add(folder)
        log.warning("angel-ptm I/O: %s does not support O_DIRECT; using buffered I/O there", folder)
    try:
        return os.open(path, flags, 0o600), False
    except OSError as exc:
        raise PageIOError(f"cannot open {path}: {exc.strerror}", errno=exc.errno or 0, path=path) from exc


def whole_blocks(start: int, end: int, size: int) -> tuple[int, int]:
    """Byte range [start, end) of a file of `size` bytes widened to whole ALIGNMENT blocks, as an O_DIRECT read
    takes them, and cut at the file's last whole block (O_DIRECT cannot read the partial one after it)."""
    return start - start % ALIGNMENT, min(-(-end // ALIGNMENT) * ALIGNMENT, size - size % ALIGNMENT)


def open_direct_readonly(path: str | os.PathLike) -> int:
    """`path` opened read-only with O_DIRECT, or -1 where the filesystem refuses it (at the open, or at the first
    read: the probe of `open_direct`); any other error is raised (OSError)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError as exc:
        if exc.errno in (errno_mod.EINVAL, errno_mod.EOPNOTSUPP):
            return -1
        raise
    try:
        if _direct_io_works(fd):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return -1


def _direct_io_works(fd: int) -> bool:
    # Some filesystems accept O_DIRECT at open and refuse it at the first transfer: probe one aligned block.
    probe = aligned_empty(ALIGNMENT)
    view = memoryview(probe.numpy()).cast("B")
    try:
        os.preadv(fd, [view], 0)
        return True
    except OSError as exc:
        if exc.errno == errno_mod.EINVAL:
            return False
        raise


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_libc = None


def _advise_huge(address: int, nbytes: int) -> bool:
    """Ask the kernel to back [address, address + nbytes) with transparent huge pages (Linux; a no-op elsewhere)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        ok = _libc.madvise(address, nbytes, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("madvise(MADV_HUGEPAGE) refused: %s", os.strerror(ctypes.get_errno()))
    return ok


def aligned_empty(nbytes: int, device: str | torch.device = "cpu", huge: bool | None = None) -> torch.Tensor:
    """An uninitialised uint8 tensor whose address is a multiple of 4096 (O_DIRECT needs it).

    CPU buffers of 2 MiB or more (or `huge=True`) are 2 MiB-aligned and advised to the kernel as
    transparent-huge-page memory before they are first touched: an O_DIRECT transfer pins 512x fewer pages and a
    streaming kernel takes fewer TLB misses (on a virtual disk, reads into huge pages ran ~10% faster)."""
    device = torch.device(device)
    if huge is None:
        huge = nbytes >= HUGE_PAGE
    huge = huge and device.type == "cpu"
    align = HUGE_PAGE if huge else ALIGNMENT
    raw = torch.empty(nbytes + align, dtype=torch.uint8, device=device)
    shift = (-raw.data_ptr()) % align
    buffer = raw[shift : shift + nbytes]
    if huge and nbytes >= HUGE_PAGE:
        _advise_huge(buffer.data_ptr(), nbytes - nbytes % HUGE_PAGE)
    return buffer


def anonymous_aligned(nbytes: int) -> torch.Tensor:
    """`aligned_empty` for a transient CPU buffer: an anonymous mapping of its own (never the allocator's heap),
    unmapped as soon as the last tensor viewing it is gone, 2 MiB-aligned and advised as transparent-huge-page
    memory from 2 MiB on. A transfer-sized buffer from the heap raises glibc's mmap threshold, and freed ones then
    stay resident; O_DIRECT into 4 KiB pages pins 512x as many pages: a checkpoint save's 4 MiB page reads ran at
    1.0-1.5 GB/s into them here, 2.5-3.3 GB/s into huge pages (tools/bench/checkpoint's disk)."""
    huge = nbytes >= HUGE_PAGE
    align = HUGE_PAGE if huge else ALIGNMENT
    # private: a shared anonymous mapping is shmem, which the kernel backs with huge pages only if told to system-wide
    area = mmap.mmap(-1, nbytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    shift = (-whole.data_ptr()) % align
    buffer = whole[shift: shift + nbytes]
    if huge:
        _advise_huge(buffer.data_ptr(), nbytes - nbytes % HUGE_PAGE)
    return buffer


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class SlotFile:
    """Slots of `slot_bytes` in one file; slot i lives at offset i * slot_bytes."""

    def __init__(self, path: str, slot_bytes: int, engine):
        if slot_bytes % ALIGNMENT:
            raise ValueError(f"slot_bytes must be a multiple of {ALIGNMENT}, got {slot_bytes}")
        self.path, self.slot_bytes, self.engine = path, slot_bytes, engine
        self.fd, self.direct = open_direct(path)
        self.n_slots = 0
        # An engine dropped without close(): its file descriptor is closed when this object is collected
        self._finalizer = weakref.finalize(self, _close_fd, self.fd)

    def grow(self, n_slots: int) -> None:
        """Reserve disk space for `n_slots` slots in total (never shrinks)."""
        if n_slots <= self.n_slots:
            return
        start, length = self.n_slots * self.slot_bytes, (n_slots - self.n_slots) * self.slot_bytes
        try:
            os.posix_fallocate(self.fd, start, length)
        except OSError as exc:
            cls = DiskFullError if exc.errno in (errno_mod.ENOSPC, errno_mod.EFBIG, errno_mod.EDQUOT) else PageIOError
            raise cls(
                f"cannot reserve {length} bytes at offset {start} in {self.path}: {exc.strerror}",
                errno=exc.errno or 0,
                path=self.path,
            ) from exc
        self.n_slots = n_slots

    def _check(self, slot: int, buffer: torch.Tensor) -> int:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} outside {self.path} ({self.n_slots} slots)")
        if buffer.numel() * buffer.element_size() != self.slot_bytes:
            raise ValueError(f"buffer of {buffer.numel() * buffer.element_size()} bytes for a {self.slot_bytes}-byte slot")
        if self.direct and buffer.data_ptr() % ALIGNMENT:
            raise ValueError(f"O_DIRECT buffer at {buffer.data_ptr():#x} is not {ALIGNMENT}-byte aligned")
        return slot * self.slot_bytes

    def write(self, slot: int, buffer: torch.Tensor):
        return self.engine.submit_write(self.fd, buffer, self._check(slot, buffer), path=self.path)

    def read(self, slot: int, buffer: torch.Tensor):
        return self.engine.submit_read(self.fd, buffer, self._check(slot, buffer), path=self.path)

    def close(self, remove: bool = False) -> None:
        if self.fd >= 0:
            self._finalizer.detach()
            os.close(self.fd)
            self.fd = -1
        if remove and os.path.exists(self.path):
            os.remove(self.path)
