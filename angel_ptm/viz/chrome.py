"""The Chrome trace-event JSON (chrome://tracing, Perfetto) of a run, and a validator for such files.

Layout: one process, "angel-ptm" (a data-parallel run's merged trace: one per rank, `merge_rank_traces`); thread 0 carries the step marks, trace marks and I/O errors as instant events,
and the per-tier bytes in use and the moved bytes per tier pair as counters (downsampled to fixed time bins);
every interval lane ("compute", "copy", "disk", "comm", ...) is a thread of its own, named by a thread_name
metadata event, holding its intervals as complete ("X") events. Times are microseconds from the trace's t = 0.

The writer streams: each interval is written when it is read, so the file is produced without keeping the trace
in memory. Past `max_intervals_per_lane` a lane's intervals that nearly touch (gap < `merge_gap_s`) are written
as one merged event with the count in its args, which bounds the file for very dense lanes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

PID = 1
MARKS_TID = 0
LANE_ORDER = ("compute", "copy", "disk", "comm")  # drawn first, in this order; other lanes follow as they appear
US = 1e6  # microseconds per second


@dataclass
class LaneTrack:
    """One lane's thread id and the state of its merging once it has passed the exact-interval cap."""

    tid: int
    written: int = 0  # intervals read (exactly written or merged)
    merged_events: int = 0
    pending: Optional[list] = None  # [start_s, end_s, count] of the merged span being extended


@dataclass
class ChromeTraceStats:
    path: Path
    events: int
    bytes: int
    merged_lanes: dict[str, int] = field(default_factory=dict)  # lane -> intervals folded into merged events


class ChromeTraceWriter:
    def __init__(self, path: str | os.PathLike, max_intervals_per_lane: int = 200_000, merge_gap_s: float = 1e-3):
        self.path = Path(path)
        self.max_intervals_per_lane = max_intervals_per_lane
        self.merge_gap_s = merge_gap_s
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._file: Optional[IO[str]] = open(self._tmp, "w", encoding="utf-8")  # OSError: the caller names it
        self._file.write('{"displayTimeUnit":"ms","traceEvents":[\n')
        self._events = 0
        self._lanes: dict[str, LaneTrack] = {}

    # ------------------------------------------------------------------ streamed while reading the trace
    def interval(self, lane: str, name: str, start: float, duration: float) -> None:
        track = self._lanes.get(lane)
        if track is None:
            track = self._lanes[lane] = LaneTrack(tid=len(self._lanes) + 1)
        track.written += 1
        if track.written <= self.max_intervals_per_lane:
            self._emit({"name": name, "cat": lane, "ph": "X", "ts": _us(start), "dur": _us(duration),
                        "pid": PID, "tid": track.tid})
            return
        end = start + duration
        span = track.pending
        if span is not None and span[0] <= start <= span[1] + self.merge_gap_s:
            span[1] = max(span[1], end)
            span[2] += 1
        else:
            self._flush_merged(lane, track)
            track.pending = [start, end, 1]

    def instant(self, name: str, t: float, args: dict[str, Any]) -> None:
        self._emit({"name": name, "cat": "mark", "ph": "i", "s": "g", "ts": _us(t), "pid": PID, "tid": MARKS_TID,
                    "args": _json_safe(args)})

    # ------------------------------------------------------------------ written at the end
    def close(self, span_s: tuple[float, float], usage: dict[str, list], moved: dict[str, list],
              bin_width_s: float) -> ChromeTraceStats:
        """Write the counters (per-tier bytes in use: `usage[tier]` is the highest value of each bin; moved bytes
        per second per tier pair), the metadata and the trace span, then move the file into place."""
        for lane, track in self._lanes.items():
            self._flush_merged(lane, track)
        self._counters("in_use bytes", usage, bin_width_s, scale=1.0)
        self._counters("moved bytes/s", moved, bin_width_s, scale=1.0 / bin_width_s)
        self._metadata()
        assert self._file is not None
        other = {"source": "angel-ptm viz", "span_us": [_us(span_s[0]), _us(span_s[1])],
                 "counter_bin_us": _us(bin_width_s)}
        self._file.write("\n],\"otherData\":" + json.dumps(other) + "}\n")
        self._file.close()
        self._file = None
        os.replace(self._tmp, self.path)
        merged = {lane: track.written - self.max_intervals_per_lane for lane, track in self._lanes.items()
                  if track.written > self.max_intervals_per_lane}
        return ChromeTraceStats(self.path, self._events, self.path.stat().st_size, merged)

    def abort(self) -> None:
        """Drop the partial file (an error stopped the report)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)

    def _flush_merged(self, lane: str, track: LaneTrack) -> None:
        span = track.pending
        if span is None:
            return
        start, end, count = span
        name = f"{lane} x{count}" if count > 1 else lane
        self._emit({"name": name, "cat": lane, "ph": "X", "ts": _us(start), "dur": _us(end - start), "pid": PID,
                    "tid": track.tid, "args": {"merged_intervals": count}})
        track.merged_events += 1
        track.pending = None

    def _counters(self, name: str, series: dict[str, list], bin_width_s: float, scale: float) -> None:
        """One counter event per bin whose values differ from the previous event's (a counter holds its value)."""
        if not series:
            return
        bins = max(len(values) for values in series.values())
        previous = None
        for i in range(bins):
            args = {}
            for key, values in series.items():
                value = values[i] if i < len(values) else None
                if value is not None:
                    args[key] = value if scale == 1.0 else round(value * scale, 3)
            if args and args != previous:
                self._emit({"name": name, "ph": "C", "ts": _us(i * bin_width_s), "pid": PID, "tid": MARKS_TID,
                            "args": args})
                previous = args

    def _metadata(self) -> None:
        self._emit({"name": "process_name", "ph": "M", "pid": PID, "tid": MARKS_TID, "args": {"name": "angel-ptm"}})
        self._emit({"name": "thread_name", "ph": "M", "pid": PID, "tid": MARKS_TID,
                    "args": {"name": "steps, marks, counters"}})
        self._emit({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": MARKS_TID,
                    "args": {"sort_index": 0}})
        for lane, track in self._lanes.items():
            rank = LANE_ORDER.index(lane) if lane in LANE_ORDER else len(LANE_ORDER) + track.tid
            self._emit({"name": "thread_name", "ph": "M", "pid": PID, "tid": track.tid, "args": {"name": lane}})
            self._emit({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": track.tid,
                        "args": {"sort_index": rank + 1}})

    def _emit(self, event: dict) -> None:
        assert self._file is not None, "the writer is closed"
        if self._events:
            self._file.write(",\n")
        self._file.write(json.dumps(event, separators=(",", ":")))
        self._events += 1


def merge_rank_traces(parts: list[tuple[int, Path, float]], path: str | os.PathLike) -> ChromeTraceStats:
    """One Chrome trace of a data-parallel run from its ranks' (written by ChromeTraceWriter): `parts` holds
    (rank, that rank's trace.chrome.json, seconds its t = 0 came after the earliest rank's). Each rank becomes a
    process of its own ("rank R", pid R + 1) with its lanes as threads, on one time axis, so Perfetto draws the
    ranks one above the other. Streamed: one event at a time."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    events = 0
    spans: list[float] = []
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write('{"displayTimeUnit":"ms","traceEvents":[\n')
            for rank, source, offset_s in parts:
                shift = _us(offset_s)
                with open(source, encoding="utf-8") as f:
                    for line in f:
                        line = line.rstrip().rstrip(",")
                        if not line.startswith('{"name"'):
                            if line.startswith('],"otherData"'):
                                span = json.loads("{" + line[2:]).get("otherData", {}).get("span_us") or [0, 0]
                                spans += [span[0] + shift, span[1] + shift]
                            continue
                        event = json.loads(line)
                        event["pid"] = rank + 1
                        if "ts" in event:
                            event["ts"] = round(event["ts"] + shift, 3)
                        if event.get("ph") == "i":
                            event["s"] = "p"  # a rank's step marks and trace marks span its own lanes only
                        if event["name"] == "process_name":
                            event["args"] = {"name": f"rank {rank}"}
                        out.write((",\n" if events else "") + json.dumps(event, separators=(",", ":")))
                        events += 1
                sort = {"name": "process_sort_index", "ph": "M", "pid": rank + 1, "tid": MARKS_TID,
                        "args": {"sort_index": rank}}
                out.write((",\n" if events else "") + json.dumps(sort, separators=(",", ":")))
                events += 1
            other = {"source": "angel-ptm viz", "ranks": [rank for rank, _, _ in parts],
                     "rank_offsets_us": [_us(offset_s) for _, _, offset_s in parts],
                     "span_us": [min(spans), max(spans)] if spans else [0, 0]}
            out.write("\n],\"otherData\":" + json.dumps(other) + "}\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ChromeTraceStats(path, events, path.stat().st_size)


def _us(seconds: float) -> float:
    return round(seconds * US, 3)


def _json_safe(args: dict[str, Any]) -> dict[str, Any]:
    """Args as JSON can hold them: NaN and infinities (which json.dumps would write as invalid JSON) become null."""
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return {str(key): clean(value) for key, value in args.items()}


# ---------------------------------------------------------------------------------------------------- validator
KNOWN_PHASES = frozenset("XBEiICM")
INSTANT_SCOPES = frozenset("gpt")
MAX_PROBLEMS = 50


def validate_chrome_trace(trace: Any) -> list[str]:
    """Problems that would make chrome://tracing or Perfetto misread `trace` (a parsed trace-event JSON: the
    object form with "traceEvents", or the bare array form); an empty list means it is valid.

    Checked: every event is an object with a known phase (X, B, E, i, I, C, M); name, ph, pid and tid on every
    event, a ts on every non-metadata event; numeric, finite, non-negative ts and dur; dur on X; numeric args
    on C; args.name on process_name/thread_name; a valid scope on instants; B/E pairs that match per thread; and,
    when otherData.span_us gives the trace span, every event inside it. Every thread with complete events must be
    named by a thread_name metadata event.
    """
    problems: list[str] = []

    def problem(where: str, text: str) -> None:
        problems.append(f"{where}: {text}")

    if isinstance(trace, dict):
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            return ["top level: traceEvents must be a list"]
        span = _span(trace.get("otherData"), problem)
    elif isinstance(trace, list):
        events, span = trace, None
    else:
        return [f"top level: expected an object or an array, got {type(trace).__name__}"]

    named_threads: set[tuple[Any, Any]] = set()
    timed_threads: set[tuple[Any, Any]] = set()
    open_begins: dict[tuple[Any, Any], int] = {}
    for n, event in enumerate(events):
        where = f"event {n}"
        if not isinstance(event, dict):
            problem(where, f"not an object ({type(event).__name__})")
            continue
        phase = event.get("ph")
        if phase not in KNOWN_PHASES:
            problem(where, f"unknown phase {phase!r}")
            continue
        where = f"event {n} ({phase} {event.get('name')!r})"
        required = ("name", "ph", "pid", "tid") + (() if phase == "M" else ("ts",))
        missing = [key for key in required if key not in event]
        if missing:
            problem(where, f"missing {', '.join(missing)}")
            continue
        if not isinstance(event["name"], str):
            problem(where, "name must be a string")
        for key in ("pid", "tid"):
            if isinstance(event[key], bool) or not isinstance(event[key], (int, str)):
                problem(where, f"{key} must be an integer or a string")
        thread = (event["pid"], event["tid"])
        if phase == "M":
            if event["name"] in ("process_name", "thread_name"):
                args = event.get("args")
                if not isinstance(args, dict) or not isinstance(args.get("name"), str):
                    problem(where, "args.name must be a string")
                elif event["name"] == "thread_name":
                    named_threads.add(thread)
            continue
        ts = event["ts"]
        if not _non_negative(ts):
            problem(where, f"ts must be a finite number >= 0, got {ts!r}")
            continue
        end = ts
        if phase == "X":
            dur = event.get("dur")
            if not _non_negative(dur):
                problem(where, f"dur must be a finite number >= 0, got {dur!r}")
                continue
            end = ts + dur
            timed_threads.add(thread)
        elif phase == "C":
            args = event.get("args")
            if not isinstance(args, dict) or not args:
                problem(where, "a counter needs a non-empty args object")
            elif not all(_number(value) for value in args.values()):
                problem(where, "counter args must all be finite numbers")
        elif phase in "iI":
            if "s" in event and event["s"] not in INSTANT_SCOPES:
                problem(where, f"instant scope must be one of g, p, t, got {event['s']!r}")
        elif phase == "B":
            open_begins[thread] = open_begins.get(thread, 0) + 1
        elif phase == "E":
            if open_begins.get(thread, 0) == 0:
                problem(where, f"E without a matching B on pid {thread[0]} tid {thread[1]}")
            else:
                open_begins[thread] -= 1
        if span is not None:
            start_us, end_us = span
            tolerance = 1.0  # one microsecond: the rounding of ts and dur
            if ts < start_us - tolerance or end > end_us + tolerance:
                problem(where, f"[{ts}, {end}] us lies outside the trace span [{start_us}, {end_us}] us")
        if len(problems) > MAX_PROBLEMS:
            break
    for thread, count in open_begins.items():
        if count:
            problems.append(f"pid {thread[0]} tid {thread[1]}: {count} B event(s) never ended")
    for thread in sorted(timed_threads - named_threads, key=str):
        problems.append(f"pid {thread[0]} tid {thread[1]}: complete events on a thread without a thread_name")
    if len(problems) > MAX_PROBLEMS:
        problems = problems[:MAX_PROBLEMS] + [f"... and more (stopped after {MAX_PROBLEMS})"]
    return problems


def _span(other: Any, problem) -> Optional[tuple[float, float]]:
    if not isinstance(other, dict) or "span_us" not in other:
        return None
    span = other["span_us"]
    if (not isinstance(span, list) or len(span) != 2 or not all(_non_negative(v) for v in span)
            or span[0] > span[1]):
        problem("otherData", f"span_us must be [start, end] with 0 <= start <= end, got {span!r}")
        return None
    return float(span[0]), float(span[1])


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _non_negative(value: Any) -> bool:
    return _number(value) and value >= 0
