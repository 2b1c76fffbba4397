"""The process group and the dp x tp mesh, from torchrun's environment.

    mesh = init_mesh(config.parallel, device_type="cpu")   # world of 1 without torchrun: no process group
    mesh.rank, mesh.dp, mesh.tp, mesh.dp_rank, mesh.tp_rank, mesh.local_rank

Ranks are laid out tensor-parallel first, as Megatron does: global rank = dp_rank * tp + tp_rank, so a tensor-parallel
group (whose collectives sit on every layer's critical path) is `tp` consecutive ranks, on one node where the node
holds them. A data-parallel group is the ranks with the same tp_rank; ZeRO shards page groups across it. Each group
is a `Group` (its global ranks and process group; the default group when it is the whole world, none of its own
with one rank). Every rank creates every group, in the same order (torch.distributed requires it).

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set) the default process group is
initialized here unless the user's script already did: NCCL for CUDA tensors, gloo on CPU, with
`parallel.timeout_s` as the collectives' timeout, after making cuda:LOCAL_RANK the current GPU (NCCL binds to it).
torchrun's world of one gets a process group too; a plain `python` run is a world of one and never touches
torch.distributed.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from angel_ptm.errors import CollectiveError, DistributedError


@dataclass(frozen=True)
class Group:
    """One process group of the mesh: its members' global ranks, in group-rank order, and the torch process group
    (None: the default group, or a group of one that never communicates)."""

    name: str  # "dp", "tp" or "world"
    ranks: tuple[int, ...]
    pg: object = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


@dataclass(frozen=True)
class Mesh:
    """Where this process stands: its rank in the world and on its node, and the dp x tp degrees."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    dp: int = 1
    timeout_s: float = 300.0
    backend: str | None = None  # None: a world of one, no process group
    tp: int = 1
    sequence_parallel: bool = False
    ep: int = 1
    moe_a2a: str = "flat"
    dp_group: Group | None = field(default=None, compare=False)  # None: every rank (tp 1)
    tp_group: Group | None = field(default=None, compare=False)
    # ep < dp: this rank's ep consecutive data-parallel ranks (its experts' all-to-all), and the dp / ep ranks that
    # hold the same experts (their gradients all-reduced). None: ep = dp (or 1)
    ep_group: Group | None = field(default=None, compare=False)
    expert_dp_group: Group | None = field(default=None, compare=False)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_ranks(self) -> Group:
        """This rank's data-parallel group."""
        return self.dp_group or Group("dp", tuple(range(self.world_size)))

    @property
    def ep_ranks(self) -> Group:
        """This rank's expert-parallel group: ep consecutive ranks of its data-parallel group (all of it: ep = dp)."""
        return self.ep_group or self.dp_ranks

    @property
    def expert_dp_ranks(self) -> Group:
        """The ranks that hold this rank's experts (one per expert-parallel group; this rank alone when ep = dp)."""
        return self.expert_dp_group or Group("expert-dp", (self.rank,))

    @property
    def tp_ranks(self) -> Group:
        """This rank's tensor-parallel group."""
        return self.tp_group or Group("tp", (self.rank,))

    @property
    def comm_device(self) -> torch.device:
        """Where tensors handed to a collective must live: this rank's GPU for NCCL, the CPU for gloo."""
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes metrics, the progress bar and the run directory's config."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}: expected an integer, got {value!r}") from None


def _destroy_at_exit() -> None:
    """The gloo process group this module made, torn down before the interpreter's own teardown (left to static
    destructors, its threads could outlive what they use: a rare abort at exit after a clean run)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # (exiting anyway; a peer already gone is no reason to fail the exit)
            pass


_OUT_OF_STEP: dict = {}  # default process group -> why its ranks' collectives are out of step (used never again)


def mark_out_of_step(reason: str) -> None:
    """This process's collectives no longer match its peers' (a collective failed, or a rank-local error ended a
    step part-way): any later collective on the process group could take a peer's data of another size, which
    gloo answers by aborting the process. A later engine on the same group is refused instead (init_mesh)."""
    if dist.is_available() and dist.is_initialized():
        _OUT_OF_STEP.setdefault(dist.group.WORLD, reason)


def init_mesh(parallel, device_type: str = "cpu") -> Mesh:
    """The mesh of this process; initializes the default process group from the environment when a launcher
    (torchrun) started several processes and nobody initialized it yet. Idempotent."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
        if dist.group.WORLD in _OUT_OF_STEP:
            raise CollectiveError(f"rank {rank}: the process group's collectives are out of step since an earlier "
                                  f"engine failed ({_OUT_OF_STEP[dist.group.WORLD][:300]}); it cannot carry another "
                                  f"engine's: start every rank anew (torchrun restarts them) and resume from the "
                                  f"last checkpoint")
        if "LOCAL_RANK" in os.environ:  # otherwise the script chose its GPU itself
            _use_local_gpu(device_type, _env_int("LOCAL_RANK", 0))
    else:
        world = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        backend = None
        # torchrun's world of one gets its process group too (NCCL's path with one GPU; scripts may call dist)
        launched = bool(os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("MASTER_ADDR"))
        if world > 1 or launched:
            if not dist.is_available():
                raise DistributedError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
            backend = "nccl" if device_type == "cuda" else "gloo"
            # NCCL binds each rank's communicators to its current GPU: cuda:LOCAL_RANK, set before the group exists
            _use_local_gpu(device_type, _env_int("LOCAL_RANK", rank % max(1, _env_int("LOCAL_WORLD_SIZE", world))))
            try:
                _init_default_group(backend, rank, world, parallel.timeout_s)
                if backend == "gloo":
                    atexit.register(_destroy_at_exit)
            except (RuntimeError, ValueError) as exc:
                raise DistributedError(f"rank {rank}: cannot set up the {backend} process group of {world} ranks "
                                       f"(MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
                                       f"MASTER_PORT={os.environ.get('MASTER_PORT')}): {exc}") from None
    local_world = _env_int("LOCAL_WORLD_SIZE", 1 if world == 1 else world)
    local_rank = _env_int("LOCAL_RANK", rank % max(1, local_world))
    dp, tp, ep = mesh_shape(parallel, world)
    dp_group = tp_group = None
    if tp > 1:  # the groups of the mesh, every one made on every rank in the same order
        tp_group = _make_groups("tp", mesh_groups("tp", dp, tp), rank, backend, parallel.timeout_s)
        dp_group = (_make_groups("dp", mesh_groups("dp", dp, tp), rank, backend, parallel.timeout_s) if dp > 1
                    else Group("dp", (rank,)))
    ep_group = expert_dp_group = None
    if 1 < ep < dp:  # (tp 1: data-parallel ranks are the world's)
        ep_group = _make_groups("ep", mesh_groups("ep", dp, 1, ep), rank, backend, parallel.timeout_s)
        expert_dp_group = _make_groups("expert-dp", mesh_groups("expert-dp", dp, 1, ep), rank, backend,
                                       parallel.timeout_s)
    return Mesh(rank, world, local_rank, local_world, dp, parallel.timeout_s, backend, tp,
                parallel.sequence_parallel and tp > 1, ep, parallel.moe_a2a, dp_group, tp_group, ep_group,
                expert_dp_group)


def _init_default_group(backend: str, rank: int, world: int, timeout_s: float) -> None:
    """init_process_group from the environment (env://, as torch does it) within about `timeout_s` when a peer
    never comes: torch's store client tries to connect for its timeout, waits a moment and tries once more (twice
    the timeout and more: 7.8 s for 4 s here), so a rank that connects to a store (not rank 0's own, nor with
    torchrun's agent store, which is up before any rank starts) tries for half of it each time; the store then
    waits `timeout_s` as any collective does."""
    from torch.distributed import PrefixStore, rendezvous

    timeout = timedelta(seconds=timeout_s)
    connects = rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store, rank, world = next(rendezvous("env://", rank, world,
                                         timeout=timedelta(seconds=timeout_s / 2) if connects else timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=PrefixStore("default_pg", store), rank=rank, world_size=world,
                            timeout=timeout)


def mesh_shape(parallel, world: int) -> tuple[int, int, int]:
    """(dp, tp, ep) of a world of `world` ranks under the `parallel` config section, or the DistributedError that
    says which rule it breaks (init_mesh's, and `angel-ptm estimate --world-size`'s)."""
    tp = parallel.tp
    if world % tp:
        raise DistributedError(f"parallel.tp: {tp} does not divide the world size {world}")
    dp = parallel.dp if parallel.dp is not None else world // tp
    if world % dp:
        raise DistributedError(f"parallel.dp: {dp} does not divide the world size {world}")
    if dp * tp != world:
        raise DistributedError(f"parallel.dp x parallel.tp = {dp} x {tp} = {dp * tp}, but the world has {world} "
                               f"ranks; set parallel.dp to {world // tp} (or null)")
    ep = parallel.ep
    if ep > 1 and dp % ep:
        raise DistributedError(f"parallel.ep: {ep} expert-parallel ranks do not divide parallel.dp {dp}; each group "
                               f"of ep consecutive data-parallel ranks holds every expert once")
    if ep > 1 and tp > 1:
        raise DistributedError("parallel.ep with parallel.tp > 1: expert and tensor parallelism together are not "
                               "supported yet")
    return dp, tp, ep


def _use_local_gpu(device_type: str, local_rank: int) -> None:
    """Make cuda:LOCAL_RANK this process's current GPU (NCCL's communicators and object collectives use it)."""
    if device_type == "cuda" and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK {local_rank}: this machine has {torch.cuda.device_count()} GPU(s); "
                                   f"start at most that many processes per node")
        torch.cuda.set_device(local_rank)


def mesh_groups(name: str, dp: int, tp: int, ep: int = 1) -> list[list[int]]:
    """Every group of one kind, in creation order: "tp" groups are tp consecutive ranks; "dp" groups the ranks with
    the same tp rank; "ep" groups ep consecutive ranks (tp 1); "expert-dp" the ranks at the same place of each ep
    group; "world" all of them."""
    if name == "ep":
        return [[b * ep + i for i in range(ep)] for b in range(dp // ep)]
    if name == "expert-dp":
        return [[b * ep + i for b in range(dp // ep)] for i in range(ep)]
    if name == "tp":
        return [[d * tp + t for t in range(tp)] for d in range(dp)]
    if name == "dp":
        return [[d * tp + t for d in range(dp)] for t in range(tp)]
    return [list(range(dp * tp))]


def _make_groups(name: str, enumeration: list[list[int]], rank: int, backend: str | None, timeout_s: float,
                 world_is_default: bool = True) -> Group:
    """Every group of `enumeration` (all ranks call this alike); this rank's. A group of the whole world is the
    default process group unless `world_is_default` is False."""
    mine = None
    for ranks in enumeration:
        if world_is_default and len(ranks) == sum(len(r) for r in enumeration):
            pg = None
        else:
            pg = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout_s))
        if rank in ranks:
            mine = Group(name, tuple(ranks), pg)
    return mine


def new_groups_like(group: Group, mesh: Mesh, backend: str) -> Group:
    """A second process group over the same ranks as `group` (and its siblings: every rank makes all of them, at
    the same point), e.g. for reductions beside the group's other collectives, or gloo for CPU objects."""
    kind = group.name if group.name in ("dp", "tp", "ep", "expert-dp") else "world"
    return _make_groups(group.name, mesh_groups(kind, mesh.dp, mesh.tp, mesh.ep), mesh.rank, backend, mesh.timeout_s,
                        world_is_default=False)


def rank_device(device: torch.device, mesh: Mesh) -> torch.device:
    """`cuda` becomes `cuda:LOCAL_RANK` (one GPU per process); other devices stay as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", mesh.local_rank)
    return device
