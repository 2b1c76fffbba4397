"""The saved pages' bytes at an asynchronous save, copied only where training would change them first."""

from __future__ import annotations

import threading

import torch

from angel_ptm.checkpoint.buffers import BufferPool, anonymous_buffer
from angel_ptm.errors import ChecksumError
from angel_ptm.memory import Page, PageState
from angel_ptm.memory import memops

# A page in these states, unpinned and unchanged, still holds the saved bytes in its (current) slot
_MOVED = frozenset({PageState.TO_HOST, PageState.TO_DEVICE, PageState.HOST, PageState.DEVICE})


class Snapshot:
    """The saved pages' bytes as they are at the save, for a save that runs beside training (`checkpoint.async_save`),
    read by the checkpoint's thread. Nothing is copied at the save but the pages pinned then:
    - a page in memory stays where it is, guarded (memory/guards.py): a pin to write it, or a move that gives its
      slot up (a write-back, a drop), copies it aside first, on the training thread; read-only pins, unpins and
      moves between device and host (the same bytes, in a traded slot or a finished copy) leave it watched where
      it is; the writer copies the pages still there into a reused buffer when it comes to them (under one lock:
      a page is copied once, by whichever comes first);
    - a page on disk stays in its slot, held there (DiskTier.hold: not rewritten, not reused) until read, so
      training goes on and a page written meanwhile gets another slot;
    - a dead page is zeros.
    `copied_bytes`: the bytes copied aside so far (the pages pinned at the save, and those training reached
    first)."""

    def __init__(self, manager, order: list[Page], page_bytes: int):
        self.manager, self.disk, self.page_bytes = manager, manager.disk, page_bytes
        self._entries: dict[int, tuple] = {}
        self.copied_bytes = self.read_bytes = 0
        self._lock = threading.Lock()
        self._scratch: torch.Tensor | None = None  # the pool's buffer last served
        self._last: int | None = None  # the page whose bytes `_served` holds
        self._served: torch.Tensor | None = None
        self._pool = BufferPool(page_bytes)
        live = []
        for page in order:
            manager.flush([page])
            if page.buffer is not None and page.pin_count:  # may be written with no further pin: copied now
                self._entries[page.id] = ("copy", self._copy(page.buffer))
            elif page.buffer is not None:
                self._entries[page.id] = ("live", page.buffer, page.version)
                live.append(page)
            elif page.dead or page.disk_slot is None:
                self._entries[page.id] = ("zeros",)
            else:
                self.disk.hold(page.kind, page.disk_slot)
                self._entries[page.id] = ("slot", page.kind, page.disk_slot, page.disk_checksum, page.name)
        manager.guard(live, self._before_change)

    def _copy(self, buffer: torch.Tensor) -> torch.Tensor:
        self.copied_bytes += self.page_bytes
        return memops.copy_(anonymous_buffer(self.page_bytes), buffer.view(torch.uint8).reshape(-1))

    def _before_change(self, page: Page) -> None:
        """(The training thread, at a guarded page's next change.) A page moving between the device and host tiers
        unpinned, or arrived there, holds the same bytes (a traded slot, or a finished copy): it is watched on in
        its slot; anything else (a pin, a write-back or drop) copies it aside first."""
        with self._lock:
            entry = self._entries.get(page.id)
            if entry is None or entry[0] != "live":
                return
            if page.pin_count == 0 and page.version == entry[2] and page.buffer is not None and page.state in _MOVED:
                self._entries[page.id] = ("live", page.buffer, entry[2])
                self.manager.guard([page], self._before_change)
            else:
                self._entries[page.id] = ("copy", self._copy(entry[1]))

    def _take_scratch(self) -> torch.Tensor:
        if self._scratch is not None:  # the writer may still hold the last one's items: the pool knows
            self._pool.give_back(self._scratch)
        self._scratch = self._pool.take()
        return self._scratch

    def get(self, page: Page) -> torch.Tensor:
        """Page `page`'s bytes at the save (valid until the next page is asked for: a page's items come together)."""
        if self._last == page.id:
            return self._served
        self._last = self._served = None  # a copy served before is dropped once the writer is done with it
        entry = self._entries[page.id]
        if entry[0] == "live":
            with self._lock:
                entry = self._entries[page.id]
                if entry[0] == "live":  # untouched since the save: its bytes are still in its slot
                    buffer = memops.copy_(self._take_scratch(), entry[1].view(torch.uint8).reshape(-1))
                    self._entries[page.id] = ("read",)
                    # only now: the copy lets the GIL go, and training may reach the page meanwhile (its guard
                    # then waits for this lock, and finds the page read)
                    self.manager.unguard([page.id])
                    return self._serve(page, buffer)
        if entry[0] == "copy":
            self._entries[page.id] = ("read",)
            return self._serve(page, entry[1])
        if entry[0] == "zeros":
            return torch.zeros(self.page_bytes, dtype=torch.uint8)
        _, kind, slot, checksum, name = entry
        buffer = self._take_scratch()
        where = self.disk.describe(kind, slot)  # the slot file, or the loaded checkpoint's files it reads
        try:
            got = self.disk.read(kind, slot, buffer).wait()
        finally:
            self.disk.release_hold(kind, slot)
            self._entries[page.id] = ("read",)
        if got != checksum:
            raise ChecksumError(name, where, checksum or 0, got)
        self.read_bytes += self.page_bytes
        return self._serve(page, buffer)

    def _serve(self, page: Page, buffer: torch.Tensor) -> torch.Tensor:
        self._last, self._served = page.id, buffer
        return buffer

    def close(self) -> None:
        """Release every page still guarded and every slot still held (a save done, or failed)."""
        with self._lock:
            for page_id, entry in list(self._entries.items()):
                if entry[0] == "slot":
                    self.disk.release_hold(entry[1], entry[2])
                elif entry[0] == "live":
                    self.manager.unguard([page_id])
                self._entries[page_id] = ("read",)
        self._scratch = self._served = None
        self._pool.clear()
