"""ZeRO's gradient side: agreement, the reduction onto the owners (during backward where it can), the norm, and the
publication of updated parameters (parallel/ownership.py says who holds what; parallel/zero.py gathers parameters).

    sync = GradSync(manager, layout, pages, collectives, ownership, update_tier, overlap=True)
    sync.begin_backward()           # the step's last backward starts
    sync.page_final(index)          # every gradient on page `index` is in: its group's reduction may start
    sync.take_landed()              # groups whose reduction has landed since (their owner may update them now)
    sync.end_backward()
    without = sync.agree_without_grad(local_without)   # after the last backward, on every rank
    sync.reduce(without)            # the rest of the reductions, then every one landed
    sync.publish_params()           # stages 1-2, after the update: every rank computes with the new weights

Reductions during backward (stages 2 and 3, over a communicator with asynchronous reduce-scatters) keep DDP's rule:
they are issued in one order agreed by every rank — the order the groups' gradients became final in the previous
step (its latest position over ranks, agreed with the tensors that got a gradient) — a group only once every page
of it is final here and every group before it was issued. A rank where a group is late (a tensor got no gradient
here) issues it, and the ones after it, once backward is over, after the agreement zeroed what it lacks: the
reductions come in the same order on every rank, only later there. They run on their own tags, and nothing waits on
one during backward (a landed one is noticed by polling), so no rank ever blocks on a reduction another rank issues
only after a collective this rank has not reached.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from angel_ptm.memory import Page, PageLayout, PageManager, Tier
from angel_ptm.parallel.collectives import MAX
from angel_ptm.parallel.ownership import Ownership
from angel_ptm.schedule.communicator import Communicator


def reduction_buffer_bytes(dp: int, stage: int, page_bytes: int, local_dp: int = 1) -> int:
    """Bytes of the reduce-scatters' own buffers at most (stages 2-3, outside the page pools, on the collectives'
    device): per reduction in flight, the group's dp staged gradients, its result and dp - 1 received pages, fp32
    copies of at most a page each; with ep < dp (`local_dp` ranks holding the same experts) as many expert group
    reductions again, of local_dp pages (parallel/expert_grads.py). The estimate counts them."""
    if stage < 2 or dp <= 1:
        return 0
    return GradSync.IN_FLIGHT * 2 * (dp + (local_dp if local_dp > 1 else 0)) * page_bytes


@dataclass
class _Reduction:
    """A group's reduce-scatter in flight and the buffers it reads (`staged`) and writes (`out`)."""
    group: int
    pending: object
    out: torch.Tensor
    staged: list[torch.Tensor]  # fp32 copies of the group's gradients
    write: bool  # this rank's page of the group has tensors: the mean lands in it
    issued_at: int  # the gradient event it was issued at


class GradSync:
    """The gradient side of a data-parallel step and the parameter publication after it."""

    IN_FLIGHT = 4  # reductions in flight at once, at most (each holds dp + 1 page-sized fp32 buffers)
    # A reduction issued during backward lands `LAG` gradient events later, waiting for it then up to 8 times what
    # one takes on this link (a running mean of those landed during backward), at least `PATIENCE_S`:
    # at the same point of every step, so the owner's update comes at the same place in the step's page accesses
    # and the scheduler's plan holds. A reduction not done by then (a peer is late: a tensor got no gradient there)
    # ends the waiting for this step: later ones land when done, noticed by polling.
    LAG = 2
    PATIENCE_S = 0.05

    def __init__(self, manager: PageManager, layout: PageLayout, pages: dict[str, list[Page | None]],
                 collectives: Communicator, ownership: Ownership, tier: Tier, overlap: bool = False,
                 replicas: Communicator | None = None):
        self.manager, self.layout, self.pages, self.comm, self.own = manager, layout, pages, collectives, ownership
        # ep < dp: the ranks holding the same experts (each expert-parallel group has every expert once); the
        # rank-local pages' gradients are all-reduced over them, as their "which got a gradient" is agreed
        self.replicas = replicas
        self.n_replicas = replicas.size if replicas is not None else 1
        self.tier = tier  # where pages are pinned for a collective (the optimizer's update tier)
        self.dp = ownership.dp
        self._on: list[list[str]] = [[] for _ in range(layout.n_pages)]  # tensor names on each page
        for slot in layout.slots:
            for seg in slot.segments:
                self._on[seg.page].append(slot.name)
        # The shared trainable pages are whole groups (the layout pads them); rank-local ones (expert parallelism)
        # follow and are never reduced: each rank's are its own experts, scaled by 1/dp like a mean (reduce()).
        self.n_shared = layout.shared_trainable_pages
        self.n_groups = self.n_shared // self.dp
        self.overlap = overlap and ownership.stage >= 2 and self.dp > 1  # reductions during backward
        self._order: list[int] | None = None  # the agreed reduction order (None: not known yet, layout order)
        self._next_order: list[int] | None = None  # agreed for the next step
        self._open = False  # in the last backward: groups are issued as they become final
        self.reductions_open = False  # from the last backward's start to the end of its reduction
        self._left: list[int] = []  # per group: its pages with tensors whose gradients are not final yet
        self._final_at: dict[int, int] = {}  # group -> the position it became final this step (here)
        self._issued = 0  # groups of the order issued this step
        self._flight: deque[_Reduction] = deque()
        self._landed: list[int] = []  # landed during backward, not taken yet
        self._events = 0  # gradient events (take_landed calls) in this backward
        # optimizer.staleness 1 (step.py): called with a gradient page's index before a reduction writes into it,
        # so the update still pending on the page reads the previous step's gradient first. A page this rank wrote
        # no gradient into in this step (an expert its tokens never reached, a tensor used on other ranks only)
        # takes the mean of the others' without any write of its own running that update before.
        self.before_write: Callable[[int], None] | None = None
        self._patient = True  # this backward still waits for reductions at their landing point
        self._typical_s = 0.0  # a running mean of the seconds from issue to landing, during backward
        self._zero_page: torch.Tensor | None = None
        self._spare: list[torch.Tensor] = []  # fp32 page buffers for reductions in flight
        self.overlapped = 0  # reductions issued during backward, cumulative (the bench reports it)
        # ZeRO-2 for the experts (ep < dp, stage >= 2): their groups reduced during backward too, from MoE layer
        # hooks (parallel/expert_grads.py: made by step.build_step, which has the model)
        self.expert_overlap = (self.overlap and replicas is not None and ownership.stage >= 2
                               and ownership.sharded_local("master"))
        self.expert_reductions = None

    # ------------------------------------------------------------------ agreement
    def agree_without_grad(self, local_without: set[str]) -> set[str]:
        """The tensors no rank gave a gradient (MAX over ranks of 'has one'). A tensor that got one elsewhere but not
        here has its regions zeroed here, so the reduction adds nothing for this rank. The same all-reduce agrees
        next step's reduction order (each group's latest position over ranks)."""
        slots = self.layout.slots
        own = [self.layout.is_local(s.segments[0].page) for s in slots]  # rank-local: no agreement, no zeroing
        positions = [float(self._final_at.get(g, self.n_groups)) for g in range(self.n_groups)]
        vector = torch.tensor([0.0 if s.name in local_without else 1.0 for s in slots] + positions,
                              dtype=torch.float32)
        self.comm.all_reduce(vector, "which tensors have a gradient", op=MAX)
        flags, latest = vector[: len(slots)].tolist(), vector[len(slots):].tolist()
        if self.overlap:  # in force from the next step's backward (this step's finishes in the order it began)
            self._next_order = sorted(range(self.n_groups), key=lambda g: (latest[g], g))
            self._final_at = {}
        without = {s.name for s, flag, mine in zip(slots, flags, own) if flag == 0.0 and not mine}
        local = [s for s, mine in zip(slots, own) if mine]
        if self.replicas is not None and local:  # the same experts' tensors: agreed over the ranks holding them
            held = torch.tensor([0.0 if s.name in local_without else 1.0 for s in local], dtype=torch.float32)
            self.replicas.all_reduce(held, "which experts' tensors have a gradient", op=MAX)
            without |= {s.name for s, flag in zip(local, held.tolist()) if flag == 0.0}
        else:
            without |= {s.name for s in local if s.name in local_without}
        for slot in slots:
            if slot.name in local_without and slot.name not in without and not self.layout.frozen(slot):
                self._zero_region(slot)
        return without

    def _zero_region(self, slot) -> None:
        experts = self.expert_reductions
        for seg in slot.segments:
            if experts is not None and self.layout.is_local(seg.page) and experts.covers(seg.page):
                continue  # reduced during backward (its staged copy had zeros there): the owner holds the mean
            page = self.pages["grad"][seg.page]
            self._writing(seg.page)
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

    # ------------------------------------------------------------------ reductions during backward
    def begin_backward(self) -> None:
        """The step's last backward starts: gradients become final from now on."""
        if not self.overlap:
            return
        self._open = self.reductions_open = True
        if self.expert_reductions is not None:
            self.expert_reductions.begin_backward()
        self._final_at, self._issued, self._landed = {}, 0, []
        self._events, self._patient = 0, True
        self._left = [sum(1 for i in self._group(g) if self._on[i]) for g in range(self.n_groups)]

    def page_final(self, index: int) -> None:
        """Every gradient on page `index` is in (last backward): once its whole group is, the group's reduction may
        start (in the agreed order)."""
        if not self._open or index >= self.n_shared:
            return
        group = index // self.dp
        self._left[group] -= 1
        if self._left[group] == 0:
            self._final_at[group] = len(self._final_at)
        self._pump()

    def take_landed(self) -> list[int]:
        """Groups whose reduction landed since the last call (their owner holds the mean gradient now). Called at
        every gradient event of the last backward: the reductions due land (`LAG`), then the next ones start."""
        self._events += 1
        while self._flight and self._patient and self._flight[0].issued_at <= self._events - self.LAG:
            self._land_due(self._flight[0])
        if not self._patient:  # not at fixed points any more: whatever is done
            self._land(block=False)
        if self._open:
            self._pump()
        if self.expert_reductions is not None:
            self.expert_reductions.land(block=False)
        landed, self._landed = self._landed, []
        return landed

    def _land_due(self, red: "_Reduction") -> None:
        """Wait for the oldest reduction up to its patience; land it, or stop waiting for this step."""
        if red.pending.done() or red.pending.wait_for(max(self.PATIENCE_S, 8 * self._typical_s)):
            self._land_one(self._flight.popleft())
        else:
            self._patient = False

    def end_backward(self) -> None:
        self._open = False
        if self.expert_reductions is not None:
            self.expert_reductions.end_backward()

    def _pump(self) -> None:
        """Issue the next groups of the agreed order while they are final here and room allows."""
        if self._order is None:
            return
        while self._issued < len(self._order) and self._order[self._issued] in self._final_at:
            group = self._order[self._issued]
            if len(self._flight) >= self.IN_FLIGHT:
                if self._patient:
                    self._land_due(self._flight[0])
                else:
                    self._land(block=False)
                if len(self._flight) >= self.IN_FLIGHT:
                    return
            self._issued += 1
            self._issue(group, [bool(self._on[i]) for i in self._group(group)])
            self.overlapped += 1

    # ------------------------------------------------------------------ gradients
    def reduce(self, without_grad: set[str]) -> None:
        """Every gradient page's owner gets the mean over ranks (fp32 reduction whatever the compute dtype); stage 0
        all-reduces, so every rank gets every page; stages 1-3 reduce-scatter (only the owner's update reads a
        page's mean) and drop the pages they do not own, unwritten. Reductions already issued during backward
        (stages 2-3) are landed; the rest are issued in the agreed order."""
        n = self.n_shared
        needed = [any(name not in without_grad for name in self._on[i]) for i in range(self.layout.trainable_pages)]
        grads = self.pages["grad"]
        if self.own.sharded_local("master"):  # ep < dp, stage >= 1: each expert page's mean onto its owner only
            self._reduce_local(needed)
        else:
            for i in range(n, self.layout.trainable_pages):  # rank-local: this rank's tokens' and the others' sums
                if needed[i] and self.replicas is not None:  # (and the other expert-parallel groups' sums)
                    self._all_reduce_page(grads[i], i, self.replicas)
                elif needed[i]:
                    self._scale_page(grads[i], i, 1.0 / self.dp)
        if self.own.stage == 0:
            for i in range(n):
                if needed[i]:
                    self._all_reduce_page(grads[i], i)
        else:
            order = self._order if self._order is not None else range(self.n_groups)
            for group in list(order)[self._issued:]:
                flags = [needed[i] for i in self._group(group)]
                if any(flags):
                    if len(self._flight) >= self.IN_FLIGHT:
                        self._land_one(self._flight.popleft())
                    self._issue(group, flags)
            self._land(block=True)
            self._issued, self._landed = 0, []
            self._order = self._next_order
            self.reductions_open = False
            self.comm.seal_reductions()
        if self.own.stage >= 1:
            self.manager.discard([grads[i] for i in range(n) if not self.own.owns(i) and not grads[i].dead
                                  and not grads[i].pin_count])

    def _reduce_local(self, needed: list[bool]) -> None:
        """The rank-local pages' reduce-scatter over the ranks holding the same experts, group by group (local_dp
        consecutive pages; every holder issues the same ones: which tensors have a gradient is agreed among them),
        fp32 whatever the compute dtype; the owner's page takes the mean over all dp ranks, the others are dropped."""
        grads, k = self.pages["grad"], self.own.local_dp
        start, end = self.layout.local_pages
        experts = self.expert_reductions
        for first in range(start, end, k):
            indices = range(first, first + k)
            if experts is not None and first in experts.issued:
                continue  # reduced during backward (landed below)
            if not any(needed[i] for i in indices):
                continue
            inputs, staged = self.stage(indices, [needed[i] for i in indices])
            mine = first + self.own.local_rank
            out = self.take_buffer(self.layout.page_numel(mine))
            self.replicas.reduce_scatter(out, inputs, what=f"expert grad group {(first - start) // k}")
            if needed[mine]:
                self.write_mean(mine, out)
            self.give_buffers(out, *staged)
            self.manager.discard([grads[i] for i in indices if i != mine and not grads[i].dead
                                  and not grads[i].pin_count])
        if experts is not None:
            experts.finish()

    def _group(self, group: int) -> range:
        return range(group * self.dp, (group + 1) * self.dp)

    def _issue(self, group: int, needed: list[bool]) -> None:
        """Start the reduce-scatter of `group`. Its gradients are copied (fp32) into buffers of the collective's own,
        as FSDP2 copies into its reduce-scatter input, and the pages are dead from then on: nothing stays pinned
        while the collective is in flight, and the mean lands in a cleared slot of this rank's page."""
        grads = self.pages["grad"]
        inputs, staged = self.stage(self._group(group), needed)
        self.manager.discard([grads[i] for i, need in zip(self._group(group), needed) if need])
        mine = group * self.dp + self.own.rank
        out = self.take_buffer(self.layout.page_numel(mine))
        pending = self.comm.reduce_scatter(out, inputs, what=f"grad group {group}", async_op=True)
        self._flight.append(_Reduction(group, pending, out, staged, needed[self.own.rank], self._events))

    def stage(self, indices: range, needed: list[bool]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A reduce-scatter's inputs for the pages `indices`: each needed page's gradient copied (fp32) into a buffer
        of the collective's own, zeros for the others; and those buffers (to give back once it has landed)."""
        grads = self.pages["grad"]
        inputs, staged = [], []
        for i, need in zip(indices, needed):
            numel = self.layout.page_numel(i)
            if not need:
                inputs.append(self.zero_buffer(numel))
                continue
            self.manager.acquire([grads[i]], self.tier)
            try:
                staged.append(self.take_buffer(numel).copy_(grads[i].view(self.layout.page_dtypes[i])[:numel]))
            finally:
                self.manager.release([grads[i]])
            inputs.append(staged[-1])
        return inputs, staged

    def write_mean(self, index: int, summed: torch.Tensor) -> None:
        """Gradient page `index` takes the mean over the dp ranks of a reduction's sum (`summed`, which is spent)."""
        page = self.pages["grad"][index]
        self._writing(index)
        self.manager.acquire([page], self.tier)
        try:
            mean = page.view(self.layout.page_dtypes[index])[: self.layout.page_numel(index)]
            if mean.dtype == summed.dtype:  # scaled straight into the page (one pass, not a scale and a copy)
                torch.mul(summed, 1.0 / self.dp, out=mean)
            else:
                mean.copy_(summed.mul_(1.0 / self.dp))
        finally:
            self.manager.release([page], dirty=True)

    def _land(self, block: bool) -> None:
        """Land the reductions in flight that are done (all of them with `block`), oldest first."""
        while self._flight and (block or self._flight[0].pending.done()):
            self._land_one(self._flight.popleft())

    def _land_one(self, red: _Reduction) -> None:
        red.pending.wait()
        if self._open:  # during backward (one a late peer held up lands after it): how long one takes here
            took = time.perf_counter() - red.pending.issued
            self._typical_s = took if not self._typical_s else 0.8 * self._typical_s + 0.2 * took
        if red.write:
            self.write_mean(red.group * self.dp + self.own.rank, red.out)
        self.give_buffers(red.out, *red.staged)
        self._landed.append(red.group)

    def drain(self) -> None:
        """Land every reduction in flight (closing: nothing may still read or write their buffers)."""
        while self._flight:
            self._flight.popleft().pending.wait()
        if self.expert_reductions is not None:
            self.expert_reductions.close()

    def take_buffer(self, numel: int) -> torch.Tensor:
        """An fp32 buffer of a page's elements (a page holds at most page_bytes / 4 of them: bf16/fp16 pages use
        their first half), from those given back to `_spare` when one is there."""
        buffer = self._spare.pop() if self._spare else torch.empty(
            self.layout.page_bytes // 4, dtype=torch.float32, device=self.manager.pools[self.tier].device)
        return buffer[:numel]

    def give_buffers(self, *buffers: torch.Tensor) -> None:
        """Buffers from `take_buffer` back for reuse (whole: a later page may hold more elements)."""
        self._spare.extend(b if b._base is None else b._base for b in buffers)

    def zero_buffer(self, numel: int) -> torch.Tensor:
        """Zeros for a page no rank gave a gradient (read only, shared by every reduction)."""
        if self._zero_page is None:
            self._zero_page = torch.zeros(self.layout.page_bytes // 4, dtype=torch.float32,
                                          device=self.manager.pools[self.tier].device)
        return self._zero_page[:numel]

    def _writing(self, index: int) -> None:
        if self.before_write is not None:
            self.before_write(index)

    def _scale_page(self, page: Page, index: int, factor: float) -> None:
        self._writing(index)
        self.manager.acquire([page], self.tier)
        try:
            page.view(self.layout.page_dtypes[index])[: self.layout.page_numel(index)].mul_(factor)
        finally:
            self.manager.release([page], dirty=True)

    def _all_reduce_page(self, page: Page, index: int, comm: Communicator | None = None) -> None:
        """The page summed over `comm`'s ranks (the data-parallel group's by default), over dp: the mean."""
        comm = comm or self.comm
        self._writing(index)
        self.manager.acquire([page], self.tier)
        try:
            view = page.view(self.layout.page_dtypes[index])[: self.layout.page_numel(index)]
            if view.dtype == torch.float32:
                comm.all_reduce(view, f"grad page {index}")
                view.mul_(1.0 / self.dp)
            else:
                wide = self.take_buffer(view.numel()).copy_(view)
                comm.all_reduce(wide, f"grad page {index}")
                view.copy_(wide.mul_(1.0 / self.dp))
                self.give_buffers(wide)
        finally:
            self.manager.release([page], dirty=True)

    def grad_norm(self, squares: dict[int, float]) -> float:
        """The global L2 norm from each page's sum of squares (`squares`: this rank's updated pages). Pages are
        summed exactly (math.fsum), so the result does not depend on which rank summed which page."""
        n = self.layout.trainable_pages
        if self.own.stage == 0 and self.layout.local_pages is None:  # every rank holds every page, reduced
            return math.sqrt(math.fsum(squares.values()))
        # rank-local pages (experts) are summed over the ranks, each expert once: ep < dp holds it on n_replicas
        if self.own.stage == 0:  # the shared pages alike everywhere; the rank-local ones summed over ranks
            mine = torch.tensor([math.fsum(v for i, v in squares.items() if self.layout.is_local(i))],
                                dtype=torch.float64)
            self.comm.all_reduce(mine, "gradient norm (rank-local pages)")
            shared = math.fsum(v for i, v in squares.items() if not self.layout.is_local(i))
            return math.sqrt(shared + float(mine.item()) / self.n_replicas)
        vector = torch.zeros(n, dtype=torch.float64)
        replicated = not self.own.sharded_local("master")  # else each expert page counted by its owner alone
        for index, value in squares.items():
            vector[index] = value / self.n_replicas if replicated and self.layout.is_local(index) else value
        self.comm.all_reduce(vector, "gradient norm")
        return math.sqrt(math.fsum(vector.tolist()))

    # ------------------------------------------------------------------ parameters
    def publish_params(self) -> None:
        """Stages 1 and 2: the owners' updated parameter pages, all-gathered group by group into every rank's; and
        with ep < dp (stage >= 1) the experts' pages over the ranks holding the same experts."""
        params = self.pages["param"]
        if self.own.sharded_local("master") and not self.own.sharded_local("param"):  # (stage 3: gathered in use)
            k, (start, end) = self.own.local_dp, self.layout.local_pages
            for first in range(start, end, k):
                pages = params[first : first + k]
                self.manager.acquire(pages, self.tier)
                try:
                    self.replicas.all_gather([p.buffer for p in pages], pages[self.own.local_rank].buffer,
                                             what=f"expert param group {(first - start) // k}")
                finally:
                    self.manager.release(pages, dirty=True)
        if self.own.stage not in (1, 2):
            return
        n = self.n_shared
        for first in range(0, n, self.dp):
            pages = params[first : first + self.dp]
            self.manager.acquire(pages, self.tier)
            try:
                own = pages[self.own.rank]
                self.comm.all_gather([p.buffer for p in pages], own.buffer, what=f"param group {first // self.dp}")
            finally:
                self.manager.release(pages, dirty=True)
