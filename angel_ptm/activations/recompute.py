"""Recomputation per paging unit (activations.checkpoint: full | selective; per unit type: activations.unit_modes).

A checkpointed unit's forward runs under `torch.utils.checkpoint` (non-reentrant, RNG state restored):

- full: autograd keeps only the unit's inputs; backward runs the forward again to rebuild everything it saved.
- selective: the forward also keeps the outputs of its matrix products and fused attention kernels
  (`SAVED_OPS`: costly to recompute, one row of `dim` per token) and recomputes the rest -- norms, activation
  functions, softmax, dropout, elementwise ops, the [seq, seq] scores of an unfused attention -- Megatron's
  selective recomputation, for any module: two dispatch modes keep those outputs in the forward and give them
  back in the recomputation (`_Kept`; as torch's selective-checkpoint cache, but an output the forward then
  writes in place is copied before the write).

In backward the unit's parameters are bound to copies brought from their pages for the recomputation alone (the
binder's `bind_copies`): the recomputed saved tensors view no page, since pages may move before backward reads them.
Checkpoint saves the unit's inputs as saved tensors, through the binder's hooks: they are counted there and, with
activations.offload, go into activation pages like any saved tensor.

The outputs selective keeps and the tensors a recomputation rebuilds are counted into the binder's activation
count, which the scheduler's trace records at every access: measured, not modelled (`_Outputs` watches the
storages the unit's ops create and counts those still alive).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from contextlib import nullcontext
from typing import Callable, TypeVar

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from angel_ptm.errors import ActivationError, ConfigValueError, EngineClosedError
from angel_ptm.parallel.activation_watch import ACTIVATION_WATCH


@functools.cache
def saved_ops() -> frozenset:
    """The ops whose outputs selective recomputation keeps: matrix products and fused attention kernels."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward")
    return frozenset(getattr(aten, name) for name in names if hasattr(aten, name))


@functools.cache
def _written(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument op `func` writes (in-place ops, out= variants)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


class _Kept:
    """What selective keeps of one call of a checkpointed unit: the outputs of its SAVED_OPS, per op in order,
    given back to the recomputation in the same order (torch's selective-checkpoint cache does the same, but
    keeps the very tensor the forward goes on with: an op that then writes it in place -- nn.ReLU(inplace=True)
    after a Linear, CPU GRU cells on the views unsafe_split makes of their matmuls' outputs, which no version
    counter sees -- changed the kept value, and the recomputation read the changed one: wrong gradients, or
    torch's "cached ... has been mutated" error in backward). Here a kept output about to be written is copied
    first (once), and the copy is what the recomputation gets; an output nothing writes is kept as it is."""

    def __init__(self):
        self.outputs: dict = {}  # op -> deque of [output leaves (detached), pytree spec]
        self._watched: dict[int, list] = {}  # storage address of a kept leaf -> [(entry, leaf index)]
        self.copied_bytes = 0

    def keep(self, func, out) -> None:
        from torch.utils._pytree import tree_flatten

        leaves, spec = tree_flatten(out)
        entry = [[leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec]
        self.outputs.setdefault(func, deque()).append(entry)
        for i, leaf in enumerate(entry[0]):
            if isinstance(leaf, torch.Tensor) and leaf.layout is torch.strided:
                self._watched.setdefault(leaf.untyped_storage().data_ptr(), []).append((entry, i))

    def before_write(self, func, args, kwargs) -> None:
        """Op `func` is about to write its written arguments: a kept output among them (any view of its memory)
        is copied first."""
        for i, name in _written(func):
            value = args[i] if i < len(args) else kwargs.get(name)
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                    for entry, k in self._watched.pop(t.untyped_storage().data_ptr(), ()):
                        entry[0][k] = entry[0][k].clone()
                        self.copied_bytes += entry[0][k].untyped_storage().nbytes()

    def forget_writes(self) -> None:
        """The forward is over: no more writes to watch for (nor kept outputs to hold for it)."""
        self._watched.clear()

    def take(self, func, unit_name: str):
        from torch.utils._pytree import tree_unflatten

        queue = self.outputs.get(func)
        if not queue:
            raise ActivationError(f"activations.checkpoint selective: the recomputation of {unit_name} ran "
                                  f"{func} more often than its forward (a forward whose ops depend on something "
                                  f"other than its inputs; see angel_ptm.activations.same_in_recompute)")
        leaves, spec = queue.popleft()
        return tree_unflatten(leaves, spec)


class _KeepMode(TorchDispatchMode):
    """selective's forward: the outputs of SAVED_OPS kept (`_Kept`), the rest left to autograd, which
    checkpoint drops."""

    def __init__(self, kept: _Kept):
        super().__init__()
        self.kept = kept

    def __exit__(self, *exc):
        self.kept.forget_writes()  # (the recomputation takes each kept output once: it may write it)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = _written(func)
        if writes and self.kept._watched:
            self.kept.before_write(func, args, kwargs)
        out = func(*args, **kwargs)
        if not writes and func.overloadpacket in saved_ops():
            self.kept.keep(func, out)
        return out


class _ReuseMode(TorchDispatchMode):
    """selective's recomputation: the SAVED_OPS' outputs given back from `_Kept`, every other op run again."""

    def __init__(self, kept: _Kept, unit_name: str):
        super().__init__()
        self.kept, self.unit_name = kept, unit_name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in saved_ops() and not _written(func):
            return self.kept.take(func, self.unit_name)
        return func(*args, **(kwargs or {}))


class _Outputs(TorchDispatchMode):
    """Watches the storages of the tensors the ops under it create; `alive_bytes` counts those still alive (kept by
    autograd or by the selective policy, whatever tensor views them), less those of `exclude` (the unit's inputs
    and outputs)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __enter__(self):
        ACTIVATION_WATCH.depth += 1  # (a model's collectives hand the process group copies this does not see)
        return super().__enter__()

    def __exit__(self, *exc):
        ACTIVATION_WATCH.depth -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view of an input (a parameter's page among them): no new memory; a collective's copy for the backend
        if func.is_view or ACTIVATION_WATCH.paused:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.layout is torch.strided}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.layout is torch.strided:
                storage = leaf.untyped_storage()
                address = storage.data_ptr()
                if address in inputs:  # in-place and out= ops write memory that was there before
                    continue
                seen = self.storages.get(address)
                if seen is None or seen[0].expired():  # the allocator reuses freed addresses
                    self.storages[address] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self, exclude) -> int:
        skip = {t.untyped_storage().data_ptr() for t in tree_leaves(exclude) if isinstance(t, torch.Tensor)}
        alive = sum(nbytes for address, (ref, nbytes) in self.storages.items()
                    if address not in skip and not ref.expired())
        self.storages.clear()
        return alive


T = TypeVar("T")


class _Decisions(threading.local):
    """The decision logs of the checkpointed forwards and recomputations under way in this thread, innermost
    last: ("record" or "replay", the call's log)."""

    def __init__(self):
        self.stack: list[tuple[str, deque]] = []


_DECISIONS = _Decisions()


def same_in_recompute(decide: Callable[[], T]) -> T:
    """`decide()`, a choice a forward makes from the run's state rather than its inputs (the order an MoE layer
    runs its experts in: those in place first), made alike by its recomputation: torch's checkpoint matches the
    tensors a recomputation saves to the forward's by their order. Inside a checkpointed unit's first forward the
    value is recorded, in its recomputation the recorded values are given back in the same order; elsewhere it is
    decided afresh."""
    if not _DECISIONS.stack:
        return decide()
    mode, log = _DECISIONS.stack[-1]
    if mode == "replay" and log:
        return log.popleft()
    value = decide()
    if mode == "record":
        log.append(value)
    return value


class _Logging:
    """Pushes a call's decision log for the forward ("record") or recomputation ("replay") under way."""

    def __init__(self, mode: str, log: deque):
        self.entry = (mode, log)

    def __enter__(self):
        _DECISIONS.stack.append(self.entry)

    def __exit__(self, *exc):
        _DECISIONS.stack.pop()


class _Both:
    """Two contexts as one (entered in order, left in reverse)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


class _Call:
    """One call of a checkpointed unit: the bytes its forward kept (given back when backward recomputes it), the
    recomputation's inputs and output while it runs, and the forward's decisions (`same_in_recompute`)."""

    __slots__ = ("kept", "inputs", "out", "decisions", "buffers")

    def __init__(self):
        self.kept = 0
        self.inputs = self.out = None
        self.decisions: deque = deque()
        self.buffers: list = []  # (module, name, value before the forward) of the buffers the forward changed

    def note_buffers(self, unit) -> list:
        """The unit's buffers before its forward: (module, name, tensor, version, copy)."""
        return [(module, name, buffer, buffer._version, buffer.clone()) for module in unit.module.modules()
                for name, buffer in module._buffers.items() if buffer is not None]

    def keep_changed(self, before: list) -> None:
        """Of `before`, the buffers the forward wrote or replaced: the recomputation reads them as it read them."""
        self.buffers = [(module, name, copy) for module, name, buffer, version, copy in before
                        if module._buffers.get(name) is not buffer or buffer._version != version]


class _Forward:
    """The first forward's context: the selective policy's (if any), with the outputs it keeps counted."""

    def __init__(self, owner: "Recomputation", call: _Call, policy):
        self.owner, self.call, self.policy = owner, call, policy
        self.watch = _Outputs()

    def __enter__(self):
        self.policy.__enter__()
        self.watch.__enter__()

    def __exit__(self, *exc):
        try:
            self.watch.__exit__(*exc)
        finally:
            self.policy.__exit__(*exc)
        # (with the copies of kept outputs the forward then wrote, made where the watch does not see them)
        kept = self.watch.alive_bytes((self.call.out, self.call.inputs)) + self.policy.kept.copied_bytes
        self.call.kept += kept
        self.call.out = self.call.inputs = None
        self.owner.binder.count_activations(kept)


class _Recompute:
    """Backward's recomputation context: the kept bytes given back and the parameters bound to copies -- before
    the selective policy's context, which must see only the forward's own ops -- and what the recomputation
    rebuilt counted."""

    def __init__(self, owner: "Recomputation", call: _Call, unit, policy):
        # (weakly: the graph keeps this context from C++, where the collector cannot see a cycle back to the
        # engine; a model that keeps a tensor of its graph would keep the engine alive for good)
        self._owner, self._unit = weakref.ref(owner), weakref.ref(unit)
        self.call, self.policy = call, policy
        self.watch = _Outputs()
        self._buffers: list = []  # (module, name, buffer, its values) at the recomputation's start

    @property
    def owner(self) -> "Recomputation":
        owner = self._owner()
        if owner is None:
            raise EngineClosedError("backward recomputes a checkpointed unit whose engine is gone (dropped or closed)")
        return owner

    @property
    def unit(self):
        return self._unit()

    def __enter__(self):
        owner, binder = self.owner, self.owner.binder
        binder.count_activations(-self.call.kept - owner.rebuilt)
        self.call.kept = owner.rebuilt = 0
        binder.bind_copies(self.unit)
        # The forward ran once already: what it did to buffers (BatchNorm's running statistics) is not done twice,
        # and the recomputation reads them as the forward did (a decay or counter it read, then updated)
        self._buffers = [(module, name, buffer, buffer.clone()) for module in self.unit.module.modules()
                         for name, buffer in module._buffers.items() if buffer is not None]
        for module, name, before in self.call.buffers:
            module._buffers[name] = before.clone()  # (put back after it, with the others)
        try:
            self.policy.__enter__()
            self.watch.__enter__()
        except BaseException:
            binder.unbind_copies(self.unit)
            raise

    def __exit__(self, *exc):
        try:
            self.watch.__exit__(*exc)
        finally:
            try:
                self.policy.__exit__(*exc)
            finally:
                self.owner.binder.unbind_copies(self.unit)
                self._restore_buffers()
        rebuilt = self.watch.alive_bytes((self.call.out, self.call.inputs))
        self.call.out = self.call.inputs = None
        self.owner.rebuilt = rebuilt
        self.owner.binder.count_activations(rebuilt)


    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for module, name, buffer, values in self._buffers:
                module._buffers[name] = buffer  # (one the recomputation replaced, the forward's again)
                if not torch.equal(buffer, values):  # (one it left as it was is not written: no version bump)
                    buffer.copy_(values)
        self._buffers = []


MODES = ("none", "full", "selective")


def checkpoint_modes(units, checkpoint: str, types=(), unit_modes=None) -> list[str]:
    """The activations.checkpoint mode of each of `units` (paging units; the root never recomputes): a type named
    in `unit_modes` (activations.unit_modes) takes its mode there; otherwise `checkpoint` if `types`
    (activations.units) is empty or names the type, else "none"; a unit inside a recomputed one is "none" (it is
    recomputed as part of it, once, as Megatron recomputes a whole MoE layer). A name that no unit of the model has
    is a ConfigValueError listing the model's unit types. The binder, the estimate and the trace all ask here."""
    unit_modes = unit_modes or {}
    inner = sorted({type(u.module).__name__ for u in units if u.parent is not None})
    for key, names in (("units", list(types)), ("unit_modes", list(unit_modes))):
        unknown = [name for name in names if name not in inner]
        if unknown:
            raise ConfigValueError(f"activations.{key}: {', '.join(unknown)} names no paging unit of this model "
                                   f"(its unit types: {', '.join(inner) or 'none but the root'})")
    modes: list[str] = []
    mode_of: dict[int, str] = {}  # (the units come parents first)
    for unit in units:
        name = type(unit.module).__name__
        if unit.parent is None:
            mode = "none"
        elif any(mode_of.get(id(outer), "none") != "none" for outer in unit.chain()[1:]):
            mode = "none"  # inside a recomputed unit (an MoE expert in its block): recomputed with it, once
        elif name in unit_modes:
            mode = unit_modes[name]
        else:
            mode = checkpoint if not types or name in types else "none"
        mode_of[id(unit)] = mode
        modes.append(mode)
    return modes


def _always(value):
    return lambda: value


class Recomputation:
    """Wraps the forward of each checkpointed unit; `binder` binds parameters and counts activation bytes."""

    def __init__(self, binder):
        self.binder = binder
        self.rebuilt = 0  # bytes the latest recomputation rebuilt (alive until its unit's backward is done)

    def wrap(self, unit, forward: Callable, mode: str) -> Callable:
        """`unit`'s forward recomputed in backward (`mode` full or selective)."""
        if mode not in ("full", "selective"):
            raise ConfigValueError(f'activations.checkpoint: "full" or "selective", got {mode!r}')
        selective = mode == "selective"
        forward_of = weakref.WeakMethod(forward) if hasattr(forward, "__self__") else _always(forward)
        del forward  # (only through forward_of: a cell holding it would reach the model from the graph)

        def checkpointed(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward_of()(*args, **kwargs)
            call = _Call()

            def contexts():
                kept = _Kept()
                first, again = (_KeepMode(kept), _ReuseMode(kept, unit.name)) if selective \
                    else (nullcontext(), nullcontext())
                forward_context = _Forward(self, call, first) if selective else first
                return (_Both(_Logging("record", call.decisions), forward_context),
                        _Both(_Logging("replay", call.decisions), _Recompute(self, call, unit, again)))

            def run(*inner_args, **inner_kwargs):  # (kept by the graph: the unit's forward through a weak reference)
                call.inputs = (inner_args, inner_kwargs)
                call.out = forward_of()(*inner_args, **inner_kwargs)
                return call.out

            before = call.note_buffers(unit)
            try:
                # The whole forward is recomputed (no early stop), so the rebuilt tensors are counted once it ends.
                with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, context_fn=contexts,
                                                             **kwargs)
            finally:
                call.keep_changed(before)
                call.out = call.inputs = None

        return checkpointed

    def end_backward(self) -> None:
        self.rebuilt = 0
