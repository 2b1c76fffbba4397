"""When the engine refuses to go on, and why: a step that failed part-way (pages may hold a half-applied update, or
an I/O or checksum error hit a page) or a failed collective (the process group is poisoned; the ranks may be
mid-step). Every later call then raises EngineFailedError with the reason; nothing trains on after a half-applied
step."""

from __future__ import annotations

from contextlib import contextmanager

from angel_ptm.errors import ChecksumError, EngineFailedError, PageIOError


class Failure:
    def __init__(self):
        self.reason: str | None = None  # why the engine refuses every call; None while it is sound
        self.steps_done = 0  # optimizer steps completed: the reason's text names the one in progress (1-based)
        self.torn_load: str | None = None  # why the pages hold part of a checkpoint: only a load may follow

    def check(self, loading: bool = False) -> None:
        """Raise EngineFailedError if the engine refuses to go on; `loading`: the call is a checkpoint load, which
        may follow a load that failed part-way (it overwrites every page)."""
        if self.reason is not None:
            raise EngineFailedError(self.reason)
        if self.torn_load is not None and not loading:
            raise EngineFailedError(self.torn_load)

    def load_failed(self, path, error: Exception) -> None:
        """A checkpoint load failed after changing pages: they hold a mix of two states until a load succeeds."""
        self.torn_load = (f"loading checkpoint {path} failed part-way ({type(error).__name__}: {error}); the pages "
                          f"hold part of it, so the engine refuses to train until a checkpoint loads completely")

    def collective_failed(self, error: Exception) -> None:
        """A collective failed (a peer died or hung): the ranks may be mid-step, and the group is unusable."""
        self.reason = (f"the engine failed in step {self.steps_done + 1} ({type(error).__name__}: {error}); resume "
                       f"every rank from the last checkpoint")

    @contextmanager
    def reads(self):
        """Pages read outside a step (the forward): an I/O or checksum error leaves a page unreadable, so the engine
        refuses to go on."""
        try:
            yield
        except (PageIOError, ChecksumError) as exc:
            self.reason = (f"the engine failed in step {self.steps_done + 1} moving a page ({type(exc).__name__}: "
                           f"{exc}); resume from the last checkpoint")
            raise

    @contextmanager
    def step(self, optimizer, delayed):
        """An error part-way through updating pages (some groups done, others not; `delayed`: staleness 1, whose
        pending update is not torn by an error in between) fails the engine for good."""
        try:
            yield
        except BaseException as exc:
            torn = optimizer.failed_group is not None or (delayed is None and optimizer.updated_this_step)
            if torn or isinstance(exc, (PageIOError, ChecksumError)):
                self.reason = (f"the engine failed during step {self.steps_done + 1} "
                               f"({type(exc).__name__}: {exc}); pages may hold a half-applied update, so it "
                               f"refuses to go on: resume from the last checkpoint")
            raise
