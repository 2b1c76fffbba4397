"""The tensor-parallel region's communication, as autograd functions (Megatron's mappings), over one `TPComm`.

    copy_to(x)          forward: identity            backward: all-reduce      (a replicated input enters the region)
    reduce_from(x)      forward: all-reduce          backward: identity        (partial sums leave it)
    gather_seq(x)       forward: all-gather on dim 1 backward: reduce-scatter  (sequence shards -> the whole sequence)
    reduce_scatter_seq(x) forward: reduce-scatter    backward: all-gather      (partial sums -> sequence shards)
    scatter_seq(x)      forward: this rank's chunk   backward: all-gather      (a replicated tensor -> sequence shards)

The sequence dimension is 1 (inputs are [batch, seq, ...], as every model here and HuggingFace's are). Each call is
one collective of the tp group on the compute path, timed on the trace's comm lane, blocking except where a region's
entry is anchored (layers.py: the backward all-reduce or reduce-scatter of the region's input gradient runs while
the column-parallel weight gradients are computed, Megatron's overlap); a dead or hung peer raises CollectiveError
within `parallel.timeout_s`. Every tp rank runs the same layers in the same order, so the collective sequences
match.
"""

from __future__ import annotations

import torch

from angel_ptm.errors import TensorParallelError
from angel_ptm.parallel.collectives import FAKE_TRACE, MAX, Collectives
from angel_ptm.parallel.mesh import Mesh
from angel_ptm.parallel.tensor.rng import ShardedRandom

SEQ_DIM = 1


class TPComm:
    """One rank's tensor-parallel group: its rank and size, and the collectives (none with tp 1)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.rank, self.size = mesh.tp_rank, mesh.tp
        self.sequence_parallel = mesh.sequence_parallel
        self.collectives = Collectives(mesh, group=mesh.tp_ranks) if mesh.tp > 1 else None
        self.random = ShardedRandom(self.rank, self.size)  # dropout's streams (rng.py)
        self.stashes: list = []  # the `enter` modules running now: their WeightGradStash (layers.py), or None
        self.regions: list = []  # per `enter` module running now: whether its row-parallel exit has not run yet
        self.overlapped = 0  # region entries whose backward collective ran beside weight gradients, cumulative

    @classmethod
    def planning(cls, tp: int, sequence_parallel: bool = False) -> "TPComm":
        """Rank 0 of a tp group that never communicates: parallelize() on a meta-device model gives the shapes one
        rank holds (the estimate's use); running such a model raises at its first collective."""
        comm = cls.__new__(cls)
        comm.mesh, comm.rank, comm.size = None, 0, tp
        comm.sequence_parallel, comm.collectives = sequence_parallel and tp > 1, None
        comm.random = ShardedRandom(0, tp)
        comm.stashes, comm.regions, comm.overlapped = [], [], 0
        return comm

    def set_trace(self, trace) -> None:
        if self.collectives is not None:
            self.collectives.trace = trace

    # ---------------------------------------------------------------- raw collectives (no autograd)
    # While a forward is traced on fake tensors (activations/footprint.py), each returns a tensor of the shape (and,
    # where the collective makes one, the new storage) the collective would: the trace sees one rank's activations.
    def all_reduce(self, x: torch.Tensor, what: str, op=None) -> torch.Tensor:
        if self.size > 1 and getattr(FAKE_TRACE, "on", False):
            return x
        if self.size > 1 and self.collectives is None:
            raise TensorParallelError("a model split for planning (TPComm.planning) cannot run")
        if self.collectives is not None:
            self.collectives.all_reduce(x, f"tp {what}", **({} if op is None else {"op": op}))
        return x

    def all_reduce_max(self, x: torch.Tensor, what: str) -> torch.Tensor:
        return self.all_reduce(x, what, op=MAX)

    def all_gather(self, x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        if self.size > 1 and getattr(FAKE_TRACE, "on", False):
            return torch.cat([x.contiguous()] * self.size, dim=dim)
        if self.collectives is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.collectives.all_gather_list(parts, x, f"tp {what}")
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        if self.size > 1 and getattr(FAKE_TRACE, "on", False):
            return self.split(x, dim)[self.rank].contiguous().clone()
        if self.collectives is None:
            return x
        parts = [p.contiguous() for p in self.split(x, dim)]
        out = torch.empty_like(parts[self.rank])
        self.collectives.reduce_scatter_list(out, parts, f"tp {what}")
        return out

    def all_reduce_async(self, x: torch.Tensor, what: str):
        """`x` summed over tp in place, started now: the handle to wait on (None: nothing in flight)."""
        if self.collectives is None or getattr(FAKE_TRACE, "on", False):
            self.all_reduce(x, what)
            return None
        return self.collectives.all_reduce(x, f"tp {what}", async_op=True)

    def reduce_scatter_async(self, x: torch.Tensor, dim: int, what: str):
        """(this rank's chunk of the sum over tp along `dim`, the handle to wait on before reading it)."""
        if self.collectives is None or getattr(FAKE_TRACE, "on", False):
            return self.reduce_scatter(x, dim, what), None
        parts = [p.contiguous() for p in self.split(x, dim)]
        out = torch.empty_like(parts[self.rank])
        return out, self.collectives.reduce_scatter(out, parts, f"tp {what}", async_op=True)

    def split(self, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        if x.shape[dim] % self.size:
            raise TensorParallelError(f"parallel.sequence_parallel: dimension {dim} of a {tuple(x.shape)} tensor "
                                      f"({x.shape[dim]}) does not divide over tp {self.size}; use a sequence length "
                                      f"that is a multiple of {self.size}")
        return list(x.chunk(self.size, dim=dim))


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, stash=None):
        ctx.comm, ctx.stash = comm, stash
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if ctx.stash is not None:  # the region's weight gradients are computed while it is all-reduced (layers.py)
            ctx.stash.pending = ctx.comm.all_reduce_async(grad, "copy_to backward")
            return grad, None, None
        return ctx.comm.all_reduce(grad, "copy_to backward"), None, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.contiguous().clone(), "reduce_from forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, stash=None):
        ctx.comm, ctx.stash = comm, stash
        return comm.all_gather(x, SEQ_DIM, "gather_seq forward")

    @staticmethod
    def backward(ctx, grad):
        if ctx.stash is not None:  # the region's weight gradients are computed while it is reduce-scattered
            out, ctx.stash.pending = ctx.comm.reduce_scatter_async(grad, SEQ_DIM, "gather_seq backward")
            return out, None, None
        return ctx.comm.reduce_scatter(grad, SEQ_DIM, "gather_seq backward"), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.reduce_scatter(x, SEQ_DIM, "reduce_scatter_seq forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, SEQ_DIM, "reduce_scatter_seq backward"), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.split(x, SEQ_DIM)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, SEQ_DIM, "scatter_seq backward"), None


def copy_to(x: torch.Tensor, comm: TPComm, stash=None) -> torch.Tensor:
    return x if comm.size == 1 else _CopyTo.apply(x, comm, stash)


def reduce_from(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Partial sums leave the region whole on every rank: random numbers come from the replicated stream again."""
    if comm.size == 1:
        return x
    comm.random.replicated()
    return _ReduceFrom.apply(x, comm)


def gather_seq(x: torch.Tensor, comm: TPComm, stash=None) -> torch.Tensor:
    return x if comm.size == 1 else _GatherSeq.apply(x, comm, stash)


def reduce_scatter_seq(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceScatterSeq.apply(x, comm)


def scatter_seq(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return x if comm.size == 1 else _ScatterSeq.apply(x, comm)


def enter_region(x: torch.Tensor, comm: TPComm, stash=None) -> torch.Tensor:
    """A module's input entering the tensor-parallel region: sequence shards gathered (sequence parallelism), else
    the replicated input copied in (its gradient all-reduced). With a `stash` (layers.WeightGradStash), that
    backward collective is started and left in flight for the stash's anchor to wait on."""
    return gather_seq(x, comm, stash) if comm.sequence_parallel else copy_to(x, comm, stash)


def leave_region(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Partial sums leaving the region: reduce-scattered to sequence shards (sequence parallelism), else
    all-reduced."""
    return reduce_scatter_seq(x, comm) if comm.sequence_parallel else reduce_from(x, comm)
