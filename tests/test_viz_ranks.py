"""angel-ptm viz across runs and ranks: a data-parallel run's traces merged into one Chrome trace on one clock, a
resumed run's trace segments read as one timeline, the recorder's start mark, and a trace cut at trace.max_bytes
whose step summaries still give the bytes moved. Every trace here is synthetic and written by the test itself."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from angel_ptm import cli
from angel_ptm.viz import build_report, validate_chrome_trace
from angel_ptm.viz.reader import ReadIssues, iter_events
from tests.test_viz import METRICS, SMALL_TRACE, MiB, make_run, write_lines


def rank_run(tmp_path: Path, starts) -> Path:
    """A two-rank run directory: each rank's trace is SMALL_TRACE, its t = 0 at starts[rank] on the wall clock
    (None: a trace from before the start mark)."""
    run = tmp_path / "run"
    run.mkdir()
    for rank, start in enumerate(starts):
        head = [] if start is None else [{"t": 0.0, "event": "mark", "name": "trace start", "unix_s": start}]
        write_lines(run / f"trace.rank{rank}.jsonl", head + SMALL_TRACE)
    write_lines(run / "metrics.jsonl", METRICS)
    return run


def test_viz_of_a_data_parallel_run_writes_one_chrome_trace_with_the_ranks_on_one_clock(capsys, tmp_path):
    run = rank_run(tmp_path, [1000.0, 1000.25])  # rank 1 started 0.25 s after rank 0
    merged = tmp_path / "all.json"
    assert cli.main(["viz", str(run), "--chrome-trace", str(merged)]) == 0
    out = capsys.readouterr().out
    assert f"chrome trace: {merged} (" in out and "every rank a process on one time axis" in out
    trace = json.loads(merged.read_text())
    assert validate_chrome_trace(trace) == []
    events = trace["traceEvents"]
    assert {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"} == {1: "rank 0", 2: "rank 1"}
    compute = {e["pid"]: e["ts"] for e in events if e.get("cat") == "compute"}
    assert compute == {1: 1.5e6, 2: 1.75e6}  # each rank's lane where its own clock puts it, shifted to one axis
    steps = [(e["pid"], e["ts"], e["s"]) for e in events if e["ph"] == "i" and e["name"] == "step 2"]
    assert steps == [(1, 4e6, "p"), (2, 4.25e6, "p")]  # a rank's marks span its own lanes only
    assert trace["otherData"]["span_us"] == [0.0, 4.25e6]
    # each rank's own trace is written beside it, and the index links the merged one
    assert (tmp_path / "all.rank1.json").exists() and 'href="all.json"' in (run / "report.html").read_text()
    # with both outputs given elsewhere, nothing is written into the run directory
    before = sorted(p.name for p in run.iterdir())
    out = tmp_path / "out"
    out.mkdir()
    assert cli.main(["viz", str(run), "-o", str(out / "v.html"), "--chrome-trace", str(out / "v.json")]) == 0
    assert sorted(p.name for p in run.iterdir()) == before
    assert sorted(p.name for p in out.iterdir()) == ["v.html", "v.json", "v.rank0.html", "v.rank0.json",
                                                      "v.rank1.html", "v.rank1.json"]
    # metrics.jsonl is rank 0's: rank 1's page takes its steps from its own trace and says so
    rank0, rank1 = (out / "v.rank0.html").read_text(), (out / "v.rank1.html").read_text()
    assert "2 logged steps from metrics.jsonl" in rank0 and "total stall 750.0 ms" in rank0
    assert "2 logged steps from trace.rank1.jsonl step events (metrics.jsonl is rank 0&#x27;s)" in rank1
    assert "total stall" not in rank1


def test_rank_traces_without_a_start_mark_are_merged_from_their_own_zero_with_a_warning(caplog, tmp_path):
    from angel_ptm.viz.ranks import build_rank_reports

    with caplog.at_level(logging.WARNING, logger="angel_ptm.viz"):
        result = build_rank_reports(rank_run(tmp_path, [None, 5.0]))
    assert any("trace.rank0.jsonl lack(s) the 'trace start' mark" in w for w in result.warnings)
    assert any("not on one clock" in r.getMessage() for r in caplog.records)
    compute = [e["ts"] for e in json.loads(result.chrome.path.read_text())["traceEvents"] if e.get("cat") == "compute"]
    assert compute == [1.5e6, 1.5e6]


def test_the_recorder_writes_its_start_on_the_wall_clock_first(tmp_path):
    import time

    from angel_ptm.trace.recorder import TraceRecorder

    before = time.time()
    recorder = TraceRecorder(tmp_path / "trace.jsonl")
    recorder.event("mark", name="x")
    recorder.close()
    first, second = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert first["event"] == "mark" and first["name"] == "trace start" and first["t"] == 0.0
    assert before <= first["unix_s"] <= time.time() and second["name"] == "x"


@pytest.mark.parametrize("second_start, shift", [(1010.0, 10.0), (1001.0, 4.0)])  # 4.0: the first segment's end
def test_a_resumed_runs_trace_reads_as_one_timeline(tmp_path, second_start, shift):
    """A resumption appends a segment whose t restarts at 0: it is put after the first on the wall clock, and never
    before the first segment's last event (a clock that stepped back)."""
    head = {"t": 0.0, "event": "mark", "name": "trace start", "unix_s": 1000.0}
    path = write_lines(tmp_path / "trace.jsonl", [head] + SMALL_TRACE + [dict(head, unix_s=second_start)]
                       + SMALL_TRACE)
    issues = ReadIssues()
    steps = [e["t"] for e in iter_events(path, issues) if e["event"] == "step"]
    assert issues.segments == 2 and steps == [2.5, 4.0, 2.5 + shift, 4.0 + shift]
    write_lines(tmp_path / "metrics.jsonl", METRICS)
    result = build_report(tmp_path)
    assert "2 segments: the run and its 1 resumption(s)" in result.html_path.read_text()
    assert json.loads(result.chrome_path.read_text())["otherData"]["span_us"] == [0.0, (4.0 + shift) * 1e6]


def test_after_a_trace_cut_each_steps_summary_gives_its_bytes_moved_and_in_use(tmp_path):
    """Past trace.max_bytes the step events carry `moved` and `in_use`: the report's moved bytes and tier usage
    count them (one point per step), so its totals still cover the whole run."""
    after = [{"t": 2.6, "event": "mark", "name": "trace truncated", "max_bytes": 4096},
             {"t": 4.0, "event": "step", "step": 2, "loss": 5.0, "step_s": 1.5, "left_out": {"moved": 3},
              "moved": {"host->device": 3 * MiB, "device->host": MiB}, "in_use": {"device": 2 * MiB, "host": 0,
                                                                                   "disk": 0}}]
    result = build_report(make_run(tmp_path, trace=SMALL_TRACE[:7] + after))
    assert any("after it the bytes moved and in use are each step's summary" in w for w in result.warnings)
    page = result.html_path.read_text()
    # 1 MiB host->device before the cut and 3 MiB after it; the device's peak is the summary's 2 MiB
    assert "moved in all:</b> host-&gt;device 4.0 MiB, device-&gt;host 1.0 MiB" in page
    assert "peak device:</b> 2.0 MiB" in page
    # What followed the last step (a final evaluation, a save): the recorder's closing summary, counted too (it
    # was dropped at close: the report's bytes moved short of metrics.jsonl's)
    end = {"t": 4.5, "event": "mark", "name": "trace end", "left_out": {"moved": 1},
           "moved": {"host->device": 2 * MiB}}
    (tmp_path / "end").mkdir()
    page = build_report(make_run(tmp_path / "end", trace=SMALL_TRACE[:7] + after + [end])).html_path.read_text()
    assert "moved in all:</b> host-&gt;device 6.0 MiB, device-&gt;host 1.0 MiB" in page


def test_a_truncated_traces_recorder_writes_what_followed_its_last_step_at_close(tmp_path):
    from angel_ptm.trace import TraceRecorder

    recorder = TraceRecorder(tmp_path / "trace.jsonl", max_bytes=80)
    recorder.event("moved", page="p", kind="param", src="host", dst="device", nbytes=4)  # past the bound
    recorder.event("step", step=1)
    recorder.event("moved", page="p", kind="param", src="host", dst="device", nbytes=8)  # an evaluation's
    recorder.close()
    last = json.loads((tmp_path / "trace.jsonl").read_text().splitlines()[-1])
    assert last["name"] == "trace end" and last["moved"] == {"host->device": 8}
