"""When the engine refuses to go on, and why: a step that failed part-way (pages may hold a half-applied update, or
an I/O or checksum error hit a page) or a failed collective (the process group is poisoned; the ranks may be
mid-step). Every later call then raises EngineFailedError with the reason; nothing trains on after a half-applied
step."""

from __future__ import annotations

from contextlib import contextmanager

from angel_ptm.errors import ChecksumError, EngineFailedError, PageIOError
from angel_ptm.parallel.collectives import issued_count
from angel_ptm.parallel.mesh import mark_out_of_step


class Failure:
    def __init__(self):
        self.reason: str | None = None  # why the engine refuses every call; None while it is sound
        self.steps_done = 0  # optimizer steps completed: the reason's text names the one in progress (1-based)
        self.torn_load: str | None = None  # why the pages hold part of a checkpoint: only a load may follow
        self.distributed = False  # several ranks: a failure leaves the process group's collectives out of step
        self._issued_at: int | None = None  # collectives issued in this process when this step began (None: between)
        self._raised_in_step: str | None = None  # an error out of this step's forward or backward, which may retry

    def fail(self, reason: str) -> None:
        """The engine refuses every call from now on; with several ranks the process group is not used again."""
        self.reason = reason
        if self.distributed:
            mark_out_of_step(reason)

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
        self.fail(f"the engine failed in step {self.steps_done + 1} ({type(error).__name__}: {error}); resume "
                  f"every rank from the last checkpoint")

    @contextmanager
    def reads(self):
        """Pages read outside a step (the forward): an I/O or checksum error leaves a page unreadable, so the engine
        refuses to go on."""
        try:
            yield
        except (PageIOError, ChecksumError) as exc:
            self.fail(f"the engine failed in step {self.steps_done + 1} moving a page ({type(exc).__name__}: {exc}); "
                      f"resume from the last checkpoint")
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
                self.fail(f"the engine failed during step {self.steps_done + 1} ({type(exc).__name__}: {exc}); "
                          f"pages may hold a half-applied update, so it refuses to go on: resume from the last "
                          f"checkpoint")
            raise

    @contextmanager
    def in_step(self, call: str):
        """A forward or backward of a multi-rank engine. An error out of a backward, or out of a forward once this
        rank issued collectives in this step (a rank-local one: the model, a hook, the data), leaves its peers
        waiting on collectives it will issue again, or not at all: the engine fails for good on this rank, and its
        peers end with a CollectiveError within parallel.timeout_s. A forward that raised before this rank's first
        collective of the step may be retried (the peers' collectives wait for its); closing the engine instead ends
        the process group's use (`closing`)."""
        if not self.distributed:
            yield
            return
        if self._issued_at is None:
            self._issued_at = issued_count()
        try:
            yield
        except BaseException as exc:
            # (a backward that raised has written some gradients and begun its reductions' bookkeeping: a retry
            # would neither add up alone nor issue what its peers' backward did)
            if self.reason is None and (call == "backward" or issued_count() != self._issued_at):
                self.fail(f"the engine failed in step {self.steps_done + 1}: {type(exc).__name__} in this rank's "
                          f"{call} ({str(exc)[:200]})"
                          + (" after the step had issued collectives" if call != "backward" else "")
                          + ", so the ranks' collectives are out of step; resume every rank from the last checkpoint")
            elif self.reason is None:
                self._raised_in_step = f"{type(exc).__name__} in this rank's {call} ({str(exc)[:200]})"
            raise

    def closing(self) -> None:
        """The engine closes. After an error in a step it did not finish, its peers wait on this rank's collectives
        of that step: the engine fails, so closing it reads no weights with collectives (they would wait
        parallel.timeout_s for peers that are elsewhere, then blame them for this rank's error), and the process
        group is not used again (a new engine would be refused, not aborted by gloo)."""
        if self.distributed and self._raised_in_step is not None and self.reason is None:
            self.fail(f"closed in step {self.steps_done + 1} after {self._raised_in_step}, which the other ranks "
                      f"went on with")

    def step_ended(self) -> None:
        """The step's collectives are all matched (its sequence check passed): the next one starts afresh."""
        self._issued_at = self._raised_in_step = None
