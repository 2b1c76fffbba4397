"""MoE gates: each maps tokens [T, dim] to a Routing (models/moe.py), with the math of its reference.

    switch   top-1 (Switch Transformer); aux = E * sum_e mean_t(p_e) * mean_t(first-choice mask_e)
    gshard   top-2 (GShard): the first by argmax, the second by Gumbel-max sampling among the rest while
             training (argmax in eval); the two weights renormalised to sum to 1; the same aux loss
    ktop1    k-top-1 (M6): the experts split into k prototypes of E/k, softmax and top-1 inside each; aux per
             prototype, averaged
    hash     no parameters: expert = a fixed multiplicative hash of the token id (Hash layers), weight 1; the ids
             come from a `TokenIds` holder the model fills before its blocks run
    base     BASE layers: a balanced assignment (each expert exactly T/E tokens; T must divide by E) maximizing
             the sum of token . centroid scores exactly (greedy, then cycle cancelling), output
             sigma(x . c_e) * expert(x) + (1 - sigma) * x; no aux loss
    sam      Switch-and-mixture over groups: the group with the largest summed probability (top-1 group), then
             top-k experts inside it with their probabilities renormalised within the group; aux = the balance
             loss over groups + an alignment loss, mean_t(1 - P(chosen group)), which pulls the router's mass
             into the group it routes to
    dts      DTS-Gate: Gumbel-softmax with a temperature decaying from `dts_start_temperature` to
             `dts_end_temperature` over `dts_decay_steps` (exponential or linear); every expert whose weight
             exceeds `dts_threshold` is active (dense to sparse); from `dts_top1_step` on, hard top-1. The step
             is set from outside (`set_step`, the trainer does it each step; it is a persistent buffer, so a
             resumed run continues the schedule)

The z-loss (`z_loss_weight`) applies to every gate with logits: mean_t(logsumexp(logits_t)^2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from angel_ptm.errors import ConfigValueError
from angel_ptm.models.moe import MoESpec, Routing, capacity_of, choice_major_slots

HASH_MULTIPLIER = 2654435761  # Knuth's multiplicative hash


class TokenIds:
    """The token ids of the forward in progress, for hash gates (the model sets `ids` before its blocks)."""

    ids: torch.Tensor | None = None


def make_gate(dim: int, spec: MoESpec, token_ids: TokenIds | None) -> nn.Module:
    cls = {"switch": SwitchGate, "gshard": GShardGate, "ktop1": KTop1Gate, "hash": HashGate, "base": BaseGate,
           "sam": SamGate, "dts": DTSGate}[spec.gate]
    return HashGate(spec, token_ids) if cls is HashGate else cls(dim, spec)


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Routing in float32 at least, whatever the compute dtype (bf16 logits tie and round)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def balance_loss(probs: torch.Tensor, first: torch.Tensor, experts: int) -> torch.Tensor:
    """E * sum_e mean_t(probs_e) * mean_t(first choice is e) (Switch / GShard)."""
    mask = F.one_hot(first, experts).to(probs.dtype)
    return experts * (probs.mean(0) * mask.mean(0)).sum()


class _LogitGate(nn.Module):
    def __init__(self, dim: int, spec: MoESpec, outputs: int | None = None):
        super().__init__()
        self.spec = spec
        self.router = nn.Linear(dim, outputs or spec.experts, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return _wide(self.router(x))

    def with_z(self, aux: dict, logits: torch.Tensor) -> dict:
        if self.spec.z_loss_weight:
            aux["z_loss"] = self.spec.z_loss_weight * torch.logsumexp(logits, -1).square().mean()
        return aux

    def routing(self, expert, weight, logits, aux, k: int) -> Routing:
        capacity = capacity_of(expert.shape[0], self.spec.experts, k, self.spec.capacity_factor)
        _, kept = choice_major_slots(expert, self.spec.experts, capacity)
        return Routing(expert, weight, kept, capacity, self.with_z(aux, logits))


class SwitchGate(_LogitGate):
    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.logits(x)
        probs = logits.softmax(-1)
        weight, expert = probs.max(-1, keepdim=True)
        aux = {"balance": self.spec.aux_loss_weight * balance_loss(probs, expert[:, 0], self.spec.experts)}
        return self.routing(expert, weight, logits, aux, 1)


class GShardGate(_LogitGate):
    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.logits(x)
        probs = logits.softmax(-1)
        first = probs.argmax(-1)
        rest = logits.masked_fill(F.one_hot(first, self.spec.experts).bool(), float("-inf"))
        if self.training:  # Gumbel-max: a sample in proportion to the remaining probabilities
            u = torch.rand_like(rest).clamp_(1e-20, 1.0)
            rest = rest - torch.log(-torch.log(u))
        second = rest.argmax(-1)
        expert = torch.stack([first, second], -1)
        g = probs.gather(-1, expert)
        weight = g / g.sum(-1, keepdim=True)
        aux = {"balance": self.spec.aux_loss_weight * balance_loss(probs, first, self.spec.experts)}
        return self.routing(expert, weight, logits, aux, 2)


class KTop1Gate(_LogitGate):
    def forward(self, x: torch.Tensor) -> Routing:
        k, experts = self.spec.top_k, self.spec.experts
        per = experts // k
        logits = self.logits(x)
        probs = logits.view(-1, k, per).softmax(-1)  # per prototype
        weight, local = probs.max(-1)  # [T, k]
        expert = local + torch.arange(k, device=x.device) * per
        balance = sum(balance_loss(probs[:, j], local[:, j], per) for j in range(k)) / k
        return self.routing(expert, weight, logits, {"balance": self.spec.aux_loss_weight * balance}, k)


class HashGate(nn.Module):
    def __init__(self, spec: MoESpec, token_ids: TokenIds | None):
        super().__init__()
        self.spec, self.token_ids = spec, token_ids

    def forward(self, x: torch.Tensor) -> Routing:
        ids = None if self.token_ids is None else self.token_ids.ids
        if ids is None or ids.numel() != x.shape[0]:
            raise ConfigValueError("model.moe.gate hash: the layer needs the token ids of its tokens (the model "
                                   "sets TokenIds.ids before its blocks run)")
        expert = ((ids.reshape(-1).long() * HASH_MULTIPLIER) % (1 << 32)) % self.spec.experts
        expert = expert.to(x.device).unsqueeze(-1)
        weight = torch.ones(expert.shape, dtype=torch.float32, device=x.device)
        capacity = capacity_of(x.shape[0], self.spec.experts, 1, self.spec.capacity_factor)
        _, kept = choice_major_slots(expert, self.spec.experts, capacity)
        return Routing(expert, weight, kept, capacity)


class BaseGate(nn.Module):
    """BASE layers: expert centroids c_e; the optimal balanced assignment; sigma(x . c_e) mixes expert and token."""

    def __init__(self, dim: int, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.centroids = nn.Linear(dim, spec.experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        scores = _wide(self.centroids(x))
        t, experts = scores.shape
        if t % experts:
            raise ConfigValueError(f"model.moe.gate base: {t} tokens do not divide over {experts} experts (BASE "
                                   f"gives every expert exactly T/E); choose a batch x sequence that does")
        expert = self.assign(scores.detach(), t // experts).unsqueeze(-1)
        gate = torch.sigmoid(scores.gather(-1, expert))
        kept = torch.ones_like(expert, dtype=torch.bool)
        return Routing(expert, gate, kept, t // experts, passthrough=1 - gate[:, 0])

    def assign(self, scores: torch.Tensor, capacity: int) -> torch.Tensor:
        """Each token's expert, every expert taking exactly `capacity` (the activation trace, which has no scores
        to bid with, sets one that deals them in order: the same shapes)."""
        return balanced_assignment(scores, capacity)


def balanced_assignment(scores: torch.Tensor, capacity: int) -> torch.Tensor:
    """The expert of each of T tokens, each expert taking exactly `capacity` tokens, maximizing the sum of
    `scores[t, e]`: the optimum itself (a transportation problem), not one within a tolerance of it -- near-optimal
    assignments are many, and which one an approximate method lands on changes with the last bits of the scores
    (expert parallelism's), so the routing would. A greedy start (the highest scores first, while the expert has
    room), then Klein's cycle cancelling on the experts' residual graph: moving one token from expert a to expert b
    costs at best w[a, b] = min over a's tokens of (score[t, a] - score[t, b]); a cycle of such moves with a negative
    sum keeps every expert's load and raises the total, and an assignment with no such cycle is optimal. Cycles are
    found by Bellman-Ford over the E experts (a cycle gaining less than 1e-12 of the score range is noise)."""
    t, experts = scores.shape
    s = scores.detach().double().cpu()
    if experts == 1:
        return torch.zeros(t, dtype=torch.long, device=scores.device)
    expert = torch.full((t,), -1, dtype=torch.long)
    load = [0] * experts
    order = torch.argsort(s.reshape(-1), descending=True, stable=True).tolist()
    placed = 0
    for flat in order:  # greedy: each token to the best expert with room left
        token, e = divmod(flat, experts)
        if expert[token] < 0 and load[e] < capacity:
            expert[token] = e
            load[e] += 1
            placed += 1
            if placed == t:
                break
    tolerance = 1e-12 * (float(s.max() - s.min()) or 1.0)
    rows = torch.arange(t)
    for _ in range(64 * t + 64):  # (each cancel gains more than the tolerance: a bound on the loop, never reached)
        # w[a, b]: the cheapest move of one of a's tokens to b, and which token
        loss = s[rows, expert].unsqueeze(1) - s  # [T, E]: what moving each token to each expert costs
        home = expert.unsqueeze(1).expand(t, experts)
        weight = torch.full((experts, experts), float("inf"), dtype=torch.float64).scatter_reduce(
            0, home, loss, "amin")
        cheapest = torch.where(loss == weight[expert], rows.unsqueeze(1), t)  # (the lowest such token: deterministic)
        mover = torch.full((experts, experts), t, dtype=torch.long).scatter_reduce(0, home, cheapest, "amin")
        weight.fill_diagonal_(float("inf"))
        cycle = _negative_cycle(weight, tolerance)
        if cycle is None:
            break
        moves = [(int(mover[a, b]), b) for a, b in zip(cycle, cycle[1:] + cycle[:1])]
        for token, b in moves:
            expert[token] = b
    return expert.to(scores.device)


def _negative_cycle(weight: torch.Tensor, tolerance: float) -> list[int] | None:
    """A cycle of nodes whose edges `weight[a, b]` sum to less than -tolerance (Bellman-Ford from every node at
    once), or None."""
    n = weight.shape[0]
    dist = torch.zeros(n, dtype=torch.float64)
    parent = torch.full((n,), -1, dtype=torch.long)
    changed = -1
    for _ in range(n):
        through = dist.unsqueeze(1) + weight  # [a, b]: reaching b through a
        best, via = through.min(dim=0)
        better = best < dist - tolerance / n
        if not bool(better.any()):
            return None
        dist = torch.where(better, best, dist)
        parent = torch.where(better, via, parent)
        changed = int(better.nonzero()[0])
    node = changed
    for _ in range(n):  # n steps back along the parents: surely on the cycle
        node = int(parent[node])
    cycle, at = [node], int(parent[node])
    while at != node:
        cycle.append(at)
        at = int(parent[at])
    cycle.reverse()  # parents point backwards: the moves go forwards
    if float(sum(weight[a, b] for a, b in zip(cycle, cycle[1:] + cycle[:1]))) >= -tolerance:
        return None  # (relaxations by less than the tolerance each: noise, no real cycle)
    return cycle


class SamGate(_LogitGate):
    def forward(self, x: torch.Tensor) -> Routing:
        groups, k = self.spec.groups, self.spec.top_k
        per = self.spec.experts // groups
        logits = self.logits(x)
        probs = logits.softmax(-1)
        grouped = probs.view(-1, groups, per)
        group_mass = grouped.sum(-1)  # [T, groups]
        group = group_mass.argmax(-1)
        inside = grouped.gather(1, group.view(-1, 1, 1).expand(-1, 1, per)).squeeze(1)  # [T, per]
        top, local = inside.topk(k, dim=-1)
        weight = top / inside.sum(-1, keepdim=True)
        expert = local + (group * per).unsqueeze(-1)
        aux = {"balance": self.spec.aux_loss_weight * balance_loss(group_mass, group, groups),
               "alignment": self.spec.aux_loss_weight * (1 - group_mass.gather(-1, group.unsqueeze(-1))).mean()}
        return self.routing(expert, weight, logits, aux, k)


class DTSGate(_LogitGate):
    def __init__(self, dim: int, spec: MoESpec):
        super().__init__(dim, spec)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))  # persistent: checkpoints keep it

    def reset_buffers(self) -> None:
        """The schedule's start (also after materializing a model built on the meta device)."""
        self.step = torch.zeros((), dtype=torch.int64, device=self.step.device)

    def set_step(self, step: int) -> None:
        self.step.fill_(int(step))

    def temperature(self, step: int | None = None) -> float:
        s = self.spec
        step = int(self.step) if step is None else step
        done = min(1.0, step / max(1, s.dts_decay_steps))
        if s.dts_decay == "linear":
            return s.dts_start_temperature + (s.dts_end_temperature - s.dts_start_temperature) * done
        return s.dts_start_temperature * (s.dts_end_temperature / s.dts_start_temperature) ** done

    def forward(self, x: torch.Tensor) -> Routing:
        s = self.spec
        logits = self.logits(x)
        probs = logits.softmax(-1)
        noisy = logits
        if self.training:
            u = torch.rand_like(logits).clamp_(1e-20, 1.0)
            noisy = logits - torch.log(-torch.log(u))
        soft = (noisy / self.temperature()).softmax(-1)
        aux = {"balance": s.aux_loss_weight * balance_loss(probs, soft.argmax(-1), s.experts)}
        if int(self.step) >= s.dts_top1_step:  # hard top-1 from here on, with capacity
            expert = soft.argmax(-1, keepdim=True)
            return self.routing(expert, soft.gather(-1, expert), logits, aux, 1)
        # dense to sparse: every expert whose weight exceeds the threshold is a choice, kept (no capacity); the
        # others are no choice (-1), so the routing statistics count no drop for them
        active = soft > s.dts_threshold
        experts = torch.arange(s.experts, device=x.device).expand(x.shape[0], -1)
        return Routing(torch.where(active, experts, -1), soft, active, 0, self.with_z(aux, logits))
