"""Eviction policies: which resting, unpinned page leaves a full tier.

The PageManager tells the policy every access (`on_access`, in acquire order) and asks it for a victim among
the candidates. LRU serves the warm-up iteration, when the future is unknown; Belady (evict the page whose next
use is farthest away) serves every later iteration, whose access sequence the recorded trace tells us.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from typing import Collection, Iterable, Protocol, Sequence


class RestingSet(set):
    """A tier's eviction candidates (the page ids resting there, unpinned), as the manager keeps them, with a log of
    the ids that joined since a policy last read it: a victim index then catches up with the joins instead of
    comparing every candidate on every eviction. The log holds each id once, so it is never larger than the
    number of pages."""

    __slots__ = ("_joined", "reader")

    def __init__(self, ids: Iterable[int] = ()):
        super().__init__(ids)
        self._joined: set[int] = set(self)
        self.reader = None  # who took the log last (a policy's index for one group): another reader missed joins

    def add(self, page_id: int) -> None:
        super().add(page_id)
        self._joined.add(page_id)

    def take_joined(self, reader=None) -> set[int]:
        """The ids added since the last call (some may have left again), and a fresh log; `reader` takes it."""
        joined, self._joined = self._joined, set()
        self.reader = reader
        return joined


class Policy(Protocol):
    def on_access(self, page_id: int) -> None: ...

    def victim(self, candidates: Collection[int], group=None, exclude: int | None = None) -> int: ...


class LRUPolicy:
    """Least recently used; a page never accessed counts as the oldest (ties: lowest page id).

    Given the manager's live `RestingSet`, a victim costs a few heap operations: a heap per group of (last use,
    page) entries, fed by the pages that joined the set since the group's last call; an entry whose page left the
    set, or was used since, is dropped (or renewed) when it comes to the top. Scanning every candidate instead
    cost ~1.6 million key reads a step on the MoE bench's on-demand run (550 candidates, 3,000 evictions), half of
    its step. Given any other collection, every candidate is compared."""

    name = "lru"

    def __init__(self):
        self._clock = 0
        self._last_use: dict[int, int] = {}
        self._heaps: dict = {}  # group -> heap of (last use when pushed, page)
        self._tokens: dict = {}  # group -> this policy's reader token for that group's RestingSet

    def on_access(self, page_id: int) -> None:
        self._clock += 1
        self._last_use[page_id] = self._clock

    def victim(self, candidates: Collection[int], group=None, exclude: int | None = None) -> int:
        if not isinstance(candidates, RestingSet):
            choices = [pid for pid in candidates if pid != exclude]
            if not choices:
                raise ValueError("no eviction candidates")
            return min(choices, key=self.recency)
        if not candidates or (exclude is not None and len(candidates) == 1 and exclude in candidates):
            raise ValueError("no eviction candidates")
        last_use = self._last_use
        token = self._tokens.setdefault(group, object())
        heap = self._heaps.get(group)
        if heap is None or candidates.reader is not token or len(heap) > 4 * len(candidates) + 1024:
            candidates.take_joined(token)  # (first call, another reader took the joins, or stale entries piled up)
            heap = self._heaps[group] = [(last_use.get(pid, 0), pid) for pid in candidates]
            heapq.heapify(heap)
        else:
            for pid in candidates.take_joined(token):
                if pid in candidates:
                    heapq.heappush(heap, (last_use.get(pid, 0), pid))

        def check(entry):
            key, pid = entry
            if pid not in candidates:
                return False  # left (pinned, moved): pushed again when it joins again
            now = last_use.get(pid, 0)
            return True if now == key else (now, pid)  # (used since, resting all along: renewed)

        return _first_kept(heap, check, exclude)

    def recency(self, page_id: int) -> tuple[int, int]:
        """(when the page was last accessed, its id): smaller is older (never accessed: the oldest)."""
        return self._last_use.get(page_id, 0), page_id


class BeladyPolicy:
    """Farthest next use, from a known future access sequence (page ids in acquire order).

    Accesses beyond the sequence, or deviating from it, still advance the clock, so a short deviation costs a few
    suboptimal choices, never a wrong answer. Ties (several pages never used again) fall back to LRU.
    """

    name = "belady"

    def __init__(self, future: Iterable[int] = (), history: LRUPolicy | None = None):
        """`history`: the recency of the accesses so far (a policy this one replaces keeps its memory)."""
        self.history = history if history is not None else LRUPolicy()
        self.set_future(future)

    def set_future(self, future: Iterable[int], start: int = 0) -> None:
        """Replace the known sequence; position `start` is the next access."""
        self._sequence = list(future)
        self._uses: dict[int, list[int]] = defaultdict(list)
        for position, page_id in enumerate(self._sequence):
            self._uses[page_id].append(position)
        self._now = start
        self.deviations = 0
        self._sequence_length = sum(len(v) for v in self._uses.values())
        self._reset_index()

    def _reset_index(self) -> None:
        """The victims' index (see `victim`), empty: it fills again from the next candidates."""
        self._stamp: dict[int, int] = {}  # page -> how often its key has changed (an entry with another is stale)
        self._heaps: dict = {}  # group -> heap of (negated key, stamp, page): the farthest next use on top
        self._expiry: dict = {}  # group -> heap of (next use, stamp, page): keys the clock will pass
        self._known: dict = {}  # group -> pages with a current entry in its heap
        self._rekeyed: dict = {}  # group -> pages rekeyed since its last victim (a fresh entry may be due)
        self._logs: dict = {}  # group -> the RestingSet whose joins it has read (its later joins are all it reads)

    def seek(self, position: int) -> None:
        """The next access is `position` of the known sequence (a scheduler keeps the clock in step with it)."""
        if position < self._now:  # the pages used in between have their next uses moved back: only their keys
            for page_id in set(self._sequence[max(0, position):self._now]):
                self._rekey(page_id)
        self._now = position

    def next_use(self, page_id: int) -> float:
        uses = self._uses.get(page_id)
        if not uses:
            return float("inf")
        i = bisect.bisect_left(uses, self._now)
        return uses[i] if i < len(uses) else float("inf")

    def on_access(self, page_id: int) -> None:
        uses = self._uses.get(page_id)
        if not uses or self._now >= self._sequence_length or not self._is_expected(page_id):
            self.deviations += 1
        self._now += 1
        self.history.on_access(page_id)
        self._rekey(page_id)

    def _rekey(self, page_id: int) -> None:
        """`page_id`'s key changed: its entries are stale, a fresh one is made when it is next a candidate."""
        self._stamp[page_id] = self._stamp.get(page_id, 0) + 1
        for known in self._known.values():
            known.discard(page_id)
        for rekeyed in self._rekeyed.values():
            rekeyed.add(page_id)

    def _is_expected(self, page_id: int) -> bool:
        uses = self._uses[page_id]
        i = bisect.bisect_left(uses, self._now)
        return i < len(uses) and uses[i] == self._now

    def victim(self, candidates: Collection[int], group=None, exclude: int | None = None) -> int:
        """Farthest next use first; among equals the least recently used; then the lowest id (deterministic);
        never `exclude`.

        This runs on every eviction and every look for room, over every unpinned page of a tier (`group`: which
        tier's, so each keeps its own index): a heap per group holds the candidates by key, each entry valid until
        the page is used (its next use moves on, its last use is now) or the clock passes its next use unused (a
        skipped access): then a fresh entry is pushed. A call costs a few heap operations, not a ranking of
        thousands of pages: given a `RestingSet` (the manager's own, live), only the pages that joined it or were
        rekeyed since the group's last call are looked at; given any other collection, every candidate is."""
        if not candidates or (exclude is not None and len(candidates) == 1 and exclude in candidates):
            raise ValueError("no eviction candidates")
        heap = self._heaps.setdefault(group, [])
        expiry = self._expiry.setdefault(group, [])
        known = self._known.setdefault(group, set())
        rekeyed = self._rekeyed.setdefault(group, set())
        stamps, now = self._stamp, self._now
        while expiry and expiry[0][0] < now:  # the clock passed these pages' next uses without them
            _, stamp, pid = heapq.heappop(expiry)
            if stamps.get(pid, 0) == stamp:
                self._rekey(pid)
        if isinstance(candidates, RestingSet) and self._logs.get(group) is candidates and \
                candidates.reader is self._logs:
            wanted = candidates
            joined = candidates.take_joined(self._logs)
            fresh = [pid for pid in (joined | rekeyed if rekeyed else joined) if pid in wanted and pid not in known]
        else:  # a collection of the caller's, or a resting set seen for the first time here: compare them all
            for other in [g for g, log in self._logs.items() if log is candidates or g == group]:
                del self._logs[other]  # (a log has one reader: another group reading it would miss joins)
            if isinstance(candidates, RestingSet):
                candidates.take_joined(self._logs)
                self._logs[group] = candidates
            wanted = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
            fresh = wanted - known
        rekeyed.clear()
        if len(heap) + len(expiry) > 4 * len(known) + 1024:  # stale entries pile up below the top: drop them
            heap[:] = [e for e in heap if e[2] in known and e[1] == stamps.get(e[2], 0)]
            expiry[:] = [e for e in expiry if e[2] in known and e[1] == stamps.get(e[2], 0)]
            heapq.heapify(heap)
            heapq.heapify(expiry)
        last_use = self.history._last_use
        for pid in fresh:
            nxt = self.next_use(pid)
            stamp = stamps.get(pid, 0)
            heapq.heappush(heap, ((-nxt, last_use.get(pid, 0), pid), stamp, pid))
            if nxt != float("inf"):
                heapq.heappush(expiry, (nxt, stamp, pid))
            known.add(pid)

        def check(entry):
            _, stamp, pid = entry
            if stamp != stamps.get(pid, 0):
                return False  # stale: a fresh entry exists, or will when the page is a candidate again
            if pid not in wanted:
                known.discard(pid)  # no longer a candidate here (moved, pinned): pushed again if it comes back
                return False
            return True

        return _first_kept(heap, check, exclude)


def _first_kept(heap: list, check, exclude: int | None) -> int:
    """The page (an entry's last field) of the first entry on top of `heap` that `check` keeps: check(entry) is
    True to take it, False to drop it, or an entry to put in its place; `exclude`'s entries are passed over and
    put back once the choice is made."""
    passed, found = [], None
    while heap:
        verdict = check(heap[0])
        if verdict is False:
            heapq.heappop(heap)
        elif verdict is not True:
            heapq.heapreplace(heap, verdict)
        elif heap[0][-1] == exclude:
            passed.append(heapq.heappop(heap))
        else:
            found = heap[0][-1]
            break
    for entry in passed:
        heapq.heappush(heap, entry)
    if found is None:
        raise AssertionError("every candidate has an entry")  # (each pushed as it joined)
    return found


def count_misses(policy: Policy, sequence: Sequence[int], capacity: int) -> int:
    """Misses of a cache of `capacity` pages driven by `policy` over `sequence` (a reference simulation)."""
    resident: set[int] = set()
    misses = 0
    for page_id in sequence:
        if page_id not in resident:
            misses += 1
            if len(resident) >= capacity:
                resident.remove(policy.victim(sorted(resident)))
            resident.add(page_id)
        policy.on_access(page_id)
    return misses
