"""The tiers of one engine, opened in order: budgets, the SSD engine, this rank's page-file directory, the pools and
their manager, and every page this rank holds, each created where it will rest. `close` undoes all of it; a start
that fails part-way closes whatever was opened.

    paging = open_paging(config, layout, kinds, ownership, estimate, mesh, device, trace)
    paging.manager, paging.pages, paging.budgets
    paging.close()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass

from angel_ptm.io import create_engine
from angel_ptm.memory import BufferPool, DiskTier, PageManager, Tier
from angel_ptm.memory.budgets import Budgets, resolve_budgets
from angel_ptm.memory.disk_dir import page_dir, remove_dead_page_dirs
from angel_ptm.memory.placement import creation_tiers, disk_reservations
from angel_ptm.memory.store import PageStore
from angel_ptm.optim.fused_adam import set_threads as set_adam_threads
from angel_ptm.page_tensors import PageTensors


@dataclass
class Paging:
    budgets: Budgets | None = None
    io: object = None
    manager: PageManager | None = None
    pages: PageStore | None = None
    disk_dir: str | None = None  # memory.disk_dir, or a temporary directory this engine made (`own_disk_dir`)
    own_disk_dir: bool = False
    page_dir: str | None = None  # this engine's slot files, under disk_dir (disk_dir/rank<R> with several ranks)
    rank_dir: bool = False
    dropped: weakref.finalize | None = None  # removes the page files of an engine dropped without close()

    def close(self) -> None:
        """Stop the manager and the SSD engine and remove this engine's page files (idempotent, partial-safe)."""
        if self.dropped is not None:
            self.dropped.detach()
        if self.manager is not None:
            self.manager.close(remove_files=True)
        if self.io is not None:
            self.io.close()
        if self.page_dir:
            shutil.rmtree(self.page_dir, ignore_errors=True)
            if self.rank_dir:  # this rank's folder (disk_dir/rank<R>), once nothing else is in it
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(self.page_dir))
        if self.own_disk_dir and self.disk_dir:
            shutil.rmtree(self.disk_dir, ignore_errors=True)


def open_paging(paging: Paging, config, layout, kinds, ownership, estimate, mesh, device, trace, owner: int) -> None:
    """Fill `paging` (the caller holds it, so a failure part-way can close what was opened) for this rank's pages
    of `kinds`; `estimate` was checked already, `owner` names the page-file directory."""
    mem, page_bytes = config.memory, config.memory.page_bytes
    n_states = sum(ownership.local_count(kind, layout.kind_pages(kind)) for kind in kinds)
    keep_free = max(estimate.largest_layer_pages, estimate.gather_pages)  # the largest unit, or ZeRO-3's copies
    paging.budgets = budgets = resolve_budgets(
        mem.device_budget, mem.host_budget, mem.disk_budget, n_states * page_bytes, device, paging.disk_dir,
        page_bytes, slack_bytes=keep_free * page_bytes, share=mesh.local_world_size,
        gathered_bytes=ownership.remote_count(layout.n_pages) * page_bytes,
        activation_bytes=estimate.activation_page_bytes, activation_tier=config.activations.offload,
        device_floor_bytes=estimate.device_floor_pages * page_bytes)
    if mesh.local_world_size > 1:  # the processes on this machine share its cores
        set_adam_threads(max(1, (os.cpu_count() or 1) // mesh.local_world_size))
    paging.io = create_engine(mem.io_threads, mem.queue_depth)
    paging.rank_dir = mesh.distributed
    paging.page_dir = page_dir(os.path.join(paging.disk_dir, f"rank{mesh.rank}") if mesh.distributed
                               else paging.disk_dir, owner)
    # An engine dropped without close(): its page files go when its paging is collected (or at exit)
    paging.dropped = weakref.finalize(paging, _remove_page_dirs, paging.page_dir, paging.rank_dir,
                                      paging.disk_dir if paging.own_disk_dir else None)
    disk = DiskTier(paging.page_dir, page_bytes, budgets.disk, paging.io, rank=mesh.rank) if budgets.disk else None
    paging.manager = manager = PageManager(
        BufferPool(Tier.DEVICE, page_bytes, budgets.device, device),
        BufferPool(Tier.HOST, page_bytes, budgets.host, "cpu", pin=device.type == "cuda"),
        disk,
        trace=trace,
        async_copies=mem.scheduler == "planned",  # CPU: host<->device copies on a thread, overlapping compute
        zero_copy=mem.zero_copy,  # without CUDA both pools are plain memory: pages change tier by trading slots
    )
    if disk is not None:  # one preallocated slot per page and kind: clean copies are dropped, never rewritten
        counts = {kind: ownership.local_count(kind, layout.kind_pages(kind)) for kind in kinds}
        for kind, slots in disk_reservations(counts, disk.capacity).items():
            disk.reserve(kind, slots)
    pools = manager.pools  # each new page where it will rest (placement.creation_tiers)
    tiers = creation_tiers(pools[Tier.DEVICE].capacity, pools[Tier.HOST].capacity, n_states,
                           estimate.gather_copy_pages, keep_free)
    paging.pages = PageStore.create(manager, layout, kinds, ownership, iter(tiers),
                                    PageTensors(manager, layout, {}).dtype)


def _remove_page_dirs(page_dir: str, rank_dir: bool, own_disk_dir: str | None) -> None:
    shutil.rmtree(page_dir, ignore_errors=True)
    if rank_dir:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(page_dir))
    if own_disk_dir:
        shutil.rmtree(own_disk_dir, ignore_errors=True)


def choose_disk_dir(paging: Paging, disk_dir: str | None) -> str:
    """memory.disk_dir (the page files of this host's killed runs there removed first: their space is this run's),
    or a temporary directory of this engine's own."""
    paging.own_disk_dir = disk_dir is None
    if disk_dir is not None:
        remove_dead_page_dirs(disk_dir)
    paging.disk_dir = disk_dir or tempfile.mkdtemp(prefix="angel-ptm-pages-")
    return paging.disk_dir
