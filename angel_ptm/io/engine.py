"""Asynchronous page I/O: the native engine (angel_ptm._native) when it is built, a thread-pool fallback otherwise.

Both engines take a file descriptor, a contiguous CPU tensor as the buffer and a byte offset, and return an
`IOHandle`. `IOHandle.wait()` releases the GIL while it blocks, then either returns the page checksum of the bytes
transferred or raises `PageIOError` / `DiskFullError` naming the file, offset and errno. No error is dropped: a
request that fails in any of its chunks fails as a whole.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import logging
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from angel_ptm.errors import DiskFullError, PageIOError

log = logging.getLogger("angel_ptm.io")

READ, WRITE = 0, 1
_OP_NAMES = {READ: "read", WRITE: "write"}
CHECKSUM_BLOCK = 256 << 10  # per-block checksums (as the native engine), combined, so workers can checksum in parallel
# A thread has one transfer of up to DEFAULT_CHUNK_BYTES in flight, which the block layer splits into requests of
# max_sectors_kb (4 MiB on this project's virtual disk): 16 MiB chunks keep 4x as many requests queued as 4 MiB ones.
# Measured (tools/bench/io's raw loop of 64 MiB preadv calls as 1.0, 64 MiB pages, medians of 10 interleaved rounds):
# 4 threads read at 0.93 with 4 MiB chunks, 0.97 with 16 MiB; 8 threads x 16 MiB at 0.99, but 8 threads made the
# scheduled training step (tools/bench/overlap) ~5% slower: more write-backs in flight delay the reads compute waits
# for. Pages smaller than a chunk are one transfer each.
DEFAULT_THREADS = 4
DEFAULT_CHUNK_BYTES = 16 << 20
_DISK_FULL_ERRNOS = {errno_mod.ENOSPC, errno_mod.EFBIG, errno_mod.EDQUOT}

try:
    from angel_ptm import _native

    NATIVE_IMPORT_ERROR: str | None = None
except ImportError as exc:  # the extension was not built: the fallback still works, slower
    _native = None
    NATIVE_IMPORT_ERROR = str(exc)


def _buffer_address(buffer: torch.Tensor) -> tuple[int, int]:
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError(f"I/O buffers must be contiguous CPU tensors, got {buffer.device} contiguous={buffer.is_contiguous()}")
    return buffer.data_ptr(), buffer.numel() * buffer.element_size()


def io_error(op: int, path: str, offset: int, nbytes: int, err: int, detail: str) -> PageIOError:
    """The typed exception for a failed transfer: DiskFullError for ENOSPC/EFBIG/EDQUOT, PageIOError otherwise."""
    cls = DiskFullError if err in _DISK_FULL_ERRNOS else PageIOError
    name = errno_mod.errorcode.get(err, str(err))
    return cls(
        f"{_OP_NAMES[op]} of {nbytes} bytes at offset {offset} in {path or '<fd>'} failed ({name}): {detail}",
        errno=err,
        path=path,
    )


class IOHandle:
    """One submitted transfer. `wait()` returns its checksum (0 if not requested) or raises its error."""

    def __init__(self, op: int, path: str, offset: int, nbytes: int, buffer: torch.Tensor, poll, block):
        self.op, self.path, self.offset, self.nbytes = op, path, offset, nbytes
        self._buffer = buffer  # keeps the memory alive until the transfer is over
        self._poll, self._block = poll, block
        self._result: int | None = None
        self._error: PageIOError | None = None

    def done(self) -> bool:
        return self._result is not None or self._error is not None or self._poll()

    def wait(self) -> int:
        if self._result is None and self._error is None:
            err, detail, checksum = self._block()
            if err:
                self._error = io_error(self.op, self.path, self.offset, self.nbytes, err, detail)
            else:
                self._result = checksum
            self._buffer = None
        if self._error is not None:
            raise self._error
        return self._result


class NativeEngine:
    """Worker threads in C++ doing pread/pwrite and CRC32C; the GIL is released while waiting."""

    backend = "native"

    def __init__(self, threads: int = DEFAULT_THREADS, queue_depth: int = 32, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        # Checksums run beside the I/O threads: one checksum thread per two cores (CRC32C runs at ~20 GB/s a core).
        checksum_threads = max(1, min(4, (os.cpu_count() or 2) // 2))
        self._engine = _native.Engine(threads, queue_depth, chunk_bytes, checksum_threads)
        self.threads, self.queue_depth, self.chunk_bytes = threads, queue_depth, chunk_bytes
        self.checksum_algorithm = _native.crc32c_impl()
        self._held = threading.local()  # this thread's hold_wakeups depth

    @contextlib.contextmanager
    def hold_wakeups(self):
        """Transfers this thread submits inside the block are queued without waking a worker; the block's end
        wakes them together (so do a full queue and a wait on any transfer). A worker that finds transfers of
        adjacent file ranges queued together makes them one vectored transfer: N pages written back (or read)
        into neighbouring slots cost the kernel one call instead of N (measured here for 64 KiB pages with
        O_DIRECT: 28 us of CPU per page alone, 4-9 us per page in runs of 4-16)."""
        self._held.depth = getattr(self._held, "depth", 0) + 1
        try:
            yield
        finally:
            self._held.depth -= 1
            if not self._held.depth:
                self._engine.wake()

    def transfer_counts(self) -> tuple[int, int]:
        """(transfers the workers made, page transfers they carried): how often adjacent ones were merged."""
        return tuple(self._engine.transfer_counts)

    def _submit(self, op, fd, buffer, offset, path, checksum) -> IOHandle:
        address, nbytes = _buffer_address(buffer)
        request = self._engine.submit(op, fd, address, nbytes, offset, checksum, not getattr(self._held, "depth", 0))
        engine = self._engine

        def block():
            if not request.done():
                engine.wake()  # (a transfer held by hold_wakeups on this thread goes now: it is waited for)
                request.wait()
            return request.error, request.message, request.checksum if checksum else 0

        return IOHandle(op, path, offset, nbytes, buffer, request.done, block)

    def submit_read(self, fd: int, buffer: torch.Tensor, offset: int, *, path: str = "", checksum: bool = True):
        return self._submit(READ, fd, buffer, offset, path, checksum)

    def submit_write(self, fd: int, buffer: torch.Tensor, offset: int, *, path: str = "", checksum: bool = True):
        return self._submit(WRITE, fd, buffer, offset, path, checksum)

    def checksum(self, buffer: torch.Tensor) -> int:
        address, nbytes = _buffer_address(buffer)
        return _native.page_checksum(address, nbytes)

    def inject_fault(self, op: int | None, err: int, count: int = 1) -> None:
        """Test hook: the next `count` chunk transfers of `op` (READ, WRITE or None for any) fail with `err`."""
        self._engine.inject_fault(-1 if op is None else op, err, count)

    def close(self) -> None:
        self._engine.shutdown()


def _zlib_page_checksum(view: memoryview) -> int:
    blocks = [zlib.crc32(view[pos : pos + CHECKSUM_BLOCK]) for pos in range(0, len(view), CHECKSUM_BLOCK)]
    if len(blocks) == 1:
        return blocks[0]
    return zlib.crc32(b"".join(b.to_bytes(4, "little") for b in blocks))


class ThreadEngine:
    """Pure-Python fallback: os.preadv/os.pwritev (which release the GIL) on a thread pool, zlib CRC32 checksums."""

    backend = "python-threads"
    checksum_algorithm = "crc32-zlib"

    def __init__(self, threads: int = DEFAULT_THREADS, queue_depth: int = 32, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.threads, self.queue_depth, self.chunk_bytes = threads, queue_depth, chunk_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="angel-io")
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._fault_lock = threading.Lock()
        self._fault = (None, 0, 0)

    def _take_fault(self, op: int) -> int:
        with self._fault_lock:
            fault_op, err, count = self._fault
            if count > 0 and (fault_op is None or fault_op == op):
                self._fault = (fault_op, err, count - 1)
                return err
        return 0

    def _transfer(self, op: int, fd: int, view: memoryview, offset: int, checksum: bool):
        try:
            err = self._take_fault(op)
            if err:
                return err, f"injected fault: {os.strerror(err)}", 0
            done = 0
            while done < len(view):
                part = view[done:]
                try:
                    n = os.preadv(fd, [part], offset + done) if op == READ else os.pwritev(fd, [part], offset + done)
                except InterruptedError:
                    continue
                except OSError as exc:
                    return exc.errno or errno_mod.EIO, f"{exc.strerror} at offset {offset + done}", 0
                if n == 0:
                    kind = "short read" if op == READ else "short write"
                    return errno_mod.EIO, f"{kind}: {done} of {len(view)} bytes", 0
                done += n
            return 0, "", _zlib_page_checksum(view) if checksum else 0
        finally:
            self._slots.release()

    @contextlib.contextmanager
    def hold_wakeups(self):
        """(The native engine's batching; each transfer here starts when submitted.)"""
        yield

    def _submit(self, op, fd, buffer, offset, path, checksum) -> IOHandle:
        _, nbytes = _buffer_address(buffer)
        view = memoryview(buffer.view(torch.uint8).numpy()).cast("B")
        self._slots.acquire()
        future = self._pool.submit(self._transfer, op, fd, view, offset, checksum)
        return IOHandle(op, path, offset, nbytes, buffer, future.done, future.result)

    def submit_read(self, fd: int, buffer: torch.Tensor, offset: int, *, path: str = "", checksum: bool = True):
        return self._submit(READ, fd, buffer, offset, path, checksum)

    def submit_write(self, fd: int, buffer: torch.Tensor, offset: int, *, path: str = "", checksum: bool = True):
        return self._submit(WRITE, fd, buffer, offset, path, checksum)

    def checksum(self, buffer: torch.Tensor) -> int:
        return _zlib_page_checksum(memoryview(buffer.view(torch.uint8).numpy()).cast("B"))

    def inject_fault(self, op: int | None, err: int, count: int = 1) -> None:
        with self._fault_lock:
            self._fault = (op, err, count)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_announced = set()


def create_engine(threads: int = DEFAULT_THREADS, queue_depth: int = 32, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  backend: str = "auto"):
    """The native engine if it is built (or `backend="native"` demands it), else the thread fallback, loudly."""
    if backend not in ("auto", "native", "python"):
        raise ValueError(f"io backend must be auto, native or python, got {backend!r}")
    if backend == "native" and _native is None:
        raise ImportError(f"angel_ptm._native is not available: {NATIVE_IMPORT_ERROR}")
    if backend == "python" or _native is None:
        if "python" not in _announced:
            _announced.add("python")
            reason = "requested" if backend == "python" else f"native extension missing ({NATIVE_IMPORT_ERROR})"
            log.warning("angel-ptm I/O: using the pure-Python thread engine (slower): %s", reason)
        return ThreadEngine(threads, queue_depth, chunk_bytes)
    engine = NativeEngine(threads, queue_depth, chunk_bytes)
    if "native" not in _announced:
        _announced.add("native")
        log.info("angel-ptm I/O: native engine, %d threads, %s checksums", threads, engine.checksum_algorithm)
    return engine


def native_available() -> bool:
    return _native is not None
