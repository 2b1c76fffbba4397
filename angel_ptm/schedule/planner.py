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
   stops at the first page that finds no room (moves stay in access order) or `lookahead` accesses ahead.

The lookahead is bounded by the device budget: pages pinned by the running access and pages needed sooner are
never evicted for a later one, so the activations (which live outside the page pools) keep their memory. Moves
are single hops ("fetch" up, "evict" down); collectives of sharded pages ("all_gather" before use,
"reduce_scatter" once a gradient is final) are slotted in with them, and `update_order` lists the pages in the
order their gradients become final, which is the order the optimizer updates them.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from angel_ptm.errors import ScheduleError
from angel_ptm.memory.page import Tier
from angel_ptm.schedule.trace import StepTrace

_RANK = {Tier.DISK: 0, Tier.HOST: 1, Tier.DEVICE: 2}
_UP = {Tier.DISK: Tier.HOST, Tier.HOST: Tier.DEVICE}
_PASSES = 3  # warm-up pass, planned pass, next step (lookahead target)


@dataclass(frozen=True)
class Op:
    """One planned action. `at`: the access it is issued after; `serves`: the access it prepares (may be in the
    next step: `serves >= n_accesses`), -1 for evictions and reductions."""

    kind: str  # "fetch" | "evict" | "all_gather" | "reduce_scatter"
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
                 has_disk: bool):
        self.loc = dict(residency)
        self.dirty = set(dirty)
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

    def place(self, pid: int, tier: Tier) -> None:
        old = self.loc[pid]
        if old is not Tier.DISK:
            self.resident[old].discard(pid)
            self.free[old] += 1
        if tier is not Tier.DISK:
            self.resident[tier].add(pid)
            self.free[tier] -= 1
        self.loc[pid] = tier


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
    gradients became final: the last layers' first, while the pages they touch are still warm."""
    final = grad_final_times(trace)
    updates = [i for i, a in enumerate(trace.accesses) if a.label == "opt:update"]
    if len(updates) < 2:
        return trace
    by_final = sorted(updates, key=lambda i: (min((final.get(p, len(trace)) for p in trace[i].pages)), i))
    accesses = list(trace.accesses)
    for slot, i in zip(updates, by_final):
        accesses[slot] = trace[i]
    return StepTrace(accesses)


def plan_step(trace: StepTrace, residency: Mapping[int, Tier], capacity: Mapping[Tier, int], page_bytes: int,
              *, dirty: Iterable[int] = (), has_disk: bool = True, policy: str = "belady", prefetch: bool = True,
              lookahead: int | None = None, sharded: Iterable[int] = ()) -> Plan:
    """Plan one steady-state step of `trace` starting from `residency` (page id -> tier of its working copy).

    `dirty`: pages whose working copy differs from their disk copy (or have none); `capacity`: slots of the
    device and host tiers; `policy`: "belady" (the plan) or "lru" (the on-demand baseline, which cannot look
    ahead, so it never prefetches); `sharded`: pages owned in shards across data-parallel ranks."""
    if policy not in ("belady", "lru"):
        raise ValueError(f"policy must be 'belady' or 'lru', got {policy!r}")
    trace = order_updates(trace)
    n = len(trace)
    lookahead = n if lookahead is None or lookahead <= 0 else lookahead
    prefetch = prefetch and policy == "belady" and n > 0
    sharded = frozenset(sharded)
    sim = _Tiers(residency, dirty, capacity, has_disk)
    for pid in {p for a in trace.accesses for p in a.pages}:
        sim.loc.setdefault(pid, Tier.DISK)
    horizon = _PASSES * n
    uses: dict[int, list[int]] = {}
    for t in range(horizon):
        for pid in trace[t % n].pages:
            uses.setdefault(pid, []).append(t)

    def next_use(pid: int, t: int) -> float:
        times = uses.get(pid)
        if not times:
            return float("inf")
        i = bisect.bisect_right(times, t)
        return times[i] if i < len(times) else float("inf")

    last_used: dict[int, int] = {}
    planned: list[list[Op]] = [[] for _ in range(n)]
    demand: list[Op] = []
    moved: Counter = Counter()
    recording = False
    frontier = 1  # every access before it (and after now) has its pages in place

    def emit(op: Op, is_demand: bool, nbytes: int) -> None:
        if not recording:
            return
        (demand if is_demand else planned[op.at]).append(op)
        if nbytes:
            moved[f"{op.src.value}->{op.dst.value}"] += nbytes

    def victim_of(tier: Tier, t: int, protected: set[int], need: float) -> int | None:
        candidates = [q for q in sim.resident[tier] if q not in protected]
        if policy == "lru":
            return min(candidates, key=lambda q: (last_used.get(q, -1), q)) if candidates else None
        best, best_key = None, None
        for q in candidates:
            key = (next_use(q, t), -last_used.get(q, -1), -q)
            if best_key is None or key > best_key:
                best, best_key = q, key
        if best is None or best_key[0] <= need:
            return None  # everything here is needed before the access we would make room for
        return best

    def make_room(tier: Tier, t: int, protected: set[int], need: float, is_demand: bool) -> bool:
        nonlocal frontier
        victim = victim_of(tier, t, protected, need)
        if victim is None:
            return False
        clean = sim.has_disk and victim not in sim.dirty
        dst = Tier.DISK if tier is Tier.HOST or clean else Tier.HOST
        if dst is Tier.DISK and not sim.has_disk:
            return False
        if dst is Tier.HOST and sim.free[Tier.HOST] == 0:
            if not make_room(Tier.HOST, t, protected | {victim}, need, is_demand):
                return False
        nbytes = 0 if clean else page_bytes
        if dst is Tier.DISK:
            sim.dirty.discard(victim)
        sim.place(victim, dst)
        emit(Op("evict", victim, tier, dst, t % n), is_demand, nbytes)
        frontier = min(frontier, int(next_use(victim, t)) if next_use(victim, t) != float("inf") else frontier)
        return True

    def bring(pid: int, tier: Tier, t: int, protected: set[int], need: float, serves: int, is_demand: bool) -> bool:
        protected = protected | {pid}
        while _RANK[sim.loc[pid]] < _RANK[tier]:
            src = sim.loc[pid]
            dst = _UP[src]
            if sim.free[dst] == 0 and not make_room(dst, t, protected, need, is_demand):
                return False
            sim.place(pid, dst)
            emit(Op("fetch", pid, src, dst, t % n, serves), is_demand, page_bytes)
        return True

    for t in range(2 * n):
        recording = t >= n
        access = trace[t % n]
        pinned = set(access.pages) | set(access.held)
        for pid in access.pages:
            if not bring(pid, access.tier, t, pinned, float("-inf"), t - n, is_demand=True):
                raise ScheduleError(f"access {t % n} ({access.label}) needs {len(pinned)} pinned pages; the "
                                    f"{access.tier.value} tier holds {capacity[access.tier]}")
        for pid in access.pages:
            last_used[pid] = t
        sim.dirty.update(access.writes)
        if not prefetch:
            continue
        frontier = max(frontier, t + 1)
        while frontier < min(horizon, t + 1 + lookahead):
            target = trace[frontier % n]
            serves = frontier - n
            if not all(bring(pid, target.tier, t, pinned, frontier, serves, is_demand=False)
                       for pid in target.pages):
                break
            if recording and sharded:
                for pid in target.pages:
                    if pid in sharded:
                        planned[t % n].append(Op("all_gather", pid, None, None, t % n, serves))
            frontier += 1

    grad_final_after: list[list[int]] = [[] for _ in range(n)]
    for pid, i in sorted(grad_final_times(trace).items(), key=lambda item: (item[1], item[0])):
        grad_final_after[i].append(pid)
        if pid in sharded:
            planned[i].append(Op("reduce_scatter", pid, None, None, i))

    fetches = sum(1 for op in (o for ops in planned for o in ops) if op.kind == "fetch")
    return Plan(n_accesses=n, ops_after=planned, demand=demand, moved_bytes=moved, trace=trace,
                grad_final_after=grad_final_after, policy=policy, lookahead=lookahead,
                activation_peak=trace.activation_peak,
                stats={"planned_fetches": fetches, "demand_fetches": sum(1 for o in demand if o.kind == "fetch")})
