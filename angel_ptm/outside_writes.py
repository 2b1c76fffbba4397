"""Writes into parameters outside their units' forward, with no autograd recording: they reach the pages.

Outside its unit's forward a parameter's op under `torch.no_grad()` runs on a copy of its values (guard.py,
OutsideUnits.resolve). torch writes the parameter itself in such an op when it is in place (`nn.init.normal_(p)`,
`p.mul_(0.5)`, `p[0] = 0`, `torch.add(a, b, out=p)`) or later through a view the op returned
(`emb.weight[pad].zero_()`, `p.detach().clamp_(...)`). So must the engine, or the write is lost without a word:
- an op that wrote its copy: the elements it changed are written into the parameter's pages at once;
- a view of a copy that the op returned: watched while the user holds it; the next entry to the engine (a forward,
  a step, a read of the weights, the next use of a parameter outside its unit) writes the elements changed
  through it since, the one after its last view is gone too.
Only the elements that changed are written (compared bit by bit with the values before), so the others keep what
the pages hold: under mixed precision the fp32 master's full precision. The copies views hold follow the
parameter: a write through one reaches the others of the same parameter, and after a step or load each takes the
new values (`refresh`), so a view held across a step reads, and writes from, what torch's would. The weight pages
(the master under mixed precision, and the compute copy rounded from it) are written on this rank only, without a
collective: under data parallelism every rank makes the same write (as in plain torch's DDP); the next engine
entry then lets the data-parallel copies know (`after_writes`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from angel_ptm.errors import ParameterAccessError


def version(tensor: torch.Tensor) -> int | None:
    """`tensor`'s version counter (an in-place write bumps it); None for an inference tensor, which has none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def changed(values: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Per element of `values`, flat: whether its bits differ from `before`'s (NaNs and -0.0 compare as bits)."""
    n, size = values.numel(), values.element_size()
    now = values.detach().contiguous().reshape(-1).view(torch.uint8).view(n, size)
    then = before.detach().contiguous().reshape(-1).view(torch.uint8).view(n, size)
    return (now != then).any(dim=1)


@dataclass
class _Watched:
    """A copy of `param`'s values that views the op returned alias (`views`: weakly), and its values when last
    written back. The copy is held until a settle after its last view is gone (a view written and dropped in one
    statement, `p[0].zero_()`, still goes in)."""

    param: nn.Parameter
    copy: torch.Tensor
    before: torch.Tensor
    version: int | None
    views: list
    lagging: bool = False  # taken while the weights lagged a pending update (optimizer.staleness 1)


class OutsideWrites:
    """The writes a binder's unbound parameters take outside their units (see the module docstring).

    `read(param)`: a copy of the parameter's values as its pages hold them now; `write(param, values, mask)`: the
    elements of `values` where `mask` into its weight pages (the engine's: PageTensors.write_where);
    `after_writes()`: run once at the next entry after any write (the data-parallel copies refreshed); `busy()`:
    why a write cannot go in now (a forward or backward of the engine runs), or None. The engine `attach`es the
    last three; `refresh` must run after every step or load of the weights."""

    def __init__(self, read: Callable, busy: Callable[[], str | None]):
        self.read, self.busy = read, busy
        self.write: Callable | None = None
        self.after_writes: Callable[[], None] | None = None
        # optimizer.staleness 1: whether the weights the model computes with lag the master (an update pending or
        # not yet in the param pages), and what puts them level (engine.flush)
        self.lagging: Callable[[], bool] = lambda: False
        self.catch_up: Callable[[], None] = lambda: None
        self._watched: list[_Watched] = []
        self._written = False  # a write went in since after_writes last ran

    def attach(self, write: Callable, after_writes: Callable[[], None], busy: Callable[[], str | None],
               lagging: Callable[[], bool] | None = None, catch_up: Callable[[], None] | None = None) -> None:
        self.write, self.after_writes, self.busy = write, after_writes, busy
        if lagging is not None and catch_up is not None:
            self.lagging, self.catch_up = lagging, catch_up

    def run(self, func, args, kwargs, unbound: list[nn.Parameter], copies: dict[int, torch.Tensor], swap,
            route: Callable[[nn.Parameter], "OutsideWrites"] | None = None):
        """`func` on `copies` of the `unbound` parameters' values (`swap` maps an argument to its copy); what it
        writes into them goes into the pages. An op in place returns the parameter, as in torch. `route`: the
        OutsideWrites of each parameter where they belong to several engines (an EMA's `ema_p.lerp_(p, a)`): each
        write, view and read back goes to its own engine's."""
        of = route or (lambda _param: self)
        writers = list({id(of(p)): of(p) for p in unbound}.values())
        lagging = [w for w in writers if w.lagging()]
        rng = _rng_state() if lagging else None
        mine, before, result = self._attempt(func, args, kwargs, unbound, copies, swap)
        wrote = [then is None or version(copy) != then for (_param, copy), (then, _values) in zip(mine, before)]
        if lagging and any(wrote):
            # optimizer.staleness 1: the op read the weights the model computes with, a step behind the master's
            # (the pending update): the update goes in (engine.flush, as any write makes it), and the op runs again
            # on the weights as torch's would hold them, with the random numbers it drew the first time
            for writer in lagging:
                writer.catch_up()
            _set_rng_state(rng)
            for param in unbound:
                copies[id(param)] = of(param).read(param)
            mine, before, result = self._attempt(func, args, kwargs, unbound, copies, swap)
            lagging = []
        for (param, copy), (then, values) in zip(mine, before):
            if then is None or version(copy) != then:
                writer = of(param)
                writer._write(param, copy, values if values is not None else writer.read(param))
        for writer in writers:
            writer._watch(result, [(p, c) for p, c in mine if of(p) is writer], writer in lagging)
        if isinstance(result, torch.Tensor):
            for param, copy in mine:
                if result is copy:
                    return param
        return result

    @staticmethod
    def _attempt(func, args, kwargs, unbound, copies, swap):
        mine = [(param, copies[id(param)]) for param in unbound]
        # (an inference tensor has no version counter: its writes are seen by its bits, against a copy kept here)
        before = [(version(copy), copy.clone() if version(copy) is None else None) for _param, copy in mine]
        return mine, before, func(*swap(tuple(args)), **swap(dict(kwargs or {})))

    def settle(self, publish: bool = True) -> None:
        """An entry to the engine: the writes made since through watched views go into the pages, then (with
        `publish`: an entry between steps) the data-parallel copies learn of every write since the last time."""
        if not self._watched and not self._written:
            return
        for entry in list(self._watched):
            if entry.version is None or version(entry.copy) != entry.version:
                if entry.lagging:  # (its values a step behind, whether or not the update has gone in since)
                    self._watched.remove(entry)
                    raise ParameterAccessError(
                        f"parameter '{entry.param.__dict__.get('_angel_name', '?')}' written through a view taken "
                        f"under optimizer.staleness 1 while the last step's update was pending: the view holds the "
                        f"weights the model computes with, a step behind; call engine.flush() before taking it")
                self._write(entry.param, entry.copy, entry.before)  # (refused now, e.g. in a forward: stays)
                self._synced(entry)
        self._watched = [entry for entry in self._watched if any(view() is not None for view in entry.views)]
        if publish and self._written and self.after_writes is not None:
            self._written = False
            self.after_writes()

    def refresh(self) -> None:
        """The weights changed (a step, a load): each watched copy takes its parameter's new values, so the views
        the user holds read them, as views of the parameter would in torch."""
        self._watched = [entry for entry in self._watched if any(view() is not None for view in entry.views)]
        for entry in self._watched:
            with torch.no_grad():
                entry.copy.copy_(self.read(entry.param))
            self._synced(entry)
            entry.lagging = self.lagging()

    def _synced(self, entry: _Watched) -> None:
        """`entry`'s copy holds its parameter's values now."""
        entry.before, entry.version = entry.copy.clone(), version(entry.copy)

    def _write(self, param: nn.Parameter, values: torch.Tensor, before: torch.Tensor) -> None:
        mask = changed(values, before)
        if not bool(mask.any()):
            return
        name = param.__dict__.get("_angel_name", "?")
        reason = self.busy() if self.busy is not None else None
        if reason is not None or self.write is None:
            raise ParameterAccessError(
                f"parameter '{name}' written in place outside its unit's forward while "
                f"{reason or 'the engine is closing'}: the write cannot reach its pages now; write it between steps")
        self.write(param, values, mask)
        self._written = True
        for other in self._watched:  # other copies of its values take the elements written
            if other.param is param and other.copy is not values:
                with torch.no_grad():
                    flat = other.copy.view(-1)
                    flat[mask] = values.reshape(-1)[mask].to(flat.dtype)
                self._synced(other)

    def _watch(self, result, mine, lagging: bool = False) -> None:
        """Copies aliased by a tensor in `result` (a view the op returned): watched for writes through it."""
        leaves = result if isinstance(result, (tuple, list)) else (result,)
        storages = {copy.untyped_storage().data_ptr(): (param, copy) for param, copy in mine}
        entries: dict[int, _Watched] = {}
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) or any(leaf is copy for _p, copy in mine):
                continue
            found = storages.get(leaf.untyped_storage().data_ptr())
            if found is None:
                continue
            param, copy = found
            entry = entries.get(id(copy))
            if entry is None:
                entry = entries[id(copy)] = _Watched(param, copy, copy.clone(), version(copy), [], lagging)
                self._watched.append(entry)
            entry.views.append(weakref.ref(leaf))


def _rng_state():
    """torch's random generators' states (CPU, and CUDA's where it runs), for `_set_rng_state`."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
