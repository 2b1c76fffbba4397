"""The memory estimate of a job, per rank, before anything is allocated.

    estimate = estimate_job(load_config("configs/default.yaml"))   # the model is built on the meta device
    print(estimate.format_table())
    estimate.check()                                                 # BudgetError naming tier and bytes

It answers, from the config alone (or from an existing nn.Module): how many pages each state kind takes, what the
budgets resolve to ("auto" included), the activation peak, the pinned host bytes, the disk space the page files
reserve, and for each tier the peak bytes in use the memory trace will record (`PageManager.in_use()`). The Engine
runs the same estimate at start and refuses a job that cannot fit, with these numbers.

The peaks follow how the engine fills its tiers. Pages are created kind by kind (`CREATION_ORDER`), on the host
while it has room, then on the device (which keeps the largest layer's pages free), then on the host again, each new
page taking the place of the oldest host page, which is created on disk instead (dead: its zeros are never written,
but it has its disk slot); `place_pages` replays that exactly (memory.placement.start_tiers, as the engine does), so
the host peaks at its budget (or at every page). The step then brings every parameter and gradient page (and the
optimizer states, when the update runs on the device) up to the device, which fills up to its budget. A page written
to disk keeps its home slot there (a clean copy is dropped, not rewritten), so the disk's bytes in use count the
pages that ever went down: those created there and, when the live states (parameters and both Adam moments; a
gradient page lives only from its backward to its update, then is discarded unwritten) exceed the device and host
together, all the live states, which every step cycles through the disk. When the live states fit, later steps may
still spill a few pages: the estimate then counts the pages created on disk only, a lower bound.
Activations are ordinary tensors on the compute device, outside the page pools: they count toward the machine's
memory, not toward any tier budget.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import psutil
import torch
from torch import nn

from angel_ptm.activations.source import (ActivationSource, activation_bytes, activation_page_bytes,
                                          activation_suggestion, offload_problems, with_offload_peaks)
from angel_ptm.config import Config, format_bytes, load_config
from angel_ptm.errors import ConfigValueError
from angel_ptm.memory import PageLayout, build_layout, compute_device
from angel_ptm.units import PagingUnit, device_pages_at_once, experts_as_units, find_units, pages_around
from angel_ptm.memory.budgets import plan_budgets
from angel_ptm.memory.placement import (CREATION_ORDER, Problem, StartPlacement, compute_dtype, creation_order,
                                        delayed_update_need, device_reserve_pages, disk_reservations, place_pages,
                                        staging_host_pages, update_batch_groups, update_group_kinds, update_tier)
from angel_ptm.memory.disk_dir import check_disk_dir, free_disk_bytes
from angel_ptm.memory.store import PageKind
from angel_ptm.models import build_model
from angel_ptm.optim.no_decay import no_decay_names
from angel_ptm.parallel.grad_sync import reduction_buffer_bytes
from angel_ptm.parallel.ownership import (Ownership, collective_bytes, gather_capacity, gather_reserve,
                                          min_gather_device_pages, osdp_replicable, with_experts)
from angel_ptm.parallel.moe.placement import replica_bytes

MIXED_MASTER_NOTE = "param and grad pages hold bf16/fp16 in half their bytes"
STALE_MASTER_NOTE = "optimizer.staleness 1: the delayed update writes it while a step computes with the param pages"
TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class TierEstimate:
    """One tier, in bytes. `needed`: the least this tier must hold for the job to run; `budget`: the resolved
    budget; `pool`: what the tier really allocates (whole pages; for the disk, the slots reserved up front);
    `peak`: the expected peak of the bytes in use that trace.jsonl records; `available`: what the machine has for
    it now (free GPU memory, free disk space; None where the host RAM check covers it)."""

    tier: str
    needed: int
    budget: int
    pool: int
    peak: int
    available: Optional[int]
    fits: bool


@dataclass(frozen=True)
class Estimate:
    """Per-rank memory of a job. Byte counts are ints; `tiers` holds one TierEstimate per tier."""

    rank: int
    world_size: int
    compute_device: str
    params: int  # distinct parameter elements (a tied weight once)
    page_bytes: int
    n_pages: int  # parameter pages (PageLayout.n_pages); the other kinds have one per trainable page (kind_bytes)
    kind_bytes: dict  # state kind -> bytes of its pages
    master_extra_bytes: int  # master weights beyond the parameter pages (0: parameters are fp32, they are the master)
    states_bytes: int
    largest_layer: str
    largest_layer_pages: int
    update_tier: str  # where an optimizer update pins its four pages
    activation_bytes: Optional[int]  # saved for backward, on the compute device outside the pools; None: unknown
    activation_page_bytes: int  # room for activations.offload's pages (host or disk), 0 without offload
    pinned_host_bytes: int  # the host pool is pinned when the compute device is CUDA
    host_ram_needed: int  # CPU memory the pools (and, on a CPU device, activations) take
    host_ram_available: int
    disk_dir: str
    start_pages: dict  # tier -> pages resting there once every page is created
    tiers: dict  # tier -> TierEstimate
    problems: tuple = field(default=())
    master_note: str = ""  # why there are master pages (shown with them)
    gpu_memory_given: bool = False  # the GPU's memory came from the caller (a GPU not present here), not from CUDA
    zero: int = 0  # ZeRO stage (parallel.zero; no effect with one rank)
    largest_unit_groups: int = 1  # page groups the largest unit and those around it span (ZeRO-3 gathers them)
    gather_groups: int = 0  # ZeRO-3: page groups kept gathered at once (parallel/ownership.gather_capacity)
    collective_buffer_bytes: int = 0  # ZeRO 2-3: the reduce-scatters' own buffers, outside the pools
    osdp_groups: int = 0  # parallel.osdp: page groups that may be kept replicated (parallel/ownership.osdp_replicable)
    gather_pages: int = 0  # ZeRO-3: device slots those groups take at most
    gather_copy_pages: int = 0  # of them, copies of other ranks' pages (a group's own page is its gather's input)
    device_floor_pages: int = 0  # ZeRO-3: no device budget is cut below this many slots (memory/budgets.py)
    expert_gather_pages: int = 0  # ZeRO-3 with ep < dp: one MoE layer's expert pages, gathered while it computes
    collective_bytes: dict = field(default_factory=dict)  # per step, bytes this rank hands to each collective
    checkpoint_staging_bytes: int = 0  # checkpoint.async_save: host RAM a save beside training copies pages into
    replica_bytes: int = 0  # parallel.moe_replicas: hot-expert copies (weights and gradients), outside the pools
    update_group_pages: int = 4  # pages one optimizer update pins per page group (placement.update_group_kinds)
    update_batch_groups: int = 1  # page groups one optimizer access updates (placement.update_batch_groups)
    local_world_size: int = 1  # processes on this machine, each with pools of its own in its RAM

    @property
    def fits(self) -> bool:
        return not self.problems

    def check(self) -> None:
        """Raise the BudgetError of the first problem found (one line: tier, bytes needed, bytes available), with
        the tier's whole need where its other needs are larger: the budget to ask for at once."""
        if self.problems:
            first, tier = self.problems[0], self.tiers.get(self.problems[0].tier)
            if tier is not None and first.available == tier.budget and tier.needed > first.requested:
                first = replace(first, what=f"{first.what}; the {first.tier} tier needs {format_bytes(tier.needed)} "
                                            f"in all (angel-ptm estimate lists each need)")
            raise first.error()

    def peaks(self) -> dict[str, int]:
        return {tier: self.tiers[tier].peak for tier in TIERS}

    def as_dict(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        out["problems"] = [dict(asdict(p), message=str(p.error())) for p in self.problems]
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def format_table(self) -> str:
        given = f" ({format_bytes(self.tiers['device'].available)} of GPU memory given, not measured)" \
            if self.gpu_memory_given else ""
        lines = [f"memory estimate, rank {self.rank} of {self.world_size}, compute device {self.compute_device}{given}"
                 + (f", ZeRO stage {self.zero} (per-rank pages below)" if self.world_size > 1 else ""),
                 f"  parameters {self.params:,}: {self.n_pages} pages of {format_bytes(self.page_bytes)} "
                 f"per state kind"]
        for kind in ("param", "grad", "exp_avg", "exp_avg_sq"):
            lines.append(f"    {kind:<11} {self.kind_bytes[kind] // self.page_bytes:>6} pages  "
                         f"{format_bytes(self.kind_bytes[kind]):>10}")
        if self.master_extra_bytes:
            lines.append(f"    {'master':<11} {self.master_extra_bytes // self.page_bytes:>6} pages  "
                         f"{format_bytes(self.master_extra_bytes):>10}"
                         f"  (fp32; {self.master_note})")
        else:
            lines.append(f"    {'master':<11} {0:>6} extra  {format_bytes(self.master_extra_bytes):>10}"
                         f"  (fp32 parameters are the master weights)")
        n_states = self.states_bytes // self.page_bytes
        lines.append(f"    {'states':<11} {n_states:>6} pages  {format_bytes(self.states_bytes):>10}")
        lines.append(f"  largest unit '{self.largest_layer}': {self.largest_layer_pages} pages on the device at once;"
                     f" optimizer updates on the {self.update_tier}, up to {self.update_batch_groups} page "
                     f"group{'s' if self.update_batch_groups > 1 else ''} of {self.update_group_pages} pages "
                     f"per access")
        act = ("unknown (not our GPT: pass example_inputs)" if self.activation_bytes is None
               else format_bytes(self.activation_bytes))
        if self.gather_pages:
            lines.append(f"  gathered parameter pages up to {self.gather_pages} on the device "
                         f"({format_bytes(self.gather_pages * self.page_bytes)}: "
                         f"{self.gather_groups} page groups of {self.world_size})")
        if self.expert_gather_pages:
            lines.append(f"  an MoE layer's experts gathered from the ranks holding them: up to "
                         f"{self.expert_gather_pages} pages on the device while it computes")
        if self.osdp_groups:
            lines.append(f"  OSDP: up to {self.osdp_groups} of those groups kept replicated: the ones compute waits "
                         f"on longest in the first step after the recorded one (the engine reports which, and why)")
        if self.collective_bytes:
            lines.append("  collectives per step: " + ", ".join(
                f"{name} {format_bytes(n)}" for name, n in self.collective_bytes.items()))
        if self.collective_buffer_bytes:
            lines.append(f"  reduce-scatter buffers {format_bytes(self.collective_buffer_bytes)}, on the "
                         f"{self.compute_device} outside the page pools")
        if self.replica_bytes:
            lines.append(f"  hot-expert copies up to {format_bytes(self.replica_bytes)} (parallel.moe_replicas: "
                         f"weights and their gradients), on the {self.compute_device} outside the page pools")
        lines.append(f"  activation peak {act}, on the {self.compute_device} outside the page pools")
        if self.activation_page_bytes:
            lines.append(f"  activation pages: room for {format_bytes(self.activation_page_bytes)} "
                         f"(activations.offload), moved like any page")
        per = self.local_world_size
        lines.append(f"  pinned host memory {format_bytes(self.pinned_host_bytes)}; host RAM needed "
                     f"{format_bytes(self.host_ram_needed)}"
                     + (f" per rank, {format_bytes(self.host_ram_needed * per)} for the {per} ranks here," if per > 1
                        else "")
                     + f" of {format_bytes(self.host_ram_available)} available"
                     + (" on this machine" if self.gpu_memory_given else ""))
        if self.checkpoint_staging_bytes:
            lines.append(f"  of which {format_bytes(self.checkpoint_staging_bytes)}: checkpoint.async_save's copy of "
                         f"the saved pages in memory, while a checkpoint is written beside training")
        lines.append(f"  page files in {self.disk_dir}: {format_bytes(self.tiers['disk'].pool)} reserved up front")
        header = f"  {'tier':<7}{'needed':>12}{'budget':>12}{'expected peak':>15}{'available':>12}  fits"
        lines += ["", header]
        for tier in TIERS:
            t = self.tiers[tier]
            available = "-" if t.available is None else format_bytes(t.available)
            lines.append(f"  {tier:<7}{format_bytes(t.needed):>12}{format_bytes(t.budget):>12}"
                         f"{format_bytes(t.peak):>15}{available:>12}  {'yes' if t.fits else 'NO'}")
        lines.append("")
        if self.fits:
            lines.append("fits: yes")
        else:
            lines += [f"fits: no: {p.error()}" for p in self.problems]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the estimate
def estimate_job(config=None, model: Optional[nn.Module] = None, *, layout: Optional[PageLayout] = None,
                 disk_dir: Optional[str] = None, device: Optional[torch.device] = None,
                 units: Optional[Sequence[PagingUnit]] = None, gpu_memory: Optional[int] = None,
                 ownership: Optional[Ownership] = None, local_world_size: int = 1,
                 example_inputs=None) -> Estimate:
    """The memory estimate of the job `config` describes (a Config, dict, YAML path or None).

    `model`: an existing module to estimate (default: the config's model, built on the meta device, so nothing
    is allocated). `layout`: its PageLayout if already built. `disk_dir`: where the page files go (default:
    memory.disk_dir, else run.dir/pages, else runs/<new run>/pages: the trainer's runs/<timestamp>/pages). `device`:
    the compute device (default: trainer.device resolved). `gpu_memory`: the bytes of GPU memory to plan for instead
    of asking CUDA for the free memory of the GPU present, so a GPU job is estimated on a machine without one (the
    device budget "auto" resolves against it, and the device pool and activations must fit in it). `ownership`:
    this rank's share of the pages under data parallelism (default: one rank); `local_world_size`: processes on
    this machine, which split its RAM. `example_inputs`: one micro-batch's forward arguments (a tuple, or a dict
    of keyword arguments; real or meta tensors), from which the activations of a model other than our dense GPT are
    traced (activations/footprint.py); without them those are unknown."""
    if not isinstance(config, Config):
        config = load_config(config)
    mem = config.memory
    page_bytes = mem.page_bytes
    device = device or compute_device(config.trainer.device)
    if gpu_memory is not None and device.type != "cuda":
        raise ConfigValueError(f"gpu_memory is the memory of a CUDA device, but the compute device is {device.type}")
    if device.type == "cuda" and gpu_memory is None and not torch.cuda.is_available():
        raise ConfigValueError('trainer.device: "cuda" requested but no CUDA device is available')
    if model is None:
        with torch.device("meta"):  # shapes and dtypes only: no parameter memory is allocated
            model = build_model(config.model)
        if config.parallel.tp > 1:  # one tensor-parallel rank's shards (the engine applies the same plan)
            from angel_ptm.parallel.tensor import TPComm, parallelize, plan_for

            parallelize(model, TPComm.planning(config.parallel.tp, config.parallel.sequence_parallel),
                        plan_for(model))
        if config.parallel.ep > 1:  # one expert-parallel rank's experts (the engine splits them alike)
            from angel_ptm.parallel.moe import EPComm, apply_expert_parallel

            apply_expert_parallel(model, EPComm.planning(config.parallel.ep))
    no_decay_names(model, config.optimizer.no_decay)  # a pattern that matches nothing: the engine's error, and ours
    own = ownership or Ownership()
    if layout is None:
        from angel_ptm.parallel.moe import expert_names

        layout = build_layout(model, page_bytes, dp_world_size=own.dp, compute_dtype=compute_dtype(config),
                              local=expert_names(model))
        if own.local_pages is None:  # this rank's experts, as the engine says
            own = with_experts(own, layout.local_pages, config.parallel.ep)
    kinds = creation_order(config)
    group = len(kinds)  # pages one optimizer update pins: one of each kind
    # This rank's pages of each kind (parallel/ownership.py); frozen tensors' pages are parameter pages only.
    counts = {kind: own.local_count(kind, layout.kind_pages(kind)) for kind in kinds}
    n_states = sum(counts.values())
    states_bytes = n_states * page_bytes
    disk_dir = disk_dir or mem.disk_dir or str(Path(config.run.dir or "runs/<new run>") / "pages")

    gpu_free = gpu_memory if gpu_memory is not None else (
        int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None)
    ram_available = int(psutil.virtual_memory().available)
    # The device holds a unit's pages and those of every unit around it at once (angel_ptm/units.py).
    units = find_units(model, experts=experts_as_units(own.dp, own.stage, config.parallel.ep)) if units is None \
        else units
    largest_name, largest = largest_unit(model, layout, units)
    acts = ActivationSource(model, config, example_inputs, units, device)
    names = {id(p): n for n, p in model.named_parameters()}
    _, chain_groups = device_pages_at_once(units, lambda p: {i // own.dp for i in layout.slot(names[id(p)]).pages})
    remote_pages = own.remote_count(layout.n_pages)  # ZeRO-3: other ranks' parameter pages, gathered here in turn
    paged = activation_page_bytes(acts, states_bytes)  # activations.offload's pages
    offload = config.activations.offload
    max_tensor_pages = max((len(slot.segments) for slot in layout.slots), default=1)
    # ZeRO-3's fewest device slots with the update on the device (the most it pins): no budget is cut below it
    floor = min_gather_device_pages(chain_groups, own.dp, gather_reserve(max_tensor_pages, group)) if own.gathers \
        else 0
    planned = plan_budgets(mem.device_budget, mem.host_budget, mem.disk_budget, states_bytes, device, page_bytes,
                           gpu_free=gpu_free, ram_available=ram_available, slack_bytes=largest * page_bytes,
                           share=local_world_size, gathered_bytes=remote_pages * page_bytes,
                           activation_bytes=paged, activation_tier=offload, device_floor_bytes=floor * page_bytes)
    budgets = {"device": planned.device, "host": planned.host, "disk": planned.disk}
    slots = {tier: budgets[tier] // page_bytes for tier in TIERS}
    update = update_tier(device, slots["device"], slots["host"], n_states, group)
    gather_groups = gather_pages = gather_min = 0
    if own.gathers:
        reserve = gather_reserve(max_tensor_pages, group if update == "device" else 0)
        gather_min = min_gather_device_pages(chain_groups, own.dp, reserve)
        local = layout.local_pages[1] - layout.local_pages[0] if layout.local_pages is not None else 0
        n_groups = (layout.n_pages - local) // own.dp  # (experts under ep: never gathered)
        gather_groups = gather_capacity(chain_groups, own.dp, slots["device"], reserve, n_groups)
        gather_pages = gather_groups * own.dp
    disk_reserved, copies = sum(disk_reservations(counts, slots["disk"]).values()), gather_pages - gather_groups
    reserve = device_reserve_pages(slots["device"], n_states + copies, max(largest, gather_pages))
    start = place_pages(counts, slots, reserve, page_bytes, kinds)
    problems: list[Problem] = []

    # 1. the budgets themselves (what resolve_budgets refuses, and the page files' slots: the engine checks this first)
    # Pages rest on disk when the states fit neither the device (beside the room it keeps free: the largest unit's,
    # or ZeRO-3's gathered copies') nor the host. Then each kind's page file keeps a slot for every page of the kind
    # (memory/placement.disk_reservations): which pages rest there changes as they move, and a kind's free slots
    # are no room for another kind's pages.
    device_keeps = max(0, slots["device"] - max(reserve, copies))
    spill = max(0, n_states - device_keeps - slots["host"]) * page_bytes
    needed_on_disk = states_bytes if spill or start.disk else 0
    if needed_on_disk and budgets["disk"] < needed_on_disk:
        problems.append(Problem("disk", needed_on_disk, budgets["disk"],
                                f"the page files: {format_bytes(spill)} of states fit neither the device nor the "
                                f"host, and each kind's file keeps a slot for every page of it"))
    if disk_reserved:  # the path before its space: a file or a read-only mount is named so, not as a budget
        check_disk_dir(disk_dir, create=False)  # DiskDirError; creates nothing
    disk_free = free_disk_bytes(disk_dir) if disk_reserved else None
    # A checkpoint written beside training holds the disk pages' slots, pages written meanwhile take others (async)
    slots_needed = disk_reserved * (2 if config.checkpoint.async_save else 1)
    # Every process on this machine reserves its own slots there (disk_dir/rank<R>): the space is theirs together.
    if disk_free is not None and disk_free < slots_needed * page_bytes * local_world_size:
        problems.append(Problem("disk", slots_needed * page_bytes * local_world_size, disk_free,
                                f"page files in memory.disk_dir {disk_dir} ({slots_needed} page slots"
                                + (" with checkpoint.async_save's second slots" if slots_needed > disk_reserved
                                   else " reserved up front")
                                + (f" by each of {local_world_size} ranks)" if local_world_size > 1 else ")")))
    # 2. the largest unit on the device, and (when pages live on disk) the host slots its pages rise through
    # (activations.offload: the activation page being filled sits on the device beside the unit's pages)
    open_page = 1 if offload != "none" else 0
    if (largest + open_page) * page_bytes > budgets["device"]:
        problems.append(Problem("device", (largest + open_page) * page_bytes, budgets["device"],
                                f"unit '{largest_name}' ({largest} pages of {format_bytes(page_bytes)})"
                                + (" and the activation page being filled (activations.offload)" if open_page else "")))
    stale, problem = delayed_update_need(config, update, open_page, page_bytes, budgets["device"], lambda: max(
        pages_around(units, lambda param: layout.slot(names[id(param)]).pages), max_tensor_pages))
    problems += [problem] if stale > slots["device"] else []
    expert_pages, expert_layer = 0, ""
    if own.sharded_local("param"):  # ZeRO-3 with ep < dp: a layer's expert groups all on the device at once
        from angel_ptm.parallel.zero import expert_groups

        for name, firsts in expert_groups(model, layout, own).items():
            if len(firsts) * own.local_dp > expert_pages:
                expert_pages, expert_layer = len(firsts) * own.local_dp, name
    if expert_pages > slots["device"]:
        problems.append(Problem("device", expert_pages * page_bytes, budgets["device"],
                                f"MoE layer '{expert_layer}': its experts' {expert_pages} pages gathered from the "
                                f"{own.local_dp} ranks holding them while it computes (ZeRO-3, parallel.ep < dp)"))
    if gather_min > slots["device"]:
        problems.append(Problem("device", gather_min * page_bytes, budgets["device"],
                                f"ZeRO-3's gathered parameter groups ({chain_groups} groups of {own.dp} pages of "
                                f"{format_bytes(page_bytes)}) beside {gather_min - chain_groups * own.dp} pages of "
                                f"this rank's own"))
    staging = staging_host_pages(largest, on_disk=bool(needed_on_disk or start.disk))
    if slots["host"] < staging:
        problems.append(Problem("host", staging * page_bytes, slots["host"] * page_bytes,
                                f"staging unit '{largest_name}' up from disk ({largest} pages pinned while they "
                                f"rise, plus one slot for a page the device evicts)"))
    # 3. creating every page: the host must take what the device and disk cannot
    if start.failure is not None:
        problems.append(start.failure)
    # 4. one optimizer update pins one page of each kind on its tier
    if slots[update] < group:
        problems.append(Problem(update, group * page_bytes, slots[update] * page_bytes,
                                f"the optimizer update (one page each of {', '.join(sorted(kinds))})"))

    # The machine: activations live on the compute device, outside the pools; on a CPU the device pool is RAM too.
    activation = activation_bytes(acts)
    pools = {tier: slots[tier] * page_bytes for tier in ("device", "host")}
    buffers = reduction_buffer_bytes(own.dp, own.stage, page_bytes, own.local_dp)  # on the device with NCCL, in RAM on a CPU
    # A checkpoint written beside training copies the saved pages resting in memory (both pools) into host RAM at
    # the step's end, held while it writes (checkpoint.async_save; checkpoint/planners.py: Snapshot).
    saved = sum(counts[kind] for kind in kinds if PageKind(kind).checkpointed) * page_bytes
    staged = min(saved, pools["device"] + pools["host"]) if config.checkpoint.async_save else 0
    # Hot-expert copies (parallel.moe_replicas) live beside the pools on the compute device, as activations do
    replicas = replica_bytes(model, config.parallel.moe_replicas, compute_dtype(config))
    host_ram = (pools["host"] + staged
                + (0 if device.type == "cuda" else pools["device"] + (activation or 0) + buffers + replicas))
    device_memory = pools["device"] + (activation or 0) + buffers + replicas
    if gpu_free is not None and device_memory > gpu_free:
        problems.append(Problem("device", device_memory, gpu_free,
                                f"the device pool ({format_bytes(pools['device'])})"
                                + (f", collective buffers ({format_bytes(buffers)})" if buffers else "")
                                + (f", hot-expert copies ({format_bytes(replicas)})" if replicas else "")
                                + f" and activations ({format_bytes(activation or 0)}) in "
                                + ("the given GPU memory" if gpu_memory is not None else "free GPU memory")
                                + (activation_suggestion(acts, gpu_free - pools["device"] - buffers)
                                   if activation else "")))
    act_problems, act_on_disk = offload_problems(offload, paged, budgets, states_bytes,
                                                 sum(counts.values()) * page_bytes)
    problems += act_problems
    # Every process on this machine has pools of its own in its RAM (disk_dir/rank<R> likewise, above)
    room = ram_available // local_world_size - host_ram  # (activations are suggested where they are the excess)
    if room < 0:
        problems.append(Problem("host", host_ram * local_world_size, ram_available,
                                "the page pools" + ("" if device.type == "cuda" else " and activations")
                                + (f", hot-expert copies ({format_bytes(replicas)})"
                                   if replicas and device.type != "cuda" else "")
                                + (f", checkpoint.async_save's copy of the saved pages in memory "
                                   f"({format_bytes(staged)})" if staged else "")
                                + (f", by each of {local_world_size} ranks," if local_world_size > 1 else "")
                                + " in available RAM"
                                + (activation_suggestion(acts, room + activation)
                                   if device.type != "cuda" and activation and room + activation >= 0 else "")))

    # ZeRO-3: the other ranks' pages of the gathered groups, as many as the gatherer keeps (or the model has)
    gathered = min(gather_groups * (own.dp - 1), remote_pages) if own.gathers else 0
    peaks = with_offload_peaks(expected_peaks(counts, slots, start, update, kinds, gathered), slots, offload, paged,
                               act_on_disk, page_bytes)  # (activations.offload's pages where they rest)
    needed = {
        "device": max(largest + open_page, gather_min, group if update == "device" else 0, stale) * page_bytes,
        "host": max(start.host_needed, group if update == "host" else 0, staging,
                    1 if needed_on_disk else 0) * page_bytes,
        "disk": sum(counts.values()) * page_bytes + act_on_disk if act_on_disk else needed_on_disk,
    }
    available = {"device": gpu_free, "host": None, "disk": disk_free}
    tiers = {
        tier: TierEstimate(tier, needed[tier], budgets[tier],
                           (disk_reserved if tier == "disk" else slots[tier]) * page_bytes,
                           peaks[tier] * page_bytes, available[tier],
                           fits=not any(p.tier == tier for p in problems))
        for tier in TIERS
    }
    params = sum(p.numel() for p in model.parameters())
    estimate = Estimate(
        rank=own.rank, world_size=own.dp, compute_device=device.type, params=params, page_bytes=page_bytes,
        n_pages=layout.n_pages, kind_bytes={kind: counts[kind] * page_bytes for kind in kinds},
        master_extra_bytes=counts.get("master", 0) * page_bytes, states_bytes=states_bytes,
        largest_layer=largest_name, largest_layer_pages=largest,
        update_tier=update, activation_bytes=activation, activation_page_bytes=paged,
        collective_buffer_bytes=buffers,
        pinned_host_bytes=pools["host"] if device.type == "cuda" else 0,
        host_ram_needed=host_ram, host_ram_available=ram_available, local_world_size=local_world_size,
        disk_dir=disk_dir,
        start_pages={"device": start.device, "host": start.host, "disk": start.disk},
        tiers=tiers, problems=tuple(problems),
        master_note=("" if not counts.get("master") else
                     STALE_MASTER_NOTE if config.trainer.dtype == "float32" else MIXED_MASTER_NOTE),
        gpu_memory_given=gpu_memory is not None,
        zero=own.stage, largest_unit_groups=chain_groups, gather_groups=gather_groups, gather_pages=gather_pages,
        device_floor_pages=floor, gather_copy_pages=copies,
        expert_gather_pages=expert_pages,
        osdp_groups=osdp_replicable(gather_groups, chain_groups) if own.gathers and config.parallel.osdp else 0,
        collective_bytes=collective_bytes(own, layout, page_bytes), checkpoint_staging_bytes=staged,
        replica_bytes=replicas, update_group_pages=len(update_group_kinds(config)),
    )
    # (the room an update batch may take is what the tiers have beyond the needs just estimated)
    return replace(estimate, update_batch_groups=update_batch_groups(
        estimate, page_bytes, estimate.update_group_pages))


# ---------------------------------------------------------------------------------------------------- the parts
def largest_unit(model: nn.Module, layout: PageLayout, units: Sequence[PagingUnit]) -> tuple[str, int]:
    """The paging unit whose forward pins the most param pages on the device at once, and that count."""
    names = {id(p): n for n, p in model.named_parameters()}
    return device_pages_at_once(units, lambda param: layout.slot(names[id(param)]).pages)


def expected_peaks(counts: dict[str, int], slots: dict[str, int], start: StartPlacement, update: str,
                   kinds: tuple[str, ...] = CREATION_ORDER, gathered: int = 0) -> dict[str, int]:
    """Peak pages in use per tier over the first steps, as PageManager.in_use() reports them (`counts`: pages of
    each kind this rank holds; `gathered`: copies of other ranks' parameter pages held at once, ZeRO-3)."""
    n_states = sum(counts[kind] for kind in kinds)
    # Host: filled first, to its budget or with every page.
    host = min(slots["host"], n_states)
    # Device: the pages created there, plus every page a step acquires on it (parameters and gradients; the
    # optimizer states too when the update runs there), up to its budget.
    up_kinds = kinds if update == "device" else ("param", "grad")
    reaching = sum(counts[kind] for kind in up_kinds if kind in counts) + sum(
        n for kind, n in start.device_kinds.items() if kind not in up_kinds) + gathered
    device = min(slots["device"], reaching)
    # Disk: a page keeps its home slot once written there, so the bytes in use are the pages that ever went
    # down. The pages created on disk are known exactly. A gradient page is live only from its backward to its
    # update (then discarded, never written), so the live states are the other three kinds; when they exceed the
    # device and host together, every step cycles them through the disk.
    live = n_states - counts.get("grad", 0)
    if not slots["disk"]:
        disk = 0
    elif gathered and n_states > slots["device"] - gathered + slots["host"]:
        # ZeRO-3: gathered copies crowd the device, so gradient pages (dirty from backward) go down as well
        disk = min(slots["disk"], n_states)
    elif live > slots["device"] + slots["host"]:
        disk = min(slots["disk"], live + start.disk_kinds.get("grad", 0))
    else:  # only the pages created on disk for sure; churn in later steps may add some (this is a lower bound)
        disk = min(slots["disk"], start.disk)
    return {"device": device, "host": host, "disk": disk}
