"""Resolving the tier budgets of a job: "auto" becomes bytes, and impossible budgets are refused up front."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import psutil
import torch

from angel_ptm.errors import BudgetError


@dataclass(frozen=True)
class Budgets:
    device: int
    host: int
    disk: int


def resolve_budgets(device_budget, host_budget, disk_budget, states_bytes: int, device: torch.device,
                    disk_dir: str, page_bytes: int) -> Budgets:
    """Bytes per tier. "auto": device = everything (CPU) or 80% of free GPU memory; host = the rest of the states,
    up to half the available RAM; disk = a slot for every page when some must live there."""
    if device_budget == "auto":
        if device.type == "cuda":
            device_budget = int(0.8 * torch.cuda.mem_get_info(device)[0])
        else:
            device_budget = states_bytes
    device_budget = min(int(device_budget), states_bytes)
    if host_budget == "auto":
        # At least the four pages one optimizer update needs (and room to stage disk reads).
        host_budget = min(max(states_bytes - device_budget, 4 * page_bytes), psutil.virtual_memory().available // 2)
    host_budget = int(host_budget)
    needed_on_disk = max(0, states_bytes - device_budget - host_budget)
    if disk_budget == "auto":  # room for a home slot per page, so clean copies are dropped, never rewritten
        disk_budget = states_bytes if needed_on_disk else 0
    disk_budget = int(disk_budget)
    if needed_on_disk:
        if disk_budget < needed_on_disk:
            raise BudgetError("disk", needed_on_disk, disk_budget,
                              what="the model states that fit neither the device nor the host budget")
        os.makedirs(disk_dir, exist_ok=True)
        free = shutil.disk_usage(disk_dir).free
        if free < needed_on_disk:
            raise BudgetError("disk", needed_on_disk, free, what=f"model states in {disk_dir}")
    return Budgets(device_budget, host_budget, disk_budget)
