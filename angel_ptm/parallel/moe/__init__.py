"""Expert parallelism: an MoE layer's experts split over the ranks of an `ep` group, tokens dispatched to their
experts' ranks and combined back with all-to-all (dispatch.py)."""

from angel_ptm.parallel.moe.dispatch import (EPComm, ExpertParallelMoE, apply_expert_parallel,
                                             apply_expert_parallel_for, expert_names)

__all__ = ["EPComm", "ExpertParallelMoE", "apply_expert_parallel", "apply_expert_parallel_for", "expert_names"]
