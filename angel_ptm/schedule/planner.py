"""The planner: from one step's trace, the page moves to issue after each access so later accesses find their
pages in place.

It simulates the tiers (device and host slots, disk behind them) over the step run three times in a row: the
first pass reaches the steady state, the second is the plan (its moves are issued at the access they follow), the
third is the next step, into which the second pass looks ahead (the last accesses of a step prefetch the first of
the next). At each access:

1. demand: pages of the access not yet on its tier are brought up (the executor leaves these to `acquire`);
2. prefetch: walking forward from the first access whose pages are not all in place, each page is moved up one
   tier at a time while a slot is free or a resident, unpinned page is used later than the access being served
   (Belady: the farthest next use leaves first; a clean page is dropped, a dirty one written back). The walk
   stops at the first page that finds no room (moves stay in access order, but for a few accesses ahead of
   their use: `REORDER_WINDOW`) or `lookahead` accesses ahead.

The lookahead is bounded by the device budget: pages pinned by the running access and pages needed sooner are
never evicted for a later one, so the activations (which live outside the page pools) keep their memory. Moves
are single hops ("fetch" up, "evict" down), and `update_order` lists the pages in the order their gradients
become final, which is the order the optimizer updates them. Collectives are not planned here: a plan's moves
depend on one rank's residency, and every rank must issue the same collectives in the same order, so ZeRO plans
its gathers from the recorded sequence of page-group accesses (parallel/zero.py).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from angel_ptm.errors import ScheduleError
from angel_ptm.memory.page import Tier
from angel_ptm.schedule.trace import StepTrace

_RANK = {Tier.DISK: 0, Tier.HOST: 1, Tier.DEVICE: 2}
_UP = {Tier.DISK: Tier.HOST, Tier.HOST: Tier.DEVICE}
RESERVE_EXTRA_BYTES = 1.10  # prefetch buffers may cost at most this factor over the plan without them
# A group of moves may be issued ahead of earlier groups within this many accesses of the access it serves (see
# plan_with_reserve, step 2). Measured with tools.bench.overlap on CPU against strictly in-order issue: steps 3-11%
# shorter on four shapes (I/O-bound, balanced, compute-bound, a tight host tier), the same under staleness 1; with
# no bound, staleness 1 ran 4.5% longer (far-ahead reads delayed the ones due sooner).
REORDER_WINDOW = 32
_PASSES = 3  # warm-up pass, planned pass, next step (what the planned step's last moves serve)


@dataclass(frozen=True)
class Op:
    """One planned action. `at`: the access it is issued after; `serves`: the access it prepares (may be in the
    next step: `serves >= n_accesses`), -1 for evictions and reductions."""

    kind: str  # "fetch" | "evict"
    page: int
    src: Tier | None
    dst: Tier | None
    at: int
    serves: int = -1

    def __str__(self) -> str:
        hop = f" {self.src.value}->{self.dst.value}" if self.src is not None else ""
        return f"{self.kind}({self.page}{hop})"


@dataclass
class Plan:
    n_accesses: int
    ops_after: list[list[Op]]
    demand: list[Op]  # moves the simulation could not plan ahead: left to acquire (and counted)
    moved_bytes: Counter  # "src->dst" -> bytes per step in the steady state, planned and demand moves
    grad_final_after: list[list[int]]  # pages whose last write before the optimizer is access i
    trace: StepTrace = field(default_factory=StepTrace)  # the step as planned (updates in gradient-final order)
    policy: str = "belady"
    lookahead: int = 0
    activation_peak: int = 0
    stats: dict = field(default_factory=dict)

    @property
    def ops(self) -> list[Op]:
        return [op for ops in self.ops_after for op in ops]

    @property
    def update_order(self) -> list[int]:
        return [pid for pages in self.grad_final_after for pid in pages]

    @property
    def total_moved_bytes(self) -> int:
        return sum(self.moved_bytes.values())


class _Tiers:
    """The simulated residency: where each page's working copy is, which are dirty, free slots per tier."""

    def __init__(self, residency: Mapping[int, Tier], dirty: Iterable[int], capacity: Mapping[Tier, int],
                 has_disk: bool, dead: Iterable[int] = ()):
        self.loc = dict(residency)
        self.dirty = set(dirty)
        self.dead = set(dead)  # contents not needed: dropped when evicted, created zeroed (no read) when used
        self.has_disk = has_disk
        self.resident: dict[Tier, set[int]] = {Tier.DEVICE: set(), Tier.HOST: set()}
        for pid, tier in self.loc.items():
            if tier is not Tier.DISK:
                self.resident[tier].add(pid)
        self.free = {tier: capacity[tier] - len(self.resident[tier]) for tier in self.resident}
        for tier, free in self.free.items():
            if free < 0:
                raise ScheduleError(f"{len(self.resident[tier])} pages rest on the {tier.value} tier, "
                                    f"which holds {capacity[tier]}")

    on_place = None  # called with (pid, tier) after each move (the victim index follows residency)

    def place(self, pid: int, tier: Tier) -> None:
        old = self.loc[pid]
        if old is not Tier.DISK:
            self.resident[old].discard(pid)
            self.free[old] += 1
        if tier is not Tier.DISK:
            self.resident[tier].add(pid)
            self.free[tier] -= 1
        self.loc[pid] = tier
        if self.on_place is not None:
            self.on_place(pid, tier)


class _Victims:
    """The resident pages of the device and host tiers ordered by the policy's key (Belady: farthest next use, then
    least recently used, then lowest id; LRU: least recently used, then lowest id), as heaps whose stale entries
    are skipped: finding a victim costs a few heap operations, not a scan of every resident page (a step of
    thousands of accesses over thousands of pages -- an MoE model with many experts -- planned in seconds, not
    minutes). A page's key changes only when it is used (its next use moves on, its last use is now), so `update`
    is called then and whenever it changes tier."""

    def __init__(self, key):
        self.key = key  # (pid, t) -> the key to maximise (a tuple of numbers)
        self.heaps: dict[Tier, list] = {Tier.DEVICE: [], Tier.HOST: []}
        self.version: dict[int, int] = {}
        self.loc: dict[int, Tier] = {}

    def update(self, pid: int, tier: Tier, t: int) -> None:
        version = self.version[pid] = self.version.get(pid, 0) + 1
        self.loc[pid] = tier
        if tier is not Tier.DISK:
            heapq.heappush(self.heaps[tier], (tuple(-k for k in self.key(pid, t)), version, pid))

    def victim(self, tier: Tier, protected: set[int]) -> int | None:
        heap, skipped, found = self.heaps[tier], [], None
        while heap:
            entry = heap[0]
            pid = entry[2]
            if self.version.get(pid) != entry[1] or self.loc.get(pid) is not tier:
                heapq.heappop(heap)  # stale: the page moved or was used since
            elif pid in protected:
                skipped.append(heapq.heappop(heap))
            else:
                found = pid
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found


def grad_final_times(trace: StepTrace) -> dict[int, int]:
    """Page id -> index of the last access before the optimizer's first that wrote it (its gradient is final)."""
    first_opt = next((i for i, a in enumerate(trace.accesses) if a.phase == "opt"), len(trace))
    last_write: dict[int, int] = {}
    for i, access in enumerate(trace.accesses[:first_opt]):
        for pid in access.writes:
            last_write[pid] = i
    return last_write


def order_updates(trace: StepTrace) -> StepTrace:
    """The same step with its optimizer updates ("opt:update" accesses, one per page group) in the order their
    gradients became final: the last layers' first, while the pages they touch are still warm. Only the updates
    after the last gradient write move: those made during backward (eager updates, which data parallelism lands at
    fixed points) stay where they are, since the step makes them there again."""
    final = grad_final_times(trace)
    last_grad = max((i for i, a in enumerate(trace.accesses) if a.label.startswith("grad:")), default=-1)
    updates = [i for i, a in enumerate(trace.accesses) if a.label == "opt:update" and i > last_grad]
    if len(updates) < 2:
        return trace
    by_final = sorted(updates, key=lambda i: (min((final.get(p, len(trace)) for p in trace[i].pages)), i))
    accesses = list(trace.accesses)
    for slot, i in zip(updates, by_final):
        accesses[slot] = trace[i]
    return StepTrace(accesses)


def _fit(residency: Mapping[int, Tier], capacity: Mapping[Tier, int]) -> dict[int, Tier]:
    """The starting residency squeezed into `capacity` (pages over it start one tier down, highest ids first)."""
    fitted = dict(residency)
    for tier, below in ((Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DISK)):
        on_tier = sorted(pid for pid, t in fitted.items() if t is tier)
        for pid in on_tier[capacity[tier]:]:
            fitted[pid] = below
    return fitted


def plan_step(trace: StepTrace, residency: Mapping[int, Tier], capacity: Mapping[Tier, int], page_bytes: int,
              **options) -> Plan:
    """Plan one steady-state step of `trace` (see `plan_with_reserve` for the options). Without an explicit
    `reserve`, the prefetch buffers are as large as they can be (up to a third of a tier, at most 8 slots) while
    the plan still moves no more bytes than on-demand LRU and at most 10% more than with no buffers at all."""
    if options.get("reserve") is not None or not options.get("prefetch", True) or options.get("policy") == "lru":
        return plan_with_reserve(trace, residency, capacity, page_bytes, **options)
    options.pop("reserve", None)
    best = plan_with_reserve(trace, residency, capacity, page_bytes, reserve={Tier.DEVICE: 0, Tier.HOST: 0},
                             **options)
    if best.total_moved_bytes == 0:
        return best
    lru_options = {k: v for k, v in options.items() if k not in ("prefetch", "lookahead")}
    lru = plan_with_reserve(trace, residency, capacity, page_bytes, policy="lru", **lru_options)
    limit = min(lru.total_moved_bytes, RESERVE_EXTRA_BYTES * best.total_moved_bytes)
    top = {tier: min(8, capacity[tier] // 3) for tier in (Tier.DEVICE, Tier.HOST)}
    for k in range(max(top.values()), 0, -1):
        reserve = {tier: min(k, top[tier]) for tier in top}
        try:
            plan = plan_with_reserve(trace, residency, capacity, page_bytes, reserve=reserve, **options)
        except ScheduleError:
            continue  # the reduced tiers cannot serve some access: a smaller buffer
        if plan.total_moved_bytes <= limit:
            return plan
    return best


def plan_with_reserve(trace: StepTrace, residency: Mapping[int, Tier], capacity: Mapping[Tier, int],
                      page_bytes: int, *, dirty: Iterable[int] = (), has_disk: bool = True, policy: str = "belady",
                      prefetch: bool = True, lookahead: int | None = None,
                      dead: Iterable[int] = (), reserve: Mapping[Tier, int] | None = None) -> Plan:
    """Plan one steady-state step of `trace` starting from `residency` (page id -> tier of its working copy).

    `dirty`: pages whose working copy differs from their disk copy (or have none); `dead`: pages whose contents
    are not needed (an applied gradient: dropped, never read back; so are the pages an access `discards`);
    `capacity`: slots of the device and host tiers; `policy`: "belady" (the plan) or "lru" (the on-demand
    baseline, which cannot look ahead, so it never prefetches); `lookahead`: how many accesses ahead a move may
    be issued (default: a whole step); `reserve`:
    slots per tier kept out of the replacement simulation as prefetch buffers (default none), which let moves
    start before the pages they replace are done with."""
    if policy not in ("belady", "lru"):
        raise ValueError(f"policy must be 'belady' or 'lru', got {policy!r}")
    trace = order_updates(trace)
    n = len(trace)
    lookahead = n if lookahead is None or lookahead <= 0 else lookahead
    prefetch = prefetch and policy == "belady" and n > 0
    if reserve is None or not prefetch:
        reserve = {Tier.DEVICE: 0, Tier.HOST: 0}
    sim_capacity = {tier: capacity[tier] - reserve.get(tier, 0) for tier in (Tier.DEVICE, Tier.HOST)}
    if sum(1 for pid, tier in residency.items() if tier is Tier.DEVICE) > sim_capacity[Tier.DEVICE] or \
            sum(1 for pid, tier in residency.items() if tier is Tier.HOST) > sim_capacity[Tier.HOST]:
        residency = _fit(residency, sim_capacity)
    sim = _Tiers(residency, dirty, sim_capacity, has_disk, dead)
    for pid in {p for a in trace.accesses for p in a.pages}:
        sim.loc.setdefault(pid, Tier.DISK)
    horizon = _PASSES * n
    uses: dict[int, list[int]] = {}
    busy: dict[int, list[int]] = {}  # times each page is taken or held (pinned): it cannot leave then
    for t in range(horizon):
        access = trace[t % n]
        for pid in access.pages:
            uses.setdefault(pid, []).append(t)
            busy.setdefault(pid, []).append(t)
        for pid in access.held:
            busy.setdefault(pid, []).append(t)

    def next_use(pid: int, t: int) -> float:
        times = uses.get(pid)
        if not times:
            return float("inf")
        i = bisect.bisect_right(times, t)
        return times[i] if i < len(times) else float("inf")

    def last_busy_before(pid: int, t: int) -> int:
        times = busy.get(pid, ())
        i = bisect.bisect_left(times, t)
        return times[i - 1] if i else -1

    # 1. The demand simulation (MIN: Belady's optimal replacement, or LRU): the moves each access needs.
    last_used: dict[int, int] = {}
    groups: list[tuple[int, list[tuple[Op, int]]]] = []  # (access time, [(op, bytes)]) in order

    # Belady: the farthest next use; among equals the least recently used, then the lowest id (as BeladyPolicy).
    # LRU: the least recently used, then the lowest id.
    victims = _Victims((lambda q, t: (next_use(q, t), -last_used.get(q, -1), -q)) if policy == "belady"
                       else (lambda q, t: (-last_used.get(q, -1), -q)))
    now = [-1]  # the access being simulated (a page placed now is keyed from it)
    for pid, tier in sim.loc.items():
        victims.update(pid, tier, -1)
    sim.on_place = lambda pid, tier: victims.update(pid, tier, now[0])

    def victim_of(tier: Tier, t: int, protected: set[int]) -> int | None:
        return victims.victim(tier, protected)

    def make_room(tier: Tier, t: int, protected: set[int], out: list) -> bool:
        victim = victim_of(tier, t, protected)
        if victim is None:
            return False
        clean = victim in sim.dead or (sim.has_disk and victim not in sim.dirty)
        # As the manager does: a clean page leaving the device goes to a free host slot if there is one.
        keep = tier is Tier.DEVICE and victim not in sim.dead and sim.free[Tier.HOST] > 0
        dst = Tier.DISK if tier is Tier.HOST or (clean and not keep) else Tier.HOST
        if dst is Tier.DISK and not clean and not sim.has_disk:
            return False
        if dst is Tier.HOST and sim.free[Tier.HOST] == 0 and not make_room(Tier.HOST, t, protected | {victim}, out):
            return False
        if dst is Tier.DISK:
            sim.dirty.discard(victim)
        sim.place(victim, dst)
        out.append((Op("evict", victim, tier, dst, t % n), 0 if clean and dst is Tier.DISK else page_bytes))
        return True

    def bring(pid: int, tier: Tier, t: int, protected: set[int], out: list) -> bool:
        protected = protected | {pid}
        if pid in sim.dead and sim.loc[pid] is Tier.DISK:  # created zeroed where it is needed: nothing to read
            if sim.free[tier] == 0 and not make_room(tier, t, protected, out):
                return False
            sim.place(pid, tier)
            sim.dead.discard(pid)
            sim.dirty.add(pid)
            out.append((Op("fetch", pid, Tier.DISK, tier, t % n, t - n), 0))
            return True
        while _RANK[sim.loc[pid]] < _RANK[tier]:
            src = sim.loc[pid]
            dst = _UP[src]
            if sim.free[dst] == 0 and not make_room(dst, t, protected, out):
                return False
            sim.place(pid, dst)
            out.append((Op("fetch", pid, src, dst, t % n, t - n), page_bytes))
        return True

    for t in range(horizon):
        now[0] = t
        access = trace[t % n]
        pinned = set(access.pages) | set(access.held)
        out: list[tuple[Op, int]] = []
        for pid in access.pages:
            if not bring(pid, access.tier, t, pinned, out):
                raise ScheduleError(
                    f"access {t % n} ({access.label}): no room to bring page {pid} to the {access.tier.value} tier "
                    f"with {len(pinned)} pages pinned (device {capacity[Tier.DEVICE]} slots, host "
                    f"{capacity[Tier.HOST]} slots)")
        if out:
            groups.append((t, out))
        for pid in access.pages:
            last_used[pid] = t
            victims.update(pid, sim.loc[pid], t)
        sim.dirty.update(access.writes)
        for pid in access.discards:
            if sim.loc[pid] is not Tier.DISK:
                sim.place(pid, Tier.DISK)
            sim.dirty.discard(pid)
            sim.dead.add(pid)

    # 2. Conservative prefetching (Cao et al.): the same moves, each group issued as early as is safe: after the
    # last access that takes or holds a page it evicts (so nothing it removes is needed before the access it
    # serves), after every earlier move of the pages it moves, after the group before it (slots are freed and
    # filled in the same order, and the disk serves reads in the order they are needed), within the lookahead.
    # Only within REORDER_WINDOW accesses of the access it serves may a group go ahead of the groups before it: a
    # read due that soon should not queue behind reads due later. A group may start earlier still by borrowing a
    # reserved slot on each tier it fills, until its victims go.
    planned: list[list[Op]] = [[] for _ in range(n)]
    demand: list[Op] = []
    moved: Counter = Counter()
    issue_floor = -1
    fetch_issued: dict[int, int] = {}  # page -> when the latest group bringing it up was issued
    evict_issued: dict[int, int] = {}  # page -> when the latest group sending it down was issued
    borrowing: dict[Tier, list[int]] = {Tier.DEVICE: [], Tier.HOST: []}  # when each borrowed slot is given back
    for t, out in groups:
        floor = min(issue_floor, max(-1, t - REORDER_WINDOW))
        safe = floor
        for op, _ in out:
            # A page's moves keep their order: each hop after the one before it, up or down.
            safe = max(safe, evict_issued.get(op.page, -1), fetch_issued.get(op.page, -1))
            if op.kind == "evict":
                safe = max(safe, last_busy_before(op.page, t))
        issue = max(floor, t - lookahead)
        fills = {op.dst for op, _ in out if op.kind == "fetch"}
        if issue < safe:
            for tier in fills:
                active = sorted(e for e in borrowing[tier] if e > issue)
                if len(active) >= reserve.get(tier, 0):
                    # wait until enough borrowed slots are back (all of them, with no reserve: the safe time)
                    issue = max(issue, active[len(active) - reserve.get(tier, 0)] if reserve.get(tier, 0) else safe)
            issue = min(max(issue, t - lookahead), safe) if issue < safe else safe
            if issue < safe:
                for tier in fills:
                    borrowing[tier].append(safe)
        materialize = any(op.kind == "fetch" and not nbytes for op, nbytes in out)  # a dead page: no read to hide
        if not prefetch or issue >= t or materialize:
            issue = t  # on demand, by acquire
        issue_floor = max(issue_floor, issue)
        # A group issued early on a borrowed slot sends its victims down at the safe time, after their last use
        # (sent with the group, the executor would find them still needed and skip them: the step then parts
        # from the plan's residency).
        when = [max(issue, safe) if op.kind == "evict" else issue for op, _ in out]
        for (op, _), at in zip(out, when):
            (evict_issued if op.kind == "evict" else fetch_issued)[op.page] = at
        if n <= t < 2 * n:  # the measured step: the moves it makes, however early they are issued
            for op, nbytes in out:
                if nbytes:
                    moved[f"{op.src.value}->{op.dst.value}"] += nbytes
        for (op, _), at in zip(out, when):
            if not n <= at < 2 * n:
                continue
            if at == t:
                demand.append(op)
            else:  # an eviction serves its group
                planned[at - n].append(Op(op.kind, op.page, op.src, op.dst, at - n, t - n))

    grad_final_after: list[list[int]] = [[] for _ in range(n)]
    for pid, i in sorted(grad_final_times(trace).items(), key=lambda item: (item[1], item[0])):
        grad_final_after[i].append(pid)

    fetches = sum(1 for op in (o for ops in planned for o in ops) if op.kind == "fetch")
    return Plan(n_accesses=n, ops_after=planned, demand=demand, moved_bytes=moved, trace=trace,
                grad_final_after=grad_final_after, policy=policy, lookahead=lookahead,
                activation_peak=trace.activation_peak,
                stats={"planned_fetches": fetches, "demand_fetches": sum(1 for o in demand if o.kind == "fetch"),
                       "reserve": {tier.value: k for tier, k in reserve.items()}})
