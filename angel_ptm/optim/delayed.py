"""optimizer.staleness 1: ZeRO-Offload's delayed parameter update, page group by page group.

The update of step t runs while step t+1 computes, and step t+1 computes with the parameters after update t-1:

    step t+1 forward/backward:  parameters theta_{t-1}        (what the param pages hold)
    meanwhile, update t:        master theta_{t-1} -> theta_t  (master pages only; gradient g_t)
    once page p is done in step t+1 (all its gradients final):  param page p <- master page p  (theta_t)

So theta_{t+1} = AdamW(theta_t, g_{t+1}) with g_{t+1} computed at theta_{t-1}, for every page, whatever order the
updates ran in: the result does not depend on timing, and two runs give identical losses.

Each page group carries where it is in that cycle; `DelayedUpdates` holds it, and the engine drives it:

- `enqueue` (engine.step of step t): the groups of update t, in the order they run (the order their gradients
  became final, so the groups whose gradients step t+1 writes first are updated first), and its learning rate and
  gradient scale (PagedAdamW takes them when the step opens);
- `run_some` (before each module's forward in step t+1): a fixed share of the pending groups, so the update's page
  moves and arithmetic are spread over the forward pass and appear in the scheduler's trace at the same points
  every step;
- `run` (before step t+1 writes a gradient into page p): group p now if it is still pending, as g_t must be read
  before g_{t+1} overwrites it;
- `publish` (page p final in step t+1's last backward): the param page takes the master's values;
- `finish` + `publish_all` (engine.step of step t+1, gradient clipping, engine.flush): whatever is left.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable

from angel_ptm.optim.paged_adamw import PagedAdamW


class DelayedUpdates:
    def __init__(self, optimizer: PagedAdamW, publish: Callable[[int], None], n_forward_points: int):
        if optimizer.write_params:
            raise ValueError("a delayed update must not write the param pages the next step computes with")
        self.optimizer = optimizer
        self._publish = publish  # copies master page p into param page p
        self._n_points = max(1, n_forward_points)
        self.pending: dict[int, None] = {}  # page groups of the open update, in the order they run
        self.unpublished: set[int] = set()  # updated master pages whose param pages still hold older values
        self._without_grad: frozenset[str] = frozenset()
        self._per_point = 0

    @property
    def idle(self) -> bool:
        return not self.pending and not self.unpublished

    def enqueue(self, order: Iterable[int], without_grad: Iterable[str] = ()) -> None:
        """Open update t (the optimizer's step opens now: its learning rate and gradient scale are taken)."""
        if self.pending:
            raise ValueError(f"{len(self.pending)} page groups of the previous update are still pending")
        self.pending = dict.fromkeys(order)
        self._without_grad = frozenset(without_grad)
        self._per_point = math.ceil(len(self.pending) / self._n_points)
        self.optimizer.begin_step(self._without_grad)
        if not self.pending:
            self.optimizer.end_step()

    def run(self, index: int) -> None:
        """Update page group `index` now if it is pending."""
        if index not in self.pending:
            return
        del self.pending[index]
        self.optimizer.update_group(index, self._without_grad)
        self.unpublished.add(index)
        if not self.pending:
            self.optimizer.end_step()

    def run_some(self) -> None:
        """One forward point's share of the pending groups."""
        for index in list(itertools.islice(self.pending, self._per_point)):
            self.run(index)

    def finish(self) -> None:
        for index in list(self.pending):
            self.run(index)

    def publish(self, index: int) -> None:
        """Page `index` is done with in this step: its param page takes the updated master (its update first)."""
        self.run(index)
        if index in self.unpublished:
            self.unpublished.discard(index)
            self._publish(index)

    def publish_all(self) -> None:
        self.finish()
        for index in sorted(self.unpublished):
            self._publish(index)
        self.unpublished.clear()
