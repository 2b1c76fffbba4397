"""Tensor-level access to pages: one tensor's values in the pages of one kind, read or written whole.

    tensors = PageTensors(manager, layout, pages)
    exp_avg = tensors.read("exp_avg", layout.slot("layers.0.attention.wq.weight"))
    tensors.write("param", slot, new_values)

Reads take every page where it is (a disk page is read into one page-sized scratch buffer) and change no page's
tier, so reading a state dict between steps evicts nothing the next step needs.
Writes acquire each page on the host (a page on the device is written there) and mark it dirty.

Data parallelism (ZeRO): a write touches only the pages this rank holds as its own (every rank writes the same
values; each keeps its share). A read of a sharded kind is collective: each page's owner broadcasts it, so every
rank must read the same tensors in the same order (state dicts are collective, as FSDP's full state dicts are).
"""

from __future__ import annotations

import torch

from torch import nn

from angel_ptm.io.slot_file import aligned_empty
from angel_ptm.memory import Page, PageLayout, PageManager, TensorSlot, Tier
from angel_ptm.memory.materialize import MaterializeReport, has_meta_parameters, materialize_parameters
from angel_ptm.parallel.ownership import Ownership


class PageTensors:
    def __init__(self, manager: PageManager, layout: PageLayout, pages: dict[str, list[Page]],
                 ownership: Ownership | None = None, collectives=None):
        self.manager, self.layout, self.pages = manager, layout, pages
        self.ownership, self.collectives = ownership or Ownership(), collectives
        self.replicas = None  # ep < dp: the collectives of the ranks holding this rank's experts (set by the engine)
        self._scratch: torch.Tensor | None = None  # made at the first disk read
        self._carrier: torch.Tensor | None = None  # a page broadcast by its owner (sharded kinds)

    def dtype(self, kind: str, index: int) -> torch.dtype:
        """Parameters and gradients in the compute dtype; master weights and Adam moments in the master's."""
        return self.layout.page_dtypes[index] if kind in ("param", "grad") else self.layout.state_dtype(index)

    def weights_kind(self, slot: TensorSlot) -> str:
        """The pages that hold a tensor's weights: its master pages under mixed precision, unless it is frozen."""
        return "master" if "master" in self.pages and not self.layout.frozen(slot) else "param"

    def read(self, kind: str, slot: TensorSlot) -> torch.Tensor:
        """A CPU copy of the tensor in its pages of `kind`."""
        if kind != "param" and self.layout.frozen(slot):
            raise KeyError(f"'{slot.name}' is frozen (requires_grad=False at initialize): it has no {kind} pages")
        dtype = self.dtype(kind, slot.segments[0].page)
        out = torch.empty(slot.numel, dtype=dtype)
        for seg in slot.segments:
            shared = self.ownership.sharded_at(kind, seg.page)
            raw = self._from_owner(kind, seg.page) if shared else self._peek(self.pages[kind][seg.page])
            out[seg.start : seg.start + seg.numel] = raw.view(dtype)[seg.offset : seg.offset + seg.numel].cpu()
        return out.view(slot.shape)

    def _from_owner(self, kind: str, index: int) -> torch.Tensor:
        """Page `index` of a sharded kind, broadcast by the rank that owns it (a collective)."""
        if self._carrier is None:
            self._carrier = torch.empty(self.layout.page_bytes, dtype=torch.uint8,
                                        device=self.collectives.mesh.comm_device)
        home = self.ownership.home(index)  # (a rank-local page: its owner among the ranks holding its experts)
        if self.ownership.owns(index):
            self._carrier.copy_(self._peek(self.pages[kind][index]))
        comm = self.replicas if self.ownership.rank_local(index) else self.collectives
        comm.broadcast(self._carrier, home, what=f"{kind} page {index} for a state read")
        return self._carrier

    def _peek(self, page: Page) -> torch.Tensor:
        """The page's bytes now: its device or host buffer (once a move in flight lands), a checked read of its disk
        slot into the scratch buffer, or zeros for a dead page. It may alias the page."""
        self.manager.flush([page])
        if page.buffer is not None:
            return page.buffer
        if page.dead or page.disk_slot is None:
            return torch.zeros(self.layout.page_bytes, dtype=torch.uint8)
        if self._scratch is None:
            self._scratch = aligned_empty(self.layout.page_bytes, "cpu")
        disk = self.manager.disk
        disk.check_read(page, disk.read(page.kind, page.disk_slot, self._scratch))
        return self._scratch

    def read_weights(self, slot: TensorSlot) -> torch.Tensor:
        """The weights as the model holds them outside the engine: the fp32 master under mixed precision (a frozen
        tensor's compute-dtype values, widened to it)."""
        values = self.read(self.weights_kind(slot), slot)
        wide = self.layout.master_dtype
        return values.to(wide) if wide is not None and values.is_floating_point() else values

    def write(self, kind: str, slot: TensorSlot, values: torch.Tensor) -> None:
        """Write `values` (any shape with the tensor's element count) into the tensor's pages of `kind`."""
        flat = values.reshape(-1)
        for seg in slot.segments:
            page = self.pages[kind][seg.page]
            if page is None or page.home is not None:
                continue  # another rank's page (ZeRO): it writes the same values into its own
            self.manager.acquire([page], Tier.HOST)  # a page on the device serves a host access where it is
            view = page.view(self.dtype(kind, seg.page))
            view[seg.offset : seg.offset + seg.numel].copy_(flat[seg.start : seg.start + seg.numel])
            self.manager.release([page], dirty=True)

    def write_where(self, kind: str, slot: TensorSlot, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Write the elements of `values` where `mask` (both flat, the tensor's element count) into the tensor's
        pages of `kind` on this rank; the others keep what the pages hold."""
        flat, mask = values.reshape(-1), mask.reshape(-1)
        for seg in slot.segments:
            page = self.pages[kind][seg.page]
            part = mask[seg.start : seg.start + seg.numel]
            if page is None or page.home is not None or not bool(part.any()):
                continue  # another rank's page (ZeRO: it makes the same write), or nothing written here
            self.manager.acquire([page], Tier.HOST)
            try:
                view = page.view(self.dtype(kind, seg.page))[seg.offset : seg.offset + seg.numel]
                new = flat[seg.start : seg.start + seg.numel].to(view.device, view.dtype)
                view.copy_(torch.where(part.to(view.device), new, view))
            finally:
                self.manager.release([page], dirty=True)

    def fill_from(self, model: nn.Module) -> MaterializeReport | None:
        """The model's parameter values into their weight pages (the fp32 master pages under mixed precision). A
        model built on the meta device is materialized straight into them, a module at a time
        (memory/materialize.py says with which values), and the report says how; None otherwise."""

        def write(slot: TensorSlot, flat: torch.Tensor) -> None:
            kind = self.weights_kind(slot)
            self.write(kind, slot, flat)
            if kind == "master" and (self.ownership.sharded("master") or self.ownership.sharded_local("master")):
                self.write("param", slot, flat)  # ZeRO: the master pages this rank does not own never reach its
                # param pages: rounded here instead

        if has_meta_parameters(model):
            return materialize_parameters(model, {s.name: s for s in self.layout.slots}, write)
        names = dict(model.named_parameters())
        for slot in self.layout.slots:
            write(slot, names[slot.name].detach().reshape(-1))
        return None
