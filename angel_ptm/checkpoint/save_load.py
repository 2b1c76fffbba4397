"""Save and load an engine's whole training state as a DCP checkpoint directory, collectively on every rank.

    save_checkpoint(engine, "ckpts/step-5", extra={"step": 5})   # written into ckpts/step-5.tmp, then renamed
    extra = load_checkpoint(engine, "ckpts/step-5")              # any rank count, page size or placement

What a checkpoint holds besides the tensors (planners.py), as DCP bytes items:

    angel_ptm.engine      steps taken, per-tensor AdamW step counts, lr and hyperparameters, whether the config's
                          LR schedule drives the lr, the fp16 loss scaler, whether the param pages lag the master
                          (optimizer.staleness 1: update t ran, its parameters are published during step t+1), the
                          saving job's config, world size, ZeRO stage, page size and layout fingerprint, and the
                          model's state_dict names (and a HuggingFace config) for `angel-ptm export`, and the
                          `get_extra_state()` of each module that has one
    angel_ptm.rng.<R>     rank R's RNG states (torch CPU and CUDA, numpy, python)
    angel_ptm.extra       the caller's picklable object (the trainer's step), returned by load_checkpoint

A save happens between steps: with staleness 1 the pending update runs first (its result does not depend on when
it runs, so the run goes on exactly as it would have), and the param pages keep the values step t+1 computes with.
Pages are read where they live and no page changes tier. The directory is complete only once renamed from `.tmp`;
a failed save removes its `.tmp` on rank 0 and leaves the engine as it was.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from angel_ptm.checkpoint.buffers import PageStream
from angel_ptm.checkpoint.export import read_object
from angel_ptm.checkpoint.planners import PageLoadPlanner, PageSavePlanner
from angel_ptm.checkpoint.snapshot import Snapshot
from angel_ptm.checkpoint.storage import CheckedReader, CheckedWriter, fault, fsync_dir
from angel_ptm.config.loader import config_to_dict
from angel_ptm.errors import (AngelError, CheckpointCorruptError, CheckpointError, CheckpointWriteError,
                              EngineClosedError)
from angel_ptm.io.stream import Pace
from angel_ptm.state_dict import _extra_states, _persistent_buffers
from angel_ptm.step import copy_masters_into_params

ENGINE, EXTRA, RNG = "angel_ptm.engine", "angel_ptm.extra", "angel_ptm.rng."


def save_checkpoint(engine, path: str | os.PathLike, extra: Any = None, background: bool = False,
                    on_done: Callable[[Path], None] | None = None, kept: list[Path] | None = None):
    """Write the engine's training state to directory `path` (which must not exist), on every rank. Returns the
    path; with `background`, a PendingSave at once: the pages' bytes as they are now (Snapshot) are written by a
    thread while training goes on. `on_done(path)` runs once the checkpoint is complete (rank 0 only). `kept`:
    the checkpoints that outlive this save (`on_done` may delete others): disk pages that still read a loaded
    checkpoint outside them take their bytes into their own slots first."""
    engine._check_alive()
    _at_step_boundary(engine, "save_checkpoint")
    engine.wait_for_checkpoint()  # one save at a time
    path = Path(path).expanduser().absolute()
    rank = engine.mesh.rank  # the world's rank 0 decides (with tensor parallelism several ranks are dp rank 0)
    delayed = engine.delayed
    if delayed is not None and delayed.pending:  # staleness 1: update t runs now, exactly as it would later
        with engine.failure.step(engine.optimizer, delayed):
            delayed.finish()
    lagging = delayed is not None and bool(delayed.unpublished)
    tmp = path.with_name(path.name + ".tmp")
    outcome: Any = None
    if rank == 0:  # one rank decides, every rank learns it: no rank is left waiting in a collective
        try:
            if path.exists():
                raise CheckpointError(f"checkpoint: {path} already exists; a checkpoint is never written into an "
                                      f"existing directory", str(path))
            if tmp.exists():  # a save killed part-way: never a checkpoint, removed before this one
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        except OSError as err:
            outcome = CheckpointWriteError(f"checkpoint: cannot create {tmp}: {err.strerror}", str(tmp),
                                           err.errno or 0)
        except CheckpointError as err:
            outcome = err
    outcome = _agree(engine, outcome, "checkpoint directory")
    if outcome is not None:
        raise outcome
    engine.manager.flush()  # no move in flight: a page's bytes are where the planner finds them
    if engine.manager.disk is not None:  # pages that read a checkpoint about to be pruned read their own slots
        engine.manager.disk.settle(engine.manager.pages, kept)
    objects = {f"{RNG}{rank}": rng_state()}
    tensors = {}
    named = named_by_every_rank(engine)  # (a collective under expert parallelism: each rank names its own experts)
    if rank == 0:
        objects[ENGINE] = engine_state(engine, lagging, named)
        objects[EXTRA] = extra
        tensors = {f"buffer.{k}": v.detach().to("cpu", copy=True)
                   for k, v in _persistent_buffers(engine.model).items()}
        # A tensor with no elements lies on no page: its shape and dtype are kept as an empty item, for export.
        tensors.update({f"param.{name}": torch.empty(param.shape, dtype=param.dtype)
                        for name, param in engine.model.named_parameters() if param.numel() == 0})
    info = {"world_size": engine.mesh.world_size, "dp": engine.ownership.dp, "tp": engine.mesh.tp,
            "zero": engine.ownership.stage,
            "page_bytes": engine.layout.page_bytes, "layout": engine.layout.fingerprint(),
            "steps_done": engine._steps_done}
    planner = PageSavePlanner(engine, objects, tensors)
    group = engine.world.side_group() if engine.world is not None else None  # made here: collective
    if not background:
        planner.source = PageStream(engine.manager, planner.order, engine.layout.page_bytes)
        _write(engine, planner, group, tmp, path, info, on_done, agree=lambda o: _agree(engine, o, "checkpoint"))
        return path
    planner.source = Snapshot(engine.manager, planner.order, engine.layout.page_bytes)
    pace = Pace(async_rate(engine.config.checkpoint, len(planner.order) * engine.layout.page_bytes,
                           engine.step_seconds))
    pending = PendingSave(path, planner.source, pace)
    agree = (lambda o: o) if group is None else (lambda o: _broadcast_on(group, o))
    pending.start(lambda: _write(engine, planner, group, tmp, path, info, on_done, agree, pace))
    engine.pending_checkpoint = pending
    return pending


AUTO_SPREAD = 0.5  # checkpoint.async_max_gbps "auto": a save is written in this share of the time to the next one


def async_rate(config, nbytes: int, step_seconds: float | None) -> float | None:
    """`checkpoint.async_max_gbps` in bytes per second for a save of about `nbytes` (None: unpaced). "auto": the
    rate that writes it in AUTO_SPREAD of the time until the next save (`every` steps of `step_seconds`); unpaced
    without `every` or before two steps."""
    gbps = config.async_max_gbps
    if gbps != "auto":
        return gbps * 1e9 if gbps else None
    if not config.every or not step_seconds:
        return None
    return max(nbytes, 1) / (AUTO_SPREAD * config.every * step_seconds)


def _write(engine, planner, group, tmp: Path, path: Path, info: dict, on_done, agree,
           pace: Pace | None = None) -> None:
    """The collective DCP save into `tmp`, then rank 0 renames it to `path` (and runs `on_done`); a failure on
    any rank removes `tmp` and raises the same typed error on every rank."""
    rank = engine.mesh.rank
    try:
        _run(engine, "save", lambda: dcp.save({}, storage_writer=CheckedWriter(tmp, info, pace),
                                              planner=planner,
                                              process_group=group, no_dist=group is None))
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        planner.source.close()
    outcome = None
    if rank == 0:
        try:
            fault("before-rename")
            os.replace(tmp, path)
            fsync_dir(path.parent)
            if on_done is not None:
                on_done(path)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = CheckpointWriteError(f"checkpoint: cannot rename {tmp} to {path}: {err.strerror}", str(path),
                                           err.errno or 0)
    outcome = agree(outcome)
    if outcome is not None:
        raise outcome
    engine.last_checkpoint_read_bytes = planner.source.read_bytes


def _yield_to_training() -> None:
    """The checkpoint's threads run at the lowest CPU priority (Linux: per thread, inherited by the writer thread
    it starts): where cores are short, training's threads go first and the save takes the idle time."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: the save shares the cores evenly
        pass


def _broadcast_on(group, outcome):
    """Rank 0's outcome on every rank, over the checkpoint's own group (a save beside training may not use the
    training's collectives)."""
    box = [outcome]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


log = logging.getLogger("angel_ptm.checkpoint")
# Saves being written beside training, for the interpreter's exit (_finish_saves_at_exit)
_IN_FLIGHT: "weakref.WeakSet[PendingSave]" = weakref.WeakSet()
_EXIT_HOOK = [False, False]  # (registered, the interpreter is exiting)


def _finish_saves_at_exit() -> None:
    """The interpreter is ending (a script returned with a save still being written: no engine.close() or wait()).
    Run by threading's shutdown before it joins the threads that are not daemons, which a save's is: each save goes
    on unpaced and the exit waits for it, so it lands whole (or, if it fails, its error is logged and its `.tmp` is
    left for the next save to remove). As a daemon the save was cut off wherever it was: no checkpoint and a 0 exit
    status, or an abort (std::terminate) when the cut came inside a native call that had released the GIL."""
    _EXIT_HOOK[1] = True
    for save in list(_IN_FLIGHT):
        if save.done():
            save._log_unreported()
            continue
        log.warning("angel_ptm: the checkpoint %s is still being written: the exit waits for it", save.path)
        if save.pace is not None:
            save.pace.lift()


class PendingSave:
    """A checkpoint being written beside training. `wait()` returns its path once complete on every rank, or
    raises the save's typed error; `done()` says whether it has finished. The interpreter's exit waits for it
    (`_finish_saves_at_exit`)."""

    def __init__(self, path: Path, snapshot: Snapshot, pace: Pace | None = None):
        self.path, self._snapshot, self.pace = path, snapshot, pace
        self.error: BaseException | None = None
        self._finished = threading.Event()  # set when the save's thread is through, whatever its outcome
        self.reported = False  # its error was raised to a caller of wait(): the engine's next wait is not told again
        self.seconds = 0.0
        self._thread: threading.Thread | None = None

    @property
    def staged_bytes(self) -> int:
        """Bytes of saved pages copied aside so far: those pinned at the save, and those training changed before
        the writer reached them."""
        return self._snapshot.copied_bytes

    def start(self, work: Callable[[], None]) -> None:
        def run():
            t0 = time.perf_counter()
            try:
                _yield_to_training()
                work()
            except BaseException as exc:  # noqa: BLE001 - raised by wait() in the training thread
                self.error = exc
            self.seconds = time.perf_counter() - t0
            self._finished.set()
            if _EXIT_HOOK[1]:  # nobody will wait() for it any more
                self._log_unreported()

        if not _EXIT_HOOK[0] and hasattr(threading, "_register_atexit"):  # (concurrent.futures' hook, 3.9+)
            threading._register_atexit(_finish_saves_at_exit)
            _EXIT_HOOK[0] = True
        _IN_FLIGHT.add(self)
        self._thread = threading.Thread(target=run, name="angel-ptm-checkpoint", daemon=False)
        self._thread.start()

    def _log_unreported(self) -> None:
        if self.error is not None and not self.reported:
            self.reported = True
            log.error("angel_ptm: the checkpoint %s was not written: %s", self.path, self.error)

    def done(self) -> bool:
        # (not the thread's is_alive(): a KeyboardInterrupt in a join() leaves a running thread looking stopped)
        return self._finished.is_set()

    def wait(self) -> Path:
        """(A paced save is waited for: its pace is lifted, the rest written as fast as it can.)"""
        if self.pace is not None:
            self.pace.lift()
        if self._thread is not None:
            # (its event, not join(): a KeyboardInterrupt inside a join leaves the thread looking stopped, and
            # every later join returns at once while it still writes)
            self._finished.wait()
        if self.error is not None:
            self.reported = True
            raise self.error
        return self.path


def load_checkpoint(engine, path: str | os.PathLike) -> Any:
    """Read directory `path` into the engine (every page, the step counts, RNG, loss scale) on every rank; returns
    the `extra` it was saved with. The checkpoint may come from any rank count, page size or placement."""
    if engine._closed:  # (its model holds ordinary tensors now: a load would write only its buffers)
        raise EngineClosedError("load_checkpoint: the engine was closed; angel_ptm.initialize(model, ...) again and "
                                "load into the new engine")
    engine.failure.check(loading=True)  # a load that failed part-way may be followed by another
    _at_step_boundary(engine, "load_checkpoint")
    engine.wait_for_checkpoint()
    path = Path(path).expanduser().absolute()
    engine.flush()  # staleness 1: no pending update may land on top of the loaded state
    rank = engine.mesh.rank
    if not (path / ".metadata").is_file():
        raise CheckpointCorruptError(f"checkpoint: {path} is not a complete checkpoint (no .metadata)", str(path))
    reader = CheckedReader(path)
    reader.read_metadata()  # checked here: a corrupt .metadata is a typed error naming it
    # Another model's checkpoint is refused before a page is written (the pages' shapes: by the planner)
    _refuse_anywhere(engine, misfit(engine, read_object(reader, ENGINE), steps=False), "load_checkpoint: fits")
    buffers = {f"buffer.{k}": v for k, v in _persistent_buffers(engine.model).items()}
    planner = PageLoadPlanner(engine, [ENGINE, EXTRA, RNG], buffers)
    group = engine.world.side_group() if engine.world is not None else None
    try:
        try:
            _run(engine, "load", lambda: dcp.load({}, storage_reader=reader, planner=planner, process_group=group,
                                                  no_dist=group is None))
        finally:
            planner.release_all()
            planner.end()
        state = planner.objects.get(ENGINE)
        if state is None:
            raise CheckpointCorruptError(f"checkpoint: {path} holds no {ENGINE} record", str(path))
        saved_world = int(state["world_size"])
        rng = planner.objects.get(f"{RNG}{rank % saved_world}")
        if rng is not None:
            set_rng_state(rng)
        apply_engine_state(engine, state)
    except BaseException as exc:
        if planner.started:  # pages hold part of this checkpoint: nothing trains on them
            engine.failure.load_failed(path, exc)
        raise
    engine.failure.torn_load = None
    engine.binder.weights_changed()  # a graph saved before the load reads other weights now
    engine.binder.outside_writes.refresh()
    return planner.objects.get(EXTRA)


def _at_step_boundary(engine, what: str) -> None:
    """A CheckpointError on every rank where any rank is mid-step (before the first collective of the save or
    load: a rank refused alone would leave the others waiting in it)."""
    driver, refusal = engine.driver, None
    if driver.micro or driver.grads_final:
        refusal = (f"{what}: called between backward() and step() ({driver.micro} micro-batches taken); call it "
                   f"between steps")
    elif engine.graphs.alive():  # (its RNG and buffers moved on, its weights not yet: a resume would not continue it)
        refusal = (f"{what}: called between a training forward and its backward (its output is still held); call it "
                   f"between steps, or drop the output (del loss) if that step is abandoned")
    _refuse_anywhere(engine, refusal, f"{what}: every rank at a step boundary")


def _refuse_anywhere(engine, refusal: str | None, what: str) -> None:
    """A CheckpointError on every rank where any rank refuses (this one's reason, else the first rank's)."""
    if engine.world is not None:
        refusals = engine.world.all_gather_object(refusal, what)
        first = next(((rank, r) for rank, r in enumerate(refusals) if r is not None), None)
        refusal = None if first is None else (refusal or f"{first[1]} (on rank {first[0]})")
    if refusal is not None:
        raise CheckpointError(refusal)


def _agree(engine, outcome, what: str):
    """Rank 0's outcome (None or an error) on every rank."""
    if engine.world is None:
        return outcome
    return engine.world.broadcast_object(outcome, 0, what)


def _run(engine, what: str, fn) -> None:
    """A DCP save or load on the checkpoint group; a failure on any rank is the same typed error on every rank."""
    try:
        with warnings.catch_warnings():  # one process: DCP warns that it assumes so, which is what we ask for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            fn()
    except CheckpointException as exc:
        failed_rank, (error, _trace) = min(exc.failures.items())
        if isinstance(error, KeyboardInterrupt):  # (a second SIGTERM or Ctrl-C during the save: the signal's exit)
            raise error from None
        raise _typed(error, failed_rank, engine.world is not None) from None
    except (AngelError, KeyboardInterrupt):
        raise
    except Exception as exc:  # a collective's own error: a peer died or hung
        detail = str(exc).splitlines()[0] if str(exc) else ""
        cause = "a collective failed (a peer rank died or hung?): " if engine.world is not None else ""
        error = CheckpointError(f"checkpoint {what} on rank {engine.mesh.rank}: {cause}{type(exc).__name__}: "
                                f"{detail}")
        if engine.world is not None and engine.failure.reason is None:
            engine.failure.collective_failed(error)  # the ranks' collectives are out of step: close uses none
        raise error from None


def _typed(error: BaseException, rank: int, distributed: bool) -> CheckpointError:
    prefix = f"rank {rank}: " if distributed else ""
    if isinstance(error, CheckpointWriteError):
        return CheckpointWriteError(f"{prefix}{error}", error.path, error.errno)
    if isinstance(error, CheckpointError):
        return type(error)(f"{prefix}{error}", error.path)
    if isinstance(error, FileNotFoundError):
        return CheckpointCorruptError(f"{prefix}checkpoint file missing: {error.filename}", str(error.filename))
    if isinstance(error, OSError):
        return CheckpointWriteError(f"{prefix}checkpoint I/O failed: {error.filename}: {error.strerror}",
                                    str(error.filename or ""), error.errno or 0)
    return CheckpointError(f"{prefix}{type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------------------- the records
def named_by_every_rank(engine) -> dict:
    """The per-tensor optimizer step counts and the model's state-dict keys under the unsplit model's names: with
    expert parallelism each rank holds other experts, so every rank's are gathered (one collective); else this
    rank's, which are every rank's."""
    rename = engine.expert_names
    steps = {rename.get(n, n): v for n, v in engine.optimizer.slot_steps.items()}
    keys = [(rename.get(k, k), kind, rename.get(saved, saved)) for k, kind, saved in state_dict_keys(engine.model)]
    if engine.ep is not None:
        everyone = engine.world.all_gather_object((steps, keys), "expert step counts and names")
        steps = {name: value for theirs, _ in everyone for name, value in theirs.items()}
        keys = list(dict.fromkeys(key for _, theirs in everyone for key in theirs))
    return {"slot_steps": steps, "state_dict_keys": keys}


def engine_state(engine, lagging: bool, named: dict) -> dict:
    opt = engine.optimizer
    scaler = engine.loss_scaler
    return {"format": 1, "steps_done": engine._steps_done, "schedule_on": engine._schedule.on,
            "step_count": opt.step_count, "slot_steps": named["slot_steps"], "lr": opt.lr, "betas": opt.betas,
            "eps": opt.eps, "weight_decay": opt.weight_decay,
            "loss_scaler": scaler.state_dict() if scaler is not None else None, "params_lag_master": lagging,
            "world_size": engine.mesh.world_size, "zero": engine.ownership.stage,
            "page_bytes": engine.layout.page_bytes, "layout": engine.layout.fingerprint(),
            "state_dict_keys": named["state_dict_keys"], "hf_config": hf_config(engine.model),
            "config": config_to_dict(engine.config),
            # what modules overriding get_extra_state return (torch's state dict holds them as `<module>._extra_state`)
            "extra_states": {key: module.get_extra_state() for key, module in _extra_states(engine.model).items()}}


def state_dict_keys(model) -> list[tuple[str, str, str]]:
    """(key, "param" or "buffer", the tensor's saved name) for every key of `model.state_dict()`, in its order: a
    parameter shared under two names (tied weights) is saved once, under the first."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    keys = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for leaf, param in module.named_parameters(recurse=False):
            keys.append((prefix + leaf, "param", canonical[id(param)]))
        for leaf, buffer in module.named_buffers(recurse=False):
            if buffer is not None and leaf not in module._non_persistent_buffers_set:
                keys.append((prefix + leaf, "buffer", prefix + leaf))
    return list(dict.fromkeys(keys))


def hf_config(model) -> dict | None:
    """A HuggingFace model's config (written as config.json by `angel-ptm export`), else None."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        return json.loads(config.to_json_string()) if hasattr(config, "to_json_string") else to_dict()
    except (TypeError, ValueError):
        return None


def misfit(engine, state: dict, steps: bool = True) -> str | None:
    """Why the engine record `state` does not fit this engine's model, or None; the modules' extra states are
    checked before any page is written (the tensors by the planner, then the step counts here)."""
    extra = _extra_states(engine.model)
    saved_extra = state.get("extra_states")  # (none in a checkpoint from before they were saved)
    if saved_extra is not None and set(saved_extra) != set(extra):
        return (f"checkpoint: does not fit this model: extra states {sorted(saved_extra)[:4]} saved, "
                f"{sorted(extra)[:4]} in the model")
    rename = engine.expert_names  # this rank's experts by their unsplit names
    unknown = sorted(rename.get(n, n) for n in engine.optimizer.slot_steps if rename.get(n, n) not in state["slot_steps"])
    return f"checkpoint: no optimizer step count for {unknown[:4]} (another model's checkpoint?)" \
        if unknown and steps else None


def apply_engine_state(engine, state: dict) -> None:
    opt, steps, rename = engine.optimizer, state["slot_steps"], engine.expert_names
    if (refusal := misfit(engine, state)) is not None:
        raise CheckpointError(refusal)
    for name in opt.slot_steps:
        opt.slot_steps[name] = int(steps[rename.get(name, name)])
    opt.step_count = int(state["step_count"])
    opt.lr, opt.betas = float(state["lr"]), tuple(float(b) for b in state["betas"])
    opt.eps, opt.weight_decay = float(state["eps"]), float(state["weight_decay"])
    engine._steps_done = engine.failure.steps_done = int(state["steps_done"])
    # The learning rate: the saved one (as torch's optimizer state holds it), or where this job spells out an
    # lr_schedule, that schedule's at the step reached (whether the saving job had one is not this job's choice)
    engine._schedule.apply(opt, engine._steps_done)
    if engine.loss_scaler is not None and state["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
    delayed = engine.delayed
    if state["params_lag_master"]:
        if delayed is not None:  # the next step computes with the param pages and publishes the masters then
            delayed.unpublished = {i for i in opt.local_indices}
        else:  # this job does not delay: its parameters are the masters now
            copy_masters_into_params(engine.scheduler, engine.pages, engine.layout, engine.ownership)
    engine.data_parallel.params_updated()  # gathered copies (ZeRO-3) and replicas refreshed from the owners
    if state.get("extra_states") is not None:
        for key, module in _extra_states(engine.model).items():
            module.set_extra_state(state["extra_states"][key])


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

