"""The executor's non-blocking moves, as the PageManager makes them (mixed into it): one hop of a page toward a
tier started without waiting, room made on a full tier by starting the eviction Belady's rule picks, and moves
whose transfer finished settled."""

from __future__ import annotations

from angel_ptm.memory.moves import Hop
from angel_ptm.memory.page import Page, PageState, Tier


class NonBlockingMoves:
    def try_hop(self, page: Page, dst: Tier, need: float | None = None) -> Hop:
        """Start one hop of `page` toward `dst` (up: disk->host, host->device; down: device->host, host->disk)
        without waiting: BLOCKED when the page is moving or the next tier has no free slot yet.

        With `need` (the position in the policy's known future at which the page is needed), a full tier makes
        room: the eviction of a resting, unpinned page whose next use comes after `need` is started (also without
        waiting), and the hop itself starts on a later call, once that slot is free."""
        if page.state is PageState.REMOTE or page.home is not None:
            return Hop.NOTHING  # a copy of another rank's page: its holder (the ZeRO gatherer) moves it
        if page.state.in_flight:
            move = self._moves.get(page.id)
            if move is not None and move.done():
                self._wait_move(page)
            else:
                return Hop.BLOCKED
        order = (Tier.DISK, Tier.HOST, Tier.DEVICE)
        here, there = order.index(page.tier), order.index(dst)
        if here == there:
            return Hop.NOTHING
        if here < there:  # up
            if page.pin_count:
                return Hop.BLOCKED  # in use where it is: its holder's views must stay valid
            step_to = dst if page.dead and page.state is PageState.DISK else order[here + 1]
            # A read into the host leaves its last slot free: a page that must come up to the device displaces one
            # there, which needs a host slot (prefetched reads filling the host deadlocked a tight host tier)
            reserve = 1 if step_to is Tier.HOST else 0
            if self.pools[step_to].free_slots <= reserve:
                if need is not None and not self.make_room_async(step_to, need, keep=page):
                    return Hop.FULL
                if need is None or self.pools[step_to].free_slots <= reserve:
                    return Hop.BLOCKED  # the eviction under way frees the slot later (a drop frees it at once)
            if page.dead and page.state is PageState.DISK:
                self._materialize(page, step_to)
            else:
                self._start_up(page)
            return Hop.STARTED
        if page.pin_count:  # down, but in use: the plan and the step disagree; leave it
            return Hop.NOTHING
        if page.tier is Tier.DEVICE and not page.droppable and self.pools[Tier.HOST].free_slots == 0:
            return Hop.BLOCKED
        if page.tier is Tier.HOST and self.disk is None:
            return Hop.NOTHING
        self._start_down(page, wait_for_room=False, target=dst)
        return Hop.STARTED

    def leaving(self, tier: Tier) -> int:
        """Moves under way out of `tier` (each frees a slot there when it lands)."""
        return self._leaving[tier]  # (kept as moves begin and settle: this is asked for every fetch a pump looks at)

    def make_room_async(self, tier: Tier, need: float, keep: Page | None = None) -> bool:
        """Start evicting one page from `tier` whose next use is after `need` (Belady's choice among them);
        False if there is none."""
        next_use = getattr(self.policy, "next_use", None)
        if next_use is None:
            return False
        candidates = self._candidates(tier)
        exclude = keep.id if keep is not None else None
        if not candidates or (len(candidates) == 1 and exclude in candidates):
            return False
        victim = self.pages[self.policy.victim(candidates, tier, exclude=exclude)]
        if next_use(victim.id) <= need:
            return False  # everything here is needed sooner than the page we would make room for
        if tier is Tier.DEVICE and not victim.droppable and self.pools[Tier.HOST].free_slots == 0:
            return self.make_room_async(Tier.HOST, need, keep)  # the victim needs a host slot first
        if tier is Tier.HOST and not victim.droppable and self.disk is None:
            return False
        self._emit("evict", victim, tier, Tier.HOST if tier is Tier.DEVICE else Tier.DISK)
        self._start_down(victim, wait_for_room=False)
        return True

    def poll(self) -> int:
        """Settle every move whose transfer has finished, without waiting for the others; how many settled."""
        finished = [move.page for move in self._moves.values() if move.done()]
        for page in finished:
            self._wait_move(page)
        return len(finished)
