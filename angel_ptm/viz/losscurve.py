"""The loss curve: training loss per step and the val_loss points, drawn as an inline SVG.

The SVG is written here, not by the report's script, so the curve reads with scripts off like the table does. The
points come from the same rows as the step table (metrics.jsonl, else the trace's step events); at most
`max_points` of each series are kept (every k-th step, and the last).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

from angel_ptm.viz.bins import Decimator
from angel_ptm.viz.reader import is_number

WIDTH, HEIGHT = 960, 280
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 14, 34
LOSS_COLOR, VAL_COLOR = "#1f77b4", "#ff7f0e"


@dataclass(frozen=True)
class LossSeries:
    loss: list[tuple[float, float]]  # (step, loss)
    val_loss: list[tuple[float, float]]  # (step, val_loss)
    loss_steps: int  # steps with a loss, before decimation
    stride: int
    diverged: tuple[int, float] | None = None  # (steps whose loss is not a finite number, the first of them)

    def export(self) -> dict[str, Any]:
        return {"loss": [list(p) for p in self.loss], "val_loss": [list(p) for p in self.val_loss],
                "loss_steps": self.loss_steps, "stride": self.stride}


class LossCurve:
    def __init__(self, max_points: int = 1000):
        self._loss: Decimator[tuple[float, float]] = Decimator(max_points)
        self._val: Decimator[tuple[float, float]] = Decimator(max_points)
        self._diverged: tuple[int, float] | None = None

    def add(self, row: dict[str, Any]) -> None:
        """One step's row; a loss or val_loss that is not a finite number is left out (a loss logged as null, or
        NaN, is counted: the run diverged)."""
        step = row["step"]
        if is_number(row.get("loss")):
            self._loss.add((step, row["loss"]))
        elif "loss" in row:
            count, first = self._diverged or (0, step)
            self._diverged = (count + 1, first)
        if is_number(row.get("val_loss")):
            self._val.add((step, row["val_loss"]))

    def finish(self) -> LossSeries:
        return LossSeries(self._loss.items(), self._val.items(), self._loss.seen, self._loss.stride, self._diverged)


def caption(series: LossSeries, source: str) -> str:
    diverged = ""
    if series.diverged is not None:
        count, first = series.diverged
        diverged = (f"the loss is not a finite number (null or NaN: the run diverged) at {count:,} steps from step "
                    f"{first:,}, left out of the curve")
    if not series.loss and not series.val_loss:
        return f"No loss values in {source}" + (f"; {diverged}." if diverged else ".")
    parts = []
    if series.loss:
        (first_step, first), (last_step, last) = series.loss[0], series.loss[-1]
        parts.append(f"loss {first:.4f} at step {first_step:,} -> {last:.4f} at step {last_step:,} "
                     f"({series.loss_steps:,} steps from {source}"
                     + (f", every {series.stride}th drawn" if series.stride > 1 else "") + ")")
    if series.val_loss:
        step, value = series.val_loss[-1]
        parts.append(f"val_loss {value:.4f} at step {step:,} ({len(series.val_loss)} evaluations, dots)")
    if diverged:
        parts.append(diverged)
    return "; ".join(parts) + "."


def render_svg(series: LossSeries) -> str:
    points = series.loss + series.val_loss
    if not points:
        return ""
    steps = [p[0] for p in points]
    values = [p[1] for p in points]
    x0, x1 = min(steps), max(steps)
    y_ticks = _ticks(min(values), max(values))
    y0, y1 = y_ticks[0], y_ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return LEFT + (plot_w / 2 if x1 == x0 else (step - x0) / (x1 - x0) * plot_w)

    def y(value: float) -> float:
        return TOP + plot_h - (value - y0) / (y1 - y0) * plot_h

    out = [f'<svg id="loss-svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" role="img" '
           f'aria-label="loss per step">']
    for tick in y_ticks:
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eef1f5"/>'
                   f'<text x="{LEFT - 8}" y="{y(tick) + 4:.1f}" text-anchor="end" font-size="11" '
                   f'fill="#5b6575">{_number(tick)}</text>')
    for tick in _ticks(x0, x1, count=8, integers=True):
        if x0 <= tick <= x1:
            out.append(f'<text x="{x(tick):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle" font-size="11" '
                       f'fill="#5b6575">{tick:,.0f}</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" stroke="#b9c0cc"/>'
               f'<text x="{LEFT + plot_w}" y="{HEIGHT - 2}" text-anchor="end" font-size="11" fill="#5b6575">step'
               f'</text>')
    if series.loss:
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in series.loss)
        out.append(f'<polyline points="{path}" fill="none" stroke="{LOSS_COLOR}" stroke-width="1.5"/>')
    for step, value in series.val_loss:
        out.append(f'<circle cx="{x(step):.1f}" cy="{y(value):.1f}" r="3.5" fill="{VAL_COLOR}">'
                   f"<title>step {step:,}: val_loss {value:.4f}</title></circle>")
    out.append("</svg>")
    legend = [f'<span style="--swatch:{LOSS_COLOR}">loss (training, per step)</span>'] if series.loss else []
    if series.val_loss:
        legend.append(f'<span style="--swatch:{VAL_COLOR}">val_loss</span>')
    return f'<div class="legend">{"".join(legend)}</div>' + "".join(out)


def _ticks(lo: float, hi: float, count: int = 5, integers: bool = False) -> list[float]:
    """Round tick values spanning [lo, hi]: the first at or below lo, the last at or above hi."""
    if hi <= lo:
        pad = max(abs(lo) * 0.05, 1.0 if integers else 1e-3)
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if raw <= m * power)
    if integers:
        step = max(1.0, round(step))
    first = math.floor(lo / step)
    last = math.ceil(hi / step)
    return [k * step for k in range(first, last + 1)]


def _number(value: float) -> str:
    return html.escape(f"{value:.4g}")
