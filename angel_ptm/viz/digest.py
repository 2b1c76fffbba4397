"""One pass over the trace: each event goes to the downsampled series the report draws, and to the Chrome-trace
writer when there is one. What is kept is bounded by the bin counts and caps, never by the trace's length (the
residency map keeps a few numbers per page, so it grows with the number of pages, not of events).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from angel_ptm.trace.recorder import END_MARK, START_MARK, TRUNCATED_MARK
from angel_ptm.viz.bins import Decimator, LaneActivity, MovedBytes, TierUsage, TimeAxis
from angel_ptm.viz.chrome import ChromeTraceWriter
from angel_ptm.viz.metrics import StepTableBuilder
from angel_ptm.viz.reader import PAGE_EVENTS, ReadIssues, is_number
from angel_ptm.viz.residency import PageResidency
from angel_ptm.viz.steptime import StepTime


@dataclass(frozen=True)
class DigestLimits:
    """How much of a trace the report keeps: bins of the charts and of the Chrome counters, rows, spans, marks."""

    time_bins: int = 512  # report charts; after the whole trace, between half and all of them are in use
    counter_bins: int = 4096  # usage and moved bytes, kept at the Chrome counters' resolution (the report merges)
    residency_rows: int = 256
    spans_per_lane: int = 2000  # exact Gantt spans per lane in the report, past which the lane is drawn binned
    steps: int = 2000  # step marks kept for the charts (every k-th)
    table_rows: int = 1000  # rows of the per-step table (every k-th step, and the last)
    marks: int = 200  # `mark` events listed in the report (the first ones)
    io_errors: int = 1000  # io_error events written to the Chrome trace (the first ones)
    union_spans: int = 4096  # disjoint spans per lane kept for the busy-time unions before the oldest are settled


class TraceDigest:
    def __init__(self, issues: ReadIssues, limits: DigestLimits = DigestLimits(),
                 chrome: Optional[ChromeTraceWriter] = None):
        self.issues = issues
        self.limits = limits
        self.chrome = chrome
        self.axis = TimeAxis(limits.time_bins)  # the residency map and the lanes
        self.lanes = LaneActivity(self.axis, max_spans=limits.spans_per_lane)
        self.step_time = StepTime(max_spans=limits.union_spans, max_lanes=self.lanes.max_lanes)
        self.residency = PageResidency(self.axis, max_rows=limits.residency_rows)
        self.fine_axis = TimeAxis(limits.counter_bins)  # usage and moved bytes: the report merges their bins
        self.usage = TierUsage(self.fine_axis)
        self.moved = MovedBytes(self.fine_axis)
        self.steps: Decimator[float] = Decimator(limits.steps)  # times of step events
        self.trace_steps = StepTableBuilder(limits.table_rows)  # the table of a run without metrics.jsonl
        self.marks: list[dict[str, Any]] = []
        self.truncated_at: float | None = None  # trace.max_bytes: when the recorder stopped writing page events
        self._cut = False  # the segment under way was truncated: its steps' summaries stand for its page events
        self.counts: Counter = Counter()  # event type -> events
        self.dropped = 0  # `drop` events: pages leaving a tier without a transfer (a clean copy is on disk)
        self.io_errors = 0
        self._finished = False

    @property
    def end(self) -> float:
        return self.axis.end

    def add(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        t = float(event["t"])
        self.counts[kind] += 1
        if kind in PAGE_EVENTS:
            self._page_event(kind, t, event)
        elif kind == "interval":
            self._interval(t, event)
        elif kind == "step":
            self._fit(t)
            self._step(t, event)
        else:  # mark
            self._fit(t)
            self._mark(t, event)

    def finish(self) -> "TraceDigest":
        if not self._finished:
            self._finished = True
            self.residency.finish(self.axis.end)
            self.step_time.finish()
            for tier in sorted(self.usage.ignored_tiers):
                self.issues.note(f"tier:{tier}", f"trace.jsonl: more than {self.usage.max_tiers} tiers in in_use; "
                                                 f"tier {tier!r} is not drawn")
            for lane in sorted(self.lanes.ignored_lanes):
                self.issues.note(f"lane:{lane}", f"trace.jsonl: more than {self.lanes.max_lanes} interval lanes; "
                                                 f"lane {lane!r} is not drawn")
            for tier in sorted(self.residency.unknown_tiers):
                self.issues.note(f"page-tier:{tier}", f"trace.jsonl: page events name an unknown tier {tier!r}; "
                                                      f"drawn as 'other' in the residency map")
        return self

    def _fit(self, t: float) -> None:
        self.axis.fit(t)
        self.fine_axis.fit(t)

    def _page_event(self, kind: str, t: float, event: dict[str, Any]) -> None:
        self._fit(t)
        in_use = event.get("in_use")
        if isinstance(in_use, dict):
            self.usage.record(t, in_use)
        page = event.get("page")
        if not isinstance(page, str):
            self.issues.note("page-missing", f"trace.jsonl: {kind} events without a page name; their moves are "
                                             f"counted but they are not in the residency map")
        src, dst = event.get("src"), event.get("dst")
        if isinstance(page, str):
            self.residency.record(t, kind, page, event.get("kind"), src, dst)
        if kind == "moved":
            nbytes = event.get("bytes")
            if not is_number(nbytes) or nbytes < 0:
                self.issues.note("bytes", "trace.jsonl: moved events without a byte count >= 0 count as 0 bytes")
                nbytes = 0
            pair = f"{src}->{dst}"
            if not self.moved.record(t, pair, nbytes):
                self.issues.note(f"pair:{pair}", f"trace.jsonl: more than {self.moved.max_pairs} tier pairs; "
                                                 f"moves {pair} are not drawn")
        elif kind == "drop":
            self.dropped += 1
        elif kind == "io_error":
            self.io_errors += 1
            if self.chrome is not None and self.io_errors <= self.limits.io_errors:
                args = {key: event.get(key) for key in ("page", "kind", "src", "dst", "bytes", "error")}
                self.chrome.instant(f"io_error {page}", t, args)

    def _interval(self, t: float, event: dict[str, Any]) -> None:
        duration = event.get("dur")
        if not is_number(duration) or duration < 0:
            self.issues.note("dur", "trace.jsonl: interval events without a duration >= 0 are drawn with duration 0")
            duration = 0.0
        lane = event.get("lane")
        lane = lane if isinstance(lane, str) and lane else "(no lane)"
        name = event.get("name")
        name = name if isinstance(name, str) else lane
        self._fit(t + duration)
        if self.lanes.record(lane, name, t, duration):
            self.step_time.interval(lane, t, t + duration)
        if self.chrome is not None:
            self.chrome.interval(lane, name, t, duration)

    def _step(self, t: float, event: dict[str, Any]) -> None:
        number = event.get("step")
        self.steps.add(t)
        if self._cut:  # past trace.max_bytes: the step's summary stands for its page events
            self._summary(t, event)
        step_s = event.get("step_s")
        if is_number(step_s) and step_s > 0:
            if self._cut:  # no intervals after the cut: no split of these steps
                self.step_time.cut_steps += 1
            else:
                self.step_time.step(t, step_s)
        fields = {k: v for k, v in event.items() if k not in ("t", "event")}
        self.trace_steps.add(fields)
        if self.chrome is not None:
            self.chrome.instant(f"step {number}", t, fields)

    def _summary(self, t: float, event: dict[str, Any]) -> None:
        """A truncated trace's summary (a step's, or the end's) in place of the page events it left out."""
        moved, in_use = event.get("moved"), event.get("in_use")
        if isinstance(moved, dict):
            for pair, nbytes in moved.items():
                if is_number(nbytes) and nbytes > 0:
                    self.moved.record(t, str(pair), nbytes)
        if isinstance(in_use, dict):
            self.usage.record(t, in_use)

    def _mark(self, t: float, event: dict[str, Any]) -> None:
        fields = {k: v for k, v in event.items() if k not in ("t", "event")}
        if fields.get("name") == END_MARK and self._cut:  # what followed the last step (an evaluation, a save)
            self._summary(t, event)
        if fields.get("name") == TRUNCATED_MARK:
            self._cut = True
            if self.truncated_at is None:
                self.truncated_at = t
        elif fields.get("name") == START_MARK:  # a resumed run's segment: its recorder writes every event again
            self._cut = False
        if len(self.marks) < self.limits.marks:
            self.marks.append({"t": t, **fields})
        if self.chrome is not None:
            name = fields.get("name")
            self.chrome.instant(f"mark {name}" if isinstance(name, str) else "mark", t, fields)
