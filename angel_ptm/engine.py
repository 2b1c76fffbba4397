"""The Engine: `initialize(model, config)` turns any nn.Module into one whose states live in pages.

    engine = angel_ptm.initialize(model, config)
    loss = engine(*inputs)        # same result as model(*inputs)
    engine.backward(loss)
    engine.step()                 # optimizer step, then gradients zeroed

The engine only wires small parts together: a PageLayout of the parameters, a PageManager over the three tiers,
a ParamBinder that points parameters at pages around each module's forward and backward, and a page-wise AdamW.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import statistics
import threading
import time

import torch
from torch import nn

from angel_ptm.binding import ParamBinder
from angel_ptm.config import Config, load_config
from angel_ptm.errors import ConfigValueError, EngineBusyError, EngineClosedError
from angel_ptm.failure import Failure
from angel_ptm.estimate import estimate_job
from angel_ptm.inputs import to_device
from angel_ptm.interrupts import defers_interrupts
from angel_ptm.lr import ConfigSchedule
from angel_ptm.memory import build_layout
from angel_ptm.memory.materialize import buffers_back, buffers_onto
from angel_ptm.memory.placement import CREATION_ORDER, compute_dtype, creation_order
from angel_ptm.model_checks import refuse_changed_parameters, refuse_compiled, refuse_unsupported
from angel_ptm.page_tensors import PageTensors
from angel_ptm.paging import Paging, choose_disk_dir, open_paging
from angel_ptm.parallel.data_parallel import agree_on_job, broadcast_buffers, join
from angel_ptm.parallel.moe.placement import rebalancer_for
from angel_ptm.parallel.ownership import with_experts
from angel_ptm.parallel.split import split_model
from angel_ptm.schedule import Scheduler
from angel_ptm.state_dict import StateAccess, exclusive
from angel_ptm.saved_tensors import OpenGraphs
from angel_ptm.step import build_step, cast_master_into_parameters, copy_masters_into_params
from angel_ptm.trace import TraceRecorder
from angel_ptm.views import EngineViews
from angel_ptm.units import UnitsSpec, experts_as_units, find_units, watch_experts

STEP_CLOCK = 8  # steps whose durations `step_seconds` takes the median of

STATE_KINDS = CREATION_ORDER  # the fp32 job's kinds in creation order (placement.creation_order: per job)


class Engine(StateAccess, EngineViews):
    def __init__(self, model: nn.Module, config: Config, trace: TraceRecorder | None = None,
                 units: UnitsSpec = None, example_inputs=None):
        try:
            self._set_up(model, config, trace, units, example_inputs)
        except BaseException:
            self._abandon()  # a refused or failed start leaves no threads, pools or page files behind
            raise

    def _abandon(self) -> None:
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.close()
        if getattr(self, "_paging", None) is not None:
            self._paging.close()

    def _set_up(self, model: nn.Module, config: Config, trace: TraceRecorder | None, units: UnitsSpec,
                example_inputs) -> None:
        refuse_unsupported(model)
        self._paging = Paging()  # the tiers, opened in order; closed whole by close() or a failed start
        self.model, self.config = model, config
        self.trace = trace or TraceRecorder(None)
        if self.trace.enabled and self.trace.max_bytes is None:  # a recorder made without a bound: the config's
            self.trace.max_bytes = config.trace.max_bytes
        self.failure = Failure()  # why the engine refuses every call, once a step or a collective failed part-way
        mem = config.memory
        # torchrun: the process group from the environment, one GPU per process, this rank's share of the pages
        self.mesh, self.device, self.ownership, self.collectives = join(config, self.trace,
                                                                        self.failure.collective_failed)
        self.failure.distributed = self.mesh.distributed
        # parallel.tp > 1: this rank's shards of the split layers (the built-in plan unless the user applied one)
        # and parallel.ep > 1: this rank's experts, whose pages are rank-local (never sharded, gathered or reduced)
        self.split = split_model(model, self.mesh, self.trace, self.failure.collective_failed)
        self.compute_dtype = compute_dtype(config)  # None: fp32, the parameters are the master weights
        self.kinds = creation_order(config)
        self.layout = build_layout(model, mem.page_bytes, dp_world_size=self.mesh.dp,
                                   compute_dtype=self.compute_dtype, local=self.expert_names)
        self.ownership = with_experts(self.ownership, self.layout.local_pages, config.parallel.ep)
        # same job everywhere, then the data-parallel group's rank 0's initial values
        self.world = agree_on_job(self.mesh, self.collectives, config, self.layout, model, self.trace,
                                  set(self.expert_names))
        par = config.parallel  # (MoE experts are units of their own unless ZeRO-3 gathers them over dp ranks)
        experts_apart = experts_as_units(self.mesh.dp, par.zero, par.ep)
        self.units = find_units(model, units, experts_apart)
        own = self.ownership
        disk_dir = choose_disk_dir(self._paging, mem.disk_dir)
        # The estimate (angel-ptm estimate) runs first: a job that cannot fit is refused with the numbers, before
        # any allocation. It includes the largest layer's pages, which the device must hold at once.
        self.estimate = estimate_job(config, model, layout=self.layout, disk_dir=disk_dir, device=self.device,
                                     units=self.units, ownership=own, local_world_size=self.mesh.local_world_size,
                                     example_inputs=example_inputs)  # (another model's activations traced with them)
        self.estimate.check()
        self._min_device_pages = max(self.estimate.largest_layer_pages, self.estimate.gather_pages,
                                     self.estimate.expert_gather_pages)
        open_paging(self._paging, config, self.layout, self.kinds, own, self.estimate, self.mesh, self.device,
                    self.trace, next(_ENGINE_NUMBERS))
        self.budgets, self.manager, self.pages = self._paging.budgets, self._paging.manager, self._paging.pages
        # The front door of the step's page accesses: the binder, the optimizer and the gatherer go through it.
        self.scheduler = Scheduler(self.manager, planned=mem.scheduler == "planned", lookahead=mem.lookahead,
                                   activation_bytes=lambda: self.binder.take_activation_peak(), trace=self.trace)
        # MoE experts: touched only when routed to; once a layer knows which compute, the others' fetches cancelled
        self._routing_hooks = watch_experts(model, self.layout, self.pages, self.scheduler, self.manager,
                                            experts_apart, mem.expert_warm_threshold, mem.expert_history_ema)
        self.tensors = PageTensors(self.manager, self.layout, self.pages, self.ownership, self.collectives)
        # Parameter values into their pages (a meta-device model materialized straight into them: `meta_init`)
        self.meta_init = self.tensors.fill_from(model)
        if "master" in self.pages:
            cast_master_into_parameters(model, self.scheduler, self.pages, self.layout, own, self.compute_dtype)
        self._buffers_cast = buffers_onto(model, self.device, self.compute_dtype)  # (meta ones computed there)

        self.binder = ParamBinder(model, self.layout, self.manager, self.pages["param"], self.pages["grad"],
                                  self.device, self.units, access=self.scheduler)
        self.binder.read_values = self.tensors.read_weights
        self.binder.outside_writes.attach(self._write_outside, lambda: self.data_parallel.params_updated(),
                                          self._busy_for_writes, self._weights_lag, self.flush)
        self._closed = False
        self._busy_lock, self._busy_thread, self._busy_depth = threading.Lock(), None, 0  # (_one_thread)
        self._steps_done = 0
        self._step_ends: collections.deque = collections.deque(maxlen=STEP_CLOCK + 1)  # when the last steps ended
        self._schedule = ConfigSchedule(config)  # applied on step(); set_lr turns it off
        self.binder.attach_config(config.activations, self.scheduler, mem.page_bytes)  # recompute, offload
        model.load_state_dict = self._load_into_pages  # (the instance's: close() gives the model torch's back)
        # The optimizer (pinning its pages where the estimate resolved), the data-parallel fixed points, the driver
        self.optimizer, self.data_parallel, self.driver = build_step(
            config, self.estimate, model=model, layout=self.layout, pages=self.pages, scheduler=self.scheduler,
            manager=self.manager, binder=self.binder, collectives=self.collectives, ownership=own, mesh=self.mesh,
            split=self.split, n_units=len(self.units))
        self._schedule.apply(self.optimizer, 0)
        self.tensors.replicas = getattr(self.data_parallel, "replicas", None)  # reads of experts' sharded states
        self.rebalancer = rebalancer_for(self)  # parallel.moe_rebalance_every: experts move to balance the load
        # modules whose buffers are this rank's own (its experts under parallel.ep): not made rank 0's after steps
        self._local_modules = frozenset(name.rsplit(".", 1)[0] + "." for name in self.expert_names)
        self.graphs = OpenGraphs()  # training forwards not yet backwarded (a checkpoint refuses to cut a step)

    # ------------------------------------------------------------------ the step
    @defers_interrupts
    def __call__(self, *args, **kwargs):
        """The model's forward, its inputs on the compute device (angel_ptm/inputs.py)."""
        self._check_alive()
        refuse_compiled(self.model)  # model.compile() after initialize
        refuse_changed_parameters(self.model, self.binder.slots, self.layout.frozen)
        args, kwargs = to_device((args, kwargs), self.device, self.compute_dtype)
        with self._one_thread("forward"), self.failure.in_step("forward"), self.failure.reads(), \
                self.binder.saved_tensor_hooks():
            try:
                output = self.model(*args, **kwargs)
                if self.model.training:  # (a checkpoint waits for its backward: saved_tensors.OpenGraphs)
                    self.graphs.add(output)
                return output
            except BaseException:
                self.binder.abort_forward()  # (a KeyboardInterrupt skips torch's always-call forward hooks)
                raise

    @defers_interrupts
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of one micro-batch. In the last one (trainer.grad_accum of them per step), with the planned
        scheduler and no clipping, each page group is updated as soon as all its gradients are in. With fp16 the
        loss is multiplied by the loss scale first (the update divides the gradients by it). `retain_graph`: as
        torch's, for a second loss of the same forward (each backward counts towards trainer.grad_accum)."""
        self._check_alive()
        with self._one_thread("backward"), self.failure.in_step("backward"), \
                self.failure.step(self.optimizer, self.delayed):  # (all or nothing)
            self.driver.backward(loss, retain_graph)
        if not retain_graph:
            self.graphs.clear()

    @defers_interrupts
    @exclusive
    def flush(self) -> None:
        """staleness 1: finish the pending update and put its result in the parameters (the end of training, or
        before reading the final weights); the next step then computes with them. A no-op with staleness 0."""
        self.driver.flush()

    @defers_interrupts
    @exclusive
    def clip_grad_norm(self, max_norm: float) -> float:
        """The global L2 norm of this step's gradients (over every rank's pages); scales them to `max_norm` (a number,
        not NaN: torch's clip turns every gradient into NaN there)."""
        if isinstance(max_norm, (bool, str)) or not isinstance(max_norm, (int, float, torch.Tensor)) or \
                math.isnan(float(max_norm)):
            raise ConfigValueError(f"clip_grad_norm: max_norm must be a number (inf: no clipping), got {max_norm!r}")
        self._check_alive()
        return self.driver.clip_grad_norm(float(max_norm))

    def set_lr(self, lr: float) -> None:
        """Drive the learning rate yourself: from now on the config's lr_schedule is no longer applied. A number
        >= 0 (a 0-dim tensor too, as torch optimizers take); anything else is a ConfigValueError, before any page
        is touched."""
        try:
            value = float(lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr)
        except (TypeError, ValueError):
            value = None
        if value is None or isinstance(lr, (bool, str)) or not 0 <= value < math.inf:
            raise ConfigValueError(f"set_lr: the learning rate must be a number >= 0 and finite, got {lr!r}")
        self._schedule.on = False
        self.optimizer.lr = value

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.optimizer.lr

    @defers_interrupts
    def step(self) -> None:
        """The optimizer step over every page, then gradients zeroed (the next backward overwrites them). With fp16
        loss scaling, a step whose gradients overflowed is skipped whole and the loss scale adjusted. An error part-way
        (I/O, checksum, disk full) marks the engine failed: every later call raises EngineFailedError."""
        self._check_alive()
        with self._one_thread("step"), self.failure.step(self.optimizer, self.delayed):
            self.driver.step()
            if self.collectives is not None:  # ranks updated them with their own batches (on every rank, whatever
                # mode the model is in now: an eval forward between backward and step left it in eval on some)
                broadcast_buffers(self.model, self.collectives, self._local_modules)
            if self.rebalancer is not None:  # at the step boundary, on every rank
                self.rebalancer.after_step(self._steps_done + 1)
        self._steps_done = self.failure.steps_done = self._steps_done + 1
        self.failure.step_ended()
        self.binder.outside_writes.refresh()  # views of parameters the user holds read the new values
        self._schedule.apply(self.optimizer, self._steps_done)
        self._step_ends.append(time.perf_counter())

    @contextlib.contextmanager
    def _one_thread(self, call: str):
        """Refuse a call while another thread is inside one (EngineBusyError); the same thread may nest."""
        me = threading.get_ident()
        with self._busy_lock:
            if self._busy_thread not in (None, me):
                raise EngineBusyError(f"engine.{call}: another thread is inside a call of this engine (a forward, "
                                      f"backward, step, checkpoint or state read); drive it from one thread, or "
                                      f"one call after another")
            self._busy_thread, self._busy_depth = me, self._busy_depth + 1
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy_depth -= 1
                if self._busy_depth == 0:
                    self._busy_thread = None

    @property
    def step_seconds(self) -> float | None:
        """The median time between the ends of the last steps (data, forward, backward, step and whatever the loop
        does between them), None before two steps."""
        ends = list(self._step_ends)
        return statistics.median(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else None

    @defers_interrupts
    @exclusive
    def zero_grad(self) -> None:
        self._check_alive()
        self.driver.zero_grad()

    def train(self, mode: bool = True) -> "Engine":
        """Training mode; evaluation passes (mode False) are not part of the scheduled step."""
        self.model.train(mode)
        self.scheduler.paused = not mode
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters_written(self) -> None:
        """After weights were written into master pages: the compute copies (param pages) take them, on every rank."""
        copy_masters_into_params(self.scheduler, self.pages, self.layout, self.ownership)
        self.data_parallel.params_updated()
        self.binder.weights_changed()
        self.binder.outside_writes.refresh()

    def _check_alive(self, reading: bool = False) -> None:
        """Refuse a call on a failed engine, or (unless it only `reading` state) on a closed one."""
        self._settle_outside_writes()  # parameters written in place outside their units since: into the pages
        if self._closed and not reading:
            raise EngineClosedError("the engine was closed: its model holds the trained weights as ordinary tensors "
                                    "(model.state_dict()); angel_ptm.initialize(model, ...) trains on from them")
        self.failure.check()

    @defers_interrupts(strict=True)
    def close(self) -> None:
        """Stop the engine and free its pages; the model keeps its trained weights as ordinary CPU tensors (the
        fp32 master weights under mixed precision), usable and saveable; a failed one leaves placeholders.
        Idempotent. Refused (EngineBusyError) while another thread is inside a forward, backward or step."""
        if self._closed:
            return
        with self._one_thread("close"):
            self._close()

    def _close(self) -> None:
        self._closed = True
        self.failure.closing()
        values = None  # the weights the model keeps: none from a failed engine, or when the last update fails
        try:
            if self.failure.reason is None and self.failure.torn_load is None:
                self.binder.outside_writes.settle(publish=False)  # (a parameter written through a view since)
                self.flush()  # staleness 1: the pending update lands in the weights first
                values = self.tensors.read_weights
        finally:
            self._finish_checkpoint()  # a save beside training reads slot files: it ends before they go
            self.data_parallel.close()  # no gather may still be writing into a slot when the pools go
            self.scheduler.close()
            for hook in getattr(self, "_routing_hooks", ()):
                hook.remove()
            self.model.__dict__.pop("load_state_dict", None)
            try:
                self.binder.detach(values)
                buffers_back(self.model, self._buffers_cast)  # (beside the CPU fp32 weights it keeps)
            finally:
                self._paging.close()

    def _load_into_pages(self, state_dict, strict: bool = True, assign: bool = False):
        """`model.load_state_dict(...)` while the engine manages the model: `engine.load_state_dict` (torch's own
        would copy into parameters that have no values outside their units, after loading some buffers)."""
        if assign:
            raise ConfigValueError("load_state_dict(assign=True): the engine's pages hold the parameters, so they "
                                   "cannot be replaced by the state dict's tensors; load without assign")
        return self.load_state_dict(state_dict, strict)


_ENGINE_NUMBERS = itertools.count(1)  # names each engine's page directory in this process (never reused, as ids are)


def initialize(model: nn.Module, config=None, trace: TraceRecorder | None = None, units: UnitsSpec = None,
               example_inputs=None) -> Engine:
    """Wrap `model`; `config` is a dict, a YAML path, an angel_ptm.Config or None (defaults). `units`: the paging
    units (angel_ptm/units.py): None for the default (each block of the model's repeated block lists, the root
    owning the rest), a list of module types, or a predicate `module -> bool`. `example_inputs`: one
    micro-batch's forward arguments (a tuple, or a dict of keyword arguments; meta tensors will do), so the
    estimate counts the activations of a model other than our GPT (traced, activations/footprint.py)."""
    if not isinstance(config, Config):
        config = load_config(config)
    return Engine(model, config, trace=trace, units=units, example_inputs=example_inputs)
