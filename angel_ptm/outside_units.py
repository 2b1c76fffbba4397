"""Parameters used outside their paging unit's forward (binding.py's ParamBinder takes these methods).

Outside its unit's forward a parameter is an `UnboundParameter` (guard.py), whose uses are errors, except:
- `module.state_dict()`: the module's unbound parameters take copies of their values while it runs;
- a recomputation the model makes itself in the engine's backward (its own activation checkpointing) and a use
  with no autograd recording (`resolve`).
And what an interrupted forward or backward leaves outside the units: open units, stray `.grad`s.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from angel_ptm import guard
from angel_ptm.memory import Tier


class OutsideUnits:
    def resolve(self, params: list[nn.Parameter]):
        """Unbound `params` used outside their units' forward (guard.manage).
        - In the engine's backward with gradients on, the model recomputes some forward itself without running
          the unit's hooks (HuggingFace's gradient checkpointing wraps a layer's `forward`; torch.utils.checkpoint
          inside a unit): each owning unit is bound to copies of its values, as a recomputed unit is, until the
          next such unit or the end of backward (a recomputation's saved tensors hold their copies).
        - With no autograd recording (torch.no_grad, inference_mode): the op gets copies of the
          values (a method of the model other than its forward: HuggingFace's encoder-decoder `generate` runs the
          encoder by itself, CLIP's `get_text_features`).
        Anything else stays an error: autograd would record a use whose gradient has no page to go to."""
        if any(id(p) not in self._unit_of for p in params):
            return None
        if self.in_backward and torch.is_grad_enabled():
            for unit in dict.fromkeys(self._unit_of[id(p)] for p in params):
                if unit not in self._lazy_units:
                    self.release_lazy()
                    self.bind_copies(unit)
                    self._lazy_units.append(unit)
            return True
        if not torch.is_grad_enabled():  # (in backward too: a reentrant checkpoint's forward inside a recomputation)
            copies = {}
            for param in params:
                pages = self.unit_pages[id(self._unit_of[id(param)])]
                self.param_access.acquire(pages, Tier.DEVICE, read_only=True)
                try:
                    with _disable_current_modes():
                        copies[id(param)] = self._param_view(self.slots[id(param)]).clone()
                finally:
                    self.param_access.release(pages)
            return copies
        return None

    def release_lazy(self) -> None:
        """Unbind the units `resolve` bound to copies in backward (their recomputation is over)."""
        while self._lazy_units:
            self.unbind_copies(self._lazy_units.pop())

    # ------------------------------------------------------------------ state dicts
    def _before_state_dict(self, module: nn.Module, _prefix, _keep_vars) -> None:
        """Unbound parameters of `module` take copies of their values while its state_dict() runs."""
        if self.read_values is None:
            return
        bound = [p for p in module.parameters(recurse=False) if id(p) not in self._bound]
        for param in bound:
            guard.bind(param, self.read_values(self.slots[id(param)]))
        self._state_dict_bound.setdefault(id(module), []).extend(bound)

    def _after_state_dict(self, module: nn.Module, *_args) -> None:
        for param in self._state_dict_bound.pop(id(module), []):
            guard.unbind(param, self._placeholders[id(param)])

    # ------------------------------------------------------------------ interrupted calls
    def abort_forward(self) -> None:
        """The model's forward was interrupted where a unit's forward hook could not run (a KeyboardInterrupt,
        which torch's always-call hooks do not catch): unbind every unit still open and release its pages."""
        while self._copied_units:
            self.unbind_unit(self._copied_units[-1])
        while self._open_units:
            self.unbind_unit(self._open_units[-1])

    def drop_stray_grads(self) -> None:
        """zero_grad: a `.grad` autograd left on a parameter that a backward interrupted before the engine's hook
        took it into the pages (the next backward would add to it) is dropped, as torch's zero_grad drops it."""
        with torch._C.DisableTorchFunctionSubclass():
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad = None
