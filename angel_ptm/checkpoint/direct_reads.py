"""A checkpoint file's items read front to back with O_DIRECT into a few huge-page chunks, the next chunks' reads
in flight while the reader copies out of the current one: how a load reads the items it puts into pages.

    file = DirectFile.open(path, [(offset, length), ...])   # None where O_DIRECT is refused (tmpfs)
    file.readinto_parts(views, offset)                       # as CheckpointFile's, from the chunks

Through the page cache, a load paid for each byte twice on the CPU: the kernel's read-ahead (a thread asking
WILLNEED ahead of the reader: ~80 ms of page-cache allocation for 310 MB here) and the copy out of the page
cache, and the disk read at the page cache's pace. Here the disk writes each chunk straight into memory of ours
(O_DIRECT into 2 MiB pages ran at 2.5-3.3 GB/s on this machine's disk), and the one copy is ours, out of the chunk
into the page. The chunks cover the byte ranges the load will read (`ranges`, whole 4 KiB blocks, nearby ranges
together), in file order, `DEPTH` of them read ahead. A read outside them (before the chunk being read, or in the
file's last partial block, which O_DIRECT cannot read) goes through the page cache as before: correct, only
slower.
"""

from __future__ import annotations

import collections
import os

from angel_ptm.checkpoint.files import CheckpointFile
from angel_ptm.errors import CheckpointCorruptError, PageIOError
from angel_ptm.io import checksums
from angel_ptm.io.engine import create_engine
from angel_ptm.io.slot_file import anonymous_aligned, open_direct_readonly, whole_blocks

CHUNK = 4 << 20  # bytes one O_DIRECT read brings in
# Chunks read ahead (their memory: DEPTH x CHUNK, whatever the file's size, while a file is read). The reader
# checksums each page after copying it out, and the disk idles once every chunk ahead has landed: a 310 MB load
# here took 0.18-0.21 s with 3 chunks, 0.13-0.19 s with 6 (8 MiB x 3: 0.14-0.19 s).
DEPTH = 6
GAP = 256 << 10  # ranges this close are read as one (the bytes between are read too, and dropped)


def spans_of(ranges: list[tuple[int, int]], size: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """Aligned [start, end) spans of at most `chunk` bytes, in file order, covering every byte of `ranges`
    ((offset, length) pairs) but those in the last partial block of a file of `size` bytes."""
    merged: list[list[int]] = []
    for offset, length in sorted(ranges):
        start, end = whole_blocks(offset, offset + length, size)
        if end <= start:
            continue
        if merged and start <= merged[-1][1] + GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(at, min(at + chunk, end)) for start, end in merged for at in range(start, end, chunk)]


class DirectFile(CheckpointFile):
    """A checkpoint file whose planned ranges are read with O_DIRECT ahead of the reader (`readinto_parts`); the
    descriptor of CheckpointFile (buffered) serves any other read."""

    def __init__(self, path, direct_fd: int, ranges: list[tuple[int, int]], chunk: int = CHUNK,
                 depth: int = DEPTH):
        super().__init__(path)
        self.direct_fd = direct_fd
        self._spans = collections.deque(spans_of(ranges, self.size, chunk))
        self._end = max((o + n for o, n in ranges), default=0)  # once read to there: chunks and threads go
        self._window: collections.deque = collections.deque()  # (start, end, buffer, handle), in file order
        self._chunk, self._depth = chunk, min(depth, len(self._spans))
        self._free: list | None = None  # the chunks and the engine, made at the first read, dropped after the last
        self._engine = None

    @classmethod
    def open(cls, path, ranges: list[tuple[int, int]]) -> "DirectFile | None":
        """The file read through O_DIRECT, or None where the filesystem refuses it (the caller reads it buffered)."""
        try:
            fd = open_direct_readonly(path)
        except OSError as err:
            raise CheckpointCorruptError(f"cannot read {path}: {err.strerror}", str(path)) from None
        if fd < 0:
            return None
        try:
            return cls(path, fd, ranges)
        except BaseException:
            os.close(fd)
            raise

    def readinto_parts(self, views: list[memoryview], offset: int, chain: list[bool] | None = None
                       ) -> list[int] | None:
        """The bytes from `offset` on into `views`, one after the other: out of the chunks where they lie there,
        through the page cache where not. With `chain`, their CRC-32Cs (as CheckpointFile's), taken as the bytes
        are copied out of the chunks (checksums.copy_crc32c: one pass over memory, not two)."""
        sums: list[int] | None = None if chain is None else []
        crc, pos = 0, offset
        for k, view in enumerate(views):
            view = memoryview(view).cast("B")
            if chain is not None and chain[k]:
                crc = 0
            done = 0
            while done < len(view):
                span = self._chunk_at(pos)
                if span is None:  # not read ahead: up to the next chunk through the page cache
                    upto = self._window[0][0] if self._window and self._window[0][0] > pos else pos + len(view)
                    n = min(len(view) - done, upto - pos)
                    super().readinto_parts([view[done: done + n]], pos)
                    if chain is not None:
                        crc = checksums.crc32c(view[done: done + n], crc)
                else:
                    start, end, buffer = span
                    n = min(len(view) - done, end - pos)
                    if chain is None:
                        view[done: done + n] = buffer[pos - start: pos - start + n]
                    else:
                        crc = checksums.copy_crc32c(view[done: done + n], buffer[pos - start: pos - start + n], crc)
                done += n
                pos += n
            if sums is not None:
                sums.append(crc)
        if pos >= self._end and self._engine is not None:  # the last planned byte read: chunks and threads go
            self._release()
        return sums

    def _chunk_at(self, pos: int) -> tuple[int, int, memoryview] | None:
        """The chunk holding byte `pos`, landed (chunks wholly before it go back for the next reads), or None."""
        while self._window and self._window[0][1] <= pos:
            self._free.append(self._settle(self._window.popleft())[2])
        while self._spans and self._spans[0][1] <= pos:  # skipped: never read
            self._spans.popleft()
        if self._free is None and self._spans:
            self._free = [anonymous_aligned(self._chunk) for _ in range(self._depth)]
            self._engine = create_engine(threads=self._depth, queue_depth=self._depth)
        while self._free and self._spans:
            start, end = self._spans.popleft()
            buffer = self._free.pop()
            handle = self._engine.submit_read(self.direct_fd, buffer[: end - start], start, path=self.path,
                                              checksum=False)
            self._window.append((start, end, buffer, handle))
        if not self._window or not self._window[0][0] <= pos < self._window[0][1]:
            return None
        start, end, buffer, handle = self._window[0]
        if handle is not None:
            self._settle(self._window[0])
            self._window[0] = (start, end, buffer, None)
        return start, end, memoryview(buffer.numpy())

    def _settle(self, entry: tuple) -> tuple:
        handle = entry[3]
        if handle is not None:
            try:
                handle.wait()
            except PageIOError as err:
                raise CheckpointCorruptError(f"cannot read {entry[1] - entry[0]} bytes at byte {entry[0]} of "
                                             f"{self.path}: {err}", self.path) from None
        return entry

    def _release(self) -> None:
        """Reads in flight waited for (no read may land in a chunk once it is unmapped), chunks and engine gone."""
        for entry in self._window:
            try:
                self._settle(entry)
            except CheckpointCorruptError:
                pass
        self._window.clear()
        self._spans.clear()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._free = []

    def close(self) -> None:
        self._release()
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
        super().close()
