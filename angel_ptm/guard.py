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

import torch
from torch import nn

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

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _name_of(func) in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is torch.Tensor.__repr__:
            param = args[0]
            return (f"UnboundParameter({param.__dict__.get('_angel_name', '?')}, shape={tuple(param.shape)}, "
                    f"dtype={param.dtype}: values in pages, unit {param.__dict__.get('_angel_unit', '?')!r})")
        offender = next((a for a in _tensors(args, kwargs) if type(a) is UnboundParameter), None)
        name = offender.__dict__.get("_angel_name", "?") if offender is not None else "?"
        unit = offender.__dict__.get("_angel_unit", "?") if offender is not None else "?"
        raise ParameterAccessError(
            f"parameter '{name}' used outside the forward of its paging unit '{unit}' ({_name_of(func) or func}): "
            f"its values live in pages; read it with engine.parameter('{name}') or engine.state_dict(), or make "
            f"the module that uses it part of that unit (initialize(..., units=...))")


def _tensors(args, kwargs):
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


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


def placeholder(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of `param`'s shape and dtype holding one element (zero strides): what an unbound parameter's data is."""
    return torch.zeros((), dtype=param.dtype, device=device).expand(param.shape)  # (a 0-dim parameter too)
