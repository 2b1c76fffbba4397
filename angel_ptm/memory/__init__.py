"""Pages and the tiers they live on: layout, pools, residency manager and eviction policies."""

from angel_ptm.memory.device import Copier, compute_device
from angel_ptm.memory.layout import PageLayout, Segment, TensorSlot, build_layout, first_use_order, largest_module
from angel_ptm.memory.manager import PageManager, Prefetch
from angel_ptm.memory.page import TRANSITIONS, Page, PageState, Tier
from angel_ptm.memory.store import PageKind, PageStore
from angel_ptm.memory.policy import BeladyPolicy, LRUPolicy, Policy, count_misses
from angel_ptm.memory.tiers import BufferPool, DiskTier

__all__ = [
    "Copier", "compute_device", "PageLayout", "Segment", "TensorSlot", "build_layout", "first_use_order", "largest_module",
    "PageManager", "Prefetch", "TRANSITIONS", "Page", "PageState", "Tier", "BeladyPolicy", "LRUPolicy", "Policy",
    "count_misses", "BufferPool", "DiskTier", "PageKind", "PageStore",
]
