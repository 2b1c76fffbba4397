"""The state of a parameter outside its paging unit's forward: it holds no values, and touching it is an error.

While its unit runs, a parameter is an ordinary `nn.Parameter` whose `.data` views its page (or a gathered copy of
the pages it spans). Outside, its class is `UnboundParameter`: every torch operation on it raises
`ParameterAccessError` naming the parameter and its unit, instead of computing with a placeholder. Metadata that
needs no values stays readable (shape, dtype, device, requires_grad, grad, numel, ...), so counting parameters,
HuggingFace's `model.dtype`, printing the model and autograd's gradient accumulation keep working. Its `.data` is
then a placeholder of the right shape on the compute device (a broadcast zero-element-stride tensor: autograd's
AccumulateGrad reads its sizes and clones gradients contiguously because of the zero strides), never read.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from angel_ptm.errors import ParameterAccessError

# Tensor attributes and methods that read metadata only (or the gradient, which autograd writes while the
# parameter is unbound): allowed on an unbound parameter.
_METADATA = frozenset({
    "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "grad", "grad_fn", "names",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "is_xpu", "is_mps",
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "get_device",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "_backward_hooks",
    "_post_accumulate_grad_hooks", "__hash__", "itemsize", "nbytes", "is_signed", "_is_view", "__len__",
})


def _name_of(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property: the descriptor carries the attribute's name
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class UnboundParameter(nn.Parameter):
    """An `nn.Parameter` whose values live in pages, outside its unit's forward (see the module docstring)."""

    def __new__(cls, *args, **kwargs):
        raise TypeError("UnboundParameter is not constructed: the engine sets it as a parameter's class")

    def __reduce_ex__(self, protocol):
        raise ParameterAccessError(f"parameter '{self.__dict__.get('_angel_name', '?')}': {NOT_COPIED}")

    def __deepcopy__(self, memo):
        raise ParameterAccessError(f"parameter '{self.__dict__.get('_angel_name', '?')}': {NOT_COPIED}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _name_of(func)
        if name in _METADATA:
            if name == "grad" and getattr(func, "__name__", "") == "__get__":
                _check_grad_readable(args[0])
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **(kwargs or {}))
            if name == "register_post_accumulate_grad_hook":  # the engine's hook, which takes .grad, stays last
                hooks, ours = args[0]._post_accumulate_grad_hooks, args[0].__dict__.get("_angel_grad_hook")
                if hooks is not None and ours in hooks:
                    hooks[ours] = hooks.pop(ours)  # (autograd walks the dict's own order, not move_to_end's)
            return result
        if func is torch.Tensor.__repr__:
            param = args[0]
            return (f"UnboundParameter({param.__dict__.get('_angel_name', '?')}, shape={tuple(param.shape)}, "
                    f"dtype={param.dtype}: values in pages, unit {param.__dict__.get('_angel_unit', '?')!r})")
        unbound = list(dict.fromkeys(a for a in _tensors(args, kwargs) if type(a) is UnboundParameter))
        owners = {id(_owner(p)): _owner(p) for p in unbound}  # the engines they belong to (an EMA's op: two)
        owner = next(iter(owners.values())) if len(owners) == 1 else None
        # `.data` and `.detach()` record no autograd, with gradients on too; `p.data = t` would replace a copy's
        setting = name == "data" and getattr(func, "__name__", "") != "__get__"
        detached = name in ("data", "detach") and not setting
        resolved = owner.resolve(unbound, detached) if owner is not None and not setting else None
        route = None
        if len(owners) > 1 and None not in owners.values() and not setting:
            parts = [o.resolve([p for p in unbound if _owner(p) is o], detached) for o in owners.values()]
            if all(isinstance(part, dict) for part in parts):  # each engine's parameters read as copies of its own
                resolved = {k: v for part in parts for k, v in part.items()}
                owner, route = next(iter(owners.values())), lambda p: _owner(p).outside_writes
        if resolved is True:  # bound now (a recomputation in backward): the op runs on their values
            return func(*args, **(kwargs or {}))
        if isinstance(resolved, dict):  # no autograd to record: the op runs on copies of their values, and what it
            # writes into them goes into the pages (outside_writes.py)
            one = lambda a: resolved.get(id(a), a) if type(a) is UnboundParameter else a  # noqa: E731
            # (`.data` of the copy would count its writes apart: a view of it shares its version counter)
            op = _same_version_alias if name == "data" else func  # (the getter: the setter is refused below)
            return owner.outside_writes.run(op, args, kwargs, unbound, resolved, lambda tree: tree_map(one, tree),
                                            route)
        offender = unbound[0] if unbound else None
        name = offender.__dict__.get("_angel_name", "?") if offender is not None else "?"
        unit = offender.__dict__.get("_angel_unit", "?") if offender is not None else "?"
        if _name_of(func) in MOVES or setting:  # model.to(...), .cpu(), .half(), .share_memory(), p.data = t
            raise ParameterAccessError(
                f"parameter '{name}': a model an engine manages is not moved, cast or given new tensors "
                f"({_name_of(func)}: model.to/.cpu/.cuda/.half/.float/.double, p.data = ...): its values live in "
                f"pages on the tiers the config chose; set trainer.device and trainer.dtype before "
                f"angel_ptm.initialize, or close the engine first (the model then holds ordinary tensors)")
        raise ParameterAccessError(
            f"parameter '{name}' used outside the forward of its paging unit '{unit}' ({_name_of(func) or func}): "
            f"its values live in pages; read it with engine.parameter('{name}') or engine.state_dict(), or make "
            f"the module that uses it part of that unit (initialize(..., units=...))")


MOVES = frozenset(("_has_compatible_shallow_copy_type", "_to_copy", "to", "cpu", "cuda", "half", "float",
                   "double", "bfloat16", "share_memory_", "set_", "_share_memory_", "is_shared"))

NOT_COPIED = ("a model an engine manages is not pickled or deep-copied (torch.save(model), copy.deepcopy(model)): its "
              "values live in the engine's pages and its modules carry the engine's hooks; save engine.state_dict() "
              "or engine.save_checkpoint(), or load engine.state_dict() into a model built again for a plain copy")


class EngineHook:
    """A hook the engine puts on a user's module, called as the function it wraps; pickling or deep-copying it (what
    torch.save(model) and copy.deepcopy(model) reach first) is a ParameterAccessError saying what to do instead."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        raise ParameterAccessError(NOT_COPIED)

    def __deepcopy__(self, memo):
        raise ParameterAccessError(NOT_COPIED)


def _same_version_alias(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor.data`'s values, viewed: a write through the view bumps `tensor`'s version counter."""
    return tensor.view(tensor.shape)


def _tensors(args, kwargs):
    for value in tree_leaves((tuple(args), dict(kwargs or {}))):
        if isinstance(value, torch.Tensor):
            yield value


def manage(param: nn.Parameter, owner) -> None:
    """`param` is the binder `owner`'s:
    - `owner.resolve(params)` is called when unbound `params` are used: True once it bound them, a dict id(param)
      -> tensor to use in their place (a copy, where no autograd records the op), or None (the use is an error);
    - while `owner.grads_pending` (between a backward and the step, outside backward) reading `param.grad` is an
      error: the gradient is in the grad pages, not in `.grad`, and torch's own clipping or zero_grad would see
      None and silently do nothing."""
    # (weakly: a graph the model keeps, say a loss it stores on itself, holds its leaves from C++, where the
    # collector cannot see the cycle parameter -> binder -> model -> graph)
    param.__dict__["_angel_owner"] = weakref.ref(owner)


def _owner(param):
    ref = param.__dict__.get("_angel_owner")
    return ref() if ref is not None else None


def _check_grad_readable(param) -> None:
    owner = _owner(param)
    if owner is not None and owner.grads_pending and not owner.in_backward:
        name = param.__dict__.get("_angel_name", "?")
        raise ParameterAccessError(
            f"'{name}'.grad read between engine.backward and engine.step: the engine holds gradients in pages, not "
            f"in .grad (torch.nn.utils.clip_grad_norm_ or model.zero_grad() would see None and do nothing); use "
            f"engine.clip_grad_norm(max_norm) or engine.zero_grad()")


def label(param: nn.Parameter, name: str, unit: str) -> None:
    """Name a parameter for its errors (kept in its __dict__, which survives class changes)."""
    param.__dict__["_angel_name"] = name
    param.__dict__["_angel_unit"] = unit


def bind(param: nn.Parameter, data: torch.Tensor) -> None:
    """Give `param` values: an ordinary Parameter viewing `data`."""
    param.__class__ = param.__dict__.get("_angel_class", nn.Parameter)
    param.data = data


def unbind(param: nn.Parameter, placeholder: torch.Tensor) -> None:
    """Take `param`'s values away: the placeholder as data, and the guarding class."""
    if type(param) is not UnboundParameter:
        param.__dict__.setdefault("_angel_class", type(param))
        param.data = placeholder
        param.__class__ = UnboundParameter


def release(param: nn.Parameter, data: torch.Tensor) -> None:
    """The engine lets go of `param` for good (close): its own class again, with ordinary values."""
    param.__class__ = param.__dict__.pop("_angel_class", nn.Parameter)
    param.data = data
    param.__dict__.pop("_angel_name", None)
    param.__dict__.pop("_angel_unit", None)
    param.__dict__.pop("_angel_owner", None)
    param.__dict__.pop("_angel_grad_hook", None)


def placeholder(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of `param`'s shape and dtype holding one element (zero strides): what an unbound parameter's data is."""
    return torch.zeros((), dtype=param.dtype, device=device).expand(param.shape)  # (a 0-dim parameter too)
