"""Expert parallelism applied from outside: `apply_expert_parallel(model, comm)` keeps, in each MoE layer, only the
experts of this rank (E / ep of them in slots: at first rank r holds experts r*E/ep .., and the load-driven
placement, placement.py, may swap experts between ranks), and turns the layer into an
`ExpertParallelMoE` whose forward dispatches every kept choice to its expert's rank and combines the results back:

    1. the gate routes this rank's tokens (the gate is an ordinary data-parallel module);
    2. the kept choices, sorted by their expert's slot (so by destination rank), with per-slot counts; the counts are
       exchanged first (one all_to_all of E integers), so the token exchange has exact uneven splits: capacity
       drops happen in the routing, and a dropless gate needs no capacity here either;
    3. all_to_all of the chosen tokens' hidden states; each local expert runs once on everything it received;
    4. all_to_all back, in the order sent; the sender combines with its gate weights, in expert order.
The exchanges are autograd functions (backward: the reverse all_to_all), so gradients reach the gate, the input and
the experts; an expert's gradient on its rank sums every rank's tokens. The layer's output equals the unsplit
layer's on the same tokens (tests/test_moe_parallel.py).

Hot-expert replicas (`set_placement(placement, replicas)`, placement.py decides them): a rank runs its own slots,
then one slot per replica it holds (a copy of the expert's weights, outside the pages, `load_replicas`); each rank
deals its rows of a replicated expert in equal contiguous shares over the owner and the copies. In backward, once
the dispatched rows' gradient is in, one more all_to_all sends each copy's parameter gradients to the owner, which
adds them to its own (`on_replica_grads`: the engine's grad pages; else the parameters' .grad).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from angel_ptm.errors import ConfigValueError, DistributedError
from angel_ptm.models.moe import MoE
from angel_ptm.parallel.collectives import Collectives
from angel_ptm.parallel.mesh import Group, Mesh
from angel_ptm.parallel.moe.placement import ExpertClock


class EPComm:
    """One rank's expert-parallel group: its rank and size, and the collectives (none with ep 1).

    `hierarchical` (HetuMoE's all-to-all, `parallel.moe_a2a: hierarchical`): the group's ranks form nodes of
    `node_size` consecutive ranks (torchrun's LOCAL_WORLD_SIZE); an exchange gathers every rank's rows on its
    node's first rank (the leader), the leaders exchange what crosses nodes, and each leader scatters what its
    node's ranks receive: one message per pair of nodes on the slow links instead of one per pair of ranks. The
    rows each rank receives, and their order (by source rank), are the flat exchange's."""

    @classmethod
    def planning(cls, ep: int) -> "EPComm":
        """Rank 0 of an ep group that never communicates: apply_expert_parallel() on a meta-device model gives the
        experts one rank holds (the estimate's use); running such a model raises at its first exchange."""
        comm = cls.__new__(cls)
        comm.rank, comm.size, comm.collectives, comm.hierarchical = 0, ep, None, False
        return comm

    def __init__(self, mesh: Mesh, group: Group | None = None, hierarchical: bool = False,
                 node_size: int | None = None):
        group = group or mesh.ep_ranks
        self.rank, self.size = group.index(mesh.rank), group.size
        self.collectives = Collectives(mesh, group=group) if group.size > 1 else None
        self.hierarchical = hierarchical and self.collectives is not None
        if self.hierarchical:
            node = node_size or mesh.local_world_size
            if node < 1 or self.size % node:
                raise ConfigValueError(f"parallel.moe_a2a hierarchical: nodes of {node} ranks (LOCAL_WORLD_SIZE) do "
                                       f"not divide the {self.size} expert-parallel ranks")
            self.node_size, self.nodes = node, self.size // node
            nodes = [list(group.ranks[n * node:(n + 1) * node]) for n in range(self.nodes)]
            leaders = [ranks[0] for ranks in nodes]
            self.local = self.leaders = None
            for ranks in nodes:  # every rank makes every group, in the same order
                made = Group("ep-node", tuple(ranks), dist.new_group(ranks, backend=mesh.backend))
                if mesh.rank in ranks:
                    self.local = Collectives(mesh, group=made) if node > 1 else None
            made = Group("ep-leaders", tuple(leaders), dist.new_group(leaders, backend=mesh.backend))
            if mesh.rank in leaders and len(leaders) > 1:
                self.leaders = Collectives(mesh, group=made)

    def exchange(self, x: torch.Tensor, send: list[int], receive: list[int], what: str) -> torch.Tensor:
        if self.collectives is None:
            return x.clone()
        if self.hierarchical:
            return self._hierarchical(x.contiguous(), send, f"ep {what}")
        out = x.new_empty((sum(receive),) + tuple(x.shape[1:]))
        self.collectives.all_to_all(out, x.contiguous(), receive, send, f"ep {what}")
        return out

    def _hierarchical(self, x: torch.Tensor, send: list[int], what: str) -> torch.Tensor:
        n, node = self.size, self.node_size
        counts = torch.tensor(send, dtype=torch.int64)
        rows = [torch.empty_like(counts) for _ in range(n)]
        self.collectives.all_gather_list(rows, counts, f"{what} counts")
        m = torch.stack(rows).tolist()  # m[s][d]: rows group rank s sends to group rank d
        me, first = self.rank, self.rank - self.rank % node
        mine = range(first, first + node)  # this node's ranks
        tail = tuple(x.shape[1:])
        # 1. every rank's rows to its leader (local rank 0)
        gathered = x
        if self.local is not None:
            to_leader = [x.shape[0] if r == 0 else 0 for r in range(node)]
            from_ranks = [sum(m[s]) if me == first else 0 for s in mine]
            gathered = x.new_empty((sum(from_ranks),) + tail)
            self.local.all_to_all(gathered, x, from_ranks, to_leader, f"{what} to the leader")
        if me != first:
            received = x.new_empty((0,) + tail)
        else:
            # 2. the leaders: to each node, for each local source in order, its rows to that node's ranks
            blocks, start = {}, 0
            for s in mine:
                for d in range(n):
                    blocks[(s, d)] = (start, m[s][d])
                    start += m[s][d]
            parts, out_splits = [], []
            for other in range(self.nodes):
                theirs = range(other * node, (other + 1) * node)
                sent = 0
                for s in mine:
                    a = blocks[(s, theirs[0])][0]
                    size = sum(m[s][d] for d in theirs)
                    parts.append(gathered[a:a + size])
                    sent += size
                out_splits.append(sent)
            in_splits = [sum(m[s][d] for s in range(o * node, (o + 1) * node) for d in mine)
                         for o in range(self.nodes)]
            outgoing = torch.cat(parts) if parts else gathered
            if self.leaders is not None:
                received = x.new_empty((sum(in_splits),) + tail)
                self.leaders.all_to_all(received, outgoing, in_splits, out_splits, f"{what} between nodes")
            else:
                received = outgoing
            # 3. what each of this node's ranks receives, by global source rank
            at, start = {}, 0
            for s in range(n):  # received: by source node, source rank, then this node's destination
                for d in mine:
                    at[(s, d)] = (start, m[s][d])
                    start += m[s][d]
            received = torch.cat([received[a:a + size] for d in mine for s in range(n)
                                  for a, size in [at[(s, d)]]]) if n else received
        if self.local is None:
            return received
        per_rank = [sum(m[s][d] for s in range(n)) for d in mine]
        out = x.new_empty((per_rank[me - first],) + tail)
        self.local.all_to_all(out, received, [per_rank[me - first] if r == 0 else 0 for r in range(node)],
                              per_rank if me == first else [0] * node, f"{what} from the leader")
        return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, send, receive, what):
        ctx.comm, ctx.send, ctx.receive, ctx.what = comm, send, receive, what
        return comm.exchange(x, send, receive, what)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.exchange(grad.contiguous(), ctx.receive, ctx.send, f"{ctx.what} backward"), None, None, None, \
            None


class ExpertParallelMoE(MoE):
    """An MoE layer holding `len(experts)` of `spec.experts` experts in slots; `placement[r]` lists the experts rank r's
    slots hold (at first rank r holds experts r*E/ep ..; parallel/moe/placement.py may move them at a step
    boundary), `expert_ids` this rank's."""

    ep: EPComm
    placement: list[list[int]]
    count_loads: bool = False  # tokens per expert kept for the placement (Rebalancer), and the experts' time
    _load_counts: torch.Tensor | None = None  # this rank's tokens per expert since the last take
    # Called with the local slots that receive rows from some rank, once the counts are exchanged (the engine
    # cancels the planned fetches of the others: units.watch_routing)
    on_local_routing = None
    # Called on an owner with (local slot, {parameter name: the sum of its replicas' gradients} or None when no
    # replica got a row) once they are in, in backward; None adds them into the slot's parameters' .grad
    on_replica_grads = None

    def set_placement(self, placement: list[list[int]], replicas=()) -> None:
        """`placement[r]`: the experts rank r's slots hold; `replicas`: (expert, rank) pairs, a copy of the expert's
        weights on that rank besides its owner's (placement.py's hot-expert replicas). Every rank sets the same."""
        self.placement = [list(held) for held in placement]
        self.expert_ids = self.placement[self.ep.rank]
        experts, local = self.spec.experts, len(self.expert_ids)
        self.replicas = sorted((int(e), int(h)) for e, h in replicas)
        self.owner = [0] * experts
        for r, held in enumerate(self.placement):
            for e in held:
                self.owner[e] = r
        on = [[e for e, h in self.replicas if h == r] for r in range(len(self.placement))]
        for e, h in self.replicas:
            ranks = len(self.placement)
            if not (0 <= e < experts and 0 <= h < ranks) or h == self.owner[e] or on[h].count(e) > 1:
                raise DistributedError(f"MoE replicas: ({e}, {h}) is no expert copy rank {h} may hold (experts "
                                       f"0..{experts - 1}, ranks 0..{ranks - 1}, not the owner, once)")
        # Every rank runs `width` slots: its own experts, then its replicas (the same width on every rank)
        self._width = local + max((len(held) for held in on), default=0)
        holders = [[(self.owner[e], self.placement[self.owner[e]].index(e))] for e in range(experts)]
        for r, held in enumerate(on):
            for j, e in enumerate(held):
                holders[e].append((r, local + j))
        ways = max(len(h) for h in holders)
        # expert -> its holders' slots over the group (rank * width + slot), the owner's first
        self._position = torch.tensor([[r * self._width + j for r, j in h] + [-1] * (ways - len(h)) for h in holders])
        self._ways = torch.tensor([len(h) for h in holders])
        self._moved = bool(self.replicas) or self._position[:, 0].tolist() != list(range(experts))
        keep = dict(zip(getattr(self, "_held", ()), getattr(self, "replica_modules", ())))  # (copies still held)
        self._held = on[self.ep.rank]  # the experts whose replicas this rank holds, in its slots' order
        self.replica_modules = [keep.get(e) for e in self._held]  # (weights: load_replicas, after every step)

    def load_replicas(self, weights: dict[int, dict[str, torch.Tensor]], device: torch.device) -> None:
        """This rank's replicas take their owners' current weights (by expert, by parameter name within it)."""
        template = self.__dict__["_replica_template"]
        for j, e in enumerate(self._held):
            module = self.replica_modules[j]
            if module is None:
                module = self.replica_modules[j] = copy.deepcopy(template).to_empty(device=device)
            for name, param in module.named_parameters():
                value = weights[e][name]
                param.data = value.to(device).reshape(param.shape).clone()
                param.grad = None

    def _slot_positions(self, expert: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each row's slot over the group: its expert's owner's, or with replicas one holder's (each rank's rows of
        an expert dealt in equal contiguous shares over its holders, the owner's first)."""
        if self._position.device != expert.device:  # (moved to the compute device once per placement)
            self._position, self._ways = self._position.to(expert.device), self._ways.to(expert.device)
        if not self.replicas:
            return self._position[expert, 0]
        first = torch.cumsum(counts, 0) - counts  # rows are sorted by expert: where each expert's begin
        index = torch.arange(expert.numel(), device=expert.device) - first[expert]
        n, ways = counts[expert], self._ways[expert]
        base, extra = n // ways, n % ways
        big = extra * (base + 1)  # the first `extra` shares have one row more
        share = torch.where(index < big, index // (base + 1), extra + (index - big) // base.clamp(min=1))
        return self._position[expert, share]

    def take_load_counts(self) -> torch.Tensor:
        """This rank's tokens per expert since the last take (float64 on the CPU), reset."""
        counts, self._load_counts = self._load_counts, None
        return torch.zeros(self.spec.experts, dtype=torch.float64) if counts is None else counts.double().cpu()

    def combine(self, flat: torch.Tensor, routing) -> torch.Tensor:
        experts, ep = self.spec.experts, self.ep
        local = len(self.experts)
        chosen = routing.kept & (routing.expert >= 0)
        tokens, choice = chosen.nonzero(as_tuple=True)
        expert = routing.expert[tokens, choice]
        order = torch.argsort(expert, stable=True)  # by expert: the order a token's choices are summed in
        tokens, choice, expert = tokens[order], choice[order], expert[order]
        counts = torch.bincount(expert, minlength=experts)
        measured = self.count_loads and self.training and torch._C._current_graph_task_id() == -1
        if measured:
            self._load_counts = counts if self._load_counts is None else self._load_counts + counts
        # The rows go out by slot over the group (rank, then slot): the expert order while no expert has moved
        outgoing, width = None, self._width
        if self._moved:
            position = self._slot_positions(expert, counts)
            outgoing = torch.argsort(position, stable=True)
            counts = torch.bincount(position, minlength=ep.size * width)
        received = ep.exchange(counts.view(ep.size, width).cpu(), [1] * ep.size, [1] * ep.size, "expert counts")
        send = counts.view(ep.size, width).sum(1).tolist()
        receive = received.sum(1).tolist()
        running = [e for e, n in enumerate(received.sum(0).tolist()) if n]  # the slots with rows
        own = [e for e in running if e < local]
        if self.on_local_routing is not None:
            self.on_local_routing(set(own))
        rows = flat.index_select(0, tokens)
        if outgoing is not None:
            rows = rows.index_select(0, outgoing)
        if self.replicas and torch.is_grad_enabled():
            if not rows.requires_grad:  # (the replicas' gradients go back once this one is in: below)
                rows = rows.detach().requires_grad_()
            if torch._C._current_graph_task_id() == -1:  # (not a recomputation in backward: registered once)
                rows.register_hook(self._return_replica_grads)
        inputs = _AllToAll.apply(rows, ep, send, receive, "dispatch")
        # rows arrive by source rank, within each by slot: run each slot's expert once on all of its rows
        owner = torch.arange(width).repeat(ep.size).repeat_interleave(received.reshape(-1)).to(flat.device)
        # (from `inputs`, even when no local expert runs: both exchanges' backward must run on every rank alike)
        outputs = inputs * 0.0
        started = self.clock.start(flat.device) if measured else None
        order = self.expert_order(own) if self.expert_order is not None else own
        for e in order + [e for e in running if e >= local]:  # (disjoint rows: the same results in any order)
            rows_of = (owner == e).nonzero(as_tuple=True)[0]
            module = self.experts[e] if e < local else self.replica_modules[e - local]
            if module is None:
                raise DistributedError(f"MoE replica of expert {self._held[e - local]} on ep rank {ep.rank} has "
                                       f"no weights: load_replicas() after set_placement()")
            outputs = outputs.index_copy(0, rows_of, module(inputs.index_select(0, rows_of)))
        if measured:
            self.clock.stop(started, inputs.shape[0])
        back = _AllToAll.apply(outputs, ep, receive, send, "combine")
        if outgoing is not None:  # back in expert order: each token's choices summed as with no expert moved
            back = back.index_select(0, torch.argsort(outgoing))
        weight = (routing.weight[tokens, choice]).to(flat.dtype).unsqueeze(-1)
        out = flat.new_zeros(flat.shape).index_add(0, tokens, back * weight)
        if routing.passthrough is not None:
            out = out + routing.passthrough.unsqueeze(-1).to(flat.dtype) * flat
        return out

    def _return_replica_grads(self, grad: torch.Tensor) -> None:
        """In backward, once the dispatched rows' gradient is in (every slot's expert, replicas too, has its
        parameters' gradients by then: autograd accumulates those first): each replica's gradients go to its
        expert's owner, in one exchange every rank makes alike, and the owner adds them to its own."""
        me, size = self.ep.rank, self.ep.size
        shapes = [(name, p.shape, p.numel()) for name, p in self.__dict__["_replica_template"].named_parameters()]
        width = sum(n for _, _, n in shapes) + 1  # and a flag: whether the replica got any row
        rows, send = [], [0] * size
        wide = torch.promote_types(grad.dtype, torch.float32)  # (exact for bf16 and fp16, and gloo carries it)
        for owner, _, j in sorted((self.owner[e], e, j) for j, e in enumerate(self._held)):
            params = list(self.replica_modules[j].parameters())
            got = any(p.grad is not None for p in params)
            parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(wide) for p in params]
            rows.append(torch.cat(parts + [torch.full((1,), float(got), dtype=wide, device=grad.device)]))
            for p in params:
                p.grad = None
            send[owner] += 1
        incoming = sorted((h, e) for e, h in self.replicas if self.owner[e] == me)  # (each source sends by expert)
        receive = [sum(1 for h, _ in incoming if h == r) for r in range(size)]
        out = torch.stack(rows) if rows else torch.zeros(0, width, dtype=wide, device=grad.device)
        got = self.ep.exchange(out, send, receive, "replica gradients")
        sums: dict[int, torch.Tensor] = {}
        for row, (_, e) in zip(got, incoming):
            if row[-1] > 0:
                sums[e] = row[:-1] if e not in sums else sums[e] + row[:-1]
        for e in sorted({e for _, e in incoming}):
            grads = None
            if e in sums:
                grads, at = {}, 0
                for name, shape, n in shapes:
                    grads[name] = sums[e][at:at + n].view(shape)
                    at += n
            self._add_replica_grads(self.expert_ids.index(e), grads)

    def _add_replica_grads(self, local: int, grads: dict[str, torch.Tensor] | None) -> None:
        if self.on_replica_grads is not None:
            self.on_replica_grads(local, grads)
        elif grads is not None:
            for name, param in self.experts[local].named_parameters():
                g = grads[name].to(param.dtype).view_as(param)
                param.grad = g if param.grad is None else param.grad + g


def apply_expert_parallel(model: nn.Module, comm: EPComm, initial: Collectives | None = None) -> nn.Module:
    """Keep this rank's experts in every MoE layer of `model` (in place); every rank must apply it alike. The
    experts are sliced from the values of rank 0 of `initial` (default: the ep group; broadcast first), so every
    rank starts from the 1-rank weights; on the meta device, the layer keeps the others (shapes only) for
    materialization to draw the 1-rank values."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ConfigValueError("parallel.ep: the model has no MoE layer (model.moe) whose experts could be split")
    for layer in layers:
        if isinstance(layer, ExpertParallelMoE):
            raise ConfigValueError("parallel.ep: the model's experts are split already")
        if layer.spec.experts % comm.size:
            raise ConfigValueError(f"parallel.ep: {comm.size} ranks do not divide model.moe.experts "
                                   f"({layer.spec.experts})")
    meta = any(p.is_meta for p in model.parameters())
    initial = initial or comm.collectives
    for layer in layers:
        experts = layer.spec.experts
        if initial is not None and not meta:  # (on meta: every rank materializes the 1-rank values)
            with torch.no_grad():
                for param in layer.experts.parameters():
                    initial.broadcast(param.data, 0, "ep initial experts")
        local = experts // comm.size
        start = comm.rank * local
        every = list(layer.experts)
        layer.experts = nn.ModuleList(every[start:start + local])
        if meta:  # materialization replays every expert's draws in the 1-rank order (memory/materialize.py)
            layer.unsplit_children = {"experts": every}
        layer.__class__ = ExpertParallelMoE
        layer.__dict__["_replica_template"] = copy.deepcopy(every[0]).to("meta")  # (a replica's shape; unregistered)
        layer.ep, layer.clock = comm, ExpertClock()
        layer.set_placement([list(range(r * local, (r + 1) * local)) for r in range(comm.size)])
    model._angel_ep = comm
    return model


def expert_names(model: nn.Module) -> dict[str, str]:
    """This rank's expert parameter names -> the names the unsplit model gives them (`...experts.<global>.`):
    checkpoints and state dicts use the global ones."""
    out = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            for name, _ in module.experts.named_parameters():
                index, _, rest = name.partition(".")
                out[f"{prefix}.experts.{name}"] = f"{prefix}.experts.{module.expert_ids[int(index)]}.{rest}"
    return out


def apply_expert_parallel_for(model: nn.Module, mesh: Mesh, trace=None, on_failure=None) -> EPComm | None:
    """parallel.ep > 1: this rank's experts of every MoE layer (the engine calls it); None with ep 1."""
    if mesh.ep == 1:
        return None
    comm = EPComm(mesh, hierarchical=mesh.moe_a2a == "hierarchical")
    if comm.collectives is not None:
        if trace is not None:
            comm.collectives.trace = trace
        comm.collectives.on_failure = on_failure
    # ep < dp: every expert-parallel group starts from data-parallel rank 0's experts (replicas alike)
    whole = Collectives(mesh, trace, on_failure) if mesh.ep_group is not None else None
    apply_expert_parallel(model, comm, initial=whole)
    if whole is not None:
        whole.close()
    return comm
