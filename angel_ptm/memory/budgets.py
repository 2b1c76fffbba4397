"""Resolving the tier budgets of a job: "auto" becomes bytes, and impossible budgets are refused up front."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from angel_ptm.errors import BudgetError
from angel_ptm.memory.disk_dir import check_disk_dir
from angel_ptm.memory.page import Tier


@dataclass(frozen=True)
class Budgets:
    device: int
    host: int
    disk: int


def plan_budgets(device_budget, host_budget, disk_budget, states_bytes: int, device: torch.device, page_bytes: int,
                 *, gpu_free: int | None = None, ram_available: int | None = None, slack_bytes: int = 0,
                 share: int = 1, gathered_bytes: int = 0) -> Budgets:
    """Bytes per tier, no checks, no side effects. "auto": device = everything (CPU) or 80% of free GPU memory;
    host = the rest of the states plus `slack_bytes` (room to rotate the largest layer through the device), up to
    half the available RAM; disk = a slot for every page when some must live there. `share`: the processes on this
    machine (torchrun's LOCAL_WORLD_SIZE), which split its RAM between them; `gathered_bytes`: device room for
    copies of other ranks' parameter pages (ZeRO-3), which a device budget may hold beyond this rank's states."""
    if device_budget == "auto":
        if device.type == "cuda":
            gpu_free = int(torch.cuda.mem_get_info(device)[0]) if gpu_free is None else gpu_free
            device_budget = int(0.8 * gpu_free)
        else:
            device_budget = states_bytes
    device_budget = min(int(device_budget), states_bytes + gathered_bytes)
    if host_budget == "auto":
        ram_available = psutil.virtual_memory().available if ram_available is None else ram_available
        rest = states_bytes - device_budget
        # At least the four pages one optimizer update needs (and room to stage disk reads).
        host_budget = min(max(rest + slack_bytes if rest > 0 else 0, 4 * page_bytes),
                          ram_available // (2 * max(1, share)))
    host_budget = int(host_budget)
    needed_on_disk = max(0, states_bytes - max(0, device_budget - gathered_bytes) - host_budget)
    if disk_budget == "auto":  # room for a home slot per page, so clean copies are dropped, never rewritten
        disk_budget = states_bytes if needed_on_disk else 0
    return Budgets(device_budget, host_budget, int(disk_budget))


def resolve_budgets(device_budget, host_budget, disk_budget, states_bytes: int, device: torch.device,
                    disk_dir: str, page_bytes: int, slack_bytes: int = 0, share: int = 1,
                    gathered_bytes: int = 0) -> Budgets:
    """`plan_budgets`, then refuse budgets that cannot hold the states, before anything is allocated."""
    budgets = plan_budgets(device_budget, host_budget, disk_budget, states_bytes, device, page_bytes,
                           slack_bytes=slack_bytes, share=share, gathered_bytes=gathered_bytes)
    device_budget, host_budget, disk_budget = budgets.device, budgets.host, budgets.disk
    needed_on_disk = max(0, states_bytes - max(0, device_budget - gathered_bytes) - host_budget)
    if needed_on_disk and disk_budget < needed_on_disk:
        raise BudgetError("disk", needed_on_disk, disk_budget,
                          what="the model states that fit neither the device nor the host budget")
    if disk_budget:  # slot files go there: memory.disk_dir created, writable, with room, or a DiskDirError
        check_disk_dir(disk_dir, needed_on_disk)
    return budgets


def device_reserve_pages(device_slots: int, state_pages: int, largest_layer_pages: int) -> int:
    """Device slots kept free while pages are created: room for the largest layer to come up, unless the device
    holds every state page (then nothing ever needs to come up)."""
    return 0 if device_slots >= state_pages else largest_layer_pages


def start_tiers(n_new_pages: int, host_slots: int, device_room: int) -> list[Tier]:
    """Where each of `n_new_pages` pages created in a row rests once all exist, in creation order: the host while it
    has room, then the device for `device_room` pages, then the host again, each later page taking the host slot of
    the oldest page there, which rests on disk instead. The engine creates every page directly where it ends up, so
    the pages that end on disk are made there dead (zeros: nothing is written; a first use gets a cleared slot)."""
    tiers: list[Tier] = []
    host_queue: list[int] = []  # pages given a host slot, in order (the oldest leave first)
    on_device = 0
    for i in range(n_new_pages):
        if len(host_queue) >= host_slots and on_device < device_room:
            tiers.append(Tier.DEVICE)
            on_device += 1
        else:
            tiers.append(Tier.HOST)
            host_queue.append(i)
    for i in host_queue[: max(0, len(host_queue) - host_slots)]:
        tiers[i] = Tier.DISK
    return tiers


def staging_host_pages(unit_pages: int, on_disk: bool) -> int:
    """Host slots a unit's acquisition needs when pages live on disk: a unit pins all its pages at once, and
    those that rest on the host or are read from disk stay pinned there until they rise to the device; each one
    that rises may displace a dirty device page, which needs a host slot of its own. So the host must have one slot
    more than the unit has pages (then an unpinned host page can always make way, down to disk)."""
    return unit_pages + 1 if on_disk else 0


def disk_reservations(counts: dict[str, int], disk_slots: int) -> dict[str, int]:
    """Slots each kind's page file reserves up front (the engine fallocates them; the estimate counts them): a slot
    per page when every page fits the disk budget, else each kind its share of the budget in proportion to its pages
    (kinds differ in count: frozen tensors have parameter pages only, ZeRO shards some kinds and not others)."""
    total = sum(counts.values())
    if not disk_slots or not total:
        return {kind: 0 for kind in counts}
    if total <= disk_slots:
        return dict(counts)
    return {kind: disk_slots * n // total for kind, n in counts.items()}
