"""Activation pages (activations.offload: host | disk): saved tensors held in pages the scheduler moves.

    pages = ActivationPages(scheduler, device, page_bytes, min_bytes, write_behind)
    packed = pages.pack(tensor)      # forward (autograd's pack hook): the bytes copied into pages, or None
    tensor = pages.unpack(packed)    # backward: a copy brought back from the pages (the pages may go at once)

A saved tensor of at least `min_bytes` on the compute device is copied, in the order of its storage (so it comes
back with the same strides), into the page being filled: one that fits in a page never straddles two, a larger one
fills the rest of the page being filled and as many more as it needs. It comes back as a copy, never a view of its pages: a
checkpointed unit's inputs come back for its recomputation, whose own saved tensors may view them long after.
Pages are `activation` pages of the PageManager like any other: written on the device tier, evicted to the host
(and disk) when the device pool needs room, brought back when backward reads them -- by the planned scheduler
ahead of time, since forward's writes and backward's reads are recorded in the step's trace like any access. A page
whose tensors have all been read (or dropped by autograd) is discarded: dead, never written back or read again.

Pages are reused lowest first and filled in the same order every step, so a page's id is the same in every step
and the plan made from one step's trace holds for the next. With `write_behind` (offload: disk), every filled page
is sent on to disk at once, so the host holds only pages being filled or brought back.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from torch.multiprocessing.reductions import StorageWeakRef

from angel_ptm.errors import ActivationError, BudgetError
from angel_ptm.memory import Page, Tier
from angel_ptm.saved_tensors import modified_in_place

KIND = "activation"
_ALIGN = 64  # bytes: a tensor starts at a multiple of it within its page (vectorized kernels, every dtype)


class _Region:
    """The bytes of one saved storage view in pages: `pages` (indices) filled in order from byte `offset` of the
    first, `nbytes` in all; `readers`: saved tensors packed to it not yet read (autograd saves one tensor more than
    once: a layer's input for each of its projections)."""

    __slots__ = ("pages", "offset", "nbytes", "readers", "storage")

    def __init__(self, pages: list[int], offset: int, nbytes: int, storage: StorageWeakRef):
        self.pages, self.offset, self.nbytes, self.readers, self.storage = pages, offset, nbytes, 1, storage


class PackedActivation:
    """A saved tensor in activation pages: its region and how to view it again."""

    __slots__ = ("owner", "region", "size", "stride", "dtype", "original", "version", "__weakref__")

    def __init__(self, owner: "ActivationPages", region: _Region, tensor: torch.Tensor):
        self.owner, self.region = owner, region
        self.size, self.stride, self.dtype = tuple(tensor.size()), tuple(tensor.stride()), tensor.dtype
        # the tensor saved, while something else keeps it (a model's input): written in place since, it is refused
        self.original, self.version = weakref.ref(tensor), tensor._version

    @property
    def pages(self) -> list[int]:
        return self.region.pages

    @property
    def nbytes(self) -> int:
        return self.region.nbytes

    def __del__(self):  # autograd dropped it unread: its pages may go once nothing else is in them
        owner = self.owner
        if owner is not None:
            owner._dropped.append(self.region)


def _span(tensor: torch.Tensor) -> int:
    """Elements between the first and the last one the tensor reaches in its storage (strides are >= 0)."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.size(), tensor.stride()))


def reaches_far(tensor: torch.Tensor) -> bool:
    """A view reaching over far more of its storage than itself (one of q/k/v split from a fused projection):
    autograd keeps it where it is, unpaged (the estimate's trace asks the same)."""
    return _span(tensor) > 2 * tensor.numel()


class ActivationPages:
    def __init__(self, scheduler, device: torch.device, page_bytes: int, min_bytes: int, write_behind: bool):
        self.scheduler, self.device, self.page_bytes = scheduler, device, page_bytes
        self.min_bytes, self.write_behind = max(1, int(min_bytes)), write_behind
        self.pages: list[Page] = []  # every activation page made so far; index = position in this list
        self._live: list[int] = []  # per page: saved tensors in it not yet read or dropped
        self._free: set[int] = set()  # pages holding nothing (dead), reused lowest first
        self._emptied: set[int] = set()  # pages whose tensors are all read or dropped, still pinned or filling
        self._dropped: list[_Region] = []  # regions of saved tensors autograd dropped unread (__del__)
        self._regions: dict[tuple, _Region] = {}  # (storage address, offset, span, version) -> its region
        self.live_bytes = 0  # bytes of saved tensors in pages now
        self.peak_bytes = 0  # the most there ever were at once (what the estimate's `paged` models)
        self.peak_pages = 0  # the most pages holding saved tensors at once
        self._open: int | None = None  # the page being filled (pinned on the device)
        self._cursor = 0  # next free byte in it
        self._behind: list[Page] = []  # filled pages on their way to disk (write_behind)
        scheduler.manager.clearers[KIND] = lambda _index, _buffer: None  # every byte read was written first

    # ------------------------------------------------------------------ forward
    def pack(self, tensor: torch.Tensor) -> PackedActivation | None:
        """Copy `tensor` into pages; None if it stays with autograd (small, elsewhere, or sparse gaps)."""
        if tensor.device != self.device or tensor.layout is not torch.strided:
            return None
        span = _span(tensor) * tensor.element_size()
        if span < self.min_bytes or reaches_far(tensor):
            return None  # small, or a view reaching over far more than itself: autograd keeps it
        self._settle()
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.storage_offset(), span, tensor._version)
        region = self._regions.get(key)
        if region is not None and region.readers and not region.storage.expired():  # the same bytes again
            region.readers += 1
            for index in region.pages:
                self._live[index] += 1
            return PackedActivation(self, region, tensor)
        source = tensor.detach().as_strided((span // tensor.element_size(),), (1,), tensor.storage_offset())
        source = source.view(torch.uint8)
        page_bytes = self.page_bytes
        cursor = -(-self._cursor // _ALIGN) * _ALIGN if self._open is not None else page_bytes
        if span <= page_bytes and cursor + span > page_bytes:
            cursor = page_bytes  # one that fits a page never straddles two
        indices, offset, written = [], None, 0
        while written < span:  # a larger one fills the rest of this page, then as many as it needs
            if cursor >= page_bytes:
                self._open_page()
                cursor = 0
            offset = cursor if offset is None else offset
            part = min(page_bytes - cursor, span - written)
            self.pages[self._open].view(torch.uint8)[cursor : cursor + part].copy_(source[written : written + part])
            self._live[self._open] += 1
            indices.append(self._open)
            written += part
            cursor += part
        self._cursor = cursor
        self.live_bytes += span
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        region = self._regions[key] = _Region(indices, offset, span, StorageWeakRef(storage))
        return PackedActivation(self, region, tensor)

    def _open_page(self) -> int:
        """Start filling the lowest free page (a new one if none is free), pinned on the device."""
        self._close_page()
        if self._free:
            index = min(self._free)
            self._free.remove(index)
        else:
            index = len(self.pages)
            with self._room():
                page = self.scheduler.manager.create_page(KIND, torch.uint8, index=index, tier=Tier.HOST,
                                                          untouched=True)
            self.pages.append(page)
            self._live.append(0)
        self.scheduler.acquire([self.pages[index]], Tier.DEVICE, label=f"act:save:{index}")
        self._open, self._cursor = index, 0
        self.peak_pages = max(self.peak_pages, self.pages_in_use)
        return index

    def _close_page(self) -> None:
        """The page being filled is full (or forward ended): unpinned, written; with write-behind sent to disk."""
        if self._open is None:
            return
        page = self.pages[self._open]
        self._open = None
        self.scheduler.release([page], dirty=True)
        if self.write_behind and self._live[page.index]:
            self._behind.append(page)
        self._settle()
        self._push_behind()

    @contextmanager
    def _room(self):
        """A tier out of room for activation pages: a BudgetError that says whose room ran out."""
        try:
            yield
        except BudgetError as exc:
            raise BudgetError(exc.tier, exc.requested, exc.available,
                              what=f"activation pages ({len(self.pages)} made, {len(self.pages) * self.page_bytes} "
                                   f"bytes): the room the estimate made for them is spent (sized from initialize's "
                                   f"example_inputs where the model is not angel_ptm's GPT; raise "
                                   f"memory.{exc.tier}_budget otherwise)") from exc

    def end_forward(self) -> None:
        self._close_page()

    def _push_behind(self) -> None:
        """Start the next hop toward disk of every filled page waiting for it (device -> host -> disk)."""
        waiting = []
        for page in self._behind:
            if page.dead or (page.tier is Tier.DISK and not self.scheduler.manager.moving(page)):
                continue  # read back and discarded already, or there
            if not page.pin_count:
                with self._room():
                    self.scheduler.write_behind(page)
            waiting.append(page)
        self._behind = waiting

    # ------------------------------------------------------------------ backward
    def unpack(self, packed: PackedActivation) -> torch.Tensor:
        """The saved tensor back on the device, a new tensor with its strides. A saved tensor is read once: its
        pages are discarded once all theirs are read (or dropped)."""
        if packed.owner is None:
            raise ActivationError(
                f"a saved tensor of {packed.nbytes} bytes in activation page {packed.pages[0]} was read a second time "
                f"(retain_graph, or a second backward through the same graph): not supported with activations.offload")
        original = packed.original()
        if original is not None and original._version != packed.version:
            raise modified_in_place(packed.version, original)
        self._push_behind()
        out = torch.empty_strided(packed.size, packed.stride, dtype=packed.dtype, device=self.device)
        flat = out.as_strided((packed.nbytes // out.element_size(),), (1,)).view(torch.uint8)
        start = 0
        for i, index in enumerate(packed.pages):  # one page at a time: a large tensor pins one page, not all
            page = self.pages[index]
            self.scheduler.acquire([page], Tier.DEVICE, label=f"act:load:{index}")
            try:  # from `offset` in the first page, then from the start of each
                base = packed.region.offset if i == 0 else 0
                size = min(self.page_bytes - base, packed.nbytes - start)
                flat[start : start + size].copy_(page.view(torch.uint8)[base : base + size])
                start += size
            finally:
                self.scheduler.release([page])
        packed.owner = None  # consumed now, not when autograd drops it
        self._consumed(packed.region)
        self._settle()
        return out

    def end_backward(self) -> None:
        self._regions = {key: r for key, r in self._regions.items() if r.readers}
        self._settle()
        self._push_behind()

    def _consumed(self, region: _Region) -> None:
        region.readers -= 1
        if region.readers == 0:
            self.live_bytes -= region.nbytes
        for index in region.pages:
            self._live[index] -= 1
            if self._live[index] == 0:
                self._emptied.add(index)

    def _settle(self) -> None:
        """Pages all of whose tensors are read or dropped are discarded, once nothing pins them."""
        if self._dropped:
            dropped, self._dropped = self._dropped, []
            for region in dropped:
                self._consumed(region)
        for index in sorted(self._emptied):
            page = self.pages[index]
            if index == self._open or page.pin_count:
                continue
            self._emptied.discard(index)
            self.scheduler.discard([page])
            self._free.add(index)

    # ------------------------------------------------------------------ accounting
    @property
    def pages_in_use(self) -> int:
        """Activation pages holding saved tensors now."""
        return len(self.pages) - len(self._free)
