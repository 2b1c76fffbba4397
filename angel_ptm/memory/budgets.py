"""Resolving the tier budgets of a job: "auto" becomes bytes, and impossible budgets are refused up front."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from angel_ptm.errors import BudgetError
from angel_ptm.memory.disk_dir import check_disk_dir


@dataclass(frozen=True)
class Budgets:
    device: int
    host: int
    disk: int


def plan_budgets(device_budget, host_budget, disk_budget, states_bytes: int, device: torch.device, page_bytes: int,
                 *, gpu_free: int | None = None, ram_available: int | None = None, slack_bytes: int = 0,
                 share: int = 1, gathered_bytes: int = 0, activation_bytes: int = 0,
                 activation_tier: str = "none", device_floor_bytes: int = 0) -> Budgets:
    """Bytes per tier, no checks, no side effects. "auto": device = everything (CPU) or 80% of free GPU memory;
    host = the rest of the states plus `slack_bytes` (room to rotate the largest layer through the device), up to
    half the available RAM; disk = a slot for every page when some must live there. `share`: the processes on this
    machine (torchrun's LOCAL_WORLD_SIZE), which split its RAM between them; `gathered_bytes`: device room for
    copies of other ranks' parameter pages (ZeRO-3), which a device budget may hold beyond this rank's states;
    `activation_bytes`: room for activation pages (activations.offload) where `activation_tier` ("host" or "disk")
    says they rest, added to that tier's "auto" budget. `device_floor_bytes`: the fewest device bytes the job runs
    with (ZeRO-3: the largest unit's gathered groups beside the pages a rank pins of its own), which may exceed
    its pages' bytes on a small model: a CPU's "auto" budget is at least that, and no budget is cut below it."""
    if device_budget == "auto":
        if device.type == "cuda":
            gpu_free = int(torch.cuda.mem_get_info(device)[0]) if gpu_free is None else gpu_free
            device_budget = int(0.8 * gpu_free)
        else:
            device_budget = max(states_bytes + gathered_bytes, device_floor_bytes)
    device_budget = min(int(device_budget), max(states_bytes + gathered_bytes, device_floor_bytes))
    # The pools hold whole pages: what a budget holds is its bytes rounded down to pages (an 800 KiB device budget
    # of 64 KiB pages holds 768 KiB, and the host and disk take the rest)
    whole = lambda nbytes: nbytes // page_bytes * page_bytes  # noqa: E731
    if host_budget == "auto":
        ram_available = psutil.virtual_memory().available if ram_available is None else ram_available
        rest = states_bytes - whole(device_budget)
        # At least the four pages one optimizer update needs (and room to stage disk reads).
        host_budget = min(max(rest + slack_bytes if rest > 0 else 0, 4 * page_bytes)
                          + (activation_bytes if activation_tier == "host" else 0),
                          ram_available // (2 * max(1, share)))
    host_budget = int(host_budget)
    needed_on_disk = max(0, states_bytes - max(0, whole(device_budget) - gathered_bytes) - whole(host_budget))
    if disk_budget == "auto":  # room for a home slot per page, so clean copies are dropped, never rewritten
        # A device that cannot hold every state keeps `slack_bytes` free for the largest layer to come up
        # (placement.device_reserve_pages): what would rest there rests on the host or the disk instead.
        room = whole(device_budget) - gathered_bytes
        if 0 < room < states_bytes and not needed_on_disk:
            needed_on_disk = max(0, states_bytes - max(0, room - slack_bytes) - whole(host_budget))
        # With activation pages on disk there is a disk tier, so any page may get its home slot there too,
        # and so may offload host's, where the host cannot hold them beside the states it keeps (a larger host
        # budget that let the states off the disk otherwise left them nowhere: refused, where a smaller one ran)
        host_spare = whole(host_budget) - max(0, states_bytes - whole(device_budget))
        spill = activation_tier == "host" and activation_bytes > max(0, host_spare)
        on_disk = bool(needed_on_disk) or activation_tier == "disk" or spill
        disk_budget = states_bytes + activation_bytes if on_disk else 0
    return Budgets(device_budget, host_budget, int(disk_budget))


def resolve_budgets(device_budget, host_budget, disk_budget, states_bytes: int, device: torch.device,
                    disk_dir: str, page_bytes: int, slack_bytes: int = 0, share: int = 1,
                    gathered_bytes: int = 0, activation_bytes: int = 0, activation_tier: str = "none",
                    device_floor_bytes: int = 0) -> Budgets:
    """`plan_budgets`, then refuse budgets that cannot hold the states, before anything is allocated."""
    budgets = plan_budgets(device_budget, host_budget, disk_budget, states_bytes, device, page_bytes,
                           slack_bytes=slack_bytes, share=share, gathered_bytes=gathered_bytes,
                           activation_bytes=activation_bytes, activation_tier=activation_tier,
                           device_floor_bytes=device_floor_bytes)
    device_budget, host_budget, disk_budget = budgets.device, budgets.host, budgets.disk
    needed_on_disk = max(0, states_bytes - max(0, device_budget - gathered_bytes) - host_budget)
    if needed_on_disk and disk_budget < needed_on_disk:
        raise BudgetError("disk", needed_on_disk, disk_budget,
                          what="the model states that fit neither the device nor the host budget")
    if disk_budget:  # slot files go there: memory.disk_dir created, writable, with room, or a DiskDirError
        check_disk_dir(disk_dir, needed_on_disk * max(1, share))  # this machine's processes share the disk
    return budgets



