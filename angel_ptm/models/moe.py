"""A Mixture-of-Experts feed-forward layer as a plain ``nn.Module``: a gate routes each token to experts, each
expert (an ordinary module) computes on its tokens, and their outputs are combined with the gate's weights.

    moe = MoE(dim, hidden, MoESpec(experts=8, top_k=2, gate="gshard", capacity_factor=1.25))
    y = moe(x)                       # [batch, seq, dim] -> [batch, seq, dim]
    moe.aux_loss                     # the gate's weighted auxiliary losses of this forward (add it to the loss)

Routing (`route`): the gate gives, per token, k (expert, weight) choices. Each expert has `capacity`
= k * ceil(T / E * capacity_factor) slots for the T tokens of a forward (`capacity_factor <= 0`: dropless, no
limit); slots are given choice-major: every token's first choice, in token order, before any second choice, so a
second choice never takes the place of a first. A choice past its expert's capacity is dropped: it contributes
zero, and the block's residual carries the token on. The layer's output for token t is
    sum over kept choices c of weight[t, c] * expert[e(t, c)](x[t])   (+ passthrough[t] * x[t] for BASE)
which is what tests/test_moe.py checks against a dense reference (every expert on every token, combined with the
capacity-masked weights). The gates are in models/gates.py.

No parallel or paging code here: expert parallelism and paged experts are applied from outside (angel_ptm/parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from angel_ptm.errors import ConfigValueError

GATES = ("switch", "gshard", "ktop1", "hash", "base", "sam", "dts")
FIXED_TOP_K = {"switch": 1, "hash": 1, "base": 1, "gshard": 2, "dts": 1}  # gates whose choices top_k does not set


@dataclass(frozen=True)
class MoESpec:
    """An MoE layer's settings (the `model.moe` mapping, less `every`)."""

    experts: int = 8
    # None: the gate's own. switch, hash and base route 1 choice per token, gshard 2, dts every expert (1 once
    # hard top-1); ktop1 one per prototype (top_k prototypes, default 2), sam top_k inside the group (default 2)
    top_k: Optional[int] = None
    gate: str = "gshard"
    capacity_factor: float = 1.25  # <= 0: dropless
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0  # router z-loss (ST-MoE): mean(logsumexp(logits)^2)
    groups: int = 2  # sam: expert groups (top-1 group, then top_k inside it)
    dts_start_temperature: float = 1.0
    dts_end_temperature: float = 0.5
    dts_decay: str = "exponential"  # or linear
    dts_decay_steps: int = 1000  # steps over which the temperature decays
    dts_top1_step: int = 2000  # from this step on, hard top-1
    dts_threshold: float = 0.001  # dense-to-sparse: experts above this weight are active

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ConfigValueError(f"model.moe.gate: {self.gate!r} is not a gate (known: {', '.join(GATES)})")
        if self.experts < 1:
            raise ConfigValueError(f"model.moe.experts: must be >= 1, got {self.experts}")
        fixed = FIXED_TOP_K.get(self.gate)
        if self.top_k is None:
            object.__setattr__(self, "top_k", fixed or 2)
        elif fixed is not None and self.top_k != fixed:
            raise ConfigValueError(f"model.moe.top_k: gate {self.gate} routes {fixed} choice(s) per token, so top_k "
                                   f"{self.top_k} would be ignored: leave it out or set {fixed}")
        if self.groups < 1:
            raise ConfigValueError(f"model.moe.groups: must be >= 1, got {self.groups}")
        k = self.choices
        if not 1 <= k <= self.experts:
            raise ConfigValueError(f"model.moe.top_k: {self.top_k} choices for gate {self.gate} with "
                                   f"{self.experts} experts: must be between 1 and the number of experts")
        if self.gate == "ktop1" and self.experts % self.top_k:
            raise ConfigValueError(f"model.moe.top_k: {self.top_k} prototypes must divide model.moe.experts "
                                   f"({self.experts})")
        if self.gate == "sam" and (self.experts % self.groups or self.top_k > self.experts // self.groups):
            raise ConfigValueError(f"model.moe.groups: {self.groups} groups must divide model.moe.experts "
                                   f"({self.experts}) into groups of at least top_k ({self.top_k}) experts")
        for key in ("aux_loss_weight", "z_loss_weight"):
            if not getattr(self, key) >= 0:
                raise ConfigValueError(f"model.moe.{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("dts_start_temperature", "dts_end_temperature", "dts_decay_steps"):
            if not getattr(self, key) > 0:
                raise ConfigValueError(f"model.moe.{key}: must be > 0, got {getattr(self, key)}")
        if not 0 <= self.dts_threshold < 1:
            raise ConfigValueError(f"model.moe.dts_threshold: must be >= 0 and < 1, got {self.dts_threshold}")
        if self.dts_decay not in ("exponential", "linear"):
            raise ConfigValueError(f"model.moe.dts_decay: exponential or linear, got {self.dts_decay!r}")

    @property
    def choices(self) -> int:
        """Choices per token a routing holds (k)."""
        if self.gate in ("switch", "hash", "base"):
            return 1
        if self.gate == "dts":
            return self.experts  # dense to sparse: every expert is a choice, the inactive ones not kept
        return self.top_k


def moe_settings(value: dict, key: str = "model.moe") -> dict:
    """`model.moe`'s mapping checked and completed: every MoESpec field and `every` (each `every`-th block's
    feed-forward is an MoE layer; 1: all of them)."""
    import dataclasses

    from angel_ptm.config.coerce import coerce
    from angel_ptm.errors import UnknownKeyError

    names = {f.name: f.type for f in dataclasses.fields(MoESpec)}
    types = {"experts": int, "top_k": int, "gate": str, "capacity_factor": float, "aux_loss_weight": float,
             "z_loss_weight": float, "groups": int, "dts_start_temperature": float, "dts_end_temperature": float,
             "dts_decay": str, "dts_decay_steps": int, "dts_top1_step": int, "dts_threshold": float}
    assert set(types) == set(names), "moe_settings: a MoESpec field without its type here"
    out = {}
    for name, raw in value.items():
        if name == "every":
            continue
        if name not in types:
            raise UnknownKeyError(f"unknown config key '{key}.{name}' (valid keys in {key}: every, "
                                  f"{', '.join(types)})")
        out[name] = coerce(raw, types[name], f"{key}.{name}")
    every = coerce(value.get("every", 1), int, f"{key}.every")
    if every < 1:
        raise ConfigValueError(f"{key}.every: must be >= 1, got {every}")
    spec = MoESpec(**out)
    # (what differs from the default: a mapping completed once, as this returns it, is read again as a job is set
    # up, and its keys were all "given" then)
    defaults = MoESpec()
    _warn_unused(spec, {name for name in out if out[name] != getattr(defaults, name)}, key)
    return {**dataclasses.asdict(spec), "every": every}


def check_every(moe: dict, n_layer: int) -> None:
    """`model.moe.every` must leave some block an MoE layer (every -th of `n_layer`): else the model is dense."""
    if moe["every"] > n_layer:
        raise ConfigValueError(f"model.moe.every: {moe['every']} is more than model.n_layer ({n_layer}): no block "
                               f"would be an MoE layer")


def _warn_unused(spec: MoESpec, given: set, key: str) -> None:
    """Keys set for a gate that does not use them: said in a warning (a config switching gates keeps them)."""
    from angel_ptm.config.combinations import warn_once

    unused = {"groups"} if spec.gate != "sam" else set()
    if spec.gate != "dts":
        unused |= {name for name in given if name.startswith("dts_")}
    if spec.gate in ("hash", "base"):  # no router: no balance or z-loss
        unused |= {"aux_loss_weight", "z_loss_weight"}
    if spec.gate == "base":  # every expert takes exactly its even share of the tokens
        unused.add("capacity_factor")
    for name in sorted(unused & given):
        warn_once(f"{key}.{name} has no effect: gate {spec.gate} does not use it")


@dataclass
class Routing:
    """A gate's decision for T tokens: k choices each (`expert`, `weight`, `kept` are [T, k]); `capacity` the slots
    per expert (0: dropless); `aux` the gate's auxiliary losses (name -> scalar, already weighted);
    `passthrough` [T] the weight of the token itself in the output (BASE), else None."""

    expert: torch.Tensor
    weight: torch.Tensor
    kept: torch.Tensor
    capacity: int
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    passthrough: Optional[torch.Tensor] = None


def capacity_of(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert: k * ceil(T / E * cf); 0 (dropless) for cf <= 0."""
    if capacity_factor <= 0:
        return 0
    return k * math.ceil(tokens / experts * capacity_factor)


def choice_major_slots(expert: torch.Tensor, experts: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each choice's slot in its expert (first choices of every token in token order, then second choices, ...)
    and whether it is kept (slot < capacity; every choice with capacity 0). `expert`: [T, k] (-1: no choice)."""
    t, k = expert.shape
    order = expert.t().reshape(-1)  # choice-major
    valid = order >= 0
    onehot = F.one_hot(order.clamp(min=0), experts) * valid.unsqueeze(-1)
    position = (onehot.cumsum(0) - 1).gather(1, order.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    slot = position.reshape(k, t).t()
    kept = valid.reshape(k, t).t() & ((slot < capacity) if capacity > 0 else torch.ones_like(slot, dtype=torch.bool))
    return slot, kept


class MoE(nn.Module):
    """Gate + experts (each a `make_expert()` module, by default GPT's SwiGLU feed-forward of width `hidden`)."""

    def __init__(self, dim: int, hidden: int, spec: MoESpec, make_expert=None, token_ids=None):
        super().__init__()
        from angel_ptm.models.gates import make_gate

        self.spec = spec
        self.gate = make_gate(dim, spec, token_ids)
        if make_expert is None:
            from angel_ptm.models.gpt import FeedForward  # GPT's SwiGLU (imported here: gpt.py builds MoE layers)

            make_expert = lambda: FeedForward(dim, hidden)  # noqa: E731
        self.experts = nn.ModuleList(make_expert() for _ in range(spec.experts))
        self.aux_loss: torch.Tensor | float = 0.0
        self.stats = MoEStats(spec.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.gate(flat)
        self.aux_loss = sum(routing.aux.values()) if routing.aux else flat.new_zeros(())
        if self.training and torch._C._current_graph_task_id() == -1:  # not evaluation, not a recomputation
            self.stats.add(routing)
        return self.combine(flat, routing).reshape(shape)

    def combine(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts' outputs for the routed tokens (expert parallelism overrides it: parallel/moe)."""
        return combine(flat, routing, self.experts, self.expert_order)

    # Set from outside (the paging runtime: units.watch_routing), else None: given the experts that have tokens in
    # this forward (ascending), the order to run them in -- those whose weights are in place first. The output and
    # every gradient are the same bitwise in any order (run_experts).
    expert_order: Optional[Callable[[list[int]], list[int]]] = None


def combine(flat: torch.Tensor, routing: Routing, experts: nn.ModuleList,
            order: Optional[Callable[[list[int]], list[int]]] = None) -> torch.Tensor:
    """sum over kept choices of weight * expert(x) (+ passthrough * x): each expert runs once on its tokens, in
    `order(experts with tokens)` where given, else by index."""
    hit = routing.kept & (routing.expert >= 0)
    tokens, choice = hit.nonzero(as_tuple=True)
    expert = routing.expert[tokens, choice]
    by_expert = torch.argsort(expert, stable=True)  # each expert's rows in token (then choice) order
    tokens, choice = tokens[by_expert], choice[by_expert]
    rows = torch.bincount(expert, minlength=len(experts)).tolist()  # (one host read per forward)
    return run_experts(flat, routing, experts, tokens, choice, rows, order)


def run_experts(flat: torch.Tensor, routing: Routing, experts: nn.ModuleList, tokens: torch.Tensor,
                choice: torch.Tensor, rows: list[int], order=None) -> torch.Tensor:
    """The experts on their rows: (tokens[i], choice[i]) for the rows grouped by expert, `rows[e]` of expert e's,
    in expert order. The rows are read in one index_select and split, the outputs joined in expert order and summed
    into their tokens in one index_add: so each token's choices are summed in expert order, in the forward and in
    the backward (the gradient of `flat`), whatever order the experts ran in (`order`, say residency's)."""
    out = flat.new_zeros(flat.shape)
    if tokens.numel():
        weight = (routing.weight * routing.kept).to(flat.dtype)[tokens, choice].unsqueeze(-1)
        inputs = flat.index_select(0, tokens).split(rows)
        running = [e for e, n in enumerate(rows) if n]
        outputs: dict[int, torch.Tensor] = {}
        for e in (order(running) if order is not None else running):
            outputs[e] = experts[e](inputs[e])
        y = torch.cat([outputs[e] for e in running]) if len(running) > 1 else outputs[running[0]]
        out = out.index_add(0, tokens, y * weight)
    if routing.passthrough is not None:
        out = out + routing.passthrough.unsqueeze(-1).to(flat.dtype) * flat
    return out


def combine_at_bound(flat: torch.Tensor, routing: Routing, experts: nn.ModuleList,
                     n_experts: int | None = None) -> torch.Tensor:
    """`combine` with each expert's rows fixed instead of routed: the kept choices' bound (T * k, or E * capacity
    where that is less; `n_experts` E, by default these experts) dealt evenly over `experts`, each row a token and
    choice as a routed one would be. What the activation estimate traces on fake tensors (activations/footprint.py),
    which hold no values to route by. The tensors an expert saves for backward grow with its rows and every
    expert's are held until backward, so their sum -- the peak that matters -- is a routed run's at that bound
    whatever the routing; only the transient inside one expert assumes the balance. Under expert parallelism
    (`experts` this rank's E / ep) it assumes the ranks' loads balanced too: this rank's experts get as many rows
    as its tokens make, and the same number comes back (a routing skewed towards them can make more)."""
    t, k = routing.expert.shape
    n_experts = len(experts) if n_experts is None else n_experts
    bound = t * k if routing.capacity <= 0 else min(t * k, n_experts * routing.capacity)
    rows = [bound // len(experts) + (1 if e < bound % len(experts) else 0) for e in range(len(experts))]
    index = torch.arange(sum(rows), device=flat.device)
    return run_experts(flat, routing, experts, index % t, (index // t) % k, rows)


class MoEStats:
    """Tokens routed per expert and dropped choices since the last `take()` (the trainer logs them per step)."""

    def __init__(self, experts: int):
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        # tokens per expert, then choices, dropped choices and the aux loss, summed on the routing's device: no
        # host sync per forward (take() reads them once)
        self._sums: torch.Tensor | None = None

    def add(self, routing: Routing) -> None:
        with torch.no_grad():
            valid = routing.expert >= 0
            kept = routing.kept & valid
            tokens = torch.bincount(routing.expert[kept].reshape(-1), minlength=self.experts).double()
            aux = sum(v.detach().double() for v in routing.aux.values()) if routing.aux else tokens.new_zeros(())
            row = torch.cat([tokens, torch.stack([valid.sum().double(), (valid & ~routing.kept).sum().double(),
                                                  aux.reshape(())])])
            self._sums = row if self._sums is None else self._sums + row

    def take_sums(self) -> torch.Tensor:
        """The sums since the last take (float64 on the CPU: tokens per expert, choices, dropped, aux), reset."""
        sums = torch.zeros(self.experts + 3, dtype=torch.float64) if self._sums is None else self._sums.cpu()
        self.reset()
        return sums

    def summary(self, sums: torch.Tensor) -> dict:
        values = sums.tolist()
        choices, dropped, aux = values[self.experts:]
        return {"tokens_per_expert": [int(n) for n in values[:self.experts]],
                "drop_rate": dropped / choices if choices else 0.0, "aux_loss": aux}

    def take(self) -> dict:
        return self.summary(self.take_sums())


def moe_metrics(model: nn.Module, sum_over_ranks=None) -> dict:
    """Per MoE layer of `model` (by name), its tokens per expert, drop rate and aux loss since the last call (the
    trainer's metrics.jsonl `moe` field); {} for a dense model. `sum_over_ranks` (a float64 CPU tensor, summed in
    place over the data-parallel ranks: every rank calls it, once per call here): the whole job's routing, every
    rank's tokens (the aux loss summed over their forwards, as one rank's is over its micro-batches)."""
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]
    if not layers:
        return {}
    sums = [module.stats.take_sums() for _, module in layers]
    if sum_over_ranks is not None:  # one collective for every layer
        flat = torch.cat(sums)
        sum_over_ranks(flat)
        sums = list(flat.split([len(s) for s in sums]))
    return {name: module.stats.summary(row) for (name, module), row in zip(layers, sums)}


def set_moe_step(model: nn.Module, step: int) -> None:
    """Tell the gates with a schedule (DTS) which training step comes next (the trainer calls it every step)."""
    for module in model.modules():
        if callable(getattr(module, "set_step", None)):
            module.set_step(step)
