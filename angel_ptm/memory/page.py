"""A Page: one fixed-size buffer of one kind and dtype, with an explicit residency state.

The state names where the working copy is (or that it is moving). `PageManager` is the only code that calls
`Page.transition`; every move it makes must be an edge of `TRANSITIONS`, so an illegal move is a loud bug, not a
silent corruption. A page may also keep a clean copy on disk (`disk_version == version`): evicting it then drops
the working copy instead of writing it back.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch

from angel_ptm.errors import PageStateError


class Tier(enum.Enum):
    # Members are singletons compared by identity: hashed by identity too, in C (Enum's own __hash__ is a Python
    # call, and the manager hashes tiers and states tens of thousands of times a step)
    __hash__ = object.__hash__

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class PageState(enum.Enum):
    __hash__ = object.__hash__  # (as Tier's)

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    TO_DEVICE = "to_device"  # host -> device copy in flight
    TO_HOST = "to_host"  # device -> host copy in flight
    TO_DISK = "to_disk"  # host -> disk write in flight
    FROM_DISK = "from_disk"  # disk -> host read in flight
    # ZeRO: a page whose home is another data-parallel rank (`Page.home`) and that has no copy here. A collective
    # fills a slot for it (REMOTE -> DEVICE/HOST: its group was gathered); leaving the tier drops the copy (back to
    # REMOTE): it is never written to this rank's disk nor read from it.
    REMOTE = "remote"

    # Each member's `in_flight` (a copy of it is moving) and `tier` (the tier holding the working copy, None while
    # it moves or is remote) are plain attributes, set below: read on every access, eviction and pump.
    in_flight: bool
    tier: "Tier | None"


_RESTING = {PageState.DEVICE: Tier.DEVICE, PageState.HOST: Tier.HOST, PageState.DISK: Tier.DISK}
_IN_FLIGHT = {PageState.TO_DEVICE, PageState.TO_HOST, PageState.TO_DISK, PageState.FROM_DISK}
for _state in PageState:
    _state.in_flight, _state.tier = _state in _IN_FLIGHT, _RESTING.get(_state)

# Legal moves. A failed or cancelled move returns to where it started; DEVICE/HOST -> DISK without a write is
# the drop of a working copy whose clean copy is already on disk.
TRANSITIONS: dict[PageState, frozenset[PageState]] = {
    PageState.DEVICE: frozenset({PageState.TO_HOST, PageState.DISK, PageState.REMOTE}),
    PageState.HOST: frozenset({PageState.TO_DEVICE, PageState.TO_DISK, PageState.DISK, PageState.REMOTE}),
    PageState.DISK: frozenset({PageState.FROM_DISK}),
    PageState.TO_DEVICE: frozenset({PageState.DEVICE, PageState.HOST}),
    PageState.TO_HOST: frozenset({PageState.HOST, PageState.DEVICE}),
    PageState.TO_DISK: frozenset({PageState.DISK, PageState.HOST}),
    PageState.FROM_DISK: frozenset({PageState.HOST, PageState.DISK}),
    PageState.REMOTE: frozenset({PageState.DEVICE, PageState.HOST}),
}

RESTING_STATE = {tier: state for state, tier in _RESTING.items()}


@dataclass(eq=False)
class Page:
    """One page. `buffer` is a uint8 view of the slot holding the working copy (None while only on disk)."""

    id: int
    kind: str
    index: int
    dtype: torch.dtype
    nbytes: int
    state: PageState = PageState.HOST
    version: int = 0
    pin_count: int = 0
    buffer: torch.Tensor | None = field(default=None, repr=False)
    disk_slot: int | None = None
    disk_version: int = -1  # version of the copy in disk_slot; -1 = none
    disk_checksum: int | None = None
    dead: bool = False  # contents no longer needed (a gradient already applied): dropped, never written or read
    # Created as zeros for an owner that writes it only through acquire, and not acquired since: it can leave its
    # tier without a write, as a dead page (PageManager.create_page(untouched=True)).
    untouched: bool = False
    home: int | None = None  # ZeRO: the rank that owns this page, when it is not this one (state REMOTE at rest)
    # Told of every change of `state` or `pin_count` (the PageManager's index of eviction candidates; the two are
    # properties, set below, so other attributes are set at plain speed)
    watcher: Callable[["Page"], None] | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def tier(self) -> Tier | None:
        return self.state.tier

    @property
    def clean_on_disk(self) -> bool:
        return self.disk_slot is not None and self.disk_version == self.version

    @property
    def droppable(self) -> bool:
        """Leaving this tier needs no write: a clean copy is on disk (or on its home rank), or the contents are dead
        or untouched zeros."""
        return self.dead or self.untouched or self.clean_on_disk or self.home is not None

    def transition(self, new_state: PageState) -> None:
        if new_state not in TRANSITIONS[self.state]:
            raise PageStateError(f"page {self.name}: illegal transition {self.state.name} -> {new_state.name}")
        self.state = new_state

    def view(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The page's data as `dtype` (its own by default); only while it rests on device or host."""
        if self.buffer is None or self.state.in_flight or self.state is PageState.DISK:
            raise PageStateError(f"page {self.name} has no readable buffer in state {self.state.name}")
        return self.buffer.view(dtype or self.dtype)

    def mark_dirty(self) -> None:
        """The working copy changed: any disk copy is now stale."""
        self.version += 1
        self.untouched = False


def _watched(name: str) -> property:
    """A Page attribute kept in `_<name>` whose every change is told to the page's watcher."""
    slot = f"_{name}"

    def set_(page: Page, value) -> None:
        page.__dict__[slot] = value
        watcher = page.__dict__.get("watcher")
        if watcher is not None:
            watcher(page)

    return property(operator.attrgetter(slot), set_)  # (a getter in C: read far more often than set)


Page.state = _watched("state")  # (after @dataclass: its __init__ sets them through the properties)
Page.pin_count = _watched("pin_count")
