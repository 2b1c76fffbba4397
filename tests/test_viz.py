"""angel-ptm viz: the streaming trace reader, the downsampling series, the HTML report, the Chrome trace and its
validator, and the `viz` command line. Every trace here is synthetic and written by the test itself."""

from __future__ import annotations

import base64
import json
import logging
import re
import tracemalloc
from pathlib import Path

import pytest

from angel_ptm import cli
from angel_ptm.viz import DigestLimits, build_report, validate_chrome_trace
from angel_ptm.viz.bins import Decimator, LaneActivity, MovedBytes, TierUsage, TimeAxis, zeros
from angel_ptm.viz.chrome import ChromeTraceWriter
from angel_ptm.viz.digest import TraceDigest
from angel_ptm.viz.reader import ReadIssues, iter_events
from angel_ptm.viz.residency import CATEGORIES, PageResidency

MiB = 1 << 20


def page_event(t, event, page, src, dst, in_use, nbytes=MiB):
    kind = page.split(":")[0]
    return {"t": t, "event": event, "page": page, "kind": kind, "src": src, "dst": dst, "bytes": nbytes,
            "in_use": in_use}


# A two-step run in miniature: two pages allocated on the host, one moved to the device and back, an interval per
# lane, step marks and a mark. in_use is what the recorder writes: bytes per tier after the event.
SMALL_TRACE = [
    page_event(0.0, "alloc", "param:0", None, "host", {"device": 0, "host": MiB, "disk": 0}),
    page_event(0.1, "alloc", "param:1", None, "host", {"device": 0, "host": 2 * MiB, "disk": 0}),
    page_event(1.0, "move", "param:0", "host", "device", {"device": MiB, "host": 2 * MiB, "disk": 0}),
    page_event(1.5, "moved", "param:0", "host", "device", {"device": MiB, "host": MiB, "disk": 0}),
    {"t": 1.5, "event": "interval", "lane": "compute", "name": "step 1", "dur": 1.0},
    {"t": 1.0, "event": "interval", "lane": "copy", "name": "param:0 h2d", "dur": 0.5},
    {"t": 2.5, "event": "step", "step": 1, "loss": 5.5, "step_s": 2.5},
    page_event(3.0, "evict", "param:0", "device", "host", {"device": MiB, "host": MiB, "disk": 0}),
    page_event(3.0, "move", "param:0", "device", "host", {"device": MiB, "host": 2 * MiB, "disk": 0}),
    page_event(3.25, "moved", "param:0", "device", "host", {"device": 0, "host": 2 * MiB, "disk": 0}),
    {"t": 3.0, "event": "interval", "lane": "optimizer", "name": "adam", "dur": 0.5},
    {"t": 3.5, "event": "mark", "name": "eval", "val_loss": 5.1},
    {"t": 4.0, "event": "step", "step": 2, "loss": 5.0, "step_s": 1.5},
]
METRICS = [
    {"step": 1, "loss": 5.5, "lr": 1e-3, "step_s": 2.5, "stall_s": 0.25, "deviations": 0,
     "in_use": {"device": MiB, "host": MiB, "disk": 0}, "moved": {"host->device": MiB}},
    {"step": 2, "loss": 5.0, "lr": 1e-3, "step_s": 1.5, "stall_s": 0.5, "deviations": 3,
     "in_use": {"device": 0, "host": 2 * MiB, "disk": 0}, "moved": {"device->host": MiB}},
    {"step": 2, "val_loss": 5.1},
]


def write_lines(path: Path, records, tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def make_run(tmp_path: Path, trace=SMALL_TRACE, metrics=METRICS, tail: str = "") -> Path:
    run = tmp_path / "run"
    run.mkdir()
    write_lines(run / "trace.jsonl", trace, tail)
    if metrics is not None:
        write_lines(run / "metrics.jsonl", metrics)
    (run / "config.yaml").write_text("memory:\n  device_budget: 2097152\n  host_budget: 4194304\n  disk_budget: auto\n")
    return run


def report_data(html_text: str) -> dict:
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html_text, re.S)
    assert match, "the report must embed its data"
    return json.loads(match.group(1))


def read_all(path: Path) -> tuple[list[dict], ReadIssues]:
    issues = ReadIssues()
    return list(iter_events(path, issues)), issues


# --- reading the trace ----------------------------------------------------------------------------------------
def test_reader_streams_one_line_at_a_time(tmp_path):
    path = write_lines(tmp_path / "trace.jsonl", SMALL_TRACE)
    issues = ReadIssues()
    events = iter_events(path, issues)
    first = next(events)
    assert first["page"] == "param:0" and issues.lines == 1  # nothing past the first line has been read
    assert len(list(events)) == len(SMALL_TRACE) - 1
    assert issues.lines == issues.events == len(SMALL_TRACE)


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    path = write_lines(tmp_path / "trace.jsonl", SMALL_TRACE, tail='{"t": 4.5, "event": "mo')
    events, issues = read_all(path)
    assert len(events) == len(SMALL_TRACE)
    assert issues.truncated_last_line == len(SMALL_TRACE) + 1 and issues.malformed == 0
    assert issues.warnings() == [f"trace.jsonl: the last line ({len(SMALL_TRACE) + 1}) is cut short (the run may have "
                                 f"crashed or still be running); it was ignored"]


def test_malformed_line_in_the_middle_is_counted_not_taken_for_truncation(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"t": 0, "event": "step", "step": 1}\n{"t": 1, "ev\n{"t": 2, "event": "step", "step": 2}\n')
    events, issues = read_all(path)
    assert [e["step"] for e in events] == [1, 2]
    assert (issues.malformed, issues.first_malformed_line, issues.truncated_last_line) == (1, 2, None)


def test_unknown_event_type_is_skipped_with_a_warning(tmp_path):
    path = write_lines(tmp_path / "trace.jsonl", [{"t": 0.5, "event": "teleport", "page": "param:0"}] * 2
                       + [{"t": 1.0, "event": "step", "step": 1}])
    events, issues = read_all(path)
    assert [e["event"] for e in events] == ["step"]
    assert issues.unknown == {"teleport": 2}
    assert issues.warnings() == ["trace.jsonl: 2 event(s) of unknown type 'teleport' ignored"]


@pytest.mark.parametrize("line", ['[1, 2]', '{"event": "step"}', '{"t": -1, "event": "step"}', '{"t": "0", "event": "x"}',
                                  '{"t": 1, "event": 7}', '{"t": NaN, "event": "step"}'])
def test_lines_that_are_not_events_are_counted_as_invalid(tmp_path, line):
    path = tmp_path / "trace.jsonl"
    path.write_text(line + '\n{"t": 1, "event": "step", "step": 1}\n')
    events, issues = read_all(path)
    assert len(events) == 1 and issues.invalid == 1 and issues.first_invalid_line == 1


# --- downsampling ---------------------------------------------------------------------------------------------
def test_time_axis_doubles_its_width_and_series_merge_bins_in_pairs():
    axis = TimeAxis(bins=4, width=1.0)
    moved = MovedBytes(axis)
    for t, nbytes in ((0.5, 10), (1.5, 20), (3.5, 40)):
        axis.fit(t)
        moved.record(t, "host->disk", nbytes)
    assert (axis.width, moved.series("host->disk")) == (1.0, (1.0, [10.0, 20.0, 0.0, 40.0]))
    axis.fit(5.0)  # past the last bin: the width doubles, bins merge pairwise
    moved.record(5.0, "host->disk", 80)
    assert axis.width == 2.0 and axis.used == 3
    assert moved.series("host->disk") == (2.0, [30.0, 40.0, 80.0])
    assert moved.series("host->disk", max_bins=2) == (4.0, [70.0, 80.0])
    assert moved.total["host->disk"] == 150 and moved.moves["host->disk"] == 4


def test_spread_splits_a_span_over_the_bins_it_covers():
    axis = TimeAxis(bins=4, width=1.0)
    values = zeros(4)
    axis.spread(values, 0.5, 2.25)
    assert list(values) == [0.5, 1.0, 0.25, 0.0]


def test_tier_usage_keeps_lowest_highest_and_last_value_per_bin_and_carries_it_forward():
    axis = TimeAxis(bins=8, width=1.0)
    usage = TierUsage(axis)
    for t, device in ((0.2, 5), (0.4, 9), (0.6, 7), (3.5, 2)):
        axis.fit(t)
        usage.record(t, {"device": device, "host": "n/a"})
    width, lowest, highest, last = usage.series("device")
    assert width == 1.0
    assert last == [7, 7, 7, 2]
    assert lowest == [5, 7, 7, 2]
    assert highest == [9, 7, 7, 7]  # bin 3 held 7 until the event that set 2
    assert usage.tiers() == ["device"] and usage.peak == {"device": 9}


def test_decimator_keeps_every_kth_item_and_the_last():
    kept = Decimator(capacity=4)
    for item in range(11):
        kept.add(item)
    assert kept.stride == 4 and kept.items() == [0, 4, 8, 10]


def test_lane_keeps_exact_spans_up_to_its_cap_then_only_busy_bins():
    axis = TimeAxis(bins=4, width=1.0)
    lanes = LaneActivity(axis, max_spans=2)
    for start in (0.0, 1.0):
        axis.fit(start + 0.5)
        lanes.record("disk", f"read {start}", start, 0.5)
    assert lanes.spans("disk") == [(0.0, 0.5, "read 0.0"), (1.0, 0.5, "read 1.0")]
    axis.fit(2.5)
    lanes.record("disk", "read 2", 2.0, 0.5)
    assert lanes.spans("disk") is None
    assert lanes.busy("disk") == [0.5, 0.5, 0.5] and lanes.count["disk"] == 3


def decode_cells(export: dict) -> list[list[list[int]]]:
    """rows x bins x categories"""
    raw = base64.b64decode(export["cells"])
    n, bins = len(CATEGORIES), export["bins"]
    return [[list(raw[(r * bins + b) * n:(r * bins + b + 1) * n]) for b in range(bins)]
            for r in range(len(export["rows"]))]


def test_residency_shares_each_bin_between_the_tiers_a_page_was_on():
    axis = TimeAxis(bins=4, width=1.0)
    residency = PageResidency(axis)
    for t, event, src, dst in ((0.0, "alloc", None, "host"), (1.0, "move", "host", "device"),
                               (1.5, "moved", "host", "device"), (2.0, "evict", "device", "host")):
        axis.fit(t)
        residency.record(t, event, "param:0", "param", src, dst)
    axis.fit(3.5)
    residency.finish(3.5)
    export = residency.export()
    assert export["rows"] == [{"kind": "param", "label": "param:0", "pages": 1}]
    device, host, moving = CATEGORIES.index("device"), CATEGORIES.index("host"), CATEGORIES.index("moving")
    cells = decode_cells(export)[0]
    assert [cell[host] for cell in cells] == [255, 0, 0, 0]
    assert [cell[moving] for cell in cells] == [0, 128, 0, 0]  # half of bin 1 in flight (127.5 rounds to 128)
    # evict alone does not move it; the last bin holds only 0.5 s of trace and is shared out of that
    assert [cell[device] for cell in cells] == [0, 128, 255, 255]


def test_residency_groups_pages_into_rows_when_there_are_too_many():
    axis = TimeAxis(bins=4, width=1.0)
    residency = PageResidency(axis, max_rows=3)
    for i in range(10):
        residency.record(0.0, "alloc", f"grad:{i}", "grad", None, "disk")
    residency.record(0.0, "alloc", "param:0", "param", None, "host")
    axis.fit(1.0)
    residency.finish(1.0)
    export = residency.export()
    assert residency.group == 8
    assert [(row["label"], row["pages"]) for row in export["rows"]] == [
        ("param:0-7", 1), ("grad:0-7", 8), ("grad:8-15", 2)]
    disk = CATEGORIES.index("disk")
    assert [row[0][disk] for row in decode_cells(export)] == [0, 255, 255]


def test_digest_memory_does_not_grow_with_the_trace(tmp_path):
    def peak_bytes(events: int) -> int:
        path = tmp_path / f"trace{events}.jsonl"
        with open(path, "w") as out:
            for n in range(events):
                page, t = f"param:{n % 50}", n * 0.001
                out.write(json.dumps(page_event(t, "moved", page, "host", "device", {"device": n, "host": 0})) + "\n")
                out.write(json.dumps({"t": t, "event": "interval", "lane": "disk", "name": "w", "dur": 0.0005}) + "\n")
        issues = ReadIssues()
        tracemalloc.start()
        digest = TraceDigest(issues, DigestLimits(spans_per_lane=100, union_spans=100))
        for event in iter_events(path, issues):
            digest.add(event)
        digest.finish()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert issues.events == 2 * events
        return peak

    assert peak_bytes(16_000) < 1.25 * peak_bytes(4_000)


# --- the HTML report --------------------------------------------------------------------------------------------
def test_report_is_one_self_contained_file_with_every_chart_and_its_data(tmp_path):
    run = make_run(tmp_path)
    result = build_report(run)
    assert result.html_path == run / "report.html" and result.chrome_path == run / "trace.chrome.json"
    page = result.html_path.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)  # nothing fetched
    assert not re.search(r"<script[^>]+src=|<link[^>]+stylesheet|@import", page, re.I)  # nothing beside the file
    for chart in ("usage", "residency", "moved", "lanes"):
        assert f'id="chart-{chart}" data-chart="{chart}"' in page
    assert '<table id="steps-table">' in page
    data = report_data(page)
    assert data["usage"]["tiers"] == ["device", "host", "disk"]
    assert data["usage"]["peak"] == {"device": MiB, "host": 2 * MiB, "disk": 0}
    assert data["budgets"] == {"device": 2 * MiB, "host": 4 * MiB}
    assert [row["label"] for row in data["residency"]["rows"]] == ["param:0", "param:1"]
    assert data["moved"]["total"] == {"host->device": MiB, "device->host": MiB}
    assert [lane["name"] for lane in data["lanes"]] == ["compute", "copy", "optimizer"]
    assert data["lanes"][0]["spans"] == [[1.5, 1.0, "step 1"]]
    assert data["steps"] == [[2.5], [4.0]] and data["meta"]["t_end"] == 4.0
    assert result.warnings == ()


def test_step_table_shows_whatever_fields_metrics_hold(tmp_path):
    page = build_report(make_run(tmp_path)).html_path.read_text()
    table = page[page.index('<table id="steps-table">'):]
    headers = re.findall(r"<th>(.*?)</th>", table[:table.index("</thead>")])
    assert headers == ["step", "loss", "val_loss", "lr", "step_s", "stall_s", "moved", "deviations",
                       "device in use", "host in use", "disk in use"]
    rows = re.findall(r"<tr>(.*?)</tr>", table[table.index("<tbody>"):])
    cells = [re.sub(r"<[^>]+>", "|", row).strip("|").split("||") for row in rows]
    assert cells[1][:3] == ["2", "5.0000", "5.1000"]  # the evaluation line joins its step's row
    assert cells[1][5:8] == ["0.500", "1.0 MiB", "3"]
    assert "mean stall 375.0 ms; total stall 750.0 ms" in page


def test_step_table_gives_each_tier_in_use_its_own_column(tmp_path):
    page = build_report(make_run(tmp_path)).html_path.read_text()
    table = page[page.index('<table id="steps-table">'):]
    rows = re.findall(r"<tr>(.*?)</tr>", table[table.index("<tbody>"):table.index("</tbody>")])
    in_use = [re.findall(r"<td>([^<]*)</td>", row)[-3:] for row in rows]
    assert in_use == [["1.0 MiB", "1.0 MiB", "0 B"], ["0 B", "2.0 MiB", "0 B"]]  # device, host, disk


def test_truncated_trace_and_unknown_events_still_give_a_report_with_visible_warnings(tmp_path, caplog):
    trace = SMALL_TRACE + [{"t": 4.2, "event": "teleport"}]
    run = make_run(tmp_path, trace=trace, tail='{"t": 4.5, "event": "mov')
    with caplog.at_level(logging.WARNING, logger="angel_ptm.viz"):
        result = build_report(run)
    assert len(result.warnings) == 2
    assert "cut short" in result.warnings[0] and "unknown type 'teleport'" in result.warnings[1]
    assert [r.getMessage() for r in caplog.records] == list(result.warnings)
    page = result.html_path.read_text()
    warnings_box = page[page.index('id="warnings"'):page.index("</section>", page.index('id="warnings"'))]
    assert "cut short" in warnings_box and "teleport" in warnings_box
    assert report_data(page)["meta"]["events"] == len(SMALL_TRACE)


def test_a_trace_cut_at_trace_max_bytes_says_what_the_report_leaves_out(tmp_path):
    """After the recorder's "trace truncated" mark only step events are written: the report says its bytes moved
    and step-time split cover the steps before it (metrics.jsonl has every step's)."""
    trace = SMALL_TRACE[:7] + [{"t": 2.6, "event": "mark", "name": "trace truncated", "max_bytes": 4096},
                               {"t": 4.0, "event": "step", "step": 2, "loss": 5.0, "step_s": 1.5,
                                "left_out": {"moved": 3}}]
    result = build_report(make_run(tmp_path, trace=trace))
    assert any("truncated at trace.max_bytes 2.6 s into the run" in w and "metrics.jsonl has every step's" in w
               for w in result.warnings)
    # the split is of the steps before the mark (their intervals are in the trace), not of every step's time
    assert '<p id="headline-text">1 steps took 2.50 s (mean 2.50 s' in result.html_path.read_text()
    whole = tmp_path / "whole"
    whole.mkdir()
    assert not any("truncated" in w for w in build_report(make_run(whole)).warnings)


def test_log_every_lines_evaluation_lines_and_a_diverged_loss_are_counted_as_what_they_are(tmp_path):
    """metrics.jsonl with trainer.log_every 2: a line sums the stall of the steps since the line before (mean stall
    per step, not per line); a line of an evaluation alone is no step, and its bytes moved add to the total; a loss
    logged as null (the run diverged) is said in the caption, not silently left out."""
    metrics = [
        {"step": 2, "loss": 5.5, "step_s": 1.0, "stall_s": 0.4, "moved": {"host->device": MiB}},
        {"step": 3, "val_loss": 5.4, "moved": {"disk->host": 2 * MiB}},
        {"step": 4, "loss": 5.2, "step_s": 1.0, "stall_s": 0.2, "moved": {"host->device": MiB}},
        {"step": 4, "val_loss": 5.1, "moved": {"host->device": MiB}},
        {"step": 6, "loss": None, "step_s": 1.0, "stall_s": 0.0, "moved": {}},
    ]
    page = build_report(make_run(tmp_path, metrics=metrics)).html_path.read_text()
    assert "3 logged steps from metrics.jsonl covering 6 steps" in page
    assert "mean stall 100.0 ms; total stall 600.0 ms" in page
    assert "moved in all: host-&gt;device 3.0 MiB, disk-&gt;host 2.0 MiB" in page
    assert "not a finite number (null or NaN: the run diverged) at 1 steps from step 6" in page


def test_without_metrics_the_table_comes_from_the_trace_step_events(tmp_path):
    result = build_report(make_run(tmp_path, metrics=None))
    assert result.warnings == ("no metrics.jsonl in the run directory; steps come from the trace's step events",)
    page = result.html_path.read_text()
    assert "2 logged steps from trace.jsonl step events" in page and "<th>step_s</th>" in page


# --- the Chrome trace -------------------------------------------------------------------------------------------
def test_chrome_trace_passes_the_validator_and_holds_lanes_counters_and_steps(tmp_path):
    result = build_report(make_run(tmp_path))
    trace = json.loads(result.chrome_path.read_text())
    assert validate_chrome_trace(trace) == []
    events = trace["traceEvents"]
    assert result.chrome_events == len(events)
    threads = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(threads) == {"steps, marks, counters", "compute", "copy", "optimizer"}
    compute = [e for e in events if e["ph"] == "X" and e["tid"] == threads["compute"]]
    assert compute == [{"name": "step 1", "cat": "compute", "ph": "X", "ts": 1.5e6, "dur": 1e6, "pid": 1,
                        "tid": threads["compute"]}]
    steps = [e for e in events if e["ph"] == "i" and e["name"].startswith("step")]
    assert [(e["ts"], e["args"]["loss"]) for e in steps] == [(2.5e6, 5.5), (4e6, 5.0)]
    usage = [(e["ts"], e["args"]) for e in events if e["ph"] == "C" and e["name"] == "in_use bytes"]
    # One counter per 1 ms bin holding the bin's highest value, written only when it changes: a rise shows in
    # the bin of its event, a fall in the next bin (the bin of the event also held the value before it).
    assert usage == [
        (0.0, {"device": 0, "host": MiB, "disk": 0}), (1e5, {"device": 0, "host": 2 * MiB, "disk": 0}),
        (1e6, {"device": MiB, "host": 2 * MiB, "disk": 0}), (1.501e6, {"device": MiB, "host": MiB, "disk": 0}),
        (3e6, {"device": MiB, "host": 2 * MiB, "disk": 0}), (3.251e6, {"device": 0, "host": 2 * MiB, "disk": 0})]
    assert trace["otherData"]["span_us"] == [0.0, 4e6]


def test_chrome_writer_merges_intervals_that_nearly_touch_past_its_cap(tmp_path):
    writer = ChromeTraceWriter(tmp_path / "t.json", max_intervals_per_lane=2, merge_gap_s=0.01)
    for start in (0.0, 1.0, 2.0, 2.105, 2.21, 3.0):
        writer.interval("disk", "write", start, 0.1)
    stats = writer.close((0.0, 3.1), {}, {}, 1.0)
    trace = json.loads(stats.path.read_text())
    assert validate_chrome_trace(trace) == []
    spans = [(e["ts"], e["dur"], e.get("args")) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans == [(0.0, 1e5, None), (1e6, 1e5, None), (2e6, 3.1e5, {"merged_intervals": 3}),
                     (3e6, 1e5, {"merged_intervals": 1})]
    assert stats.merged_lanes == {"disk": 4}


VALID = {"traceEvents": [
    {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "compute"}},
    {"name": "fwd", "ph": "X", "ts": 10, "dur": 5, "pid": 1, "tid": 1},
    {"name": "in_use", "ph": "C", "ts": 0, "pid": 1, "tid": 0, "args": {"device": 3}},
    {"name": "step 1", "ph": "i", "s": "g", "ts": 15, "pid": 1, "tid": 0},
], "otherData": {"span_us": [0, 20]}}


def with_event(index: int, **changes) -> dict:
    trace = json.loads(json.dumps(VALID))
    trace["traceEvents"][index].update(changes)
    for key, value in changes.items():
        if value is None:
            del trace["traceEvents"][index][key]
    return trace


@pytest.mark.parametrize("broken, problem", [
    (with_event(1, name=None), "missing name"),
    (with_event(1, ph="Q"), "unknown phase 'Q'"),
    (with_event(1, ts=-1), "ts must be a finite number >= 0"),
    (with_event(1, ts="10"), "ts must be a finite number >= 0"),
    (with_event(1, dur=None), "dur must be a finite number >= 0"),
    (with_event(1, dur=-5), "dur must be a finite number >= 0"),
    (with_event(1, tid=None), "missing tid"),
    (with_event(2, args={}), "a counter needs a non-empty args object"),
    (with_event(2, args={"device": "3"}), "counter args must all be finite numbers"),
    (with_event(3, s="x"), "instant scope must be one of g, p, t"),
    (with_event(1, dur=50), "lies outside the trace span"),
    (with_event(0, tid=7), "complete events on a thread without a thread_name"),
    (with_event(1, ph="E", dur=None), "E without a matching B"),
    ({"traceEvents": {}}, "traceEvents must be a list"),
])
def test_validator_rejects_broken_events(broken, problem):
    assert validate_chrome_trace(VALID) == []
    problems = validate_chrome_trace(broken)
    assert any(problem in p for p in problems), problems


# --- the command line ---------------------------------------------------------------------------------------------
def assert_one_line_error(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("angel-ptm: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_viz_of_a_missing_run_directory_is_a_one_line_error(capsys, tmp_path):
    assert cli.main(["viz", str(tmp_path / "nope")]) == 2
    assert_one_line_error(capsys.readouterr().err, f"run directory not found: {tmp_path / 'nope'}")


def test_viz_of_a_directory_without_a_trace_is_a_one_line_error(capsys, tmp_path):
    assert cli.main(["viz", str(tmp_path)]) == 2
    assert_one_line_error(capsys.readouterr().err, f"no trace.jsonl in run directory {tmp_path}")
    assert not (tmp_path / "report.html").exists() and not (tmp_path / "trace.chrome.json").exists()


def test_viz_of_a_trace_without_any_event_is_a_one_line_error_and_writes_nothing(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "trace.jsonl").write_text("not json\nnor this\n")
    assert cli.main(["viz", str(run)]) == 2
    assert_one_line_error(capsys.readouterr().err, "no readable event in 2 line(s) (2 malformed, 0 not events)")
    assert sorted(p.name for p in run.iterdir()) == ["trace.jsonl"]


def test_viz_into_a_missing_output_directory_is_a_one_line_error(capsys, tmp_path):
    run = make_run(tmp_path)
    assert cli.main(["viz", str(run), "-o", str(tmp_path / "no" / "r.html")]) == 2
    assert_one_line_error(capsys.readouterr().err, f"directory {tmp_path / 'no'} does not exist")


def test_viz_writes_the_report_and_the_chrome_trace_where_asked(capsys, tmp_path):
    run = make_run(tmp_path, tail='{"t": 9')
    report, chrome = tmp_path / "out.html", tmp_path / "out.json"
    assert cli.main(["viz", str(run), "-o", str(report), "--chrome-trace", str(chrome)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[:2] == [f"report: {report} ({report.stat().st_size / 1024:.1f} KiB)",
                                             f"chrome trace: {chrome} ({chrome.stat().st_size / 1024:.1f} KiB, "
                                             f"{len(json.loads(chrome.read_text())['traceEvents']):,} events)"]
    assert captured.err.startswith("angel-ptm: warning: trace.jsonl: the last line (14) is cut short")
    assert not (run / "report.html").exists()

