"""Whether an activation watch runs on this thread (activations/recompute.py counts the storages a checkpointed
unit's ops create that are still alive at its end), for the collectives that must hand the process group what such a
count does not see (parallel/collectives.py: Collectives._hand)."""

from __future__ import annotations

import contextlib
import threading


class _ActivationWatch(threading.local):
    """`depth` > 0 while activations/recompute.py counts the storages a checkpointed unit's ops create that are
    still alive at its end. The process group keeps what a collective was handed a moment after its wait returns
    (gloo's worker thread, NCCL's watchdog), so such a count would see those tensors alive or gone at random: under
    a watch, a model's collectives hand the backend copies made while the watch is `paused` (it does not see
    them), and land the results in the caller's tensors."""

    def __init__(self):
        self.depth = 0
        self.paused = False

    @contextlib.contextmanager
    def pause(self):
        outer, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = outer


ACTIVATION_WATCH = _ActivationWatch()
