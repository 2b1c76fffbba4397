"""The vocabulary of page moves: one move in flight, a prefetch handle and what `try_hop` did."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from angel_ptm.memory.page import Page, Tier

if TYPE_CHECKING:
    from angel_ptm.memory.manager import PageManager


@dataclass
class Move:
    """One page crossing one tier boundary. `complete()` waits for the transfer and settles the page's state."""

    page: Page
    src: Tier
    dst: Tier
    handle: object  # IOHandle or CopyHandle
    new_buffer: torch.Tensor | None
    finish: Callable[["Move"], None]
    started: float = 0.0  # trace clock when the move was issued
    src_freed: bool = False  # the source slot went back to its pool when the copy was queued (fenced by it)

    def done(self) -> bool:
        return self.handle.done()


class Prefetch:
    """Handle for moves started by `PageManager.prefetch`; `wait()` settles them (and finishes staged moves)."""

    def __init__(self, manager: "PageManager", pages: list[Page], tier: Tier):
        self._manager, self.pages, self.tier = manager, pages, tier

    def done(self) -> bool:
        return not any(self._manager.moving(p) for p in self.pages)

    def wait(self) -> None:
        self._manager._bring(self.pages, self.tier)


class Hop(enum.Enum):
    """What `try_hop` did with one page: started a move, had nothing to do, must wait for room / a move, or must
    wait and nothing on the full tier is used later than the `need` it was given (FULL: no eviction started; a page
    needed later still finds none until something there is used or leaves)."""

    __hash__ = object.__hash__  # (as Tier's)

    STARTED = "started"
    NOTHING = "nothing"
    BLOCKED = "blocked"
    FULL = "full"
