"""A file written front to back through a few aligned chunks, each written by an I/O engine's thread while the
caller fills the next: how a checkpoint file is written.

    with SequentialWriter(path) as out:    # out.write(bytes-like), out.tell(); leaving the block without an
        torch.save(item, out)              # error makes the file whole and durable (`finish`)

O_DIRECT where the filesystem allows it: no copy into the page cache, no dirty-page throttling, nothing of the
page cache (training's page files) pushed out, and the disk writes while the next chunk is produced. Measured
here (16 MiB writes of 304 MiB, then fsync): O_DIRECT 2.2-2.7 GB/s in every round; buffered writes 0.4-3.0, the
same with 32 MiB handed to the disk at a time. The last chunk is written padded to the alignment, then the file
is truncated to its length. Where O_DIRECT is refused (tmpfs), buffered writes, each `KICK` bytes handed to the
disk at once (posix_fadvise DONTNEED starts their writeback), so the closing fsync finds little left.

`max_bytes_per_s` paces the writes (a save beside training: `checkpoint.async_max_gbps`): a number, or a `Pace`,
which another thread may `lift` (someone waits for the file: the rest goes as fast as it can).

Memory: `depth` chunks of `chunk` bytes (2 x 1 MiB), whatever the file's size, in one anonymous mapping
(slot_file.anonymous_aligned: 2 MiB-aligned, so the two chunks are one transparent huge page). A checkpoint save
of 310 MB (tools/bench/checkpoint's model, its pages mostly read from disk beside the writes) took 0.24-0.28 s
with 2 x 1 MiB in one huge page, 0.23-0.26 s with 2 x 2 MiB in two (2 MiB more RSS growth: 4.05 pages, over the
bench's 4-page goal), 0.35-0.39 s with 2 x 1 MiB in 4 KiB pages.
"""

from __future__ import annotations

import os
import threading
import time

from angel_ptm.errors import PageIOError
from angel_ptm.io.engine import create_engine
from angel_ptm.io.slot_file import ALIGNMENT, anonymous_aligned, open_direct

CHUNK = 1 << 20
DEPTH = 2
KICK = 32 << 20


class Pace:
    """Bytes per second a writer keeps to (None: as fast as it can), which another thread may lift: a writer
    waiting for its turn then goes on at once."""

    def __init__(self, bytes_per_s: float | None):
        self.bytes_per_s = bytes_per_s
        self._lifted = threading.Event()

    def wait(self, seconds: float) -> None:
        self._lifted.wait(seconds)

    def lift(self) -> None:
        self.bytes_per_s = None
        self._lifted.set()


class SequentialWriter:
    """Write-only, sequential; `write` raises PageIOError (DiskFullError on ENOSPC) naming the file, from the
    chunk that failed; `finish` makes the file whole (length, fsync); `close` (also on error) only releases."""

    def __init__(self, path: str | os.PathLike, chunk: int | None = None, depth: int | None = None,
                 max_bytes_per_s: float | Pace | None = None):
        chunk, depth = CHUNK if chunk is None else chunk, DEPTH if depth is None else depth
        if chunk % ALIGNMENT or depth < 1:
            raise ValueError(f"chunk must be a multiple of {ALIGNMENT} bytes and depth >= 1, got {chunk}, {depth}")
        self.path, self.chunk = str(path), chunk
        self.fd, self.direct = open_direct(self.path)
        try:
            self.engine = create_engine(threads=depth, queue_depth=depth)
        except BaseException:
            os.close(self.fd)
            raise
        staging = anonymous_aligned(chunk * depth)  # (one mapping: huge pages once the chunks together fill one)
        self._buffers = [staging[k * chunk: (k + 1) * chunk] for k in range(depth)]
        # Filled by memoryview assignment: a memcpy with the GIL held (numpy's copy releases it above a few hundred
        # bytes, and a writer beside training then waits for the GIL back after every chunk)
        self._views = [memoryview(b.numpy()) for b in self._buffers]
        self._handles: list = [None] * depth
        self._k = self._fill = 0  # the chunk being filled, and how far
        self._written = 0  # where the chunk being filled starts in the file
        self._kicked = 0
        self._closed = False
        # pacing: a chunk waits until the rate allows its bytes
        self.pace = max_bytes_per_s if isinstance(max_bytes_per_s, Pace) else Pace(max_bytes_per_s)
        self._started = time.monotonic()
        os.ftruncate(self.fd, 0)  # a file of that name (a leftover) holds nothing of ours

    def __enter__(self) -> "SequentialWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                self.finish()
        finally:
            self.close()

    def tell(self) -> int:
        return self._written + self._fill

    def writable(self) -> bool:
        return True

    def flush(self) -> None:  # chunks go to the disk when full; `finish` writes the rest
        pass

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total, done = len(view), 0
        while done < total:
            n = min(total - done, self.chunk - self._fill)
            self._views[self._k][self._fill: self._fill + n] = view[done: done + n]
            self._fill += n
            done += n
            if self._fill == self.chunk:
                self._submit()
        return total

    def _submit(self) -> None:
        """The chunk being filled goes to the disk (padded to the alignment: only the last is partial); the next
        buffer is waited for."""
        k, fill = self._k, self._fill
        rate = self.pace.bytes_per_s
        if rate:
            delay = self._started + (self._written + fill) / rate - time.monotonic()
            if delay > 0:
                self.pace.wait(delay)
        padded = -(-fill // ALIGNMENT) * ALIGNMENT
        if padded > fill:
            self._buffers[k][fill:padded].zero_()
        self._handles[k] = self.engine.submit_write(self.fd, self._buffers[k][:padded], self._written,
                                                    path=self.path, checksum=False)
        self._written += fill
        self._k, self._fill = (k + 1) % len(self._buffers), 0
        self._wait(self._k)
        if not self.direct and self._written - self._kicked >= KICK and hasattr(os, "posix_fadvise"):
            self._wait_all()
            os.posix_fadvise(self.fd, self._kicked, self._written - self._kicked, os.POSIX_FADV_DONTNEED)
            self._kicked = self._written

    def _wait(self, k: int) -> None:
        handle, self._handles[k] = self._handles[k], None
        if handle is not None:
            handle.wait()

    def _wait_all(self) -> None:
        for k in range(len(self._handles)):
            self._wait(k)

    def finish(self) -> None:
        """Every byte written, the file cut to its length and fsynced."""
        if self._fill:
            self._submit()
        self._wait_all()
        try:
            os.ftruncate(self.fd, self._written)
            os.fsync(self.fd)
        except OSError as err:
            raise PageIOError(f"cannot finish {self.path}: {err.strerror}", errno=err.errno or 0,
                              path=self.path) from None

    def close(self) -> None:
        """Waits for the writes in flight (their errors are not raised here: `write` or `finish` raised one
        already, or the file is being abandoned) and releases the file, the engine and the buffers."""
        if self._closed:
            return
        self._closed = True
        for k in range(len(self._handles)):
            try:
                self._wait(k)
            except PageIOError:
                pass
        self.engine.close()
        os.close(self.fd)
        self._buffers = self._views = []
