"""Collectives over the data-parallel group, with one error type: pure functions of buffers, no page logic.

Every call names what it moves (`what`, e.g. "all_gather param group 3"); a peer that died (gloo sees the
connection close in well under a second) or hung past `parallel.timeout_s` surfaces as a `CollectiveError` naming
this rank, the collective and the elapsed time. The process group is unusable after that (torch poisons it), so the
engine treats it as fatal. Each collective is timed on the trace's "comm" lane.
"""

from __future__ import annotations

import time
import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from angel_ptm.errors import CollectiveError
from angel_ptm.parallel.mesh import Mesh
from angel_ptm.trace.recorder import TraceRecorder

SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN


class Collectives:
    """The data-parallel group's collectives (the world's default group while dp is the world)."""

    def __init__(self, mesh: Mesh, trace: TraceRecorder | None = None, on_failure=None):
        if not mesh.distributed:
            raise ValueError("collectives need a world of more than one rank")
        self.mesh = mesh
        self.rank, self.size = mesh.rank, mesh.dp
        self.trace = trace or TraceRecorder(None)
        self.bytes_sent = 0  # bytes this rank contributed to collectives, cumulative (the estimate's figure)
        self.calls = 0
        self.on_failure = on_failure  # called with the error before it is raised (the engine fails for good)
        self.failed: CollectiveError | None = None
        # A digest of the collectives issued since the last `verify_sequence` (name and what, in order): ranks that
        # issued different ones of the same size would exchange the wrong data silently; the check makes it loud.
        self._sequence = 0
        self._since_check = 0

    def _run(self, name: str, what: str, nbytes: int, fn, *args, **kwargs):
        if self.failed is not None:  # the group is poisoned: no rank may wait on it again
            raise self.failed
        t0 = time.perf_counter()
        start = self.trace.now() if self.trace.enabled else 0.0
        try:
            result = fn(*args, **kwargs)
        except (RuntimeError, ValueError) as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.failed = CollectiveError(
                f"rank {self.rank} of {self.size}: {name} ({what}) failed after {time.perf_counter() - t0:.1f} s "
                f"(parallel.timeout_s {self.mesh.timeout_s:g}): a peer rank died or hung: {detail[:300]}")
            if self.on_failure is not None:
                self.on_failure(self.failed)
            raise self.failed from None
        self.calls += 1
        self.bytes_sent += nbytes
        if name != "wait":
            self._sequence = zlib.crc32(f"{name}:{what};".encode(), self._sequence)
            self._since_check += 1
        if self.trace.enabled:
            self.trace.interval("comm", f"{name} {what}", start, self.trace.now(), bytes=nbytes)
        return result

    def verify_sequence(self, what: str) -> None:
        """Every rank issued the same collectives, in the same order, since the last check (one small all-gather);
        otherwise a CollectiveError on every rank naming the ranks that differ from rank 0, and the engine fails."""
        mine = torch.tensor([self._sequence, self._since_check], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        self._run("all_gather", f"collective sequence check ({what})", _nbytes(mine), dist.all_gather, everyone,
                  mine)
        self._sequence, self._since_check = 0, 0
        differ = [rank for rank, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
        if differ:
            counts = [int(t[1]) for t in everyone]
            self.failed = CollectiveError(
                f"rank {self.rank} of {self.size}: ranks {differ} issued other collectives than rank 0 before "
                f"{what} (collectives per rank {counts}); data exchanged since the last check may be wrong, so "
                f"no rank trains on")
            if self.on_failure is not None:
                self.on_failure(self.failed)
            raise self.failed

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, what: str,
                   async_op: bool = False):
        """outputs[r] <- rank r's `tensor` (outputs[self.rank] may be `tensor` itself: gathered in place). With
        `async_op` it returns at once with a handle whose `wait()` returns when the outputs are filled (the
        transfer runs on the process group's own threads or stream) and raises a CollectiveError if it failed."""
        if not async_op:
            self._run("all_gather", what, _nbytes(tensor), dist.all_gather, list(outputs), tensor)
            return None
        work = self._run("all_gather", what, _nbytes(tensor), dist.all_gather, list(outputs), tensor,
                         async_op=True)
        return Pending(self, work, what)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], what: str) -> None:
        """output <- the sum over ranks of their inputs[self.rank]."""
        self._run("reduce_scatter", what, sum(_nbytes(t) for t in inputs), dist.reduce_scatter, output,
                  list(inputs))

    def all_reduce(self, tensor: torch.Tensor, what: str, op=SUM) -> None:
        self._run("all_reduce", what, _nbytes(tensor), dist.all_reduce, tensor, op=op)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        self._run("broadcast", what, _nbytes(tensor) if src == self.rank else 0, dist.broadcast, tensor, src=src)

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._run("all_gather_object", what, 0, dist.all_gather_object, out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int, what: str) -> Any:
        box = [obj if self.rank == src else None]
        self._run("broadcast_object", what, 0, dist.broadcast_object_list, box, src=src)
        return box[0]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Pending:
    """A collective in flight: `wait()` blocks until it is done, with the same typed error as a blocking call."""

    def __init__(self, collectives: Collectives, work, what: str):
        self.collectives, self.work, self.what = collectives, work, what

    def wait(self) -> None:
        self.collectives._run("wait", self.what, 0, self.work.wait)
