"""The training loop: data, model, engine, learning rate, logging, evaluation. Reads top to bottom.

    result = Trainer(load_config("configs/default.yaml")).run()

A run directory holds everything one run writes:
  config.yaml    the resolved config (run.dir filled in); ``load_config`` reads it back
  metrics.jsonl  one JSON line per logged step (step, loss, lr, grad_norm, tokens_per_s, step_s, in_use, moved,
                 and the scheduler's stall_s, deviations, planned_moves, replanned; with parallel.osdp, once
                 chosen, osdp_replicated: page group -> seconds compute waited on its gathers when chosen)
                 and one per evaluation (step, val_loss); written line by line, so a crash keeps what was logged.
                 A run never overwrites another's: a run.dir whose metrics.jsonl holds lines is refused.
  trace.jsonl    the memory trace (page events from the engine; a ``step`` event and a compute interval per step),
                 up to trace.max_bytes, then one summary event per step (trace/recorder.py)

Data parallelism (torchrun, parallel.dp ranks): rank r takes micro-batches r*G .. r*G+G-1 of each step's dp*G
(G = trainer.grad_accum), exactly the micro-batches one rank with grad_accum dp*G takes, and the logged loss is the
mean over ranks and micro-batches. Rank 0 picks the run directory (and refuses a used one) for every rank and writes
config.yaml, metrics.jsonl and the progress; every rank writes its own trace, trace.rank<R>.jsonl.

On a terminal the loop shows a progress bar; where stdout is not one (nohup, Slurm, a pipe) it prints one plain line
every trainer.log_every steps instead. SIGTERM (what Slurm and Kubernetes send) stops a run as Ctrl-C does: the
engine closes and its page files are removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from tqdm import tqdm

from angel_ptm.checkpoint.directory import Checkpoints
from angel_ptm.config import Config, save_config, with_absolute_paths
from angel_ptm.config.combinations import engine_config_for_trainer
from angel_ptm.data import BatchSampler, check_part, load_tokens, split_train_val
from angel_ptm.errors import ConfigValueError, DataError, Terminated
from angel_ptm.interrupts import defer
from angel_ptm.lr import lr_at
from angel_ptm.models import build_model
from angel_ptm.models.moe import moe_metrics, set_moe_step
from angel_ptm.parallel import Mesh, init_mesh, rank_device
from angel_ptm.parallel.collectives import Collectives, world_group
from angel_ptm.run_dir import agree_run_dir, keep_metrics_until, release_run_dir, resume_run, set_aside
from angel_ptm.trace import TraceRecorder
from angel_ptm.train_metrics import (add_counts, finite_or_none, moved_since, precision_metrics,
                                     progress_line, progress_text, schedule_metrics, write_metrics)


EngineFactory = Callable[..., Any]  # (model, config, trace=TraceRecorder) -> Engine
VAL_SEED = 0  # the held-out batches are the same at every evaluation and in every run


@dataclass
class TrainResult:
    steps: int
    losses: list[float]  # training loss of every step, in order
    final_val_loss: Optional[float]  # None when evaluation is off (trainer.eval_every 0 or data.val_fraction 0)
    run_dir: Path
    tokens_per_s: float  # over the whole loop, evaluation excluded (every rank's tokens)
    rank: int = 0  # this process's rank (data parallelism): rank 0 reports the run
    resumed_from: Optional[Path] = None  # the checkpoint this run continued from; `losses` are the steps after it
    start_step: int = 1  # the first step this process ran
    last_checkpoint: Optional[Path] = None  # the newest checkpoint this process saved


class Trainer:
    def __init__(self, config: Config, engine_factory: Optional[EngineFactory] = None, progress: bool = True):
        self.config = config
        self.engine_factory = engine_factory
        self.progress = progress

    def run(self) -> TrainResult:
        with StopSignals() as signals:
            self.signals = signals
            self._run_dir = None
            try:
                return self._run()
            finally:
                release_run_dir(self._run_dir)  # (the run directory's lock: agree_run_dir took it)

    def _run(self) -> TrainResult:
        cfg = self.config
        tcfg = cfg.trainer
        torch.manual_seed(tcfg.seed)
        device = resolve_device(tcfg.device)
        mesh = init_mesh(cfg.parallel, device.type)  # torchrun: the process group, from the environment
        device = rank_device(device, mesh)
        collectives = Collectives(mesh, group=world_group(mesh)) if mesh.distributed else None

        # Data: byte-level text or a token file, split into train and held-out tokens.
        tokens, data_vocab = load_tokens(cfg.data)
        split = split_train_val(tokens, cfg.data.val_fraction)
        seq_len = cfg.model.seq_len
        check_part("train", split.train, seq_len, cfg.data)  # (naming data.val_fraction where it took the rest)
        train_batches = BatchSampler(split.train, cfg.data.batch_size, seq_len, cfg.data.seed)
        micro_per_step = tcfg.grad_accum * mesh.dp  # what one rank with grad_accum dp*G would take
        evaluate_every = tcfg.eval_every if cfg.data.val_fraction > 0 else 0
        if evaluate_every and len(split.val) < seq_len + 1:
            raise DataError(
                f"validation split has {len(split.val)} tokens, need at least model.seq_len + 1 = {seq_len + 1} "
                f"(raise data.val_fraction ({cfg.data.val_fraction}) or set trainer.eval_every=0)"
            )
        if cfg.model.vocab_size < data_vocab:
            raise ConfigValueError(
                f"model.vocab_size: must be >= the data's vocabulary ({data_vocab}), got {cfg.model.vocab_size}"
            )
        model = build_model(cfg.model)

        # The run directory, created only once the inputs are known to be good; rank 0's, on every rank. A run that
        # resumes (run.resume, or torchrun restarting it) continues its own directory.
        resume = cfg.run.resume
        if resume is None and _env_int("TORCHELASTIC_RESTART_COUNT") > 0:
            resume = "auto"
        run_dir = self._run_dir = agree_run_dir(cfg.run.dir, mesh, collectives, refuse_used=resume is None,
                                                name=cfg.run.name)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(run_dir)))
        checkpoints = Checkpoints(cfg.checkpoint.dir or run_dir / "checkpoints", keep=cfg.checkpoint.keep)
        if cfg.checkpoint.dir and mesh.is_main:  # (a directory the user names: usable, and this run's alone)
            checkpoints.prepare(new_run=resume is None)
        if cfg.memory.disk_dir is None:  # page files live in the run directory unless the job says otherwise
            cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, disk_dir=str(run_dir / "pages")))
        cfg = with_absolute_paths(cfg)  # (config.yaml resumes from any directory)

        losses: list[float] = []
        final_val_loss: Optional[float] = None
        tokens_per_step = cfg.data.batch_size * seq_len * micro_per_step
        train_seconds = 0.0
        with contextlib.ExitStack() as cleanup:  # closes engine, then trace, then files, even on an exception
            trace_path = run_dir / trace_name(mesh)
            if resume == "auto" and checkpoints.latest() is None:  # a new run in a directory an earlier one used
                set_aside([trace_path] + ([run_dir / "metrics.jsonl"] if mesh.is_main else []))
            if resume is None:
                trace_path.unlink(missing_ok=True)  # a run dir holds one run
            # A resumed run appends to its trace (as to metrics.jsonl): a new segment, which viz puts on one clock
            trace = TraceRecorder(trace_path, max_bytes=cfg.trace.max_bytes)
            cleanup.callback(trace.close)
            metrics = None
            # A bar on a terminal; nohup, Slurm and pipes get a plain line per logged step, which a log file keeps.
            progress = self.progress and mesh.is_main
            print_lines = progress and not sys.stdout.isatty()
            bar = cleanup.enter_context(
                tqdm(total=tcfg.steps, desc=run_dir.name, unit="step", dynamic_ncols=True,
                     disable=None if progress and not print_lines else True)  # None: off when not a TTY
            )
            engine = self._create_engine(model, cfg, trace)
            cleanup.callback(engine.close)
            cleanup.push(_interrupted_alone(engine, mesh))  # (runs before close)
            can_checkpoint = hasattr(engine, "save_checkpoint")
            if not can_checkpoint and (cfg.checkpoint.every or resume is not None):
                raise ConfigValueError("checkpoint.every / run.resume: the engine made by engine_factory has no "
                                       "save_checkpoint/load_checkpoint")
            resumed_from, done, consumed = None, 0, None  # the checkpoint continued from, its steps, micro-batches
            if resume is not None:
                resumed_from, done, consumed = resume_run(engine, resume, checkpoints)
                if resumed_from is not None:  # the steps after the checkpoint's, taken again, are traced once
                    trace.resumed_at(done)
                if done >= tcfg.steps and mesh.is_main:
                    logging.getLogger("angel_ptm").warning(
                        f"trainer.steps {tcfg.steps}: the checkpoint resumed from is at step {done}, so there is "
                        f"nothing to train; raise trainer.steps (--set trainer.steps=N) to go on")
            # The data stream goes on where the checkpoint left it, whatever grad_accum or dp the run has now
            first_micro = done * micro_per_step if consumed is None else consumed
            if mesh.is_main:  # (written once the start succeeded: a refused --resume leaves the run's own config)
                save_config(cfg, run_dir / "config.yaml")
            if mesh.is_main:  # metrics of the steps done so far are kept (a resumed run appends after them)
                keep_metrics_until(run_dir / "metrics.jsonl", done)
                metrics = cleanup.enter_context(open(run_dir / "metrics.jsonl", "a", encoding="utf-8"))
            bar.update(done)
            # From here a signal can wait for the step to end: there is an engine to save.
            self.signals.save_first = cfg.checkpoint.on_signal and can_checkpoint
            device = getattr(engine, "device", device)  # where the engine computes, if it says
            evaluate = Evaluator(engine, split.val, cfg, device) if evaluate_every else None
            start_stats = engine.memory_stats()
            moved_before, experts_before = start_stats["moved"], start_stats.get("expert_moved", {})
            wasted_before = start_stats.get("expert_prefetch_wasted", 0)
            since_line, skipped_since = {}, 0  # the steps' figures since the last metrics line
            last_checkpoint = None

            def save(step: int, stop) -> Path:
                background = cfg.checkpoint.async_save and stop is None  # a signal's save is the last: waited
                saved = checkpoints.save(engine, step, {"step": step, "micro_batches": first_micro + (
                    step - done) * micro_per_step}, background=background)
                if progress:
                    bar.write(f"step {step}: checkpoint {saved.path if background else saved}"
                              + (" (writing)" if background else ""))
                return saved.path if background else saved

            for step in range(done + 1, tcfg.steps + 1):
                t_start = time.perf_counter()
                lr = lr_at(step - 1, cfg.optimizer.lr, tcfg.steps, cfg.lr_schedule.warmup_steps,
                           cfg.lr_schedule.decay, cfg.lr_schedule.min_lr_ratio)
                engine.set_lr(lr)

                # Forward + backward over grad_accum micro-batches; dividing each loss makes the summed
                # gradients those of the mean loss over the whole batch.
                t_compute = trace.now()
                set_moe_step(model, step - 1)  # gates with a schedule (DTS): the steps done
                loss_sum = 0.0
                for micro in range(tcfg.grad_accum):
                    x, y = train_batches.batch(first_micro + (step - 1 - done) * micro_per_step
                                               + mesh.dp_rank * tcfg.grad_accum + micro)
                    loss = engine(x.to(device), y.to(device))
                    engine.backward(loss / tcfg.grad_accum)
                    loss_sum += loss.item()
                trace.interval("compute", f"step {step}", t_compute, trace.now())
                grad_norm = engine.clip_grad_norm(tcfg.grad_clip) if tcfg.grad_clip else None
                engine.step()

                step_s = time.perf_counter() - t_start
                train_seconds += step_s
                step_loss = loss_sum / tcfg.grad_accum
                if mesh.distributed:  # the mean over ranks and micro-batches (every rank takes part)
                    step_loss = engine.mean_over_ranks(step_loss)
                losses.append(step_loss)
                trace.event("step", step=step, loss=finite_or_none(step_loss), step_s=step_s)
                stats = engine.memory_stats()
                # a line every log_every steps, after the last, and at each checkpoint (a resume keeps the lines up
                # to its checkpoint's step: every step before it is then in one of them)
                every = cfg.checkpoint.every
                # SIGTERM/SIGINT on any rank (agreed over the ranks, so all save at the same step)
                stop = self.signals.requested(collectives) if can_checkpoint else None
                log_now = (step % tcfg.log_every == 0 or step == tcfg.steps or stop is not None
                           or (can_checkpoint and every and step % every == 0))
                # the scheduler's figures of each step since the last line (summed; replanned: any of them)
                since_line = add_counts(since_line, schedule_metrics(stats.get("schedule"),
                                                                     experts="expert_moved" in stats))
                precision = precision_metrics(engine)
                skipped_since = skipped_since + bool(precision.get("skipped"))
                # Bytes moved since the last logged line (log_every > 1: the steps between are counted in it)
                moved = {pair: stats["moved"][pair] - moved_before.get(pair, 0) for pair in stats["moved"]}
                experts_moved = {pair: n - experts_before.get(pair, 0)
                                 for pair, n in stats.get("expert_moved", {}).items()}
                wasted = stats.get("expert_prefetch_wasted", 0) - wasted_before
                if log_now:
                    moved_before, experts_before = stats["moved"], stats.get("expert_moved", {})
                    wasted_before = stats.get("expert_prefetch_wasted", 0)
                # the whole job's routing: every rank's tokens, summed over ranks (every rank takes part)
                routed = moe_metrics(model, getattr(engine, "sum_over_ranks", None)) if log_now else {}
                if metrics is not None and log_now:
                    if precision:  # fp16: skipped if any step since the last line was (skipped_steps: how many)
                        precision.update(skipped=skipped_since > 0, skipped_steps=skipped_since)
                    write_metrics(metrics, {
                        "step": step, "loss": finite_or_none(step_loss), "lr": lr,
                        # strict JSON: a non-finite norm (an fp16 overflow, the step skipped) is logged as null
                        "grad_norm": None if grad_norm is None or not math.isfinite(grad_norm) else float(grad_norm),
                        "tokens_per_s": tokens_per_step / step_s, "step_s": step_s,
                        "in_use": dict(stats["in_use"]), "moved": moved,
                        **since_line, **precision,
                        **({"osdp_replicated": stats["osdp_replicated"]} if stats.get("osdp_replicated") else {}),
                        **({"moe": routed} if routed else {}),
                        **({"moe_rebalance": stats["moe_rebalance"]} if "moe_rebalance" in stats else {}),
                        **({"expert_moved": experts_moved, "expert_prefetch_wasted": wasted}
                           if "expert_moved" in stats else {}),
                    })
                    if print_lines:
                        print(progress_line(step, tcfg.steps, step_loss, lr, tokens_per_step / step_s), flush=True)
                if log_now:
                    since_line, skipped_since = {}, 0
                bar.update(1)
                bar.set_postfix_str(progress_text(step_loss, tokens_per_step / step_s, stats["in_use"]))

                # A checkpoint every checkpoint.every steps and after the last; on SIGTERM/SIGINT one now, then the
                # run stops as the signal asks. After the last step it is saved before optimizer.staleness 1's last
                # update lands in the parameters (flush): it records them a step behind, as a longer run has them,
                # so a resume that trains on continues that run exactly; the evaluation then sees the final weights.
                saving = stop is not None or (every and (step % every == 0 or step == tcfg.steps))
                if step == tcfg.steps:
                    last_checkpoint = save(step, stop) if saving else last_checkpoint
                    saving = False
                    if hasattr(engine, "flush"):
                        engine.flush()
                if evaluate is not None and (step % evaluate_every == 0 or step == tcfg.steps):
                    before = engine.memory_stats()
                    final_val_loss = evaluate()
                    # the evaluation's own traffic goes on its line, not on the next step's
                    after = engine.memory_stats()
                    eval_moved = moved_since({}, before["moved"], after["moved"])
                    moved_before = moved_since(moved_before, before["moved"], after["moved"])
                    experts_before = moved_since(experts_before, before.get("expert_moved", {}),
                                                 after.get("expert_moved", {}))
                    wasted_before += (after.get("expert_prefetch_wasted", 0)
                                      - before.get("expert_prefetch_wasted", 0))
                    if metrics is not None:
                        write_metrics(metrics, {"step": step, "val_loss": finite_or_none(final_val_loss),
                                                "moved": eval_moved})
                    if progress:
                        bar.write(f"step {step}: val_loss {final_val_loss:.4f}")

                if saving:
                    last_checkpoint = save(step, stop)
                if stop is not None:
                    raise Terminated(stop) if stop != signal.SIGINT else KeyboardInterrupt()
            if can_checkpoint:
                engine.wait_for_checkpoint()  # a checkpoint written beside the last steps is complete (or raises)

        return TrainResult(
            steps=tcfg.steps,
            losses=losses,
            final_val_loss=final_val_loss,
            run_dir=run_dir,
            tokens_per_s=tokens_per_step * len(losses) / train_seconds if train_seconds else 0.0,
            rank=mesh.rank,
            resumed_from=resumed_from,
            start_step=done + 1,
            last_checkpoint=last_checkpoint,
        )

    def _create_engine(self, model: torch.nn.Module, cfg: Config, trace: TraceRecorder) -> Any:
        factory = self.engine_factory
        if factory is None:
            from angel_ptm.engine import initialize  # imported here: the trainer must import without the engine

            factory = initialize
        return factory(model, engine_config_for_trainer(cfg), trace=trace)


class Evaluator:
    """Mean loss over ``trainer.eval_steps`` held-out batches; the same batches every time (fixed seed)."""

    def __init__(self, engine: Any, val_tokens: np.ndarray, cfg: Config, device: torch.device):
        self.engine, self.device = engine, device
        self.steps = cfg.trainer.eval_steps
        self.batches = BatchSampler(val_tokens, cfg.data.batch_size, cfg.model.seq_len, VAL_SEED)

    def __call__(self) -> float:
        self.engine.eval()
        try:
            total = 0.0
            with torch.no_grad():
                for k in range(self.steps):
                    x, y = self.batches.batch(k)
                    total += self.engine(x.to(self.device), y.to(self.device)).item()
            return total / self.steps
        finally:
            self.engine.train()


def resolve_device(name: str) -> torch.device:
    """``trainer.device``: "auto" is CUDA where present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigValueError('trainer.device: "cuda" requested but no CUDA device is available')
    return torch.device(name)


def trace_name(mesh: Mesh) -> str:
    """trace.jsonl for a single process; trace.rank<R>.jsonl for each rank of a data-parallel run."""
    return f"trace.rank{mesh.rank}.jsonl" if mesh.distributed else "trace.jsonl"


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


class StopSignals:
    """SIGTERM (what Slurm and Kubernetes send before they kill a job) and SIGINT during a run.

    By default SIGTERM raises Terminated (a KeyboardInterrupt) where the run is and SIGINT KeyboardInterrupt, so
    it unwinds as on Ctrl-C: the engine closes and removes its page files. Once `save_first` is set (the trainer
    does, with checkpoint.on_signal, when the engine is up): the first signal is noted, the trainer saves a
    checkpoint at the end of the step (`requested`, agreed over the ranks) and then raises; a second signal raises
    at once (one within SAME_REQUEST_S of the first is the first delivered again). "Where the run is" and "at once"
    mean when the engine call under way returns (interrupts.defer: raised half-way through one, the engine's own
    bookkeeping was left torn and its close() failed with a misleading error); another signal in that call raises
    then and there. The previous handlers are
    restored after. Signal handlers belong to the main thread: a run on another thread keeps the defaults."""

    # A second signal this soon after the first is the same request delivered twice: Slurm signals every task of a
    # step (torchrun's agent too, which passes it on), a terminal's Ctrl-C reaches the agent and the workers alike
    SAME_REQUEST_S = 1.0

    def __init__(self):
        self.save_first = False
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous = signal.signal(signum, self._on_signal)
                # a handler installed outside Python: the default is the closest we can restore
                self._previous[signum] = signal.SIG_DFL if previous is None else previous
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.save_first and self.received is None:
            self.received, self._received_at = signum, time.monotonic()  # saved at the end of this step
            return
        if self.save_first and time.monotonic() - self._received_at < self.SAME_REQUEST_S:
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the cleanup short
        stop = KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)
        if defer(stop):  # inside an engine call: raised once it has finished (interrupts.py), not half-way
            return
        raise stop

    def requested(self, collectives: Optional[Collectives]) -> Optional[int]:
        """The signal that asks the run to stop after this step, on any rank (every rank calls this each step)."""
        if not self.save_first:
            return None
        received = self.received or 0
        if collectives is not None:
            flag = torch.tensor([float(received)])
            collectives.all_reduce(flag, "stop signal", op=torch.distributed.ReduceOp.MAX)
            received = int(flag.item())
        return received or None


def _interrupted_alone(engine, mesh):
    """An exit callback: a run stopped by a signal (Ctrl-C, or SIGTERM without or past its save) may have stopped
    only this rank, its peers mid-collective, so with several ranks the engine closes without collectives (it
    would read the weights back with them, wait for peers that never come, then blame them after
    parallel.timeout_s); the signal's exit code follows at once. The peers end with a CollectiveError."""
    def on_exit(exc_type, _exc, _tb) -> bool:
        failure = getattr(engine, "failure", None)
        if (exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and mesh.distributed
                and failure is not None and failure.reason is None):
            failure.fail(f"interrupted on rank {mesh.rank} ({exc_type.__name__}): the other ranks may be inside a "
                         f"collective this rank will not join")
        return False  # (the interrupt goes on)
    return on_exit
