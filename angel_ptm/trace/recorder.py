"""The memory-trace recorder: one JSON object per line in trace.jsonl.

Contract (ARCHITECTURE.md): every event has `t` (seconds since the recorder started) and `event`; page events add
`page`, `kind`, `src`, `dst`, `bytes` and `in_use` (bytes in use per tier after the event). Intervals (compute,
disk I/O, copies, communication) are `{"event": "interval", "lane", "name", "t", "dur"}`. Nothing in the runtime
reads the trace back, so recording is write-only and cheap: lines are buffered and written in batches.

The file is bounded (`max_bytes`, the config's trace.max_bytes). The event that would take it past the bound is
not written; a `mark` event named "trace truncated" is, once, and from then on page events and intervals are only
counted: each `step` event carries what its step left out (`left_out`: events per type, `moved`: bytes per tier
pair, `in_use`: the bytes per tier after the step's last page event). `mark` and `io_error` events, a few per run,
are still written whole. The first line is a `mark` named "trace start" whose `unix_s` is the wall-clock time of
t = 0 (`angel-ptm viz` lines the ranks' traces of a data-parallel run up by it).
"""

from __future__ import annotations

import json
import os
import time

EVENTS = ("alloc", "free", "move", "moved", "evict", "drop", "io_error", "interval", "step", "mark")
KEPT_WHEN_TRUNCATED = frozenset(("step", "mark", "io_error"))
TRUNCATED_MARK = "trace truncated"
START_MARK = "trace start"  # the first event of every trace: `unix_s`, the wall-clock time of its t = 0
END_MARK = "trace end"  # a truncated trace's last summary: what was left out after its last step event


class TraceRecorder:
    """Appends events to `path`; with `path=None` it records nothing (every method is a cheap no-op)."""

    def __init__(self, path: str | os.PathLike | None = None, flush_every: int = 512, max_bytes: int | None = None):
        self.path = os.fspath(path) if path is not None else None
        self.enabled = self.path is not None
        self._t0 = time.perf_counter()
        self._unix_t0 = time.time()
        self._lines: list[str] = []
        self._flush_every = flush_every
        self._file = open(self.path, "a", encoding="utf-8") if self.enabled else None
        self.counts: dict[str, int] = {}
        self.max_bytes = max_bytes  # None: no bound
        self.bytes = self._file.tell() if self._file is not None else 0  # in the file and buffered
        self._segment_start = self.bytes  # where this recorder's events begin in the file (earlier runs' before)
        self.truncated = False
        self._left_out = StepSummary()
        if self.enabled:  # where t = 0 is on the wall clock: `angel-ptm viz` lines up the ranks' traces by it
            self._append(json.dumps({"t": 0.0, "event": "mark", "name": START_MARK, "unix_s": round(self._unix_t0, 6)},
                                    separators=(",", ":")))

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def resumed_at(self, step: int) -> int:
        """This run resumed from a checkpoint of step `step`: the earlier runs' events after that step's (steps a
        run took past its last checkpoint, which this one takes again; metrics.jsonl drops their lines too) leave
        the file, so `angel-ptm viz` counts every step once. Kept: everything up to the start of step `step` + 1
        (the checkpoint's save and an evaluation at `step` included: `superseded_from`); then this recorder's
        events so far. Where
        no event of step `step` is found (another run's trace, or one cut already) the file is left as it is.
        Returns the bytes dropped."""
        if not self.enabled:
            return 0
        self.flush()
        cut = superseded_from(self.path, self._segment_start, step)
        if cut is None or cut >= self._segment_start:
            return 0
        with open(self.path, "r+b") as f:  # (the recorder's own handle appends: its writes go to the new end)
            f.seek(self._segment_start)
            ours = f.read()
            f.seek(cut)
            f.write(ours)
            f.truncate()
        dropped = self._segment_start - cut
        self.bytes -= dropped
        self._segment_start = cut
        return dropped

    def count(self, event: str) -> None:
        """Count `event` without recording it (what `event` does when the trace is off)."""
        self.counts[event] = self.counts.get(event, 0) + 1

    def event(self, event: str, *, page: str | None = None, kind: str | None = None, src: str | None = None,
              dst: str | None = None, nbytes: int = 0, in_use: dict | None = None, **extra) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1
        if not self.enabled:
            return
        record = {"t": round(self.now(), 6), "event": event}
        if page is not None:
            record.update(page=page, kind=kind, src=src, dst=dst, bytes=nbytes)
        if in_use is not None:
            record["in_use"] = in_use
        record.update(extra)
        self._write(record)

    def interval(self, lane: str, name: str, start: float, end: float, **extra) -> None:
        """A span of activity on `lane` ("compute", "disk", "copy", "comm"); times from `now()`."""
        if not self.enabled:
            return
        record = {"t": round(start, 6), "event": "interval", "lane": lane, "name": name, "dur": round(end - start, 6)}
        record.update(extra)
        self._write(record)

    def _write(self, record: dict) -> None:
        if not self.truncated:
            line = json.dumps(record, separators=(",", ":"))
            if self.max_bytes is None or self.bytes + len(line) + 1 <= self.max_bytes:
                self._append(line)
                return
            self.truncated = True
            self._append(json.dumps({"t": record["t"], "event": "mark", "name": TRUNCATED_MARK,
                                     "max_bytes": self.max_bytes}, separators=(",", ":")))
        if record["event"] not in KEPT_WHEN_TRUNCATED:
            self._left_out.add(record)
            return
        if record["event"] == "step":
            record.update(self._left_out.fields())
            self._left_out = StepSummary()
        self._append(json.dumps(record, separators=(",", ":")))

    def _append(self, line: str) -> None:
        self._lines.append(line)
        self.bytes += len(line) + 1  # json.dumps escapes to ASCII: one byte a character
        if len(self._lines) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if self._file is not None and self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines.clear()

    def close(self) -> None:
        if self.enabled and self.truncated and self._left_out.events:  # (a final evaluation, save or flush)
            self._append(json.dumps({"t": round(self.now(), 6), "event": "mark", "name": END_MARK,
                                     **self._left_out.fields()}, separators=(",", ":")))
            self._left_out = StepSummary()
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        self.enabled = False


class StepSummary:
    """What a step left out of a truncated trace: events per type, bytes moved per tier pair, the latest in_use."""

    def __init__(self) -> None:
        self.events: dict[str, int] = {}
        self.moved: dict[str, int] = {}
        self.in_use: dict | None = None

    def add(self, record: dict) -> None:
        event = record["event"]
        self.events[event] = self.events.get(event, 0) + 1
        if event == "moved":
            pair = f"{record.get('src')}->{record.get('dst')}"
            self.moved[pair] = self.moved.get(pair, 0) + int(record.get("bytes") or 0)
        if record.get("in_use") is not None:
            self.in_use = record["in_use"]

    def fields(self) -> dict:
        fields: dict = {"left_out": self.events, "moved": self.moved}
        if self.in_use is not None:
            fields["in_use"] = self.in_use
        return fields


def superseded_from(path: str | os.PathLike, end: int, step: int) -> int | None:
    """Where, in the first `end` bytes of trace file `path`, the events after step `step` begin (see
    `TraceRecorder.resumed_at`): after the last `step` event of that step, at the first line that starts step
    `step` + 1 (at or after its compute interval's start, on the same segment's clock), a later `step` event
    (a truncated trace's summaries) or a later segment -- else at the segment's end (a run that ended at that
    step: its evaluation and save stay); None when no such `step` event is there."""
    after = start_next = None
    same_segment = False  # whether the lines read since `after` are on its segment's clock
    with open(path, "rb") as f:
        at = 0
        for line in f:  # the last `step` event of `step`, and the start of the next step after it
            if at >= end:
                break
            at += len(line)
            if b'"event":"step"' in line and _field(line, "step") == step:
                after, start_next, same_segment = at, None, True
            elif START_MARK.encode() in line:
                same_segment = False
            elif same_segment and start_next is None and b'"lane":"compute"' in line and \
                    _field(line, "name") == f"step {step + 1}":
                t = _field(line, "t")
                start_next = t if isinstance(t, (int, float)) else None
        if after is None:
            return None
        f.seek(after)
        at = after
        for line in f:
            if at >= end or START_MARK.encode() in line or b'"event":"step"' in line:
                return at
            t = _field(line, "t") if start_next is not None else None
            if isinstance(t, (int, float)) and t >= start_next:
                return at
            at += len(line)
    return min(at, end)


def _field(line: bytes, key: str):
    try:
        record = json.loads(line)
    except ValueError:  # a line torn by a crash
        return None
    return record.get(key) if isinstance(record, dict) else None
