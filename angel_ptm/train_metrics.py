"""The trainer's figures per logged line (metrics.jsonl) and its progress text: pure functions of what the engine
reports, kept apart from the loop (trainer.py)."""

from __future__ import annotations

import json
import math
from typing import Any

from angel_ptm.config import format_bytes

TIERS = ("device", "host", "disk")


def precision_metrics(engine: Any) -> dict[str, Any]:
    """fp16 loss scaling: the scale after the step and whether the step was skipped for an overflow."""
    scale = getattr(engine, "loss_scale", None)
    if scale is None:
        return {}
    return {"loss_scale": float(scale), "skipped": bool(getattr(engine, "last_step_skipped", False))}


def schedule_metrics(schedule: dict | None, experts: bool = False) -> dict[str, Any]:
    """The scheduler's figures for the step just finished (an engine without a scheduler reports none); `experts`
    (the engine pages MoE experts): the expert accesses' figures on every line, zeros included."""
    if not schedule:
        return {}
    out = {"stall_s": schedule["stall_s"], "deviations": schedule["deviations"],
           "planned_moves": schedule["issued"], "replanned": schedule["replanned"],
           "repair_reads": schedule["repair_reads"]}
    if experts or any(schedule.get(key) for key in ("optional_skipped", "optional_unplanned", "optional_cancelled",
                                                    "optional_reordered", "optional_resumed", "experts_cold")):
        out.update(expert_accesses_skipped=schedule["optional_skipped"],  # MoE: experts routed or not
                   expert_accesses_unplanned=schedule["optional_unplanned"],
                   expert_fetches_cancelled=schedule.get("optional_cancelled", 0),
                   expert_accesses_reordered=schedule.get("optional_reordered", 0),
                   expert_fetches_resumed=schedule.get("optional_resumed", 0),
                   experts_cold_pages=schedule.get("experts_cold", 0))
    return out


def add_counts(total: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    """`total` with one step's figures added: numbers summed, flags or-ed."""
    for key, value in step.items():
        if isinstance(value, bool):
            total[key] = total.get(key, False) or value
        elif isinstance(value, (int, float)):
            total[key] = round(total.get(key, 0) + value, 9)  # (stall_s: no float noise in the log)
        else:
            total[key] = value
    return total


def moved_since(base: dict[str, int], before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """`base` (bytes per tier pair) plus what moved between the counters `before` and `after`."""
    return {pair: base.get(pair, 0) + n - before.get(pair, 0) for pair, n in after.items()}


def finite_or_none(value: float) -> float | None:
    """Strict JSON: a loss that is NaN or infinite (the run diverged) is logged as null."""
    return value if math.isfinite(value) else None


def write_metrics(file: Any, record: dict[str, Any]) -> None:
    file.write(json.dumps(record, separators=(",", ":")) + "\n")
    file.flush()  # a crash keeps every line logged so far


def progress_line(step: int, steps: int, loss: float, lr: float, tokens_per_s: float) -> str:
    """The plain line printed per logged step where there is no terminal for a bar."""
    return f"step {step}/{steps} | loss {loss:.4f} | lr {lr:.3e} | {tokens_per_s:,.0f} tokens/s"


def progress_text(loss: float, tokens_per_s: float, in_use: dict[str, int]) -> str:
    tiers = " ".join(f"{label} {format_bytes(in_use.get(tier, 0)).replace(' ', '')}"
                     for tier, label in zip(TIERS, ("dev", "host", "disk")))
    return f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | {tiers}"
