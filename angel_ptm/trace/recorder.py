"""The memory-trace recorder: one JSON object per line in trace.jsonl.

Contract (ARCHITECTURE.md): every event has `t` (seconds since the recorder started) and `event`; page events add
`page`, `kind`, `src`, `dst`, `bytes` and `in_use` (bytes in use per tier after the event). Intervals (compute,
disk I/O, copies, communication) are `{"event": "interval", "lane", "name", "t", "dur"}`. Nothing in the runtime
reads the trace back, so recording is write-only and cheap: lines are buffered and written in batches.
"""

from __future__ import annotations

import json
import os
import time

EVENTS = ("alloc", "free", "move", "moved", "evict", "drop", "io_error", "interval", "step", "mark")


class TraceRecorder:
    """Appends events to `path`; with `path=None` it records nothing (every method is a cheap no-op)."""

    def __init__(self, path: str | os.PathLike | None = None, flush_every: int = 512):
        self.path = os.fspath(path) if path is not None else None
        self.enabled = self.path is not None
        self._t0 = time.perf_counter()
        self._lines: list[str] = []
        self._flush_every = flush_every
        self._file = open(self.path, "a", encoding="utf-8") if self.enabled else None
        self.counts: dict[str, int] = {}

    def now(self) -> float:
        return time.perf_counter() - self._t0

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
        self._lines.append(json.dumps(record, separators=(",", ":")))
        if len(self._lines) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if self._file is not None and self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        self.enabled = False
