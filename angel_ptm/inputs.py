"""A forward's inputs on the compute device: every tensor among the arguments (inside lists, tuples, named tuples and
dicts too) moved there, and floating ones cast to the compute dtype under mixed precision (FSDP2's
cast_forward_inputs); integers (token ids, labels) keep their dtype."""

from __future__ import annotations

import torch


def to_device(value, device: torch.device, dtype: torch.dtype | None = None):
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        moved = [to_device(v, device, dtype) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    if isinstance(value, dict):
        return type(value)((k, to_device(v, device, dtype)) for k, v in value.items())
    return value
