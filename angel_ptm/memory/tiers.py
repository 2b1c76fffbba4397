"""Tiers: per tier a byte budget and page-sized slots allocated once, up front.

- `BufferPool` (device and host tiers): one slab of `n_slots * page_bytes` on a torch device, cut into aligned
  page slots with a free list. Device: the compute device (`cuda` where present; on CPU a separate budgeted pool).
  Host: 4 KiB-aligned memory (O_DIRECT needs the alignment), page-locked with CUDA (exactly its bytes:
  device.pin_host_memory) when CUDA is present.
- `DiskTier`: one preallocated slot file per (rank, page kind) under a directory, slots handed out from a free list
  and the space reserved with fallocate when a file grows, all within the disk budget.

Nothing is allocated in the steady-state step: `alloc` / `free` only move slots between lists. Two pools in the
same kind of memory (the CPU "device" pool and the host pool of a run without CUDA) may `trade` slots: a page then
changes tier without a byte being copied, and each pool still holds exactly `capacity` slots.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Iterable

import psutil
import torch

from angel_ptm.errors import BudgetError, ChecksumError, PageIOError
from angel_ptm.io.slot_file import ALIGNMENT, SlotFile, aligned_empty
from angel_ptm.memory.backing import BackedReader, Source, SourceFiles
from angel_ptm.memory.device import CopyHandle, compute_fence, finish_copies, pin_host_memory
from angel_ptm.memory.page import Page, Tier


def available_bytes(device: torch.device) -> int:
    """What the machine can give a new pool on `device` right now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


class BufferPool:
    """`capacity` page-sized slots, carved from one slab; slot buffers are uint8 tensors that alias slab memory.

    A pool owns its slots by address. `trade` swaps one slot in use with a free slot of another pool in the same
    memory, so the pools' slabs may end up interleaved, but each pool always owns `capacity` slots."""

    def __init__(self, tier: Tier, page_bytes: int, budget_bytes: int, device: torch.device | str = "cpu",
                 pin: bool = False, check_available: bool = True):
        self.tier, self.page_bytes, self.budget_bytes = tier, int(page_bytes), int(budget_bytes)
        self.device = torch.device(device)
        if self.page_bytes <= 0 or self.page_bytes % ALIGNMENT:
            raise ValueError(f"page_bytes must be a positive multiple of {ALIGNMENT}, got {page_bytes}")
        self.capacity = self.budget_bytes // self.page_bytes
        slab_bytes = self.capacity * self.page_bytes
        if check_available and slab_bytes:
            available = available_bytes(self.device)
            if slab_bytes > available:
                raise BudgetError(tier.value, slab_bytes, available, what=f"a {self.device} pool of {self.capacity} pages")
        self.pinned = pin
        self._slab = aligned_empty(slab_bytes, self.device) if slab_bytes else None
        self._unpin = pin_host_memory(self, self._slab) if pin and self._slab is not None else None
        if self._slab is not None and self.device.type == "cuda":  # (a pool dropped without its manager's close)
            weakref.finalize(self, finish_copies, self.device)
        # address -> slot buffer, for every slot this pool owns; the free ones by address, slot 0 handed out first
        self._slots = {}
        for slot in range(self.capacity):
            buffer = self._slab[slot * self.page_bytes : (slot + 1) * self.page_bytes]
            self._slots[buffer.data_ptr()] = buffer
        self._free = list(reversed(self._slots))
        # address -> the fence a free slot was freed with: its next user comes after it (device.py)
        self._fences: dict[int, CopyHandle] = {}

    def owns(self, buffer: torch.Tensor) -> bool:
        return buffer.data_ptr() in self._slots

    def _check_slot(self, buffer: torch.Tensor) -> int:
        address = buffer.data_ptr()
        if address not in self._slots:
            raise ValueError(f"buffer at {address:#x} is not a slot of the {self.tier.value} pool")
        return address

    def alloc(self) -> torch.Tensor:
        """A free slot, ready for the caller's next use on this pool's device (its fence, if any, is ordered before
        the current stream's next work on CUDA, or waited for on the host)."""
        buffer, fence = self.alloc_fenced()
        if fence is not None:
            fence.order_before_use(self.device)
        return buffer

    def alloc_fenced(self) -> tuple[torch.Tensor, CopyHandle | None]:
        """A free slot and the fence its next user must come after (None: nothing may still use it), for a caller
        that orders that use itself (a copy into the slot on a copy stream)."""
        if not self._free:
            raise BudgetError(self.tier.value, self.page_bytes, 0, what="one page (all slots in use)")
        address = self._free.pop()
        return self._slots[address], self._fences.pop(address, None)

    def free(self, buffer: torch.Tensor, fence: CopyHandle | None = None) -> None:
        """Give a slot back. `fence`: what may still use it (a copy under way); without one, a GPU slot is fenced
        at the compute queued so far (what may still read it)."""
        address = self._check_slot(buffer)
        fence = fence if fence is not None else compute_fence(self.device)
        if fence is not None and fence.pending:
            self._fences[address] = fence
        self._free.append(address)

    def can_trade(self, other: "BufferPool") -> bool:
        """Slots can change pools: both in ordinary (unpinned) CPU memory of the same page size."""
        return (self.device.type == other.device.type == "cpu" and not self.pinned and not other.pinned
                and self.page_bytes == other.page_bytes)

    def trade(self, in_use: torch.Tensor, other: "BufferPool") -> None:
        """Hand `in_use` (a slot of this pool, in use) to `other`, where it stays in use, and take one free slot of
        `other` in exchange, which becomes free here: a page on this tier moves to `other`'s without a copy."""
        if not self.can_trade(other):
            raise ValueError(f"the {self.tier.value} and {other.tier.value} pools cannot trade slots "
                             f"({self.device}{' pinned' if self.pinned else ''} / "
                             f"{other.device}{' pinned' if other.pinned else ''})")
        address = self._check_slot(in_use)
        if address in self._free:
            raise ValueError(f"slot at {address:#x} of the {self.tier.value} pool is free, not in use")
        if not other._free:
            raise BudgetError(other.tier.value, self.page_bytes, 0, what="one page (all slots in use)")
        spare_address = other._free.pop()
        spare = other._slots.pop(spare_address)
        other._slots[address] = self._slots.pop(address)
        self._slots[spare_address] = spare
        self._free.append(spare_address)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.capacity - len(self._free)) * self.page_bytes


class DiskTier:
    """Preallocated slot files `rank{rank}.{kind}.slots` in `directory`, bounded by `budget_bytes`."""

    tier = Tier.DISK

    def __init__(self, directory: str, page_bytes: int, budget_bytes: int, engine, rank: int = 0,
                 growth_slots: int = 16):
        self.directory, self.page_bytes, self.budget_bytes = directory, int(page_bytes), int(budget_bytes)
        self.engine, self.rank, self.growth_slots = engine, rank, max(1, growth_slots)
        self.capacity = self.budget_bytes // self.page_bytes
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:  # the engine checked memory.disk_dir (disk_dir.py); a tier built by hand gets this
            raise PageIOError(f"cannot create the page directory {directory}: {exc.strerror}",
                              errno=exc.errno or 0, path=directory) from None
        self.files: dict[str, SlotFile] = {}
        self._free: dict[str, list[int]] = {}
        self._reserved = 0  # slots reserved on disk, all kinds
        # Slots an asynchronous checkpoint still has to read (it holds the bytes a page had when the checkpoint was
        # taken): not written and not reused until released. A page written meanwhile gets another slot; the held
        # one is freed once released (`_orphans`). Released from the checkpoint's thread, hence the lock.
        self._held: dict[tuple[str, int], int] = {}
        self._held_peak = 0  # the most slots held at once since none was (the files may grow by that many)
        self._orphans: set[tuple[str, int]] = set()
        self._released = threading.Condition()
        # Slots whose bytes lie in a loaded checkpoint's files, nothing written (backing.py), and the sources the
        # loader offered for pages not yet evicted (page id -> Source).
        self.sources = SourceFiles()
        self._reader = BackedReader(self.sources, lambda buffer: self.engine.checksum(buffer))
        self._backed: dict[tuple[str, int], Source] = {}
        self._offers: dict[int, Source] = {}

    def _file(self, kind: str) -> SlotFile:
        if kind not in self.files:
            path = os.path.join(self.directory, f"rank{self.rank}.{kind}.slots")
            self.files[kind] = SlotFile(path, self.page_bytes, self.engine)
            self._free[kind] = []
        return self.files[kind]

    def reserve(self, kind: str, n_slots: int) -> None:
        """Make sure `n_slots` slots of `kind` exist on disk (fallocate now, so no write finds the disk full)."""
        slot_file = self._file(kind)
        extra = n_slots - slot_file.n_slots
        if extra <= 0:
            return
        if self._reserved + extra > self.capacity + self._held_peak:
            raise BudgetError("disk", extra * self.page_bytes, (self.capacity - self._reserved) * self.page_bytes,
                              what=f"{extra} {kind} pages in {self.directory}")
        first_new = slot_file.n_slots
        slot_file.grow(n_slots)
        self._reserved += extra
        self._free[kind].extend(range(n_slots - 1, first_new - 1, -1))

    def alloc(self, kind: str) -> int:
        slot_file = self._file(kind)
        if not self._free[kind]:
            # While an asynchronous checkpoint holds slots, pages written meanwhile may take as many slots more:
            # the checkpoint costs disk space, never a wait (`checkpoint.async_save`: the estimate counts it).
            # Slots in use stay within the budget plus the slots held now; the files grow at most by the most
            # held at once (what the estimate counts). Beyond the budget one slot at a time: a kind's spare slots
            # there (orphans freed as the checkpoint reads them) are room another kind cannot use.
            with self._released:
                held, peak = len(self._held), self._held_peak
            in_use = self._reserved - sum(len(free) for free in self._free.values())
            if in_use >= self.capacity + held or self._reserved >= self.capacity + peak:
                raise BudgetError("disk", self.page_bytes, 0, what=f"one {kind} page in {self.directory}")
            within = self.capacity - self._reserved
            self.reserve(kind, slot_file.n_slots + (min(self.growth_slots, within) if within > 0 else 1))
        return self._free[kind].pop()

    def alloc_or_reclaim(self, kind: str, pages: Iterable[Page]) -> int:
        """A slot for `kind`; when the budget is spent, the slot of a clean copy of one of `pages` that also rests
        on the device or host (that copy only saves a future write, it holds no unique data), unless a checkpoint
        holds it; with none, once an asynchronous checkpoint releases a slot."""
        while True:
            try:
                return self.alloc(kind)
            except BudgetError:
                for other in pages:
                    if (other.kind == kind and other.disk_slot is not None and other.tier in (Tier.DEVICE, Tier.HOST)
                            and not self.held(kind, other.disk_slot)):
                        slot, other.disk_slot, other.disk_version = other.disk_slot, None, -1
                        self._unback(kind, slot)
                        return slot
                with self._released:
                    if not self._held:
                        raise
                    self._released.wait()

    # ------------------------------------------------------------------ slots held by an asynchronous checkpoint
    def hold(self, kind: str, slot: int) -> None:
        with self._released:
            self._held[(kind, slot)] = self._held.get((kind, slot), 0) + 1
            self._held_peak = max(self._held_peak, len(self._held))

    def release_hold(self, kind: str, slot: int) -> None:
        """The checkpoint has read the slot (any thread): written again, or freed if its page moved away."""
        with self._released:
            key = (kind, slot)
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
                if key in self._orphans:
                    self._orphans.discard(key)
                    self._unback_locked(kind, slot)
                    self._free[kind].append(slot)
                if not self._held:
                    self._held_peak = 0
            self._released.notify_all()

    def held(self, kind: str, slot: int) -> bool:
        return (kind, slot) in self._held

    def rehome(self, kind: str, slot: int, pages: Iterable[Page]) -> int:
        """The slot a page whose slot `slot` is held writes into: a free one (the held slot is freed once
        released), or, with none left in the budget, `slot` itself once the checkpoint has read it."""
        try:
            new = self.alloc(kind)
        except BudgetError:  # no room for another slot: this one, once the checkpoint has read it
            with self._released:
                while (kind, slot) in self._held:
                    self._released.wait()
            return slot
        with self._released:
            if (kind, slot) in self._held:
                self._orphans.add((kind, slot))
            else:  # released meanwhile
                self._unback_locked(kind, slot)
                self._free[kind].append(slot)
        return new

    def free(self, kind: str, slot: int) -> None:
        self._unback(kind, slot)
        self._free[kind].append(slot)

    def write(self, kind: str, slot: int, buffer: torch.Tensor):
        self._unback(kind, slot)
        return self.files[kind].write(slot, buffer)

    def read(self, kind: str, slot: int, buffer: torch.Tensor):
        with self._released:
            source = self._backed.get((kind, slot))
        if source is not None:
            return self._reader.submit(source, buffer)
        return self.files[kind].read(slot, buffer)

    def check_read(self, page: Page, handle) -> None:
        """Wait for a read of `page`'s slot: its bytes must have the checksum recorded when they were written."""
        checksum = handle.wait()
        if checksum != page.disk_checksum:
            raise ChecksumError(page.name, self.describe(page.kind, page.disk_slot), page.disk_checksum or 0,
                                checksum)

    # ------------------------------------------------------------------ slots backed by a loaded checkpoint
    def offer(self, page: Page, source: Source) -> None:
        """`page` (at `source.version`) holds exactly `source`'s bytes: when it leaves the host unchanged, its slot
        may point at them instead of being written (`adopt`)."""
        self.sources.ref(source.paths)
        old = self._offers.pop(page.id, None)
        if old is not None:
            self.sources.unref(old.paths)
        self._offers[page.id] = source

    def adopt(self, page: Page) -> bool:
        """Make `page.disk_slot` (free to write, the page's version unchanged since its offer) its clean disk copy
        by pointing it at the offered source; False (and the offer dropped) when there is none or it is stale."""
        source = self._offers.pop(page.id, None)
        if source is None:
            return False
        if source.version != page.version:
            self.sources.unref(source.paths)
            return False
        with self._released:
            self._unback_locked(page.kind, page.disk_slot)
            self._backed[(page.kind, page.disk_slot)] = source  # the offer's file references pass to the slot
        page.disk_checksum, page.disk_version = source.checksum, page.version
        return True

    def backing(self, kind: str, slot: int | None) -> Source | None:
        """The checkpoint bytes slot `slot` reads, or None when it reads its own file."""
        return self._backed.get((kind, slot))

    @property
    def backed_slots(self) -> int:
        return len(self._backed)

    def settle(self, pages, keep=None) -> int:
        """Forget backed slots that no page in `pages` reads any more (its page moved on: the slot is rewritten
        before it is read again). With `keep` (directories), the bytes of every backed slot still read whose files
        lie outside them are copied into the slot itself, and such offers dropped: no page then needs a checkpoint
        file outside `keep` (one about to be pruned). Returns how many slots were written."""
        readers = {(p.kind, p.disk_slot) for p in pages
                   if p.disk_slot is not None and not p.dead and p.disk_version == p.version}
        with self._released:
            todo = [key for key in self._backed if key not in self._held]
        prefixes = None if keep is None else tuple(os.path.join(os.path.abspath(k), "") for k in keep)

        def outside(source: Source) -> bool:
            return prefixes is not None and any(not path.startswith(prefixes) for path in source.paths)

        for page_id in [i for i, source in self._offers.items() if outside(source)]:
            self.sources.unref(self._offers.pop(page_id).paths)
        scratch, written = None, 0
        for kind, slot in todo:
            source = self._backed[(kind, slot)]
            if (kind, slot) not in readers:
                self._unback(kind, slot)
            elif outside(source):
                scratch = aligned_empty(self.page_bytes) if scratch is None else scratch
                checksum = self._reader.submit(source, scratch).wait()
                if checksum != source.checksum:
                    raise ChecksumError(f"{kind} slot {slot}", self.describe(kind, slot), source.checksum, checksum)
                self.write(kind, slot, scratch).wait()
                written += 1
        return written

    def describe(self, kind: str, slot: int | None) -> str:
        """Where slot `slot`'s bytes are read from: the slot file, or the checkpoint files backing it."""
        source = self._backed.get((kind, slot))
        return ", ".join(sorted(source.paths)) if source is not None else self.path(kind)

    def _unback(self, kind: str, slot: int) -> None:
        with self._released:
            self._unback_locked(kind, slot)

    def _unback_locked(self, kind: str, slot: int) -> None:
        source = self._backed.pop((kind, slot), None)
        if source is not None:
            self.sources.unref(source.paths)
            if not self._backed:
                self._reader.release_staging()

    def path(self, kind: str) -> str:
        return self._file(kind).path

    @property
    def reserved_bytes(self) -> int:
        return self._reserved * self.page_bytes

    @property
    def used_bytes(self) -> int:
        free = sum(len(v) for v in self._free.values())
        return (self._reserved - free) * self.page_bytes

    def close(self, remove: bool = False) -> None:
        self._reader.close()
        self._offers.clear()
        self._backed.clear()
        self.sources.close()
        for slot_file in self.files.values():
            slot_file.close(remove=remove)
