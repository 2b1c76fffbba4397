"""Read trace.jsonl as a stream: one line at a time, so a trace of any size costs the memory of one event.

Bad input is counted, not fatal: a malformed line (a crash cuts the last line short; a disk error can garble one
in the middle), a JSON value that is not an event, and an event type this version does not know are skipped and
reported through `ReadIssues`, which turns each kind of problem into one warning line for the log and the report.

A resumed run appends to its trace (dropping first the earlier run's events of the steps it takes again:
TraceRecorder.resumed_at): each segment starts with the recorder's "trace start" mark, its `t` counted from that
segment's start. The reader puts every segment on the first one's clock (its `unix_s` after the first's;
never before the events already read), so a run and its resumptions read as one timeline.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from angel_ptm.trace.recorder import EVENTS, START_MARK

KNOWN_EVENTS = frozenset(EVENTS)
PAGE_EVENTS = frozenset(("alloc", "free", "move", "moved", "evict", "drop", "io_error"))
MAX_UNKNOWN_NAMES = 20


@dataclass
class ReadIssues:
    """Problems met while reading, counted by kind; `warnings()` phrases them, one line each."""

    lines: int = 0  # lines read, blank ones included
    events: int = 0  # valid events of a known type, handed on
    malformed: int = 0  # lines that are not JSON (the truncated last line is counted apart)
    first_malformed_line: int | None = None
    truncated_last_line: int | None = None  # its line number, when the file ends in a partial line
    invalid: int = 0  # JSON lines that are not an event object with a numeric `t` >= 0 and a string `event`
    first_invalid_line: int | None = None
    unknown: Counter = field(default_factory=Counter)  # event type -> lines skipped
    segments: int = 0  # "trace start" marks read: 1 for a run, 1 more per resumption appended to its trace
    notes: list[str] = field(default_factory=list)  # problems found by the consumers (see `note`)
    _noted: set = field(default_factory=set, repr=False)

    def note(self, key: str, message: str) -> None:
        """Record a consumer's warning once per `key` (e.g. once per unknown tier name, not once per event)."""
        if key not in self._noted:
            self._noted.add(key)
            self.notes.append(message)

    def warnings(self, source: str = "trace.jsonl") -> list[str]:
        found = []
        if self.truncated_last_line is not None:
            found.append(f"{source}: the last line ({self.truncated_last_line}) is cut short (the run may have "
                         f"crashed or still be running); it was ignored")
        if self.malformed:
            found.append(f"{source}: {self.malformed} malformed line(s) ignored, the first at line "
                         f"{self.first_malformed_line}")
        if self.invalid:
            found.append(f"{source}: {self.invalid} line(s) are not events (need a number t >= 0 and a string "
                         f"event), the first at line {self.first_invalid_line}; ignored")
        for name, count in sorted(self.unknown.items()):
            found.append(f"{source}: {count} event(s) of unknown type {name!r} ignored")
        return found + self.notes


def iter_events(path: str | Path, issues: ReadIssues) -> Iterator[dict[str, Any]]:
    """Yield each valid event of a known type from the trace at `path`, in file order; count the rest in `issues`.

    Raises OSError if the file cannot be opened or read (the caller names the path in its own error).
    """
    pending_bad: tuple[int, bool] | None = None  # (line number, ended with a newline) of the latest bad line
    decode = json.JSONDecoder().decode  # on str: skips json.loads' per-call encoding detection
    origin: float | None = None  # unix_s of the first segment's t = 0
    shift = 0.0  # added to the t of this segment's events
    last = 0.0  # the latest t handed on
    # Invalid UTF-8 becomes U+FFFD instead of an exception: one bad byte in a page name must not lose the line.
    with open(path, encoding="utf-8", errors="replace", newline="\n") as lines:
        for number, raw in enumerate(lines, start=1):
            issues.lines = number
            if pending_bad is not None:  # a bad line followed by another line was not the truncated end
                _count_malformed(issues, pending_bad[0])
                pending_bad = None
            if raw.isspace():
                continue
            try:
                record = decode(raw)
            except ValueError:
                pending_bad = (number, raw.endswith("\n"))
                continue
            if not _is_event(record):
                issues.invalid += 1
                if issues.first_invalid_line is None:
                    issues.first_invalid_line = number
                continue
            if record["event"] not in KNOWN_EVENTS:
                name = record["event"]
                if name not in issues.unknown and len(issues.unknown) >= MAX_UNKNOWN_NAMES:
                    name = "(other names)"  # bounded: a file of random names must not grow the counter
                issues.unknown[name] += 1
                continue
            if record["event"] == "mark" and record.get("name") == START_MARK:
                issues.segments += 1
                unix_s = record.get("unix_s")
                if isinstance(unix_s, (int, float)) and math.isfinite(unix_s):
                    if origin is None:
                        origin = float(unix_s)
                    else:
                        shift = max(float(unix_s) - origin, last)
                elif origin is not None:
                    shift = last
            if shift:
                record["t"] = record["t"] + shift
            dur = record.get("dur")
            last = max(last, record["t"] + (dur if is_number(dur) and dur > 0 else 0.0))
            issues.events += 1
            yield record
    if pending_bad is not None:
        number, ended = pending_bad
        if ended:
            _count_malformed(issues, number)
        else:
            issues.truncated_last_line = number


def _count_malformed(issues: ReadIssues, number: int) -> None:
    issues.malformed += 1
    if issues.first_malformed_line is None:
        issues.first_malformed_line = number


def _is_event(record: Any) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        return False
    t = record.get("t")
    return is_number(t) and t >= 0


def is_number(value: Any) -> bool:
    """A finite int or float (bool is an int subclass, never a measurement)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value)
