"""The activation footprint of any model, traced: one forward on fake tensors (no memory, no compute) records what
autograd saves for backward, unit by unit, and the footprint follows the rules the binder measures by -- the same
ones models.gpt.activation_footprint writes out for our GPT.

    footprint = traced_footprint(model, example_inputs, units, config)   # ActivationFootprint(device, paged)

`example_inputs`: the forward's positional arguments (a tuple) or keyword arguments (a dict), as one micro-batch
calls it; tensors may be real or on the meta device (only shapes and dtypes are read). Under mixed precision the
parameters and floating inputs are traced in the compute dtype, as the engine runs them.

What is counted, as the binder counts it (binding.py, activations/recompute.py): each saved storage once, page
views (the parameters) never; with activations.checkpoint a checkpointed unit keeps its inputs (its boundary) and,
under `selective`, the outputs of its matrix products and fused attention kernels (recompute.saved_ops), while
backward's recomputation rebuilds one unit's saved tensors at a time; the peak is the end of forward or a unit's
recomputation (the units before it still holding theirs), whichever is larger. With activations.offload, saved
tensors of at least `offload_min_bytes` go into pages (without recomputation all of them, under it the
boundaries), the rest stay on the device.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from angel_ptm.activations.offload import reaches_far
from angel_ptm.activations.recompute import MODES, saved_ops
from angel_ptm.errors import ConfigValueError
from angel_ptm.models.gpt import ActivationFootprint


@dataclasses.dataclass
class UnitActivations:
    """What one checkpointable unit's forward saved (storage bytes, each once), its boundary (the inputs a
    checkpoint keeps) and the bytes of its matrix products' and attention kernels' outputs (selective keeps)."""

    saved: dict[int, int] = dataclasses.field(default_factory=dict)  # storage -> bytes
    boundary: dict[int, int] = dataclasses.field(default_factory=dict)
    produced: dict[int, int] = dataclasses.field(default_factory=dict)  # the selective policy's ops' outputs
    outputs: set = dataclasses.field(default_factory=set)  # the unit's output storages
    root_before: int = 0  # how many of the root's saved storages were saved before the unit ran

    @property
    def selective(self) -> int:
        """What selective recomputation keeps: its ops' outputs, less the unit's inputs and outputs (which are
        alive anyway, as the binder counts them)."""
        return sum(n for key, n in self.produced.items() if key not in self.outputs and key not in self.boundary)

    @property
    def boundary_saved(self) -> int:
        """Of the boundary, the bytes the unit's own forward saved (a unit whose first op saves its input)."""
        return sum(n for key, n in self.boundary.items() if key in self.saved)


@dataclasses.dataclass
class TracedActivations:
    """Saved-for-backward bytes of one micro-batch's forward: per checkpointable unit, in forward order, and the
    rest (`root`: saved outside every such unit)."""

    units: list[UnitActivations]
    root: dict[int, int]
    modules: list = dataclasses.field(default_factory=list)  # each unit's module
    unpaged: set = dataclasses.field(default_factory=set)  # storages saved as views the offloader leaves be
    # Per MoE layer: the storages its experts' forwards saved (traced at an even deal of the rows) and how many
    # experts ran. A routed run's sizes differ by expert: see `_experts_offloaded`.
    expert_saves: list = dataclasses.field(default_factory=list)

    def footprint(self, checkpoint="none", offload: bool = False, offload_min_bytes: int = 0) -> ActivationFootprint:
        """`checkpoint`: one mode for every unit, or a mode per unit (in `units`' order)."""
        modes = [checkpoint] * len(self.units) if isinstance(checkpoint, str) else list(checkpoint)
        if len(modes) != len(self.units) or any(mode not in MODES for mode in modes):
            raise ConfigValueError(f'activations.checkpoint: "none", "full" or "selective" for each of '
                                   f'{len(self.units)} units, got {checkpoint!r}')

        def paged(key: int, nbytes: int) -> bool:
            return offload and nbytes >= max(1, offload_min_bytes) and key not in self.unpaged

        bounded = self._experts_offloaded(max(1, offload_min_bytes)) if offload else {}

        def split(items) -> tuple[int, int]:  # (storage key, bytes) pairs
            device = on_pages = 0
            for key, n in items:
                if key in bounded:
                    device, on_pages = device + bounded[key][0], on_pages + bounded[key][1]
                elif paged(key, n):
                    on_pages += n
                else:
                    device += n
            return device, on_pages

        root_device, root_paged = split(self.root.items())
        root_sizes = list(self.root.items())
        kept, boundaries_paged, peak = 0, 0, 0
        counted = set(self.root)  # a storage is kept once however many units take it (a shared attention mask)
        for unit, checkpoint in zip(self.units, modes):
            if checkpoint == "none":  # autograd keeps what it saved, as the root's
                device, in_pages = split(unit.saved.items())
                kept += device
                boundaries_paged += in_pages
                counted.update(unit.saved)
                continue
            boundary = [(key, n) for key, n in unit.boundary.items() if key not in counted]
            counted.update(unit.boundary)
            boundary_device, boundary_paged = split(boundary)
            inside = unit.selective if checkpoint == "selective" else 0
            # Its recomputation rebuilds what its forward saved (the input it saved is the boundary, kept already)
            rebuilt = sum(unit.saved.values()) - unit.boundary_saved
            # ... while the units before it keep theirs, and what was saved outside units before it is alive
            peak = max(peak, kept + split(root_sizes[: unit.root_before])[0] + rebuilt)
            kept += inside + boundary_device
            boundaries_paged += boundary_paged
        return ActivationFootprint(max(kept + root_device, peak), boundaries_paged + root_paged)


    def _experts_offloaded(self, threshold: int) -> dict[int, tuple[int, int]]:
        """(device, paged) bytes to count for each storage an expert saved, under activations.offload. The trace
        deals the rows evenly, but a routed run gives each expert its own share: the layer's sum is the same,
        and a tensor stays on the device exactly when it is under `threshold` bytes. So, per layer, of the
        tensors that may reach the threshold (all the rows to one expert would), the device holds at most
        min(their sum, their count x threshold) -- shared out over them -- and the pages at most their sum; the
        rest stay on the device as traced. Upper bounds, both (a skewed run measured 17.7x the even deal's
        device bytes here)."""
        sizes: dict[int, int] = dict(self.root)
        for unit in self.units:
            sizes.update(unit.saved)
        bounded: dict[int, tuple[int, int]] = {}
        for keys, experts in self.expert_saves:
            may_page = {k: sizes[k] for k in keys if k in sizes and k not in self.unpaged
                        and sizes[k] * max(1, experts) >= threshold}
            total = sum(may_page.values())
            on_device = min(total, len(may_page) * (threshold - 1))
            for key, n in may_page.items():
                bounded[key] = (-(-on_device * n // total), n)
        return bounded


class _Producers(TorchDispatchMode):
    """Notes the storages the selective policy's ops create (their outputs are what `selective` keeps), and the
    real size of outputs whose fake kernel gives a wrong one (`sizes`: storage -> bytes; `_REAL_SIZES`)."""

    def __init__(self):
        super().__init__()
        self.unit: UnitActivations | None = None
        self.alive: list[torch.Tensor] = []  # (fake: no memory) a freed storage's key could name a new one
        self.sizes: dict[int, int] = {}

    def nbytes(self, tensor: torch.Tensor) -> int:
        key = _storage_key(tensor)
        return self.sizes.get(key, tensor.untyped_storage().nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        real = _REAL_SIZES.get(func)
        if real is not None:
            index, size_of = real
            self.alive.append(out[index])
            self.sizes[_storage_key(out[index])] = size_of(args, kwargs or {})
        if self.unit is not None and func.overloadpacket in saved_ops():
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.alive.append(leaf)
                    self.unit.produced[_storage_key(leaf)] = leaf.untyped_storage().nbytes()
        return out


def _storage_key(tensor: torch.Tensor) -> int:
    return StorageWeakRef(tensor.untyped_storage()).cdata


PROBE_STEPS = 16  # the longest sequence a recurrent kernel's workspace is measured at (longer ones: extrapolated)


def _mkldnn_rnn_workspace(args, kwargs) -> int:
    """The bytes of the workspace oneDNN's recurrent layer (CPU nn.LSTM's kernel) saves for backward. Its fake
    kernel says 0 (oneDNN alone knows the size: gates and states of every step, in page-aligned parts), so the
    real kernel is run on zeros of the same shapes outside the fake mode: at the sequence's own length up to
    PROBE_STEPS, beyond it at PROBE_STEPS / 2 and PROBE_STEPS, extrapolated linearly in the length (within a few
    percent of the real size: the parts' alignment). 0 where the probe fails (the trace then undercounts it)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    time_dim = 1 if args[14] else 0  # (input, 4 weights, hx, cx, reverse, batch_sizes, mode, hidden, layers,
    steps = args[0].shape[time_dim]  # has_biases, bidirectional, batch_first, train)

    def measured(length: int) -> int:
        shape = list(args[0].shape)
        shape[time_dim] = length
        real = [torch.zeros(shape, dtype=args[0].dtype)] + [
            torch.zeros(tuple(a.shape), dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args[1:]]
        out = torch.ops.aten.mkldnn_rnn_layer.default(*real, **kwargs)
        return out[3].untyped_storage().nbytes() if out[3] is not None else 0

    try:
        with unset_fake_temporarily():
            if steps <= PROBE_STEPS:
                return measured(steps)
            half, full = measured(PROBE_STEPS // 2), measured(PROBE_STEPS)
            return full + (full - half) * (steps - PROBE_STEPS) // (PROBE_STEPS - PROBE_STEPS // 2)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return 0


# Ops whose fake kernel gives an output a size other than the real one: op -> (output index, its real bytes)
_REAL_SIZES = {op: (3, _mkldnn_rnn_workspace)
               for op in [getattr(getattr(torch.ops.aten, "mkldnn_rnn_layer", None), "default", None)] if op}


def trace_activations(model: nn.Module, example_inputs, checkpointed: list[nn.Module],
                      compute_dtype: torch.dtype | None = None,
                      device: torch.device | None = None) -> TracedActivations:
    """One forward of `model` on fake tensors with `example_inputs` (a tuple of positional arguments or a dict of
    keyword arguments), what autograd saves recorded per module of `checkpointed` (outermost ones: a unit inside
    another is part of it). The model is left as it was. `device`: where the fake tensors say they are, so the
    kernels the device would run are traced (default: the parameters' device; the CPU for a meta-device model)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = (example_inputs, {}) if isinstance(example_inputs, (tuple, list)) else ((), example_inputs)
    if not isinstance(kwargs, dict):
        raise ConfigValueError(f"example_inputs: a tuple of positional arguments or a dict of keyword arguments, "
                               f"got {type(example_inputs).__name__}")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":  # a model built on the meta device: the kernels are the CPU's
        device = torch.device("cpu")
    outer = {id(m) for m in checkpointed}
    tops = [m for name, m in model.named_modules() if id(m) in outer
            and not any(id(a) in outer for a in _ancestors(model, name))]
    units = [UnitActivations() for _ in tops]
    root: dict[int, int] = {}
    unpaged: set[int] = set()
    seen: set[int] = set()
    current: list[UnitActivations | None] = [None]
    in_expert: list[int] = []  # the MoE layer whose expert is running (its index in expert_saves), if any
    expert_saves: list[tuple[set, int]] = []
    params: set[int] = set()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    producers = _Producers()

    def fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        dtype = compute_dtype if compute_dtype is not None and t.is_floating_point() else t.dtype
        with mode:
            return torch.empty(tuple(t.shape), dtype=dtype, device=device)

    def scalar(t):
        """A 0-dim buffer with its value (a fake constant: a forward may read it, as DTS-Gate reads its step)."""
        value = t.item()  # (outside the mode, which refuses to read a value)
        with mode:
            return torch.tensor(value, dtype=t.dtype, device=device)

    def pack(tensor):
        key = _storage_key(tensor)
        if key not in params and key not in seen:
            seen.add(key)
            if reaches_far(tensor):
                unpaged.add(key)
            if in_expert:
                expert_saves[in_expert[-1]][0].add(key)
            producers.alive.append(tensor)
            (current[0].saved if current[0] is not None else root)[key] = producers.nbytes(tensor)
        return tensor

    def enter(unit):
        def hook(_module, hook_args, hook_kwargs):
            current[0], producers.unit = unit, unit
            unit.root_before = len(root)
            for t in tree_leaves((hook_args, hook_kwargs)):
                if isinstance(t, torch.Tensor) and (key := _storage_key(t)) not in params:
                    unit.boundary[key] = t.untyped_storage().nbytes()
                    producers.alive.append(t)
        return hook

    def leave(_module, _args, _kwargs, out):
        if current[0] is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    current[0].outputs.add(_storage_key(t))
                    producers.alive.append(t)
        current[0] = producers.unit = None

    with ExitStack() as stack:
        for module, unit in zip(tops, units):
            stack.callback(module.register_forward_pre_hook(enter(unit), with_kwargs=True).remove)
            stack.callback(module.register_forward_hook(leave, with_kwargs=True, always_call=True).remove)
        state = {name: fake(t) for name, t in model.named_parameters()}
        state.update((name, scalar(t) if t.dim() == 0 and not t.is_meta else fake(t))
                     for name, t in model.named_buffers())
        for name, p in model.named_parameters():
            params.add(_storage_key(state[name]))
            state[name].requires_grad_(p.requires_grad)
        fake_args, fake_kwargs = tree_map(fake, (tuple(args), dict(kwargs)))
        stack.enter_context(_refusing_collectives())
        stack.enter_context(_routing_at_bound(model, in_expert, expert_saves))
        stack.enter_context(mode)
        stack.enter_context(producers)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(torch.enable_grad())
        stack.callback(_restore, _tensors_of(model))  # (torch's restore misses a module registered twice)
        torch.func.functional_call(model, state, fake_args, fake_kwargs, strict=False, tie_weights=True)
    return TracedActivations(units, root, tops, unpaged, expert_saves)


def _tensors_of(model: nn.Module) -> list:
    """Every (module, dict, name, tensor) of the model's parameters and buffers, shared modules once each."""
    out = []
    for module in model.modules():  # (each module once, however often it is registered)
        for table in (module._parameters, module._buffers):
            out.extend((table, name, tensor) for name, tensor in table.items())
    return out


def _restore(tensors: list) -> None:
    """Put back the model's own parameters and buffers, whatever the trace left in their place."""
    for table, name, tensor in tensors:
        if table.get(name) is not tensor:
            table[name] = tensor


@contextmanager
def _refusing_collectives():
    """A collective during the trace raises (it would hand fake tensors to the process group)."""
    from angel_ptm.parallel.collectives import FAKE_TRACE

    FAKE_TRACE.on = True
    try:
        yield
    finally:
        FAKE_TRACE.on = False


@contextmanager
def _routing_at_bound(model: nn.Module, in_expert: list | None = None, expert_saves: list | None = None):
    """Our MoE layers (models/moe.py) run their experts on a fixed number of rows during the trace (fake tensors
    have no values to route by: `combine_at_bound`), and count no routing statistics; an expert-parallel one
    (parallel/moe) its own experts, with no all-to-all (the ranks' loads taken as balanced). BASE's gate, whose
    auction bids with the scores' values, deals the tokens to the experts in order (exactly balanced, as the
    auction is). `in_expert`: the index of the layer whose expert runs is pushed on it meanwhile, and
    `expert_saves` gets a (storages, experts) entry per layer for the caller to fill."""
    from angel_ptm.models.gates import BaseGate
    from angel_ptm.models.moe import MoE, combine_at_bound

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    hooks = []
    for index, layer in enumerate(layers):
        layer.combine = lambda flat, routing, layer=layer: combine_at_bound(flat, routing, layer.experts,
                                                                            layer.spec.experts)
        layer.stats.add = lambda routing: None
        if in_expert is not None and expert_saves is not None:
            expert_saves.append((set(), len(layer.experts)))
            def enter(*_, index=index) -> None:
                in_expert.append(index)

            def leave(*_) -> None:
                in_expert.pop()

            for expert in layer.experts:
                hooks.append(expert.register_forward_pre_hook(enter))
                hooks.append(expert.register_forward_hook(leave, always_call=True))
    bases = [m for m in model.modules() if isinstance(m, BaseGate)]  # BASE: exactly balanced, whatever the scores
    for gate in bases:
        gate.assign = lambda scores, capacity: torch.arange(scores.shape[0], device=scores.device) // capacity
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for layer in layers:
            del layer.combine, layer.stats.add
        for gate in bases:
            del gate.assign


def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".") if name else []
    return [model.get_submodule(".".join(parts[:i])) for i in range(len(parts))]
