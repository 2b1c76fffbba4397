"""Fixed-size time series for a trace of unknown length: bins whose width doubles as the trace grows.

A `TimeAxis` has a fixed number of bins starting at t = 0. When an event falls past the last bin, the width doubles
and every series on the axis merges its bins in pairs, so memory never grows with the trace, and after the whole
trace is read at least half the bins are in use. Each series says how two neighbouring bins merge (a sum, a
min/max, the later value).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from typing import Generic, Optional, Protocol, TypeVar

T = TypeVar("T")
TIERS = ("device", "host", "disk")  # the contract's tiers, drawn in this order; others follow as they appear


class Binned(Protocol):
    def merge_pairs(self) -> None:
        """Bin i becomes the merge of bins 2i and 2i+1; the second half of the bins becomes empty."""


class TimeAxis:
    def __init__(self, bins: int = 512, width: float = 1e-3):
        if bins < 2 or bins % 2:
            raise ValueError(f"bins must be an even number >= 2, got {bins}")
        if not width > 0:
            raise ValueError(f"width must be > 0, got {width}")
        self.bins = bins
        self.width = width
        self.end = 0.0  # the latest time fitted so far
        self._series: list[Binned] = []

    def register(self, series: Binned) -> None:
        self._series.append(series)

    def fit(self, t: float) -> None:
        """Make room for time `t`, doubling the width (and merging every series) as often as needed."""
        if t > self.end:
            self.end = t
            while t >= self.width * self.bins:
                self.width *= 2.0
                for series in self._series:
                    series.merge_pairs()

    def index(self, t: float) -> int:
        i = int(t / self.width)
        return i if i < self.bins else self.bins - 1

    @property
    def used(self) -> int:
        """Bins that cover [0, end]: the ones a report draws."""
        return min(self.bins, int(self.end / self.width) + 1)

    def spread(self, values: array, start: float, end: float) -> None:
        """Add to each bin of `values` the seconds of [start, end) that fall inside it."""
        width = self.width
        first, last = self.index(start), self.index(end)
        if first == last:
            values[first] += end - start
            return
        values[first] += (first + 1) * width - start
        for k in range(first + 1, last):
            values[k] += width
        values[last] += end - last * width


def zeros(n: int) -> array:
    return array("d", bytes(8 * n))


def merge_sums(values: array) -> array:
    n = len(values)
    merged = array("d", (values[2 * i] + values[2 * i + 1] for i in range(n // 2)))
    merged.extend(zeros(n - n // 2))
    return merged


class Decimator(Generic[T]):
    """Keeps every `stride`-th item of a stream, at most `capacity` of them: when full it drops every other kept
    item and doubles the stride. The latest item is always kept as well, so a table ends at the last step."""

    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2, got {capacity}")
        self.capacity = capacity
        self.stride = 1
        self.seen = 0
        self._items: list[T] = []
        self._latest: Optional[T] = None
        self._latest_kept = False

    def add(self, item: T) -> None:
        self._latest_kept = self.seen % self.stride == 0
        if self._latest_kept:
            self._items.append(item)
            if len(self._items) > self.capacity:
                self._items = self._items[::2]
                self.stride *= 2
                self._latest_kept = self.seen % self.stride == 0
        self._latest = item
        self.seen += 1

    def items(self) -> list[T]:
        if self.seen and not self._latest_kept:
            return self._items + [self._latest]
        return list(self._items)


class TierUsage:
    """Bytes in use per tier over time: for each bin the lowest, the highest and the last value seen."""

    def __init__(self, axis: TimeAxis, max_tiers: int = 8):
        self.axis = axis
        self.max_tiers = max_tiers
        self.peak: dict[str, float] = {}
        self.ignored_tiers: set[str] = set()
        self._bins: dict[str, tuple[list, list, list]] = {}  # tier -> (lowest, highest, last); None: no value
        axis.register(self)

    def record(self, t: float, in_use: dict) -> None:
        i = self.axis.index(t)
        all_bins, peak = self._bins, self.peak
        for tier, value in in_use.items():
            kind = type(value)  # the hot path of the whole report: exact type checks, not isinstance
            if kind is not int and (kind is not float or not math.isfinite(value)):
                continue
            bins = all_bins.get(tier)
            if bins is None:
                bins = self._add_tier(tier)
                if bins is None:
                    continue
            lowest, highest, last = bins
            if last[i] is None:
                lowest[i] = highest[i] = value
            elif value < lowest[i]:
                lowest[i] = value
            elif value > highest[i]:
                highest[i] = value
            last[i] = value
            if value > peak[tier]:
                peak[tier] = value

    def _add_tier(self, tier: str) -> Optional[tuple[list, list, list]]:
        if len(self._bins) >= self.max_tiers or not isinstance(tier, str):
            self.ignored_tiers.add(str(tier))
            return None
        n = self.axis.bins
        self._bins[tier] = ([None] * n, [None] * n, [None] * n)
        self.peak[tier] = 0
        return self._bins[tier]

    def merge_pairs(self) -> None:
        for tier, (lowest, highest, last) in self._bins.items():
            n = len(last)
            new_low, new_high, new_last = [None] * n, [None] * n, [None] * n
            for i in range(n // 2):
                a, b = 2 * i, 2 * i + 1
                new_low[i] = _pick(min, lowest[a], lowest[b])
                new_high[i] = _pick(max, highest[a], highest[b])
                new_last[i] = last[b] if last[b] is not None else last[a]
            self._bins[tier] = (new_low, new_high, new_last)

    def tiers(self) -> list[str]:
        return [t for t in TIERS if t in self._bins] + [t for t in self._bins if t not in TIERS]

    def series(self, tier: str, max_bins: Optional[int] = None) -> tuple[float, list, list, list]:
        """(bin width, lowest, highest, last) over the used bins, merged in pairs until at most `max_bins`.

        A bin without events holds the previous bin's last value (usage does not change between events); bins
        before the tier's first event are None."""
        lowest, highest, last = self._bins[tier]
        used = self.axis.used
        out_low, out_high, out_last = [None] * used, [None] * used, [None] * used
        carried = None
        for i in range(used):
            if last[i] is None:
                out_low[i] = out_high[i] = out_last[i] = carried
            else:
                # The bin also held the previous value until its first event, which the extremes must include.
                out_low[i] = lowest[i] if carried is None else min(lowest[i], carried)
                out_high[i] = highest[i] if carried is None else max(highest[i], carried)
                out_last[i] = carried = last[i]
        width = self.axis.width
        while max_bins is not None and len(out_last) > max_bins:
            pairs = range(0, len(out_last), 2)
            out_low = [_pick(min, out_low[k], out_low[k + 1] if k + 1 < len(out_low) else None) for k in pairs]
            out_high = [_pick(max, out_high[k], out_high[k + 1] if k + 1 < len(out_high) else None) for k in pairs]
            out_last = [out_last[k + 1] if k + 1 < len(out_last) else out_last[k] for k in pairs]
            width *= 2
        return width, out_low, out_high, out_last


def _pick(choose, a, b):
    if a is None:
        return b
    if b is None:
        return a
    return choose(a, b)


class MovedBytes:
    """Bytes moved per tier pair ("host->device") per bin, and in total."""

    def __init__(self, axis: TimeAxis, max_pairs: int = 32):
        self.axis = axis
        self.max_pairs = max_pairs
        self.total: Counter = Counter()
        self.moves: Counter = Counter()
        self._bins: dict[str, array] = {}
        axis.register(self)

    def record(self, t: float, pair: str, nbytes: float) -> bool:
        """False if the pair was not recorded (too many distinct pairs)."""
        bins = self._bins.get(pair)
        if bins is None:
            if len(self._bins) >= self.max_pairs:
                return False
            bins = self._bins[pair] = zeros(self.axis.bins)
        bins[self.axis.index(t)] += nbytes
        self.total[pair] += nbytes
        self.moves[pair] += 1
        return True

    def merge_pairs(self) -> None:
        for pair, bins in self._bins.items():
            self._bins[pair] = merge_sums(bins)

    def pairs(self) -> list[str]:
        return sorted(self._bins, key=lambda pair: -self.total[pair])

    def series(self, pair: str, max_bins: Optional[int] = None) -> tuple[float, list[float]]:
        """(bin width, bytes per bin) over the used bins, merged in pairs until at most `max_bins`."""
        values, width = list(self._bins[pair][: self.axis.used]), self.axis.width
        while max_bins is not None and len(values) > max_bins:
            values = [sum(values[k:k + 2]) for k in range(0, len(values), 2)]
            width *= 2
        return width, values


class LaneActivity:
    """Intervals per lane ("compute", "disk", "copy", "comm", any other): the busy seconds in each bin, and the
    exact spans too while a lane has at most `max_spans` of them (past that the lane is drawn from its bins)."""

    def __init__(self, axis: TimeAxis, max_spans: int = 2000, max_lanes: int = 32):
        self.axis = axis
        self.max_spans = max_spans
        self.max_lanes = max_lanes
        self.count: Counter = Counter()
        self.busy_total: Counter = Counter()
        self.ignored_lanes: set[str] = set()
        self._busy: dict[str, array] = {}
        self._spans: dict[str, Optional[list[tuple[float, float, str]]]] = {}  # None: over max_spans
        axis.register(self)

    def record(self, lane: str, name: str, start: float, duration: float) -> bool:
        """False if the lane was not recorded (too many distinct lanes)."""
        busy = self._busy.get(lane)
        if busy is None:
            if len(self._busy) >= self.max_lanes:
                self.ignored_lanes.add(lane)
                return False
            busy = self._busy[lane] = zeros(self.axis.bins)
            self._spans[lane] = []
        self.axis.spread(busy, start, start + duration)
        self.count[lane] += 1
        self.busy_total[lane] += duration
        spans = self._spans[lane]
        if spans is not None:
            if len(spans) < self.max_spans:
                spans.append((start, duration, name))
            else:
                self._spans[lane] = None  # the lane is too dense for single spans; its bins tell the story
        return True

    def merge_pairs(self) -> None:
        for lane, busy in self._busy.items():
            self._busy[lane] = merge_sums(busy)

    def lanes(self) -> list[str]:
        return list(self._busy)

    def spans(self, lane: str) -> Optional[list[tuple[float, float, str]]]:
        return self._spans[lane]

    def busy(self, lane: str) -> list[float]:
        return list(self._busy[lane][: self.axis.used])
