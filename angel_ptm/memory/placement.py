"""Placement: THE rules for which page kinds a job has, where each page rests when it is created, which tier an
optimizer update pins, and what each tier must hold for that. The engine, the estimate and (later) the planner call
these functions; none of them keeps a copy of a rule.

    kinds = creation_order(config)                       # the kinds, coldest first
    tiers = start_tiers(n_pages, host_slots, device_room)  # where each new page rests
    update = update_tier(device, device_slots, host_slots, n_states, len(kinds))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from angel_ptm.errors import BudgetError
from angel_ptm.memory.page import Tier
from angel_ptm.memory.store import PageKind

CREATION_ORDER = (PageKind.EXP_AVG_SQ, PageKind.EXP_AVG, PageKind.GRAD, PageKind.PARAM)  # parameters last: warmest
# Mixed precision (trainer.dtype bfloat16/float16): fp32 master weights get pages of their own, created with the
# other optimizer-only kinds (colder than the parameters and gradients the forward and backward touch). So do fp32
# weights under optimizer.staleness 1: the delayed update writes the master while the step computes with the params.
MIXED_CREATION_ORDER = (PageKind.EXP_AVG_SQ, PageKind.EXP_AVG, PageKind.MASTER, PageKind.GRAD, PageKind.PARAM)
UPDATE_GROUP = 4  # pages one optimizer update pins at once: param, grad, exp_avg, exp_avg_sq of one index (fp32)
DISK_GROWTH_SLOTS = 16  # DiskTier.growth_slots: slots a kind's page file grows by past its reservation


@dataclass(frozen=True)
class Problem:
    """One reason the job cannot run: the arguments of the BudgetError that `Estimate.check` raises."""

    tier: str
    requested: int
    available: int
    what: str

    def error(self) -> BudgetError:
        return BudgetError(self.tier, self.requested, self.available, what=self.what)


def creation_order(config) -> tuple[str, ...]:
    """The page kinds of the job, in the order the engine creates them (one optimizer update pins one of each)."""
    separate_master = config.trainer.dtype != "float32" or config.optimizer.staleness == 1
    return MIXED_CREATION_ORDER if separate_master else CREATION_ORDER


def update_group_kinds(config) -> tuple[str, ...]:
    """The page kinds one optimizer update pins (PagedAdamW.group_kinds): each kind of the job, except the
    parameter pages under optimizer.staleness 1 (the delayed update writes the master pages; the parameters are
    published from them later)."""
    kinds = creation_order(config)
    return tuple(k for k in kinds if k != "param") if config.optimizer.staleness == 1 else kinds


def delayed_update_need(config, update: str, open_page: int, page_bytes: int, budget: int,
                        pinned: Callable[[], int]) -> tuple[int, Problem]:
    """optimizer.staleness 1 with the update on the device: the delayed update runs its page groups within the next
    step, beside what is pinned then (before a unit's forward, the units around it; in backward, a node's saved
    tensor's pages: `pinned()`). The device pages that needs (0 otherwise), and the Problem when it does not fit."""
    delayed = len(update_group_kinds(config))
    around = pinned() if config.optimizer.staleness == 1 and update == "device" else 0
    need = around + open_page + delayed if around else 0
    from angel_ptm.config import format_bytes

    return need, Problem("device", need * page_bytes, budget,
                         f"a delayed update's page group ({delayed} pages: optimizer.staleness 1 updates during the "
                         f"next step) beside the pages pinned then (up to {around} of {format_bytes(page_bytes)}: the "
                         f"units around a unit, or a saved tensor's)")


def compute_dtype(config) -> Optional[torch.dtype]:
    """The mixed-precision compute dtype (bf16 / fp16), or None for fp32 (the parameters are the master weights)."""
    return None if config.trainer.dtype == "float32" else getattr(torch, config.trainer.dtype)


def update_tier(device: torch.device, device_slots: int, host_slots: int, n_state_pages: int,
                group: int = UPDATE_GROUP) -> str:
    """Where the optimizer updates a page group (the engine's choice too). On a GPU, the device (the host-side
    update is the fused CPU Adam's job). On a CPU-only machine both tiers are CPU memory, so when the states do not
    all fit on the device tier the update runs on the host: bringing optimizer states up to the device tier and back
    would only copy them twice per step. `group`: the pages one update pins (one per kind)."""
    if device.type == "cuda" or device_slots >= n_state_pages:
        return "device" if device_slots >= group else "host"
    return "host" if host_slots >= group else "device"


def update_batch_groups(estimate, page_bytes: int, group: int = UPDATE_GROUP, most: int = 16) -> int:
    """The most page groups (`group` pages each) one optimizer access updates (PagedAdamW.batches): one, or more
    where the update tier has slots beyond what the estimate's rules need there, half of them, at most `most`.
    Spare: on the host, its slots beyond that need where every state page has a home slot on disk (the resting
    pages a batch displaces always have somewhere to go); on the device, its slots beyond all the states, the
    largest unit (or ZeRO-3's gathered copies) and an activation page (nothing resting is displaced)."""
    tiers = estimate.tiers
    if estimate.update_tier == "host":
        homes = tiers["disk"].pool >= estimate.states_bytes
        spare = (tiers["host"].pool - tiers["host"].needed) // page_bytes if homes else 0
    else:
        spare = ((tiers["device"].pool - estimate.states_bytes) // page_bytes - 1
                 - max(estimate.largest_layer_pages, estimate.gather_pages + estimate.expert_gather_pages))
    return max(1, min(most, 1 + max(0, spare) // (2 * group)))


@dataclass
class StartPlacement:
    """Where pages rest once all are created, per tier (pages), and what creating them needs of the host."""

    device: int = 0
    host: int = 0
    disk: int = 0
    device_kinds: dict = field(default_factory=dict)  # kind -> pages of that kind created on the device
    disk_kinds: dict = field(default_factory=dict)  # kind -> pages of that kind created on disk
    host_needed: int = 0  # host slots needed to create every page (what the device and disk cannot take)
    failure: Optional[Problem] = None


def place_pages(counts: dict[str, int], slots: dict[str, int], reserve_on_device: int, page_bytes: int,
                kinds: tuple[str, ...] = CREATION_ORDER) -> StartPlacement:
    """Where the engine creates each page (start_tiers over the creation order `kinds`, `counts[kind]`
    pages each: PageLayout.kind_pages). A page created on disk is dead (nothing written) but takes its slot in its
    kind's page file at once (`disk_reservations` reserved per kind, then grown in steps)."""
    place = StartPlacement()
    disk_free = disk_reservations({kind: counts[kind] for kind in kinds}, slots["disk"])
    disk_reserved = sum(disk_free.values())
    device_room = max(0, slots["device"] - reserve_on_device)
    n_states = sum(counts[kind] for kind in kinds)
    tiers = start_tiers(n_states, slots["host"], device_room)
    kind_of = [kind for kind in kinds for _ in range(counts[kind])]
    for i, tier in enumerate(tiers):
        kind = kind_of[i]
        if tier is Tier.DEVICE:
            place.device += 1
            place.device_kinds[kind] = place.device_kinds.get(kind, 0) + 1
        elif tier is Tier.HOST:
            place.host += 1
        else:
            place.disk += 1
            place.disk_kinds[kind] = place.disk_kinds.get(kind, 0) + 1
            if place.failure is None and (not slots["host"] or not slots["disk"] or not disk_free[kind]):
                room = slots["disk"] - disk_reserved
                if not slots["host"] or not slots["disk"] or room <= 0:
                    place.failure = _placement_failure(n_states, slots, reserve_on_device, page_bytes)
                else:
                    grow = min(DISK_GROWTH_SLOTS, room)
                    disk_reserved += grow
                    disk_free[kind] += grow
            if place.failure is None:
                disk_free[kind] -= 1
    place.host_needed = max(0, n_states - device_room - slots["disk"])
    return place


def _placement_failure(states: int, slots: dict[str, int], reserve_on_device: int, page_bytes: int) -> Problem:
    device_takes = max(0, min(states, slots["device"] - reserve_on_device))
    disk_takes = slots["disk"]
    needed = max(1, states - device_takes - disk_takes)  # at least one host slot: pages are created there
    where = f"a disk tier of {disk_takes} pages" if disk_takes else "no disk tier"
    return Problem("host", needed * page_bytes, slots["host"] * page_bytes,
                   f"the {states} state pages at start: the device takes {device_takes} (it keeps "
                   f"{reserve_on_device} free for the largest layer), {where}")


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


def creation_tiers(device_slots: int, host_slots: int, n_states: int, gathered: int, keep_free: int) -> list[Tier]:
    """Where each of a rank's `n_states` new pages rests (kinds in creation order): `start_tiers`, the device keeping
    `keep_free` slots (the largest unit's pages, or ZeRO-3's `gathered` copies) unless it holds everything."""
    reserve = device_reserve_pages(device_slots, n_states + gathered, keep_free)
    return start_tiers(n_states, host_slots, max(0, device_slots - reserve))


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
