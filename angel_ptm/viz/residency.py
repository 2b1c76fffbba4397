"""Page residency over time: for each row of pages and each time bin, how long its pages sat on each tier.

A page's place follows its events: `alloc`, `moved` and `drop` put it on `dst`, `move` puts it in flight until
its `moved`, an `io_error` leaves it on `src` (the failed transfer changed nothing), `free` removes it, `evict`
only announces a move. Rows are pages of one kind with consecutive indices ("param:0" .. "param:7"); a row starts
as one page, and when there are more rows than `max_rows` every kind's rows merge in pairs (the group size
doubles), so the map stays a fixed size whatever the number of pages.
"""

from __future__ import annotations

import base64
from array import array
from dataclasses import dataclass
from typing import Optional

from angel_ptm.viz.bins import TimeAxis, merge_sums, zeros

CATEGORIES = ("device", "host", "disk", "moving", "other")
DEVICE, HOST, DISK, MOVING, OTHER = range(len(CATEGORIES))
ABSENT = -1
_TIER_CATEGORY = {"device": DEVICE, "host": HOST, "disk": DISK}
# the model states in the order a step touches them, then the activations saved for backward (activations.offload)
KIND_ORDER = ("param", "grad", "master", "exp_avg", "exp_avg_sq", "activation")


@dataclass(slots=True)
class PageTrack:
    """Where one page is now (a category or ABSENT) and since when."""

    kind: str
    index: int
    category: int = ABSENT
    since: float = 0.0


class PageResidency:
    def __init__(self, axis: TimeAxis, max_rows: int = 256):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.axis = axis
        self.max_rows = max_rows
        self.group = 1  # consecutive page indices per row
        self.unknown_tiers: set[str] = set()
        self._pages: dict[str, PageTrack] = {}
        self._rows: dict[tuple[str, int], list[array]] = {}  # (kind, index // group) -> seconds per category
        self._kinds: dict[str, int] = {}  # kind -> pages seen without a numeric index (next index to give)
        axis.register(self)

    @property
    def pages(self) -> int:
        return len(self._pages)

    def record(self, t: float, event: str, page: str, kind: Optional[str], src: Optional[str],
               dst: Optional[str]) -> None:
        track = self._pages.get(page)
        if track is None:
            track = self._pages[page] = self._new_track(page, kind)
        if event == "evict":
            return
        if event == "move":
            category = MOVING
        elif event == "free":
            category = ABSENT
        elif event == "io_error":
            category = self._category(src)
        else:  # alloc, moved, drop
            category = self._category(dst)
        if category != track.category:
            self._close(track, t)
            track.category = category
            track.since = max(t, track.since)

    def finish(self, t_end: float) -> None:
        """Count every page's time on its current tier up to `t_end` (the end of the trace)."""
        for track in self._pages.values():
            self._close(track, t_end)
            track.since = max(t_end, track.since)

    def merge_pairs(self) -> None:
        for key, seconds in self._rows.items():
            self._rows[key] = [merge_sums(values) for values in seconds]

    def _category(self, tier: Optional[str]) -> int:
        if tier == "remote":  # ZeRO-3: a copy of another rank's page dropped; its home is that rank's
            return ABSENT
        category = _TIER_CATEGORY.get(tier)  # type: ignore[arg-type]
        if category is None:
            self.unknown_tiers.add(str(tier))
            return OTHER
        return category

    def _new_track(self, page: str, kind: Optional[str]) -> PageTrack:
        prefix, _, suffix = page.rpartition(":")
        if not isinstance(kind, str) or not kind:
            kind = prefix or page
        if suffix.isdigit() and prefix:
            index = int(suffix)
        else:  # a name without ":<index>": number such pages of a kind in order of appearance
            index = self._kinds.get(kind, 0)
            self._kinds[kind] = index + 1
        return PageTrack(kind, index)

    def _close(self, track: PageTrack, t: float) -> None:
        if track.category == ABSENT or t <= track.since:
            return
        self.axis.spread(self._row(track)[track.category], track.since, t)
        track.since = t

    def _row(self, track: PageTrack) -> list[array]:
        key = (track.kind, track.index // self.group)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = [zeros(self.axis.bins) for _ in CATEGORIES]
            if len(self._rows) > self.max_rows:
                self._regroup()
                row = self._rows[(track.kind, track.index // self.group)]
        return row

    def _regroup(self) -> None:
        while len(self._rows) > self.max_rows:
            self.group *= 2
            merged: dict[tuple[str, int], list[array]] = {}
            for (kind, number), seconds in self._rows.items():
                key = (kind, number // 2)
                into = merged.get(key)
                if into is None:
                    merged[key] = seconds
                else:
                    for category, values in enumerate(seconds):
                        target = into[category]
                        for i, value in enumerate(values):
                            if value:
                                target[i] += value
            self._rows = merged

    def export(self) -> dict:
        """The map for the report: rows (label, kind, page count) and the cells as base64 bytes, five per cell
        (device, host, disk, moving, other), each the share of the row's page-time in that bin, 0..255."""
        pages_per_row: dict[tuple[str, int], int] = {}
        for track in self._pages.values():
            key = (track.kind, track.index // self.group)
            pages_per_row[key] = pages_per_row.get(key, 0) + 1
        # Rows that saw no time at all (pages that never left ABSENT) still get their row, empty.
        for key in pages_per_row:
            if key not in self._rows:
                self._rows[key] = [zeros(self.axis.bins) for _ in CATEGORIES]
        keys = sorted(self._rows, key=self._row_order)
        used, width = self.axis.used, self.axis.width
        last_bin_seconds = self.axis.end - (used - 1) * width  # the last bin is only partly inside the trace
        cells = bytearray(len(keys) * used * len(CATEGORIES))
        offset = 0
        for key in keys:
            seconds = self._rows[key]
            page_count = max(1, pages_per_row.get(key, 0))
            for i in range(used):
                span = width if i < used - 1 else max(last_bin_seconds, 1e-12)
                scale = 255.0 / (page_count * span)
                for category in range(len(CATEGORIES)):
                    cells[offset] = min(255, round(seconds[category][i] * scale))
                    offset += 1
        rows = [{"kind": kind, "label": self._label(kind, number), "pages": pages_per_row.get((kind, number), 0)}
                for kind, number in keys]
        return {
            "width": width, "bins": used, "group": self.group, "categories": list(CATEGORIES), "rows": rows,
            "cells": base64.b64encode(bytes(cells)).decode("ascii"), "pages": self.pages,
        }

    def _label(self, kind: str, number: int) -> str:
        if self.group == 1:
            return f"{kind}:{number}"
        first = number * self.group
        return f"{kind}:{first}-{first + self.group - 1}"

    def _row_order(self, key: tuple[str, int]) -> tuple[int, str, int]:
        kind, number = key
        rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
        return rank, kind, number
