"""The Scheduler, which drives the executor (schedule/issuing.py: a plan's moves run on their queues while compute
goes on).

Queues: disk reads and writes run on the native SSD engine's threads, host<->device copies on the copy streams
(CUDA) or the copy thread (CPU); ZeRO's collectives run on the process group's own threads or stream
(parallel/zero.py issues them, through schedule/communicator.py's protocol). The executor issues moves in plan order
without ever blocking: a move whose page is still travelling, or whose next tier has no free slot yet, waits at the
head of its queue until a later `pump()` (every access pumps). Compute never waits on the executor: `acquire`
waits only for the pages it needs, fetching on demand whatever the plan did not bring.

The `Scheduler` is the front door of the training step's page accesses: the binder, the optimizer and the ZeRO
gatherer acquire, release and discard pages through it, and it calls the PageManager (which never calls up). In
the warm-up step it records the trace (LRU evictions,
on-demand fetches); at the end of each step it plans the next one from the trace if there is no plan yet or the
step deviated from it; in a planned step it matches each access against the plan, keeps the Belady policy's clock
on the plan's position, and hands the moves planned after the access to the executor. An access the plan did not
expect (data-dependent control flow, MoE routing) is served on demand and counted as a deviation; the plan is
rebuilt from that step's trace.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Iterable, Sequence

from angel_ptm.memory.manager import PageManager
from angel_ptm.memory.moves import Hop
from angel_ptm.memory.page import Page, PageState, Tier
from angel_ptm.memory.policy import BeladyPolicy, LRUPolicy
from angel_ptm.schedule.issuing import Executor, StepStats
from angel_ptm.schedule.planner import Plan, plan_step
from angel_ptm.schedule.predictor import RoutingHistory
from angel_ptm.schedule.runs import OptionalRuns
from angel_ptm.schedule.trace import StepRecorder, StepTrace, merge_optional
from angel_ptm.trace.recorder import TraceRecorder

RESYNC_WINDOW = 64  # accesses searched ahead of the plan's position for an unexpected access
# Accesses ahead whose planned disk reads may start early into free host slots. Measured with tools.bench.overlap
# on CPU: the scheduled step is 4-5% shorter with 16 to 128 than with 8 on two I/O-bound shapes, the same within
# noise on a compute-bound one, a tight host tier and optimizer.staleness 1.
EARLY_READS = 32


class Scheduler:
    """The unified scheduler: trace -> plan -> execute, one training step at a time."""

    def __init__(self, manager: PageManager, planned: bool = True, lookahead: int = 0,
                 activation_bytes: Callable[[], int] | None = None, trace: TraceRecorder | None = None):
        self.manager, self.planned, self.lookahead = manager, planned, lookahead
        self.activation_bytes = activation_bytes or (lambda: 0)
        self.trace = trace or TraceRecorder(None)
        self.executor = Executor(manager)
        self.recorder = StepRecorder()
        self.plan: Plan | None = None
        self.last_trace: StepTrace | None = None
        self.paused = False
        self.step = 0
        self.stats = StepStats()
        self.last_stats = StepStats()
        self.plan_s = 0.0
        self.early_reads = EARLY_READS
        # Pages whose accesses a step may or may not make (an MoE layer's experts: only those the gate routed to
        # run): a planned access to them that does not come is not a deviation, and one the plan lacks is served on
        # demand and learned (the next plan follows this step's routing), not a deviation either.
        self.optional_pages: frozenset[int] = frozenset()
        # Where routing is watched (experts are units of their own): which experts' fetches go ahead of their gate
        self.history: RoutingHistory | None = None
        self._learn = False
        self._learned: StepTrace | None = None  # the trace (in the order recorded) the plan was made from
        self._keys: list[tuple] = []
        self._positions: dict[tuple, list[int]] = {}
        self._offsets: list[int] = []
        self._read_at: list[int] = []  # access index after which each planned disk read is issued (sorted)
        self._read_page: list[int] = []  # its page id
        self._resident: list[tuple[int, ...]] = []  # per access, its pages the plan moves nothing for
        self._repair_at = 0  # the next access whose pages _read_early looks at
        self._cursor = 0  # one past the furthest plan position matched this step
        self._runs = OptionalRuns((), self._optional)  # the plan's runs of optional accesses (made in any order)
        self._page_positions: dict[int, list[int]] = {}
        self._matched: int | None = None
        self._t_acquire = 0.0

    # ------------------------------------------------------------------ the front door
    def acquire(self, pages: Sequence[Page], tier: Tier = Tier.DEVICE, label: str | None = None,
                read_only: bool = False) -> None:
        """Pin `pages` on `tier` (PageManager.acquire, `read_only` too). A `label` (say "fwd:layers.0") marks an
        access of the training step: it is recorded, matched against the plan, and the moves planned after it are
        issued."""
        if label is None or self.paused:
            self.manager.acquire(pages, tier, read_only)
            return
        self._before_acquire(pages, tier, label)
        waited = self.manager.acquire(pages, tier, read_only)
        try:
            self._after_acquire(pages, tier, label, waited)
        except BaseException:  # (a planned move that failed, a disk full): the caller never gets the pages
            self.manager.release(pages)
            raise

    def release(self, pages: Sequence[Page], dirty: bool = False) -> None:
        """Unpin `pages` (PageManager.release); a write is recorded, so the plan knows the page must go back."""
        self.manager.release(pages, dirty=dirty)
        if dirty and not self.paused:
            self.recorder.wrote(p.id for p in pages)

    def discard(self, pages: Sequence[Page]) -> None:
        """`pages` are dead (PageManager.discard); recorded, so the plan drops them instead of saving them."""
        self.manager.discard(pages)
        if not self.paused:
            self.recorder.discarded(p.id for p in pages)

    def write_behind(self, page: Page) -> None:
        """Start `page`'s next hop down toward disk without waiting (an activation page, filled, with
        activations.offload: disk); settled by the pumps of later accesses."""
        self.manager.try_hop(page, Tier.DISK)

    def _before_acquire(self, pages: Sequence[Page], tier: Tier, label: str) -> None:
        if self.paused:
            return
        t0 = time.perf_counter()
        ids = tuple(p.id for p in pages)
        self.recorder.record(label, ids, tier, self.manager.pinned_ids, self.activation_bytes())
        self.stats.accesses += 1
        self._matched = None
        if self.plan is not None:
            self._matched = self._match((ids, tier))
            if self._matched is None and self._optional(ids):
                self.stats.optional_unplanned += 1
                self._learn = True
            elif self._matched is None:
                self.stats.deviations += 1
            else:
                self._runs.made(self._matched, self._cursor)
                if isinstance(self.manager.policy, BeladyPolicy):
                    self.manager.policy.seek(self._offsets[min(self._matched, self._now())])
        self.executor.pump(self._now(), self._need_of)
        self._t_acquire = time.perf_counter()
        self.stats.schedule_s += self._t_acquire - t0

    def _after_acquire(self, pages: Sequence[Page], tier: Tier, label: str, waited: bool) -> None:
        t1 = time.perf_counter()
        if waited:
            self.stats.stall_s += t1 - self._t_acquire
            self.stats.stalls += 1
            if self.trace.enabled:
                end = self.trace.now()
                self.trace.interval("stall", label, end - (t1 - self._t_acquire), end)
        if self._matched is not None and self._matched >= self._cursor:  # (one before it: its moves were issued)
            self.executor.submit(self.plan.ops_after[self._matched])
            self._cursor = self._matched + 1
        with self.manager.batched_io():  # the pump's transfers and the early reads go to the SSD workers together
            self.executor.pump(self._now(), self._need_of)
            if self._matched is not None and self.early_reads:
                self._read_early(self._matched)
        self.stats.schedule_s += time.perf_counter() - t1

    def _read_early(self, at: int) -> None:
        """Start the disk reads planned a few accesses from now into host slots that are free anyway: no page is
        evicted for them before their planned time, so the plan's moves stay what they are, only sooner."""
        host = self.manager.pools[Tier.HOST]
        first = bisect.bisect_right(self._read_at, at)
        last = bisect.bisect_right(self._read_at, at + self.early_reads)
        for page_id in self._read_page[first:last]:
            if host.free_slots <= 1:  # keep one slot for the copies and write-backs already planned
                break
            page = self.manager.pages[page_id]
            if _on_disk(page):
                self.manager.try_hop(page, Tier.HOST)
                self.stats.early_reads += 1
        self._read_back(at)

    def _read_back(self, at: int) -> None:
        """Pages the plan keeps in place for the accesses ahead that an eviction the plan did not make (one made on
        demand, or to make room where a planned write was still under way) left on disk: read back into free
        host slots as their access comes within reach, so the step returns to the plan's residency instead of
        reading them on demand step after step. No page is evicted for them (that moved more bytes than it
        saved waiting: the evicted page is the next one read back); each access is looked at once, from where the
        last look stopped for want of a free slot."""
        host, pages = self.manager.pools[Tier.HOST], self.manager.pages
        j, end = max(self._repair_at, at + 1), min(at + 1 + self.early_reads, len(self._resident))
        while j < end:
            for page_id in self._resident[j]:
                page = pages[page_id]
                if _on_disk(page):
                    if host.free_slots <= 1:
                        self._repair_at = j
                        return
                    if self.manager.try_hop(page, Tier.HOST) is Hop.STARTED:
                        self.stats.repair_reads += 1
            j += 1
        self._repair_at = j

    def _now(self) -> int:
        """The plan position of the first access still to come: the cursor, or before it an expert of the layer
        under way that has not run yet (OptionalRuns; one the gate routed nothing to is not to come)."""
        return self._runs.low(self._cursor, self._unrouted)

    def _unrouted(self, position: int) -> bool:
        cancelled = self.executor.cancelled
        return bool(cancelled) and all(i in cancelled for i in self._keys[position][0])

    def _need_of(self, serves: int) -> float:
        """The Belady clock's position of plan access `serves` (>= n: in the next step)."""
        n = len(self._keys)
        return self._offsets[serves] if serves < n else self._offsets[n] + self._offsets[serves - n]

    def _match(self, key: tuple) -> int | None:
        """The plan's index of this access: the next expected one, or one a little further on (the step
        skipped some accesses); None when the plan does not know it."""
        cursor = self._cursor
        if cursor < len(self._keys) and self._keys[cursor] == key:
            return cursor
        positions = self._positions.get(key)
        if not positions:
            return None
        in_run = self._runs.find(positions)  # an expert of the layer under way, in an order of the layer's choosing
        if in_run is not None:
            for j in range(cursor, in_run):  # passed over, to come later (or not routed): their moves still serve
                self.executor.submit(self.plan.ops_after[j])
            return in_run
        i = bisect.bisect_left(positions, cursor)
        optional_gap = i < len(positions) and all(self._optional(self._keys[j][0])
                                                  for j in range(cursor, positions[i]))
        if i < len(positions) and (positions[i] - cursor <= RESYNC_WINDOW or optional_gap):
            skipped = range(cursor, positions[i])
            if optional_gap:  # experts nothing was routed to (a plan holds every expert routed to lately)
                for j in skipped:  # their planned moves for later accesses still serve those
                    self.executor.submit(self.plan.ops_after[j])
            else:
                self.stats.deviations += 1  # skipped accesses
            return positions[i]
        return None

    def route(self, unrouted: Iterable[int], routed: Iterable[int]) -> None:
        """An MoE gate has routed: the optional pages of its experts that got no token (`unrouted`) will not be
        accessed for the rest of this step unless a later forward (the next micro-batch) routes to them, so their
        planned fetches not yet issued are held (dropped at the step's end); the held fetches of `routed` pages (held
        by an earlier micro-batch, or as predicted cold: _hold_cold) go first. Only speed depends on it: an access
        that does come is served on demand."""
        if self.paused or self.plan is None:
            return
        routed = set(routed)
        executor = self.executor
        executor.cancelled.difference_update(routed)
        executor.resume(routed)  # (held as predicted cold: their planned fetches go now)
        executor.cancelled.update(unrouted)
        executor.horizon = len(self._keys)
        executor.cancel()

    def planned_order(self, experts: list[int], first_pages: Sequence[int]) -> list[int] | None:
        """The order in which the plan runs `experts` (expert e's weights' first page: `first_pages[e]`) from here
        on: by the plan position of that page's next access; experts the plan lacks last, by index. None without a
        plan."""
        if self.plan is None or self.paused:
            return None
        cursor, last = self._cursor, len(self._keys)

        def position(e: int) -> tuple[int, int]:
            found = self._page_positions.get(first_pages[e])
            i = bisect.bisect_left(found, cursor) if found else 0
            return (found[i] if found and i < len(found) else last, e)
        return sorted(experts, key=position)

    def _optional(self, ids: Sequence[int]) -> bool:
        return bool(ids) and all(i in self.optional_pages for i in ids)

    # ------------------------------------------------------------------ steps
    def end_step(self) -> StepStats:
        """The training step is over (after the optimizer): plan the next one if needed; this step's stats."""
        t0 = time.perf_counter()
        trace = self.recorder.finish()
        stats = self.stats
        if self.plan is not None and self._cursor != len(self._keys):
            rest = range(self._cursor, len(self._keys))
            if not all(self._optional(self._keys[j][0]) for j in rest):
                stats.deviations += 1  # the step ended before (or after) the plan did
        if self.plan is not None:  # planned optional accesses not made: experts no token was routed to
            stats.optional_skipped = self._runs.total - self._runs.matched
            stats.optional_reordered = self._runs.reordered
        self.executor.drop_parked()
        counts = self.executor.counts
        stats.issued, stats.skipped, stats.dropped = counts["issued"], counts["skipped"], counts["dropped"]
        stats.optional_cancelled, stats.optional_resumed = counts["cancelled"], counts["resumed"]
        counts.clear()
        if self.planned and len(trace) and (self.plan is None or stats.deviations or self._learn):
            basis = trace
            if self._learn and not stats.deviations and self._learned is not None:
                # Experts routed to now that the plan lacked: added to the ones it has (a superset, so routing that
                # comes back makes no re-plan), unless the other accesses differ
                basis = merge_optional(self._learned, trace, lambda a: self._optional(a.pages)) or trace
            self._replan(basis)
            self._learned = basis
            stats.replanned = True
        self._learn = False
        self.last_trace = trace
        self._cursor = 0
        self._repair_at = 0
        self._runs.begin_step()
        self.executor.next_step(len(self._keys))
        if isinstance(self.manager.policy, BeladyPolicy):
            self.manager.policy.seek(0)
        self.step += 1
        self.last_stats, self.stats = stats, StepStats()
        self._hold_cold(trace)
        stats.schedule_s += time.perf_counter() - t0
        return stats

    def _hold_cold(self, trace: StepTrace) -> None:
        """A step starts: the routing history learns which experts the last one ran (`trace`: any MoE layer's,
        whatever its gate), and the planned fetches of the experts it finds cold wait for their gate to route to
        them (route; those of a layer whose gate reports nothing are fetched on demand if it runs them)."""
        if self.history is None or self.paused:
            return
        optional = self.optional_pages
        self.history.routed(i for access in trace.accesses for i in access.pages if i in optional)
        self.history.end_step(self._page_positions)  # (the optional pages the plan accesses)
        if self.plan is not None and self.history.cold:
            self.executor.cancelled.update(self.history.cold)
            self.executor.horizon = len(self._keys)
            self.executor.cancel()
        self.stats.experts_cold = len(self.history.cold)

    def _replan(self, trace: StepTrace) -> None:
        t0 = time.perf_counter()
        manager = self.manager
        residency, dirty, dead = {}, [], []
        for page in manager.pages:
            if page.home is not None:  # another rank's page (ZeRO-3): its gatherer moves it; planned as dropped
                dead.append(page.id)
                continue
            residency[page.id] = _planning_tier(page)
            if page.dead:
                dead.append(page.id)
            elif not page.clean_on_disk:
                dirty.append(page.id)
        capacity = {tier: manager.pools[tier].capacity for tier in (Tier.DEVICE, Tier.HOST)}
        self.plan = plan_step(trace, residency, capacity, manager.page_bytes, dirty=dirty, dead=dead,
                              has_disk=manager.disk is not None, lookahead=self.lookahead)
        trace = self.plan.trace  # the optimizer's accesses in the plan's order
        self._keys = trace.keys()
        self._positions = {}
        for index, key in enumerate(self._keys):
            self._positions.setdefault(key, []).append(index)
        self._offsets = trace.flat_offsets()
        self._runs = OptionalRuns(self._keys, self._optional)
        self._page_positions = {}  # optional page -> the plan positions of the accesses taking it
        for index, (ids, _) in enumerate(self._keys):
            if self._optional(ids):
                for page_id in ids:
                    self._page_positions.setdefault(page_id, []).append(index)
        # The plan's disk reads in issue order, for _read_early (where they are planned, and which page).
        reads = [(op.at, op.page) for op in self.plan.ops
                 if op.kind == "fetch" and op.src is Tier.DISK and op.dst is Tier.HOST]
        self._read_at, self._read_page = [at for at, _ in reads], [pid for _, pid in reads]
        # Per access, the pages the plan expects in place without a move of their own (kept since a use before;
        # a fetch serving the next step's access `serves - n` is issued in this step for that access).
        fetched = [set() for _ in self._keys]
        for op in self.plan.ops + self.plan.demand:
            if op.kind == "fetch" and op.serves >= 0 and fetched:
                fetched[op.serves % len(fetched)].add(op.page)
        self._resident = [tuple(i for i in ids if i not in fetched[j]) if tier is not Tier.DISK else ()
                          for j, (ids, tier) in enumerate(self._keys)]
        sequence = trace.page_sequence()
        # This step, then the next (the future wraps around); the recency of past accesses carries over.
        history = manager.policy.history if isinstance(manager.policy, BeladyPolicy) else _as_lru(manager.policy)
        manager.policy = BeladyPolicy(sequence + sequence, history=history)
        self.executor.clear()
        self.plan_s = time.perf_counter() - t0
        if self.trace.enabled:
            self.trace.event("mark", name="plan", step=self.step, accesses=len(trace), plan_s=round(self.plan_s, 6),
                             planned_fetches=self.plan.stats["planned_fetches"],
                             demand_fetches=self.plan.stats["demand_fetches"])

    def update_order(self) -> list[int] | None:
        """Page ids in the order their gradients become final (the optimizer's order), when planned."""
        return self.plan.update_order if self.plan is not None else None

    def close(self) -> None:
        self.executor.close()


def _on_disk(page: Page) -> bool:
    """A page whose contents only the disk holds, free to be read up now."""
    return page.state is PageState.DISK and not page.dead and not page.pin_count


def _planning_tier(page: Page) -> Tier:
    """Where a page will rest once its move in flight lands (the planner's starting point)."""
    return {PageState.TO_DEVICE: Tier.DEVICE, PageState.TO_HOST: Tier.HOST, PageState.TO_DISK: Tier.DISK,
            PageState.FROM_DISK: Tier.HOST}.get(page.state) or page.tier


def _as_lru(policy) -> LRUPolicy:
    return policy if isinstance(policy, LRUPolicy) else LRUPolicy()
