"""The page manager with no disk tier below the host (memory.disk_dir unset)."""

import pytest
import torch

from angel_ptm.errors import BudgetError
from angel_ptm.memory import BufferPool, PageManager, Tier

PAGE = 64 * 1024


def test_creating_a_page_on_disk_without_a_disk_tier_is_a_budget_error():
    manager = PageManager(BufferPool(Tier.DEVICE, PAGE, PAGE), BufferPool(Tier.HOST, PAGE, PAGE), None)
    with pytest.raises(BudgetError, match="exp_avg:0"):
        manager.create_page("exp_avg", torch.float32, index=0, tier=Tier.DISK)
    manager.close()


def test_without_a_disk_tier_a_full_host_makes_room_by_moving_a_resting_page_up_to_a_free_device_slot():
    """No disk tier: a host that must make room while full of resting pages (Adam moments where the update runs, a
    reduced gradient landing beside them under ZeRO-1/2) moves one up into a free device slot, its bytes intact,
    instead of failing to evict it down (device and host together hold every page). With the device full too it
    is still a BudgetError."""
    manager = PageManager(BufferPool(Tier.DEVICE, PAGE, 2 * PAGE), BufferPool(Tier.HOST, PAGE, 2 * PAGE), None)
    pages = []
    for i in range(4):  # the third and fourth find the host full: a resting page goes up each time
        pages.append(manager.create_page("exp_avg", torch.float32, tier=Tier.HOST))
        manager.acquire([pages[-1]], Tier.HOST)
        pages[-1].view().fill_(i + 1)
        manager.release([pages[-1]], dirty=True)
    assert sorted(p.state.name for p in pages) == ["DEVICE", "DEVICE", "HOST", "HOST"]
    assert [float(p.view()[0]) for p in pages] == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(BudgetError, match="no disk tier"):
        manager.create_page("exp_avg", torch.float32, tier=Tier.HOST)
    manager.close()
