"""Parameters used outside their paging unit's forward (binding.py's ParamBinder takes these methods).

Outside its unit's forward a parameter is an `UnboundParameter` (guard.py), whose uses are errors, except:
- `module.state_dict()`: the module's unbound parameters take copies of their values while it runs;
- a recomputation the model makes itself in the engine's backward (its own activation checkpointing) and a use
  with no autograd recording (`resolve`).
And what an interrupted forward or backward leaves outside the units: open units, stray `.grad`s.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from angel_ptm import guard
from angel_ptm.errors import EngineClosedError
from angel_ptm.memory import Tier


def weakly(method, gone=lambda *args: None):
    """`method` (bound) called through a weak reference to its object, returning its result; `gone(*args)` answers
    once the object was collected (a plain function, one put in the method's place, is called as it is). Autograd
    keeps a parameter's hooks and saved-tensor hooks in C++, where the garbage collector cannot see the cycle
    parameter -> hook -> binder -> model -> parameter: a strong hook would keep an engine dropped without close()
    alive for good."""
    if not hasattr(method, "__self__"):
        return method
    ref, func = weakref.ref(method.__self__), method.__func__

    def hook(*args):
        owner = ref()
        return gone(*args) if owner is None else func(owner, *args)
    return hook


def register_state_dict_post_hook(module: nn.Module, hook):
    """`register_state_dict_post_hook` where torch has it (2.5+), its private predecessor before."""
    register = getattr(module, "register_state_dict_post_hook", None) or module._register_state_dict_hook
    return register(guard.EngineHook(hook))  # (torch marks the hook with an attribute: not the bound method)


def keep(tensor):
    """Packing a saved tensor once the engine is gone: the tensor itself."""
    return tensor


def unpack_orphan(packed):
    """Unpacking once the engine is gone: a saved activation is still there; a parameter saved as its page is not."""
    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(getattr(packed, "tensor", None), torch.Tensor):
        return packed.tensor
    raise EngineClosedError("backward through a graph whose engine is gone (dropped or closed): the parameters it "
                            "saved lived in the engine's pages")


class OutsideUnits:
    def resolve(self, params: list[nn.Parameter], detached: bool = False):
        """Unbound `params` used outside their units' forward (guard.manage).
        - In the engine's backward with gradients on, the model recomputes some forward itself without running
          the unit's hooks (HuggingFace's gradient checkpointing wraps a layer's `forward`; torch.utils.checkpoint
          inside a unit): each owning unit is bound to copies of its values (`bind_lazy`).
        - With no autograd recording (torch.no_grad, inference_mode; `detached`: `.data`, `.detach()`): the op gets
          copies of the values (a method of the model other than its forward: HuggingFace's encoder-decoder
          `generate` runs the encoder by itself, CLIP's `get_text_features`; `p.data.clamp_()` after a step), and
          what it writes into them goes into the pages (outside_writes.py).
        Anything else stays an error: autograd would record a use whose gradient has no page to go to."""
        if any(id(p) not in self._unit_of for p in params):
            return None
        self.outside_writes.settle(publish=False)  # (a view of their values written since: in first)
        if self.in_backward and torch.is_grad_enabled():
            for unit in dict.fromkeys(self._unit_of[id(p)] for p in params):
                self.bind_lazy(unit)
            return True
        if detached or not torch.is_grad_enabled():  # (in backward too: a reentrant checkpoint's recomputed forward)
            return {id(param): self.copy_of(param) for param in params}
        return None

    def copy_of(self, param: nn.Parameter) -> torch.Tensor:
        """A copy of an unbound parameter's values (its compute-dtype pages), on the compute device."""
        pages = self.unit_pages[id(self._unit_of[id(param)])]
        self.param_access.acquire(pages, Tier.DEVICE, read_only=True)
        try:
            with _disable_current_modes():
                return self._param_view(self.slots[id(param)]).clone()
        finally:
            self.param_access.release(pages)

    def weights_changed(self) -> None:
        """Every parameter's values changed (a step, a load): graphs saved before are stale."""
        self.weights_generation += 1

    def writes_refused(self) -> str | None:
        """Why a parameter cannot be written outside its unit now (OutsideWrites), or None."""
        if self.in_backward:
            return "the engine's backward runs"
        if self._hooks_on or self._open_units:
            return "a forward runs"
        return None

    def bind_lazy(self, unit) -> None:
        """Bind `unit` to copies of its values for the model's own recomputation in backward, until each of its
        trainable parameters has its gradient of this backward (or backward ends): a reentrant checkpoint's own
        backward, after the recomputed forward is over, reads the parameters autograd saved, which must still hold
        their values then."""
        if id(unit) not in self._lazy:
            self.bind_copies(unit, nested=False)
            self._lazy[id(unit)] = (unit, {id(p) for p in unit.params if p.requires_grad})

    def lazy_grad_in(self, param: nn.Parameter) -> None:
        """`param`'s gradient is in: its lazily bound unit is unbound once all of its are."""
        unit = self._unit_of.get(id(param))
        entry = self._lazy.get(id(unit)) if unit is not None else None
        if entry is not None:
            entry[1].discard(id(param))
            if not entry[1]:
                del self._lazy[id(unit)]
                self.unbind_copies(unit, nested=False)

    def release_lazy(self) -> None:
        """Unbind the units still bound to copies for the model's own recomputation (the end of backward)."""
        while self._lazy:
            unit, _ = self._lazy.popitem()[1]
            self.unbind_copies(unit, nested=False)

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
