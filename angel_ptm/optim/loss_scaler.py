"""fp16 loss scaling, with torch.amp.GradScaler's semantics and defaults.

fp16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by `scale` before backward, so
the gradients are `scale` times too large while they are fp16, and the update reads them times `1 / scale` (in fp32).
A step whose gradients hold an inf or NaN is skipped whole; a dynamic scaler then multiplies the scale by `backoff`,
and after `growth_interval` steps in a row without an overflow multiplies it by `growth`. A fixed scale never
changes (an overflow still skips the step).
"""

from __future__ import annotations


class LossScaler:
    def __init__(self, scale: float, dynamic: bool = True, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.growth, self.backoff, self.growth_interval = growth, backoff, growth_interval
        self.clean_steps = 0  # steps without an overflow since the scale last changed (GradScaler's growth tracker)
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, opt) -> "LossScaler":
        """From the optimizer section: loss_scale "dynamic" (starting at loss_scale_initial) or a fixed number."""
        dynamic = opt.loss_scale == "dynamic"
        return cls(opt.loss_scale_initial if dynamic else opt.loss_scale, dynamic=dynamic,
                   growth=opt.loss_scale_growth, backoff=opt.loss_scale_backoff,
                   growth_interval=opt.loss_scale_growth_interval)

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` says it was skipped for an inf/NaN gradient."""
        if overflow:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if overflow:
            self.scale *= self.backoff
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
