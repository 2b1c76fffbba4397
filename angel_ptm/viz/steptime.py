"""Where step time went: the report's headline, measured on the trace's lanes inside the steps' windows.

A step's window is [t - step_s, t] of its `step` event. Inside the windows, the training thread's time splits into
  compute   the trainer's `compute` intervals (forward and backward), less the stalls inside them
  stalled   the scheduler's `stall` intervals: the training thread waiting for a page
  other     the rest: the optimizer update (its stalls excepted), gradient clipping, logging
and, overlapping those, the I/O lanes are busy: the time at least one `disk` (or `copy`) transfer was in flight.
That is the union of the lane's intervals, not their sum: the disk lane's transfers run on several I/O threads at
once, so their durations add up to more than the time the disk was busy.

Unions are kept as sorted, disjoint spans. The trace is read once, so the old spans are settled (measured and
dropped) as it goes: memory is bounded by the spans of about one step, not by the trace's length.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from angel_ptm.viz.metrics import StepTable

IO_LANES = {"disk": "disk I/O", "copy": "host<->device copies"}


class Coverage:
    """A union of intervals: sorted, disjoint spans; adding one merges every span it overlaps or touches."""

    __slots__ = ("starts", "ends")

    def __init__(self, starts: Optional[list[float]] = None, ends: Optional[list[float]] = None):
        self.starts = starts if starts is not None else []
        self.ends = ends if ends is not None else []

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, start: float, end: float) -> None:
        starts, ends = self.starts, self.ends
        if not starts or start > ends[-1]:  # the usual case: intervals arrive in about the order they end
            starts.append(start)
            ends.append(end)
            return
        first, stop = bisect_left(ends, start), bisect_right(starts, end)  # spans [first, stop) meet [start, end]
        if first < stop:
            start, end = min(start, starts[first]), max(end, ends[stop - 1])
        starts[first:stop] = [start]
        ends[first:stop] = [end]

    def cut(self, t: float) -> "Coverage":
        """Remove the part before `t` and return it."""
        whole = bisect_right(self.ends, t)
        before = Coverage(self.starts[:whole], self.ends[:whole])
        del self.starts[:whole], self.ends[:whole]
        if self.starts and self.starts[0] < t:
            before.starts.append(self.starts[0])
            before.ends.append(t)
            self.starts[0] = t
        return before

    def seconds(self) -> float:
        return math.fsum(end - start for start, end in zip(self.starts, self.ends))

    def intersect(self, other: "Coverage") -> "Coverage":
        out, i, j = Coverage(), 0, 0
        while i < len(self.starts) and j < len(other.starts):
            start, end = max(self.starts[i], other.starts[j]), min(self.ends[i], other.ends[j])
            if start < end:
                out.starts.append(start)
                out.ends.append(end)
            if self.ends[i] < other.ends[j]:
                i += 1
            else:
                j += 1
        return out


class StepTime:
    """The lanes' unions, over the whole trace and inside the step windows; fed by the digest, one event at a time."""

    def __init__(self, max_spans: int = 4096, max_lanes: int = 32):
        self.max_spans = max_spans
        self.max_lanes = max_lanes
        self.steps = 0  # step events with a step_s
        self.cut_steps = 0  # step events after the trace was truncated (trace.max_bytes): not in the split
        self.step_s = 0.0  # their step_s, summed
        self.union_s: Counter = Counter()  # lane -> seconds with at least one interval open
        self.in_steps_s: Counter = Counter()  # lane -> the same, inside the step windows
        self.stall_in_compute_s = 0.0  # stalls inside compute intervals, inside the step windows
        self._windows = Coverage()
        self._lanes: dict[str, Coverage] = {}
        self._settled_until = 0.0  # everything before this time is measured; later intervals are clipped to it
        self._last_step_end: Optional[float] = None

    def lanes(self) -> list[str]:
        return list(self._lanes)

    def interval(self, lane: str, start: float, end: float) -> None:
        start = max(start, self._settled_until)
        if end <= start:
            return
        spans = self._lanes.get(lane)
        if spans is None:
            if len(self._lanes) >= self.max_lanes:
                return
            spans = self._lanes[lane] = Coverage()
        spans.add(start, end)
        self._bound(spans)

    def step(self, t: float, step_s: float) -> None:
        self.steps += 1
        self.step_s += step_s
        self._last_step_end = t if self._last_step_end is None else max(self._last_step_end, t)
        start = max(t - step_s, self._settled_until)
        if t > start:
            self._windows.add(start, t)
            self._bound(self._windows)

    def finish(self) -> "StepTime":
        self._settle(math.inf)
        return self

    def _bound(self, spans: Coverage) -> None:
        """Settle the older half of a union grown past `max_spans`, but no later than the last step's end: a step's
        window arrives only when the step ends, and so does a compute interval (its start must not be clipped).
        Once the union is four times too large it is settled anyway, so memory stays bounded whatever the trace
        (a trace without step events; a step with more spans than that), at the cost of clipping an interval."""
        if len(spans) <= self.max_spans:
            return
        t = spans.starts[len(spans) // 2]
        if len(spans) <= 4 * self.max_spans:
            if self._last_step_end is None:
                return
            t = min(t, self._last_step_end)
        if t > self._settled_until:
            self._settle(t)

    def _settle(self, t: float) -> None:
        windows = self._windows.cut(t)
        parts = {lane: spans.cut(t) for lane, spans in self._lanes.items()}
        for lane, part in parts.items():
            self.union_s[lane] += part.seconds()
            self.in_steps_s[lane] += part.intersect(windows).seconds()
        if "stall" in parts and "compute" in parts:
            self.stall_in_compute_s += parts["stall"].intersect(parts["compute"]).intersect(windows).seconds()
        self._settled_until = t


@dataclass(frozen=True)
class TimeShare:
    name: str
    seconds: float
    share: float  # of the step time
    meaning: str


@dataclass(frozen=True)
class StepTimeSummary:
    steps: int
    step_s: float
    source: str  # where the step times come from
    parts: tuple[TimeShare, ...]  # compute, stalled, other: they add up to the step time
    io: tuple[TimeShare, ...]  # busy I/O lanes, overlapping the parts
    notes: tuple[str, ...]


def summarize(step_time: StepTime, table: StepTable) -> Optional[StepTimeSummary]:
    """The headline's numbers: the trace's step windows when it has step events with step_s, else the step table's
    step_s with the lanes measured over the whole trace. None without any step time."""
    notes = []
    if step_time.steps and step_time.step_s > 0:
        steps, total, source, lane_s = step_time.steps, step_time.step_s, "trace.jsonl step events", step_time.in_steps_s
        stall_in_compute = step_time.stall_in_compute_s
    elif step_time.cut_steps:  # every step ended past trace.max_bytes: no intervals to split them by
        return None
    elif table.counts["step_s"] and table.sums["step_s"] > 0:
        steps, total, source, lane_s = table.counts["step_s"], table.sums["step_s"], table.source, step_time.union_s
        stall_in_compute = 0.0
        notes.append("the trace has no step events with step_s: lanes are measured over the whole trace")
    else:
        return None

    def share(name: str, seconds: float, meaning: str) -> TimeShare:
        return TimeShare(name, seconds, seconds / total, meaning)

    lanes = step_time.lanes()
    parts = []
    if "stall" in lanes:
        stalled = lane_s["stall"]
        parts.append(share("stalled", stalled, "the training thread waiting for pages (the scheduler's stall "
                                               "intervals)"))
    elif table.counts["stall_s"] and table.sums["step_s"] > 0:
        # (a line's stall_s sums the steps since the line before, its step_s is its own step's)
        per_step = table.sums["stall_s"] / max(table.covered_steps, table.counts["stall_s"])
        stalled = total * per_step / (table.sums["step_s"] / table.counts["step_s"])
        parts.append(share("stalled", stalled, f"the training thread waiting for pages (stall_s of {table.source}, "
                                               f"as a share of its step_s)"))
    else:
        stalled, stall_in_compute = 0.0, 0.0
        notes.append("no stall times recorded (the scheduler records them; policy lru runs without one)")
    if "compute" in lanes:
        compute = max(0.0, lane_s["compute"] - stall_in_compute)
        parts.insert(0, share("compute", compute, "forward and backward (the compute intervals), less the stalls "
                                                  "inside them"))
    else:
        compute = 0.0
        notes.append("no compute intervals in the trace: compute is counted in 'other'")
    parts.append(share("other", max(0.0, total - compute - stalled),
                       "the rest: optimizer update, gradient clipping, logging"))
    io = tuple(share(f"{label} busy", lane_s[lane], f"at least one {lane} transfer in flight (the union of the "
                                                    f"{lane} lane's intervals, over all I/O threads); overlaps the "
                                                    f"parts above")
               for lane, label in IO_LANES.items() if lane in lanes)
    return StepTimeSummary(steps, total, source, tuple(parts), io, tuple(notes))
