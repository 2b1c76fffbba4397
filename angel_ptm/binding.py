"""Binding an unmodified nn.Module's parameters to pages (the ZeRO-3 / FSDP2 pattern, from the outside).

- Units (angel_ptm/units.py): a pre-hook on every paging unit acquires the param pages of the parameters it owns on
  the device tier and makes each an ordinary `nn.Parameter` viewing its page; a post-hook (run even when the forward
  raises) releases them and makes each an `UnboundParameter` again (angel_ptm/guard.py), which raises a typed error
  on any use instead of computing with a placeholder. A tied parameter owned by two units is bound while either runs.
- A parameter larger than a page spans several page slots that need not be adjacent: while bound it views a
  gathered contiguous copy (read-only: only the optimizer writes parameters, and it writes pages).
- Saved tensors: in forward, saved-tensor hooks replace one in a device page by (page, offset, size, stride), one in a
  gathered copy by (tensor slot, offset, size, stride); backward acquires (and gathers) them on unpack, pinned until
  the next autograd node starts (another engine's backward through this one, which frees no pins, gets a copy).
- Gradients: a post-accumulate-grad hook adds each parameter's gradient into its grad page and frees `param.grad`;
  under fp16 loss scaling (`check_finite`) it notes an inf or NaN as it lands (no second pass to decide a skip).
- State dicts: `module.state_dict()` binds the module's unbound parameters to copies of their values (`read_values`,
  the engine's page reader) for the duration of the call, so it returns real values, never placeholders.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch import nn

from angel_ptm import guard
from angel_ptm.activations import ActivationPages, PackedActivation, Recomputation
from angel_ptm.activations.recompute import checkpoint_modes
from angel_ptm.errors import ParameterAccessError
from angel_ptm.memory import Page, PageLayout, PageManager, TensorSlot, Tier
from angel_ptm.outside_units import OutsideUnits, keep, register_state_dict_post_hook, unpack_orphan, weakly
from angel_ptm.outside_writes import OutsideWrites
from angel_ptm.saved_tensors import PackedGathered, PackedPageTensor, Saved, modified_in_place, stale_graph
from angel_ptm.units import PagingUnit, unit_pages

log = logging.getLogger("angel_ptm")


def _padding_ranges(layout: PageLayout) -> list[list[tuple[int, int]]]:
    """Per page, the element ranges no tensor segment covers."""
    covered: list[list[tuple[int, int]]] = [[] for _ in range(layout.n_pages)]
    for slot in layout.slots:
        for seg in slot.segments:
            covered[seg.page].append((seg.offset, seg.offset + seg.numel))
    ranges = []
    for index, spans in enumerate(covered):
        numel = layout.page_numel(index)  # a bf16/fp16 page under mixed precision: only its first half is used
        gaps, cursor = [], 0
        for start, end in sorted(spans):
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if cursor < numel:
            gaps.append((cursor, numel))
        ranges.append(gaps)
    return ranges


class ParamBinder(OutsideUnits):
    def __init__(self, model: nn.Module, layout: PageLayout, manager: PageManager, param_pages: list[Page],
                 grad_pages: list[Page], device: torch.device, units: list[PagingUnit], access):
        self.model, self.layout, self.manager, self.device = model, layout, manager, device
        self.param_pages, self.grad_pages = param_pages, grad_pages
        self.units = units
        self.slots: dict[int, TensorSlot] = {}
        for name, param in model.named_parameters():
            self.slots[id(param)] = layout.slot(name)
        self.unit_pages = {id(u): [param_pages[i] for i in unit_pages(u, lambda p: self.slots[id(p)].pages)]
                           for u in units}
        self.activation_bytes = 0  # saved activations alive now
        self._activation_high = 0  # the most alive at once since the scheduler's trace last sampled (take_peak)
        self._saved_storages: dict[int, list[int]] = {}  # storage address -> [saves not yet read, its bytes]
        # Parameter pages a graph saved through a detached use (w.detach(), w.data): a backward node may read them
        # after the parameter's own gradient is final, so they are not updated during that backward (step.py)
        self.detached_saves: set[int] = set()
        self.weights_generation = 0  # bumped when the weights change (a graph saved before is stale)
        self._bound: dict[int, int] = {}  # id(param) -> units binding it now
        self._versions: dict[int, int] = {}  # id(param) -> its version counter when bound (an in-place write bumps it)
        self._page_by_address: dict[int, Page] = {}  # device pages bound now, by buffer address
        self._page_binds: dict[int, int] = {}  # page id -> units holding it now
        self._gathered: dict[int, TensorSlot] = {}  # storage address of a gathered copy -> its tensor's slot
        self._open_units: list[PagingUnit] = []  # units whose forward is running (their pages pinned)
        self._hooks_on = False  # inside engine(...): saved tensors in pages are packed by reference
        self._recomputing = 0  # units being recomputed now (activations.checkpoint), nested ones counted
        self._copied_units: list[PagingUnit] = []  # units nested in a recomputed one, bound to copies
        self.in_backward = False  # inside the engine's backward (StepDriver.backward): a unit run then is recomputed
        self._post_hook_ids: dict[int, int] = {}  # id(unit) -> its unbinding forward hook's id
        self._lazy: dict[int, tuple] = {}  # id(unit) -> (unit, ids of its parameters still to get a gradient)
        self.grads_pending = False  # a backward's gradients are in the grad pages, waiting for step() or zero_grad()
        self._unit_of: dict[int, PagingUnit] = {}  # id(param) -> the unit that binds it (attach)
        self._node_pins: list[Page] = []
        self._current_node = None
        self._handles = []
        self._has_grad: set[str] = set()
        self.without_grad: set[str] = set()  # tensors no gradient reached in the step being settled
        self.on_grad_ready = None  # called with a TensorSlot once its gradient of this backward is in its pages
        self.held_grads: set[str] = set()  # tensors whose gradients also come from elsewhere: ready at add_grads
        self.before_grad_write = None  # called with a TensorSlot before its gradient is written into its pages
        self.before_unit_forward = None  # called before each unit's forward
        self.read_values: Callable[[TensorSlot], torch.Tensor] | None = None  # a copy of a parameter's values
        self.outside_writes = OutsideWrites(read=self.copy_of, busy=self.writes_refused)  # (outside_writes.py)
        # Where pages are acquired: the scheduler (the step's front door), and for parameter pages under ZeRO-3 the
        # gatherer, which first all-gathers their groups.
        self.access = access  # acquire(pages, tier, label), release(pages, dirty), discard(pages)
        self.param_access = self.access
        # A dead gradient page comes back with only its padding zeroed: every tensor's region is overwritten by
        # its first gradient before anything reads it, or never read at all (a tensor without a gradient this step).
        self._padding = _padding_ranges(layout)
        manager.clearers["grad"] = self._clear_grad_padding
        self._settled = False
        self.check_finite = False  # fp16 loss scaling: note inf/NaN gradients as they land (see take_overflow)
        self._overflow: torch.Tensor | None = None  # a bool tensor on the device: no sync per gradient
        self._placeholders = {id(p): guard.placeholder(p, device) for p in model.parameters()}
        self._state_dict_bound: dict[int, list[nn.Parameter]] = {}
        self._recomputed: list[PagingUnit] = []  # units whose forward is recomputed in backward
        self.recomputation: Recomputation | None = None  # activations.checkpoint (attach)
        self.offload: ActivationPages | None = None  # activations.offload (attach)

    # ------------------------------------------------------------------ wiring
    def attach_config(self, acts, scheduler, page_bytes: int) -> None:
        """`attach` as the config's activations section says: recomputation per unit, offload into pages of
        `page_bytes` through `scheduler` (disk: written behind)."""
        offload = None if acts.offload == "none" else ActivationPages(
            scheduler, self.device, page_bytes, acts.offload_min_bytes, write_behind=acts.offload == "disk")
        self.attach(recompute=acts.checkpoint, recompute_units=acts.units, unit_modes=acts.unit_modes, offload=offload)

    def attach(self, recompute: str = "none", recompute_units: tuple[str, ...] = (),
               offload: ActivationPages | None = None, unit_modes: dict | None = None) -> None:
        """Hooks on the model. `recompute` (activations.checkpoint: full | selective): the units of the types
        `recompute_units` names (every unit but the root if none) recompute their forward in backward;
        `unit_modes` (activations.unit_modes) gives some unit types a mode of their own (recompute.checkpoint_modes).
        `offload`: saved tensors go into its activation pages (activations.offload)."""
        self.offload = offload
        modes = checkpoint_modes(self.units, recompute, recompute_units, unit_modes)
        checkpointed = [unit for unit, mode in zip(self.units, modes) if mode != "none"]
        config = getattr(self.model, "config", None)
        if checkpointed and getattr(config, "use_cache", False):  # a HuggingFace model: as its own checkpointing does
            log.warning(f"activations.checkpoint {'/'.join(sorted(set(modes) - {'none'}))}: the model's "
                        f"config.use_cache set to False (a recomputed layer would fill its key/value cache again)")
            config.use_cache = False
        self.recomputation = Recomputation(self) if checkpointed else None
        for unit, mode in zip(self.units, modes):
            # First of the unit's pre-hooks (one the model had, torch.nn.utils.weight_norm's, reads the weights),
            # and last of its forward hooks, those added later too (the pre-hook moves it back to the end)
            post = unit.module.register_forward_hook(self._unit_post_hook(unit), always_call=True)
            self._post_hook_ids[id(unit)] = post.id
            self._handles.append(unit.module.register_forward_pre_hook(self._unit_pre_hook(unit), prepend=True))
            self._handles.append(post)
            if mode != "none":
                self._recomputed.append(unit)
                unit.module.forward = self.recomputation.wrap(unit, unit.module.forward, mode)
        for module in self.model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._handles.append(module.register_state_dict_pre_hook(guard.EngineHook(self._before_state_dict)))
                self._handles.append(register_state_dict_post_hook(module, self._after_state_dict))
        owner = {id(p): u.name for u in reversed(self.units) for p in u.params}
        for name, param in self.model.named_parameters():
            if param.requires_grad:  # (kept last of its hooks: a user's added later still sees .grad, guard.py)
                handle = param.register_post_accumulate_grad_hook(weakly(self._accumulate_grad))
                param.__dict__["_angel_grad_hook"] = handle.id
                self._handles.append(handle)
            guard.label(param, name, owner.get(id(param), "<root>"))
            guard.manage(param, self)
            guard.unbind(param, self._placeholders[id(param)])
        self._unit_of = {id(p): u for u in reversed(self.units) for p in u.params}

    def unit_of_page(self) -> list[str | None]:
        """Per page index, the name of the unit whose parameters are on it (the first one's where several share it)."""
        units = [None] * self.layout.n_pages
        for key, slot in self.slots.items():
            unit = self._unit_of.get(key)
            for seg in slot.segments:
                if units[seg.page] is None and unit is not None:
                    units[seg.page] = unit.name
        return units

    def detach(self, values: Callable[[TensorSlot], torch.Tensor] | None = None) -> None:
        """Remove every hook; with `values`, give each parameter its values as an ordinary tensor for good."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self._recomputed:
            del unit.module.forward  # the class's forward again
        self._recomputed.clear()
        if values is not None:
            for param in (p for p in self.model.parameters() if id(p) in self.slots):  # (not one set since)
                guard.release(param, values(self.slots[id(param)]))

    # ------------------------------------------------------------------ forward
    def _unit_pre_hook(self, unit: PagingUnit):
        post = self._post_hook_ids[id(unit)]

        def hook(module, _args):
            hooks = module._forward_hooks
            if next(reversed(hooks)) != post:
                hooks.move_to_end(post)
            self.bind_unit(unit)
        return guard.EngineHook(hook)

    def _unit_post_hook(self, unit: PagingUnit):
        def hook(_module, _args, _output):
            self.unbind_unit(unit)
        return guard.EngineHook(hook)

    def bind_unit(self, unit: PagingUnit) -> None:
        if self._recomputing and not self._hooks_on:  # a unit inside one being recomputed (an MoE block's experts)
            self.bind_copies(unit)
            self._copied_units.append(unit)
            return
        if torch.is_grad_enabled() and not self._hooks_on and self.in_backward:
            # The model recomputes this unit in backward itself (torch.utils.checkpoint around the unit:
            # HuggingFace's gradient_checkpointing_enable()): it reads copies, kept until its gradients are in
            self.bind_lazy(unit)
            return
        if torch.is_grad_enabled() and not self._hooks_on:
            raise ParameterAccessError(
                f"unit '{unit.name}' ran with gradients enabled outside engine(...): autograd would keep views of "
                f"pages that move before backward; call engine(*inputs) instead of the model (under torch.no_grad() "
                f"the model may be called directly)")
        self.outside_writes.settle(publish=False)  # (a view of a parameter's values written since, outside)
        if self.before_unit_forward is not None:
            self.before_unit_forward()
        pages = self.unit_pages[id(unit)]
        self.param_access.acquire(pages, Tier.DEVICE, label=f"fwd:{unit.name}", read_only=True)
        self._open_units.append(unit)
        for page in pages:
            count = self._page_binds.get(page.id, 0)
            if count == 0:
                self._page_by_address[page.buffer.data_ptr()] = page
            self._page_binds[page.id] = count + 1
        for param in unit.params:
            count = self._bound.get(id(param), 0)
            if count == 0:
                guard.bind(param, self._param_view(self.slots[id(param)], gather_into=self._gathered))
                self._versions[id(param)] = param._version
            self._bound[id(param)] = count + 1

    def unbind_unit(self, unit: PagingUnit) -> None:
        if unit in self._copied_units:
            self._copied_units.remove(unit)
            self.unbind_copies(unit)
            return
        if unit not in self._open_units:
            return  # its pre-hook raised before anything was bound (the post-hook runs anyway)
        self._open_units.remove(unit)
        written = []
        for param in unit.params:
            count = self._bound.get(id(param), 0) - 1
            if count <= 0:
                self._bound.pop(id(param), None)
                if param._version != self._versions.pop(id(param), param._version):
                    written.append(param.__dict__.get("_angel_name", "?"))
                slot = self.slots[id(param)]
                if slot.spans_pages:
                    self._gathered.pop(param.untyped_storage().data_ptr(), None)
                guard.unbind(param, self._placeholders[id(param)])
            else:
                self._bound[id(param)] = count
        pages = self.unit_pages[id(unit)]
        for page in pages:
            count = self._page_binds.get(page.id, 0) - 1
            if count <= 0:
                self._page_binds.pop(page.id, None)
                self._page_by_address.pop(page.buffer.data_ptr(), None)
            else:
                self._page_binds[page.id] = count
        self.param_access.release(pages)
        if written:
            raise ParameterAccessError(
                f"unit '{unit.name}': its forward wrote parameter(s) {', '.join(written)} in place (e.g. under "
                f"torch.no_grad()); the engine pages parameters for reading in forward and would drop that write, "
                f"training other than torch: make the rewrite part of the computation (use a rewritten copy), or "
                f"change the parameter between steps")

    def _param_view(self, slot: TensorSlot, gather_into: dict | None = None) -> torch.Tensor:
        """The parameter's values on its (pinned) device pages: a view of its page, or a gathered copy of the
        pages it spans (registered in `gather_into` so that autograd saves it by reference)."""
        parts = [self.param_pages[s.page].view(slot.dtype)[s.offset : s.offset + s.numel] for s in slot.segments]
        if len(parts) == 1:
            return parts[0].view(slot.shape)
        flat = torch.cat(parts)
        if gather_into is not None:
            gather_into[flat.untyped_storage().data_ptr()] = slot
        return flat.view(slot.shape)

    # ------------------------------------------------------------------ recomputation (activations.checkpoint)
    @property
    def hooks_on(self) -> bool:
        """Inside the engine's forward (saved tensors go through the binder's hooks), not backward's recomputation."""
        return self._hooks_on

    def take_activation_peak(self) -> int:
        """The most saved activation bytes alive at once since the last call (the scheduler's trace records it at
        every access, so a peak between two accesses -- the loss's, at the end of forward -- is not missed)."""
        peak, self._activation_high = max(self._activation_high, self.activation_bytes), self.activation_bytes
        return peak

    def count_activations(self, nbytes: int) -> None:
        """Saved activation bytes kept (or, negative, given back) outside the saved-tensor hooks' sight."""
        self.activation_bytes += nbytes
        self._activation_high = max(self._activation_high, self.activation_bytes)

    def bind_copies(self, unit: PagingUnit, nested: bool = True) -> None:
        """Bind `unit`'s parameters to copies of their values, brought from their pages for a recomputation (its
        saved tensors then view no page: the pages may move before backward reads them). `nested`: the units
        inside it bind copies too while it is bound (activations.checkpoint's recomputation)."""
        pages = self.unit_pages[id(unit)]
        self.param_access.acquire(pages, Tier.DEVICE, label=f"recompute:{unit.name}", read_only=True)
        try:  # (unseen by a selective recomputation's op log, which holds the forward's own ops only)
            with _disable_current_modes():
                for param in unit.params:
                    guard.bind(param, self._param_view(self.slots[id(param)]).clone())
        finally:
            self.param_access.release(pages)
        self._recomputing += nested  # the units nested in it bind copies too (bind_unit)

    def unbind_copies(self, unit: PagingUnit, nested: bool = True) -> None:
        self._recomputing -= nested
        for param in unit.params:
            guard.unbind(param, self._placeholders[id(param)])

    # ------------------------------------------------------------------ saved tensors
    @contextmanager
    def saved_tensor_hooks(self):
        outer, self._hooks_on = self._hooks_on, True
        try:
            # (weakly: a graph the model keeps, say a loss it stores on itself, holds these hooks in C++, where
            # the collector cannot see the cycle to the engine)
            with torch.autograd.graph.saved_tensors_hooks(weakly(self._pack, keep),
                                                          weakly(self._unpack, unpack_orphan)):
                yield
        finally:
            self._hooks_on = outer
            if self.offload is not None and not outer:
                self.offload.end_forward()

    def _pack(self, tensor: torch.Tensor):
        if tensor.device == self.device:
            if self._gathered:
                storage = tensor.untyped_storage().data_ptr()
                slot = self._gathered.get(storage)
                if slot is not None:
                    if not tensor.requires_grad:  # a detached use (w.detach()): read after w's gradient is final
                        self.detached_saves.update(slot.pages)
                    return PackedGathered(slot, (tensor.data_ptr() - storage) // tensor.element_size(),
                                          tuple(tensor.size()), tuple(tensor.stride()), self.weights_generation)
            if self._page_by_address:
                base = tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()
                for address, page in self._page_by_address.items():
                    if address <= tensor.data_ptr() < address + page.nbytes and base <= address:
                        offset_bytes = tensor.data_ptr() - address
                        if not tensor.requires_grad:  # (as above)
                            self.detached_saves.add(page.index)
                        return PackedPageTensor(page, offset_bytes // tensor.element_size(), tuple(tensor.size()),
                                                tuple(tensor.stride()), tensor.dtype, self.weights_generation)
        if self.offload is not None:
            packed = self.offload.pack(tensor)
            if packed is not None:
                return packed
        saved = Saved(tensor)
        count = self._saved_storages.get(saved.storage)
        if count is None:
            self.activation_bytes += tensor.untyped_storage().nbytes()
            self._activation_high = max(self._activation_high, self.activation_bytes)
            self._saved_storages[saved.storage] = [1, tensor.untyped_storage().nbytes()]
        else:
            count[0] += 1
        return saved

    def _unpack(self, packed):
        if isinstance(packed, Saved):
            count = self._saved_storages.get(packed.storage)
            if count is not None:  # the last save of its storage read: backward uses it, then autograd frees it
                count[0] -= 1
                if count[0] == 0:
                    self.activation_bytes -= count[1]
                    del self._saved_storages[packed.storage]
            if packed.tensor._version != packed.version:
                raise modified_in_place(packed.version, packed.tensor)
            return packed.tensor
        if isinstance(packed, PackedActivation):
            return self.offload.unpack(packed)
        if isinstance(packed, (PackedGathered, PackedPageTensor)) and packed.generation != self.weights_generation:
            raise stale_graph()
        if isinstance(packed, PackedGathered):
            self._enter_node()
            pages = [self.param_pages[i] for i in packed.slot.pages]
            self.param_access.acquire(pages, Tier.DEVICE, label=f"bwd:{packed.slot.name}", read_only=True)
            try:
                flat = self._param_view(packed.slot).reshape(-1)  # a fresh copy: the pages may go at once
            finally:
                self.param_access.release(pages)
            return flat.as_strided(packed.size, packed.stride, packed.offset)
        if not isinstance(packed, PackedPageTensor):
            return packed
        self._enter_node()
        self.param_access.acquire([packed.page], Tier.DEVICE, label=f"bwd:{packed.page.name}", read_only=True)
        view = packed.page.view(packed.dtype)  # as_strided's offset counts from the start of the storage (the slab)
        view = view.as_strided(packed.size, packed.stride, view.storage_offset() + packed.offset)
        if not self.in_backward:  # another engine's backward through this (frozen) one: no later unpin, so a copy
            copy, _ = view.clone(), self.param_access.release([packed.page])
            return copy
        self._node_pins.append(packed.page)
        return view

    def _enter_node(self) -> None:
        """Release the pages pinned for the previous autograd node once a new node runs."""
        node = torch._C._current_autograd_node()
        if node is not self._current_node:
            self.release_node_pins()
            self._current_node = node

    def release_node_pins(self) -> None:
        """The pages pinned for the last autograd node that read one go (that node has finished running)."""
        pins, self._node_pins, self._current_node = self._node_pins, [], None
        if pins:
            self.param_access.release(pins)

    def end_backward(self) -> None:
        self.release_lazy()
        self.detached_saves.clear()
        self.activation_bytes = 0
        self._saved_storages.clear()
        self.release_node_pins()
        if self.offload is not None:
            self.offload.end_backward()
        if self.recomputation is not None:
            self.recomputation.end_backward()

    # ------------------------------------------------------------------ gradients
    # Grad pages are never zeroed in bulk: the first gradient of a step is copied into its slot (the slot's old
    # contents are dead), later micro-batches add to it, and `settle_grads` zeroes only slots that got nothing.
    def _accumulate_grad(self, param: nn.Parameter) -> None:
        self._enter_node()
        slot = self.slots[id(param)]
        self._write_grad(slot, param.grad.reshape(-1))
        param.grad = None
        if self._lazy:
            self.lazy_grad_in(param)
        if self.on_grad_ready is not None and slot.name not in self.held_grads:
            self.on_grad_ready(slot)

    def _write_grad(self, slot: TensorSlot, grad: torch.Tensor) -> None:
        if self.before_grad_write is not None:
            self.before_grad_write(slot)
        pages = [self.grad_pages[s.page] for s in slot.segments]
        self.access.acquire(pages, Tier.DEVICE, label=f"grad:{slot.name}")
        first = slot.name not in self._has_grad
        for seg, page in zip(slot.segments, pages):
            region = page.view(slot.dtype)[seg.offset : seg.offset + seg.numel]
            part = grad[seg.start : seg.start + seg.numel]
            region.copy_(part) if first else region.add_(part)
            if self.check_finite:  # the region, not `part`: fp16 sums of finite micro-batch gradients can overflow
                bad = torch.isfinite(region).all().logical_not_()
                self._overflow = bad if self._overflow is None else self._overflow.logical_or_(bad)
        self.access.release(pages, dirty=True)
        self._has_grad.add(slot.name)

    def add_grads(self, grads: dict[str, torch.Tensor | None]) -> None:
        """Gradients computed elsewhere (a hot expert's replicas on other ranks), added into the named tensors'
        grad pages during backward (None: nothing came); a tensor in `held_grads` is final only after this."""
        self._enter_node()
        for name, grad in grads.items():
            slot = self.layout.slot(name)
            if grad is not None:
                self._write_grad(slot, grad.reshape(-1))
            if self.on_grad_ready is not None and name in self.held_grads and name in self._has_grad:
                self.on_grad_ready(slot)

    def _clear_grad_padding(self, index: int, buffer: torch.Tensor) -> None:
        view = buffer.view(self.layout.page_dtypes[index])
        for start, end in self._padding[index]:
            view[start:end].zero_()

    def settle_grads(self) -> None:
        """Close this step's gradients: `without_grad` names the tensors no gradient reached (frozen, unused, a
        branch not taken). Their grad regions are never written nor read (the norm and the update skip them), so a
        grad page that only such tensors use is never even materialized."""
        if self._settled:
            return
        self.without_grad = {slot.name for slot in self.layout.slots if slot.name not in self._has_grad}
        self._settled = True

    def got_grad(self, name: str) -> bool:
        """Whether tensor `name` has a gradient in its pages this step (so far)."""
        return name in self._has_grad

    def take_overflow(self) -> bool:
        """Whether a gradient of this step held an inf or NaN (with `check_finite`); the flag starts over."""
        overflow, self._overflow = self._overflow, None
        return bool(overflow) if overflow is not None else False

    def start_new_step(self) -> None:
        """Gradients of the finished step are dead: the next ones overwrite their slots."""
        self.grads_pending = False
        self._has_grad = set()
        self._settled = False
        self._overflow = None
