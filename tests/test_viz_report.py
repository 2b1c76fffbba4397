"""angel-ptm viz: where step time went (the headline: compute, stalls, the rest, and I/O busy time as the union over
I/O threads) and the loss curve. Every trace here is synthetic and written by the test itself (tests/test_viz.py's
helpers)."""

from __future__ import annotations

import re

import pytest

from angel_ptm.viz import build_report
from angel_ptm.viz.steptime import Coverage, StepTime

from test_viz import make_run, report_data


def test_report_draws_the_loss_per_step_and_the_val_loss_points(tmp_path):
    page = build_report(make_run(tmp_path)).html_path.read_text()
    assert report_data(page)["loss"] == {"loss": [[1, 5.5], [2, 5.0]], "val_loss": [[2, 5.1]], "loss_steps": 2,
                                         "stride": 1}
    section = page[page.index('<section id="section-loss">'):page.index('<section id="section-usage">')]
    assert "<polyline points=" in section
    assert re.findall(r"<title>(.*?)</title>", section) == ["step 2: val_loss 5.1000"]
    assert ('id="loss-caption">loss 5.5000 at step 1 -&gt; 5.0000 at step 2 (2 steps from metrics.jsonl); '
            'val_loss 5.1000 at step 2 (1 evaluations, dots).</p>') in section


def test_without_metrics_the_loss_curve_comes_from_the_trace_step_events(tmp_path):
    page = build_report(make_run(tmp_path, metrics=None)).html_path.read_text()
    assert report_data(page)["loss"]["loss"] == [[1, 5.5], [2, 5.0]]
    assert "(2 steps from trace.jsonl step events)" in page


# Two steps, with evaluation between them. Step 1 is [0, 2]: compute [0, 1.2] holds a stall [0.2, 0.4]; the
# optimizer's stall [1.5, 1.6] lies outside compute; two I/O threads read [0.1, 0.9] and [0.5, 1.3] (busy 1.2 s,
# 1.6 s summed). The evaluation's read [2.1, 2.4] falls between the steps. Step 2 is [2.5, 4]: compute [2.5, 3.5]
# holds a stall [3, 3.25], a copy [2.6, 2.7], a read [3.8, 4.2] runs past the step's end. Intervals are written
# when they end, as the recorder does.
def interval(lane, start, end):
    return {"t": start, "event": "interval", "lane": lane, "name": lane, "dur": end - start}


TIMED_TRACE = [
    interval("stall", 0.2, 0.4), interval("disk", 0.1, 0.9), interval("compute", 0.0, 1.2),
    interval("disk", 0.5, 1.3), interval("stall", 1.5, 1.6), {"t": 2.0, "event": "step", "step": 1, "step_s": 2.0},
    interval("disk", 2.1, 2.4), interval("copy", 2.6, 2.7), interval("stall", 3.0, 3.25),
    interval("compute", 2.5, 3.5), {"t": 4.0, "event": "step", "step": 2, "step_s": 1.5}, interval("disk", 3.8, 4.2),
]


def headline_rows(page: str) -> list[list[str]]:
    table = page[page.index('<table id="headline-table">'):]
    rows = re.findall(r"<tr>(.*?)</tr>", table[table.index("<tbody>"):table.index("</tbody>")])
    return [re.sub(r"<[^>]+>", "|", row).strip("|").split("||")[:3] for row in rows]


def test_headline_splits_step_time_into_compute_stalls_and_the_rest_and_gives_io_busy_time(tmp_path):
    page = build_report(make_run(tmp_path, trace=TIMED_TRACE, metrics=None)).html_path.read_text()
    assert page.index('<section id="headline">') < page.index('<ul class="facts">')  # at the top
    # compute 2.2 s less the 0.45 s stalled inside it; stalls 0.55 s; other 3.5 - 1.75 - 0.55 = 1.2 s; the disk
    # busy 1.2 s in step 1 and 0.2 s in step 2 (the evaluation's read is not step time)
    assert headline_rows(page) == [["compute", "1.75 s", "50.0%"], ["stalled", "550.0 ms", "15.7%"],
                                   ["other", "1.20 s", "34.3%"], ["disk I/O busy", "1.40 s", "40.0%"],
                                   ["host&lt;-&gt;device copies busy", "100.0 ms", "2.9%"]]
    assert ('<p id="headline-text">2 steps took 3.50 s (mean 1.75 s, from trace.jsonl step events): compute 50.0%, '
            'stalled 15.7%, other 34.3%. Meanwhile disk I/O busy 40.0%, host&lt;-&gt;device copies busy 2.9% of '
            'the step time (overlapping the above).</p>') in page


def test_lane_data_gives_busy_time_as_the_union_and_the_sum_over_io_threads(tmp_path):
    page = build_report(make_run(tmp_path, trace=TIMED_TRACE, metrics=None)).html_path.read_text()
    disk = next(lane for lane in report_data(page)["lanes"] if lane["name"] == "disk")
    assert (disk["count"], disk["union_s"], disk["busy_s"]) == (4, pytest.approx(1.9), pytest.approx(2.3))
    assert "summed time exceeds its busy time" in page


def test_headline_takes_stalls_from_metrics_when_the_trace_has_no_stall_lane(tmp_path):
    page = build_report(make_run(tmp_path)).html_path.read_text()  # SMALL_TRACE: steps 2.5 s + 1.5 s, no stalls
    # metrics: stall_s 0.75 of step_s 4 s; compute [1.5, 2.5] lies in step 1's window [0, 2.5]
    assert headline_rows(page)[:3] == [["compute", "1.00 s", "25.0%"], ["stalled", "750.0 ms", "18.8%"],
                                       ["other", "2.25 s", "56.2%"]]
    assert headline_rows(page)[3] == ["host&lt;-&gt;device copies busy", "500.0 ms", "12.5%"]


def test_busy_times_are_the_same_when_old_spans_are_settled_early():
    def measure(max_spans):
        step_time = StepTime(max_spans=max_spans)
        for event in TIMED_TRACE:
            if event["event"] == "step":
                step_time.step(event["t"], event["step_s"])
            else:
                step_time.interval(event["lane"], event["t"], event["t"] + event["dur"])
        step_time.finish()
        return step_time.in_steps_s, step_time.union_s, step_time.stall_in_compute_s

    (in_steps, union, stall_in_compute), whole = measure(max_spans=1), measure(max_spans=4096)
    assert in_steps == pytest.approx(whole[0]) and union == pytest.approx(whole[1])
    assert stall_in_compute == pytest.approx(whole[2]) == 0.45
    assert in_steps == pytest.approx({"stall": 0.55, "disk": 1.4, "compute": 2.2, "copy": 0.1})


def test_coverage_merges_overlapping_and_touching_spans_in_any_order():
    spans = Coverage()
    for start, end in ((5, 6), (1, 2), (2, 3), (7, 8), (2.5, 7.5)):
        spans.add(start, end)
    assert (spans.starts, spans.ends) == ([1], [8])
    before = spans.cut(4)
    assert (before.starts, before.ends, spans.starts, spans.ends) == ([1], [4], [4], [8])
    other = Coverage([0, 5], [2, 6])
    assert before.intersect(other).seconds() == 1.0
