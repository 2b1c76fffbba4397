"""A save's page-sized scratch buffers: anonymous mappings of their own (never the allocator's heap), reused once
the writer is done with the items that view them, and capped (BufferPool); the pages a save reads, served in order
through them (PageStream)."""

from __future__ import annotations

import time

import torch

from angel_ptm.io.slot_file import anonymous_aligned
from angel_ptm.memory import Page


def anonymous_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor over memory of its own (io/slot_file.py's `anonymous_aligned`: an anonymous
    mapping in transparent huge pages), returned to the system as soon as the last tensor viewing it is gone: a
    save's transient buffers never stay in the allocator's heap (a page-sized buffer from it raises glibc's mmap
    threshold, and the freed pages then stay resident), and a disk page's O_DIRECT read into one runs at 2-3x the
    speed of a read into 4 KiB pages here."""
    return anonymous_aligned(nbytes)


def _views(buffer: torch.Tensor) -> int | None:
    """How many tensors view `buffer`'s memory (torch's count of its storage's users), None where this torch
    does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    try:
        return None if count is None else int(count(buffer.untyped_storage()._cdata))
    except (TypeError, AttributeError, RuntimeError):  # a private call another torch may change
        return None


class BufferPool:
    """Page-sized anonymous buffers (`anonymous_buffer`), each handed out again once given back and no tensor
    views it any more (the writer wrote its items): a fresh mapping costs ~1-2.5 ms a 4 MiB page here in faults
    and zeroing, a reused one nothing. With `cap`, a `take` while `cap` buffers are out waits (up to `patience`
    seconds, then makes one more) for the writer to finish with one: the writer is the slower side of a save, so
    waiting costs it nothing and the save's memory stays at `cap` pages."""

    def __init__(self, nbytes: int, cap: int | None = None, patience: float = 1.0):
        self.nbytes, self.cap, self.patience = nbytes, cap, patience
        self._back: list[tuple[torch.Tensor, int]] = []  # (buffer, its count of views when only it existed)
        self._made: dict[int, int] = {}  # id(buffer) -> that count, for buffers handed out
        self._count = 0  # buffers made and not dropped

    def _free(self) -> torch.Tensor | None:
        for i, (buffer, alone) in enumerate(self._back):
            if _views(buffer) == alone:
                del self._back[i]
                self._made[id(buffer)] = alone
                return buffer
        return None

    def take(self) -> torch.Tensor:
        buffer = self._free()
        if buffer is None and self.cap is not None and self._back and self._count >= self.cap:
            deadline = time.monotonic() + self.patience
            while buffer is None and time.monotonic() < deadline:
                time.sleep(0.0002)
                buffer = self._free()
        if buffer is not None:
            return buffer
        buffer = anonymous_buffer(self.nbytes)
        alone = _views(buffer)
        if alone is not None:
            self._made[id(buffer)] = alone
            self._count += 1
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """`buffer` (from `take`) is not used by the caller any more; items may still view it."""
        alone = self._made.pop(id(buffer), None)
        if alone is not None:
            self._back.append((buffer, alone))

    def clear(self) -> None:
        self._back.clear()
        self._made.clear()
        self._count = 0


class PageStream:
    """Pages served in a known order, with no page changing tier: a page in CPU memory is served as its own buffer
    (a save between steps: nothing moves it until the save is over), a GPU page copied out, a disk page read from
    its slot into a buffer of its own (checked against its checksum; the reads of the next `depth - 1` disk pages
    in flight meanwhile), a dead one is zeros. Items are views of what `get` returns (zero-copy), so a buffer lives
    exactly as long as the items the writer has not written yet: about `depth` + 1 pages at a time."""

    def __init__(self, manager, order: list[Page], page_bytes: int, depth: int = 2):
        self.manager, self.order, self.depth, self.page_bytes = manager, order, max(1, depth), page_bytes
        self._ready: dict[int, tuple[torch.Tensor, object]] = {}  # position -> (buffer, disk read or None)
        self._position = {page.id: i for i, page in enumerate(order)}
        self._next = 0  # the next position to start
        self._current: tuple[int, torch.Tensor] | None = None
        self._pool = BufferPool(page_bytes, cap=self.depth + 1)  # the ones this holds, one the writer holds
        self.read_bytes = 0

    def get(self, page: Page) -> torch.Tensor:
        """Page `page`'s bytes, a CPU uint8 tensor."""
        position = self._position[page.id]
        if self._current is not None and self._current[0] == position:
            return self._current[1]
        if self._current is not None:
            self._pool.give_back(self._current[1])
        self._current = None
        for stale in [p for p in self._ready if p < position]:  # skipped pages
            buffer, handle = self._ready.pop(stale)
            if handle is not None:
                handle.wait()
            self._pool.give_back(buffer)
        self._next = max(self._next, position)
        self._start_until(position)
        buffer, handle = self._ready.pop(position)
        if handle is not None:
            self.manager.disk.check_read(page, handle)
        self._current = (position, buffer)
        self._start_until(position + self.depth - 1)  # read ahead
        return buffer

    def _start_until(self, last: int) -> None:
        while self._next <= min(last, len(self.order) - 1) and len(self._ready) < self.depth:
            page = self.order[self._next]
            self.manager.flush([page])
            handle = None
            if page.buffer is not None:
                raw = page.buffer.view(torch.uint8).reshape(-1)
                buffer = raw if raw.device.type == "cpu" else self._pool.take().copy_(raw)
            elif page.dead or page.disk_slot is None:
                buffer = torch.zeros(self.page_bytes, dtype=torch.uint8)
            else:
                buffer = self._pool.take()
                handle = self.manager.disk.read(page.kind, page.disk_slot, buffer)
                self.read_bytes += buffer.numel()
            self._ready[self._next] = (buffer, handle)
            self._next += 1

    def close(self) -> None:
        for _, handle in self._ready.values():
            if handle is not None:
                handle.wait()
        self._ready.clear()
        self._current = None
        self._pool.clear()
