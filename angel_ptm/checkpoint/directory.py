"""A run's checkpoints: `step-N/` directories, a `latest` pointer, the last `keep` of them kept.

    ckpts = Checkpoints("run/checkpoints", keep=2)
    ckpts.save(engine, step=50, extra={"step": 50})   # step-50.tmp/ -> step-50/, latest <- "step-50", old ones gone
    extra, path = ckpts.load_latest(engine)           # the newest complete one that reads back whole

A directory counts as a checkpoint only when complete: renamed from `.tmp` with its `.metadata` and manifest. A
`.tmp` left by a killed save is removed by the next save. `latest` is rewritten atomically after each save; loading
does not trust it alone: it tries the complete checkpoints newest first, and one that is torn or bit-flipped is
skipped with a warning naming the file, and renamed `step-N.corrupt` (kept for a look; the resumed run saves
`step-N` again when it gets there). Rank 0 writes and deletes (the directory is shared by the ranks, as DCP's
single `.metadata` requires); every rank calls save and load.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from angel_ptm.checkpoint.save_load import load_checkpoint, save_checkpoint
from angel_ptm.checkpoint.storage import MANIFEST, METADATA, write_durably
from angel_ptm.errors import CheckpointCorruptError, CheckpointError

STEP_DIR = re.compile(r"^step-(\d+)$")
LATEST = "latest"


class Checkpoints:
    def __init__(self, root: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root, self.keep = Path(root).expanduser().absolute(), keep

    def prepare(self, new_run: bool) -> None:
        """The directory a job names (checkpoint.dir), checked at start rather than at the first save: created,
        a writable directory, and (`new_run`) holding no other run's checkpoints, which a resume would take for
        its own and whose pruning would delete them. A CheckpointError naming it otherwise."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"checkpoint.dir: cannot create {self.root}: {err.strerror or err}",
                                  str(self.root)) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CheckpointError(f"checkpoint.dir: {self.root} is not writable", str(self.root))
        if new_run and self.latest() is not None:
            raise CheckpointError(f"checkpoint.dir: {self.root} holds another run's checkpoints "
                                  f"({self.latest().name}); give this run an empty directory, or resume that run "
                                  f"(--resume)", str(self.root))

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def complete(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = STEP_DIR.match(entry.name)
            if match and (entry / METADATA).is_file() and (entry / MANIFEST).is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def save(self, engine, step: int, extra: Any = None, background: bool = False):
        """Checkpoint `step` (every rank calls it); once complete, `latest` points at it and the oldest beyond
        `keep` go. Returns the path, or with `background` the PendingSave (save_load.py)."""
        if engine.mesh.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        done = self.complete()  # those that outlive this save: pages still reading another take their bytes
        kept = [path for _, path in done[max(0, len(done) - self.keep + 1):]] + [self.path(step)]
        return save_checkpoint(engine, self.path(step), extra, background, on_done=self._completed, kept=kept)

    def _completed(self, path: Path) -> None:
        write_durably(self.root / LATEST, f"{path.name}\n".encode())
        for _, old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def _set_aside(path: Path) -> Path | None:
        """Rename the corrupt checkpoint `path` to `step-N.corrupt` (`.corrupt-2`, ... if taken): kept for a look,
        no longer a checkpoint, and its step free for the save the resumed run makes there again."""
        for n in range(1, 1000):
            aside = path.with_name(f"{path.name}.corrupt" + (f"-{n}" if n > 1 else ""))
            if not aside.exists():
                try:
                    path.rename(aside)
                except OSError:
                    return None  # (the run goes on; a save at this step will say the directory exists)
                return aside
        return None

    def load_latest(self, engine) -> tuple[Any, Path] | None:
        """Load the newest complete checkpoint that reads back whole (a corrupt one is skipped with a warning);
        None when there is none. Every rank calls it and sees the same directory listing."""
        skipped = 0
        for _, path in reversed(self.complete()):
            try:
                return load_checkpoint(engine, path), path
            except CheckpointCorruptError as err:  # (every rank gets the same error: DCP gathers the failures)
                skipped += 1
                aside = self._set_aside(path) if engine.mesh.rank == 0 else None
                moved = f"; moved to {aside.name}" if aside is not None else ""
                warnings.warn(f"skipping corrupt checkpoint {path}{moved}: {err}", stacklevel=2)
        if skipped:
            raise CheckpointError(f"checkpoint: no checkpoint in {self.root} reads back whole (see the warnings)",
                                  str(self.root))
        return None
