"""The data-parallel side of the engine's step: one object the engine calls at fixed points, so the engine has no
branch on the world size. `SingleRank` does nothing (a world of one); `DataParallel` agrees, reduces and publishes.

    begin_backward() / page_final(i) / take_landed() / end_backward()
                                     the step's last backward: gradients reduced as their page groups become
                                     final (stages 2-3), the groups whose reduction landed (their owner may update)
    finish_grads(without, overflow)  after the last backward, before the norm or the update: the tensors no rank
                                     gave a gradient, an overflow anywhere, and the rest of the reduction
    grad_norm(optimizer, without)    the norm over every rank's pages
    params_updated()                 the owners' parameter pages changed: the others take them (stages 1, 2) or
                                     drop their gathered copies (stage 3)
"""

from __future__ import annotations

import contextlib
import hashlib
import json

import torch
from torch import nn

from angel_ptm.config import config_to_dict
from angel_ptm.errors import CollectiveError, ConfigMismatchError, ConfigValueError
from angel_ptm.memory import Page, PageLayout, PageManager, Tier, compute_device
from angel_ptm.parallel.mesh import Mesh, init_mesh, rank_device
from angel_ptm.parallel.collectives import MIN, Collectives, world_group
from angel_ptm.parallel.ownership import Ownership, osdp_replicable
from angel_ptm.parallel.grad_sync import GradSync
from angel_ptm.parallel.zero import ParamGatherer


def join(config, trace=None, on_failure=None) -> tuple[Mesh, torch.device, Ownership, Collectives | None]:
    """This process's place in the job: its mesh (torchrun's process group, set up from the environment when
    nobody did), its compute device (`cuda:LOCAL_RANK` on GPUs), its share of the pages and, with more than one
    rank, the collectives (`on_failure`: told of a failed collective before it raises)."""
    if config.parallel.osdp and config.optimizer.staleness:
        raise ConfigValueError("parallel.osdp: true needs optimizer.staleness 0 (a replicated group is refreshed when "
                               "the step ends; staleness 1 publishes the update during the next step)")
    mesh = init_mesh(config.parallel, compute_device(config.trainer.device).type)
    device = rank_device(compute_device(config.trainer.device), mesh)
    ownership = Ownership(mesh.dp_rank, mesh.dp, config.parallel.zero)  # (rank-local pages: set with the layout)
    collectives = Collectives(mesh, trace, on_failure=on_failure) if mesh.dp > 1 else None
    return mesh, device, ownership, collectives


def agree_on_job(mesh: Mesh, collectives: Collectives | None, config, layout: PageLayout, model: nn.Module,
                 trace=None, local: set[str] = frozenset()) -> Collectives | None:
    """Every rank runs rank 0's job (`check_same_job`, over the whole world) and starts from its data-parallel
    group's rank 0's values (`broadcast_module`; tensor-parallel peers hold different shards). Returns the world's
    collectives (the data-parallel ones when they span it; None for a world of one)."""
    if not mesh.distributed:
        return None
    world = collectives if collectives is not None and mesh.tp == 1 else Collectives(mesh, trace,
                                                                                       group=world_group(mesh))
    check_same_job(world, config_digest(config_to_dict(config)), layout, model)
    if collectives is not None:
        broadcast_module(model, collectives, local)
    return world


class SingleRank:
    """A world of one: every page is this rank's, nothing to agree on."""

    ownership = Ownership()
    collectives = None
    gatherer = None
    overlaps = False  # no reduction to run during backward

    def begin_backward(self) -> None:
        pass

    def before_grad_write(self, run) -> None:
        pass  # (no reduction writes a gradient page)

    def stats(self) -> dict:
        return {}

    def page_final(self, index: int) -> None:
        pass

    def take_landed(self) -> list[int]:
        return []

    def end_backward(self) -> None:
        pass

    @property
    def reductions_open(self) -> bool:
        return False

    def finish_grads(self, without: set[str], overflow: bool) -> tuple[set[str], bool]:
        return without, overflow

    def grad_norm(self, optimizer, without: set[str]) -> float:
        return optimizer.grad_norm(without)

    def params_updated(self) -> None:
        pass

    def mean(self, value: float, what: str) -> float:
        return value

    def sum(self, tensor: torch.Tensor, what: str) -> None:
        pass

    def close(self) -> None:
        pass


class DataParallel:
    def __init__(self, collectives: Collectives, ownership: Ownership, manager: PageManager, access,
                 layout: PageLayout, pages: dict[str, list[Page | None]], update_tier: Tier, gather_capacity: int,
                 chain_groups: int = 0, osdp: bool = False):
        self.collectives, self.ownership = collectives, ownership
        # Gradients reduced during backward where the collectives run a reduce-scatter beside compute and the
        # other collectives (gloo's pairwise exchange, NCCL's group of its own for reductions)
        mesh = collectives.mesh
        self.replicas = None  # ep < dp: the ranks that hold this rank's experts
        if mesh.expert_dp_ranks.size > 1 and layout.local_pages is not None:
            self.replicas = Collectives(mesh, collectives.trace, collectives.on_failure, group=mesh.expert_dp_ranks)
        self.sync = GradSync(manager, layout, pages, collectives, ownership, update_tier,
                             overlap=collectives.async_reductions, replicas=self.replicas)
        self.overlaps = self.sync.overlap
        self.begin_backward, self.page_final = self.sync.begin_backward, self.sync.page_final
        self.take_landed, self.end_backward = self.sync.take_landed, self.sync.end_backward
        self.gatherer = None
        self.experts = None  # ep < dp at stage 3: zero.ExpertGatherer (set by step.build_step, which has the model)
        if ownership.gathers:  # the same capacity everywhere (auto GPU budgets differ by free memory): the least
            agreed = torch.tensor([float(gather_capacity)])
            collectives.all_reduce(agreed, "ZeRO-3 gather capacity", op=MIN)
            capacity = int(agreed.item())
            self.gatherer = ParamGatherer(manager, pages["param"], collectives, ownership, capacity, access=access,
                                          replicable=osdp_replicable(capacity, chain_groups) if osdp else 0)

    def before_grad_write(self, run) -> None:
        """`run(index)` before a reduction writes gradient page `index` (staleness 1: its pending update first)."""
        self.sync.before_write = run

    def finish_grads(self, without: set[str], overflow: bool) -> tuple[set[str], bool]:
        """Once per step, after the last backward (the engine calls it before the norm and the update)."""
        self.collectives.verify_sequence("this step's gradient reduction")
        without = self.sync.agree_without_grad(without)
        overflow = self.sync.agree_flag(overflow, "fp16 overflow")
        # A skipped step needs no reduced gradient, but reductions begun during backward (a different number on
        # each rank) are finished on every rank, so the next step's come in the same order everywhere.
        if not overflow or self.sync.reductions_open:
            self.sync.reduce(without)
        return without, overflow

    def stats(self) -> dict:
        """What the collectives did (Engine.memory_stats): gradient reductions started during backward, bytes of CPU
        tensors staged through the GPU for NCCL, and OSDP's replicated page groups with the seconds compute waited on each one's gathers when they were chosen."""
        out = {"reductions_in_backward": self.sync.overlapped,
               "staged_bytes": self.collectives.staged_bytes}  # NCCL: CPU tensors sent through the GPU
        if self.sync.expert_reductions is not None:  # ep < dp, stage >= 2: expert groups reduced in backward
            out["expert_reductions_in_backward"] = self.sync.expert_reductions.overlapped
        if self.gatherer is not None:
            out.update(gathers=self.gatherer.gathers,
                       osdp_replicated={g: round(s, 6) for g, s in self.gatherer.replicated.items()})
        return out

    @property
    def reductions_open(self) -> bool:
        """The last backward's gradients are being reduced: the step (or zero_grad) must finish them."""
        return self.sync.reductions_open

    def grad_norm(self, optimizer, without: set[str]) -> float:
        return optimizer.grad_norm(without, combine=self.sync.grad_norm)

    def params_updated(self) -> None:
        self.sync.publish_params()
        if self.gatherer is not None:
            self.gatherer.clear()
        if self.experts is not None:  # (copies a backward left held: the owners' pages changed)
            self.experts.drop_all()

    def mean(self, value: float, what: str) -> float:
        return self.sync.mean_over_ranks(value, what)

    def sum(self, tensor: torch.Tensor, what: str) -> None:
        """`tensor` summed over the data-parallel ranks, in place (every rank calls it)."""
        self.collectives.all_reduce(tensor, what)

    def close(self) -> None:
        """Land the gathers still in flight (the step's end starts the next step's first ones) and drop their
        copies, and the reductions still in flight, before the pools and buffers they use are freed; then the
        collectives' waiter thread stops. After a failed collective there is nothing to wait on."""
        with contextlib.suppress(CollectiveError):
            self.sync.drain()
        if self.gatherer is not None:
            self.gatherer.close()
            with contextlib.suppress(CollectiveError):
                self.gatherer.drop_all()
        if self.experts is not None:
            self.experts.close()
        self.collectives.close()
        if self.replicas is not None:
            self.replicas.close()


def broadcast_module(model: nn.Module, collectives: Collectives, skip: set[str] = frozenset()) -> None:
    """Rank 0's parameter and buffer values on every rank (as DDP does at construction): ranks that built the model
    with different random states start equal. A model on the meta device has no values yet: rank 0's random state is
    taken instead, so every rank materializes the same values. `skip`: rank-local parameters (each rank's own
    experts, sliced from values made equal before)."""
    device = collectives.mesh.comm_device
    params = [p for n, p in model.named_parameters() if n not in skip]
    tensors = list(dict.fromkeys(t for t in params + list(model.buffers())))
    if any(t.is_meta for t in tensors):
        state = collectives.broadcast_object(torch.get_rng_state(), 0, "rank 0's random state")
        torch.set_rng_state(state)
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_meta:
                continue
            carrier = tensor.data if tensor.device == device else tensor.data.to(device)
            collectives.broadcast(carrier, 0, "initial parameters")
            if carrier is not tensor.data:
                tensor.data.copy_(carrier)


def check_same_job(collectives: Collectives, config_digest: str, layout: PageLayout,
                   model: nn.Module | None = None) -> None:
    """Every rank runs the same job: the config (less per-rank paths), the page layout and the model's buffers
    (names, shapes, dtypes) match rank 0's, else a ConfigMismatchError on every rank naming the ranks that differ."""
    buffers = "" if model is None else hashlib.sha256(repr(
        [(name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers()]).encode()).hexdigest()[:16]
    mine = (config_digest, layout.fingerprint(), buffers)
    everyone = collectives.all_gather_object(mine, "config and layout fingerprints")
    differ = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        at = next(i for i in range(3) if any(everyone[r][i] != everyone[0][i] for r in differ))
        what = ("config", "page layout", "buffers (names, shapes or dtypes)")[at]
        raise ConfigMismatchError(
            f"rank {collectives.rank}: ranks {differ} started with a different {what} than rank 0 "
            f"(fingerprints {[everyone[r][at] for r in differ]} vs {everyone[0][at]}); every rank must run the "
            f"same job")


def broadcast_buffers(model: nn.Module, collectives: Collectives, skip: frozenset[str] = frozenset()) -> None:
    """Rank 0's buffers on every rank of the data-parallel group, one broadcast per dtype: each rank updated them
    with its own micro-batches (BatchNorm's running statistics), so after each step they agree again, as DDP's
    broadcast_buffers makes them agree (state dicts, checkpoints and evaluations are then the same on every rank).
    `skip`: rank-local modules' buffers (each rank's own experts)."""
    buffers = [b for name, b in model.named_buffers()
               if b is not None and not b.is_meta and not any(name.startswith(prefix) for prefix in skip)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in dict.fromkeys(buffers):
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            flat = torch.cat([b.reshape(-1).to(collectives.mesh.comm_device) for b in group])
            collectives.broadcast(flat, 0, f"buffers ({dtype})")
            at = 0
            for buffer in group:
                buffer.copy_(flat[at : at + buffer.numel()].view(buffer.shape))
                at += buffer.numel()


def config_digest(config_dict: dict) -> str:
    """A digest of the job's config without what legitimately differs per rank (run and page directories)."""
    clean = {section: dict(values) for section, values in config_dict.items()}
    clean.get("run", {}).pop("dir", None)
    clean.get("memory", {}).pop("disk_dir", None)
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()[:16]
