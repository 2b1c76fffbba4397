"""The learning-rate schedule: linear warmup, then cosine / linear decay to a floor, or constant.

A pure function of the step, so a resumed run gets exactly the learning rates an uninterrupted one would.
"""

from __future__ import annotations

import math

DECAYS = ("cosine", "linear", "constant")


def lr_at(
    step: int,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    decay: str = "cosine",
    min_lr_ratio: float = 0.1,
) -> float:
    """The learning rate for optimizer step ``step`` (counted from 0).

    Warmup (nanoGPT form): ``base_lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``, so the first step
    already moves and step ``warmup_steps - 1`` reaches ``base_lr``. After warmup, ``cosine`` and ``linear`` go
    from ``base_lr`` down to ``base_lr * min_lr_ratio``, reached at ``step == total_steps`` and held after it;
    ``constant`` stays at ``base_lr``.
    """
    if decay not in DECAYS:
        raise ValueError(f"lr decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    if step < 0:
        raise ValueError(f"lr_at: step must be >= 0, got {step}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if decay == "constant":
        return base_lr
    min_lr = base_lr * min_lr_ratio
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0 or step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / decay_steps  # in [0, 1)
    if decay == "cosine":
        weight = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        weight = 1.0 - progress
    return min_lr + weight * (base_lr - min_lr)


def schedule_given(config) -> bool:
    """Whether a config spells out an lr_schedule (the engine applies it then): the section was in its source (a
    dict, YAML file or --set), or it differs from the defaults (set in code, on a Config loaded or built there)."""
    given = getattr(config, "given_sections", None)
    return (given is not None and "lr_schedule" in given) or config.lr_schedule != type(config.lr_schedule)()


class ConfigSchedule:
    """The config's lr_schedule, applied to the optimizer for the next step, when the config spells one out;
    `set_lr` (the user drives the learning rate) turns it off for good."""

    def __init__(self, config):
        self.config = config
        self.on = schedule_given(config)

    def apply(self, optimizer, steps_done: int) -> None:
        """The learning rate of optimizer step `steps_done` (counted from 0)."""
        if self.on:
            sched = self.config.lr_schedule
            optimizer.lr = lr_at(steps_done, self.config.optimizer.lr, self.config.trainer.steps,
                                 sched.warmup_steps, sched.decay, sched.min_lr_ratio)
