"""The executor: runs a plan's moves on their queues while compute goes on, without ever blocking (the Scheduler
in schedule/executor.py drives it, access by access), and the figures of one scheduled step.

Queues: disk reads and writes run on the native SSD engine's threads, host<->device copies on the copy streams
(CUDA) or the copy thread (CPU). A move whose page is still travelling, or whose next tier has no free slot yet,
waits at the head of its queue until a later `pump()` (every access pumps).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from angel_ptm.memory.manager import PageManager
from angel_ptm.memory.moves import Hop
from angel_ptm.schedule.planner import Op

INF = float("inf")


@dataclass
class StepStats:
    """What one step's scheduling did."""

    accesses: int = 0
    stall_s: float = 0.0  # compute waiting in acquire for pages that were not in place
    stalls: int = 0  # accesses that waited
    schedule_s: float = 0.0  # time spent recording, matching and issuing moves
    deviations: int = 0
    issued: int = 0  # planned moves started
    skipped: int = 0  # planned moves with nothing to do (the page already where the plan wanted it)
    dropped: int = 0  # planned moves that could not start (the state differed from the plan)
    replanned: bool = False
    early_reads: int = 0  # planned disk reads started before their time, into free host slots
    repair_reads: int = 0  # reads of pages the plan had in place but an unplanned eviction had sent to disk
    optional_skipped: int = 0  # planned accesses to optional pages (experts no token was routed to) not made
    optional_unplanned: int = 0  # accesses to optional pages the plan did not have (served on demand, learned)
    optional_cancelled: int = 0  # planned fetches of experts' pages dropped unissued: the gate routed them nothing
    optional_reordered: int = 0  # optional accesses made after a later one of their run (experts run resident first)
    optional_resumed: int = 0  # held fetches of experts' pages (predicted cold) issued once their gate routed to them
    experts_cold: int = 0  # optional pages whose fetches wait for their gate (RoutingHistory) in this step

    def as_dict(self) -> dict:
        return {"accesses": self.accesses, "stall_s": round(self.stall_s, 6), "stalls": self.stalls,
                "schedule_s": round(self.schedule_s, 6), "deviations": self.deviations, "issued": self.issued,
                "skipped": self.skipped, "dropped": self.dropped, "replanned": self.replanned,
                "optional_skipped": self.optional_skipped, "optional_unplanned": self.optional_unplanned,
                "optional_cancelled": self.optional_cancelled, "optional_reordered": self.optional_reordered,
                "optional_resumed": self.optional_resumed, "experts_cold": self.experts_cold,
                "early_reads": self.early_reads, "repair_reads": self.repair_reads}


class Executor:
    """Issues planned moves on the manager's queues.

    Fetches are issued in plan order. One whose page is still on its way up (the previous hop) is passed over
    for the moment, so disk reads stay many deep; one that finds no free slot starts the eviction that will free
    one (a page used after the access the fetch serves: Belady) and is retried on the next pump; when there is
    none, no later fetch of that pump looks. Evictions are the manager's, made to room for fetches, so a step
    whose residency differs from the plan's (after an evaluation pass, say) still evicts correctly. A fetch for
    an access already past is dropped: acquire fetched that page on demand."""

    SCAN = 64  # queued fetches looked at per pump

    def __init__(self, manager: PageManager):
        self.manager = manager
        self.moves: list[Op] = []
        self.counts: Counter = Counter()
        # Pages whose fetches serving this step's accesses (serves < horizon) are held, not issued: experts the
        # gate routed no token to, or predicted cold whose gate has not routed yet (Scheduler.route, _hold_cold).
        # Their fetches wait in `parked`: issued if the gate routes to them after all (`resume`), else dropped.
        self.cancelled: set[int] = set()
        self.horizon = 0
        self.parked: list[Op] = []

    def submit(self, ops: Sequence[Op]) -> None:
        for op in ops:
            if op.kind == "fetch" and self._is_cancelled(op):
                self.parked.append(op)
            elif op.kind in ("fetch", "evict"):
                self.moves.append(op)

    def _is_cancelled(self, op: Op) -> bool:
        return op.kind == "fetch" and op.page in self.cancelled and 0 <= op.serves < self.horizon

    def cancel(self) -> None:
        """Hold the queued fetches of the cancelled pages (those already under way land, as any move does)."""
        if self.cancelled:
            kept = []
            for op in self.moves:
                (self.parked if self._is_cancelled(op) else kept).append(op)
            self.moves = kept

    def resume(self, pages: set[int]) -> None:
        """The held fetches of `pages` (their gate routed to them) go ahead of the queue: their accesses come
        soonest."""
        if self.parked and pages:
            back = [op for op in self.parked if op.page in pages]
            if back:
                self.parked = [op for op in self.parked if op.page not in pages]
                self.counts["resumed"] += len(back)
                self.moves = back + self.moves

    def drop_parked(self) -> None:
        """The step is over: the fetches still held were never needed (counted as cancelled)."""
        self.counts["cancelled"] += len(self.parked)
        self.parked = []

    def pump(self, now: int = 0, need_of: Callable[[int], float] | None = None) -> None:
        """Settle finished moves, then start queued ones. `now`: the plan index of the next access;
        `need_of(serves)`: the policy position of an access (for making room)."""
        manager = self.manager
        if manager.moves_in_flight:
            manager.poll()
        if not self.moves:
            return
        with manager.batched_io():  # the transfers started here go together: adjacent slots make one transfer
            self._issue(now, need_of)

    def _issue(self, now: int, need_of: Callable[[int], float] | None) -> None:
        manager = self.manager
        next_use = getattr(manager.policy, "next_use", None)
        kept: list[Op] = []
        waiting: Counter = Counter()  # fetches held back for room, per tier: each may have one eviction under way
        full: dict[tuple, float] = {}  # hop -> least need it was FULL for: a later need is FULL too, this pump
        pending: Counter = Counter()  # planned evictions held back (their page still pinned), per tier
        moves, i = self.moves, 0
        while i < len(moves) and len(kept) < self.SCAN:
            op = moves[i]
            i += 1
            if 0 <= op.serves < now:
                self.counts["dropped"] += 1  # its access has come and gone
                continue
            page = manager.pages[op.page]
            need = need_of(op.serves) if need_of is not None and op.serves >= 0 else None
            if op.kind == "evict":  # write-behind: free the slot as soon as the plan says the page is done
                if page.pin_count and page.tier is op.src:
                    kept.append(op)  # still held by the access it follows (released after this pump): retried
                    pending[op.src] += 1  # the slot it frees is coming: a fetch waits for it, evicts no other
                    continue
                if page.pin_count or page.state.in_flight or page.tier is not op.src or \
                        (need is not None and next_use is not None and next_use(page.id) <= need):
                    self.counts["skipped"] += 1  # in use, gone already, or needed sooner than planned
                    continue
                result = manager.try_hop(page, op.dst)
                if result is Hop.BLOCKED:
                    kept.append(op)  # a device page waiting for a host slot
                else:
                    self.counts["issued" if result is Hop.STARTED else "skipped"] += 1
                continue
            if page.pin_count or manager.moving(page):
                kept.append(op)  # in use, or the previous hop is still under way: later moves go ahead
                continue
            hop = (page.tier, op.dst)
            may_evict = need is not None and need < full.get(hop, INF) and \
                manager.leaving(op.dst) + pending[op.dst] <= waiting[op.dst]
            result = manager.try_hop(page, op.dst, need if may_evict else None)
            if result is Hop.BLOCKED or result is Hop.FULL:
                if result is Hop.FULL:
                    full[hop] = min(full.get(hop, INF), need)
                kept.append(op)
                waiting[op.dst] += 1
                continue
            self.counts["issued" if result is Hop.STARTED else "skipped"] += 1
        self.moves = kept + moves[i:]

    def next_step(self, n: int) -> None:
        """A new step starts: fetches for the next step's accesses now serve this one; the rest are stale."""
        self.cancelled.clear()
        self.counts["dropped"] += sum(1 for op in self.moves if op.serves < n)
        self.moves = [dataclasses.replace(op, serves=op.serves - n) for op in self.moves if op.serves >= n]

    def clear(self) -> None:
        self.moves.clear()
        self.parked.clear()

    def close(self) -> None:
        self.clear()
