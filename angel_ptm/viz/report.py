"""`build_report(run_dir)`: read a run's trace once, as a stream, and write the HTML report and the Chrome trace.

    result = build_report("runs/20250101-120000")   # -> report.html and trace.chrome.json in the run dir

A run directory without trace.jsonl is an error (RunDirError); so is a trace with no readable line at all
(TraceFormatError). Everything short of that (a truncated last line, unknown event types, a missing or damaged
metrics.jsonl) still gives a report: each problem is logged as a warning and listed at the top of the report.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from angel_ptm.config.sizes import format_bytes
from angel_ptm.errors import ReportWriteError, RunDirError, TraceFormatError
from angel_ptm.viz.chrome import ChromeTraceWriter
from angel_ptm.viz.digest import DigestLimits, TraceDigest
from angel_ptm.viz.html import chart_data, render_report
from angel_ptm.viz.metrics import MetricsIssues, StepTable, StepTableBuilder, read_metrics
from angel_ptm.viz.reader import ReadIssues, iter_events
from angel_ptm.viz.steptime import summarize

log = logging.getLogger("angel_ptm.viz")
TRACE_FILE = "trace.jsonl"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
REPORT_FILE = "report.html"
CHROME_FILE = "trace.chrome.json"


@dataclass(frozen=True)
class ReportResult:
    html_path: Path
    chrome_path: Path
    html_bytes: int
    chrome_bytes: int
    chrome_events: int
    trace_bytes: int
    events: int  # valid events read from the trace
    seconds: float
    warnings: tuple[str, ...]


def build_report(run_dir: str | os.PathLike, output: Optional[str | os.PathLike] = None,
                 chrome_trace: Optional[str | os.PathLike] = None,
                 limits: DigestLimits = DigestLimits(), trace_file: str = TRACE_FILE,
                 title: str = "", metrics_of_this_rank: bool = True) -> ReportResult:
    """The report of one trace of `run_dir` (`trace_file`: trace.jsonl, or one rank's trace.rank<R>.jsonl).
    `metrics_of_this_rank` False: metrics.jsonl (rank 0's) is not this trace's rank's, whose steps then come from
    its own trace."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    trace_path = _trace_path(run_dir, trace_file)
    html_path = Path(output) if output is not None else run_dir / REPORT_FILE
    chrome_path = Path(chrome_trace) if chrome_trace is not None else run_dir / CHROME_FILE
    for path in (html_path, chrome_path):
        _check_writable(path)

    issues = ReadIssues()
    chrome = _open_chrome(chrome_path)
    try:
        digest = TraceDigest(issues, limits, chrome)
        try:
            for event in iter_events(trace_path, issues):
                digest.add(event)
        except OSError as err:
            raise RunDirError(f"cannot read {trace_path}: {err.strerror or err}") from None
        if issues.events == 0 and (issues.malformed or issues.invalid or issues.truncated_last_line):
            raise TraceFormatError(
                f"{trace_path}: no readable event in {issues.lines} line(s) "
                f"({issues.malformed + (issues.truncated_last_line is not None)} malformed, {issues.invalid} not "
                f"events); is it a trace.jsonl written by angel-ptm?"
            )
        digest.finish()
        try:
            stats = chrome.close((0.0, digest.end), *_counter_series(digest), digest.fine_axis.width)
        except OSError as err:
            raise ReportWriteError(f"cannot write {chrome_path}: {err.strerror or err}") from None
    except BaseException:
        chrome.abort()
        raise

    warnings = issues.warnings(trace_file)
    if digest.truncated_at is not None:
        warnings.append(f"{trace_file}: truncated at trace.max_bytes {digest.truncated_at:.1f} s into the run: page "
                        f"events and intervals after that are not in it, so the lanes, the residency map and the "
                        f"step-time split cover the steps before it only; after it the bytes moved and in use are "
                        f"each step's summary, one point per step ({METRICS_FILE} has every step's)")
    if issues.lines == 0:
        warnings.append(f"{trace_file} is empty: the run wrote no events (it may have stopped before its first step)")
    for lane, count in stats.merged_lanes.items():
        warnings.append(f"{chrome_path.name}: lane {lane!r} has more than {chrome.max_intervals_per_lane:,} "
                        f"intervals; {count:,} later ones are merged where they nearly touch")
    table = _step_table(run_dir, digest, limits, warnings, metrics_of_this_rank, trace_file)
    trace_bytes = trace_path.stat().st_size
    meta = {"run_dir": str(run_dir), "t_end": digest.end, "dropped": digest.dropped, "events": issues.events}
    data = chart_data(digest, _budgets(run_dir, warnings), meta)
    data["loss"] = table.loss.export()
    for warning in warnings:
        log.warning(warning)
    page = render_report(f"angel-ptm report: {run_dir.resolve().name}{title}", data,
                         _facts(run_dir, trace_bytes, issues, digest, stats.path), warnings, table, digest.marks,
                         summarize(digest.step_time, table))
    _write_text(html_path, page)
    return ReportResult(
        html_path=html_path, chrome_path=stats.path, html_bytes=html_path.stat().st_size, chrome_bytes=stats.bytes,
        chrome_events=stats.events, trace_bytes=trace_bytes, events=issues.events,
        seconds=time.perf_counter() - started, warnings=tuple(warnings),
    )


def _trace_path(run_dir: Path, trace_file: str = TRACE_FILE) -> Path:
    if not run_dir.exists():
        raise RunDirError(f"run directory not found: {run_dir}")
    if not run_dir.is_dir():
        raise RunDirError(f"not a run directory (not a directory): {run_dir}")
    trace_path = run_dir / trace_file
    if not trace_path.is_file():
        raise RunDirError(f"no {trace_file} in run directory {run_dir} (angel-ptm train writes one into each run "
                          f"directory)")
    return trace_path


def _check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ReportWriteError(f"cannot write {path}: directory {parent} does not exist")
    if path.is_dir():
        raise ReportWriteError(f"cannot write {path}: it is a directory")


def _open_chrome(path: Path) -> ChromeTraceWriter:
    try:
        return ChromeTraceWriter(path)
    except OSError as err:
        raise ReportWriteError(f"cannot write {path}: {err.strerror or err}") from None


def _write_text(path: Path, text: str) -> None:
    """Write via a temporary file and a rename, so a failed write never leaves half a report."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ReportWriteError(f"cannot write {path}: {err.strerror or err}") from None


def _counter_series(digest: TraceDigest) -> tuple[dict[str, list], dict[str, list]]:
    """Per-tier highest bytes in use and moved bytes per pair, per fine bin, for the Chrome counters."""
    usage = {tier: digest.usage.series(tier)[2] for tier in digest.usage.tiers()}
    moved = {pair: digest.moved.series(pair)[1] for pair in digest.moved.pairs()}
    return usage, moved


def _step_table(run_dir: Path, digest: TraceDigest, limits: DigestLimits, warnings: list[str],
                own: bool = True, trace_file: str = TRACE_FILE) -> StepTable:
    metrics_path = run_dir / METRICS_FILE
    if not own:  # (its loss is every rank's mean; its bytes moved and stalls are rank 0's)
        return digest.trace_steps.finish(f"{trace_file} step events ({METRICS_FILE} is rank 0's)")
    if metrics_path.is_file():
        builder, issues = StepTableBuilder(limits.table_rows), MetricsIssues()
        try:
            read_metrics(metrics_path, builder, issues)
        except OSError as err:
            warnings.append(f"cannot read {metrics_path}: {err.strerror or err}; steps come from the trace")
        else:
            warnings.extend(issues.warnings(METRICS_FILE))
            table = builder.finish(METRICS_FILE)
            if table.rows:
                return table
            warnings.append(f"{METRICS_FILE} has no step lines; steps come from the trace")
    else:
        warnings.append(f"no {METRICS_FILE} in the run directory; steps come from the trace's step events")
    return digest.trace_steps.finish(f"{trace_file} step events")


def _budgets(run_dir: Path, warnings: list[str]) -> dict[str, int]:
    """memory.{device,host,disk}_budget from the run's resolved config.yaml, where they are byte counts."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            config: Any = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as err:
        warnings.append(f"{CONFIG_FILE} unreadable ({type(err).__name__}); budgets are not drawn")
        return {}
    memory = config.get("memory") if isinstance(config, dict) else None
    if not isinstance(memory, dict):
        return {}
    budgets = {}
    for tier in ("device", "host", "disk"):
        value = memory.get(f"{tier}_budget")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            budgets[tier] = value
    return budgets


def _facts(run_dir: Path, trace_bytes: int, issues: ReadIssues, digest: TraceDigest,
           chrome_path: Path) -> list[tuple[str, str]]:
    counts = ", ".join(f"{name} {count:,}" for name, count in digest.counts.most_common())
    moved = ", ".join(f"{pair} {format_bytes(int(digest.moved.total[pair]))}" for pair in digest.moved.pairs())
    facts = [
        ("run directory", str(run_dir)),
        ("trace", f"{format_bytes(trace_bytes)}, {issues.lines:,} lines, {issues.events:,} events"),
        ("span", f"{digest.end:.2f} s"
                 + (f" ({issues.segments} segments: the run and its {issues.segments - 1} resumption(s), on one clock)"
                    if issues.segments > 1 else "")),
        ("events", counts or "none"),
        ("pages", f"{digest.residency.pages:,}"),
        ("moved in all", moved or "nothing"),
        ("drops (no transfer)", f"{digest.dropped:,}"),
        ("I/O errors", f"{digest.io_errors:,}"),
        ("Chrome trace", f"{chrome_path.name} (open in ui.perfetto.dev or chrome://tracing)"),
    ]
    for tier in digest.usage.tiers():
        facts.append((f"peak {tier}", format_bytes(int(digest.usage.peak[tier]))))
    return facts
