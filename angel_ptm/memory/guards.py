"""Guards on pages, as the PageManager keeps them (mixed into it): an asynchronous checkpoint's copy-on-write.

`guard(pages, before_change)` asks to be told, once, at each page's next change that may precede a change of its
bytes: a pin (a write pins a page first), or a change of state (a move, drop or eviction changes a page's state
before its slot is reused). The page's slot still holds its bytes when `before_change(page)` runs, on the thread
making the change. A pin that only reads (`acquire(..., read_only=True)`: the binder's parameter views, released
clean) and an unpin tell no one: neither changes a byte.
"""

from __future__ import annotations

from typing import Callable, Iterable

from angel_ptm.memory.page import Page


class PageGuards:
    def guard(self, pages: Iterable[Page], before_change: Callable[[Page], None]) -> None:
        """before_change(page), once, at each page's next change of state or (writing) pins."""
        self._watch_new()  # every page's changes reach _reindex from now on
        self._guards.update((page.id, before_change) for page in pages)

    def unguard(self, page_ids: Iterable[int]) -> None:
        """(Any thread: the dict's pop is atomic.)"""
        for page_id in page_ids:
            self._guards.pop(page_id, None)

    def _tell_guard(self, page: Page) -> None:
        """(From _reindex: `page` changed state or pins.)"""
        if page.id != self._quiet:
            before_change = self._guards.pop(page.id, None)
            if before_change is not None:
                before_change(page)
