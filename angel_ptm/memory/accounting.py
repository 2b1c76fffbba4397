"""What the PageManager counts and traces of its moves (mixed into it): bytes per tier pair, the watched (MoE
expert) pages' moves and wasted prefetches, and the trace's events and copy/disk lanes."""

from __future__ import annotations

from angel_ptm.memory.moves import Move
from angel_ptm.memory.page import Page, Tier

_UP = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}  # a move to a lower number goes up, toward compute


class MoveAccounting:
    def _moved(self, move: Move) -> None:
        pair = f"{move.src.value}->{move.dst.value}"
        self.bytes_moved[pair] += self.page_bytes
        if move.page.id in self.watched:
            self.watched_moved[pair] += self.page_bytes
            if _UP[move.dst] < _UP[move.src]:
                if move.page.pin_count == 0:  # ahead of an access (an on-demand one pins first)
                    self._fetched_unused[move.page.id] = self._fetched_unused.get(move.page.id, 0) + self.page_bytes
            else:
                self.watched_wasted += self._fetched_unused.pop(move.page.id, 0)
        self._emit("moved", move.page, move.src, move.dst)
        if self.trace.enabled:  # the span from issue to settling, on the lane of the queue that carried it
            lane = "disk" if Tier.DISK in (move.src, move.dst) else "copy"
            self.trace.interval(lane, f"{move.page.name} {move.src.value}->{move.dst.value}", move.started,
                                self.trace.now(), bytes=self.page_bytes)

    def in_use(self) -> dict[str, int]:
        return {"device": self.pools[Tier.DEVICE].used_bytes, "host": self.pools[Tier.HOST].used_bytes,
                "disk": self.disk.used_bytes if self.disk else 0}

    def _emit(self, event: str, page: Page, src: Tier | None, dst: Tier | str | None, **extra) -> None:
        if not self.trace.enabled:  # counted only: no page name to format on every move
            self.trace.count(event)
            return
        self.trace.event(event, page=page.name, kind=page.kind, src=src.value if src else None,
                         dst=dst.value if isinstance(dst, Tier) else dst, nbytes=page.nbytes,
                         in_use=self.in_use(), **extra)
