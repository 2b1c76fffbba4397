"""The report of a data-parallel run: one report per rank's trace (trace.rank<R>.jsonl), and an index page that
shows them side by side with each rank's headline figures, so a slow or stalled rank stands out.

    result = build_rank_reports("runs/<run>")   # report.html (the index), report.rank<R>.html, trace.rank<R>.chrome.json
                                                # and trace.chrome.json: every rank a process, on one time axis
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from angel_ptm.errors import ReportWriteError, RunDirError
from angel_ptm.trace.recorder import START_MARK
from angel_ptm.viz.chrome import ChromeTraceStats, merge_rank_traces
from angel_ptm.viz.report import CHROME_FILE, REPORT_FILE, ReportResult, build_report

log = logging.getLogger("angel_ptm.viz")

RANK_TRACE = re.compile(r"^trace\.rank(\d+)\.jsonl$")


@dataclass(frozen=True)
class RankReports:
    html_path: Path  # the index
    ranks: tuple[ReportResult, ...]
    seconds: float
    chrome: ChromeTraceStats  # the ranks' traces merged: each rank a process
    warnings: tuple[str, ...] = ()

    @property
    def events(self) -> int:
        return sum(r.events for r in self.ranks)


def rank_traces(run_dir: str | os.PathLike) -> dict[int, str]:
    """rank -> trace file name of a data-parallel run directory (empty for a single-process run)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return {}
    found = {int(m.group(1)): name for name in os.listdir(run_dir) if (m := RANK_TRACE.match(name))}
    return dict(sorted(found.items()))


def build_rank_reports(run_dir: str | os.PathLike, output: Optional[str | os.PathLike] = None,
                       chrome_trace: Optional[str | os.PathLike] = None) -> RankReports:
    started = time.perf_counter()
    run_dir = Path(run_dir)
    traces = rank_traces(run_dir)
    if not traces:
        raise RunDirError(f"no trace.rank<R>.jsonl in {run_dir}")
    index = Path(output) if output is not None else run_dir / REPORT_FILE
    merged = Path(chrome_trace) if chrome_trace is not None else run_dir / CHROME_FILE
    # each rank's files beside the index and the merged trace (given paths move them out of the run directory)
    per_rank = ((lambda rank: run_dir / f"trace.rank{rank}.chrome.json") if chrome_trace is None
                else (lambda rank: merged.with_name(f"{merged.stem}.rank{rank}{merged.suffix}")))
    results = []
    for rank, name in traces.items():
        results.append(build_report(run_dir, index.with_name(f"{index.stem}.rank{rank}{index.suffix}"),
                                    per_rank(rank), trace_file=name, title=f" (rank {rank} of {len(traces)})",
                                    metrics_of_this_rank=rank == 0))
    starts = {rank: _start_time(run_dir / name) for rank, name in traces.items()}
    warnings = []
    if None in starts.values():
        warnings.append(f"{merged.name}: {', '.join(traces[r] for r, t in starts.items() if t is None)} "
                        f"lack(s) the '{START_MARK}' mark (a trace from before it was written): every rank is drawn "
                        f"from its own t = 0, not on one clock")
        starts = dict.fromkeys(starts, 0.0)
    base = min(starts.values())
    try:
        chrome = merge_rank_traces([(rank, r.chrome_path, starts[rank] - base) for rank, r in zip(traces, results)],
                                   merged)
    except OSError as err:
        raise ReportWriteError(f"cannot write {merged}: {err.strerror or err}") from None
    for warning in warnings:
        log.warning(warning)
    _write_index(index, run_dir, list(traces), results, chrome.path)
    return RankReports(index, tuple(results), time.perf_counter() - started, chrome, tuple(warnings))


def _start_time(trace: Path) -> float | None:
    """The wall-clock time of the trace's t = 0 (its first line, the recorder's start mark), None without one."""
    try:
        with open(trace, encoding="utf-8") as f:
            first = json.loads(f.readline() or "null")
    except (OSError, ValueError):
        return None
    if isinstance(first, dict) and first.get("name") == START_MARK and isinstance(first.get("unix_s"), (int, float)):
        return float(first["unix_s"])
    return None


def _write_index(path: Path, run_dir: Path, ranks: list[int], results: list[ReportResult], merged: Path) -> None:
    frames = "".join(
        f'<section><h2>rank {rank}</h2><p>{r.events:,} events, {len(r.warnings)} warning(s) · '
        f'<a href="{html.escape(r.html_path.name)}">open</a> · '
        f'<a href="{html.escape(r.chrome_path.name)}">Chrome trace</a></p>'
        f'<iframe src="{html.escape(r.html_path.name)}" title="rank {rank}"></iframe></section>'
        for rank, r in zip(ranks, results))
    page = (f"<!doctype html><meta charset=utf-8><title>angel-ptm report: {html.escape(run_dir.resolve().name)}"
            f" ({len(ranks)} ranks)</title><style>body{{font-family:system-ui,sans-serif;margin:1em}}"
            f".ranks{{display:grid;grid-template-columns:repeat({min(len(ranks), 4)},1fr);gap:1em}}"
            f"iframe{{width:100%;height:80vh;border:1px solid #ccc}}</style>"
            f"<h1>angel-ptm report: {html.escape(run_dir.resolve().name)}, {len(ranks)} data-parallel ranks</h1>"
            f"<p>Each rank's report, side by side (metrics.jsonl is rank 0's: losses are the mean over ranks). "
            f'Every rank\'s lanes on one time axis, a process per rank: <a href="{html.escape(merged.name)}">'
            f"{html.escape(merged.name)}</a> (open it in ui.perfetto.dev).</p>"
            f'<div class="ranks">{frames}</div>')
    path.write_text(page, encoding="utf-8")
