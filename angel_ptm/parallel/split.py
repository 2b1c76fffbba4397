"""The model's split over the mesh, applied from outside before the engine lays out its pages: tensor parallelism
(parallel/tensor: each tp rank's shards) and expert parallelism (parallel/moe: each ep rank's experts).

    split = split_model(model, mesh, trace, on_failure)
    split.tp, split.ep          the tp and ep communicators (None where that degree is 1)
    split.tp_shards             parameter name -> its Shard of the full tensor (checkpoints name those)
    split.expert_names          this rank's expert parameter names -> the unsplit model's (rank-local pages)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from angel_ptm.parallel.mesh import Mesh
from angel_ptm.parallel.moe import EPComm, apply_expert_parallel_for, expert_names
from angel_ptm.parallel.tensor import TPComm, shards_of
from angel_ptm.parallel.tensor.step import TensorParallelStep, apply_tensor_parallel


@dataclass
class Split:
    tp: TPComm | None = None
    ep: EPComm | None = None
    tp_shards: dict = field(default_factory=dict)
    expert_names: dict[str, str] = field(default_factory=dict)

    def wrap_step(self, data_parallel, layout):
        """The data-parallel side of the step, with the tp group's agreements (norm, overflow) when tp > 1."""
        if self.tp is None:
            return data_parallel
        return TensorParallelStep(data_parallel, self.tp, {s.name for s in layout.slots} - set(self.tp_shards))


def split_model(model: nn.Module, mesh: Mesh, trace=None, on_failure=None) -> Split:
    tp = apply_tensor_parallel(model, mesh, trace, on_failure)
    ep = apply_expert_parallel_for(model, mesh, trace, on_failure)
    return Split(tp, ep, shards_of(model), expert_names(model))
