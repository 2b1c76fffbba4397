"""The tensor-parallel side of the engine: the plan applied when the engine starts, and the step's agreements.

    comm = apply_tensor_parallel(model, mesh)      # parallel.tp > 1: the built-in plan unless the user applied one
    data_parallel = TensorParallelStep(data_parallel, comm, replicated)

Each tp rank holds its shards of the split tensors and a whole copy of the rest (norm weights, row-parallel biases),
whose gradients are equal on every tp rank. The gradient norm adds every rank's shards and the replicated tensors
once (tp rank 0's); an fp16 overflow on any tp rank skips the step on all of them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from angel_ptm.errors import TensorParallelError
from angel_ptm.parallel.collectives import MAX
from angel_ptm.parallel.mesh import Mesh
from angel_ptm.parallel.tensor.comm import TPComm
from angel_ptm.parallel.tensor.plan import is_parallelized, parallelize, plan_for, tp_comm_of


def apply_tensor_parallel(model: nn.Module, mesh: Mesh, trace=None, on_failure=None) -> TPComm | None:
    """The model's tp communicator (None with tp 1); the built-in plan for its type is applied here when the user
    did not apply one. A model parallelized for another tp degree, or one with tp shards under tp 1, is refused."""
    done = is_parallelized(model)
    if mesh.tp == 1:
        if done > 1:
            raise TensorParallelError(f"parallel.tp is 1 but the model was parallelized for tp {done}")
        return None
    if done == 1:
        parallelize(model, TPComm(mesh), plan_for(model))
    elif done != mesh.tp:
        raise TensorParallelError(f"parallel.tp is {mesh.tp} but the model was parallelized for tp {done}")
    comm = tp_comm_of(model)
    if comm.sequence_parallel != mesh.sequence_parallel:
        raise TensorParallelError(f"parallel.sequence_parallel is {mesh.sequence_parallel} but the model was "
                                  f"parallelized with sequence_parallel {comm.sequence_parallel}")
    if trace is not None:
        comm.set_trace(trace)
    comm.collectives.on_failure = on_failure
    return comm


class TensorParallelStep:
    """The data-parallel side (SingleRank or DataParallel) with the tp group's agreements added."""

    def __init__(self, inner, comm: TPComm, replicated: set[str]):
        self.inner, self.comm, self.replicated = inner, comm, frozenset(replicated)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def finish_grads(self, without: set[str], overflow: bool) -> tuple[set[str], bool]:
        without, overflow = self.inner.finish_grads(without, overflow)
        flag = torch.tensor([1.0 if overflow else 0.0])
        self.comm.all_reduce(flag, "fp16 overflow", op=MAX)
        return without, bool(flag.item())

    def grad_norm(self, optimizer, without: set[str]) -> float:
        """Every tp rank's shards, the replicated tensors counted once (tp rank 0's)."""
        skip = set(without) | self.replicated if self.comm.rank else without
        mine = self.inner.grad_norm(optimizer, skip)
        total = torch.tensor([mine * mine], dtype=torch.float64)
        self.comm.all_reduce(total, "gradient norm")
        return math.sqrt(float(total.item()))
