"""Optimizers that update pages where they live."""

from angel_ptm.optim.paged_adamw import PagedAdamW

__all__ = ["PagedAdamW"]
