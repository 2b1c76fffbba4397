"""Checkpoint files read through a read-only mapping, and where a tensor's elements lie in the bytes torch.save
wrote for it: a load copies an item's elements from the page cache into its page once, without unpickling, and
says where they lie so a disk page can read them there (memory/backing.py)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path


class MappedFile:
    """A checkpoint file mapped read-only (private: nothing is ever written through it)."""

    def __init__(self, path: Path):
        with open(path, "rb", buffering=0) as f:
            self.size = os.fstat(f.fileno()).st_size
            self.map = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY) if self.size else None
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")

    def advise(self, offset: int, length: int) -> None:
        """The kernel starts reading these bytes now."""
        if self.map is not None and hasattr(mmap, "MADV_WILLNEED") and offset + length <= self.size:
            start = offset - offset % mmap.PAGESIZE
            self.map.madvise(mmap.MADV_WILLNEED, start, offset + length - start)

    def done(self, offset: int, length: int) -> None:
        """These bytes are read: their pages leave this process (they stay in the page cache)."""
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = min(offset + length, self.size) // mmap.PAGESIZE * mmap.PAGESIZE
        if self.map is not None and hasattr(mmap, "MADV_DONTNEED") and end > start:
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        for thing in (self.view, self.map):
            try:
                if thing is not None:
                    thing.release() if isinstance(thing, memoryview) else thing.close()
            except BufferError:  # a tensor still views it: unmapped once that tensor is gone
                pass


def _u(data, at: int, size: int) -> int:
    return int.from_bytes(data[at: at + size], "little")


def record_start(data: memoryview, nbytes: int) -> int | None:
    """Where the one storage record of `data` (a tensor torch.save wrote: a zip archive, records stored
    uncompressed) begins, if it holds `nbytes` bytes; None otherwise (torch.load then reads it). Reads the zip's
    central directory (torch writes sizes after each record's data, not in its local header)."""
    tail = bytes(data[max(0, len(data) - (1 << 16) - 22):])
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + 22 > len(tail):
        return None
    entries, position = _u(tail, end + 10, 2), _u(tail, end + 16, 4)
    if position == 0xFFFFFFFF:
        return None  # zip64: more than a page
    found = None
    for _ in range(entries):
        entry = bytes(data[position: position + 46])
        if len(entry) < 46 or entry[:4] != b"PK\x01\x02":
            return None
        name_len, extra_len, comment_len = _u(entry, 28, 2), _u(entry, 30, 2), _u(entry, 32, 2)
        name = bytes(data[position + 46: position + 46 + name_len])
        if b"/data/" in name:
            local = _u(entry, 42, 4)
            if (found is not None or _u(entry, 10, 2) != 0 or _u(entry, 20, 4) != nbytes
                    or _u(entry, 24, 4) != nbytes or bytes(data[local: local + 4]) != b"PK\x03\x04"):
                return None
            found = local + 30 + _u(data, local + 26, 2) + _u(data, local + 28, 2)
        position += 46 + name_len + extra_len + comment_len
    return found if found is not None and found + nbytes <= len(data) else None
