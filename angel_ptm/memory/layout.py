"""PageLayout: where every tensor of a module lives in pages.

Tensors are packed in first-use order so one page serves a contiguous run of the step. Each page holds one dtype;
a tensor that does not fit the rest of the open page starts a new one, and a tensor larger than a page spans
consecutive whole pages. Pages form groups of `dp_world_size` (the page count is padded to a multiple of it) so
that ZeRO sharding — rank r owns page r of every group — needs no new layout. The same layout describes every
page kind (parameters, gradients, master weights, optimizer states): page i of each kind covers the same elements.
The layout is a pure function of (tensor names, shapes, dtypes, order, page_bytes, dp_world_size, compute_dtype,
which tensors are frozen).

Tensors can be kept apart in groups (`apart`: MoE experts, build_layout): a group's tensors are on pages of their
own, which no tensor outside it shares, so a step that leaves the group alone (an expert no token was routed to)
leaves its pages alone too.

Frozen tensors (`requires_grad=False` at initialize) come last, on pages of their own: pages
[0, n_trainable_pages) hold the trainable tensors and exist in every kind; the pages after them exist only as
parameters (no gradient, master or optimizer-state pages: `kind_pages`).

Mixed precision (`compute_dtype` bf16 or fp16): floating tensors are stored in the compute dtype on the param and
grad pages, and in fp32 on the master and optimizer-state pages. All tiers share one page size, so tensors are
packed by element count at fp32's 4 bytes: page i of every kind then holds the same elements at the same element
offsets, and a compute-dtype page uses only the first half of its bytes (`page_numel` elements). The wasted halves
(20 bytes of pages per parameter instead of 2 + 2 + 4 + 4 + 4 = 16) buy one buffer pool and one disk slot size for
every kind, and one page index per optimizer update; half-size compute pages would need pools of two page sizes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

ALIGN_BYTES = 64  # every tensor starts on a 64-byte boundary (vector loads, and views stay aligned)


@dataclass(frozen=True)
class Segment:
    """`numel` elements of a tensor, starting at element `start` of it, stored at element `offset` of `page`."""

    page: int
    offset: int
    numel: int
    start: int


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @property
    def pages(self) -> list[int]:
        return [s.page for s in self.segments]

    @property
    def spans_pages(self) -> bool:
        return len(self.segments) > 1


@dataclass
class PageLayout:
    page_bytes: int
    dp_world_size: int
    slots: list[TensorSlot]
    page_dtypes: list[torch.dtype]  # one per page, padding pages included (the compute dtype under mixed precision)
    page_used_bytes: list[int] = field(default_factory=list)  # as packed (fp32 bytes under mixed precision)
    master_dtype: torch.dtype | None = None  # mixed precision: the dtype of master and optimizer-state pages
    n_trainable_pages: int | None = None  # pages of trainable tensors (None: all); frozen ones follow
    # Pages [start, end) of rank-local tensors (expert parallelism: each rank holds other experts under the same
    # names): whole page groups after the shared trainable ones, never sharded, gathered or reduced. None: none.
    local_pages: tuple[int, int] | None = None

    @property
    def n_pages(self) -> int:
        return len(self.page_dtypes)

    @property
    def trainable_pages(self) -> int:
        """Pages that exist in every kind (the frozen tensors' pages after them are parameter pages only)."""
        return self.n_pages if self.n_trainable_pages is None else self.n_trainable_pages

    def kind_pages(self, kind: str) -> int:
        """How many pages of `kind` the layout has: every page is a parameter page, the trainable ones only are
        gradient, master and optimizer-state pages too."""
        return self.n_pages if kind == "param" else self.trainable_pages

    @property
    def shared_trainable_pages(self) -> int:
        """Trainable pages every data-parallel rank holds the same tensors in (reduced, sharded by ZeRO): those
        before the rank-local ones."""
        return self.local_pages[0] if self.local_pages is not None else self.trainable_pages

    def is_local(self, page: int) -> bool:
        return self.local_pages is not None and self.local_pages[0] <= page < self.local_pages[1]

    def frozen(self, slot: "TensorSlot") -> bool:
        return slot.segments[0].page >= self.trainable_pages

    def state_dtype(self, page: int) -> torch.dtype:
        """The dtype of page `page` in the master and optimizer-state kinds (the param page's own without mixed
        precision, where the parameters are the master weights)."""
        dtype = self.page_dtypes[page]
        return self.master_dtype if self.master_dtype is not None and dtype.is_floating_point else dtype

    def page_numel(self, page: int) -> int:
        """Elements page `page` holds, in every kind: a compute-dtype page under mixed precision views only its
        first `page_numel` elements (half its bytes)."""
        return self.page_bytes // self.state_dtype(page).itemsize

    @property
    def groups(self) -> list[list[int]]:
        d = self.dp_world_size
        return [list(range(g, g + d)) for g in range(0, self.n_pages, d)]

    def owner(self, page: int) -> int:
        """The data-parallel rank that owns `page` under ZeRO sharding."""
        return page % self.dp_world_size

    def slot(self, name: str) -> TensorSlot:
        """The slot of tensor `name` (KeyError if none): by a name index, made at the first call (and again if the
        slot list is replaced): a scan per lookup made callers that look up every tensor quadratic in their count
        (the binder's set-up, the estimate, a checkpoint's planning)."""
        index = self.__dict__.get("_by_name")
        if index is None or index[0] is not self.slots or index[1] != len(self.slots):
            index = self.__dict__["_by_name"] = (self.slots, len(self.slots), {})
            for slot in self.slots:
                index[2].setdefault(slot.name, slot)  # (the first of a name, as the scan found)
        return index[2][name]

    def tensors_on(self, page: int) -> list[TensorSlot]:
        return [s for s in self.slots if page in s.pages]

    def fingerprint(self) -> str:
        """A digest of the whole layout, to match checkpoints and page files on reload."""
        h = hashlib.sha256(f"{self.page_bytes}/{self.dp_world_size}/{[str(d) for d in self.page_dtypes]}/"
                           f"{self.trainable_pages}".encode())
        if self.master_dtype is not None:
            h.update(f"master {self.master_dtype}".encode())
        if self.local_pages is not None:
            h.update(f"local {self.local_pages}".encode())
        for s in self.slots:
            h.update(f"{s.name}{s.shape}{s.dtype}{s.segments}".encode())
        return h.hexdigest()[:16]

    @classmethod
    def build(cls, tensors: Iterable[tuple[str, torch.Tensor]], page_bytes: int, dp_world_size: int = 1,
              compute_dtype: torch.dtype | None = None, frozen: Iterable[str] = (),
              local: Iterable[str] = (), apart: Iterable[Iterable[str]] = ()) -> "PageLayout":
        """`compute_dtype` (bf16/fp16): mixed precision, floating tensors stored in it and packed at fp32's size.
        `frozen`: names of tensors without gradients, which must come after every trainable one. `local`: names of
        rank-local trainable tensors, which must come after the other trainable ones and start a page group.
        `apart`: groups of tensor names, each on pages of its own (its tensors come one after another)."""
        if page_bytes <= 0 or page_bytes % ALIGN_BYTES:
            raise ValueError(f"page_bytes must be a positive multiple of {ALIGN_BYTES}, got {page_bytes}")
        if dp_world_size < 1:
            raise ValueError(f"dp_world_size must be >= 1, got {dp_world_size}")
        page_dtypes: list[torch.dtype] = []
        used: list[int] = []  # bytes used per page
        open_page: dict[torch.dtype, int] = {}  # dtype -> index of the page still being filled
        slots: list[TensorSlot] = []

        def new_page(dtype: torch.dtype) -> int:
            page_dtypes.append(dtype)
            used.append(0)
            return len(page_dtypes) - 1

        master_dtype = torch.float32 if compute_dtype is not None else None
        frozen, local = set(frozen), set(local)
        group_of = {name: g for g, names in enumerate(apart) for name in names}
        group = None  # the group of the tensor before (None: in no group)
        n_trainable = None
        local_start = None
        for name, tensor in tensors:
            if name in local and local_start is None:  # the rank-local section starts a page group of its own
                if name in frozen or n_trainable is not None:
                    raise ValueError(f"rank-local tensor '{name}' must be trainable and come before frozen ones")
                while len(page_dtypes) % dp_world_size:
                    new_page(page_dtypes[-1] if page_dtypes else torch.float32)
                local_start, open_page = len(page_dtypes), {}
            elif local_start is not None and name not in local and name not in frozen:
                raise ValueError(f"rank-local tensors must come after the other trainable ones: '{name}' follows one")
            if name in frozen and n_trainable is None:  # the frozen section starts on fresh pages, a whole group
                while len(page_dtypes) % dp_world_size:
                    new_page(page_dtypes[-1] if page_dtypes else torch.float32)
                n_trainable, open_page = len(page_dtypes), {}
            elif name not in frozen and n_trainable is not None:
                raise ValueError(f"frozen tensors must come last: '{name}' is trainable and follows a frozen one")
            if group_of.get(name) != group:  # a group starts or ends: its pages hold nothing from outside it
                group, open_page = group_of.get(name), {}
            dtype, esize, numel = tensor.dtype, tensor.element_size(), tensor.numel()
            if master_dtype is not None and dtype.is_floating_point:
                dtype, esize = compute_dtype, master_dtype.itemsize  # offsets count elements, the same in all kinds
            nbytes = numel * esize
            page = open_page.get(dtype)
            if page is not None:
                offset = -(-used[page] // ALIGN_BYTES) * ALIGN_BYTES
                if offset + nbytes <= page_bytes:
                    used[page] = offset + nbytes
                    slots.append(TensorSlot(name, tuple(tensor.shape), dtype, (Segment(page, offset // esize, numel, 0),)))
                    continue
            # Start a fresh page; a tensor larger than a page spans consecutive whole pages.
            per_page = page_bytes // esize
            segments, start = [], 0
            while start < numel or not segments:
                fresh = new_page(dtype)
                count = min(per_page, numel - start)
                segments.append(Segment(fresh, 0, count, start))
                used[fresh] = count * esize
                start += count
            # A tensor that fills its last page leaves the page open before it open (the next small tensor fits
            # there); any other makes its last page the open one.
            if page is None or used[fresh] < page_bytes:
                open_page[dtype] = fresh
            slots.append(TensorSlot(name, tuple(tensor.shape), dtype, tuple(segments)))

        while len(page_dtypes) % dp_world_size:  # pad to whole page groups
            new_page(page_dtypes[-1] if page_dtypes else torch.float32)
        local_pages = None
        if local_start is not None:
            local_pages = (local_start, n_trainable if n_trainable is not None else len(page_dtypes))
        return cls(page_bytes, dp_world_size, slots, page_dtypes, used, master_dtype, n_trainable, local_pages)


def first_use_order(module: nn.Module, *example_inputs, **example_kwargs) -> list[str]:
    """Parameter names in the order a forward pass first touches their modules (unused ones last)."""
    names = {id(p): n for n, p in module.named_parameters()}
    order: list[str] = []
    seen: set[int] = set()

    def record(mod: nn.Module, _args) -> None:
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                order.append(names[id(p)])

    handles = [m.register_forward_pre_hook(record) for m in module.modules()]
    try:
        with torch.no_grad():
            module(*example_inputs, **example_kwargs)
    finally:
        for h in handles:
            h.remove()
    order.extend(n for n, p in module.named_parameters() if id(p) not in seen)
    return order


def build_layout(module: nn.Module, page_bytes: int, dp_world_size: int = 1,
                 order: Sequence[str] | None = None, compute_dtype: torch.dtype | None = None,
                 local: Iterable[str] = ()) -> PageLayout:
    """The layout of `module`'s parameters (shared parameters once), in `order` or registration order, the
    rank-local ones (`local`: expert parallelism's experts) after the other trainable ones, the frozen ones
    (`requires_grad=False`) last; `compute_dtype`: mixed precision (PageLayout.build). Each MoE expert's tensors
    (units.expert_modules) are on pages of their own, one after another, where its first tensor would be."""
    from angel_ptm.units import expert_modules  # (units.py builds on the memory package)

    params = dict(module.named_parameters())
    names = list(order) if order is not None else list(params)
    missing = set(params) - set(names)
    if missing:
        raise ValueError(f"order leaves out parameters: {sorted(missing)[:5]}")
    frozen = {n for n in names if not params[n].requires_grad}
    local = set(local) - frozen
    known = {id(p): n for n, p in params.items()}
    group_of: dict[str, int] = {}  # (a parameter shared by several experts: in the first one's group)
    for g, expert in enumerate(expert_modules(module)):
        for p in expert.parameters():
            group_of.setdefault(known[id(p)], g)
    groups = [[] for _ in range(max(group_of.values(), default=-1) + 1)]
    for name in names:
        if name in group_of:
            groups[group_of[name]].append(name)

    def together(section: list[str]) -> list[str]:  # each group's members of `section` where its first one is
        out, done = [], set()
        for name in section:
            g = group_of.get(name)
            if g is None:
                out.append(name)
            elif g not in done:
                done.add(g)
                members = set(groups[g])
                out.extend(n for n in section if n in members)
        return out

    names = (together([n for n in names if n not in frozen and n not in local])
             + together([n for n in names if n in local]) + together([n for n in names if n in frozen]))
    return PageLayout.build(((n, params[n]) for n in names), page_bytes, dp_world_size, compute_dtype, frozen,
                            local, apart=groups)


def largest_module(model: nn.Module, layout: PageLayout) -> tuple[str, int]:
    """The module whose own parameters span the most pages, and that count: the device tier must hold that many
    pages at once (the module's forward pins them all)."""
    largest, name = 0, ""
    param_names = {id(p): n for n, p in model.named_parameters()}
    for module_name, module in model.named_modules():
        pages = {p for param in module.parameters(recurse=False) for p in layout.slot(param_names[id(param)]).pages}
        if len(pages) > largest:
            largest, name = len(pages), module_name or "<root>"
    return name, largest
