"""PageManager: the only code that changes a page's state.

It owns the three tiers, the policy that picks eviction victims and the moves in flight. Pages move one tier at a
time (device <-> host <-> disk); a page whose clean copy is already on disk is dropped instead of written back.
Moves are asynchronous (`prefetch` returns a handle); `acquire` pins pages on a tier and waits for them, and
`release` unpins them. With `zero_copy` and both pools in ordinary CPU memory (a run without CUDA), a page crosses
between the device and host tiers by trading slots between the pools: no bytes are copied, the budgets hold.
Every state change is an edge of `page.TRANSITIONS`; a failed move puts the page back where it was, untouched.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterable, Sequence

import torch

from angel_ptm.errors import BudgetError, ChecksumError, PageIOError, PageStateError
from angel_ptm.memory import memops
from angel_ptm.memory.accounting import MoveAccounting
from angel_ptm.memory.device import NO_WAIT, Copier, CopyHandle
from angel_ptm.memory.guards import PageGuards
from angel_ptm.memory.hops import NonBlockingMoves
from angel_ptm.memory.moves import Move, Prefetch
from angel_ptm.memory.page import RESTING_STATE, Page, PageState, Tier
from angel_ptm.memory.policy import LRUPolicy, Policy, RestingSet
from angel_ptm.memory.remote import RemotePages
from angel_ptm.memory.tiers import BufferPool, DiskTier
from angel_ptm.trace.recorder import TraceRecorder

_TRADED = CopyHandle()  # a traded slot: nothing to wait for


class PageManager(RemotePages, NonBlockingMoves, PageGuards, MoveAccounting):
    def __init__(self, device_pool: BufferPool, host_pool: BufferPool, disk: DiskTier | None = None,
                 policy: Policy | None = None, trace: TraceRecorder | None = None, async_copies: bool = False,
                 zero_copy: bool = False):
        if device_pool.page_bytes != host_pool.page_bytes or (disk and disk.page_bytes != host_pool.page_bytes):
            raise ValueError("all tiers must use the same page_bytes")
        self.page_bytes = host_pool.page_bytes
        self.pools = {Tier.DEVICE: device_pool, Tier.HOST: host_pool}
        self.disk = disk
        self.policy = policy or LRUPolicy()
        self.trace = trace or TraceRecorder(None)
        self.zero_copy = zero_copy and device_pool.can_trade(host_pool)
        self.copier = Copier(device_pool.device, asynchronous=async_copies and not self.zero_copy)
        self.pages: list[Page] = []
        # Each tier's eviction candidates (resting there, unpinned), kept by the pages' watchers; `_indexed`: watched.
        self._resting: dict[Tier, RestingSet] = {tier: RestingSet() for tier in RESTING_STATE}
        self._rest_of: dict[int, Tier | None] = {}
        self._indexed = 0
        self._moves: dict[int, Move] = {}
        self._leaving: Counter = Counter()  # tier -> moves in flight out of it whose source slot is still held
        self._pinned: set[int] = set()  # ids of pages with pin_count > 0
        self._guards: dict[int, Callable[[Page], None]] = {}  # page id -> told of its next change (guards.py)
        self._quiet: int | None = None  # a page whose pin count changes with no byte changed: its guard not told
        # kind -> clear(index, buffer): what a dead page of that kind needs before reuse (default: all zero). Its
        # owner may know that most of the page is overwritten before it is read, and clear only the rest.
        self.clearers: dict[str, Callable[[int, torch.Tensor], None]] = {}
        self.bytes_moved: Counter = Counter()  # "src->dst" -> bytes, cumulative
        self.watched: frozenset[int] = frozenset()  # page ids whose moves are also counted apart (MoE experts)
        self.watched_moved: Counter = Counter()  # "src->dst" -> bytes of the watched pages, cumulative
        # Wasted prefetches of watched pages: bytes a page was brought up (toward the device) while nothing held it,
        # counted once it goes back down (moved or dropped) without an access in between, cumulative
        self.watched_wasted = 0
        self._fetched_unused: dict[int, int] = {}  # watched page id -> bytes brought up since its last access

    # ------------------------------------------------------------------ pages
    def create_page(self, kind: str, dtype: torch.dtype, index: int | None = None, tier: Tier = Tier.HOST,
                    untouched: bool = False) -> Page:
        """A new page of zeros on `tier`: on the device or host a zeroed slot (evicting others if the tier is full);
        on disk a dead page in a slot of its own, nothing written (its first use gets a cleared slot, as after
        `discard`). `untouched=True` promises writes only through `acquire`: until then it leaves as a dead page."""
        index = len(self.pages) if index is None else index
        if tier is Tier.DISK and self.disk is None:
            raise BudgetError("disk", self.page_bytes, 0, what=f"creating page {kind}:{index} (no disk tier)")
        page = Page(id=len(self.pages), kind=kind, index=index, dtype=dtype, nbytes=self.page_bytes,
                    state=RESTING_STATE[tier], dead=tier is Tier.DISK, untouched=untouched and tier is not Tier.DISK)
        page.pin_count = 1  # not an eviction candidate while its buffer is being found
        self.pages.append(page)
        try:
            if tier is Tier.DISK:
                page.disk_slot = self.disk.alloc_or_reclaim(kind, self.pages)
            else:
                page.buffer = self._alloc(tier)
                memops.zero_(page.buffer)
        except Exception:
            self.pages.pop()
            self._indexed = min(self._indexed, len(self.pages))
            raise
        page.pin_count = 0
        self._emit("alloc", page, None, tier)
        return page

    # ------------------------------------------------------------------ public moves
    def acquire(self, pages: Sequence[Page], tier: Tier = Tier.DEVICE, read_only: bool = False) -> bool:
        """Pin `pages` on `tier` and wait until they are all there. Pair every acquire with a release. Whether it
        had to wait (a page was not there yet). The training step's accesses come through the scheduler
        (schedule/executor.py: Scheduler.acquire), which records them and issues the moves planned after them.
        `read_only`: the caller only reads the pages (and releases them clean), so no `guard` is told of the pin."""
        self._check_fits(pages, tier)
        waited, quiet = False, read_only and bool(self._guards)
        for page in pages:
            if page.pin_count == 0:
                self._pinned.add(page.id)
            if quiet:
                self._quiet = page.id
            page.pin_count += 1
            self._quiet = None
            page.untouched = False
            self.policy.on_access(page.id)
            self._fetched_unused.pop(page.id, None)  # (a watched page's prefetch served)
            if not waited and not self._is_at(page, tier):
                waited = True
        try:
            if waited:
                self._bring(pages, tier)
        except Exception:
            for page in pages:
                page.pin_count -= 1
                if page.pin_count == 0:
                    self._pinned.discard(page.id)
            raise
        return waited

    @staticmethod
    def _is_at(page: Page, tier: Tier) -> bool:
        """The page rests on `tier` or above it (a host access is served by a device copy, as `_bring` does)."""
        state = page.state
        return state is PageState.DEVICE or (tier is Tier.HOST and state is PageState.HOST)

    def release(self, pages: Iterable[Page], dirty: bool = False) -> None:
        """Unpin `pages`; `dirty=True` says their data changed, so a disk copy is stale."""
        quiet = bool(self._guards)  # an unpin changes no byte (a write came after a pin its guard was told of)
        for page in pages:
            if page.pin_count <= 0:
                raise ValueError(f"page {page.name} released more often than acquired")
            if quiet:
                self._quiet = page.id
            page.pin_count -= 1
            self._quiet = None
            if page.pin_count == 0:
                self._pinned.discard(page.id)
            if dirty:
                page.mark_dirty()

    def prefetch(self, pages: Sequence[Page], tier: Tier = Tier.DEVICE) -> Prefetch:
        """Start moving `pages` toward `tier` without waiting (disk reads are issued now)."""
        pages = list(pages)
        with self.batched_io():
            for page in pages:
                if (page.state is PageState.DISK and not page.dead and tier is not Tier.DISK
                        and self.pools[Tier.HOST].free_slots):
                    self._start_up(page)
        return Prefetch(self, pages, tier)

    def move(self, page: Page, tier: Tier) -> None:
        """Move one unpinned page to `tier` (up or down, one tier at a time) and wait."""
        if page.pin_count:
            raise ValueError(f"page {page.name} is pinned ({page.pin_count}); release it before moving it")
        if tier is Tier.DISK or (tier is Tier.HOST and page.tier is Tier.DEVICE):
            self._wait_move(page)
            while page.tier is not tier:
                self._start_down(page, wait_for_room=True, target=tier)
                self._wait_move(page)
        else:
            self._bring([page], tier)

    def evict(self, pages: Sequence[Page], tier: Tier = Tier.DISK) -> None:
        """Move unpinned `pages` down to `tier`, all transfers of one hop in flight together, and wait."""
        pages = list(pages)
        for page in pages:
            if page.pin_count:
                raise ValueError(f"page {page.name} is pinned ({page.pin_count}); release it before evicting it")
        order = [Tier.DEVICE, Tier.HOST, Tier.DISK]
        self.flush(pages)
        for hop_from in order[: order.index(tier)]:
            movers = [p for p in pages if p.tier is hop_from]
            with self.batched_io():
                for page in movers:
                    self._start_down(page, wait_for_room=True, target=tier)
            for page in movers:
                self._wait_move(page)

    @property
    def pinned_ids(self) -> set[int]:
        """Ids of the pages pinned now (read-only view for the scheduler's trace)."""
        return self._pinned

    def batched_io(self):
        """A block whose disk transfers start together at its end (the executor's pump issues several): the I/O
        workers then merge those into adjacent slots (io/engine.py: hold_wakeups)."""
        return self.disk.engine.hold_wakeups() if self.disk is not None else contextlib.nullcontext()

    def moving(self, page: Page) -> bool:
        """The page is on its way between tiers and the transfer has not finished yet."""
        move = self._moves.get(page.id)
        return move is not None and not move.done()

    @property
    def moves_in_flight(self) -> int:
        return len(self._moves)

    def flush(self, pages: Iterable[Page] | None = None) -> None:
        """Settle every move in flight for `pages` (all pages by default)."""
        for page in list(self.pages if pages is None else pages):
            self._wait_move(page)

    # ------------------------------------------------------------------ internals: bringing pages up
    def _check_fits(self, pages: Sequence[Page], tier: Tier) -> None:
        if tier not in self.pools:
            raise ValueError(f"pages are acquired on the device or host tier, not {tier.value}")
        capacity = self.pools[tier].capacity
        if len(pages) + len(self._pinned) <= capacity:
            return
        pages = [p for p in pages if not (tier is Tier.HOST and p.state is PageState.DEVICE)]
        wanted = {p.id for p in pages}  # (a host access to a page on the device is served there: no host slot)
        pinned_elsewhere = sum(1 for i in self._pinned if self.pages[i].tier is tier and i not in wanted)
        if len(pages) + pinned_elsewhere > capacity:
            raise BudgetError(tier.value, len(pages) * self.page_bytes,
                              (capacity - pinned_elsewhere) * self.page_bytes,
                              what=f"{len(pages)} pages pinned at once")

    def _bring(self, pages: Sequence[Page], tier: Tier) -> None:
        """Bring every page up to `tier`: disk reads overlap each other, host slots are recycled as we go."""
        reads: list[Page] = []
        with self.batched_io():  # the reads start together: pages in adjacent slots are read as one
            for page in pages:
                if page.state is PageState.REMOTE:
                    raise PageStateError(f"page {page.name} lives on rank {page.home}: its page group must be "
                                         f"gathered before it is acquired")
                if page.state in (PageState.TO_DISK, PageState.TO_HOST, PageState.TO_DEVICE):
                    self._wait_move(page)  # land the move under way (an eviction, or a prefetch to the device)
                if page.dead and page.state is PageState.DISK and tier is not Tier.DISK:
                    self._materialize(page, tier)
                    continue
                if page.state in (PageState.DISK, PageState.FROM_DISK) and tier is not Tier.DISK:
                    if page.state is PageState.DISK:
                        # Bound to the device, every read staged on the host must leave a host slot for the device
                        # page it will displace: finish staged reads before the host fills with pinned pages.
                        spare = 1 if tier is Tier.DEVICE and reads else 0
                        while not self._host_room_for_read(spare):
                            if not reads:
                                raise BudgetError("host", self.page_bytes, 0,
                                                  what=f"staging page {page.name} (every host page is pinned)")
                            self._finish_up(reads.pop(0), tier)
                        self._start_up(page)
                    reads.append(page)
        for page in reads:
            self._finish_up(page, tier)
        if tier is Tier.DEVICE:
            for page in pages:
                self._wait_move(page)
                if page.state is PageState.HOST:
                    self._start_up(page)
                self._wait_move(page)

    def _host_room_for_read(self, spare: int = 0) -> bool:
        """More than `spare` host slots are free, can be freed by an eviction, or will be once a move in flight
        lands."""
        self._watch_new()
        room = self.pools[Tier.HOST].free_slots + len(self._resting[Tier.HOST])
        room += sum(1 for m in self._moves.values()
                    if m.src is Tier.HOST or (m.dst is Tier.HOST and m.page.pin_count == 0))
        return room > spare

    def _finish_up(self, page: Page, tier: Tier) -> None:
        self._wait_move(page)
        if tier is Tier.DEVICE and page.state is PageState.HOST:
            self._start_up(page)
            self._wait_move(page)

    def _materialize(self, page: Page, tier: Tier) -> None:
        """A dead page's new working copy: a zeroed slot on `tier`, nothing read (its old contents are dead)."""
        buffer = self._alloc(tier)
        clear = self.clearers.get(page.kind)
        clear(page.index, buffer) if clear is not None else memops.zero_(buffer)
        page.transition(PageState.FROM_DISK)
        page.transition(PageState.HOST)
        if tier is Tier.DEVICE:
            page.transition(PageState.TO_DEVICE)
            page.transition(PageState.DEVICE)
        page.buffer, page.dead = buffer, False
        page.mark_dirty()  # any disk copy is stale now
        self._emit("alloc", page, None, tier)

    def discard(self, pages: Iterable[Page]) -> None:
        """The contents of `pages` are no longer needed (a gradient already applied): free their slots now, and
        never write them back or read them again; the next acquire gets a zeroed page."""
        pages = list(pages)
        for page in pages:
            if page.pin_count:
                raise ValueError(f"page {page.name} is pinned ({page.pin_count}); release it before discarding it")
            self._wait_move(page)
            page.dead = True
            if page.state not in (PageState.DISK, PageState.REMOTE):
                self._drop(page, page.tier)

    def _start_up(self, page: Page) -> None:
        """Issue one upward move: disk -> host (read) or host -> device (copy)."""
        if page.state is PageState.DISK:
            buffer = self._alloc(Tier.HOST)
            page.transition(PageState.FROM_DISK)
            handle = self.disk.read(page.kind, page.disk_slot, buffer)
            self._begin(Move(page, Tier.DISK, Tier.HOST, handle, buffer, self._finish_read))
        elif page.state is PageState.HOST:
            page.pin_count += 1  # an unpinned page must not be the victim that makes room for itself
            try:
                self._make_room(Tier.DEVICE)
            finally:
                page.pin_count -= 1
            buffer, fence = self.pools[Tier.DEVICE].alloc_fenced()  # the copy into it orders itself after the fence
            self._cross(page, Tier.DEVICE, buffer, wait=page.pin_count > 0, after=fence or NO_WAIT)

    # ------------------------------------------------------------------ internals: evicting pages down
    def _start_down(self, page: Page, wait_for_room: bool, target: Tier | None = None) -> None:
        """Issue one downward move: drop (clean on disk), device -> host (copy) or host -> disk (write)."""
        src = page.tier
        if page.home is not None:  # a gathered copy of another rank's page: dropped, its home keeps the page
            self.pools[src].free(page.buffer)
            page.buffer = None
            page.transition(PageState.REMOTE)
            self._emit("drop", page, src, "remote")
            return
        # A clean page leaving the device is dropped, unless the host has a free slot: keeping it there costs a
        # copy and may save a disk read later (so is an untouched one). A dead page is always dropped. (`target`:
        # where the caller wants the page; an explicit move to disk drops a clean page at once.)
        keep_on_host = src is Tier.DEVICE and target is not Tier.DISK and self.pools[Tier.HOST].free_slots > 0
        if page.dead or ((page.clean_on_disk or page.untouched) and not keep_on_host):
            if page.untouched:  # zeros nobody has used: left dead, in a home slot of its own as if written there
                page.untouched, page.dead = False, True
                if page.disk_slot is None and self.disk is not None:
                    page.disk_slot = self.disk.alloc_or_reclaim(page.kind, self.pages)
            self._drop(page, src)
        elif src is Tier.DEVICE:
            buffer = self._alloc(Tier.HOST) if wait_for_room else self.pools[Tier.HOST].alloc()
            self._cross(page, Tier.HOST, buffer, wait=wait_for_room)
        elif src is Tier.HOST:
            if self.disk is None:
                raise BudgetError("disk", self.page_bytes, 0, what=f"evicting page {page.name} (no disk tier)")
            if page.disk_slot is None:
                page.disk_slot = self.disk.alloc_or_reclaim(page.kind, self.pages)
            elif self.disk.held(page.kind, page.disk_slot):  # an asynchronous checkpoint still reads the old bytes
                page.disk_slot, page.disk_version = self.disk.rehome(page.kind, page.disk_slot, self.pages), -1
            if self.disk.adopt(page):  # as loaded from a checkpoint: the slot reads the checkpoint's bytes
                self._drop(page, src)
                return
            page.transition(PageState.TO_DISK)
            handle = self.disk.write(page.kind, page.disk_slot, page.buffer)
            self._begin(Move(page, Tier.HOST, Tier.DISK, handle, None, self._finish_write))
        else:
            raise ValueError(f"page {page.name} in state {page.state.name} cannot move down")

    def _drop(self, page: Page, src: Tier) -> None:
        if self._fetched_unused:
            self.watched_wasted += self._fetched_unused.pop(page.id, 0)
        self.pools[src].free(page.buffer)
        page.buffer = None
        page.transition(PageState.DISK)
        self._emit("drop", page, src, Tier.DISK)

    def _candidates(self, tier: Tier) -> RestingSet:
        """The pages resting on `tier`, unpinned: the live set (never changed by the caller), so that a policy's
        victim index reads only what joined it since its last choice."""
        self._watch_new()
        return self._resting[tier]

    def _watch_new(self) -> None:
        if self._indexed < len(self.pages):  # pages made since (here, or remote ones): watched from now on
            for page in self.pages[self._indexed:]:
                page.watcher = self._reindex
                self._reindex(page)
            self._indexed = len(self.pages)

    def _reindex(self, page: Page) -> None:
        """`page` changed state or pins: in its tier's candidates exactly while it rests there unpinned."""
        if self._guards:
            self._tell_guard(page)
        tier = page.state.tier if page.pin_count == 0 else None  # (no tier while it moves, or is remote)
        old = self._rest_of.get(page.id)
        if old is not tier:
            if old is not None:
                self._resting[old].discard(page.id)
            if tier is not None:
                self._resting[tier].add(page.id)
            self._rest_of[page.id] = tier

    def _alloc(self, tier: Tier) -> torch.Tensor:
        """A free slot on `tier`, ready for use (its fence ordered before the next work: tiers.BufferPool.alloc)."""
        self._make_room(tier)
        return self.pools[tier].alloc()

    def _make_room(self, tier: Tier) -> None:
        """A free slot on `tier`: a victim chosen by the policy is evicted if there is none."""
        pool = self.pools[tier]
        while pool.free_slots == 0:
            if self._leaving[tier]:  # a slot is about to be freed by a move already under way
                self._wait_move(next(m for m in self._moves.values() if m.src is tier and not m.src_freed).page)
                continue
            candidates = self._candidates(tier)
            if not candidates:
                arriving = [m for m in self._moves.values() if m.dst is tier and m.page.pin_count == 0]
                if arriving:  # a prefetched page still landing: once there it can be evicted
                    self._wait_move(arriving[0].page)
                    continue
                raise BudgetError(tier.value, self.page_bytes, 0,
                                  what=f"one page ({pool.capacity} slots, all pinned or in flight)")
            victim = self.pages[self.policy.victim(candidates, tier)]
            # No disk tier: a host victim goes up to a free device slot (a ZeRO-1/2 reduced gradient landing on the
            # host beside the resting moments)
            up = tier is Tier.HOST and self.disk is None and self.pools[Tier.DEVICE].free_slots > 0
            self._emit("evict", victim, tier, Tier.DEVICE if up else Tier.HOST if tier is Tier.DEVICE else Tier.DISK)
            self._start_up(victim) if up else self._start_down(victim, wait_for_room=True)
            if pool.free_slots == 0:  # (a drop, or a copy that gave its slot back when queued, freed one already)
                self._wait_move(victim)

    # ------------------------------------------------------------------ internals: completing moves
    def _begin(self, move: Move) -> None:
        move.started = self.trace.now() if self.trace.enabled else 0.0
        self._moves[move.page.id] = move
        self._leaving[move.src] += not move.src_freed
        self._emit("move", move.page, move.src, move.dst)

    def _wait_move(self, page: Page) -> None:
        move = self._moves.pop(page.id, None)
        if move is not None:
            self._leaving[move.src] -= not move.src_freed
            move.finish(move)

    def _cross(self, page: Page, dst: Tier, buffer: torch.Tensor, wait: bool, after: CopyHandle | None = None) -> None:
        """Start `page`'s move between the device and host tiers into `buffer`, a slot of `dst`: a copy, or with
        `zero_copy` a trade (the page's own slot joins `dst`'s pool, `buffer` goes to the pool it leaves). A copy
        down gives the device slot back at once, fenced by the copy (its next user comes after it on the GPU, the
        host waits for nothing), unless a guard watches the page (an asynchronous checkpoint reads its slot)."""
        src = page.tier
        page.transition(PageState.TO_DEVICE if dst is Tier.DEVICE else PageState.TO_HOST)
        if self.zero_copy:
            self.pools[dst].free(buffer)
            self.pools[src].trade(page.buffer, self.pools[dst])
            self._begin(Move(page, src, dst, _TRADED, page.buffer, self._finish_copy))
            self._wait_move(page)  # settles at once: nothing travelled
            return
        move = Move(page, src, dst, self.copier.copy(buffer, page.buffer, wait=wait, after=after), buffer,
                    self._finish_copy)
        if dst is Tier.HOST and move.handle.pending and page.id not in self._guards:
            self.pools[src].free(page.buffer, fence=move.handle)
            page.buffer, move.src_freed = buffer, True  # (its bytes are there once the move settles)
        self._begin(move)

    def _finish_copy(self, move: Move) -> None:
        page = move.page
        if move.dst is Tier.DEVICE:  # compute comes after the copy on the GPU; the host goes on
            move.handle.order_before_use(self.copier.device)
        else:
            move.handle.wait()
        if move.new_buffer is not page.buffer:  # the source slot is free once the copy is done with it (a trade
            self.pools[move.src].free(page.buffer, fence=move.handle)  # moved the slot; an early free is done)
            page.buffer = move.new_buffer
        page.transition(PageState.DEVICE if move.dst is Tier.DEVICE else PageState.HOST)
        self._moved(move)

    def _finish_write(self, move: Move) -> None:
        page = move.page
        try:
            checksum = move.handle.wait()
        except PageIOError as exc:
            page.disk_version = -1  # the slot may hold a torn write
            page.transition(PageState.HOST)  # the host buffer was never touched
            self._emit("io_error", page, Tier.HOST, Tier.DISK, error=str(exc))
            raise
        page.disk_checksum, page.disk_version = checksum, page.version
        self.pools[Tier.HOST].free(page.buffer)
        page.buffer = None
        page.transition(PageState.DISK)
        self._moved(move)

    def _finish_read(self, move: Move) -> None:
        page = move.page
        try:
            self.disk.check_read(page, move.handle)
        except (PageIOError, ChecksumError) as exc:
            self.pools[Tier.HOST].free(move.new_buffer)
            page.transition(PageState.DISK)  # the slot still holds what it held
            self._emit("io_error", page, Tier.DISK, Tier.HOST, error=str(exc))
            raise
        page.buffer = move.new_buffer
        page.transition(PageState.HOST)
        self._moved(move)

    def close(self, remove_files: bool = True) -> None:
        """Stop: every move in flight ends first. Its I/O or checksum error no longer matters (no page is read or
        kept after this), so it does not stop the close: the page files still go."""
        for page in self.pages:
            with contextlib.suppress(PageIOError, ChecksumError):
                self._wait_move(page)
        self.copier.close()
        if self.disk is not None:
            self.disk.close(remove=remove_files)
