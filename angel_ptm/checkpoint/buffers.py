"""A save's page-sized scratch buffers: anonymous mappings of their own (never the allocator's heap), reused once
the writer is done with the items that view them, and capped (BufferPool)."""

from __future__ import annotations

import mmap
import time

import torch


def anonymous_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor over memory of its own (an anonymous mapping), returned to the system as
    soon as the last tensor viewing it is gone: a save's transient buffers never stay in the allocator's heap (a
    page-sized buffer from it raises glibc's mmap threshold, and the freed pages then stay resident)."""
    area = mmap.mmap(-1, nbytes)
    return torch.frombuffer(area, dtype=torch.uint8)


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
