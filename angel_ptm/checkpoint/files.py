"""Checkpoint files read by offset, and where a tensor's elements lie in the bytes torch.save wrote for it: a
load reads a dense item's elements from the file straight into their page (one copy, page cache to page), without
unpickling, and says where they lie so a disk page can read them there (memory/backing.py)."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Callable

from angel_ptm.errors import CheckpointCorruptError
from angel_ptm.io import checksums


def _iov_max() -> int:
    try:
        return max(1, min(os.sysconf("SC_IOV_MAX"), 1024))
    except (AttributeError, ValueError, OSError):
        return 16  # POSIX's least


IOV_MAX = _iov_max()  # buffers one preadv may fill


class CheckpointFile:
    """A checkpoint file open for reading: `read` and `readinto` at an offset (pread: the GIL is released while
    the kernel copies), `advise` what comes next (WILLNEED: the kernel starts reading it)."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def read(self, offset: int, nbytes: int) -> bytearray:
        out = bytearray(nbytes)
        self.readinto(memoryview(out), offset)
        return out

    def readinto(self, view: memoryview, offset: int) -> None:
        self.readinto_parts([view], offset)

    def readinto_parts(self, views: list[memoryview], offset: int, chain: list[bool] | None = None
                       ) -> list[int] | None:
        """The bytes from `offset` on into `views`, one after the other (one preadv per IOV_MAX views: a single
        front-to-back read of the file however the destination is split). With `chain` (a flag per view), their
        CRC-32Cs as checksums.chained_crc32c takes them, once read (a DirectFile takes them as it copies)."""
        total = sum(len(v) for v in views)
        given, views = views, [v for v in views if len(v)]
        done = i = 0
        while i < len(views):
            try:
                got = os.preadv(self.fd, views[i: i + IOV_MAX], offset + done)
            except OSError as err:
                raise CheckpointCorruptError(f"cannot read {total} bytes at byte {offset} of {self.path}: "
                                             f"{err.strerror}", self.path) from None
            if got <= 0:
                raise CheckpointCorruptError(f"{self.path} ends before byte {offset + total} (truncated?)",
                                             self.path)
            done += got
            while i < len(views) and got >= len(views[i]):  # the views filled whole
                got -= len(views[i])
                i += 1
            if got:
                views[i] = views[i][got:]
        return None if chain is None else checksums.chained_crc32c(given, chain)

    def advise(self, offset: int, length: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ReadAhead:
    """Asks the kernel for the byte ranges a reader will read next, up to `window` bytes ahead of it, from a thread
    of its own: WILLNEED allocates the page cache's pages and submits the reads (~50 ms for 300 MB here), work the
    reading thread need not do. `reached(i)`: the reader is at range i. Advice is only advice: its errors are
    ignored (the read itself reports a missing or short file)."""

    def __init__(self, ranges: list[tuple[CheckpointFile, int, int]], window: int):
        self.ranges, self.window = ranges, window
        self._ends = list(itertools.accumulate(length for _, _, length in ranges))
        self._position = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="angel-ptm-checkpoint-readahead", daemon=True)

    def __enter__(self) -> "ReadAhead":
        self._thread.start()
        return self

    def reached(self, position: int) -> None:
        with self._cond:
            self._position = position
            self._cond.notify()

    def _ahead(self, advised: int) -> int:
        return self._ends[advised - 1] - self._ends[self._position] if advised > self._position + 1 else 0

    def _run(self) -> None:
        for advised, (file, offset, length) in enumerate(self.ranges):
            with self._cond:
                while not self._stop and self._ahead(advised) >= self.window:
                    self._cond.wait()
                if self._stop:
                    return
            try:
                if file is not None:  # (None: a range read otherwise, direct_reads.py)
                    file.advise(offset, length)
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()


def _u(data, at: int, size: int) -> int:
    return int.from_bytes(data[at: at + size], "little")


def data_record_ends(head) -> bool:
    """Whether `head` (an item's bytes up to where its elements are said to begin) ends with the local header of
    a tensor's data record (torch.save's zip: `<archive>/data/<key>`, stored): the check that a recorded start
    points at the elements and not merely at bytes the checksum also covers."""
    at = bytes(head).rfind(b"PK\x03\x04")
    if at < 0 or at + 30 > len(head):
        return False
    name_len, extra_len = _u(head, at + 26, 2), _u(head, at + 28, 2)
    name = bytes(head[at + 30: at + 30 + name_len])
    return at + 30 + name_len + extra_len == len(head) and b"/data/" in name and _u(head, at + 8, 2) == 0


def record_start(read: Callable[[int, int], bytes], length: int, nbytes: int) -> int | None:
    """Where the one storage record of an item (a tensor torch.save wrote: a zip archive, records stored
    uncompressed; `length` bytes, `read(offset, n)` its bytes at an offset) begins, if it holds `nbytes` bytes;
    None otherwise (torch.load then reads it). Reads the zip's central directory (torch writes sizes after each
    record's data, not in its local header): a few small reads, never the data."""
    for span in (4096, (1 << 16) + 22):  # torch writes no archive comment: the end record is in the last 4 KiB
        at = max(0, length - span)
        tail = bytes(read(at, length - at))
        end = tail.rfind(b"PK\x05\x06")
        if end >= 0 and end + 22 <= len(tail) and _u(tail, end + 16, 4) >= at:
            break
    else:
        return None
    entries, position = _u(tail, end + 10, 2), _u(tail, end + 16, 4)
    if position == 0xFFFFFFFF or position < at:
        return None  # zip64 (more than a page), or a directory not where a tensor's is
    found = None
    for _ in range(entries):
        entry = tail[position - at: position - at + 46]
        if len(entry) < 46 or entry[:4] != b"PK\x01\x02":
            return None
        name_len, extra_len, comment_len = _u(entry, 28, 2), _u(entry, 30, 2), _u(entry, 32, 2)
        name = tail[position - at + 46: position - at + 46 + name_len]
        if b"/data/" in name:
            local = _u(entry, 42, 4)
            header = bytes(read(local, 30)) if local + 30 <= length else b""
            if (found is not None or _u(entry, 10, 2) != 0 or _u(entry, 20, 4) != nbytes
                    or _u(entry, 24, 4) != nbytes or header[:4] != b"PK\x03\x04"):
                return None
            found = local + 30 + _u(header, 26, 2) + _u(header, 28, 2)
        position += 46 + name_len + extra_len + comment_len
    return found if found is not None and found + nbytes <= length else None
