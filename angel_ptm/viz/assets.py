"""The report's stylesheet and scripts, inlined into every report (no network, no CDN, no files beside it).

They live in a Python module, not in .css/.js files, so that every install of the package (wheel or editable)
carries them without package-data configuration.

The scripts report their own health in the DOM, which is how the browser test reads it: ERROR_HOOK (first in
<head>) counts every uncaught error into ``body[data-errors]`` and shows a banner; REPORT_JS draws each
``[data-chart]`` container and sets ``data-rendered="N points"`` on it (or ``data-error`` if drawing threw), then
``body[data-render-complete="true"]``.
"""

CSS = r"""
:root { --fg: #1d2430; --muted: #5b6575; --line: #d8dde6; --bg: #ffffff; --panel: #f6f8fb; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 32px 48px; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
       color: var(--fg); background: var(--bg); }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 0 0 6px; }
section { margin: 22px 0 0; padding: 16px 18px; background: var(--panel); border: 1px solid var(--line);
          border-radius: 6px; }
.meta { color: var(--muted); margin: 0; }
.facts { display: grid; grid-template-columns: repeat(auto-fill, minmax(230px, 1fr)); gap: 4px 18px; margin: 10px 0 0;
         padding: 0; list-style: none; }
.facts b { font-weight: 600; }
.caption { color: var(--muted); margin: 6px 0 0; font-size: 13px; }
.chart { position: relative; min-height: 60px; background: #fff; border: 1px solid var(--line); border-radius: 4px; }
.chart svg, .chart canvas { display: block; }
.chart .empty { padding: 20px; color: var(--muted); }
.chart .panel + .panel { border-top: 1px solid #eef1f5; }
.chart .legend { padding: 6px 10px 0; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 16px; margin: 0 0 6px; font-size: 13px; }
.legend span::before { content: ""; display: inline-block; width: 12px; height: 12px; margin-right: 5px;
                       vertical-align: -2px; border-radius: 2px; background: var(--swatch); }
.warnings { background: #fff7e0; border-color: #e8c66a; }
.warnings ul { margin: 4px 0 0; padding-left: 20px; }
#script-errors { display: none; background: #fde8e8; border-color: #e39b9b; }
.table-wrap { max-height: 560px; overflow: auto; border: 1px solid var(--line); background: #fff; }
table { border-collapse: collapse; font-size: 12.5px; font-variant-numeric: tabular-nums; width: 100%; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eef1f5; text-align: right; white-space: nowrap; }
th { position: sticky; top: 0; background: #eef2f7; font-weight: 600; }
td.text { text-align: left; }
#tooltip { position: fixed; pointer-events: none; display: none; z-index: 10; max-width: 420px; padding: 6px 8px;
           font-size: 12px; background: rgba(20, 24, 32, 0.92); color: #fff; border-radius: 4px; }
.axis text { font-size: 11px; fill: var(--muted); }
.axis line, .axis path { stroke: #b9c0cc; }
.grid line { stroke: #eef1f5; }
#headline { background: #eef6ee; border-color: #b7d7b7; }
#headline-text { font-size: 15px; margin: 0 0 8px; }
.share-bar { display: flex; height: 16px; margin: 0 0 10px; border-radius: 3px; overflow: hidden; }
.share-bar span { display: block; height: 100%; }
#headline-table { width: auto; background: #fff; }
"""

ERROR_HOOK = r"""
window.__vizErrors = [];
window.addEventListener("error", function (event) {
  var where = event.filename ? " (" + event.filename.split("/").pop() + ":" + event.lineno + ")" : "";
  window.__vizReportError(String(event.message) + where);
});
window.__vizReportError = function (message) {
  window.__vizErrors.push(message);
  var apply = function () {
    document.body.setAttribute("data-errors", String(window.__vizErrors.length));
    document.body.setAttribute("data-error-messages", window.__vizErrors.join(" | "));
    var box = document.getElementById("script-errors");
    if (box) {
      box.style.display = "block";
      box.querySelector("p").textContent = "The report's scripts failed: " + window.__vizErrors.join(" | ");
    }
  };
  if (document.body) { apply(); } else { document.addEventListener("DOMContentLoaded", apply); }
};
"""

REPORT_JS = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var T_END = Math.max(data.meta.t_end, 1e-6);
  var MARGIN = {left: 110, right: 24, top: 12, bottom: 30};
  var COLORS = {device: "#d62728", host: "#1f77b4", disk: "#6b6b6b", moving: "#f2b200", other: "#9467bd"};
  var LANE_COLORS = {compute: "#2ca02c", copy: "#1f77b4", disk: "#6b6b6b", comm: "#9467bd", optimizer: "#ff7f0e"};
  var PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#bcbd22", "#7f7f7f"];
  var tooltip = document.getElementById("tooltip");

  // ---------------------------------------------------------------- formatting and scales
  function esc(text) {
    return String(text).replace(/[&<>"']/g, function (c) {
      return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c];
    });
  }
  var BYTE_UNITS = [["TiB", Math.pow(1024, 4)], ["GiB", Math.pow(1024, 3)], ["MiB", 1048576], ["KiB", 1024]];
  function byteUnit(n) {
    for (var i = 0; i < BYTE_UNITS.length; i++) { if (Math.abs(n) >= BYTE_UNITS[i][1]) { return BYTE_UNITS[i]; } }
    return ["B", 1];
  }
  function fmtBytes(n) {
    if (n === null || n === undefined) { return "-"; }
    var unit = byteUnit(n);
    return unit[1] === 1 ? Math.round(n) + " B" : (n / unit[1]).toFixed(1) + " " + unit[0];
  }
  function fmtSeconds(s) {
    if (s >= 120) { return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s"; }
    if (s >= 1) { return s.toFixed(s >= 10 ? 1 : 2) + " s"; }
    if (s >= 1e-3) { return (s * 1e3).toFixed(s >= 0.01 ? 0 : 1) + " ms"; }
    return (s * 1e6).toFixed(0) + " us";
  }
  function fmtAxisTime(t, step) {  // tick labels: one unit for the whole axis, as many decimals as the step needs
    if (t === 0) { return "0"; }
    if (step >= 1 || T_END >= 10) { return +t.toFixed(step >= 1 ? 0 : 1) + " s"; }
    if (step >= 1e-3) { return +(t * 1e3).toFixed(step >= 1e-2 ? 0 : 1) + " ms"; }
    return +(t * 1e6).toFixed(0) + " us";
  }
  function niceStep(span, count) {
    var raw = span / Math.max(count, 1);
    var power = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) { if (raw <= steps[i] * power) { return steps[i] * power; } }
    return 10 * power;
  }
  function ticks(lo, hi, count) {
    if (!(hi > lo)) { return [lo]; }
    var step = niceStep(hi - lo, count), out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) { out.push(v); }
    return out;
  }
  function byteTicks(max) {  // ticks at round numbers of the unit the maximum is shown in
    var unit = byteUnit(max || 1)[1];
    return ticks(0, (max || 1) / unit, 5).map(function (v) { return v * unit; });
  }
  function scale(d0, d1, r0, r1) {
    var k = d1 > d0 ? (r1 - r0) / (d1 - d0) : 0;
    return function (v) { return r0 + (v - d0) * k; };
  }
  function laneColor(name, index) { return LANE_COLORS[name] || PALETTE[index % PALETTE.length]; }
  function chartWidth(el) { return Math.max(el.clientWidth || 0, 600); }

  // ---------------------------------------------------------------- tooltip
  function showTip(html, event) {
    tooltip.innerHTML = html;
    tooltip.style.display = "block";
    var x = event.clientX + 14, y = event.clientY + 12;
    if (x + tooltip.offsetWidth > window.innerWidth - 8) { x = event.clientX - tooltip.offsetWidth - 14; }
    tooltip.style.left = x + "px";
    tooltip.style.top = y + "px";
  }
  function hideTip() { tooltip.style.display = "none"; }

  // ---------------------------------------------------------------- shared SVG pieces
  function timeAxis(x, y, width) {
    var out = '<g class="axis">' + '<line x1="' + MARGIN.left + '" x2="' + (MARGIN.left + width) + '" y1="' + y +
              '" y2="' + y + '"/>';
    var marks = ticks(0, T_END, Math.max(2, Math.floor(width / 110))), step = marks[1] - marks[0] || T_END;
    marks.forEach(function (t) {
      var px = x(t).toFixed(1);
      out += '<line x1="' + px + '" x2="' + px + '" y1="' + y + '" y2="' + (y + 4) + '"/>' +
             '<text x="' + px + '" y="' + (y + 16) + '" text-anchor="middle">' + esc(fmtAxisTime(t, step)) + "</text>";
    });
    return out + "</g>";
  }
  function legend(el, items) {
    var box = document.createElement("div");
    box.className = "legend";
    box.innerHTML = items.map(function (item) {
      return '<span style="--swatch:' + item.color + '">' + esc(item.label) + "</span>";
    }).join("");
    el.appendChild(box);
  }
  function empty(el, text) {
    el.innerHTML = '<div class="empty">' + esc(text) + "</div>";
    return 0;
  }
  function stepPath(xs, ys, x, y) {  // a step line over bins [xs[i], xs[i+1]); null values break the line
    var d = "", open = false;
    for (var i = 0; i < ys.length; i++) {
      if (ys[i] === null || ys[i] === undefined) { open = false; continue; }
      var x0 = x(xs[i]).toFixed(1), x1 = x(xs[i + 1]).toFixed(1), yv = y(ys[i]).toFixed(1);
      d += (open ? "L" + x0 + " " + yv : "M" + x0 + " " + yv) + "L" + x1 + " " + yv;
      open = true;
    }
    return d;
  }
  function bandPath(xs, lo, hi, x, y) {  // one closed shape per bin, from the bin's lowest to its highest value
    var d = "";
    for (var i = 0; i < lo.length; i++) {
      if (lo[i] === null || hi[i] === null || hi[i] === lo[i]) { continue; }
      d += "M" + x(xs[i]).toFixed(1) + " " + y(hi[i]).toFixed(1) + "H" + x(xs[i + 1]).toFixed(1) + "V" +
           y(lo[i]).toFixed(1) + "H" + x(xs[i]).toFixed(1) + "Z";
    }
    return d;
  }

  // A step-line chart over time bins: series [{label, color, values, lows?, highs?}], y from 0 to the maximum.
  function binnedLineChart(el, spec) {
    var width = chartWidth(el), height = spec.height || 260;
    var plotW = width - MARGIN.left - MARGIN.right, plotH = height - MARGIN.top - MARGIN.bottom;
    var bins = spec.bins, binWidth = spec.binWidth, xs = [];
    for (var i = 0; i <= bins; i++) { xs.push(Math.min(i * binWidth, T_END)); }
    var max = 0, points = 0;
    spec.series.forEach(function (s) {
      (s.highs || s.values).forEach(function (v) { if (v !== null && v > max) { max = v; } });
      s.values.forEach(function (v) { if (v !== null) { points++; } });
    });
    (spec.lines || []).forEach(function (line) { if (line.value > max) { max = line.value; } });
    var yTicks = spec.byteAxis ? byteTicks(max) : ticks(0, max || 1, 5);
    var top = Math.max(max, yTicks[yTicks.length - 1] || 1);
    var x = scale(0, T_END, MARGIN.left, MARGIN.left + plotW), y = scale(0, top, MARGIN.top + plotH, MARGIN.top);
    var svg = '<svg width="' + width + '" height="' + height + '" role="img">';
    svg += '<g class="grid">' + yTicks.map(function (v) {
      return '<line x1="' + MARGIN.left + '" x2="' + (MARGIN.left + plotW) + '" y1="' + y(v).toFixed(1) + '" y2="' +
             y(v).toFixed(1) + '"/>';
    }).join("") + "</g>";
    svg += '<g class="axis">' + yTicks.map(function (v) {
      return '<text x="' + (MARGIN.left - 8) + '" y="' + (y(v) + 4).toFixed(1) + '" text-anchor="end">' +
             esc(spec.format(v)) + "</text>";
    }).join("") + "</g>";
    spec.series.forEach(function (s) {
      if (s.lows && s.highs) {
        svg += '<path d="' + bandPath(xs, s.lows, s.highs, x, y) + '" fill="' + s.color + '" fill-opacity="0.18"/>';
      }
      svg += '<path d="' + stepPath(xs, s.values, x, y) + '" fill="none" stroke="' + s.color +
             '" stroke-width="' + (spec.series.length > 1 ? 1.2 : 1.6) + '" stroke-opacity="0.9"/>';
    });
    (spec.lines || []).forEach(function (line) {
      var yv = y(line.value).toFixed(1);
      svg += '<line x1="' + MARGIN.left + '" x2="' + (MARGIN.left + plotW) + '" y1="' + yv + '" y2="' + yv +
             '" stroke="' + line.color + '" stroke-dasharray="6 4" stroke-width="1"/>' +
             '<text x="' + (MARGIN.left + 6) + '" y="' + (y(line.value) - 4).toFixed(1) +
             '" font-size="11" fill="' + line.color + '" stroke="#fff" stroke-width="3" paint-order="stroke">' +
             esc(line.label) + "</text>";
    });
    svg += timeAxis(x, MARGIN.top + plotH, plotW);
    svg += '<line class="cursor" x1="0" x2="0" y1="' + MARGIN.top + '" y2="' + (MARGIN.top + plotH) +
           '" stroke="#333" stroke-width="1" visibility="hidden"/>';
    svg += '<rect class="hover" x="' + MARGIN.left + '" y="' + MARGIN.top + '" width="' + plotW + '" height="' +
           plotH + '" fill="transparent"/></svg>';
    legend(el, spec.series.map(function (s) { return {label: s.legend || s.label, color: s.color}; }));
    var holder = document.createElement("div");
    holder.innerHTML = svg;
    el.appendChild(holder);
    var cursor = holder.querySelector(".cursor");
    holder.querySelector(".hover").addEventListener("mousemove", function (event) {
      var rect = event.currentTarget.getBoundingClientRect();
      var t = (event.clientX - rect.left) / rect.width * T_END, bin = Math.min(bins - 1, Math.floor(t / binWidth));
      if (bin < 0) { return; }
      cursor.setAttribute("x1", x(t).toFixed(1));
      cursor.setAttribute("x2", x(t).toFixed(1));
      cursor.setAttribute("visibility", "visible");
      var lines = spec.series.map(function (s) {
        var text = esc(s.label) + ": " + esc(spec.format(s.values[bin]));
        if (s.lows && s.highs && s.lows[bin] !== s.highs[bin] && s.lows[bin] !== null) {
          text += " (" + esc(spec.format(s.lows[bin])) + " .. " + esc(spec.format(s.highs[bin])) + ")";
        }
        return text;
      });
      showTip("<b>" + esc(fmtSeconds(bin * binWidth)) + " - " + esc(fmtSeconds((bin + 1) * binWidth)) + "</b><br>" +
              lines.join("<br>"), event);
    });
    holder.querySelector(".hover").addEventListener("mouseleave", function () {
      cursor.setAttribute("visibility", "hidden");
      hideTip();
    });
    return points;
  }

  // ---------------------------------------------------------------- (1) bytes in use per tier
  // One panel per tier, each on its own scale: a 56 MiB device budget must not be flattened by a 240 MiB disk.
  function drawUsage(el) {
    var usage = data.usage;
    if (!usage.tiers.length) { return empty(el, "No page events with in_use in this trace."); }
    var points = 0;
    usage.tiers.forEach(function (tier, i) {
      var color = COLORS[tier] || PALETTE[(i + 3) % PALETTE.length], budget = data.budgets[tier];
      var panel = document.createElement("div");
      panel.className = "panel";
      panel.setAttribute("data-tier", tier);
      el.appendChild(panel);
      points += binnedLineChart(panel, {
        bins: usage.bins, binWidth: usage.width, height: 150, byteAxis: true, format: fmtBytes,
        series: [{label: tier, color: color, values: usage.last[tier], lows: usage.min[tier], highs: usage.max[tier],
                  legend: tier + ": peak " + fmtBytes(usage.peak[tier]) +
                          (budget ? " of a " + fmtBytes(budget) + " budget (dashed)" : "")}],
        lines: budget ? [{value: budget, color: color, label: "budget " + fmtBytes(budget)}] : []
      });
    });
    return points;
  }

  // ---------------------------------------------------------------- (3) bytes moved per tier pair
  function drawMoved(el) {
    var moved = data.moved;
    if (!moved.pairs.length) { return empty(el, "No completed moves (moved events) in this trace."); }
    var series = moved.pairs.map(function (pair, i) {
      return {label: pair, color: PALETTE[i % PALETTE.length],
              values: moved.bytes[pair].map(function (b) { return b / moved.width; }),
              legend: pair + " (" + fmtBytes(moved.total[pair]) + " in " + moved.moves[pair] + " moves)"};
    });
    return binnedLineChart(el, {bins: moved.bins, binWidth: moved.width, series: series, byteAxis: true,
                                format: function (v) { return v === null ? "-" : fmtBytes(v) + "/s"; }});
  }

  // ---------------------------------------------------------------- (2) page residency map
  function decodeCells(text) {
    var raw = atob(text), out = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) { out[i] = raw.charCodeAt(i); }
    return out;
  }
  function drawResidency(el) {
    var map = data.residency, rows = map.rows.length, bins = map.bins, cats = map.categories.length;
    if (!rows || !bins) { return empty(el, "No page events in this trace."); }
    var cells = decodeCells(map.cells);
    var width = chartWidth(el), plotW = width - MARGIN.left - MARGIN.right;
    var rowH = Math.max(1, Math.min(14, Math.floor(760 / rows)));
    var plotH = rows * rowH, height = MARGIN.top + plotH + MARGIN.bottom;
    legend(el, map.categories.map(function (c) { return {label: c, color: COLORS[c]}; }));
    var canvas = document.createElement("canvas"), ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    el.appendChild(canvas);
    var ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    var binPx = map.width / T_END * plotW, filled = 0;
    for (var r = 0; r < rows; r++) {
      var y0 = MARGIN.top + r * rowH;
      for (var b = 0; b < bins; b++) {
        var x0 = MARGIN.left + b * binPx, w = Math.max(binPx, 0.6), base = (r * bins + b) * cats, acc = 0;
        if (x0 > MARGIN.left + plotW) { break; }
        w = Math.min(w, MARGIN.left + plotW - x0);
        for (var c = 0; c < cats; c++) {
          var share = cells[base + c];
          if (!share) { continue; }
          var h = share / 255 * rowH;
          ctx.fillStyle = COLORS[map.categories[c]];
          ctx.fillRect(x0, y0 + acc, w + 0.35, h + 0.35);
          acc += h;
          filled++;
        }
      }
    }
    // Kind boundaries and labels: every row when rows are tall enough, else one label per kind.
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    var previous = null;
    for (var k = 0; k < rows; k++) {
      var row = map.rows[k], yk = MARGIN.top + k * rowH;
      if (row.kind !== previous) {
        if (k) {
          ctx.fillStyle = "#ffffff";
          ctx.fillRect(MARGIN.left, yk - 0.5, plotW, 1);
        }
        ctx.fillStyle = "#1d2430";
        ctx.fillText(row.kind, MARGIN.left - 8, yk + Math.min(6, rowH / 2));
        previous = row.kind;
      } else if (rowH >= 11) {
        ctx.fillStyle = "#5b6575";
        ctx.fillText(row.label, MARGIN.left - 8, yk + rowH / 2);
      }
    }
    // Time axis under the map.
    var x = scale(0, T_END, MARGIN.left, MARGIN.left + plotW), axisY = MARGIN.top + plotH;
    ctx.fillStyle = "#5b6575";
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    ctx.fillRect(MARGIN.left, axisY, plotW, 1);
    var marks = ticks(0, T_END, Math.max(2, Math.floor(plotW / 110))), step = marks[1] - marks[0] || T_END;
    marks.forEach(function (t) {
      ctx.fillRect(x(t), axisY, 1, 4);
      ctx.fillText(fmtAxisTime(t, step), x(t), axisY + 7);
    });
    canvas.addEventListener("mousemove", function (event) {
      var rect = canvas.getBoundingClientRect();
      var px = event.clientX - rect.left, py = event.clientY - rect.top;
      var r = Math.floor((py - MARGIN.top) / rowH), b = Math.floor((px - MARGIN.left) / binPx);
      if (r < 0 || r >= rows || b < 0 || b >= bins || px > MARGIN.left + plotW) { hideTip(); return; }
      var row = map.rows[r], base = (r * bins + b) * cats, parts = [];
      for (var c = 0; c < cats; c++) {
        if (cells[base + c]) { parts.push(esc(map.categories[c]) + " " + Math.round(cells[base + c] / 2.55) + "%"); }
      }
      showTip("<b>" + esc(row.label) + "</b> (" + row.pages + (row.pages === 1 ? " page" : " pages") + ")<br>" +
              esc(fmtSeconds(b * map.width)) + " - " + esc(fmtSeconds((b + 1) * map.width)) + "<br>" +
              (parts.length ? parts.join(", ") : "not allocated"), event);
    });
    canvas.addEventListener("mouseleave", hideTip);
    return filled;
  }

  // ---------------------------------------------------------------- (4) lanes as a Gantt chart
  function drawLanes(el) {
    var lanes = data.lanes;
    if (!lanes.length) { return empty(el, "No interval events in this trace."); }
    var width = chartWidth(el), plotW = width - MARGIN.left - MARGIN.right, laneH = 26;
    var plotH = lanes.length * laneH, height = MARGIN.top + plotH + MARGIN.bottom;
    var x = scale(0, T_END, MARGIN.left, MARGIN.left + plotW), drawn = 0;
    var svg = '<svg width="' + width + '" height="' + height + '" role="img">';
    lanes.forEach(function (lane, i) {
      var y0 = MARGIN.top + i * laneH, color = laneColor(lane.name, i), barH = laneH - 8;
      svg += '<rect x="' + MARGIN.left + '" y="' + y0 + '" width="' + plotW + '" height="' + laneH + '" fill="' +
             (i % 2 ? "#fafbfd" : "#f2f4f8") + '"/>';
      svg += '<text class="lane-label" x="' + (MARGIN.left - 8) + '" y="' + (y0 + laneH / 2 + 4) +
             '" text-anchor="end" font-size="12" fill="#1d2430">' + esc(lane.name) + "</text>";
      svg += '<g fill="' + color + '">';
      if (lane.spans) {
        // Spans closer than half a pixel merge into one rectangle; its tooltip says how many it holds.
        var sorted = lane.spans.slice().sort(function (a, b) { return a[0] - b[0]; }), run = null;
        var flush = function () {
          if (!run) { return; }
          var title = run.n === 1 ? run.name + ": " + fmtSeconds(run.busy) + " at " + fmtSeconds(run.t0)
                                  : run.n + " intervals, busy " + fmtSeconds(run.busy) + " from " + fmtSeconds(run.t0);
          svg += '<rect x="' + run.x0.toFixed(2) + '" y="' + (y0 + 4) + '" width="' +
                 Math.max(run.x1 - run.x0, 1).toFixed(2) + '" height="' + barH + '"><title>' + esc(title) +
                 "</title></rect>";
          drawn++;
        };
        sorted.forEach(function (span) {
          var x0 = x(span[0]), x1 = x(span[0] + span[1]);
          if (run && x0 <= run.x1 + 0.5) {
            run.x1 = Math.max(run.x1, x1);
            run.n++;
            run.busy += span[1];
          } else {
            flush();
            run = {x0: x0, x1: x1, n: 1, busy: span[1], t0: span[0], name: span[2]};
          }
        });
        flush();
      } else {
        lane.busy.forEach(function (busy, b) {
          if (!busy) { return; }
          var share = busy / lane.width, x0 = x(b * lane.width), x1 = x(Math.min((b + 1) * lane.width, T_END));
          svg += '<rect x="' + x0.toFixed(2) + '" y="' + (y0 + 4) + '" width="' + Math.max(x1 - x0, 0.8).toFixed(2) +
                 '" height="' + barH + '" fill-opacity="' + Math.min(1, 0.15 + 0.85 * share).toFixed(2) +
                 '"><title>' + esc(fmtSeconds(b * lane.width) + ": busy " + Math.round(share * 100) + "%" +
                 (share > 1 ? " (overlapping intervals)" : "")) + "</title></rect>";
          drawn++;
        });
      }
      svg += "</g>";
    });
    var steps = data.steps;
    if (steps.length && plotW / steps.length >= 6) {  // step boundaries, when they are not too dense to see
      svg += '<g stroke="#1d2430" stroke-opacity="0.25">' + steps.map(function (s) {
        var px = x(s[0]).toFixed(1);
        return '<line x1="' + px + '" x2="' + px + '" y1="' + MARGIN.top + '" y2="' + (MARGIN.top + plotH) + '"/>';
      }).join("") + "</g>";
    }
    svg += timeAxis(x, MARGIN.top + plotH, plotW) + "</svg>";
    legend(el, lanes.map(function (lane, i) {
      var mode = lane.spans ? "" : ", drawn as busy share per bin";
      return {label: lane.name + " (" + lane.count + " intervals, busy " + fmtSeconds(lane.union_s) + ", summed " +
                     fmtSeconds(lane.busy_s) + mode + ")",
              color: laneColor(lane.name, i)};
    }));
    var holder = document.createElement("div");
    holder.innerHTML = svg;
    el.appendChild(holder);
    return drawn;
  }

  // ---------------------------------------------------------------- drive: each chart reports its own status
  var charts = {usage: drawUsage, residency: drawResidency, moved: drawMoved, lanes: drawLanes};
  var containers = document.querySelectorAll("[data-chart]");
  for (var i = 0; i < containers.length; i++) {
    var el = containers[i], draw = charts[el.getAttribute("data-chart")];
    try {
      if (!draw) { throw new Error("no drawing function for chart " + el.getAttribute("data-chart")); }
      var points = draw(el);
      el.setAttribute("data-rendered", points + " points");
    } catch (err) {
      el.setAttribute("data-error", String(err && err.message || err));
      window.__vizReportError("chart " + el.getAttribute("data-chart") + ": " + String(err && err.stack || err));
    }
  }
  document.body.setAttribute("data-render-complete", "true");
})();
"""
