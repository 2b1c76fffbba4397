"""DCP planners over pages: what a rank writes and reads, named by the model's parameter names.

Saved tensors (every one with the model's full shape; DCP chunks say which part each file holds):

    param.<name>        the parameters as the model computes with them (bf16/fp16 under mixed precision)
    master.<name>       the fp32 master weights (mixed precision, optimizer.staleness 1)
    exp_avg.<name>      Adam's first moment
    exp_avg_sq.<name>   Adam's second moment
    buffer.<name>       the model's persistent buffers (rank 0)

A rank writes page i of a kind when it owns page i (`i % dp == rank`): its own pages of a sharded kind and one
rank's share of a replicated one, so each element is written once. Each tensor segment on a page is one run of the
tensor's elements, written as the boxes that tile it (boxes.py). Items are listed in page order, so a page is read
from its tier once (buffers.py's PageStream: a bounded set of scratch buffers, disk reads of the next pages in
flight).

Loading asks, for every page this rank holds in the new layout (any page size, any number of ranks), for the runs
its segments cover, and DCP finds them in whichever files hold them: that is the resharding.

Tensor parallelism: a rank's tensor-parallel shard (parallel/tensor) is named by its full tensor, its boxes moved to
its slice's place in it (`full_box`), so the checkpoint holds full tensors whatever tp wrote it, and a load at any
other tp (1 included) asks for the boxes its own slices cover. Tensors whole on every tp rank (norms) are written
by tp rank 0's ranks only.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from angel_ptm.checkpoint.boxes import box_start, flat_boxes
from angel_ptm.errors import CheckpointError
from angel_ptm.state_dict import _persistent_buffers
from angel_ptm.memory import Page, PageLayout, PageState, Tier
from angel_ptm.memory.store import PageKind
from angel_ptm.memory.backing import Extent, Source, ZeroOutsideRuns, zero_outside

SAVED_KINDS = tuple(kind.value for kind in PageKind if kind.checkpointed)  # param, master, exp_avg, exp_avg_sq


@dataclass(frozen=True)
class Run:
    """A box of tensor `name` that lies in page `page` of `kind` at element `offset` (contiguous there)."""

    kind: str
    name: str
    page: int
    offset: int
    numel: int
    sizes: tuple[int, ...]
    dtype: torch.dtype


def segments_by_page(layout: PageLayout) -> list[list[tuple]]:
    """Per page, the (slot, segment) pairs on it."""
    out: list[list[tuple]] = [[] for _ in range(layout.n_pages)]
    for slot in layout.slots:
        for seg in slot.segments:
            out[seg.page].append((slot, seg))
    return out


def page_runs(layout: PageLayout, on_page: list[tuple], kind: str, index: int,
              dtype: torch.dtype) -> list[tuple[str, tuple, Run]]:
    """(fqn, box offsets, Run) for every box of every tensor segment on page `index` of `kind` (`on_page`: its
    (slot, segment) pairs)."""
    out = []
    for slot, seg in on_page:
        if kind != "param" and layout.frozen(slot):
            continue
        for offsets, sizes in flat_boxes(slot.shape, seg.start, seg.start + seg.numel):
            start = box_start(slot.shape, offsets) if slot.shape else 0
            run = Run(kind, slot.name, index, seg.offset + start - seg.start, math.prod(sizes), sizes, dtype)
            out.append((f"{kind}.{slot.name}", offsets, run))
    return out


def full_box(engine, name: str, offsets: tuple, shape: tuple) -> tuple[tuple, tuple]:
    """A box of this rank's tensor `name` (of `shape`) as a box of the full tensor: a tensor-parallel shard's
    offsets move by its slice's start along the split dimension; other tensors are whole already."""
    shard = engine.tp_shards.get(name)
    if shard is None:
        return tuple(offsets), tuple(shape)
    full = list(offsets)
    full[shard.dim] += shard.start
    return tuple(full), tuple(shard.full_shape)


def global_fqn(engine, kind: str, name: str) -> str:
    """The checkpoint's name of this rank's tensor `name` of `kind`: an expert of an expert-parallel layer by its
    index in the unsplit layer (parallel/moe), every other tensor by its own name."""
    return f"{kind}.{engine.expert_names.get(name, name)}"


def unexpected_tensors(engine, md) -> list[str]:
    """The checkpoint's parameters and optimizer states (`<kind>.<name>`) of tensors this model does not have: a
    larger model's blocks or experts, an untied head of a model that ties it (torch's strict load refuses them too);
    and its buffers (`buffer.<name>`) this model has no persistent buffer for (a BatchNorm taken out).
    Another rank's experts of a layer split over ep ranks are this model's (the unsplit layer's experts)."""
    from angel_ptm.parallel.moe.dispatch import ExpertParallelMoE

    names = {engine.expert_names.get(slot.name, slot.name) for slot in engine.layout.slots}
    for prefix, module in engine.model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            tensors = {name.partition(".")[2] for name, _ in module.experts.named_parameters()}
            names |= {f"{prefix}.experts.{e}.{tensor}" for e in range(module.spec.experts) for tensor in tensors}
    buffers = {f"buffer.{name}" for name in _persistent_buffers(engine.model)}
    return [fqn for fqn, saved in md.items()
            if isinstance(saved, TensorStorageMetadata) and (
                (fqn.partition(".")[0] in SAVED_KINDS and fqn.partition(".")[2] not in names)
                or (fqn.startswith("buffer.") and fqn not in buffers))]


def in_file_order(groups: list[list[ReadItem]], storage: dict | None) -> list[ReadItem]:
    """Each page's items, the pages one after the other, in the order their bytes lie in the checkpoint's files
    (the items of a page by where each lies, the pages by where their first lies): a load then reads the files
    front to back, as the kernel reads ahead, whatever order the save wrote the kinds in. (Pages cut otherwise
    than at the save take their items from several of the saved pages, which may lie apart: the reads then
    stride forward through the files, a page at a time.) Without the files' map (`storage`), as given."""
    if not storage:
        return [item for group in groups for item in group]

    def where(item: ReadItem) -> tuple:
        info = storage.get(item.storage_index)
        return ("", -1) if info is None else (info.relative_path, info.offset)

    groups = [sorted(group, key=where) for group in groups if group]
    return [item for group in sorted(groups, key=lambda g: where(g[0])) for item in group]


def held_pages(engine, kind: str) -> list[tuple[int, Page]]:
    """(index, page) of every page of `kind` this rank holds as its own."""
    return [(i, p) for i, p in enumerate(engine.pages.get(kind, ())) if p is not None and p.home is None]


class PageSavePlanner(SavePlanner):
    """This rank's owned pages of every saved kind, plus `objects` (fqn -> picklable) as bytes items and
    `tensors` (fqn -> whole tensor: the model's buffers) written whole. The plan (and `order`, the pages in the
    order its items read them) is made at construction, on the training thread."""

    def __init__(self, engine, objects: dict[str, object], tensors: dict[str, torch.Tensor]):
        self.engine, self.objects, self.tensors = engine, objects, tensors
        self.runs: dict[tuple[str, tuple], Run] = {}
        layout = engine.layout
        items: list[WriteItem] = [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
                                  for fqn in self.objects]
        for fqn, tensor in self.tensors.items():
            items.append(_tensor_item(fqn, (0,) * tensor.dim(), tuple(tensor.shape), tensor.dtype, tensor.shape))
        self.order: list[Page] = []
        on_page = segments_by_page(layout)
        own = engine.ownership
        for index in range(layout.n_pages):
            local = own.rank_local(index)  # every rank writes its own experts' pages, each page once: ...
            if not local and not own.owns(index):
                continue
            for kind in SAVED_KINDS:
                pages = engine.pages.get(kind, ())
                page = pages[index] if index < len(pages) else None
                if page is None or page.home is not None:
                    continue
                if local and not own.sharded_local(kind) and own.local_rank:
                    continue  # ... with ep < dp by the first of the ranks holding them, or a sharded kind's owner
                runs = page_runs(layout, on_page[index], kind, index, engine.tensors.dtype(kind, index))
                if engine.mesh.tp_rank:  # a tensor whole on every tp rank is written by tp rank 0's group
                    runs = [r for r in runs if r[2].name in engine.tp_shards]
                if not runs:
                    continue
                self.order.append(page)
                for fqn, offsets, run in runs:
                    fqn = global_fqn(engine, kind, run.name)
                    offsets, shape = full_box(engine, run.name, offsets, layout.slot(run.name).shape)
                    self.runs[(fqn, offsets)] = run
                    items.append(_tensor_item(fqn, offsets, run.sizes, run.dtype, shape))
        self.plan = SavePlan(items)
        self.source = None  # PageStream (a save between steps) or Snapshot (a save beside training)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        plans, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        for fqn, md in metadata.state_dict_metadata.items():  # every element of every tensor written exactly once
            if isinstance(md, TensorStorageMetadata):
                covered = sum(math.prod(c.sizes) for c in md.chunks)
                if covered != math.prod(md.size):
                    raise CheckpointError(f"checkpoint: the ranks' pages cover {covered} of the {math.prod(md.size)} "
                                          f"elements of '{fqn}' (a layout that differs between ranks?)")
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.objects[fqn], buffer)
            return buffer
        if fqn in self.tensors:
            return self.tensors[fqn].detach().cpu()
        run = self.runs[(fqn, tuple(write_item.index.offset))]
        raw = self.source.get(self.engine.pages[run.kind][run.page])
        # a tensor over exactly the run's bytes (torch.save of a slice would write its whole page), no copy
        return torch.frombuffer(memoryview(raw.numpy()), dtype=run.dtype, count=run.numel,
                                offset=run.offset * run.dtype.itemsize).view(run.sizes)


def _source(fqn: str, kind: str, name: str, saved: dict, job_has_master: bool, dtype: torch.dtype) -> str:
    """The checkpoint's tensor that page kind `kind` (of element type `dtype`) of tensor `name` loads from. The
    weights are the master wherever one was saved: a job without master pages takes it into its parameters (under
    staleness 1 the saved parameters lag it by one update), and so does one whose parameters are of another dtype
    than the saved ones (bf16 saved, fp16 or fp32 loaded: rounded from the master, not from the other rounding);
    a job with master pages takes the parameters where no master was saved."""
    master, param = f"master.{name}", f"param.{name}"
    saved_param = saved.get(param)
    other_dtype = saved_param is not None and getattr(saved_param.properties, "dtype", dtype) != dtype
    if kind == "param" and (not job_has_master or other_dtype) and master in saved:
        return master
    if kind == "master" and master not in saved:
        return param
    return fqn


def _tensor_item(fqn: str, offsets: tuple, sizes: tuple, dtype: torch.dtype, shape) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                 properties=TensorProperties(dtype=dtype), size=torch.Size(shape)))


class PageLoadPlanner(LoadPlanner):
    """Every page this rank holds, of every kind the job has, from the checkpoint's tensors; bytes items into
    `objects` (those named in `wanted`, or starting with a prefix in it); `buffers` (fqn -> the model's tensor)."""

    def __init__(self, engine, wanted: list[str], buffers: dict[str, torch.Tensor]):
        self.engine, self.wanted, self.buffers = engine, wanted, buffers
        self.objects: dict[str, object] = {}
        self.targets: dict[tuple[str, tuple], Run] = {}
        # Pages held for items being read (id -> page). One at a time, unless a reader that releases them itself
        # (`release_page`) sets `keep_held`: CheckedReader reads one page's items while the next is resolved.
        self._held: dict[int, Page] = {}
        self.keep_held = False
        self.started = False  # whether any page was changed (from the first item read on)
        # Each filled page's items, and where those copied byte for byte from a file lie (backing.py): a page
        # placed on disk then needs no write, its slot reads the checkpoint. Kept across holds: a page whose items
        # come from several files (another rank count) is held once per file.
        self._items: dict[int, int] = {}
        self._extents: dict[int, list[Extent]] = {}
        # Pages this load made afresh (discarded, then zero-filled when first held): their bytes outside the items
        # are zeros already, and nothing but the load writes them while it runs
        self._zeroed: set[int] = set()
        self._clearers: dict[str, Callable] = {}  # clearers this load set for kinds that had none (`end` drops them)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        engine, md = self.engine, self.metadata.state_dict_metadata
        layout = engine.layout
        items: list[ReadItem] = []
        for fqn in md:
            if any(fqn == w or (w.endswith(".") and fqn.startswith(w)) for w in self.wanted):
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                      dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(fqn),
                                      storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        problems: list[str] = []
        for fqn, tensor in self.buffers.items():
            saved = md.get(fqn)
            if not isinstance(saved, TensorStorageMetadata):
                problems.append(f"no '{fqn}'")
                continue
            if tuple(saved.size) != tuple(tensor.shape):
                problems.append(f"'{fqn}' has shape {tuple(saved.size)}, the model's {tuple(tensor.shape)}")
                continue
            chunk = ChunkStorageMetadata(torch.Size((0,) * tensor.dim()), tensor.shape)
            items += create_read_items_for_chunk_list(fqn, saved, [chunk])
        on_page = segments_by_page(layout)
        groups: list[list[ReadItem]] = []  # each page's items
        for kind in SAVED_KINDS:
            for index, _page in held_pages(engine, kind):
                groups.append([])
                dtype = engine.tensors.dtype(kind, index)
                for fqn, offsets, run in page_runs(layout, on_page[index], kind, index, dtype):
                    fqn = global_fqn(engine, kind, run.name)
                    source = _source(fqn, kind, engine.expert_names.get(run.name, run.name), md,
                                     "master" in engine.pages, dtype)
                    saved = md.get(source)
                    if not isinstance(saved, TensorStorageMetadata):
                        problems.append(f"no '{fqn}'")
                        continue
                    offsets, shape = full_box(engine, run.name, offsets, layout.slot(run.name).shape)
                    if tuple(saved.size) != tuple(shape):
                        problems.append(f"'{fqn}' has shape {tuple(saved.size)}, the model's {tuple(shape)}")
                        continue
                    self.targets[(fqn, offsets)] = run
                    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(run.sizes))
                    for item in create_read_items_for_chunk_list(source, saved, [chunk]):
                        groups[-1].append(replace(item, dest_index=MetadataIndex(fqn, torch.Size(offsets))))
        items += in_file_order(groups, getattr(self.metadata, "storage_data", None))
        problems += [f"'{fqn}' is none of this model's" for fqn in unexpected_tensors(engine, md)]
        if problems:
            unique = list(dict.fromkeys(problems))
            more = f" (and {len(unique) - 4} more)" if len(unique) > 4 else ""
            raise CheckpointError(f"checkpoint: does not fit this model: {'; '.join(unique[:4])}{more}")
        self.plan = LoadPlan(items)
        return self.plan

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        if fqn in self.buffers:
            target = self.buffers[fqn]
        else:
            run = self.targets[(fqn, tuple(read_item.dest_index.offset))]
            page = self._hold(self.engine.pages[run.kind][run.page])
            target = page.view(run.dtype)[run.offset: run.offset + run.numel].view(run.sizes)
        return narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)

    def holdable(self) -> int:
        """Pages a reader may have held at once (`keep_held`): the host pool's, but one left for moves."""
        return self.engine.manager.pools[Tier.HOST].capacity - 1

    def page_of(self, read_item: ReadItem) -> Page | None:
        """The page an item is read into (None: a model buffer, or a bytes item)."""
        run = self.targets.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ())))
        return None if run is None or read_item.dest_index.fqn in self.buffers else \
            self.engine.pages[run.kind][run.page]

    def _hold(self, page: Page) -> Page:
        """Page `page` pinned on the host for the items being read into it. The plan lists a page's items
        together, so one page is held at a time (again for items from another file), or, under `keep_held`, until
        the reader releases it."""
        if page.id in self._held:
            return page
        if not self.keep_held:
            self.release_all()
        if not self.started:
            self._clear_targets()
        manager = self.engine.manager
        if page.dead and (page.kind not in manager.clearers or page.kind in self._clearers):
            self._zeroed.add(page.id)  # (acquired, it is zero-filled but where the items go: PageManager._materialize)
        manager.acquire([page], Tier.HOST)  # a page in memory is written where it is
        self._held[page.id] = page
        self._items.setdefault(page.id, 0)
        self._extents.setdefault(page.id, [])
        return page

    def _clear_targets(self) -> None:
        """Before the first item: every page the load fills (it fills every tensor on it; padding is zero in
        every page) is discarded unless it is on the device, where it is written in place. A page resting on disk
        is then not read only to be overwritten, and one in host memory is not written to disk when the pages
        filled before it need the room."""
        self.started = True
        manager = self.engine.manager
        pages = {(run.kind, run.page): self.engine.pages[run.kind][run.page] for run in self.targets.values()}
        covered: dict[str, dict[int, list[tuple[int, int]]]] = {}
        for run in self.targets.values():
            start = run.offset * run.dtype.itemsize
            covered.setdefault(run.kind, {}).setdefault(run.page, []).append((start, start + run.numel *
                                                                               run.dtype.itemsize))
        for kind, runs in covered.items():  # a page made afresh is zeroed only where no item lands
            if kind not in manager.clearers:
                self._clearers[kind] = manager.clearers[kind] = ZeroOutsideRuns(runs)
        manager.flush(list(pages.values()))
        manager.discard([p for p in pages.values()
                         if not p.dead and (p.state is PageState.DISK
                                            or (p.state is PageState.HOST and manager.disk is not None))])

    def end(self) -> None:
        """The load is over (read whole or not): the page kinds' clearers as they were before it."""
        clearers = self.engine.manager.clearers
        for kind, clearer in self._clearers.items():
            if clearers.get(kind) is clearer:
                del clearers[kind]
        self._clearers.clear()

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """The bytes are in the held page (it is released dirty once its items are read)."""
        page = self.page_of(read_item)
        if page is not None:
            self._items[page.id] += 1

    def loaded_from(self, read_item: ReadItem, target: torch.Tensor, path: str, offset: int, nbytes: int) -> None:
        """The item just committed into `target` is `nbytes` bytes at `offset` of file `path`, as they are."""
        page = self.page_of(read_item)
        if page is None or page.id not in self._held or target.dtype != page.dtype or not target.is_contiguous():
            return
        self._extents[page.id].append(Extent(path, offset, nbytes, target.data_ptr() - page.buffer.data_ptr()))

    def release_all(self) -> None:
        """Every held page back to the manager (after the last item, or a failed read)."""
        for page in list(self._held.values()):
            self.release_page(page)

    def page_checksum(self, page: Page) -> Callable[[], int] | None:
        """For a held page that could rest on its checkpoint file (a disk tier, the page in host memory): its
        checksum as a function, which a reading thread may call once the page's bytes are in."""
        disk, buffer = self.engine.manager.disk, page.buffer
        if disk is None or buffer is None or buffer.device.type != "cpu" or page.state is not PageState.HOST:
            return None
        return lambda: disk.engine.checksum(buffer)

    def release_page(self, page: Page, checksum: int | None = None) -> None:
        """A held page back to the manager, dirty. When every item on it came byte for byte from a file and the
        rest is zeros, its source is offered to the disk tier (`checksum`: the page's, if the reader took it once
        the page's bytes were in)."""
        if self._held.pop(page.id, None) is None:
            return
        manager = self.engine.manager
        manager.release([page], dirty=True)
        disk, items, extents = manager.disk, self._items[page.id], self._extents[page.id]
        if (disk is None or not items or len(extents) != items or page.buffer is None
                or page.buffer.device.type != "cpu" or page.state is not PageState.HOST):
            return
        extents = tuple(sorted(extents, key=lambda e: e.page_offset))
        buffer = page.buffer
        if page.id in self._zeroed or zero_outside(buffer, extents):
            disk.offer(page, Source(extents, page.version,
                                    disk.engine.checksum(buffer) if checksum is None else checksum))
