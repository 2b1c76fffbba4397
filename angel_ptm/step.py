"""The training step's state machine: micro-batches, when gradients become final, eager and delayed updates, the
norm, and the optimizer step with its data-parallel fixed points. The engine wires it and calls it.

    driver.backward(loss)      # one micro-batch; in the last one, page groups update as their gradients are final
    driver.clip_grad_norm(1.0) # the global norm (over every rank's pages), then the clip coefficient folded in
    driver.step()              # reduce, update (or skip on an fp16 overflow), publish, start the next step

State: `micro` backward passes since the last step; in the last one, `eager_now` while pages may be updated as
their gradients become final (`pending` counts the tensors still to come on each page); `final_order` the order
they did; `grads_final` once this step's gradients are settled, agreed over ranks and reduced.
"""

from __future__ import annotations

import collections

import torch

from angel_ptm.errors import ActivationError, ConfigValueError
from angel_ptm.memory import PageLayout, Tier
from angel_ptm.optim import PagedAdamW
from angel_ptm.optim.delayed import DelayedUpdates
from angel_ptm.optim.loss_scaler import LossScaler
from angel_ptm.optim.no_decay import no_decay_names
from angel_ptm.parallel.data_parallel import DataParallel, SingleRank


def copy_master_into_param(scheduler, pages, layout: PageLayout, index: int, tier: Tier,
                           label: str | None = None) -> None:
    """Param page `index` takes the values of its master page (rounded to nearest even to bf16/fp16)."""
    master, param = pages["master"][index], pages["param"][index]
    scheduler.acquire([master, param], tier, label=label)
    param.view(layout.page_dtypes[index])[: layout.page_numel(index)].copy_(master.view(layout.state_dtype(index)))
    scheduler.release([master])
    scheduler.release([param], dirty=True)


def copy_masters_into_params(scheduler, pages, layout: PageLayout, ownership) -> None:
    """Every param page this rank updates takes its master page's values (after weights were written into the
    masters); on the host when it has room for the pair."""
    if "master" in pages:
        tier = Tier.HOST if scheduler.manager.pools[Tier.HOST].capacity >= 2 else Tier.DEVICE
        for index in filter(ownership.updated, range(layout.trainable_pages)):
            copy_master_into_param(scheduler, pages, layout, index, tier)


def cast_master_into_parameters(model, scheduler, pages, layout: PageLayout, ownership, compute_dtype) -> None:
    """Mixed precision: the compute parameters are the fp32 master weights rounded to the compute dtype, page by
    page; the model's floating parameters become compute-dtype placeholders (the binder points them at the pages).
    Every rank wrote every parameter page it holds from the same values, so no rank needs another's yet."""
    copy_masters_into_params(scheduler, pages, layout, ownership)
    if compute_dtype is None:  # fp32 under optimizer.staleness 1: the copy is all there is to do
        return
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != compute_dtype:
                param.data = torch.zeros((), dtype=compute_dtype).expand(param.shape)


NESTED_BACKWARD_NODES = frozenset(("CheckpointFunctionBackward",))  # torch.utils.checkpoint(use_reentrant=True)


def replay_failed(exc: BaseException) -> bool:
    """Whether `exc` is torch's checkpoint finding that a recomputation saved other tensors than its forward did
    (non-reentrant checkpoint: a count or metadata that differs; selective: an op the forward's log lacks)."""
    return isinstance(exc, torch.utils.checkpoint.CheckpointError) or "not found in storage" in str(exc)


def runs_nested_backward(loss: torch.Tensor) -> bool:
    """Whether `loss`'s graph holds a node whose backward runs a backward of its own (a reentrant activation
    checkpoint, HuggingFace's gradient checkpointing with use_reentrant=True): its parameters' gradients then
    arrive in several accumulations, so eager updates and reductions cannot take the first as final."""
    # Nodes seen are kept, not only their ids: a node's Python object may be made anew at each `next_functions`
    # (torch 2.11 does), and a dropped one's id reused by the next, which would end the walk early
    stack, seen = [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__ in NESTED_BACKWARD_NODES:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def build_step(config, estimate, *, model, layout: PageLayout, pages, scheduler, manager, binder, collectives,
               ownership, mesh, split, n_units: int):
    """The optimizer, the data-parallel fixed points and the StepDriver of a job, wired: (optimizer, data_parallel,
    driver)."""
    opt, tcfg, staleness = config.optimizer, config.trainer, config.optimizer.staleness
    # fp16: loss scaling. The binder notes inf/NaN gradients as they land; no page may be updated before the whole
    # backward is known to be clean, so fp16 never updates during backward.
    loss_scaler = LossScaler.from_config(opt) if tcfg.dtype == "float16" else None
    # Where an update pins its pages (placement.update_tier, resolved by the estimate, which checked they fit)
    update_tier = Tier(estimate.update_tier)
    optimizer = PagedAdamW(scheduler, layout, pages, opt.lr, opt.betas, opt.eps, opt.weight_decay, update_tier,
                           write_params=staleness == 0, updates=ownership.updated,
                           no_decay=no_decay_names(model, opt.no_decay))
    # one access updates a few of a unit's groups where the update tier has room to spare (update_batch_groups)
    optimizer.batch_groups = estimate.update_batch_groups  # (its groups: placement.update_group_kinds)
    optimizer.batch_key = binder.unit_of_page()
    data_parallel = SingleRank() if collectives is None else DataParallel(
        collectives, ownership, manager, scheduler, layout, pages, update_tier, estimate.gather_groups,
        estimate.largest_unit_groups, config.parallel.osdp)
    if ownership.sharded_local("param"):  # ep < dp at stage 3: the experts' pages gathered over their holders
        from angel_ptm.parallel.zero import ExpertGatherer

        data_parallel.experts = ExpertGatherer(manager, pages["param"], data_parallel.replicas, ownership, layout,
                                               model)
    sync = getattr(data_parallel, "sync", None)
    if sync is not None and sync.expert_overlap:  # ep < dp, stage >= 2: experts' gradients reduced in backward
        from angel_ptm.parallel.expert_grads import ExpertReductions

        sync.expert_reductions = ExpertReductions(sync, model, layout, ownership, binder.got_grad)
    data_parallel = split.wrap_step(data_parallel, layout)  # tp: the norm and the overflow agreed over tp too
    if data_parallel.gatherer is not None:  # stage 3: a unit's pages are gathered before it computes, and again
        binder.param_access = data_parallel.gatherer  # when backward reaches its output
        data_parallel.gatherer.follow_units(binder)
    # Updates during backward (planned scheduler, no clipping, no loss scaling, staleness 0) need every gradient
    # final: with more than one rank, reduced during backward too (parallel/grad_sync.py), else not at all.
    eager = (config.memory.scheduler == "planned" and opt.overlap_updates and not tcfg.grad_clip
             and loss_scaler is None and staleness == 0 and (mesh.dp == 1 or data_parallel.overlaps))
    driver = StepDriver(model=model, layout=layout, pages=pages, binder=binder, optimizer=optimizer,
                        scheduler=scheduler, data_parallel=data_parallel, ownership=ownership,
                        grad_accum=tcfg.grad_accum, loss_scaler=loss_scaler, eager_allowed=eager,
                        staleness=staleness, n_units=n_units)
    return optimizer, data_parallel, driver


class StepDriver:
    def __init__(self, *, model, layout: PageLayout, pages, binder, optimizer, scheduler, data_parallel, ownership,
                 grad_accum: int, loss_scaler, eager_allowed: bool, staleness: int, n_units: int):
        self.model, self.layout, self.pages, self.binder = model, layout, pages, binder
        self.optimizer, self.scheduler, self.data_parallel, self.ownership = optimizer, scheduler, data_parallel, \
            ownership
        self.grad_accum, self.loss_scaler, self.eager_allowed = grad_accum, loss_scaler, eager_allowed
        self.micro = 0
        self.eager_done = False
        self.grads_final = False
        self.eager_now = False
        self.last_step_skipped = False
        self.pending: list[int] = []
        self.ready: set[str] = set()
        self.final_order: list[int] = []  # page indices in the order their gradients became final (last backward)
        self._batches: dict = {}  # unit -> its final page groups waiting for their update (_update_soon)
        self._unit_groups = collections.Counter(optimizer.batch_key[i] for i in optimizer.local_indices)
        # Distinct tensors on each page: every last micro-batch counts them down as their gradients become final.
        self.tensors_per_page = [len(set(names)) for names in optimizer.slot_names_on_page]
        self._updates_here = set(optimizer.local_indices)  # the page groups this rank's optimizer updates
        binder.on_grad_ready = self._grad_ready
        binder.check_finite = loss_scaler is not None
        # optimizer.staleness 1: update t runs during step t+1 (optim/delayed.py), a share before each unit's
        # forward, a group at the latest before step t+1 writes its gradient page.
        self.delayed: DelayedUpdates | None = None
        self._landing = False  # staleness 1: an update was enqueued that no step or flush has published since
        if staleness == 1:
            self.delayed = DelayedUpdates(optimizer, self._publish, n_units)
            binder.before_unit_forward = self._before_unit_forward
            binder.before_grad_write = self._before_grad_write
            data_parallel.before_grad_write(self.delayed.run)  # (a reduction's mean written into a page)

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1):
            loss.backward()  # torch's own error (a loss with no graph, or not a scalar), before this backward counts
        self.micro += 1
        if self.micro > self.grad_accum and self.eager_done:
            # The last micro-batch's backward reduced gradients onto their owners (ZeRO 2-3), updated pages or
            # landed the delayed update as they became final: another backward's gradients would miss all that
            raise ConfigValueError(
                f"trainer.grad_accum: backward called {self.micro} times before step(), but trainer.grad_accum "
                f"is {self.grad_accum}, and at that boundary gradients were already "
                f"{'reduced over the ranks' if self.data_parallel.overlaps else 'applied'}; set it to the number of "
                f"micro-batches per step (or the most a step takes: a step with fewer finishes them at step())")
        last = self.micro == self.grad_accum and self.model.training
        # In the last micro-batch each page's gradients become final at some point of backward: then its group is
        # reduced over the ranks (stages 2-3) and updated once its owner holds the mean (staleness 0, eager), or
        # its param page takes the delayed update's master (staleness 1).
        dp = self.data_parallel
        self.eager_now = last and (self.eager_allowed or self.delayed is not None or dp.overlaps)
        if self.eager_now and runs_nested_backward(loss):
            # A reentrant checkpoint's backward is a backward of its own, inside this one: a parameter used
            # inside and outside it gets its gradient in parts, so none is known final before the end
            self.eager_now = False
        if self.eager_now:
            self.eager_done = True
            if self.eager_allowed and self.delayed is None:
                self.optimizer.begin_step()
            self.pending = list(self.tensors_per_page)
            for index in self.binder.detached_saves:  # read by a node after their gradients are final: never final
                if index < len(self.pending):  # in this backward, so updated (and published) at step()
                    self.pending[index] += 1
            self.ready = set()
            self.final_order = []
            dp.begin_backward()
        self.binder.in_backward = True
        try:
            try:
                (loss if self.loss_scaler is None else loss * self.loss_scaler.scale).backward(
                    retain_graph=retain_graph)
            except RuntimeError as exc:  # (torch.utils.checkpoint.CheckpointError is one)
                if not replay_failed(exc):
                    raise
                raise ActivationError(
                    f"a recomputation in backward (activations.checkpoint, or the model's own checkpointing) did "
                    f"not replay its forward ({str(exc).strip().splitlines()[0][:160]}): the unit's forward depends "
                    f"on state its first run changed (HuggingFace T5's decoder); use the model's own "
                    f"gradient_checkpointing_enable(), or activations.unit_modes to leave that unit type out") from exc
            if self.eager_now:
                self._flush_updates()
                self._update_landed()
        finally:
            self._batches = {}  # (after an error: groups not updated, as any the backward did not reach)
            if self.eager_now:
                dp.end_backward()
            self.eager_now = False
            self.binder.in_backward = False
            self.binder.grads_pending = True
            self.binder.end_backward()
            if self.data_parallel.gatherer is not None:
                self.data_parallel.gatherer.end_backward()

    def _grad_ready(self, slot) -> None:
        """A tensor's gradient is final (last micro-batch): update each of its pages whose gradients all are."""
        if not self.eager_now or slot.name in self.ready:
            return
        self.ready.add(slot.name)
        for index in dict.fromkeys(seg.page for seg in slot.segments):
            self.pending[index] -= 1
            if self.pending[index] == 0:
                self.final_order.append(index)
                if self.delayed is not None:
                    self.delayed.publish(index)
                elif self.eager_allowed and not self.data_parallel.overlaps:
                    self._update_soon(index)
                self.data_parallel.page_final(index)
        self._update_landed()

    def _update_soon(self, index: int) -> None:
        """Page group `index` is final: updated with others of its unit, one access for a batch of them
        (PagedAdamW.batches), once the batch is full or holds all the unit's groups (so in the same place whatever
        other units, say experts routed or not, became final meanwhile), the rest when backward ends."""
        key = self.optimizer.batch_key[index]
        batch = self._batches.setdefault(key, [])
        batch.append(index)
        if len(batch) == min(self.optimizer.batch_groups, self._unit_groups[key]):
            del self._batches[key]
            self.optimizer.update_groups(batch)

    def _flush_updates(self) -> None:
        batches, self._batches = self._batches, {}
        for batch in batches.values():  # (in the order each unit's first group became final)
            self.optimizer.update_groups(batch)

    def _update_landed(self) -> None:
        """Page groups whose reduction landed (their owner holds the mean gradient): this rank's page of each is
        updated now (staleness 0, eager)."""
        for group in self.data_parallel.take_landed():
            index = group * self.ownership.dp + self.ownership.rank
            if self.eager_allowed and self.delayed is None and index in self._updates_here:
                self.optimizer.update_group(index)

    def _before_unit_forward(self) -> None:
        """staleness 1: a share of the pending update before each unit's forward (training steps only)."""
        if self.delayed.pending and self.model.training and torch.is_grad_enabled():
            self.delayed.run_some()

    def _before_grad_write(self, slot) -> None:
        """staleness 1: the pending update of a page reads its gradient before this step's overwrites it."""
        for seg in slot.segments:
            self.delayed.run(seg.page)

    def _publish(self, index: int) -> None:
        """staleness 1: param page `index` takes the delayed update's master. On the update's tier, whatever the
        pages' tiers now (a device copy serves a host access): the access is the same every step, so the plan holds."""
        copy_master_into_param(self.scheduler, self.pages, self.layout, index, self.optimizer.update_tier,
                               label="opt:publish")

    def flush(self) -> None:
        """staleness 1: finish the pending update and put its result in the parameters, every rank's (the owners'
        new parameters all-gathered, gathered copies dropped, as after a step: every rank calls it, and whether an
        update is pending is the same on all of them)."""
        if self.delayed is not None:
            self.delayed.publish_all()
            if self._landing:
                self._landing = False
                self.data_parallel.params_updated()

    # ------------------------------------------------------------------ the norm and the step
    def finish_grads(self) -> None:
        """Close this step's gradients (once per step): the tensors that got one and an fp16 overflow, agreed over
        the data-parallel ranks, then the gradients reduced onto their owners (parallel/data_parallel.py)."""
        if self.grads_final:
            return
        self.binder.settle_grads()
        overflow = self.loss_scaler is not None and self.binder.take_overflow()
        self.binder.without_grad, self.last_step_skipped = self.data_parallel.finish_grads(
            self.binder.without_grad, overflow)
        self.grads_final = True

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.delayed is not None:
            self.delayed.finish()  # update t has read its gradients; the norm reads step t+1's
        elif self.optimizer.updated_this_step:
            raise ConfigValueError(
                "trainer.grad_clip: clip_grad_norm was called after pages were already updated during backward; "
                "set trainer.grad_clip so the engine waits for the norm (or optimizer.overlap_updates: false)")
        self.finish_grads()
        # The pages hold the gradients as backward left them: a clip earlier in this step is pending in grad_scale
        # (folded into the update), so the norm is of the gradients as already clipped, as torch's second call sees
        total = self.data_parallel.grad_norm(self.optimizer, self.binder.without_grad) * self.optimizer.grad_scale
        if self.loss_scaler is not None:  # the norm of the true gradients (inf after an overflow: the step is skipped)
            total = float("inf") if self.last_step_skipped else total / self.loss_scaler.scale
        clip_coef = max_norm / (total + 1e-6)
        if clip_coef < 1.0:
            self.optimizer.scale_grads(clip_coef)
        return total

    def step(self) -> None:
        if self.delayed is not None:  # update t-1 done and in the parameters before update t is opened
            self.delayed.publish_all()
            self._landing = False  # (every rank's at the end of this step)
        self.finish_grads()
        if self.last_step_skipped:  # nothing updated: parameters, master weights, moments and step counts stay
            self.optimizer.skip_step()
            self.scheduler.discard(self.pages["grad"])  # dead: never written back
        else:
            if self.loss_scaler is not None:
                self.optimizer.scale_grads(1.0 / self.loss_scaler.scale)  # folded into the update's gradient read
            if self.delayed is not None:
                # The order this step's gradients became final: step t+1 writes them in about that order again.
                final = set(self.final_order)
                order = self.final_order + [i for i in self.optimizer.local_indices if i not in final]
                self.delayed.enqueue([i for i in order if self.ownership.updated(i)], self.binder.without_grad)
                self._landing = True
            else:
                self.optimizer.step(self._update_order(), without_grad=self.binder.without_grad)
            self.binder.weights_changed()  # a graph saved before this step reads other weights now
        self.data_parallel.params_updated()  # the owners' new parameters reach every rank
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.last_step_skipped)
        self.start_over()
        self.scheduler.end_step()

    def _update_order(self) -> list[int] | None:
        """Layout page indices in the order the plan says their gradients became final (None: layout order)."""
        planned = self.scheduler.update_order()
        if not planned:
            return None
        order, seen = [], set()
        for pid in planned:
            page = self.scheduler.manager.pages[pid]
            if page.kind == "grad" and page.index not in seen and self.ownership.updated(page.index):
                order.append(page.index)
                seen.add(page.index)
        order.extend(i for i in self.optimizer.local_indices if i not in seen)
        return order

    def zero_grad(self) -> None:
        if self.delayed is None and self.optimizer.updated_this_step:
            raise ConfigValueError("zero_grad: pages were already updated during this step's backward "
                                   "(optimizer.overlap_updates); call step() to finish it, or set "
                                   "optimizer.overlap_updates: false to be able to drop a step after its backward")
        # staleness 1, a step dropped after its backward: that backward published the pending update on the pages
        # that became final in it, which pages depending on the ranks and micro-batches. The rest now (before the
        # gradients go: the update still reads the previous step's), so the next step computes with the parameters
        # after that update on every rank, not with a mix of both.
        dropped = self.delayed is not None and self.micro > 0
        if dropped:
            self.delayed.publish_all()
        if self.data_parallel.reductions_open:  # begun during backward: finished alike on every rank, then dropped
            self.finish_grads()
            self.scheduler.discard(self.pages["grad"])
        if dropped:
            self.flush()  # (landed already: the owners' new parameters to every rank, as at step())
        self.binder.drop_stray_grads()
        self.start_over()

    def start_over(self) -> None:
        """The gradients of this step are dead: the next backward starts a new one."""
        self.binder.start_new_step()
        self.micro = 0
        self.eager_done = False  # a backward of this step did the last micro-batch's work as gradients became final
        self.grads_final = False
