"""Where a job's activation footprint comes from, for the estimate (angel_ptm/estimate.py): our dense GPT's formula
(models.gpt.activation_footprint), any other model's trace on fake tensors (activations/footprint.py), or nothing;
each unit in the checkpoint mode recompute.checkpoint_modes gives it."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from angel_ptm.activations.recompute import checkpoint_modes
from angel_ptm.config import Config, format_bytes
from angel_ptm.errors import ConfigValueError
from angel_ptm.memory.placement import Problem, compute_dtype
from angel_ptm.models import GPT
from angel_ptm.models.gpt import ActivationFootprint, Block, activation_footprint
from angel_ptm.units import find_units

log = logging.getLogger("angel_ptm")
_warned: set[str] = set()


def _warn_once(message: str, *args) -> None:
    text = message % args
    if text not in _warned:
        _warned.add(text)
        log.warning(text)
_WARNED: set = set()  # (model type, reason) of the traces that failed and said so


class ActivationSource:
    """Where a job's activation footprint comes from: the formula of our dense GPT (models.gpt), else a trace of
    the model on fake tensors with the example inputs (activations/footprint.py: traced once, then evaluated per
    setting), else nothing (unknown)."""

    def __init__(self, model: nn.Module, config: Config, example_inputs=None, units=None,
                 device: Optional[torch.device] = None):
        self.model, self.config, self.example_inputs, self.units = model, config, example_inputs, units
        self.trace_failed = False  # example_inputs were given, but fake tensors could not run the forward
        if example_inputs is None and isinstance(model, GPT) and not self.formula:
            # our GPT with dropout, MoE layers or other units: its batch is known, traced (MoE at its routing bound)
            tokens = torch.empty(config.data.batch_size, model.cfg.seq_len, dtype=torch.long, device="meta")
            self.example_inputs = (tokens, tokens)
        # The kernels traced are the compute device's where it is here (a GPU job planned without a GPU: the CPU's)
        self.device = device if device is None or device.type != "cuda" or torch.cuda.is_available() else None
        self._traced: dict = {}  # the checkpointed modules' ids -> their trace

    @property
    def formula(self) -> bool:
        """Our dense GPT without dropout in its own units (blocks and the root): the formula's case (MoE: routing
        decides; dropout's masks and other units: traced)."""
        blocks = self.units is None or all(isinstance(u.module, Block) for u in self.units if u.parent is not None)
        return (isinstance(self.model, GPT) and self.model.cfg.moe is None and not self.model.cfg.dropout
                and blocks)

    @property
    def n_units(self) -> int:
        return self.model.cfg.n_layer + 1 if self.formula else len(self.units or ())

    def footprint(self, checkpoint: Optional[str] = None,
                  offload: Optional[str] = None) -> Optional[ActivationFootprint]:
        """At data.batch_size (our GPT) or the example inputs' batch (one micro-batch), under the config's
        activations section (each unit's mode: recompute.checkpoint_modes) or the `checkpoint` / `offload`
        settings given (`checkpoint`: every unit but the root); None when unknown."""
        acts = self.config.activations
        offload = acts.offload if offload is None else offload
        if not self.formula and self.example_inputs is None:
            return None
        units = self.units if self.units is not None else find_units(self.model)
        modes = (checkpoint_modes(units, acts.checkpoint, acts.units, acts.unit_modes) if checkpoint is None
                 else checkpoint_modes(units, checkpoint))
        if self.formula:  # our GPT's units are its blocks (one type, one mode) and the root
            dtype = compute_dtype(self.config)  # mixed precision: the model runs in it (the engine converts it)
            dtype_bytes = dtype.itemsize if dtype is not None else next(
                (p.element_size() for p in self.model.parameters() if p.is_floating_point()), 4)
            block_mode = next((m for u, m in zip(units, modes) if u.parent is not None), "none")
            return activation_footprint(self.model.cfg, self.config.data.batch_size, dtype_bytes, block_mode,
                                        offload != "none", acts.offload_min_bytes, self.config.parallel.tp,
                                        self.config.parallel.sequence_parallel)
        mode_of = {id(u.module): m for u, m in zip(units, modes) if m != "none"}
        traced = self.traced([u.module for u in units if id(u.module) in mode_of])
        if traced is None:
            return None
        return traced.footprint([mode_of[id(m)] for m in traced.modules], offload != "none", acts.offload_min_bytes)

    def traced(self, checkpointed: list):
        """The trace with these modules' saved tensors apart (cached per set of modules)."""
        key = tuple(id(m) for m in checkpointed)
        if key not in self._traced:
            from angel_ptm.activations.footprint import trace_activations

            fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # (its own traceback of a failed kernel:
            level = fake_log.level  # the warning below says it in one line)
            fake_log.setLevel(logging.CRITICAL)
            try:
                self._traced[key] = trace_activations(self.model, self.example_inputs, checkpointed,
                                                      compute_dtype(self.config), self.device)
            except ConfigValueError:
                raise
            except Exception as err:  # noqa: BLE001 - a forward fake tensors cannot run (data-dependent shapes)
                reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
                if (type(self.model).__name__, reason) not in _WARNED:  # once per process: every engine says it
                    _WARNED.add((type(self.model).__name__, reason))
                    log.warning(f"activations: the forward could not be traced with example_inputs ({reason}); its "
                                f"activations are not counted in the estimate")
                self.example_inputs = None
                self.trace_failed = True
                return None
            finally:
                fake_log.setLevel(level)
        return self._traced[key]


def activation_footprint_of(model: nn.Module, config: Config, checkpoint: Optional[str] = None,
                            offload: Optional[str] = None, example_inputs=None,
                            units=None) -> Optional[ActivationFootprint]:
    """The activation footprint of one micro-batch (ActivationSource.footprint): our dense GPT's at
    data.batch_size, another model's traced with `example_inputs`; None when unknown."""
    return ActivationSource(model, config, example_inputs, units).footprint(checkpoint, offload)


def activation_bytes(acts: ActivationSource) -> Optional[int]:
    """The device-side activation peak under the config (None when unknown)."""
    footprint = acts.footprint()
    return None if footprint is None else footprint.device


def activation_page_bytes(acts: ActivationSource, states_bytes: int) -> int:
    """Room the activation pages need (activations.offload): the paged activations with slack for packing; for a
    model whose activations are unknown, as much as its states."""
    if acts.config.activations.offload == "none":
        return 0
    footprint = acts.footprint()
    if footprint is None:
        why, remedy = (("unknown", "its forward could not be traced with the example_inputs given (the warning "
                        "above says why)") if acts.trace_failed else
                       ("unknown without example_inputs", "pass example_inputs= to angel_ptm.initialize to size it"))
        _warn_once("activations.offload %s: the activations of this %s are %s, so the room for its activation "
                   "pages is a guess (%s, the size of its states); %s", acts.config.activations.offload,
                   type(acts.model).__name__, why, format_bytes(states_bytes), remedy)
        return states_bytes
    page = acts.config.memory.page_bytes
    # A tensor that fits a page never straddles two: up to a tenth more, and two pages per unit of slack.
    return (-(-footprint.paged * 11 // (10 * page)) + 2 * acts.n_units) * page


def activation_suggestion(acts: ActivationSource, room: int) -> str:
    """Which activations settings would bring the device-side activations within `room` bytes."""
    fits = []
    for checkpoint, offload in (("selective", "none"), ("full", "none"), ("none", "host"), ("full", "host")):
        footprint = acts.footprint(checkpoint, offload)
        if footprint is not None and footprint.device <= room:
            setting = (f"activations.checkpoint {checkpoint}" if checkpoint != "none" else "") + \
                (f"{' + ' if checkpoint != 'none' else ''}activations.offload {offload}" if offload != "none" else "")
            fits.append(f"{setting} ({format_bytes(footprint.device)})")
    if not fits:
        return "; no activations setting fits: a smaller data.batch_size or model.seq_len"
    return "; these fit: " + ", ".join(fits)


def offload_problems(offload: str, paged: int, budgets: dict, states_bytes: int, files: int) -> tuple[list, int]:
    """What activations.offload's pages (`paged` bytes of room) need of the host and disk budgets (the estimate's
    rules): without a disk tier, the host beside the states it holds; on disk, a disk budget beside the states'
    page files (`files`: a slot for every page, which they reserve where the budget has that many). The problems,
    and the activation bytes the disk takes (all of them with offload disk; with offload host, what the host
    cannot hold; 0 without a disk tier)."""
    problems = []
    host_spare = budgets["host"] - max(0, states_bytes - budgets["device"])
    if offload == "host" and paged and not budgets["disk"] and host_spare < paged:
        problems.append(Problem("host", paged, max(0, host_spare),
                                "activations.offload host's activation pages beside the states the host holds "
                                "(no disk tier to spill to)"))
    if offload == "disk" and not budgets["disk"]:
        problems.append(Problem("disk", paged, 0, "activations.offload disk's activation pages (memory.disk_budget "
                                                   "is 0: no disk tier)"))
    on_disk = paged if offload == "disk" else max(0, paged - max(0, host_spare)) if offload == "host" else 0
    on_disk = on_disk if budgets["disk"] else 0
    if on_disk and budgets["disk"] < files + on_disk:
        problems.append(Problem("disk", files + on_disk, budgets["disk"],
                                f"the states' page files ({format_bytes(files)}: a slot for every page) and "
                                f"activations.offload's activation pages ({format_bytes(on_disk)})"))
    return problems, on_disk


def with_offload_peaks(peaks: dict[str, int], slots: dict[str, int], offload: str, paged: int, on_disk: int,
                       page_bytes: int) -> dict[str, int]:
    """The tiers' peak pages in use with activations.offload's pages added where they rest (the trace counts
    them): with offload host, on the host as far as it has room beside the states (`paged` - `on_disk` bytes);
    the rest (`on_disk`), and all of them with offload disk, on the disk."""
    if offload not in ("host", "disk") or not paged:
        return peaks
    pages = lambda nbytes: -(-nbytes // page_bytes)  # noqa: E731
    host = peaks["host"] + (pages(paged - on_disk) if offload == "host" else 0)
    disk = peaks["disk"] + pages(on_disk)
    device = peaks["device"]
    if not slots.get("disk") and host > slots["host"]:  # no disk: what the host cannot hold goes up to the device
        device = min(device + host - slots["host"], slots.get("device", device + host - slots["host"]))
    return {**peaks, "device": device, "host": min(host, slots["host"]),
            "disk": min(disk, slots["disk"]) if slots["disk"] else 0}
