"""A training run's directory: made (or refused when an earlier run's record is there), agreed over ranks, and
what a resumed run keeps of it (the trainer's helpers, angel_ptm/trainer.py)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from angel_ptm.checkpoint.directory import Checkpoints
from angel_ptm.checkpoint.storage import write_durably
from angel_ptm.errors import CheckpointError, ConfigValueError, RunDirInUseError
from angel_ptm.parallel import Mesh
from angel_ptm.parallel.collectives import Collectives

log = logging.getLogger("angel_ptm")


def agree_run_dir(requested: Optional[str], mesh: Mesh, collectives: Optional[Collectives],
                  refuse_used: bool = True, name: str = "default") -> Path:
    """Rank 0 makes the run directory (refusing an earlier run's unless this run resumes it) and every rank takes
    its path, or raises the error rank 0 met, so no rank is left waiting."""
    outcome: Any = None
    if mesh.is_main:
        try:
            run_dir = make_run_dir(requested, name)
            if refuse_used:
                refuse_an_earlier_run(run_dir)
            lock_run_dir(run_dir)
            outcome = str(run_dir)
        except (ConfigValueError, RunDirInUseError) as err:
            outcome = err
    if collectives is not None:
        outcome = collectives.broadcast_object(outcome, 0, "the run directory")
    if isinstance(outcome, Exception):
        raise outcome
    return Path(outcome)


def make_run_dir(requested: Optional[str], name: str = "default") -> Path:
    """``run.dir`` if given (created if needed, reused if present), else a new ``runs/<YYYYmmdd-HHMMSS>``, or
    ``runs/<name>-<YYYYmmdd-HHMMSS>`` for a ``run.name`` other than "default"."""
    try:
        if requested is not None:
            run_dir = Path(requested).expanduser().resolve()
            run_dir.mkdir(parents=True, exist_ok=True)
            return run_dir
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path("runs").resolve() / (stamp if name == "default" else f"{name}-{stamp}")
        for attempt in range(1000):  # two runs started in the same second get -1, -2, ...
            run_dir = base if attempt == 0 else base.with_name(f"{base.name}-{attempt}")
            try:
                run_dir.mkdir(parents=True)
                return run_dir
            except FileExistsError:
                continue
        raise ConfigValueError(f"run.dir: no free name for a new run directory next to {base}")
    except OSError as err:
        raise ConfigValueError(f"run.dir: cannot create {err.filename or requested}: {err.strerror}") from None


LOCK = ".angel_ptm.lock"
_HELD: dict[Path, int] = {}  # run directories this process trains in now -> the descriptor holding their lock


def lock_run_dir(run_dir: Path) -> None:
    """Hold `run_dir` for this process's run (an advisory lock, released with the process, or by
    `release_run_dirs`): a second run there, a `--resume` of a run still training, is a RunDirInUseError (it
    swapped the running one's metrics.jsonl and collided with its checkpoints)."""
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunDirInUseError(f"run.dir: {run_dir} is in use by a run training now (pid {holder}); let it end, "
                               f"or choose another run.dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[run_dir] = fd


def release_run_dir(run_dir: Path | None) -> None:
    """The run in `run_dir` is over: its lock goes (nothing if this process holds none there)."""
    fd = _HELD.pop(Path(run_dir), None) if run_dir is not None else None
    if fd is not None:
        os.close(fd)


def refuse_an_earlier_run(run_dir: Path) -> None:
    """A run directory whose metrics.jsonl holds lines belongs to an earlier run: refused, never overwritten. (An
    empty one is what a run refused at start leaves; the next attempt may take its place.)"""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        raise RunDirInUseError(f"run.dir: {run_dir} already holds the metrics of an earlier run ({metrics}, "
                               f"{metrics.stat().st_size} bytes); choose another run.dir or move that file away")


def set_aside(paths: list[Path]) -> None:
    """Rename each non-empty file of `paths` to `<name>.<k>` (the first k free), with a warning: run.resume auto
    found no checkpoint, so this run starts at step 0 where an earlier one (a restart before its first checkpoint,
    or another run) left its record, which is kept."""
    for path in paths:
        if not (path.is_file() and path.stat().st_size > 0):
            continue
        k = 1
        while path.with_name(f"{path.name}.{k}").exists():
            k += 1
        path.rename(path.with_name(f"{path.name}.{k}"))
        log.warning("run.resume auto: no checkpoint to resume, so this run starts over; the earlier %s is kept as "
                    "%s", path.name, f"{path.name}.{k}")


def resume_run(engine: Any, resume: str, checkpoints: Checkpoints) -> tuple[Optional[Path], int, Optional[int]]:
    """Load what `resume` names into the engine: "auto", the newest complete checkpoint of `checkpoints` (none: a
    new run); a path, that checkpoint directory or the newest complete one in a directory of them. Returns the
    checkpoint, the steps it had taken and the micro-batches of data they had consumed (None from a checkpoint
    saved before that was recorded)."""
    if resume == "auto":
        found = checkpoints.load_latest(engine)
    else:
        path = Path(resume).expanduser().absolute()
        if (path / ".metadata").is_file():
            found = engine.load_checkpoint(path), path
        else:
            found = Checkpoints(path).load_latest(engine)
            if found is None:
                raise CheckpointError(f"run.resume: no complete checkpoint in {path}", str(path))
    if found is None:
        return None, 0, None
    extra, path = found
    if not isinstance(extra, dict) or "step" not in extra:
        raise CheckpointError(f"run.resume: {path} was not saved by the trainer (no step recorded)", str(path))
    micro = extra.get("micro_batches")
    return path, int(extra["step"]), None if micro is None else int(micro)


def keep_metrics_until(path: Path, step: int) -> None:
    """metrics.jsonl keeps the lines of steps up to `step` (those after it, from a run that went past its last
    checkpoint, are dropped: the resumed run logs them again); replaced atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash
        if isinstance(record, dict) and int(record.get("step", 0)) <= step:
            kept.append(line + "\n")
    write_durably(path, "".join(kept).encode())
