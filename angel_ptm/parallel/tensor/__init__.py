"""Megatron-style 1-D tensor parallelism with sequence parallelism, applied from outside (see plan.py)."""

from angel_ptm.parallel.tensor.comm import TPComm, copy_to, enter_region, gather_seq, leave_region, reduce_from
from angel_ptm.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, Shard, VocabParallelEmbedding,
                                              VocabShardedLogits, gather_logits)
from angel_ptm.parallel.tensor.plan import (Plan, gpt_plan, is_parallelized, llama_plan, parallelize, plan_for,
                                            shards_of, tp_comm_of)

__all__ = ["TPComm", "copy_to", "enter_region", "gather_seq", "leave_region", "reduce_from", "ColumnParallelLinear",
           "RowParallelLinear", "Shard", "VocabParallelEmbedding", "VocabShardedLogits", "gather_logits", "Plan",
           "gpt_plan", "is_parallelized", "llama_plan", "parallelize", "plan_for", "shards_of", "tp_comm_of"]
