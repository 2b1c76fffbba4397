"""Binding an unmodified nn.Module's parameters to pages (the ZeRO-3 / FSDP pattern, from the outside).

- Forward: a pre-hook on every module that owns parameters acquires their param pages on the device tier and points
  each `param.data` at its slice of a page; a post-hook releases them and leaves a placeholder (a broadcast NaN of
  the right shape), so a stale alias can never read a page slot that now holds another page. A parameter must be
  used inside the forward of a module that owns it (as FSDP requires); a tied weight may be owned by several.
- Saved tensors: while the engine runs forward, autograd's saved-tensor hooks replace any saved tensor that lives in
  a device page by (page, offset, size, stride); backward re-acquires the page when the saved tensor is unpacked.
  Pages pinned for one autograd node are released when the next node starts (nodes run one at a time).
- Gradients: a post-accumulate-grad hook adds each parameter's gradient into its grad page and frees `param.grad`.
  With fp16 loss scaling (`check_finite`) it also notes whether the gradient held an inf or NaN, as it lands, so the
  engine knows whether to skip the step without another pass over the gradient pages.

A tensor larger than a page spans several page slots that need not be adjacent, so it is gathered into a
contiguous copy while in use (read-only: only the optimizer writes parameters, and it writes pages).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from angel_ptm.memory import Page, PageLayout, PageManager, TensorSlot, Tier


def _placeholder(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    fill = float("nan") if param.dtype.is_floating_point else 0
    return torch.full((1,), fill, dtype=param.dtype, device=device).expand(param.shape)


class PackedPageTensor:
    """A saved tensor that lives in a page: enough to rebuild the same view after the page moved."""

    __slots__ = ("page", "offset", "size", "stride", "dtype")

    def __init__(self, page: Page, offset: int, size, stride, dtype):
        self.page, self.offset, self.size, self.stride, self.dtype = page, offset, size, stride, dtype


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


class _Saved:
    """A saved activation (not in a page), counted while autograd holds it."""

    __slots__ = ("tensor", "nbytes")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.nbytes = tensor, tensor.numel() * tensor.element_size()


class ParamBinder:
    def __init__(self, model: nn.Module, layout: PageLayout, manager: PageManager, param_pages: list[Page],
                 grad_pages: list[Page], device: torch.device):
        self.model, self.layout, self.manager, self.device = model, layout, manager, device
        self.param_pages, self.grad_pages = param_pages, grad_pages
        self.slots: dict[int, TensorSlot] = {}
        for name, param in model.named_parameters():
            self.slots[id(param)] = layout.slot(name)
        self.module_params = {
            module: [p for p in module.parameters(recurse=False)] for module in model.modules()
        }
        self.module_params = {m: ps for m, ps in self.module_params.items() if ps}
        self.module_names = {module: name or "<root>" for name, module in model.named_modules()}
        self.activation_bytes = 0  # saved activations alive now (the scheduler's trace records it per access)
        self._pinned_by_module: dict[int, list[Page]] = {}
        self._node_pins: list[Page] = []
        self._current_node = None
        self._page_by_address: dict[int, Page] = {}
        self._handles = []
        self._has_grad: set[str] = set()
        self.without_grad: set[str] = set()  # tensors no gradient reached in the step being settled
        self.on_grad_ready = None  # called with a TensorSlot once its gradient of this backward is in its pages
        self.before_grad_write = None  # called with a TensorSlot before its gradient is written into its pages
        self.before_module_forward = None  # called before each parameter-owning module's forward
        # A dead gradient page comes back with only its padding zeroed: every tensor's region is overwritten by
        # its first gradient (or zeroed by settle_grads) before anything reads it.
        self._padding = _padding_ranges(layout)
        manager.clearers["grad"] = self._clear_grad_padding
        self._settled = False
        self.check_finite = False  # fp16 loss scaling: note inf/NaN gradients as they land (see take_overflow)
        self._overflow: torch.Tensor | None = None  # a bool tensor on the device: no sync per gradient
        # Outside its module's forward a parameter holds no memory: one NaN broadcast to its shape. Autograd's
        # AccumulateGrad needs the right sizes (stride 0 makes it clone gradients contiguously), and NaN makes a
        # use outside the owning module's forward loud instead of silently wrong.
        self._placeholders = {id(p): _placeholder(p, device) for p in model.parameters()}

    # ------------------------------------------------------------------ wiring
    def attach(self) -> None:
        for module in self.module_params:
            self._handles.append(module.register_forward_pre_hook(self._before_forward))
            self._handles.append(module.register_forward_hook(self._after_forward))
        for param in self.model.parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._accumulate_grad))
            param.data = self._placeholders[id(param)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def module_pages(self, module: nn.Module) -> list[Page]:
        pages = []
        for param in self.module_params[module]:
            for index in self.slots[id(param)].pages:
                if self.param_pages[index] not in pages:
                    pages.append(self.param_pages[index])
        return pages

    # ------------------------------------------------------------------ forward
    def _before_forward(self, module: nn.Module, _args) -> None:
        if self.before_module_forward is not None:
            self.before_module_forward()
        pages = self.module_pages(module)
        self.manager.acquire(pages, Tier.DEVICE, label=f"fwd:{self.module_names[module]}")
        self._pinned_by_module.setdefault(id(module), []).extend(pages)
        for page in pages:
            self._page_by_address[page.buffer.data_ptr()] = page
        for param in self.module_params[module]:
            param.data = self._param_view(self.slots[id(param)])

    def _after_forward(self, module: nn.Module, _args, _output) -> None:
        for param in self.module_params[module]:
            param.data = self._placeholders[id(param)]
        pages = self._pinned_by_module.pop(id(module), [])
        for page in pages:
            self._page_by_address.pop(page.buffer.data_ptr(), None)
        self.manager.release(pages)

    def _param_view(self, slot: TensorSlot) -> torch.Tensor:
        parts = [self.param_pages[s.page].view(slot.dtype)[s.offset : s.offset + s.numel] for s in slot.segments]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.view(slot.shape)

    # ------------------------------------------------------------------ saved tensors
    @contextmanager
    def saved_tensor_hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor):
        if tensor.device == self.device and self._page_by_address:
            base = tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()
            for address, page in self._page_by_address.items():
                if address <= tensor.data_ptr() < address + page.nbytes and base <= address:
                    offset_bytes = tensor.data_ptr() - address
                    return PackedPageTensor(page, offset_bytes // tensor.element_size(), tuple(tensor.size()),
                                            tuple(tensor.stride()), tensor.dtype)
        saved = _Saved(tensor)
        self.activation_bytes += saved.nbytes
        return saved

    def _unpack(self, packed):
        if isinstance(packed, _Saved):
            self.activation_bytes -= packed.nbytes  # backward is about to use it, then autograd frees it
            packed.nbytes = 0
            return packed.tensor
        if not isinstance(packed, PackedPageTensor):
            return packed
        self._enter_node()
        self.manager.acquire([packed.page], Tier.DEVICE, label=f"bwd:{packed.page.name}")
        self._node_pins.append(packed.page)
        view = packed.page.view(packed.dtype)  # as_strided's offset counts from the start of the storage (the slab)
        return view.as_strided(packed.size, packed.stride, view.storage_offset() + packed.offset)

    def _enter_node(self) -> None:
        """Release the pages pinned for the previous autograd node once a new node runs."""
        node = torch._C._current_autograd_node()
        if node is not self._current_node:
            self._current_node = node
            if self._node_pins:
                self.manager.release(self._node_pins)
                self._node_pins = []

    def end_backward(self) -> None:
        self._current_node = None
        self.activation_bytes = 0
        if self._node_pins:
            self.manager.release(self._node_pins)
            self._node_pins = []

    # ------------------------------------------------------------------ gradients
    # Grad pages are never zeroed in bulk: the first gradient of a step is copied into its slot (the slot's old
    # contents are dead), later micro-batches add to it, and `settle_grads` zeroes only slots that got nothing.
    def _accumulate_grad(self, param: nn.Parameter) -> None:
        self._enter_node()
        slot = self.slots[id(param)]
        grad = param.grad.reshape(-1)
        if self.before_grad_write is not None:
            self.before_grad_write(slot)
        pages = [self.grad_pages[s.page] for s in slot.segments]
        self.manager.acquire(pages, Tier.DEVICE, label=f"grad:{slot.name}")
        first = slot.name not in self._has_grad
        for seg, page in zip(slot.segments, pages):
            region = page.view(slot.dtype)[seg.offset : seg.offset + seg.numel]
            part = grad[seg.start : seg.start + seg.numel]
            region.copy_(part) if first else region.add_(part)
            if self.check_finite:  # the region, not `part`: fp16 sums of finite micro-batch gradients can overflow
                bad = torch.isfinite(region).all().logical_not_()
                self._overflow = bad if self._overflow is None else self._overflow.logical_or_(bad)
        self.manager.release(pages, dirty=True)
        self._has_grad.add(slot.name)
        param.grad = None
        if self.on_grad_ready is not None:
            self.on_grad_ready(slot)

    def _clear_grad_padding(self, index: int, buffer: torch.Tensor) -> None:
        view = buffer.view(self.layout.page_dtypes[index])
        for start, end in self._padding[index]:
            view[start:end].zero_()

    def settle_grads(self) -> None:
        """Make every grad slot hold this step's gradient: zero the slots no gradient reached."""
        if self._settled:
            return
        self.without_grad = {slot.name for slot in self.layout.slots if slot.name not in self._has_grad}
        for slot in self.layout.slots:
            if slot.name in self._has_grad:
                continue
            for seg in slot.segments:
                page = self.grad_pages[seg.page]
                self.manager.acquire([page], Tier.HOST if page.tier is not Tier.DEVICE else Tier.DEVICE,
                                     label=f"grad:settle:{slot.name}")
                page.view(slot.dtype)[seg.offset : seg.offset + seg.numel].zero_()
                self.manager.release([page], dirty=True)
            self._has_grad.add(slot.name)
        self._settled = True

    def take_overflow(self) -> bool:
        """Whether a gradient of this step held an inf or NaN (with `check_finite`); the flag starts over."""
        overflow, self._overflow = self._overflow, None
        return bool(overflow) if overflow is not None else False

    def start_new_step(self) -> None:
        """Gradients of the finished step are dead: the next ones overwrite their slots."""
        self._has_grad = set()
        self._settled = False
        self._overflow = None
