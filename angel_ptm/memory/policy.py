"""Eviction policies: which resting, unpinned page leaves a full tier.

The PageManager tells the policy every access (`on_access`, in acquire order) and asks it for a victim among
the candidates. LRU serves the warm-up iteration, when the future is unknown; Belady (evict the page whose next
use is farthest away) serves every later iteration, whose access sequence the recorded trace tells us.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Iterable, Protocol, Sequence


class Policy(Protocol):
    def on_access(self, page_id: int) -> None: ...

    def victim(self, candidates: Sequence[int]) -> int: ...


class LRUPolicy:
    """Least recently used; a page never accessed counts as the oldest (ties: lowest page id)."""

    name = "lru"

    def __init__(self):
        self._clock = 0
        self._last_use: dict[int, int] = {}

    def on_access(self, page_id: int) -> None:
        self._clock += 1
        self._last_use[page_id] = self._clock

    def victim(self, candidates: Sequence[int]) -> int:
        if not candidates:
            raise ValueError("no eviction candidates")
        return min(candidates, key=self.recency)

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
        self._uses: dict[int, list[int]] = defaultdict(list)
        for position, page_id in enumerate(future):
            self._uses[page_id].append(position)
        self._now = start
        self.deviations = 0
        self._sequence_length = sum(len(v) for v in self._uses.values())
        # page -> its next use as last found (at a clock no later than now): still its next use until the clock
        # passes it; cleared when the clock goes back
        self._next: dict[int, float] = {}
        # the last ranking of candidates (best first), and the clock it holds at (victim())
        self._ranking: list[int] = []
        self._ranked: set[int] = set()
        self._ranked_at: tuple | None = None

    def seek(self, position: int) -> None:
        """The next access is `position` of the known sequence (a scheduler keeps the clock in step with it)."""
        if position < self._now:
            self._next = {}
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

    def _is_expected(self, page_id: int) -> bool:
        uses = self._uses[page_id]
        i = bisect.bisect_left(uses, self._now)
        return i < len(uses) and uses[i] == self._now

    def victim(self, candidates: Sequence[int]) -> int:
        if not candidates:
            raise ValueError("no eviction candidates")
        # Farthest next use first; among equals the least recently used; then the lowest id (deterministic).
        # This runs on every eviction (and every look for room), over every unpinned page of the tier; most calls
        # come at the same clock as the one before (several evictions between two accesses), when every key is
        # what it was: then the answer is the first page of that call's ranking that is still a candidate.
        state = (self._now, self.history._clock)  # (set_future starts the ranking over)
        if state == self._ranked_at and self._ranked.issuperset(candidates):
            wanted = set(candidates)
            for pid in self._ranking:
                if pid in wanted:
                    return pid
        # A page's next use is found once and kept until the clock passes it (or goes back).
        uses, now, cached, last_use = self._uses, self._now, self._next, self.history._last_use
        inf = float("inf")
        keys = []
        for pid in candidates:
            nxt = cached.get(pid)
            if nxt is None or nxt < now:
                page_uses = uses.get(pid)
                i = bisect.bisect_left(page_uses, now) if page_uses else 0
                nxt = cached[pid] = page_uses[i] if page_uses and i < len(page_uses) else inf
            keys.append((nxt, -last_use.get(pid, 0), -pid))
        keys.sort(reverse=True)
        self._ranking = [-key[2] for key in keys]
        self._ranked, self._ranked_at = set(self._ranking), state
        return self._ranking[0]


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
