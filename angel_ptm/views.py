"""What an Engine shows of its parts: the model split's communicators and names, the step's state, the memory
statistics, and the means over ranks a training loop logs (engine.py wires the parts; this mixin only reads them)."""

from __future__ import annotations

import torch


class EngineViews:
    # The model's split (parallel/split.py): the tp and ep communicators, the shards, this rank's expert names.
    tp = property(lambda self: self.split.tp)
    ep = property(lambda self: self.split.ep)
    tp_shards = property(lambda self: self.split.tp_shards)
    expert_names = property(lambda self: self.split.expert_names)  # this rank's expert names -> the unsplit model's

    # The step's state, for callers that look at it (optim/step.py holds it).
    delayed = property(lambda self: self.driver.delayed)
    loss_scaler = property(lambda self: self.driver.loss_scaler)
    last_step_skipped = property(lambda self: self.driver.last_step_skipped)
    _eager_now = property(lambda self: self.driver.eager_now)

    def memory_stats(self) -> dict:
        """Bytes in use per tier and moved per tier pair, the experts' moves, the last step's schedule and the
        collectives' figures. After close() nothing is in use (the pages and their files are gone); the rest is
        the run's record."""
        in_use = {tier: 0 for tier in self.manager.in_use()} if self._closed else self.manager.in_use()
        return {"in_use": in_use, "moved": dict(self.manager.bytes_moved),
                **({"expert_moved": dict(self.manager.watched_moved),
                    "expert_prefetch_wasted": self.manager.watched_wasted} if self.manager.watched else {}),
                **({"moe_rebalance": self.rebalancer.stats()} if self.rebalancer is not None else {}),
                "zero_copy": self.manager.zero_copy,
                "schedule": self.scheduler.last_stats.as_dict(), **self.data_parallel.stats()}

    def mean_over_ranks(self, value: float) -> float:
        """`value` averaged over the data-parallel ranks (every rank must call it): the loss to log. `value` itself
        with one rank."""
        return self.data_parallel.mean(float(value), "mean over ranks")

    def sum_over_ranks(self, tensor: torch.Tensor) -> None:
        """`tensor` summed over the data-parallel ranks, in place (every rank must call it; nothing with one)."""
        self.data_parallel.sum(tensor, "sum over ranks")

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale the next backward uses (None: no loss scaling)."""
        return None if self.loss_scaler is None else self.loss_scaler.scale
