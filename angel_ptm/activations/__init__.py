"""Activations in the memory hierarchy: recomputation per paging unit (recompute.py) and saved tensors held in
activation pages that the scheduler moves like any page (offload.py). The binder applies both from outside the
model (binding.py); the estimate counts them (estimate.py, models/gpt.py)."""

from angel_ptm.activations.offload import KIND, ActivationPages, PackedActivation
from angel_ptm.activations.recompute import Recomputation

__all__ = ["KIND", "ActivationPages", "PackedActivation", "Recomputation"]
