"""The executor's non-blocking hops (memory/hops.py), on a PageManager of the manager tests."""

from angel_ptm.memory import BeladyPolicy, Tier
from angel_ptm.memory.moves import Hop
from test_manager import make_manager, written_pages


def test_a_hop_to_a_full_tier_says_whether_an_eviction_will_free_a_slot(tmp_path, io_engine):
    """try_hop with a need: FULL (no eviction started) when every page on the full tier is used sooner, BLOCKED
    once it started evicting the one used after the need, STARTED when a slot is free."""
    policy = BeladyPolicy()
    manager = make_manager(tmp_path, io_engine, device_pages=2, host_pages=4, policy=policy)
    a, b, c = written_pages(manager, 3)  # a on the host, b and c on the device
    assert (a.tier, b.tier, c.tier) == (Tier.HOST, Tier.DEVICE, Tier.DEVICE)
    policy.set_future([b.id, c.id, a.id, b.id])  # b at 0 and 3, c at 1, a at 2
    assert manager.try_hop(a, Tier.DEVICE, need=2) is Hop.FULL  # b and c are both needed before a's use at 2...
    assert (b.tier, c.tier) == (Tier.DEVICE, Tier.DEVICE) and not manager.moves_in_flight
    policy.seek(2)  # ...but from position 2 on, c is never used again
    assert manager.try_hop(a, Tier.DEVICE, need=2) in (Hop.BLOCKED, Hop.STARTED)
    assert c.tier is not Tier.DEVICE or manager.moving(c)
    manager.poll()
    while manager.try_hop(a, Tier.DEVICE, need=2) is not Hop.STARTED:
        manager.poll()
    manager.poll()
    assert a.tier is Tier.DEVICE and b.tier is Tier.DEVICE


def test_a_host_access_to_pages_on_the_device_needs_no_host_slot(tmp_path, io_engine):
    """A host tier of no slots (every page fits the device) still serves host accesses from the device copies;
    a page that would need a host slot is refused with the numbers."""
    import pytest
    import torch

    from angel_ptm.errors import BudgetError

    manager = make_manager(tmp_path, io_engine, device_pages=3, host_pages=0)
    pages = [manager.create_page("param", torch.float32, tier=Tier.DEVICE) for _ in range(3)]
    manager.acquire(pages, Tier.HOST)
    manager.release(pages, dirty=True)
    assert all(p.tier is Tier.DEVICE for p in pages)
    spilled = manager.create_page("param", torch.float32, tier=Tier.DISK)
    with pytest.raises(BudgetError, match="host tier budget exceeded for 1 pages pinned at once"):
        manager.acquire([spilled], Tier.HOST)
