"""What the scheduling side needs of the collectives: the protocol parallel/collectives.py implements.

ZeRO's page logic (parallel/zero.py) is written against it, so it runs over torch.distributed (NCCL, gloo), torch's
threaded process group in tests, or anything else that keeps the contract: every rank calls the same collectives in
the same order; a failure or a peer that is gone past the timeout raises angel_ptm.errors.CollectiveError.
Asynchronous calls return at once with a handle; the transfer runs on the process group's own queue (its threads
on CPU, its stream on a GPU), and compute waits only on the handle of the group it needs.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch


class PendingCollective(Protocol):
    def wait(self) -> None:
        """Block until the collective is done (CollectiveError if it failed)."""

    def done(self) -> bool:
        """Whether `wait()` would return at once."""


class Communicator(Protocol):
    rank: int  # this rank in the data-parallel group
    size: int  # ranks in it
    gathers_observed: bool  # while true, an asynchronous all_gather's handle answers done() truly (OSDP measures)

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, what: str,
                   async_op: bool = False) -> PendingCollective | None:
        """outputs[r] <- rank r's `tensor`; `what` names it in errors and traces."""

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], what: str) -> None:
        """output <- the sum over ranks of their inputs[self.rank]."""

    def all_reduce(self, tensor: torch.Tensor, what: str, op: Any = ...) -> None:
        """tensor <- its reduction (sum by default) over ranks, in place."""

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """tensor <- rank `src`'s, in place."""
