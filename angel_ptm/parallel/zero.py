"""ZeRO over page groups: the collectives of a data-parallel step, on pages (parallel/ownership.py says who holds
what).

    gatherer = ParamGatherer(manager, param_pages, collectives, ownership, capacity_groups)   # stage 3
    gatherer.acquire(pages, Tier.DEVICE, label)    # every group of `pages` gathered, then pinned as usual
    sync = GradSync(manager, layout, pages, collectives, ownership, update_tier)
    sync.reduce(without_grad)                      # after the last backward: owners hold the mean gradient
    sync.publish_params()                          # after the update: every rank computes with the new weights

Every decision that issues a collective is a function of state that is the same on every rank (the model's
access sequence, the agreed set of tensors with a gradient, group indices), never of this rank's residency or
timing, so all ranks issue the same collectives in the same order. Gathered groups are kept in a deterministic
LRU of `capacity` groups (their remote pages pinned while held), so a unit's backward finds its groups still
there without a second all-gather; a group is dropped only by that LRU or at the end of the step.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, OrderedDict
from typing import Sequence

import torch

from angel_ptm.memory import Page, PageLayout, PageManager, Tier
from angel_ptm.parallel.collectives import MAX
from angel_ptm.schedule.communicator import Communicator
from angel_ptm.parallel.ownership import Ownership


class ParamGatherer:
    """Stage 3: a unit's parameter pages that other ranks own are all-gathered (by page group) before it computes.

    The first step records the sequence of group accesses (the same on every rank: the model's unit order). Later
    steps follow it: after each access the gatherer starts the all-gathers of the groups the next accesses need
    (asynchronously: the communication runs while this unit computes), as far as `capacity` groups allow, making
    room by dropping the held group whose next use is farthest. A step that leaves the recording (an evaluation
    pass, data-dependent control flow) gathers on demand for the rest of that step. The step's end drops every
    group (the owners' pages changed) and starts gathering the first groups of the next step."""

    LOOKAHEAD = 8  # accesses ahead whose groups may be gathered early

    def __init__(self, manager: PageManager, param_pages: list[Page], collectives: Communicator,
                 ownership: Ownership, capacity: int, access, tier: Tier = Tier.DEVICE):
        self.manager, self.param_pages, self.comm, self.own = manager, param_pages, collectives, ownership
        self.access = access  # the scheduler: the step's accesses go through it
        self.capacity = max(1, capacity)
        self.tier = tier
        self.dp = ownership.dp
        self.held: OrderedDict[int, list[Page]] = OrderedDict()  # group -> its remote pages held here, LRU first
        self.pending: dict[int, tuple[object, Page]] = {}  # group -> (its all-gather in flight, the owned page)
        self.gathers = 0  # all-gathers issued, cumulative
        self.prefetched = 0  # of them, issued ahead of their access
        self._in_use: Counter = Counter()  # group -> pages of it acquired through this gatherer and not released
        self._recording: list[tuple[int, ...]] | None = []  # the first step's group accesses, while recorded
        self._sequence: list[tuple[int, ...]] = []
        self._uses: dict[int, list[int]] = {}  # group -> positions in the sequence
        self._cursor = 0
        self._following = False

    def acquire(self, pages: Sequence[Page], tier: Tier = Tier.DEVICE, label: str | None = None) -> None:
        groups = tuple(dict.fromkeys(page.index // self.dp for page in pages))
        self._advance(groups)
        for group in groups:
            if group in self.held:
                self.held.move_to_end(group)
                self._settle(group)
            else:
                self._make_room(keep=groups)
                self._start(group)
                self._settle(group)
        self.access.acquire(pages, tier, label=label)
        for page in pages:
            self._in_use[page.index // self.dp] += 1
        if self._following:
            self._prefetch()

    def release(self, pages: Sequence[Page]) -> None:
        self.access.release(pages)
        for page in pages:
            self._in_use[page.index // self.dp] -= 1

    def _advance(self, groups: tuple[int, ...]) -> None:
        """Follow the recorded sequence: this access is the next one, or the step has left it."""
        if self._recording is not None:
            self._recording.append(groups)
        elif self._following:
            if self._cursor < len(self._sequence) and self._sequence[self._cursor] == groups:
                self._cursor += 1
            else:
                self._following = False

    def _next_use(self, group: int) -> float:
        uses = self._uses.get(group, ())
        i = bisect.bisect_left(uses, self._cursor)
        return uses[i] if i < len(uses) else float("inf")

    def _make_room(self, keep: Sequence[int], before: float = float("inf")) -> bool:
        """Drop held groups until fewer than `capacity` are held: the one used farthest ahead (least recently used
        when not following the recording) that is neither in use (counted by group, so the same on every rank,
        whichever page of it a rank owns), in flight, nor needed by this access; with `before`, only one whose next
        use comes after that position. False if none could go: the capacity is a target, not a hard bound."""
        while len(self.held) >= self.capacity:
            victims = [g for g in self.held if g not in keep and not self._in_use[g] and g not in self.pending]
            if self._following:
                if before != float("inf"):  # a prefetch: only for a group needed sooner than the victim
                    victims = [g for g in victims if self._next_use(g) > before]
                victims.sort(key=lambda g: -self._next_use(g))  # stable: among equals, least recently used first
            if not victims:
                return False
            self.manager.drop_remote(self.held.pop(victims[0]))
        return True

    def _prefetch(self) -> None:
        last = min(len(self._sequence), self._cursor + self.LOOKAHEAD)
        for position in range(self._cursor, last):
            for group in self._sequence[position]:
                if group in self.held:
                    continue
                if not self._make_room(keep=self._sequence[position], before=position):
                    return
                self._start(group)
                self.prefetched += 1

    def _start(self, group: int) -> None:
        """Issue the all-gather of `group` into slots held for its remote pages (the owned page stays pinned as its
        input until the gather has landed)."""
        first = group * self.dp
        pages = self.param_pages[first : first + self.dp]
        own = pages[self.own.rank]
        remote = [page for page in pages if page is not own]
        self.manager.acquire([own], self.tier)
        try:
            self.manager.hold_remote(remote, self.tier)
        except BaseException:
            self.manager.release([own])
            raise
        self.held[group] = remote
        handle = self.comm.all_gather([page.buffer for page in pages], own.buffer, what=f"param group {group}",
                                      async_op=True)
        self.pending[group] = (handle, own)
        self.gathers += 1

    def _settle(self, group: int) -> None:
        entry = self.pending.pop(group, None)
        if entry is not None:
            handle, own = entry
            try:
                handle.wait()
            finally:
                self.manager.release([own])

    def drop_all(self) -> None:
        """Drop every held group (once its gather has landed)."""
        for group in list(self.pending):
            self._settle(group)
        while self.held:
            _, remote = self.held.popitem(last=False)
            self.manager.drop_remote(remote)

    def clear(self) -> None:
        """The step is over (the owners' pages changed): drop every held group, then start gathering the first
        groups of the next step."""
        self.drop_all()
        if self._recording is not None:
            self._sequence, self._recording = self._recording, None
            for position, groups in enumerate(self._sequence):
                for group in groups:
                    self._uses.setdefault(group, []).append(position)
        self._cursor, self._following = 0, bool(self._sequence)
        if self._following:
            self._prefetch()


class GradSync:
    """The gradient side of a data-parallel step and the parameter publication after it."""

    def __init__(self, manager: PageManager, layout: PageLayout, pages: dict[str, list[Page | None]],
                 collectives: Communicator, ownership: Ownership, tier: Tier):
        self.manager, self.layout, self.pages, self.comm, self.own = manager, layout, pages, collectives, ownership
        self.tier = tier  # where pages are pinned for a collective (the optimizer's update tier)
        self.dp = ownership.dp
        self._on: list[list[str]] = [[] for _ in range(layout.n_pages)]  # tensor names on each page
        for slot in layout.slots:
            for seg in slot.segments:
                self._on[seg.page].append(slot.name)
        self._scratch: dict = {}

    # ------------------------------------------------------------------ agreement
    def agree_without_grad(self, local_without: set[str]) -> set[str]:
        """The tensors no rank gave a gradient (MAX over ranks of 'has one'). A tensor that got one elsewhere but not
        here has its regions zeroed here, so the reduction adds nothing for this rank."""
        slots = self.layout.slots
        has = torch.tensor([0.0 if s.name in local_without else 1.0 for s in slots], dtype=torch.float32)
        self.comm.all_reduce(has, "which tensors have a gradient", op=MAX)
        without = {s.name for s, flag in zip(slots, has.tolist()) if flag == 0.0}
        for slot in slots:
            if slot.name in local_without and slot.name not in without and not self.layout.frozen(slot):
                self._zero_region(slot)
        return without

    def _zero_region(self, slot) -> None:
        for seg in slot.segments:
            page = self.pages["grad"][seg.page]
            self.manager.acquire([page], self.tier)
            page.view(slot.dtype)[seg.offset : seg.offset + seg.numel].zero_()
            self.manager.release([page], dirty=True)

    def agree_flag(self, flag: bool, what: str) -> bool:
        """True on every rank if it is true on any (an fp16 overflow anywhere skips the step everywhere)."""
        value = torch.tensor([1.0 if flag else 0.0])
        self.comm.all_reduce(value, what, op=MAX)
        return bool(value.item())

    def mean_over_ranks(self, value: float, what: str) -> float:
        box = torch.tensor([value], dtype=torch.float64)
        self.comm.all_reduce(box, what)
        return float(box.item()) / self.dp

    # ------------------------------------------------------------------ gradients
    def reduce(self, without_grad: set[str]) -> None:
        """Every gradient page's owner gets the mean over ranks (fp32 reduction whatever the compute dtype); stage 0
        all-reduces, so every rank gets every page; stages 1-3 drop the pages they do not own, unwritten."""
        n = self.layout.trainable_pages
        needed = [any(name not in without_grad for name in self._on[i]) for i in range(n)]
        grads = self.pages["grad"]
        for first in range(0, n, self.dp):  # the trainable pages are whole groups (the layout pads them)
            group = list(range(first, first + self.dp))
            if not any(needed[i] for i in group):
                continue
            if self.own.stage <= 1:
                for i in group:
                    if needed[i]:
                        self._all_reduce_page(grads[i], i)
            else:
                self._reduce_scatter_group(group, needed)
        if self.own.stage >= 1:
            self.manager.discard([grads[i] for i in range(n) if not self.own.owns(i) and not grads[i].dead
                                  and not grads[i].pin_count])

    def _wide(self, index: int, key) -> torch.Tensor:
        numel = self.layout.page_numel(index)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[key] = torch.empty(numel, dtype=torch.float32,
                                                      device=self.manager.pools[self.tier].device)
        return buffer[:numel]

    def _all_reduce_page(self, page: Page, index: int) -> None:
        self.manager.acquire([page], self.tier)
        try:
            view = page.view(self.layout.page_dtypes[index])[: self.layout.page_numel(index)]
            if view.dtype == torch.float32:
                self.comm.all_reduce(view, f"grad page {index}")
                view.mul_(1.0 / self.dp)
            else:
                wide = self._wide(index, "out").copy_(view)
                self.comm.all_reduce(wide, f"grad page {index}")
                view.copy_(wide.mul_(1.0 / self.dp))
        finally:
            self.manager.release([page], dirty=True)

    def _reduce_scatter_group(self, group: list[int], needed: list[bool]) -> None:
        grads = self.pages["grad"]
        live = [grads[i] for i in group if needed[i]]
        self.manager.acquire(live, self.tier)
        try:
            inputs = []
            for k, i in enumerate(group):
                if not needed[i]:
                    inputs.append(self._wide(i, ("zero", k)).zero_())
                    continue
                view = grads[i].view(self.layout.page_dtypes[i])[: self.layout.page_numel(i)]
                inputs.append(view if view.dtype == torch.float32 else self._wide(i, ("in", k)).copy_(view))
            mine = group[self.own.rank]
            out = self._wide(mine, "out")
            self.comm.reduce_scatter(out, inputs, what=f"grad group {group[0] // self.dp}")
            if needed[mine]:
                view = grads[mine].view(self.layout.page_dtypes[mine])[: self.layout.page_numel(mine)]
                view.copy_(out.mul_(1.0 / self.dp))
        finally:
            self.manager.release(live, dirty=True)

    def grad_norm(self, squares: dict[int, float]) -> float:
        """The global L2 norm from each page's sum of squares (`squares`: this rank's updated pages). Pages are
        summed exactly (math.fsum), so the result does not depend on which rank summed which page."""
        n = self.layout.trainable_pages
        if self.own.stage == 0:  # every rank reduced and holds every page: nothing to exchange
            return math.sqrt(math.fsum(squares.values()))
        vector = torch.zeros(n, dtype=torch.float64)
        for index, value in squares.items():
            vector[index] = value
        self.comm.all_reduce(vector, "gradient norm")
        return math.sqrt(math.fsum(vector.tolist()))

    # ------------------------------------------------------------------ parameters
    def publish_params(self) -> None:
        """Stages 1 and 2: the owners' updated parameter pages, all-gathered group by group into every rank's."""
        if self.own.stage not in (1, 2):
            return
        params = self.pages["param"]
        n = self.layout.trainable_pages
        for first in range(0, n, self.dp):
            pages = params[first : first + self.dp]
            self.manager.acquire(pages, self.tier)
            try:
                own = pages[self.own.rank]
                self.comm.all_gather([p.buffer for p in pages], own.buffer, what=f"param group {first // self.dp}")
            finally:
                self.manager.release(pages, dirty=True)
