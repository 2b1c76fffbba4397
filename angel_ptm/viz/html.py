"""The HTML report: one self-contained file, the charts' data as inline JSON and the drawing code inline.

At the top, where step time went (steptime.py); then the loss curve, bytes in use per tier, page residency map,
bytes moved per tier pair, lanes (Gantt) and the per-step table. The tier, residency, moved and lane charts are
drawn in the browser (assets.REPORT_JS); the headline, the loss curve (an inline SVG), the table, the facts and the
warnings are plain HTML written here, so they read even with scripts off.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any, Optional

from angel_ptm.config.sizes import format_bytes
from angel_ptm.viz import losscurve
from angel_ptm.viz.assets import CSS, ERROR_HOOK, REPORT_JS
from angel_ptm.viz.bins import TIERS
from angel_ptm.viz.chrome import LANE_ORDER
from angel_ptm.viz.digest import TraceDigest
from angel_ptm.viz.metrics import BYTE_DICT_COLUMNS, StepTable
from angel_ptm.viz.steptime import StepTimeSummary

CHARTS = ("usage", "residency", "moved", "lanes")  # the data-chart names REPORT_JS draws


def chart_data(digest: TraceDigest, budgets: dict[str, int], meta: dict[str, Any]) -> dict[str, Any]:
    """Everything the charts draw, small enough to inline (a few hundred KB for a 200 MB trace)."""
    bins = digest.limits.time_bins
    usage = digest.usage
    tiers = usage.tiers()
    usage_width, lows, highs, lasts = digest.fine_axis.width, {}, {}, {}
    for tier in tiers:
        usage_width, lows[tier], highs[tier], lasts[tier] = usage.series(tier, bins)
    moved = digest.moved
    pairs = moved.pairs()
    moved_width, moved_bytes = digest.fine_axis.width, {}
    for pair in pairs:
        moved_width, moved_bytes[pair] = moved.series(pair, bins)
    lanes = sorted(digest.lanes.lanes(), key=lambda lane: LANE_ORDER.index(lane) if lane in LANE_ORDER else 99)
    return {
        "meta": meta,
        "budgets": budgets,
        "usage": {"width": usage_width, "bins": len(lasts[tiers[0]]) if tiers else 0, "tiers": tiers, "min": lows,
                  "max": highs, "last": lasts, "peak": {tier: usage.peak[tier] for tier in tiers}},
        "residency": digest.residency.export(),
        "moved": {"width": moved_width, "bins": len(moved_bytes[pairs[0]]) if pairs else 0, "pairs": pairs,
                  "bytes": moved_bytes,
                  "total": {pair: moved.total[pair] for pair in pairs},
                  "moves": {pair: moved.moves[pair] for pair in pairs}},
        "lanes": [{"name": lane, "count": digest.lanes.count[lane], "busy_s": digest.lanes.busy_total[lane],
                   "union_s": digest.step_time.union_s[lane], "spans": digest.lanes.spans(lane),
                   "busy": digest.lanes.busy(lane), "width": digest.axis.width}
                  for lane in lanes],
        "steps": [[t] for t in digest.steps.items()],
    }


def render_report(title: str, data: dict[str, Any], facts: list[tuple[str, str]], warnings: list[str],
                  table: StepTable, marks: list[dict[str, Any]], step_time: Optional[StepTimeSummary]) -> str:
    esc = html.escape
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>",
        f"<style>{CSS}</style>",
        f"<script>{ERROR_HOOK}</script>",
        '</head><body data-errors="0">',
        f"<header><h1>{esc(title)}</h1>",
        '<p class="meta">Hover a chart for values. Times are seconds since the trace started.</p>',
        _headline_section(step_time),
        '<ul class="facts">' + "".join(f"<li><b>{esc(k)}:</b> {esc(v)}</li>" for k, v in facts) + "</ul></header>",
        '<section id="script-errors"><h2>Script errors</h2><p></p></section>',
        "<noscript><section><p>The charts need JavaScript; the table below does not.</p></section></noscript>",
    ]
    if warnings:
        parts.append('<section class="warnings" id="warnings"><h2>Warnings</h2><ul>'
                     + "".join(f"<li>{esc(w)}</li>" for w in warnings) + "</ul></section>")
    usage, moved, residency = data["usage"], data["moved"], data["residency"]
    parts += [
        _loss_section(table),
        _chart_section("usage", "2. Bytes in use per tier",
                       f"One panel per tier. The line is the last value in each bin of {_seconds(usage['width'])}; "
                       f"the shaded band spans the lowest to highest value within the bin. Dashed lines are the "
                       f"run's budgets (config.yaml)."),
        _chart_section("residency", "3. Page residency",
                       f"{residency['pages']} pages in {len(residency['rows'])} rows "
                       f"({_plural(residency['group'], 'page')} per row), bins of {_seconds(residency['width'])}. "
                       f"Each cell is split by the share of its page-time on each tier; 'moving' is a page in flight "
                       f"between two tiers."),
        _chart_section("moved", "4. Bytes moved per tier pair",
                       f"Completed moves (moved events) as bytes per second in bins of {_seconds(moved['width'])}. "
                       f"Drops (a clean copy already on disk, no transfer) are not moves: "
                       f"{data['meta']['dropped']:,} in this trace."),
        _chart_section("lanes", "5. Compute, stall, disk I/O, copy and communication lanes",
                       "Intervals from the trace. A dense lane is drawn as its busy share per time bin; the Chrome "
                       "trace beside this report holds every interval for Perfetto or chrome://tracing. Each "
                       "lane's legend gives its busy time (at least one interval open) and its intervals' "
                       "durations summed: the disk lane's transfers run on several I/O threads at once, so its "
                       "summed time exceeds its busy time."),
        _table_section(table),
    ]
    if marks:
        parts.append(_marks_section(marks))
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    parts += [
        '<div id="tooltip"></div>',
        f'<script type="application/json" id="report-data">{payload}</script>',
        f"<script>{REPORT_JS}</script>",
        "</body></html>",
    ]
    return "\n".join(parts)


def _chart_section(name: str, heading: str, caption: str) -> str:
    return (f'<section id="section-{name}"><h2>{html.escape(heading)}</h2>'
            f'<div class="chart" id="chart-{name}" data-chart="{name}"></div>'
            f'<p class="caption">{html.escape(caption)}</p></section>')


def _table_section(table: StepTable) -> str:
    esc = html.escape
    head = '<section id="section-steps"><h2>6. Steps</h2>'
    if not table.rows:
        return head + '<p class="caption" id="steps-empty">No step records (metrics.jsonl and the trace hold no ' \
                      "step lines).</p></section>"
    covered = f" covering {table.covered_steps:,} steps" if table.covered_steps > table.steps else ""
    summary = [f"{table.steps:,} logged steps from {table.source}{covered}"]
    if table.stride > 1:
        summary.append(f"every {table.stride}th shown, and the last")
    mean = table.mean("step_s")
    if mean is not None:
        summary.append(f"mean step {_seconds(mean)}")
    if table.counts["stall_s"] and table.covered_steps:  # (a line's stall_s sums the steps since the line before)
        summary.append(f"mean stall {_seconds(table.sums['stall_s'] / table.covered_steps)}")
    if table.counts["stall_s"]:
        summary.append(f"total stall {_seconds(table.sums['stall_s'])}")
    if table.moved_total:
        moved = ", ".join(f"{pair} {format_bytes(int(n))}" for pair, n in table.moved_total.most_common())
        summary.append(f"moved in all: {moved}")
    tiers = _in_use_tiers(table)
    headers = [f"{tier} in use" for tier in tiers] if tiers else []
    header = "".join(f"<th>{esc(label)}</th>" for column in table.columns
                     for label in (headers if column == "in_use" and tiers else [column]))
    body = []
    for row in table.rows:
        cells = []
        for column in table.columns:
            if column == "in_use" and tiers:  # one column per tier: bytes in use after the step
                in_use = row.get("in_use") if isinstance(row.get("in_use"), dict) else {}
                cells += [f"<td>{esc(_bytes(in_use.get(tier)))}</td>" for tier in tiers]
                continue
            text, tip, numeric = _cell(column, row.get(column))
            klass = "" if numeric else ' class="text"'
            title = f' title="{esc(tip)}"' if tip else ""
            cells.append(f"<td{klass}{title}>{esc(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (head + f'<p class="caption">{esc("; ".join(summary))}.</p>'
            f'<div class="table-wrap"><table id="steps-table"><thead><tr>{header}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div></section>')


def _in_use_tiers(table: StepTable) -> list[str]:
    """The tiers named in the rows' in_use dicts: the contract's tiers in their order, others as they appear."""
    seen: list[str] = []
    for row in table.rows:
        in_use = row.get("in_use")
        if isinstance(in_use, dict):
            seen += [str(tier) for tier in in_use if str(tier) not in seen]
    return [tier for tier in TIERS if tier in seen] + [tier for tier in seen if tier not in TIERS]


def _bytes(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return ""
    return format_bytes(int(value))


def _headline_section(summary: Optional[StepTimeSummary]) -> str:
    esc = html.escape
    head = '<section id="headline"><h2>Where step time went</h2>'
    if summary is None:
        return head + '<p id="headline-text">No step times (step_s) in the trace or metrics.jsonl.</p></section>'
    shares = ", ".join(f"{part.name} {_percent(part.share)}" for part in summary.parts)
    text = (f"{summary.steps:,} steps took {_seconds(summary.step_s)} (mean {_seconds(summary.step_s / summary.steps)}"
            f", from {summary.source}): {shares}.")
    if summary.io:
        text += " Meanwhile " + ", ".join(f"{io.name} {_percent(io.share)}" for io in summary.io) + \
                " of the step time (overlapping the above)."
    bar = "".join(f'<span style="width:{part.share * 100:.2f}%;background:{SHARE_COLORS.get(part.name, "#999")}" '
                  f'title="{esc(part.name)} {_percent(part.share)}"></span>' for part in summary.parts)
    rows = "".join(f"<tr><td class=\"text\">{esc(share.name)}</td><td>{_seconds(share.seconds)}</td>"
                   f"<td>{_percent(share.share)}</td><td class=\"text\">{esc(share.meaning)}</td></tr>"
                   for share in summary.parts + summary.io)
    notes = "".join(f'<p class="caption">{esc(note)}.</p>' for note in summary.notes)
    return (head + f'<p id="headline-text">{esc(text)}</p><div class="share-bar">{bar}</div>'
            f'<table id="headline-table"><thead><tr><th class="text">part</th><th>time</th><th>of step time</th>'
            f'<th class="text">what it is</th></tr></thead><tbody>{rows}</tbody></table>{notes}</section>')


SHARE_COLORS = {"compute": "#2ca02c", "stalled": "#d62728", "other": "#9aa3b0"}


def _loss_section(table: StepTable) -> str:
    head = '<section id="section-loss"><h2>1. Loss per step</h2>'
    caption = html.escape(losscurve.caption(table.loss, table.source))
    return head + losscurve.render_svg(table.loss) + f'<p class="caption" id="loss-caption">{caption}</p></section>'


def _percent(share: float) -> str:
    return f"{share * 100:.1f}%"


def _marks_section(marks: list[dict[str, Any]]) -> str:
    rows = []
    for mark in marks:
        fields = {k: v for k, v in mark.items() if k != "t"}
        rows.append(f"<tr><td>{_seconds(mark['t'])}</td><td class=\"text\">"
                    f"{html.escape(json.dumps(fields, default=str)[:300])}</td></tr>")
    return ('<section id="section-marks"><h2>Marks</h2><div class="table-wrap"><table><thead><tr><th>t</th>'
            '<th class="text">fields</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table></div></section>")


def _cell(column: str, value: Any) -> tuple[str, str, bool]:
    """(text, tooltip, is-numeric) of one table cell."""
    if value is None:
        return "", "", True
    if isinstance(value, bool):
        return str(value).lower(), "", False
    if isinstance(value, (int, float)):
        return _number(column, value), "", True
    if isinstance(value, dict):
        numbers = {str(k): v for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if column in BYTE_DICT_COLUMNS:
            detail = ", ".join(f"{k} {format_bytes(int(v))}" for k, v in numbers.items())
            return format_bytes(int(sum(numbers.values()))), detail, True
        if numbers and len(numbers) == len(value):
            detail = ", ".join(f"{k} {_number(column, v)}" for k, v in numbers.items())
            return _number(column, sum(numbers.values())), detail, True
        return _short(value), "", False
    if isinstance(value, list):
        return f"{len(value)} items", _short(value), True
    return _short(value), "", False


def _number(column: str, value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if column == "step" or (isinstance(value, int) and abs(value) < 10**15):
        return f"{value:,}"
    if column in ("loss", "val_loss", "grad_norm"):
        return f"{value:.4f}"
    if column == "lr":
        return f"{value:.3e}"
    if column.endswith("_s") and not column.endswith("per_s"):
        return f"{value:.3f}"
    if column.endswith("per_s"):
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} us"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"

