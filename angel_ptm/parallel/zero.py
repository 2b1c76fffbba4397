"""ZeRO-3's parameter side: page groups all-gathered ahead of the units that compute with them (parallel/ownership.py
says who holds what; parallel/grad_sync.py is the gradient side).

    gatherer = ParamGatherer(manager, param_pages, collectives, ownership, capacity_groups)   # stage 3
    gatherer.acquire(pages, Tier.DEVICE, label)    # every group of `pages` gathered, then pinned as usual

Every decision that issues a collective is a function of state that is the same on every rank (the model's
access sequence, the agreed set of tensors with a gradient, group indices), never of this rank's residency or
timing, so all ranks issue the same collectives in the same order. Gathered groups are kept in a deterministic
LRU of `capacity` groups (their remote pages pinned while held), so a unit's backward finds its groups still
there without a second all-gather; a group is dropped only by that LRU or at the end of the step.

In backward the points are the units', as FSDP's: when the gradient of a unit's output arrives, every group of the
unit is gathered and kept until the next unit's backward starts (or backward ends), so each rank's reads inside the
unit -- which may differ from rank to rank (an MoE block's experts at ep 1, any data-dependent branch) -- need no
collective of their own and leave no trace in the plan.
"""

from __future__ import annotations

import bisect
import functools
import time
import weakref
from collections import Counter, OrderedDict
from typing import Sequence

import torch
from torch.utils._pytree import tree_leaves

from angel_ptm import guard
from angel_ptm.memory import Page, PageManager, Tier
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
    group (the owners' pages changed) and starts gathering the first groups of the next step.

    With `follow_units`, backward's accesses are the units' (`enter_backward`, when the gradient of a unit's output
    arrives): a read inside a unit whose groups are all pinned so is this rank's own business -- no collective, no
    entry in the recording, no move in the LRU -- so ranks that read different parameters there stay in step."""

    LOOKAHEAD = 8  # accesses ahead whose groups may be gathered early
    EXPOSED_S = 1e-4  # OSDP: a group whose gathers kept compute waiting longer than this may be kept replicated

    def __init__(self, manager: PageManager, param_pages: list[Page], collectives: Communicator,
                 ownership: Ownership, capacity: int, access, tier: Tier = Tier.DEVICE, replicable: int = 0):
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
        # OSDP (parallel.osdp): up to `replicable` groups kept gathered for good (replicated on every rank, refreshed
        # once after each update instead of gathered before use), chosen after the first step that followed the
        # recording: the groups whose gathers compute waited on longest there (agreed over ranks: the MAX).
        self.replicable = replicable
        self.replicated: dict[int, float] = {}  # group -> seconds compute waited on its gathers when chosen
        self._exposed: Counter = Counter()  # group -> seconds waited on its gathers, in the step being measured
        self._measuring = False
        self._decided = replicable == 0
        # Units whose backward runs (follow_units): id(unit) -> its groups, pinned (in _in_use) until it is left
        self._entered: dict = {}
        self._entered_groups: Counter = Counter()  # group -> entered units holding it
        self._silent: Counter = Counter()  # page index -> acquisitions inside an entered unit, not yet released
        self._binder = None
        self._handles: list = []
        # (id, sequence number) of a node that made a unit's output -> [(unit, its call's entered flag)], the
        # forward's until backward ends: ids come again once nodes are freed, sequence numbers do not
        self._output_nodes: dict[tuple[int, int], list] = {}

    @property
    def recorded(self) -> tuple[tuple[int, ...], ...]:
        """The group accesses recorded in the first step, which later steps follow (the same on every rank)."""
        return tuple(self._sequence)

    def acquire(self, pages: Sequence[Page], tier: Tier = Tier.DEVICE, label: str | None = None,
                read_only: bool = False) -> None:
        groups = self._groups(pages)
        if groups and all(self._entered_groups[g] for g in groups):
            # inside a unit's backward, whose groups are all here and pinned: this rank's own read (it may read
            # what no other rank does) moves nothing the plan or the LRU sees
            self.access.acquire(pages, tier, label=label, read_only=read_only)
            self._silent.update(page.index for page in pages if not self.own.rank_local(page.index))
            return
        self._gather(groups)
        self.access.acquire(pages, tier, label=label, read_only=read_only)
        for page in pages:
            if not self.own.rank_local(page.index):
                self._in_use[page.index // self.dp] += 1
        if self._following:
            self._prefetch()

    def release(self, pages: Sequence[Page]) -> None:
        self.access.release(pages)
        for page in pages:
            if self.own.rank_local(page.index):
                continue
            if self._silent[page.index]:
                self._silent[page.index] -= 1
            else:
                self._in_use[page.index // self.dp] -= 1

    def _groups(self, pages: Sequence[Page]) -> tuple[int, ...]:
        return tuple(dict.fromkeys(page.index // self.dp for page in pages if not self.own.rank_local(page.index)))

    def _gather(self, groups: tuple[int, ...]) -> None:
        """An access to `groups` (the next in the recorded sequence, or off it): each gathered if not held, and
        landed if its gather is in flight."""
        self._advance(groups)
        t0, on_demand = time.perf_counter(), set()
        for group in groups:
            if group in self.held:  # gathered ahead: compute waits only if its data is not here yet
                self.held.move_to_end(group)
            else:  # on demand: every missing group's gather is issued before any is waited on (they overlap)
                self._make_room(keep=groups)
                self._start(group)
                on_demand.add(group)
        for group in groups:
            waited = self._settle(group)
            if self._measuring:  # (on demand: compute waited from the first issue)
                self._exposed[group] += time.perf_counter() - t0 if group in on_demand else waited

    # ------------------------------------------------------------------ units' backward (FSDP's pre-backward)
    def follow_units(self, binder) -> None:
        """Gather each unit's groups when backward reaches the gradient of its output (`binder`: the units, their
        pages, whether the engine's forward or backward runs, and the node pins to let go)."""
        self._binder = weakref.ref(binder)  # (hooks live in autograd's graph: nothing there keeps the engine)
        me = weakref.ref(self)
        for unit in binder.units:
            def post(_module, _args, output, unit=unit):
                gatherer = me()
                if gatherer is not None:
                    gatherer._watch_output(unit, output)
            self._handles.append(unit.module.register_forward_hook(guard.EngineHook(post)))

    def _watch_output(self, unit, output) -> None:
        binder = self._binder()
        if binder is None or not binder.hooks_on or binder.in_backward or not torch.is_grad_enabled():
            return  # (a recomputation in backward, an evaluation: no backward of this forward to prepare)
        with torch._C.DisableTorchFunctionSubclass():  # (tp's vocabulary-sharded logits allow few tensor methods)
            nodes = {id(t.grad_fn): t.grad_fn for t in tree_leaves(output)
                     if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None}
        call: list = []  # this forward call of the unit: entered once, at whichever of its output nodes comes first
        for node in nodes.values():
            # One prehook per node, entering every unit whose output it made, the latest registered first: an outer
            # unit that returns its inner unit's output before the inner one (which it holds), and a unit that
            # returns its input unchanged before the unit that made it (so that one stays entered for its reads)
            key = (id(node), node._sequence_nr())
            entries = self._output_nodes.get(key)
            if entries is None:
                entries = self._output_nodes[key] = []
                node.register_prehook(functools.partial(_reached, weakref.ref(self), entries))
            entries.append((unit, call))

    def enter_backward(self, unit) -> None:
        """Backward reached `unit`'s output (the same point on every rank, whatever each rank's inputs were): the
        units entered before it let go of their groups unless they hold it, then its groups are gathered (one
        access of the recorded sequence) and pinned until it is left."""
        binder = self._binder() if self._binder is not None else None
        if binder is None or not binder.in_backward:
            return
        binder.release_node_pins()  # (the node that made this gradient has run: what it read may go)
        around = {id(u) for u in unit.chain()[1:]}  # (a unit entered again, called twice in forward: left first)
        for key in [key for key in self._entered if key not in around]:
            self._leave(key)
        groups = self._groups(binder.unit_pages[id(unit)])
        self._gather(groups)
        self._entered[id(unit)] = groups
        self._in_use.update(groups)
        self._entered_groups.update(groups)
        if self._following:
            self._prefetch()

    def _leave(self, key: int) -> None:
        groups = self._entered.pop(key)
        self._in_use.subtract(groups)
        self._entered_groups.subtract(groups)

    def end_backward(self) -> None:
        """Backward is over: every entered unit lets go of its groups."""
        for key in list(self._entered):
            self._leave(key)
        self._silent.clear()
        self._output_nodes.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

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
            victims = [g for g in self.held if g not in keep and not self._in_use[g] and g not in self.pending
                       and g not in self.replicated]
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
        """Issue the all-gather of `group` into slots held for its remote pages (taken now unless it is held: an
        OSDP refresh); the owned page stays pinned as its input until the gather has landed."""
        first = group * self.dp
        pages = self.param_pages[first : first + self.dp]
        own = pages[self.own.rank]
        self.manager.acquire([own], self.tier, read_only=True)  # the gather's input (its own slot: the same bytes)
        if group not in self.held:
            remote = [page for page in pages if page is not own]
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

    def _settle(self, group: int) -> float:
        """Land `group`'s gather if it is in flight; the seconds compute waited for it (0 if its data was here)."""
        entry = self.pending.pop(group, None)
        if entry is None:
            return 0.0
        handle, own = entry
        ready, t0 = handle.done(), time.perf_counter()
        try:
            handle.wait()
        finally:
            self.manager.release([own])
        return 0.0 if ready else time.perf_counter() - t0

    def drop_all(self, keep_replicated: bool = False) -> None:
        """Drop every held group (once its gather has landed); OSDP's replicated ones too unless `keep_replicated`."""
        for group in list(self.pending):
            self._settle(group)
        for group in [g for g in self.held if not (keep_replicated and g in self.replicated)]:
            self.manager.drop_remote(self.held.pop(group))

    def clear(self) -> None:
        """The step is over (the owners' pages changed): drop every held group, refresh OSDP's replicated ones, then
        start gathering the first groups of the next step."""
        self.drop_all(keep_replicated=True)
        self._output_nodes.clear()  # (a forward no backward followed)
        if self._recording is not None:
            self._sequence, self._recording = self._recording, None
            for position, groups in enumerate(self._sequence):
                for group in groups:
                    self._uses.setdefault(group, []).append(position)
            self._measuring = not self._decided  # the next step follows the recording: measure its waits
            self.comm.gathers_observed = self._measuring
        elif self._measuring:
            self._choose_replicated()
        for group in sorted(self.replicated):
            self._refresh(group)
        self._cursor, self._following = 0, bool(self._sequence)
        if self._following:
            self._prefetch()

    def _choose_replicated(self) -> None:
        """OSDP: the groups compute waited on longest in the measured step (MAX over ranks, so every rank picks the
        same), as many as `replicable`, each only if it waited at all (EXPOSED_S)."""
        self._measuring, self._decided = False, True
        self.comm.gathers_observed = False
        waited = torch.tensor([self._exposed.get(g, 0.0) for g in range(len(self.param_pages) // self.dp)],
                              dtype=torch.float64)
        self.comm.all_reduce(waited, "OSDP: seconds waited on each group's gathers", op=MAX)
        ranked = sorted(range(len(waited)), key=lambda g: (-float(waited[g]), g))
        chosen = [g for g in ranked if float(waited[g]) > self.EXPOSED_S][: self.replicable]
        self.replicated = {g: float(waited[g]) for g in sorted(chosen)}

    def _refresh(self, group: int) -> None:
        """A replicated group's copies take the owners' updated pages (an all-gather into the held slots)."""
        if group not in self.held:  # just chosen: gathered for the first time, and kept
            self._make_room(keep=tuple(self.replicated))
        self._start(group)


def _reached(gatherer_ref, entries: list, _grads) -> None:
    """Backward is about to run a node that made units' outputs (their gradients are whole): enter each unit."""
    gatherer = gatherer_ref()
    if gatherer is None:
        return
    for unit, call in reversed(entries):
        if not call:
            call.append(True)
            gatherer.enter_backward(unit)


def expert_groups(model, layout, ownership: Ownership) -> dict[str, list[int]]:
    """MoE layer name -> the first pages of the expert page groups (local_dp consecutive rank-local pages) its
    experts' parameters lie on: what ExpertGatherer gathers while that layer computes (the estimate counts it)."""
    from angel_ptm.units import moe_layers

    start, k = ownership.local_pages[0], ownership.local_dp
    slots = {slot.name: slot for slot in layout.slots}
    names = {id(p): n for n, p in model.named_parameters()}
    layer_names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for layer in moe_layers(model):
        pages = {page for expert in layer.experts for p in expert.parameters()
                 for page in slots[names[id(p)]].pages if ownership.rank_local(page)}
        out[layer_names[id(layer)]] = sorted({start + (page - start) // k * k for page in pages})
    return out


class ExpertGatherer:
    """ZeRO-3 over the ranks holding the same experts (ep < dp): an expert page lives on its owner among them only
    (parallel/ownership.py), a REMOTE page elsewhere, and every MoE layer's expert pages are all-gathered over those
    ranks while the layer computes: at its forward (dropped when the forward returns) and again at its backward
    (from the gradient of its output to the gradient of its input).

    The holders route different tokens (they sit in different expert-parallel groups), so a gather tied to an
    expert's own use would be issued on one holder and not on another. These points are the layer's, the same on
    every holder whatever the routing: every expert of the layer is gathered, routed or not."""

    def __init__(self, manager: PageManager, param_pages: list[Page], replicas: Communicator,
                 ownership: Ownership, layout, model, tier: Tier = Tier.DEVICE):
        self.manager, self.param_pages, self.comm, self.own, self.tier = manager, param_pages, replicas, ownership, tier
        modules = dict(model.named_modules())
        self.groups: dict[int, list[int]] = {}  # id(layer) -> the first pages of its experts' groups
        self.held: dict[int, list[Page]] = {}  # group's first page -> its remote pages held here
        self._uses: Counter = Counter()  # group's first page -> the layers holding it now
        self._handles = []
        for name, firsts in expert_groups(model, layout, ownership).items():
            layer = modules[name]
            self.groups[id(layer)] = firsts
            self._handles.append(layer.register_forward_pre_hook(self._forward_pre))
            self._handles.append(layer.register_forward_hook(self._forward_post, always_call=True))

    def _forward_pre(self, layer, args) -> None:
        self.gather(layer)
        x = args[0] if args else None
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda grad, layer=layer: self._backward_done(layer, grad))

    def _forward_post(self, layer, args, out) -> None:
        self.drop(layer)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, layer=layer: self._backward_start(layer, grad))

    def _backward_start(self, layer, grad):
        self.gather(layer)
        return grad

    def _backward_done(self, layer, grad):
        self.drop(layer)
        return grad

    def gather(self, layer) -> None:
        """Every expert group of `layer` filled from its owner (those another layer holds already: as they are), the
        gathers all issued before any is waited on (they overlap)."""
        k = self.own.local_dp
        issued, handles = [], []  # (group's first page, its own page pinned as the input), the gathers
        try:
            for first in self.groups.get(id(layer), ()):
                if self._uses[first]:
                    self._uses[first] += 1
                    continue
                pages = self.param_pages[first : first + k]
                own = pages[self.own.local_rank]
                self.manager.acquire([own], self.tier, read_only=True)  # the gather's input, as in _start
                issued.append((first, own))
                remote = [page for page in pages if page is not own]
                self.manager.hold_remote(remote, self.tier)
                self.held[first] = remote
                handles.append(self.comm.all_gather([page.buffer for page in pages], own.buffer,
                                                    what=f"expert param group {first}", async_op=True))
            for handle in handles:
                handle.wait()
            for first, _ in issued:
                self._uses[first] = 1  # (counted once filled: a failed gather leaves nothing to skip next time)
        finally:
            for _, own in issued:
                self.manager.release([own])

    def drop(self, layer) -> None:
        for first in self.groups.get(id(layer), ()):
            if self._uses[first] > 0:
                self._uses[first] -= 1
            if self._uses[first] == 0 and first in self.held:
                self.manager.drop_remote(self.held.pop(first))

    def drop_all(self) -> None:
        """The step is over, or a backward ended without reaching a layer's input: no copy is kept."""
        for first in list(self.held):
            self.manager.drop_remote(self.held.pop(first))
        self._uses.clear()

    def close(self) -> None:
        self.drop_all()
        for handle in self._handles:
            handle.remove()
        self._handles = []
