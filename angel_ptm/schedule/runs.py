"""Runs of optional accesses in a plan, made in any order.

An MoE layer runs its routed experts in an order of its own choosing (models/moe.py `expert_order`; the paging
runtime's is units.resident_first), and autograd runs their backwards in the reverse of it. In the plan, each layer's
experts are a run of consecutive optional accesses (schedule/trace.py: a superset in a fixed order). `OptionalRuns`
lets the scheduler match an access anywhere in the run it is in, not only at the plan's position: a step that runs
a layer's experts in another order makes no deviation and no re-plan, and the moves planned for the accesses it has
not made yet stay queued.

    runs = OptionalRuns(keys, optional)      # per plan: which plan positions form runs
    runs.begin_step()
    p = runs.find(positions_of_key)          # an access not made yet of the run under way, or None
    runs.made(p, cursor)                     # every matched position, in the order made
    low = runs.low(cursor, skip)             # the first position still to come: the plan's "now"
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence


class OptionalRuns:
    """The runs of a plan's accesses (`keys`, `optional(ids)`: whether an access's pages are all optional) and the
    positions of the run under way made so far in this step."""

    def __init__(self, keys: Sequence[tuple], optional: Callable[[Sequence[int]], bool]):
        self.start_of: list[int] = []  # plan position -> the first position of its run (-1: not optional)
        self.end_of: dict[int, int] = {}  # a run's first position -> the position after its last
        start = -1
        for index, key in enumerate(keys):
            if optional(key[0]):
                if start < 0:
                    start = index
                self.end_of[start] = index + 1
            else:
                start = -1
            self.start_of.append(start)
        self.total = sum(end - start for start, end in self.end_of.items())  # optional accesses planned
        self.begin_step()

    def begin_step(self) -> None:
        self.start = -1  # the run under way (its first position), -1: none
        self._made: set[int] = set()  # its positions made so far
        self._first = 0  # no position of the run under way before it is still to come
        self.matched = 0  # optional positions made this step
        self.reordered = 0  # of them, made after a later one of their run

    def find(self, positions: Sequence[int]) -> int | None:
        """The first of `positions` (sorted: where the plan has an access's key) in the run under way that was not
        made yet, or None."""
        if self.start < 0 or not positions:
            return None
        end = self.end_of[self.start]
        i = bisect.bisect_left(positions, self.start)
        while i < len(positions) and positions[i] < end:
            if positions[i] not in self._made:
                return positions[i]
            i += 1
        return None

    def made(self, position: int, cursor: int) -> None:
        """Plan position `position` was matched while the plan's position (one past the furthest made) was
        `cursor`."""
        start = self.start_of[position] if position < len(self.start_of) else -1
        if start < 0:
            self.start = -1
            return
        if start != self.start:
            self.start, self._made, self._first = start, set(), start
        self._made.add(position)
        self.matched += 1
        if position < cursor:
            self.reordered += 1

    def low(self, cursor: int, skip: Callable[[int], bool]) -> int:
        """The first position still to come: the lowest one of the run under way before `cursor` not made (nor
        `skip`ped: an expert the gate routed nothing to), else `cursor`."""
        if self.start < 0:
            return cursor
        end = min(cursor, self.end_of[self.start])
        while self._first < end and (self._first in self._made or skip(self._first)):
            self._first += 1  # (within a run, what is made or skipped stays so: each position looked at once)
        return self._first if self._first < end else cursor
