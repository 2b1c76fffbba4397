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
        self.steps_done = 0  # optimizer steps completed, for the reason's text

    def check(self) -> None:
        if self.reason is not None:
            raise EngineFailedError(self.reason)

    def collective_failed(self, error: Exception) -> None:
        """A collective failed (a peer died or hung): the ranks may be mid-step, and the group is unusable."""
        self.reason = (f"the engine failed at step {self.steps_done} ({type(error).__name__}: {error}); resume "
                       f"every rank from the last checkpoint")

    @contextmanager
    def step(self, optimizer, delayed):
        """An error part-way through updating pages (some groups done, others not; `delayed`: staleness 1, whose
        pending update is not torn by an error in between) fails the engine for good."""
        try:
            yield
        except BaseException as exc:
            torn = optimizer.failed_group is not None or (delayed is None and optimizer.updated_this_step)
            if torn or isinstance(exc, (PageIOError, ChecksumError)):
                self.reason = (f"the engine failed during optimizer step {optimizer.step_count} "
                               f"({type(exc).__name__}: {exc}); pages may hold a half-applied update, so it "
                               f"refuses to go on: resume from the last checkpoint")
            raise
