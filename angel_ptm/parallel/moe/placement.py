"""Load-driven expert placement (FlexMoE's idea: migration and hot-expert replicas): where routing leaves one rank's
experts with far more tokens than another's, experts change ranks at a step boundary so that the busiest rank, which
every all-to-all waits for, gets fewer tokens; an expert hotter than a rank's share, which no move can split, gets
copies of its weights on other ranks (`parallel.moe_replicas`) that compute a share of its rows.

    rebalancer = Rebalancer(model, ep, sum_over_ranks, tensors, optimizer, every, threshold, ema)
    rebalancer.after_step(step)     # every rank, after each optimizer step: maybe moves experts; returns what it did

Each MoE layer's experts keep fixed *slots* (rank r holds E/ep of them; the pages, the plan and the budgets are the
slots'), and a placement says which expert each slot holds. A migration is a set of swaps between two ranks' slots:
the two experts' weights, AdamW moments and step counts change places (one all-to-all of the rows that move), the
dispatch follows the new placement, and the checkpoint names follow it too (an expert is saved under its own index,
wherever it lives). Nothing of the math changes: an expert runs on the same rows in the same order (by source rank)
wherever it is, and the combine sums each token's choices in expert order as before, so the losses are those of the
run that never moved an expert (bitwise, tests/test_moe_parallel.py).

The decision, every `every` steps, is the same on every rank (it is made from figures summed over the ranks):
  - load: each expert's tokens per step over the interval, every rank's, in an exponential moving average over
    the intervals (`ema`: the weight of the past);
  - balance ratio: the busiest rank's load over the mean rank's; at or below `threshold` nothing moves;
  - swaps, greedily: the busiest rank's expert and another rank's lighter one that, exchanged, leave the larger of
    the two ranks' loads lowest, until no swap lowers the busiest rank's (ties broken by index: deterministic);
  - replicas (`max_replicas` per rank): on the swapped placement, the busiest rank's heaviest expert share gets a
    copy on the least loaded rank without one, while that lowers the busiest rank's load (an expert's load is
    dealt equally over its owner and copies);
  - cost model: the swaps and replicas pay when the busiest rank's tokens they remove, times the measured expert
    time per token (forward and backward: 3x the forward measured in the layer), over the next `every` steps,
    exceed the time to move the swapped experts' states, plus each replica's weights out and gradients back every
    step, at the bandwidth of a probe all-to-all timed at the decision (1 MiB per pair of ranks).

A replica holds only weights (the compute copy): the owner keeps the moments and updates; in backward each
replica's gradients go to the owner (dispatch.py), which adds them before its gradient counts as final
(ParamBinder.held_grads), and after every step `_refresh_replicas` sends the owners' new weights to the copies.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

# AdamW's state of an expert that moves with it: its weights (the fp32 master under mixed precision), both moments
MOVED_KINDS = ("exp_avg", "exp_avg_sq")
FORWARD_AND_BACKWARD = 3.0  # an expert's backward costs about twice its forward
PROBE_BYTES = 1 << 20  # per pair of ranks, the all-to-all that measures the link at each decision


def rank_loads(loads: list[float], slots: list[list[int]], replicas=()) -> list[float]:
    """Each rank's load: the sum of its experts', an expert with replicas (expert, rank) sharing its load equally
    among its owner and them."""
    ways = Counter(e for e, _ in replicas)
    per_rank = [sum(loads[e] / (1 + ways[e]) for e in held) for held in slots]
    for e, rank in replicas:
        per_rank[rank] += loads[e] / (1 + ways[e])
    return per_rank


def balance_ratio(loads: list[float], slots: list[list[int]], replicas=()) -> float:
    """The busiest rank's load over the mean rank's (1.0: balanced, or no load at all)."""
    per_rank = rank_loads(loads, slots, replicas)
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0


def plan_replicas(loads: list[float], slots: list[list[int]], per_rank: int) -> list[tuple[int, int]]:
    """Hot-expert replicas (FlexMoE), greedily: the busiest rank's heaviest expert share gets a copy on the least
    loaded rank that does not hold it and has fewer than `per_rank` replicas, as long as that lowers the busiest
    rank's load. Returns sorted (expert, rank) pairs; deterministic for equal inputs (ties: the lower index)."""
    owner = {e: r for r, held in enumerate(slots) for e in held}
    replicas: list[tuple[int, int]] = []
    while True:
        loads_now = rank_loads(loads, slots, replicas)
        busy = max(range(len(slots)), key=lambda r: (loads_now[r], -r))
        ways = Counter(e for e, _ in replicas)
        here = slots[busy] + [e for e, r in replicas if r == busy]
        found = None
        for e in sorted(here, key=lambda e: (-loads[e] / (1 + ways[e]), e)):
            holders = {owner[e]} | {r for f, r in replicas if f == e}
            room = [r for r in range(len(slots)) if r not in holders
                    and sum(1 for _, h in replicas if h == r) < per_rank]
            if not room:
                continue
            to = min(room, key=lambda r: (loads_now[r], r))
            if max(rank_loads(loads, slots, replicas + [(e, to)])) < loads_now[busy] * (1 - 1e-9):
                found = (e, to)
                break
        if found is None:
            return sorted(replicas)
        replicas.append(found)


def plan_swaps(loads: list[float], slots: list[list[int]], max_swaps: int | None = None
               ) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Greedy swaps off the busiest rank: of every (its expert, another rank's lighter expert) pair, the swap that
    leaves the lower of the two ranks' larger load, as long as that is below the busiest rank's load now (or until
    `max_swaps`). Returns the new slots (rank -> experts, each rank keeping its slot count) and the swaps as (expert
    leaving the busiest rank, expert coming to it). Deterministic for equal inputs (ties: the lower rank, then the
    lower expert indexes)."""
    slots = [list(held) for held in slots]
    swaps: list[tuple[int, int]] = []
    limit = max_swaps if max_swaps is not None else sum(len(h) for h in slots)
    while len(swaps) < limit:
        per_rank = rank_loads(loads, slots)
        busy = max(range(len(slots)), key=lambda r: (per_rank[r], -r))
        best, best_key = None, (per_rank[busy],)
        for other in range(len(slots)):
            if other == busy:
                continue
            for i, e in enumerate(slots[busy]):
                for j, f in enumerate(slots[other]):
                    moved = loads[e] - loads[f]
                    if moved <= 0:
                        continue
                    key = (max(per_rank[busy] - moved, per_rank[other] + moved), other, e, f)
                    if key < best_key:
                        best, best_key = (other, i, j, e, f), key
        if best is None:
            break
        other, i, j, e, f = best
        slots[busy][i], slots[other][j] = f, e
        swaps.append((e, f))
    return slots, swaps


def decide(layer: str, loads: list[float], slots: list[list[int]], threshold: float, seconds_per_row: float,
           bandwidth: float, bytes_per_expert: int, horizon: int, replicas=(), max_replicas: int = 0,
           weight_bytes: int = 0) -> "Decision":
    """Whether (and how) to move one layer's experts, with `replicas` the hot-expert copies in place now: where
    the balance ratio exceeds `threshold`, swaps are planned, then (`max_replicas` per rank) replicas on the swapped
    placement. They are made where the busiest rank's rows they remove, at `seconds_per_row` each, over `horizon`
    steps, take longer than sending the swapped experts (`bytes_per_expert` each) at `bandwidth` bytes/s from the
    rank that sends the most of them, plus each replica's weights out and gradients back (`weight_bytes` each way)
    every step of the horizon."""
    replicas = sorted(tuple(r) for r in replicas)
    before = balance_ratio(loads, slots, replicas)
    decision = Decision(layer, before, before, replicas=list(replicas))
    if before <= threshold:
        return decision
    new_slots, swaps = plan_swaps(loads, slots)
    planned = plan_replicas(loads, new_slots, max_replicas) if max_replicas else []
    if not swaps and planned == replicas:
        return decision
    decision.ratio_after, decision.swaps = balance_ratio(loads, new_slots, planned), swaps
    decision.replicas = planned
    peak_removed = max(rank_loads(loads, slots, replicas)) - max(rank_loads(loads, new_slots, planned))
    decision.gain_s = peak_removed * seconds_per_row * horizon
    where = {e: r for r, held in enumerate(slots) for e in held}
    sent_by = [0] * len(slots)  # each swap sends two experts, one each way
    for e, f in swaps:
        sent_by[where[e]] += 1
        sent_by[where[f]] += 1
    owner = {e: r for r, held in enumerate(new_slots) for e in held}
    copies_by = [0] * len(slots)  # each replica: its weights out of the owner, its gradients into it, every step
    for e, r in planned:
        copies_by[owner[e]] += 1
        copies_by[r] += 1
    cost = max(s * bytes_per_expert + c * weight_bytes * horizon for s, c in zip(sent_by, copies_by))
    decision.move_s = cost / bandwidth if bandwidth > 0 else float("inf")
    decision.moved = decision.gain_s > decision.move_s and decision.ratio_after < before
    if decision.moved:
        decision.new_slots = new_slots
    else:
        decision.replicas = list(replicas)  # (they stay as they are)
    return decision


def replica_bytes(model, per_rank: int, dtype: torch.dtype | None) -> int:
    """The most bytes one rank's hot-expert copies take beside the pages (`parallel.moe_replicas` = `per_rank` copies
    per MoE layer, as plan_replicas places them): each copy's weights and, in backward, their gradients, in the
    compute dtype (`dtype`; None: the parameters' own)."""
    from angel_ptm.models.moe import MoE

    total = 0
    for layer in model.modules():
        if isinstance(layer, MoE) and len(layer.experts) and per_rank:
            weights = sum(p.numel() * (dtype or p.dtype).itemsize for p in layer.experts[0].parameters())
            total += per_rank * 2 * weights
    return total


@dataclass
class Decision:
    """What one layer's rebalance found: the ratios before and after, the swaps, their cost and gain (seconds)."""

    layer: str
    ratio_before: float
    ratio_after: float
    swaps: list[tuple[int, int]] = field(default_factory=list)
    move_s: float = 0.0
    gain_s: float = 0.0
    moved: bool = False
    new_slots: list[list[int]] | None = None  # where the experts go, when they move
    replicas: list[tuple[int, int]] = field(default_factory=list)  # the hot-expert copies (expert, rank) from now

    def as_dict(self) -> dict:
        return {"ratio_before": round(self.ratio_before, 4), "ratio_after": round(self.ratio_after, 4),
                "swaps": [list(s) for s in self.swaps], "replicas": [list(r) for r in self.replicas],
                "move_s": self.move_s if self.move_s != float("inf") else None, "gain_s": self.gain_s,
                "moved": self.moved}


class ExpertClock:
    """The forward time of one layer's local experts and the rows they ran on, since the last `take()`: wall time on
    the CPU, CUDA events on a GPU (read at `take()`, when the step that recorded them is long done)."""

    def __init__(self):
        self.seconds, self.rows, self._events = 0.0, 0, []

    def start(self, device: torch.device):
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started, rows: int) -> None:
        self.rows += rows
        if isinstance(started, float):
            self.seconds += time.perf_counter() - started
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((started, end))

    def take(self) -> tuple[float, int]:
        for start, end in self._events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000.0
        out = (self.seconds, self.rows)
        self.seconds, self.rows, self._events = 0.0, 0, []
        return out


class Rebalancer:
    """parallel.moe_rebalance_every > 0: the placement of every expert-parallel MoE layer revisited at that step
    interval (module docstring). `sum_over_ranks` sums a float64 CPU tensor over the ranks in place; `tensors` and
    `optimizer` read and write the experts' states (rank-local pages); `parameters_written` recasts the compute
    copies after weights were written (mixed precision); `expert_names` (this rank's local -> global names) is
    updated in place."""

    def __init__(self, model, ep, sum_over_ranks, tensors, layout, optimizer, parameters_written, expert_names: dict,
                 every: int, threshold: float, ema: float, max_replicas: int = 0, binder=None,
                 device: torch.device | None = None):
        from angel_ptm.parallel.moe.dispatch import ExpertParallelMoE

        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]
        self.model, self.ep, self.sum_over_ranks = model, ep, sum_over_ranks
        self.tensors, self.layout, self.optimizer = tensors, layout, optimizer
        self.parameters_written, self.expert_names = parameters_written, expert_names
        self.every, self.threshold, self.ema = every, threshold, ema
        self.max_replicas, self.binder, self.device = max_replicas, binder, device or torch.device("cpu")
        self.replica_bytes = 0  # this rank's bytes sent refreshing replicas' weights
        self.loads: dict[str, list[float] | None] = {name: None for name, _ in self.layers}
        self.decisions: list[dict] = []  # one entry per rebalance that looked (step, layers' decisions)
        self.migrations = 0  # experts moved (each swap moves two)
        self.bytes_moved = 0  # this rank's bytes sent moving experts
        for name, layer in self.layers:
            layer.count_loads = True
            if binder is not None:  # an owner adds its replicas' gradients into its expert's grad pages
                layer.on_replica_grads = (lambda local, grads, name=name:
                                          binder.add_grads(self._replica_grad_names(name, local, grads)))

    def stats(self) -> dict:
        """Experts moved so far (each swap moves two), this rank's bytes sent moving them, the replicas in place
        (every layer's) and this rank's bytes sent refreshing them, the decisions made, and the last one (step and
        per layer: ratios, swaps, replicas, cost and gain)."""
        return {"migrations": self.migrations, "bytes_moved": self.bytes_moved, "decisions": len(self.decisions),
                "replicas": sum(len(layer.replicas) for _, layer in self.layers), "replica_bytes": self.replica_bytes,
                "last": self.decisions[-1] if self.decisions else None}

    # ------------------------------------------------------------------ the decision
    def after_step(self, step: int) -> dict | None:
        """After optimizer step `step` (1-based) on every rank: every `every` steps, fold the interval's routing
        (every rank's tokens) into the loads and rebalance; then, every step, the replicas take their owners' new
        weights. Returns the decision per layer when one was made."""
        out = None
        if self.layers and step % self.every == 0:
            out = self._rebalance(step)
        self._refresh_replicas()
        return out

    def _rebalance(self, step: int) -> dict:
        counts = torch.cat([layer.take_load_counts() for _, layer in self.layers])
        self.sum_over_ranks(counts)  # every rank's tokens: the same figures everywhere
        experts = [layer.spec.experts for _, layer in self.layers]
        for (name, _), row in zip(self.layers, counts.split(experts)):
            values = [v / self.every for v in row.tolist()]  # tokens per step over the interval
            old = self.loads[name]
            self.loads[name] = values if old is None else [self.ema * o + (1 - self.ema) * v
                                                           for o, v in zip(old, values)]
        seconds_per_row, bandwidth = self._measured()
        out, moved = {}, []
        for name, layer in self.layers:
            decision = decide(name, self.loads[name], layer.placement, self.threshold, seconds_per_row, bandwidth,
                              self._expert_row_numel(name) * 8, self.every, layer.replicas, self.max_replicas,
                              self._expert_weight_numel(name) * self._wide(name).itemsize)
            if decision.moved and decision.swaps:
                self._migrate(name, layer, decision)
                moved.append(name)
            elif decision.moved:
                layer.set_placement(layer.placement, decision.replicas)
            out[name] = decision.as_dict()
        if moved:  # once for every layer that moved: names follow the slots, compute copies take the masters
            from angel_ptm.parallel.moe.dispatch import expert_names

            self.expert_names.clear()
            self.expert_names.update(expert_names(self.model))
            if any(self.tensors.weights_kind(s) == "master" for s in self._expert_slots(moved[0], 0)):
                self.parameters_written()  # mixed precision (every rank alike: a collective under ZeRO 1/2)
        if self.binder is not None:  # an owner's replicated experts: their gradients are final once theirs are in
            self.binder.held_grads = {s.name for name, layer in self.layers for e in {e for e, _ in layer.replicas}
                                      if layer.owner[e] == self.ep.rank
                                      for s in self._expert_slots(name, layer.expert_ids.index(e))}
        self.decisions.append({"step": step, "layers": out})
        return out

    def _measured(self) -> tuple[float, float]:
        """The experts' seconds per row (forward and backward) since the last decision, and the all-to-all bytes
        per second of a probe exchange made now, summed over the ranks so every rank decides on the same figures.
        (The step's own all-to-alls are no measure of the link: an unbalanced layer's include the wait for the
        busiest rank, the very thing a move would save. The probe starts right after a summing collective, so
        the ranks start it together.)"""
        seconds, rows = 0.0, 0
        for _, layer in self.layers:
            s, r = layer.clock.take()
            seconds, rows = seconds + s, rows + r
        figures = torch.tensor([seconds, rows], dtype=torch.float64)
        self.sum_over_ranks(figures)
        seconds, rows = figures.tolist()
        size, n = self.ep.size, PROBE_BYTES // 4
        probe = torch.zeros(size * n, dtype=torch.float32, device=self.device)
        got = torch.empty_like(probe)
        t0 = time.perf_counter()
        self.ep.collectives.all_to_all(got, probe, [n] * size, [n] * size, "ep bandwidth probe")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        spent = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        self.sum_over_ranks(spent)
        per_row = FORWARD_AND_BACKWARD * seconds / rows if rows else 0.0
        sent = PROBE_BYTES * (size - 1)  # each rank's bytes to the others
        return per_row, (sent * size / spent.item() if spent.item() > 0 else 0.0)

    # ------------------------------------------------------------------ moving experts
    def _expert_slots(self, name: str, local: int) -> list:
        """The layout slots of local expert `local` of layer `name`."""
        prefix = f"{name}.experts.{local}."
        return [s for s in self.layout.slots if s.name.startswith(prefix)]

    def _expert_row_numel(self, name: str) -> int:
        """Float64 numbers that carry one expert's state: per tensor its weights and moments, and its step count."""
        return sum(s.numel * (1 + len(MOVED_KINDS)) + 1 for s in self._expert_slots(name, 0))

    def _expert_weight_numel(self, name: str) -> int:
        return sum(s.numel for s in self._expert_slots(name, 0))

    def _wide(self, name: str) -> torch.dtype:
        """What a replica's weights and gradients travel as: their compute dtype, at least fp32 (exact for bf16 and
        fp16, and gloo carries it)."""
        return torch.promote_types(self.tensors.dtype("param", self._expert_slots(name, 0)[0].segments[0].page),
                                   torch.float32)

    # ------------------------------------------------------------------ hot-expert replicas
    def _refresh_replicas(self) -> None:
        """Every rank alike, after each step: the owners send their replicated experts' weights (the compute
        copies, as the experts compute with them) to the ranks holding replicas (one all-to-all per layer)."""
        me = self.ep.rank
        for name, layer in self.layers:
            if not layer.replicas:
                continue
            outgoing = sorted((h, e) for e, h in layer.replicas if layer.owner[e] == me)
            incoming = sorted((layer.owner[e], e) for e, h in layer.replicas if h == me)
            send = [sum(1 for h, _ in outgoing if h == r) for r in range(self.ep.size)]
            receive = [sum(1 for o, _ in incoming if o == r) for r in range(self.ep.size)]
            width, wide = self._expert_weight_numel(name), self._wide(name)
            rows = (torch.stack([torch.cat([self.tensors.read("param", s).reshape(-1).to(wide)
                                            for s in self._expert_slots(name, layer.expert_ids.index(e))])
                                 for _, e in outgoing]) if outgoing else torch.zeros(0, width, dtype=wide))
            got = torch.zeros(sum(receive), width, dtype=wide)
            self.ep.collectives.all_to_all(got, rows, receive, send, f"ep replicas {name}")
            self.replica_bytes += rows.numel() * rows.element_size()
            prefix = f"{name}.experts.0."
            parts = [(s.name[len(prefix):], s.numel, self.tensors.dtype("param", s.segments[0].page))
                     for s in self._expert_slots(name, 0)]
            weights = {}
            for row, (_, e) in zip(got, incoming):
                weights[e], at = {}, 0
                for pname, numel, dtype in parts:
                    weights[e][pname] = row[at:at + numel].to(dtype)
                    at += numel
            layer.load_replicas(weights, self.device)

    def _replica_grad_names(self, name: str, local: int, grads) -> dict:
        """The layout names of local expert `local`'s tensors -> their replicas' gradients (None: none came)."""
        prefix = f"{name}.experts.{local}."
        return {s.name: None if grads is None else grads[s.name[len(prefix):]]
                for s in self._expert_slots(name, local)}

    def _pack(self, name: str, local: int) -> torch.Tensor:
        parts = []
        for slot in self._expert_slots(name, local):
            parts.append(self.tensors.read(self.tensors.weights_kind(slot), slot).reshape(-1).double())
            parts += [self.tensors.read(kind, slot).reshape(-1).double() for kind in MOVED_KINDS]
            parts.append(torch.tensor([float(self.optimizer.slot_steps.get(slot.name, 0))], dtype=torch.float64))
        return torch.cat(parts)

    def _unpack(self, name: str, local: int, row: torch.Tensor) -> None:
        at = 0
        for slot in self._expert_slots(name, local):
            shape = tuple(slot.shape)
            for kind in (self.tensors.weights_kind(slot),) + MOVED_KINDS:  # (cast to each page's dtype)
                self.tensors.write(kind, slot, row[at:at + slot.numel].view(shape))
                at += slot.numel
            self.optimizer.slot_steps[slot.name] = int(row[at].item())
            at += 1

    def _migrate(self, name: str, layer, decision: Decision) -> None:
        """Every rank in the same order: the rows of the slots whose expert changes rank go to the expert's new
        rank (one all-to-all), are written into the slots that now hold it, and the dispatch takes the new
        placement (after_step then renames and recasts once for every layer moved)."""
        old, new = layer.placement, decision.new_slots
        ranks = len(old)
        held_at = {e: (r, i) for r, held in enumerate(old) for i, e in enumerate(held)}
        me = self.ep.rank
        # what moves: (new rank, new slot) <- (old rank, old slot), for the experts whose rank changes
        moves = sorted(((r, i), held_at[e]) for r, held in enumerate(new) for i, e in enumerate(held)
                       if held_at[e][0] != r)
        outgoing = [(dst, src) for dst, src in moves if src[0] == me]  # sorted by destination rank and slot
        # a source's rows arrive in the order it sent them: by this rank's slot
        incoming = sorted(((src[0], dst[1]), dst) for dst, src in moves if dst[0] == me)
        width = self._expert_row_numel(name)
        send = [sum(1 for dst, _ in outgoing if dst[0] == r) for r in range(ranks)]
        receive = [sum(1 for src, _ in incoming if src[0] == r) for r in range(ranks)]
        rows = (torch.stack([self._pack(name, src[1]) for _, src in outgoing]) if outgoing
                else torch.zeros(0, width, dtype=torch.float64))
        got = torch.zeros(sum(receive), width, dtype=torch.float64)
        self.ep.collectives.all_to_all(got, rows, receive, send, f"ep migrate {name}")
        for row, (_, dst) in zip(got, incoming):
            self._unpack(name, dst[1], row)
        self.bytes_moved += rows.numel() * 8
        self.migrations += 2 * len(decision.swaps)
        layer.set_placement(new, decision.replicas)


def rebalancer_for(engine) -> Rebalancer | None:
    """The engine's Rebalancer where `parallel.moe_rebalance_every` asks for one (the config checked ep > 1 and
    staleness 0), else None."""
    par = engine.config.parallel
    if not par.moe_rebalance_every or engine.ep is None:
        return None
    return Rebalancer(engine.model, engine.ep, engine.sum_over_ranks, engine.tensors, engine.layout,
                      engine.optimizer, engine.parameters_written, engine.expert_names, par.moe_rebalance_every,
                      par.moe_rebalance_threshold, par.moe_rebalance_ema, par.moe_replicas, engine.binder,
                      engine.device)
