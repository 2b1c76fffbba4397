"""The process group and the data-parallel mesh, from torchrun's environment.

    mesh = init_mesh(config.parallel, device_type="cpu")   # world of 1 without torchrun: no process group
    mesh.rank, mesh.dp, mesh.local_rank

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set) the default process group is
initialized here unless the user's script already did: NCCL for CUDA tensors, gloo on CPU, with
`parallel.timeout_s` as the collectives' timeout. A plain `python` run is a world of one and never touches
torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from angel_ptm.errors import DistributedError


@dataclass(frozen=True)
class Mesh:
    """Where this process stands: its rank in the world and on its node, and the data-parallel degree."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    dp: int = 1
    timeout_s: float = 300.0
    backend: str | None = None  # None: a world of one, no process group

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

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


def init_mesh(parallel, device_type: str = "cpu") -> Mesh:
    """The mesh of this process; initializes the default process group from the environment when a launcher
    (torchrun) started several processes and nobody initialized it yet. Idempotent."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    else:
        world = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        backend = None
        if world > 1:
            if not dist.is_available():
                raise DistributedError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
            backend = "nccl" if device_type == "cuda" else "gloo"
            try:
                dist.init_process_group(backend, timeout=timedelta(seconds=parallel.timeout_s))
            except (RuntimeError, ValueError) as exc:
                raise DistributedError(f"rank {rank}: cannot set up the {backend} process group of {world} ranks "
                                       f"(MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
                                       f"MASTER_PORT={os.environ.get('MASTER_PORT')}): {exc}") from None
    local_world = _env_int("LOCAL_WORLD_SIZE", 1 if world == 1 else world)
    local_rank = _env_int("LOCAL_RANK", rank % max(1, local_world))
    dp = parallel.dp if parallel.dp is not None else world
    if world % dp:
        raise DistributedError(f"parallel.dp: {dp} does not divide the world size {world}")
    if dp != world:
        raise DistributedError(f"parallel.dp: {dp} ranks of data parallelism in a world of {world}: the other "
                               f"{world // dp}-way factor needs tensor parallelism, which this version does not "
                               f"have; set parallel.dp to {world} (or null)")
    return Mesh(rank, world, local_rank, local_world, dp, parallel.timeout_s, backend)


def rank_device(device: torch.device, mesh: Mesh) -> torch.device:
    """`cuda` becomes `cuda:LOCAL_RANK` (one GPU per process); other devices stay as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", mesh.local_rank)
    return device
