"""The page store: every page of a job by kind and index, and which rank owns each.

    store = PageStore.create(manager, layout, kinds, ownership, tiers)
    store["grad"][7]            # page 7 of the gradients (PageKind.GRAD == "grad")
    store.owner("param", 7)     # the data-parallel rank whose page it is
    store.local_count("exp_avg")

Page i of every kind covers the same elements (memory/layout.py). A page this rank owns is an ordinary page on its
tiers; under ZeRO-3 a parameter page another rank owns is a REMOTE page (filled while its group is gathered); an
optimizer-state page another rank owns does not exist here (None). parallel/ownership.py is the rule.
"""

from __future__ import annotations

import enum
from typing import Callable, Iterator, Mapping, Sequence

import torch

from angel_ptm.memory.layout import PageLayout
from angel_ptm.memory.manager import PageManager
from angel_ptm.memory.page import Page, Tier


class PageKind(str, enum.Enum):
    """What a page holds. A str enum: `PageKind.GRAD == "grad"`, and it is written as "grad" in traces and names."""

    PARAM = "param"
    GRAD = "grad"
    MASTER = "master"  # fp32 master weights (mixed precision, or optimizer.staleness 1)
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def optimizer_state(self) -> bool:
        """Read and written only by the optimizer (what ZeRO-1 shards)."""
        return self in (PageKind.MASTER, PageKind.EXP_AVG, PageKind.EXP_AVG_SQ)

    @property
    def checkpointed(self) -> bool:
        """Saved by a checkpoint: every kind but gradients (none is pending between steps)."""
        return self is not PageKind.GRAD


class PageStore(Mapping):
    def __init__(self, pages: dict[PageKind, list[Page | None]], home: Callable[[str, int], int]):
        self._pages = pages
        self._home = home

    @classmethod
    def create(cls, manager: PageManager, layout: PageLayout, kinds: Sequence[str], ownership,
               tiers: Iterator[Tier], dtype_of: Callable[[str, int], torch.dtype]) -> "PageStore":
        """Every page this rank holds, kind by kind in creation order, each on the tier `tiers` yields for it in
        turn (placement.start_tiers); created untouched: every write goes through acquire."""
        pages: dict[PageKind, list[Page | None]] = {}
        for kind in map(PageKind, kinds):
            pages[kind] = []
            for i in range(layout.kind_pages(kind)):
                if ownership.local(kind, i):
                    page = manager.create_page(kind, dtype_of(kind, i), index=i, tier=next(tiers), untouched=True)
                elif ownership.remote(kind, i):
                    page = manager.create_remote_page(kind, dtype_of(kind, i), i, ownership.home(i))
                else:
                    page = None
                pages[kind].append(page)
        return cls(pages, lambda kind, i: ownership.rank if ownership.local(kind, i) else ownership.home(i))

    def __getitem__(self, kind: str) -> list[Page | None]:
        return self._pages[PageKind(kind)]

    def __iter__(self):
        return iter(self._pages)

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, kind: object) -> bool:
        try:
            return PageKind(kind) in self._pages
        except ValueError:
            return False

    def owner(self, kind: str, index: int) -> int:
        """The rank that owns page `index` of `kind` (this rank for every page without data parallelism)."""
        return self._home(kind, index)

    def local(self, kind: str) -> list[Page]:
        """The pages of `kind` this rank holds as its own (not REMOTE copies, not another rank's)."""
        return [page for page in self[kind] if page is not None and page.home is None]

    def local_count(self, kind: str) -> int:
        return len(self.local(kind))
