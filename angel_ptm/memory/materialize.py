"""Materializing a model built on the meta device straight into its pages, one module at a time.

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)                                  # shapes only: no memory, no random numbers drawn
    engine = angel_ptm.initialize(model, config)          # every parameter written into its pages here

A 4-billion-parameter model's fp32 weights alone are 16 GB, so it cannot be built in memory and then copied into
pages. Here each module's own parameters get a working copy in one scratch buffer (sized for the largest module
and reused), are initialized there, written into their pages, and the scratch moves on to the next module.

Which values. A model built normally draws from torch's global CPU generator twice over: while it is constructed,
every layer runs its own `reset_parameters()` (nn.Linear, nn.Embedding, ...), in construction order; then a
model-wide rule may overwrite them (GPT.init_weights). Materialization replays both:
  1. construction: for every module in registration order (`named_modules`), `reset_parameters()` on the working
     copy, recording the generator state before each one;
  2. the model's rule, if the model defines `init_module(name, module)` (GPT does): per module, in the same order,
     the working copy is reset again from the state recorded in (1) — the same values as then — and
     `init_module` runs on it, drawing from where the previous `init_module` stopped. A module whose parameters
     were all materialized already (a tied weight) is skipped, as GPT.init_weights skips it.
Guarantee: `torch.manual_seed(s)`, build on meta, `initialize` gives parameters bit-identical to
`torch.manual_seed(s)`, build normally — and leaves the generator in the same state — provided
  - the whole model was built on meta, with no random draws between building it and `initialize`;
  - each module's construction-time randomness is its own `reset_parameters()` (true of torch's layers), called
    in registration order (true when submodules are created as they are assigned);
  - the model's post-construction rule is `init_module` applied per module in registration order (GPT's is).
Otherwise each parameter still follows its layer's or model's init rule, deterministically, but with other draws.
A parameter that neither step sets (its module has no `reset_parameters()` and `init_module` leaves it alone) is
an error that names it, never uninitialized memory: working copies start as NaN and are checked. Parameters built
off the meta device keep their values (their modules still replay their draws, as their constructors made them).

Cost: one scratch buffer of the largest module's own parameters; the generator runs twice over the
construction-time draws (once to reach the state in which the model's rule starts, once to regenerate values).

Tensor parallelism: a parameter that is one rank's shard of a larger tensor (its module's `tp_shards`,
angel_ptm/parallel/tensor) gets a working copy of the full tensor's shape, initialized by the same rules and draws as
one rank's build, and only this rank's slice is written: the shards equal the slices of the 1-rank values (the
scratch is sized for full tensors).

Expert parallelism: a layer that keeps only this rank's experts (parallel/moe) names the experts it had
(`unsplit_children`); every one of them replays its draws in the 1-rank order and only this rank's are written, so
each rank's experts equal the 1-rank build's (`registration_order`).

Buffers on the meta device (GPT's RoPE tables) are materialized on the compute device and filled by their
module's `reset_buffers()`.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from angel_ptm.errors import ConfigValueError
from angel_ptm.memory.layout import ALIGN_BYTES, TensorSlot

WriteSlot = Callable[[TensorSlot, torch.Tensor], None]  # (slot, the tensor's values, flat) -> into its pages


@dataclass(frozen=True)
class MaterializeReport:
    modules: int  # modules that own parameters
    parameters: int  # distinct tensors written
    bytes_written: int
    scratch_bytes: int  # the only parameter memory held at once: the largest module's own parameters
    seconds: float


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(key, p) for key, p in module._parameters.items() if p is not None]


def _full_shape(module: nn.Module, key: str, p: torch.Tensor) -> tuple[int, ...]:
    """The shape `module`'s init rule works on: a tensor-parallel shard's full tensor (parallel/tensor/layers.py)."""
    shard = getattr(module, "tp_shards", {}).get(key)
    return tuple(p.shape) if shard is None else shard.full_shape


def _nbytes(module: nn.Module, key: str, p: torch.Tensor) -> int:
    return _aligned(math.prod(_full_shape(module, key, p)) * p.element_size())


def _working_copy(module: nn.Module, scratch: torch.Tensor, fill: bool = True) -> nn.Module:
    """A shallow copy of `module` whose own parameters (and meta buffers) are real CPU tensors, the parameters
    views of `scratch` filled with NaN (so a value nobody sets is caught). Its children are the real ones."""
    work = copy.copy(module)
    work._parameters = dict(module._parameters)
    offset = 0
    for key, p in _own_parameters(module):
        shape = _full_shape(module, key, p)
        nbytes = math.prod(shape) * p.element_size()
        view = scratch[offset : offset + nbytes].view(p.dtype).view(shape)
        if fill:
            view.fill_(float("nan") if p.dtype.is_floating_point else 0)
        work._parameters[key] = nn.Parameter(view, requires_grad=p.requires_grad)
        offset += _aligned(nbytes)
    work._buffers = {key: torch.empty(b.shape, dtype=b.dtype) if b is not None and b.is_meta else b
                     for key, b in module._buffers.items()}
    return work


def _has_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def materialize_parameters(model: nn.Module, slots: dict[str, TensorSlot], write: WriteSlot) -> MaterializeReport:
    """Initialize every parameter of `model` one module at a time (see the module docstring for which values),
    hand each to `write` with its slot, then leave the meta parameters as empty CPU placeholders of their shape
    (the same Parameter objects, so ties and outside references hold)."""
    t0 = time.perf_counter()
    names = {id(p): name for name, p in model.named_parameters()}  # a shared parameter: its first name
    order = registration_order(model)
    owners = [(name, module) for name, module, _ in order if _own_parameters(module)]
    elsewhere = {id(module) for _, module, kept in order if not kept}  # another rank's experts: draws only
    scratch_bytes = max((sum(_nbytes(m, key, p) for key, p in _own_parameters(m)) for _, m in owners), default=0)
    scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
    init_module = getattr(model, "init_module", None)
    written: set[int] = set()
    bytes_written = 0

    def emit(name: str, module: nn.Module, work: nn.Module) -> None:
        nonlocal bytes_written
        if id(module) in elsewhere:
            return
        for key, p in _own_parameters(module):
            if id(p) in written:
                continue
            value = work._parameters[key] if p.is_meta else p.detach()
            shard = getattr(module, "tp_shards", {}).get(key)
            if p.is_meta and shard is not None:  # initialized whole, as one rank would; this rank keeps its slice
                value = shard.take(value)
            if p.is_meta and value.dtype.is_floating_point and torch.isnan(value).any():
                raise ConfigValueError(
                    f"model: parameter '{names[id(p)]}' is on the meta device and nothing initializes it: neither "
                    f"{type(module).__name__}.reset_parameters() nor the model's init_module(name, module) sets "
                    f"it; build module '{name}' off the meta device or give the model an init_module")
            write(slots[names[id(p)]], value.detach().contiguous().reshape(-1))
            written.add(id(p))
            bytes_written += p.numel() * p.element_size()

    with torch.no_grad():
        if init_module is None:  # the values are the construction-time ones: one pass
            for name, module in owners:
                work = _working_copy(module, scratch)
                if _has_reset(work):  # a tied module too: its constructor drew before the weight was tied
                    work.reset_parameters()
                emit(name, module, work)
        else:
            construction_states = []
            for _, module in owners:  # pass 1: replay construction, to know where each module's draws start
                construction_states.append(torch.get_rng_state())
                if _has_reset(module):
                    _working_copy(module, scratch, fill=False).reset_parameters()
            rule_state = torch.get_rng_state()  # where the model's rule starts drawing
            for (name, module), state in zip(owners, construction_states):
                if all(id(p) in written for _, p in _own_parameters(module)):
                    continue  # tied: the model's rule initializes a shared weight once
                work = _working_copy(module, scratch)
                if _has_reset(work):
                    torch.set_rng_state(state)
                    work.reset_parameters()
                    torch.set_rng_state(rule_state)
                init_module(name, work)
                rule_state = torch.get_rng_state()
                emit(name, module, work)
            torch.set_rng_state(rule_state)
    del scratch

    for p in [p for p in model.parameters() if p.is_meta]:  # their values live in pages now
        empty = torch.zeros((), dtype=p.dtype).expand(p.shape)
        torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))
    return MaterializeReport(len(owners) - len(elsewhere), len(written), bytes_written, scratch_bytes,
                             time.perf_counter() - t0)


def registration_order(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, kept) for every module in `model.named_modules()`'s order, except that a module split from
    outside (expert parallelism: its `unsplit_children`, child name -> the modules that child held before the split)
    walks the modules it held, under their unsplit names, with kept False for those this rank no longer holds:
    their construction and the model's rule still draw, in the 1-rank order, so this rank's modules get the values
    a 1-rank build gives them."""
    out: list[tuple[str, nn.Module, bool]] = []
    seen: set[int] = set()

    def walk(module: nn.Module, name: str, kept: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        out.append((name, module, kept))
        unsplit = getattr(module, "unsplit_children", None) or {}
        for child_name, child in module._modules.items():
            if child is None:
                continue
            full = f"{name}.{child_name}" if name else child_name
            if child_name in unsplit:
                held = {id(m) for m in child.children()}
                seen.add(id(child))
                out.append((full, child, kept))
                for index, member in enumerate(unsplit[child_name]):
                    walk(member, f"{full}.{index}", kept and id(member) in held)
            else:
                walk(child, full, kept)

    walk(model, "", True)
    return out


def buffers_onto(model: nn.Module, device: torch.device, compute_dtype: torch.dtype | None = None) -> None:
    """Every buffer of `model` on `device`: those on the meta device computed there first. `compute_dtype` (mixed
    precision): the floating buffers of a module with floating parameters of its own (batch norm's running
    statistics) in that dtype too, as its parameters are, the way `model.to(dtype)` leaves them (torch's kernels
    take them in the parameters' dtype); a module without parameters keeps its buffers' dtypes (RoPE tables).
    Returns the dtypes the cast buffers had, for `buffers_back`."""
    materialize_buffers(model, device)
    cast_from = {}
    for name, module in model.named_modules():
        cast = compute_dtype is not None and any(p.is_floating_point() for p in module.parameters(recurse=False))
        for key, buffer in module._buffers.items():
            if buffer is None:
                continue
            dtype = compute_dtype if cast and buffer.is_floating_point() else buffer.dtype
            if dtype != buffer.dtype:
                cast_from[(id(module), key)] = buffer.dtype
            if buffer.device != device or buffer.dtype != dtype:
                module._buffers[key] = buffer.to(device, dtype)
    return cast_from


def buffers_back(model: nn.Module, cast_from: dict) -> None:
    """The engine closes: the model's buffers on the CPU beside its parameters, those `buffers_onto` cast to the
    compute dtype back in their own (fp32 running statistics beside the fp32 weights the model keeps)."""
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to("cpu", cast_from.get((id(module), key), buffer.dtype))


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Give every buffer on the meta device real memory on `device`, filled by its module's `reset_buffers()`."""
    for name, module in model.named_modules():
        meta = [key for key, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        reset = getattr(module, "reset_buffers", None)
        if not callable(reset):
            raise ConfigValueError(
                f"model: buffer '{name + '.' if name else ''}{meta[0]}' is on the meta device and "
                f"{type(module).__name__} has no reset_buffers() to compute it; build that module off the meta device")
        for key in meta:
            b = module._buffers[key]
            module._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device=device)
        with torch.no_grad():
            reset()
