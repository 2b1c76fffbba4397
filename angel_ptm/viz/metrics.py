"""The per-step table: metrics.jsonl read as a stream, whatever fields its lines carry.

A training line and the evaluation line logged at the same step become one row. Columns are the union of the
fields seen (known ones first: step, loss, val_loss, lr, step_s, stall_s, ...; new ones after, in order of first
appearance), so fields other code adds later (`stall_s`, `deviations`, ...) show up without a change here. At most
`max_rows` rows are kept (every k-th step, and always the last); the totals cover every line.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from angel_ptm.viz.bins import Decimator
from angel_ptm.viz.losscurve import LossCurve, LossSeries
from angel_ptm.viz.reader import is_number

PREFERRED_COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "step_s", "stall_s", "tokens_per_s", "moved",
                     "deviations", "in_use")
BYTE_DICT_COLUMNS = frozenset(("moved", "in_use"))  # dicts of bytes: shown with units, `moved` also summed
MAX_COLUMNS = 40


@dataclass
class StepTable:
    rows: list[dict[str, Any]] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    steps: int = 0  # training rows (with a loss) before decimation; rows of an evaluation alone are not steps
    covered_steps: int = 0  # the steps those rows cover (with trainer.log_every > 1 a line sums several steps')
    stride: int = 1  # every `stride`-th row is kept (plus the last)
    sums: Counter = field(default_factory=Counter)  # numeric column -> sum over every row
    counts: Counter = field(default_factory=Counter)  # numeric column -> rows that had it
    moved_total: Counter = field(default_factory=Counter)  # tier pair -> bytes, over every row
    source: str = ""  # where the rows came from, for the report's caption
    loss: LossSeries = field(default_factory=lambda: LossCurve().finish())  # every row's loss and val_loss

    def mean(self, column: str) -> Optional[float]:
        return self.sums[column] / self.counts[column] if self.counts[column] else None


class StepTableBuilder:
    def __init__(self, max_rows: int = 1000):
        self._kept: Decimator[dict[str, Any]] = Decimator(max_rows)
        self._pending: Optional[dict[str, Any]] = None
        self._columns: list[str] = []
        self._ignored_columns = 0
        self._table = StepTable()
        self._loss = LossCurve()
        self._steps = self._covered = 0
        self._last_step = 0

    def add(self, record: dict[str, Any]) -> None:
        """One metrics line (or a trace `step` event); lines without a numeric `step` are ignored."""
        step = record.get("step")
        if not is_number(step):
            return
        for key in record:
            if key not in self._columns:
                if len(self._columns) < MAX_COLUMNS:
                    self._columns.append(key)
                else:
                    self._ignored_columns += 1
        if self._pending is not None and self._pending.get("step") == step:
            pending = self._pending  # the evaluation line of the same step: its bytes moved add to the step's
            for key, value in record.items():
                if key == "moved" and isinstance(value, dict) and isinstance(pending.get(key), dict):
                    both = dict(pending[key])
                    for pair, nbytes in value.items():
                        if is_number(nbytes) and is_number(both.get(pair, 0)):
                            both[pair] = both.get(pair, 0) + nbytes
                    pending[key] = both
                else:
                    pending[key] = value
            return
        self._push()
        self._pending = dict(record)

    def finish(self, source: str) -> StepTable:
        self._push()
        table = self._table
        table.rows = self._kept.items()
        table.stride = self._kept.stride
        table.steps, table.covered_steps = self._steps, self._covered
        known = [c for c in PREFERRED_COLUMNS if c in self._columns]
        table.columns = known + [c for c in self._columns if c not in PREFERRED_COLUMNS]
        table.source = source
        table.loss = self._loss.finish()
        return table

    def _push(self) -> None:
        row = self._pending
        if row is None:
            return
        self._pending = None
        self._kept.add(row)
        if "loss" in row:
            self._steps += 1
            step = int(row["step"])
            self._covered += step - self._last_step if step > self._last_step else 1
            self._last_step = step
        self._loss.add(row)
        table = self._table
        for key, value in row.items():
            if is_number(value):
                table.sums[key] += value
                table.counts[key] += 1
        moved = row.get("moved")
        if isinstance(moved, dict):
            for pair, nbytes in moved.items():
                if is_number(nbytes):
                    table.moved_total[pair] += nbytes


@dataclass
class MetricsIssues:
    malformed: int = 0
    first_malformed_line: Optional[int] = None

    def warnings(self, source: str) -> list[str]:
        if not self.malformed:
            return []
        return [f"{source}: {self.malformed} malformed line(s) ignored, the first at line {self.first_malformed_line}"]


def read_metrics(path: Path, builder: StepTableBuilder, issues: MetricsIssues) -> None:
    """Feed each line of metrics.jsonl to `builder`, one at a time. OSError if the file cannot be read."""
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if raw.isspace():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                issues.malformed += 1
                if issues.first_malformed_line is None:
                    issues.first_malformed_line = number
                continue
            builder.add(record)
