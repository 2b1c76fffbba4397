"""Slot fences: an eviction's copy gives the device slot back as soon as it is queued, and the slot's next user comes
after that copy (on CUDA on the GPU, tested in test_cuda.py; here with the CPU copy thread, where the host waits).

The copy thread is held on a gate, so the copy is still queued when the slot is reused: were the fence missing, the
new page's zeros would land in the slot before the copy read it, and the evicted page would come back as zeros.
"""

import threading

import pytest
import torch

from angel_ptm.memory import BufferPool, DiskTier, PageManager, PageState, Tier

PAGE = 64 * 1024


@pytest.fixture
def manager(tmp_path, io_engine):
    """One device slot, two host slots, copies between them on the copy thread."""
    manager = PageManager(BufferPool(Tier.DEVICE, PAGE, PAGE), BufferPool(Tier.HOST, PAGE, 2 * PAGE),
                          DiskTier(str(tmp_path / "disk"), PAGE, 16 * PAGE, io_engine), async_copies=True)
    yield manager
    manager.close()


def hold_copies(manager) -> threading.Event:
    """Block the manager's copy thread until the returned gate is set (by a timer, so a wait on the host ends)."""
    gate = threading.Event()
    manager.copier._pool.submit(gate.wait)
    threading.Timer(0.3, gate.set).start()
    return gate


def device_page(manager, value: float):
    page = manager.create_page("param", torch.float32, tier=Tier.DEVICE)
    page.view().fill_(value)
    page.mark_dirty()
    return page


def test_an_evicted_pages_device_slot_is_free_at_once_and_reused_only_after_its_copy(manager):
    evicted = device_page(manager, 7.0)
    gate = hold_copies(manager)
    manager.try_hop(evicted, Tier.HOST)
    assert evicted.state is PageState.TO_HOST and not gate.is_set()
    assert manager.pools[Tier.DEVICE].free_slots == 1 and manager.leaving(Tier.DEVICE) == 0
    fresh = manager.create_page("param", torch.float32, tier=Tier.DEVICE)  # zeroes the slot: after the copy
    assert gate.is_set()
    assert torch.all(fresh.view() == 0)
    manager.flush([evicted])
    assert evicted.state is PageState.HOST and torch.all(evicted.view() == 7.0)
    manager.acquire([evicted], Tier.DEVICE)  # displaces `fresh` the same way, and comes back whole
    assert torch.all(evicted.view() == 7.0)
    manager.release([evicted])


def test_a_copy_up_into_a_fenced_slot_comes_after_the_copy_that_freed_it(manager):
    incoming = device_page(manager, 3.0)
    manager.move(incoming, Tier.HOST)
    leaving = device_page(manager, 5.0)
    hold_copies(manager)
    manager.try_hop(leaving, Tier.HOST)  # its copy queued, its slot free
    manager.acquire([incoming], Tier.DEVICE)  # a copy into that slot (inline: the page is pinned): after it
    assert torch.all(incoming.view() == 3.0)
    manager.release([incoming])
    manager.flush([leaving])
    assert torch.all(leaving.view() == 5.0)


def test_a_guarded_page_keeps_its_device_slot_until_its_copy_lands(manager):
    """An asynchronous checkpoint may read a guarded page's slot until it changes: that slot is not given back early."""
    page = device_page(manager, 2.0)
    seen = []
    manager.guard([page], lambda p: (seen.append(p.state), manager.guard([p], lambda q: None)))
    gate = hold_copies(manager)
    manager.try_hop(page, Tier.HOST)
    assert seen == [PageState.TO_HOST] and manager.pools[Tier.DEVICE].free_slots == 0
    assert manager.leaving(Tier.DEVICE) == 1
    gate.set()
    manager.flush([page])
    assert manager.pools[Tier.DEVICE].free_slots == 1 and torch.all(page.view() == 2.0)
