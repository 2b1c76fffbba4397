"""Data parallelism: the mesh from torchrun's environment, collectives with typed errors, and ZeRO over page groups
(ownership.py: who holds which page; zero.py: ZeRO-3 gathers and OSDP; grad_sync.py: reductions, the norm and
publication; data_parallel.py: the engine's side of a step)."""

from angel_ptm.parallel.mesh import Mesh, init_mesh, rank_device
from angel_ptm.parallel.ownership import Ownership

__all__ = ["Mesh", "Ownership", "init_mesh", "rank_device"]
