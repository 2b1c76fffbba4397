"""Pages whose home is another data-parallel rank (ZeRO-3), as the PageManager keeps them (mixed into it).

A remote page has no slot and no disk copy here (state REMOTE). Its holder (the ZeRO gatherer) takes slots for the
pages of a group before a collective fills them, pinned once for it, and gives them back afterwards; a copy that
leaves its tier otherwise is dropped, never written (PageManager._start_down).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from angel_ptm.errors import PageStateError
from angel_ptm.memory.page import RESTING_STATE, Page, PageState, Tier


class RemotePages:
    def create_remote_page(self, kind: str, dtype: torch.dtype, index: int, home: int) -> Page:
        """A page whose home is rank `home` (ZeRO): no slot and no disk copy here until its group is gathered."""
        page = Page(id=len(self.pages), kind=kind, index=index, dtype=dtype, nbytes=self.page_bytes,
                    state=PageState.REMOTE, home=home)
        self.pages.append(page)
        return page

    def hold_remote(self, pages: Sequence[Page], tier: Tier) -> list[torch.Tensor]:
        """Slots on `tier` for remote pages about to be filled by a collective (evicting others if the tier is
        full); each page is pinned once, for its holder, until `drop_remote`. Returns the slots, in order."""
        buffers = []
        for page in pages:
            if page.state is not PageState.REMOTE:
                raise ValueError(f"page {page.name} is {page.state.name}, not REMOTE: it is already held")
        self._check_fits(pages, tier)
        for page in pages:
            page.pin_count = 1
            self._pinned.add(page.id)
            try:
                page.buffer = self._alloc(tier)
            except Exception:
                page.pin_count = 0
                self._pinned.discard(page.id)
                raise
            page.transition(RESTING_STATE[tier])
            page.mark_dirty()
            self._emit("alloc", page, None, tier, src_rank=page.home)  # filled by a gather from its home
            buffers.append(page.buffer)
        return buffers

    def drop_remote(self, pages: Iterable[Page]) -> None:
        """Give up the copies `hold_remote` made: their slots are freed, the pages are REMOTE again."""
        for page in pages:
            if page.state is PageState.REMOTE:
                continue
            if page.pin_count != 1:
                raise PageStateError(f"page {page.name} is pinned {page.pin_count} times; only its holder may drop it")
            page.pin_count = 0
            self._pinned.discard(page.id)
            src = page.tier
            self.pools[src].free(page.buffer)
            page.buffer = None
            page.transition(PageState.REMOTE)
            self._emit("drop", page, src, "remote")
