"""Paging units: which module's forward brings in which parameters (FSDP2's unit, in our words).

A unit is a module whose forward gathers every parameter of its subtree that no inner unit owns; the root module is
always a unit (it owns whatever is left). Parameters are bound to device pages for the whole forward of their unit,
so a parameter may be read anywhere inside it — `nn.MultiheadAttention` reads `out_proj.weight` in its own forward,
not in `out_proj`'s, and that is fine once the attention's layer is the unit.

Default units: the children of the model's repeated block lists — an `nn.ModuleList` (or an `nn.Sequential` of two
or more) whose parameter-owning children are all of one type: GPT's `layers`, `TransformerEncoder.layers`,
HuggingFace's `model.layers` / `transformer.h`. Lists inside a unit are not split further, except an MoE layer's
experts (models/moe.py): each is a unit inside its block's, so a step brings in only the experts it routes to. `units=` overrides:
a list of module types (as FSDP's `ModuleWrapPolicy`) or a predicate `module -> bool`.

The device must hold, at once, the pages of a unit and of every unit around it (their forwards are still running):
`device_pages_at_once` is that rule, shared by the engine's budget check and the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from angel_ptm.activations.recompute import same_in_recompute
from angel_ptm.errors import ConfigValueError
from angel_ptm.memory.page import PageState
from angel_ptm.memory.store import PageKind
from angel_ptm.schedule.predictor import RoutingHistory

UnitsSpec = Union[None, Sequence[type], Callable[[nn.Module], bool]]


@dataclass(eq=False)
class PagingUnit:
    """One unit: its module, its dotted name ("<root>" for the model), the parameters it owns (a tied parameter may
    be owned by several units) and the unit around it."""

    module: nn.Module
    name: str
    params: list[nn.Parameter] = field(default_factory=list)
    parent: Optional["PagingUnit"] = None

    def chain(self) -> list["PagingUnit"]:
        """This unit and every unit around it, innermost first."""
        out, unit = [], self
        while unit is not None:
            out.append(unit)
            unit = unit.parent
        return out


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts of `model`'s MoE layers (a module with a `gate` and an `experts` list, models/moe.py): each is
    a paging unit of its own, so only the experts a step routes tokens to bring their pages in."""
    return [expert for layer in moe_layers(model) for expert in layer.experts]


def optional_page_indexes(model: nn.Module, layout) -> set[int]:
    """Layout pages that hold only MoE experts' tensors: a step touches them only for the experts it routes to
    (the scheduler's optional pages)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return _pages_holding_only({names[id(p)] for m in expert_modules(model) for p in m.parameters()},
                               _tensors_on_pages(layout))


def _tensors_on_pages(layout) -> dict[int, set[str]]:
    """Layout page -> the names of the tensors on it."""
    on_page: dict[int, set[str]] = {}
    for slot in layout.slots:
        for page in slot.pages:
            on_page.setdefault(page, set()).add(slot.name)
    return on_page


def _pages_holding_only(tensors: set[str], on_page: dict[int, set[str]]) -> set[int]:
    """The pages (of `_tensors_on_pages`) every tensor of which is in `tensors`."""
    return {page for page, held in on_page.items() if held <= tensors} if tensors else set()


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """`model`'s MoE layers: modules with a `gate` and an `experts` list (models/moe.py)."""
    return [module for module in model.modules()
            if hasattr(module, "gate") and isinstance(getattr(module, "experts", None), nn.ModuleList)]


def expert_page_indexes(layer: nn.Module, model: nn.Module, layout) -> list[set[int]]:
    """Per expert of the MoE `layer` (in its `experts` order), the layout pages holding only that expert's tensors:
    the pages a step leaves alone when the gate routes it no token."""
    names, on_page = {id(p): n for n, p in model.named_parameters()}, _tensors_on_pages(layout)
    slot_pages = {slot.name: slot.pages for slot in layout.slots}
    out = []
    for expert in layer.experts:  # only its own tensors' pages are looked at: linear in the layer's size
        mine = {names[id(p)] for p in expert.parameters()}
        out.append({page for name in mine for page in slot_pages.get(name, ()) if on_page[page] <= mine})
    return out


def experts_as_units(dp: int, zero: int, ep: int) -> bool:
    """Whether each MoE expert is a paging unit of its own, so that a step brings in only the experts it routes to.
    Not where ZeRO-3 shards the experts over data-parallel ranks that route differently (dp > 1 with ep 1): an
    expert's pages are all-gathered before it computes (and again for its backward), and a rank that routed it no
    token would not join the gather its peers wait in. There the experts stay in their block's unit, gathered with
    it on every rank. (Under expert parallelism each rank's experts are its own pages; with ep < dp at ZeRO 3 the
    ranks holding the same experts gather them a whole MoE layer at a time, at points every one of them reaches:
    parallel/zero.ExpertGatherer.)"""
    return not (dp > 1 and zero == 3 and ep == 1)


def default_unit_modules(model: nn.Module, experts: bool = True) -> set[nn.Module]:
    """The children of repeated block lists, outermost lists only; and, with `experts`, every MoE layer's experts
    (inside their block's unit)."""
    experts_of = set(expert_modules(model))
    found: set[nn.Module] = set(experts_of) if experts else set()

    def visit(module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            blocks = [child for child in module.children() if _owns_parameters(child)]
            if blocks and all(block in experts_of for block in blocks):
                return  # an MoE layer's experts: units of their own with `experts`, else in the unit around them
            least = 1 if isinstance(module, nn.ModuleList) else 2  # a Sequential of one is a wrapper, not a list
            if len(blocks) >= least and len({type(b) for b in blocks}) == 1:
                for block in blocks:  # a block that is a container (never called) gives its called parts
                    found.update(_called_parts(block) if isinstance(block, CONTAINERS) else (block,))
                return
        for child in module.children():
            visit(child)

    visit(model)
    return found


# Modules that hold others but are never called (no forward): a unit's parameters are bound by its forward's hooks
CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)


def _called_parts(container: nn.Module) -> list[nn.Module]:
    """The parameter-owning modules a container holds, looking through containers inside it."""
    parts = []
    for child in container.children():
        if isinstance(child, CONTAINERS):
            parts += _called_parts(child)
        elif _owns_parameters(child):
            parts.append(child)
    return parts


def _unit_modules(model: nn.Module, spec: UnitsSpec, experts: bool = True) -> set[nn.Module]:
    chosen = _chosen_unit_modules(model, spec, experts)
    if spec is not None and (containers := [m for m in chosen if isinstance(m, CONTAINERS)]):
        raise ConfigValueError(
            f"units: {type(containers[0]).__name__} modules are never called (no forward), so their parameters would "
            f"never be bound; name the modules they hold instead")
    return chosen


def _chosen_unit_modules(model: nn.Module, spec: UnitsSpec, experts: bool = True) -> set[nn.Module]:
    if spec is None:
        return default_unit_modules(model, experts)
    if callable(spec) and not isinstance(spec, (list, tuple, set, frozenset)):
        return {m for m in model.modules() if m is not model and spec(m)}
    types = tuple(spec)
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise ConfigValueError(f"units: expected a list of nn.Module types or a predicate, got {spec!r}")
    return {m for m in model.modules() if m is not model and isinstance(m, types)}


def find_units(model: nn.Module, spec: UnitsSpec = None, experts: bool = True) -> list[PagingUnit]:
    """The paging units of `model`, the root first, then in module order (each after the units around it).
    `experts` False (experts_as_units): no MoE expert is a unit of its own; one that `spec` names is an error."""
    chosen = _unit_modules(model, spec, experts)
    if not experts and (named := [m for m in expert_modules(model) if m in chosen]):
        raise ConfigValueError(
            f"units: {len(named)} MoE experts ({type(named[0]).__name__}) are paging units of their own, but under "
            f"parallel.zero 3 with dp > 1 and ep 1 ranks that route differently would gather different experts; "
            f"leave the experts inside their block's unit, or set parallel.ep to the data-parallel degree")
    units: list[PagingUnit] = []

    def visit(module: nn.Module, name: str, unit: PagingUnit, seen: set[int]) -> None:
        if module is not model and module in chosen:
            unit = PagingUnit(module, name, parent=unit)
            units.append(unit)
            seen = set()
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                unit.params.append(param)
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if module is not model else child_name, unit, seen)

    root = PagingUnit(model, "<root>")
    units.append(root)
    visit(model, "", root, set())
    return units


def unit_pages(unit: PagingUnit, slot_pages: Callable[[nn.Parameter], Iterable[int]]) -> list[int]:
    """Page indices of a unit's own parameters, in first-use order, each once."""
    return list(dict.fromkeys(p for param in unit.params for p in slot_pages(param)))


def device_pages_at_once(units: Sequence[PagingUnit],
                         slot_pages: Callable[[nn.Parameter], Iterable[int]]) -> tuple[str, int]:
    """The unit whose forward needs the most param pages on the device at once (its own and those of every unit
    around it, whose forwards are still running), and that count."""
    own = {id(u): set(unit_pages(u, slot_pages)) for u in units}
    best_name, best = "", 0
    for unit in units:
        pages = set().union(*(own[id(u)] for u in unit.chain()))
        if len(pages) > best:
            best_name, best = unit.name, len(pages)
    return best_name, best


def pages_around(units: Sequence[PagingUnit], slot_pages: Callable[[nn.Parameter], Iterable[int]]) -> int:
    """The most param pages the units around one unit (whose forwards are running when it starts) pin at once: what
    is pinned on the device before that unit's own pages are acquired."""
    own = {id(u): set(unit_pages(u, slot_pages)) for u in units}
    return max((len(set().union(*(own[id(u)] for u in unit.chain() if u is not unit))) for unit in units),
               default=0)


# How soon an expert can run, by the state of its weights' pages (the slowest of them): resting on the device,
# on their way to it, on the host, leaving the device, on their way from disk, on disk.
_READINESS = {PageState.DEVICE: 0, PageState.TO_DEVICE: 1, PageState.HOST: 2, PageState.TO_HOST: 2,
              PageState.FROM_DISK: 3, PageState.DISK: 4, PageState.TO_DISK: 4, PageState.REMOTE: 5}


def resident_first(weight_pages: list[list], planned_order=None) -> Callable[[list[int]], list[int]]:
    """An MoE layer's `expert_order` (models/moe.py) over the experts that have tokens (`weight_pages[e]`: the
    pages expert e's forward acquires). Under a plan, the plan's order (`planned_order(experts, pages)`:
    Scheduler.planned_order), which is the order of the step it was made from; with none (the step that records
    the trace, or the on-demand scheduler), those whose weights rest on the device first, then those on their way
    there, then the host's, then the disk's, by index among equals -- so the trace a plan is made from runs the
    experts in place first, and the plan keeps that order. (Reordering a planned step by where its pages are at
    that moment would contradict the plan's prefetches and evictions: measured 15% slower on tools.bench.moe.)"""
    first = [pages[0].id if pages else -1 for pages in weight_pages]

    def decide(experts: list[int]) -> list[int]:
        planned = planned_order(experts, first) if planned_order is not None else None
        if planned is not None:
            return planned
        return sorted(experts, key=lambda e: max((_READINESS[p.state] for p in weight_pages[e]), default=0))

    def order(experts: list[int]) -> list[int]:  # (a recomputation in backward runs them as its forward did)
        return same_in_recompute(lambda: decide(experts))
    return order


def watch_routing(model: nn.Module, layout, pages: dict, route, planned_order=None) -> list:
    """Once each MoE layer knows which of its experts compute in this forward, `route(unrouted, routed)` gets the
    page ids (every kind) of the experts that got no token and of those that did (Scheduler.route cancels the
    former's planned fetches): after the gate (a forward hook on it), or under expert parallelism after the
    exchange of per-expert counts (a layer that holds only some experts calls `on_local_routing` with its slots
    that receive rows from some rank). Each layer runs its experts resident first (`resident_first`, in the plan's
    order under `planned_order`). The handles, to remove them."""
    from angel_ptm.models.moe import MoE, Routing

    handles = []
    for layer in moe_layers(model):
        if not isinstance(layer, MoE):  # another MoE module (a gate and an experts list): its gate's output is not
            continue  # our Routing, nor does it take an order; its experts' pages are optional all the same
        indexes_of = expert_page_indexes(layer, model, layout)
        per_expert = [{p.id for kind_pages in pages.values() for i in indexes
                       if i < len(kind_pages) and (p := kind_pages[i]) is not None}
                      for indexes in indexes_of]
        weights = pages.get(PageKind.PARAM, ())
        layer.expert_order = resident_first([[weights[i] for i in sorted(indexes) if i < len(weights)
                                              and weights[i] is not None] for indexes in indexes_of],
                                            planned_order)
        handles.append(_Unset(layer, "expert_order"))

        def report(hit, per_expert=per_expert):
            route({i for e, ids in enumerate(per_expert) if e not in hit for i in ids},
                  {i for e in hit if e < len(per_expert) for i in per_expert[e]})

        if hasattr(layer, "on_local_routing"):  # expert parallelism (parallel/moe): the local slots that compute
            layer.on_local_routing = report
            handles.append(_Unset(layer, "on_local_routing"))
            continue

        def routed(gate, inputs, routing, report=report):
            if not isinstance(routing, Routing):  # (a gate of another kind put in place)
                return
            chosen = routing.expert[routing.kept & (routing.expert >= 0)]
            report(set(torch.unique(chosen).tolist()))  # (one small host read per MoE forward)
        handles.append(layer.gate.register_forward_hook(routed))
    return handles


def watch_experts(model: nn.Module, layout, pages: dict, scheduler, manager, experts_apart: bool,
                  warm_threshold: float = 0.0, history_ema: float = 0.8) -> list:
    """MoE experts' pages are optional (a step touches them only when routed to) and watched (their moves counted
    apart); where experts are units of their own, their planned fetches are cancelled once routing is known
    (`watch_routing`; in their block's unit they are always fetched), and a routing history (`warm_threshold` > 0:
    memory.expert_warm_threshold) holds those of the experts it finds cold until their gate routes to them. The
    routing hooks' handles."""
    optional = optional_page_indexes(model, layout)
    scheduler.optional_pages = manager.watched = frozenset(
        p.id for ps in pages.values() for i, p in enumerate(ps) if p is not None and i in optional)
    if not (optional and experts_apart):
        return []
    if warm_threshold > 0:
        scheduler.history = RoutingHistory(history_ema, warm_threshold)
    return watch_routing(model, layout, pages, scheduler.route, scheduler.planned_order)


class _Unset:
    """A handle whose remove() sets a callback attribute back to None."""

    def __init__(self, obj, name: str):
        self.obj, self.name = obj, name

    def remove(self) -> None:
        setattr(self.obj, self.name, None)
