"""ZeRO-2 for the experts: with ep < dp, the ranks of an expert-dp group hold the same experts, and each expert page
has one owner among them (parallel/ownership.py). From stage 2 on, an expert page group's gradients are
reduce-scattered onto their owner during the step's last backward, as soon as every MoE layer with experts on the
group has finished its backward, while the layers before it compute theirs; the pages this rank does not own are
dead from then on, so the experts' gradients are not all held whole until the step.

    reductions = ExpertReductions(sync, model, layout, ownership, has_grad)   # sync: this job's GradSync
    ... last backward: MoE layer L's input gradient is in -> its groups whose layers are all done are issued
    sync.reduce(without)    # lands them (and reduces, as before, any group no hook issued)

The point a group is issued at is the layer's, the same on every holder whatever the routing: the holders sit in
different expert-parallel groups and route different tokens, so "this expert's gradient is final" would come at a
different point on each, or not at all, and one would wait for a reduction another never issues. The tensors that
got no gradient here are zeros in the staged copy; which tensors got one anywhere is agreed after backward as before
(GradSync.agree_without_grad), and the update skips those that got none anywhere.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable

import torch

from angel_ptm.parallel.ownership import Ownership


class ExpertReductions:
    """The expert page groups' reduce-scatters of one job (GradSync.expert_overlap), issued from MoE layer hooks."""

    def __init__(self, sync, model, layout, ownership: Ownership, has_grad: Callable[[str], bool]):
        from angel_ptm.parallel.zero import expert_groups

        self.sync, self.layout, self.own, self.has_grad = sync, layout, ownership, has_grad
        modules = dict(model.named_modules())
        groups = expert_groups(model, layout, ownership)  # the one rule of which groups a layer's experts lie on
        self.groups = {id(modules[name]): firsts for name, firsts in groups.items()}
        self.layers_on = Counter(first for firsts in groups.values() for first in firsts)  # layers per group
        # Per page: (segment offset, numel, tensor name) of every tensor on it (to clear those without a gradient)
        self._segments: dict[int, list[tuple[int, int, str]]] = {}
        for slot in layout.slots:
            for seg in slot.segments:
                if layout.is_local(seg.page):
                    self._segments.setdefault(seg.page, []).append((seg.offset, seg.numel, slot.name))
        self.flight: OrderedDict[int, tuple] = OrderedDict()  # first page -> (pending, out, staged), oldest first
        self.issued: set[int] = set()  # groups issued this step (landed or not)
        self.overlapped = 0  # expert groups reduced during backward, cumulative
        self._left: Counter = Counter()
        self._done: set[int] = set()
        self._open = False
        self._handles = [modules[name].register_forward_pre_hook(self._forward_pre) for name in groups]

    # ------------------------------------------------------------------ the layers' points
    def begin_backward(self) -> None:
        """The step's last backward starts: every group waits for each of its layers once."""
        self._open = True
        self._left, self._done = Counter(self.layers_on), set()

    def end_backward(self) -> None:
        self._open = False

    def _forward_pre(self, layer, args) -> None:
        x = args[0] if args else None
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda grad, layer=layer: self._layer_done(layer, grad))

    def _layer_done(self, layer, grad):
        """The gradient of the layer's input is in: every expert parameter gradient of the layer has been
        accumulated before (autograd runs a parameter's accumulation as soon as it is ready, ahead of other
        nodes). Once per layer per step (a recomputed layer registers its hook again)."""
        if self._open and id(layer) not in self._done:
            self._done.add(id(layer))
            for first in self.groups.get(id(layer), ()):
                self._left[first] -= 1
                if self._left[first] == 0:
                    self.issue(first)
        self.land(block=False)
        return grad

    # ------------------------------------------------------------------ the reductions
    def issue(self, first: int) -> None:
        """The reduce-scatter of group `first` over the holders, in flight (at most GradSync.IN_FLIGHT of them: the
        oldest lands first); its gradient pages are staged (fp32) and dead from here."""
        sync, k = self.sync, self.own.local_dp
        while len(self.flight) >= sync.IN_FLIGHT:
            self._land(*self.flight.popitem(last=False))
        grads, indices = sync.pages["grad"], range(first, first + k)
        got = {i: [self.has_grad(name) for _, _, name in self._segments.get(i, [])] for i in indices}
        needed = [any(got[i]) for i in indices]  # (nothing here: zeros; the page may never have been made)
        inputs, staged = sync.stage(indices, needed)
        for i, need, buffer in zip(indices, needed, inputs):
            for (offset, count, _), has in zip(self._segments.get(i, []), got[i]):
                if need and not has:  # a tensor no token reached here adds nothing (its page region is stale)
                    buffer[offset: offset + count].zero_()
        sync.manager.discard([grads[i] for i, need in zip(indices, needed)
                              if need and not grads[i].dead and not grads[i].pin_count])
        mine = first + self.own.local_rank
        out = sync.take_buffer(self.layout.page_numel(mine))
        start = self.layout.local_pages[0]
        pending = sync.replicas.reduce_scatter(out, inputs, what=f"expert grad group {(first - start) // k}",
                                               async_op=True)
        self.flight[first] = (pending, out, staged)
        self.issued.add(first)
        self.overlapped += 1

    def land(self, block: bool) -> None:
        """Land the reductions in flight that are done (every one with `block`), oldest first."""
        while self.flight and (block or next(iter(self.flight.values()))[0].done()):
            self._land(*self.flight.popitem(last=False))

    def _land(self, first: int, entry) -> None:
        pending, out, staged = entry
        pending.wait()
        self.sync.write_mean(first + self.own.local_rank, out)
        self.sync.give_buffers(out, *staged)

    def covers(self, page: int) -> bool:
        """Whether local page `page`'s group was reduced this step already (its owner holds the mean)."""
        start, k = self.layout.local_pages[0], self.own.local_dp
        return start + (page - start) // k * k in self.issued

    def finish(self) -> None:
        """The step's reductions are all issued: land this step's, and start over."""
        self.land(block=True)
        self.issued = set()

    def close(self) -> None:
        """The hooks off the model, then the reductions in flight landed (a failed collective raises here, after)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.land(block=True)
