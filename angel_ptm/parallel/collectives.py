"""Collectives over the data-parallel group, with one error type: pure functions of buffers, no page logic.

Every call names what it moves (`what`, e.g. "all_gather param group 3"); a peer that died (gloo sees the
connection close in well under a second) or hung past `parallel.timeout_s` surfaces as a `CollectiveError` naming
this rank, the collective and the elapsed time. The process group is unusable after that (torch poisons it), so the
engine treats it as fatal. Each collective is timed on the trace's "comm" lane.

Over gloo, a page group's all-gather and reduce-scatter are pairwise exchanges (each rank sends its page straight
to every peer and receives theirs straight into the destination; gloo runs them on its own threads): gloo's
collectives stage every list through a flat copy, and its reduce-scatter is a reduction of the whole group's bytes,
so on page-sized buffers the exchange measured 1.2-2x (all-gather) and 2-4x (reduce-scatter) faster on this
machine's loopback. The bytes each rank sends are the same as a ring's. Other backends (NCCL) use their own
collectives, with the reductions on a process group of their own (tests run that path on gloo too, with
PAIRWISE_ON_GLOO off). A reduce-scatter sums the ranks' contributions in rank order on every rank, so the result
does not depend on which rank owns the page.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from angel_ptm.errors import CollectiveError
from angel_ptm.parallel.activation_watch import ACTIVATION_WATCH
from angel_ptm.parallel.mesh import Group, Mesh, mark_out_of_step, new_groups_like
from angel_ptm.trace.recorder import TraceRecorder

SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN
PAIRWISE_ON_GLOO = True  # gloo's page-group collectives as pairwise exchanges (tests turn it off to run NCCL's way)
# Set while a forward runs on fake tensors (activations/footprint.py): a collective there (a tensor- or
# expert-parallel layer's) is refused before it reaches the process group, which cannot move fake tensors.
FAKE_TRACE = threading.local()


def world_group(mesh: Mesh) -> Group:
    """Every rank of the job (the default process group)."""
    return Group("world", tuple(range(mesh.world_size)))


class Collectives:
    """The collectives of one group of the mesh: the data-parallel group's (page groups, gradients) by default."""

    def __init__(self, mesh: Mesh, trace: TraceRecorder | None = None, on_failure=None, group: Group | None = None):
        """`group`: the ranks they run over (default: this rank's data-parallel group; `world_group(mesh)` for
        every rank). `rank` and `size` are this rank's place in it; peers are named by group rank."""
        group = group or mesh.dp_ranks
        if group.size < 1:
            raise ValueError(f"collectives need a group of at least one rank, got {group}")
        self.mesh, self.group = mesh, group
        self.rank, self.size = group.index(mesh.rank), group.size
        self._pg = group.pg  # None: the default group (the group is the world)
        self.who = (f"rank {self.rank} of {self.size}" if group.size == mesh.world_size and group.name != "tp"
                    else f"rank {mesh.rank} ({group.name} rank {self.rank} of {self.size})")
        self.trace = trace or TraceRecorder(None)
        self.bytes_sent = 0  # bytes this rank contributed to collectives, cumulative (the estimate's figure)
        # NCCL moves CUDA tensors only: a CPU tensor handed to a collective goes through a GPU copy (and back),
        # counted here -- correct wherever a caller's tensor lives, and a figure that says when that costs
        self.staged_bytes = 0
        self._stage_to = mesh.comm_device if mesh.backend == "nccl" else None
        self.calls = 0
        self.seconds = 0.0  # wall time the calling threads spent inside collectives (and waits), cumulative
        self.on_failure = on_failure  # called with the error before it is raised (the engine fails for good)
        self.failed: CollectiveError | None = None
        # A digest of the collectives issued since the last `verify_sequence` (name and what, in order): ranks that
        # issued different ones of the same size would exchange the wrong data silently; the check makes it loud.
        self._sequence = 0
        self._since_check = 0
        self.pairwise = mesh.backend == "gloo" and PAIRWISE_ON_GLOO  # page-group collectives as pairwise exchanges
        # Elsewhere (NCCL) reductions run on a process group of their own: one issued during backward may then come
        # between other collectives at a different point on each rank without crossing them (a communicator runs
        # its collectives in the order issued). Not on torch's threaded test group, which cannot make one.
        self._reduction_group = None
        if not self.pairwise and mesh.backend in ("nccl", "gloo"):
            self._reduction_group = new_groups_like(group, mesh, mesh.backend).pg
        # Reductions can run asynchronously beside compute and other collectives (GradSync overlaps them)
        self.async_reductions = self.pairwise or self._reduction_group is not None
        self._exchanges = 0  # pairwise all-gathers issued: the tag of the next one (the same count on every rank)
        self._reductions = 0  # pairwise reductions issued, likewise
        self._spare: dict = {}  # (numel, dtype, device) -> buffers a reduction may receive into
        self._jobs: dict = {}  # channel -> its background waiter's queue, once one is needed
        # an engine dropped without close() still stops its waiters (they hold only their queues, not this object)
        self._stop_waiters = weakref.finalize(self, _stop_waiters, self._jobs)
        self.gathers_observed = False  # all_gather's handles answer done() truly (a thread waits for them)
        self._reduction_sequence = 0  # reductions keep a digest of their own (reduce_scatter's docstring)
        self._reductions_since_check = 0
        self._sealed = (0, 0)  # the reductions' digest and count when the last step's reductions were all issued
        self._side_group = None  # side_group(), once made

    def _run(self, name: str, what: str, nbytes: int, fn, *args, since: float | None = None, **kwargs):
        """fn(*args, **kwargs), timed on the trace; a failure becomes this rank's CollectiveError, its elapsed time
        counted from `since` (a wait: when the collective was issued, as the process group's timeout counts)."""
        if self.failed is not None:  # the group is poisoned: no rank may wait on it again
            raise self.failed
        if getattr(FAKE_TRACE, "on", False):
            raise RuntimeError(f"{name} ({what}) in a forward traced on fake tensors: a parallel layer's "
                               f"activations are not traced")
        t0 = time.perf_counter()
        start = self.trace.now() if self.trace.enabled else 0.0
        if name != "wait":
            with _ISSUED_LOCK:
                _ISSUED[0] += 1
        try:
            result = fn(*args, **kwargs)
        except (RuntimeError, ValueError) as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.failed = CollectiveError(
                f"{self.who}: {name} ({what}) failed after "
                f"{time.perf_counter() - (t0 if since is None else since):.1f} s "
                f"(parallel.timeout_s {self.mesh.timeout_s:g}): a peer rank died, hung or took another path "
                f"(a branch taken on some ranks only that runs collectives): {detail[:300]}")
            mark_out_of_step(str(self.failed))
            if self.on_failure is not None:
                self.on_failure(self.failed)
            raise self.failed from None
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        self.bytes_sent += nbytes
        if name == "reduce_scatter":
            self._reduction_sequence = zlib.crc32(f"{name}:{what};".encode(), self._reduction_sequence)
            self._reductions_since_check += 1
        elif name != "wait":
            self._sequence = zlib.crc32(f"{name}:{what};".encode(), self._sequence)
            self._since_check += 1
        if self.trace.enabled:
            self.trace.interval("comm", f"{name} {what}", start, self.trace.now(), bytes=nbytes)
        return result

    def seal_reductions(self) -> None:
        """Every reduction of this step is issued: the next `verify_sequence` compares them (reductions issued
        during backward come at different points between other collectives on different ranks, so they are
        compared as a sequence of their own, once a step's are all issued)."""
        self._sealed = (self._reduction_sequence, self._reductions_since_check)
        self._reduction_sequence, self._reductions_since_check = 0, 0

    def verify_sequence(self, what: str) -> None:
        """Every rank issued the same collectives, in the same order, since the last check (one small all-gather),
        and the same reductions up to the last `seal_reductions`; otherwise a CollectiveError on every rank naming
        the ranks that differ from rank 0, and the engine fails."""
        mine = self._to_comm(torch.tensor([self._sequence, self._since_check, *self._sealed], dtype=torch.int64))
        self._sealed = (0, 0)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        self._run("all_gather", f"collective sequence check ({what})", _nbytes(mine), dist.all_gather, everyone,
                  mine, group=self._pg)
        self._sequence, self._since_check = 0, 0
        differ = [rank for rank, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
        if differ:
            counts = [int(t[1]) for t in everyone]
            self.failed = CollectiveError(
                f"{self.who}: ranks {differ} issued other collectives than rank 0 before "
                f"{what} (collectives per rank {counts}); data exchanged since the last check may be wrong, so "
                f"no rank trains on")
            mark_out_of_step(str(self.failed))
            if self.on_failure is not None:
                self.on_failure(self.failed)
            raise self.failed

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, what: str,
                   async_op: bool = False):
        """outputs[r] <- rank r's `tensor` (outputs[self.rank] may be `tensor` itself: gathered in place). With
        `async_op` it returns at once with a handle whose `wait()` returns when the outputs are filled (the
        transfer runs on the process group's own threads or stream) and raises a CollectiveError if it failed."""
        if self.pairwise:
            mine = outputs[self.rank]
            if mine.data_ptr() != tensor.data_ptr():
                mine.copy_(tensor)
            peers = [r for r in range(self.size) if r != self.rank]
            works = self._run("all_gather", what, _nbytes(tensor), self._exchange,
                              [(tensor, r) for r in peers], [(outputs[r], r) for r in peers])
        else:
            staged = [self._to_comm(out, copy=False) for out in outputs]
            works = [self._run("all_gather", what, _nbytes(tensor), dist.all_gather, staged,
                               self._to_comm(tensor), group=self._pg, async_op=async_op)]
            then = _copy_back(outputs, staged)
        # While `gathers_observed`, an asynchronous pairwise gather is waited on by a thread of its own, so `done()`
        # tells whether its data is here (OSDP measures what compute really waited for; a thread hop per gather
        # costs CPU, so only then)
        pending = Pending(self, works, what, then=None if self.pairwise else then,
                          background=async_op and self.pairwise and self.gathers_observed, channel="gathers")
        if not async_op:
            pending.wait()
            return None
        return pending

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], what: str,
                       async_op: bool = False):
        """output <- the sum over ranks of their inputs[self.rank]. With `async_op`, a handle (`done()` polls,
        `wait()` lands it); the inputs must stay unchanged and `output` unread until then. Reductions keep their own
        order (their own tags, their own digest in `verify_sequence`): one issued during backward may interleave
        with other collectives differently on different ranks, as long as the reductions come in the same order."""
        nbytes = sum(_nbytes(t) for t in inputs)
        if not self.pairwise:
            staged = self._to_comm(output, copy=False)
            works = [self._run("reduce_scatter", what, nbytes, dist.reduce_scatter, staged,
                               [self._to_comm(t) for t in inputs],
                               group=self._reduction_group if self._reduction_group is not None else self._pg,
                               async_op=async_op)]
            # NCCL's work says when it is done (a CUDA event); gloo's only once waited on: a thread waits for it
            pending = Pending(self, works, what, then=_copy_back([output], [staged]),
                              background=async_op and self.mesh.backend != "nccl", channel="reductions")
        else:
            peers = [r for r in range(self.size) if r != self.rank]
            received = {r: self._take_buffer(inputs[self.rank]) for r in peers}
            works = self._run("reduce_scatter", what, nbytes, self._exchange, [(inputs[r], r) for r in peers],
                              [(received[r], r) for r in peers], reduction=True)
            pending = Pending(self, works, what, then=lambda: self._sum_in_rank_order(output, inputs, received),
                              background=async_op, channel="reductions")
        if not async_op:
            pending.wait()
            return None
        return pending

    def _sum_in_rank_order(self, output, inputs, received) -> None:
        mine = inputs[self.rank]
        parts = [mine if r == self.rank else received[r] for r in range(self.size)]
        if self.rank and output.data_ptr() == mine.data_ptr():  # `mine` is added after rank 0's part
            parts[self.rank] = mine.clone()
        if len(parts) > 1:  # the first two summed straight into `output`: one pass over it, not a copy and an add
            torch.add(parts[0], parts[1], out=output)
        else:
            output.copy_(parts[0])
        for part in parts[2:]:
            output.add_(part)
        for buffer in received.values():
            self._spare.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)

    def _exchange(self, sends, receives, reduction: bool = False) -> list:
        """Post every receive, then every send, of one pairwise exchange. Its tag keeps exchanges in flight at once
        apart: all-gathers and reductions are numbered in two ranges of their own, alike on every rank (each
        range's sequence is the same on every rank)."""
        if reduction:
            tag = (1 << 29) + self._reductions % (1 << 29)
            self._reductions += 1
        else:
            tag = self._exchanges % (1 << 29)
            self._exchanges += 1
        ranks = self.group.ranks
        works = [dist.irecv(buffer, src=ranks[peer], group=self._pg, tag=tag) for buffer, peer in receives]
        works += [dist.isend(buffer, dst=ranks[peer], group=self._pg, tag=tag) for buffer, peer in sends]
        return works

    def side_group(self):
        """A gloo group of the same ranks for object collectives outside the step (DCP's checkpoint planning: CPU
        objects, which NCCL cannot carry), made at the first call: every rank makes it at the same point."""
        if self._side_group is None:  # (a peer gone meanwhile: torch's store times out, a CollectiveError here)
            self._side_group = self._run("new_group", "a gloo group for checkpoint planning", 0, new_groups_like,
                                         self.group, self.mesh, "gloo").pg
        return self._side_group

    def close(self) -> None:
        """Stop the background waiters once they have finished what they were given (the process group stays: its
        owner, torchrun's script or the trainer, destroys it)."""
        _stop_waiters(self._jobs)

    def _waiter(self, channel: str) -> "queue.SimpleQueue[Pending | None]":
        """The queue of the thread that waits for `channel`'s background collectives in the order they were issued
        (one thread per channel: a reduction held up by a late peer never holds up a gather's completion)."""
        if channel not in self._jobs:
            self._jobs[channel] = queue.SimpleQueue()
            thread = threading.Thread(target=_wait_in_order, args=(self._jobs[channel],),
                                      name=f"angel-ptm-{channel}", daemon=True)
            thread.start()
            _WAITERS[:] = [w for w in _WAITERS if w[0].is_alive()] + [(thread, self._jobs[channel])]
        return self._jobs[channel]

    def _take_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer like `like` for a reduction to receive into (reused: a fresh page-sized one costs page faults)."""
        spare = self._spare.get((like.numel(), like.dtype, like.device))
        buffer = spare.pop() if spare else torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buffer.view(like.shape)

    def _to_comm(self, tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """`tensor` where this backend can move it: itself, or (NCCL, a tensor off the GPU) a GPU copy of it (an
        uninitialized one for an output, `copy=False`)."""
        if self._stage_to is None or tensor.device.type == "cuda":
            return tensor
        self.staged_bytes += _nbytes(tensor)
        if copy:
            return tensor.to(self._stage_to)
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=self._stage_to)

    def _hand(self, tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """What a model's collective (tp's, ep's: not a page group's) hands the backend: `_to_comm`'s, and under an
        activation watch a copy the watch does not count (_ActivationWatch)."""
        if not ACTIVATION_WATCH.depth:
            return self._to_comm(tensor, copy)
        with ACTIVATION_WATCH.pause():
            staged = self._to_comm(tensor, copy)
            if staged is tensor:
                staged = tensor.clone() if copy else torch.empty_like(tensor)
            return staged

    def all_reduce(self, tensor: torch.Tensor, what: str, op=SUM, async_op: bool = False):
        """`tensor` reduced over the group, in place. With `async_op`, a handle whose `wait()` returns once it is
        (the reduction runs on the process group's own threads or stream meanwhile)."""
        staged = self._hand(tensor)
        work = self._run("all_reduce", what, _nbytes(tensor), dist.all_reduce, staged, op=op, group=self._pg,
                         async_op=async_op)
        if async_op:
            return Pending(self, [work], what, then=_copy_back([tensor], [staged]))
        _land([tensor], [staged])
        return None

    def all_gather_list(self, outputs: list[torch.Tensor], tensor: torch.Tensor, what: str) -> None:
        """outputs[r] <- group rank r's `tensor`, with the backend's own all-gather (blocking)."""
        staged = [self._hand(out, copy=False) for out in outputs]
        self._run("all_gather", what, _nbytes(tensor), dist.all_gather, staged, self._hand(tensor),
                  group=self._pg)
        _land(outputs, staged)

    def reduce_scatter_list(self, output: torch.Tensor, inputs: list[torch.Tensor], what: str) -> None:
        """output <- the sum over the group of inputs[self.rank], with the backend's own reduce-scatter (blocking)."""
        staged = self._hand(output, copy=False)
        self._run("reduce_scatter", what, sum(_nbytes(t) for t in inputs), dist.reduce_scatter, staged,
                  [self._hand(t) for t in inputs], group=self._pg)
        _land([output], [staged])

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], what: str) -> None:
        """Rows input[sum(input_splits[:r]) ..] to group rank r; output gets rank r's rows at
        sum(output_splits[:r]) (uneven splits; blocking)."""
        staged = self._hand(output, copy=False)
        self._run("all_to_all", what, _nbytes(input), dist.all_to_all_single, staged, self._hand(input),
                  output_splits, input_splits, group=self._pg)
        _land([output], [staged])

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """From group rank `src`."""
        staged = self._to_comm(tensor)
        self._run("broadcast", what, _nbytes(tensor) if src == self.rank else 0, dist.broadcast, staged,
                  src=self.group.ranks[src], group=self._pg)
        _land([tensor], [staged])

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._run("all_gather_object", what, 0, dist.all_gather_object, out, obj, group=self._pg)
        return out

    def broadcast_object(self, obj: Any, src: int, what: str) -> Any:
        box = [obj if self.rank == src else None]
        self._run("broadcast_object", what, 0, dist.broadcast_object_list, box, src=self.group.ranks[src],
                  group=self._pg)
        return box[0]


def _copy_back(originals: Sequence[torch.Tensor], staged: Sequence[torch.Tensor]):
    """What lands a staged collective's outputs in the caller's tensors (None when nothing was staged)."""
    pairs = [(o, s) for o, s in zip(originals, staged) if o is not s]
    if not pairs:
        return None

    def land() -> None:
        for original, copy in pairs:
            original.copy_(copy)
    return land


def _land(originals: Sequence[torch.Tensor], staged: Sequence[torch.Tensor]) -> None:
    land = _copy_back(originals, staged)
    if land is not None:
        land()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Pending:
    """A collective in flight: `wait()` blocks until it is done (then runs `then`, once), with the same typed error
    as a blocking call; `done()` says whether `wait()` would return at once. With `background`, a thread of the
    collectives waits for it (and runs `then`) as soon as it can, so `done()` turns true by itself: gloo's
    point-to-point works only notice completion when waited on."""

    def __init__(self, collectives: Collectives, works: list, what: str, then=None, background: bool = False,
                 channel: str = "reductions"):
        self.collectives, self.works, self.what = collectives, [w for w in works if w is not None], what
        self.then = then
        self.issued = time.perf_counter()
        self._finished: threading.Event | None = None
        self._error: BaseException | None = None
        if background:
            self._finished = threading.Event()
            collectives._waiter(channel).put(self)

    def done(self) -> bool:
        if self._finished is not None:
            return self._finished.is_set()
        return all(work.is_completed() for work in self.works)

    def wait_for(self, seconds: float) -> bool:
        """Whether it is done within `seconds` (a background one waits on its event; others poll `done()`)."""
        if self._finished is not None:
            return self._finished.wait(seconds)
        deadline = time.perf_counter() + seconds
        while not self.done():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(0.0002)
        return True

    def _complete(self) -> None:
        """On the waiter thread."""
        try:
            for work in self.works:
                work.wait()
            if self.then is not None:
                self.then()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
            self._error = exc
        finally:
            self._finished.set()

    def wait(self) -> None:
        if self._finished is not None:
            self.collectives._run("wait", self.what, 0, self._wait_background, since=self.issued)
            return
        while self.works:
            self.collectives._run("wait", self.what, 0, self.works[0].wait, since=self.issued)
            self.works.pop(0)
        if self.then is not None:
            then, self.then = self.then, None
            then()

    def _wait_background(self) -> None:
        self._finished.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


_ISSUED = [0]  # collectives this process issued, over every group (issued_count)
_ISSUED_LOCK = threading.Lock()


def issued_count() -> int:
    """Collectives this process has issued so far, over every group: an engine compares it with its value when the
    step began to know whether a rank-local error left its peers waiting on collectives of this step."""
    return _ISSUED[0]


def _stop_waiters(jobs: dict) -> None:
    for waiter in jobs.values():
        waiter.put(None)
    jobs.clear()


# Every waiter thread started, with its queue
_WAITERS: list[tuple[threading.Thread, "queue.SimpleQueue[Pending | None]"]] = []
EXIT_JOIN_S = 10.0  # how long the exit waits for waiter threads in all


def _join_waiters_at_exit() -> None:
    """Stop the waiter threads and wait for them (up to EXIT_JOIN_S), before the interpreter finalizes. One still
    inside a collective's wait then (a peer died: the wait returns with its error just as this rank exits on the
    same error) is ended by the interpreter when it wants the GIL back, which unwinds its C++ frames through
    pybind11's noexcept GIL guard: std::terminate, SIGABRT instead of the error's exit status. The process group,
    destroyed before this runs (mesh._destroy_at_exit, registered later), ends those waits at once; a wait on a
    group the user made ends at its timeout, long after this process has gone if it is not over by then."""
    for _, jobs in _WAITERS:
        jobs.put(None)
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread, _ in _WAITERS:
        thread.join(max(0.0, deadline - time.monotonic()))
    _WAITERS.clear()


atexit.register(_join_waiters_at_exit)  # (first registered, so run last: after the process group is destroyed)


def _wait_in_order(jobs: "queue.SimpleQueue[Pending | None]") -> None:
    while True:
        pending = jobs.get()
        if pending is None:
            return
        pending._complete()
        del pending  # holding the last one while waiting for the next would keep its collectives (and engine) alive
