import errno
import gc
import random

import pytest
import torch

from angel_ptm.errors import BudgetError, ChecksumError, PageIOError
from angel_ptm.io import WRITE
from angel_ptm.memory import BeladyPolicy, BufferPool, DiskTier, PageManager, PageState, Tier
from angel_ptm.memory.page import RESTING_STATE
from angel_ptm.trace import TraceRecorder

PAGE = 64 * 1024


def make_manager(tmp_path, engine, device_pages=2, host_pages=2, disk_pages=128, policy=None, trace=None):
    return PageManager(
        BufferPool(Tier.DEVICE, PAGE, device_pages * PAGE),
        BufferPool(Tier.HOST, PAGE, host_pages * PAGE),
        DiskTier(str(tmp_path / "disk"), PAGE, disk_pages * PAGE, engine),
        policy=policy,
        trace=trace,
    )


def written_pages(manager, count):
    """`count` parameter pages, page i holding the value i, each written through an acquire on the device (the
    oldest ones pushed down the tiers as the device and host fill)."""
    pages = [manager.create_page("param", torch.float32) for _ in range(count)]
    for i, page in enumerate(pages):
        manager.acquire([page], Tier.DEVICE)
        page.view().fill_(i)
        manager.release([page], dirty=True)
    return pages


def random_page_data(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = PAGE // torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=dtype)


def assert_round_trip_is_bitwise_identical(manager, dtype, after_move=lambda page, tier: None):
    """A device page of random `dtype` data moved device -> host -> disk -> host -> device comes back bit for bit;
    `after_move(page, tier)` checks each stop."""
    page = manager.create_page("param", dtype, tier=Tier.DEVICE)
    expected = random_page_data(dtype, 0)
    page.view().copy_(expected)
    page.mark_dirty()
    for tier, state in [(Tier.HOST, PageState.HOST), (Tier.DISK, PageState.DISK),
                        (Tier.HOST, PageState.HOST), (Tier.DEVICE, PageState.DEVICE)]:
        manager.move(page, tier)
        assert page.state is state
        after_move(page, tier)
    assert torch.equal(page.view().cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_round_trip_through_every_tier_is_bitwise_identical(tmp_path, io_engine, dtype):
    manager = make_manager(tmp_path, io_engine)
    assert_round_trip_is_bitwise_identical(manager, dtype)
    assert manager.bytes_moved == {"device->host": PAGE, "host->disk": PAGE, "disk->host": PAGE, "host->device": PAGE}
    manager.close()


def test_clean_page_is_dropped_not_written_back(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine)
    page = manager.create_page("param", torch.float32)
    manager.move(page, Tier.DISK)
    manager.move(page, Tier.DEVICE)
    manager.move(page, Tier.DISK)  # unchanged since its write: dropped
    assert manager.bytes_moved["host->disk"] == PAGE
    assert manager.bytes_moved.get("device->host", 0) == 0
    manager.close()


def test_acquire_evicts_down_the_tiers_and_keeps_data(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine, device_pages=2, host_pages=3)
    pages = written_pages(manager, 10)
    for i, page in reversed(list(enumerate(pages))):
        manager.acquire([page], Tier.DEVICE)
        assert torch.all(page.view() == i)
        manager.release([page])
    states = [p.state for p in pages]
    assert states.count(PageState.DEVICE) == 2
    assert states.count(PageState.HOST) <= 3
    manager.close()


def test_64_disk_pages_are_read_concurrently(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine, device_pages=1, host_pages=64)
    pages = [manager.create_page("exp_avg", torch.float32) for _ in range(64)]
    for i, page in enumerate(pages):
        page.view().fill_(i)
        page.mark_dirty()
        manager.move(page, Tier.DISK)
    prefetch = manager.prefetch(pages, Tier.HOST)
    assert sum(p.state is PageState.FROM_DISK for p in pages) == 64  # all 64 reads in flight at once
    prefetch.wait()
    assert all(torch.all(p.view() == i) for i, p in enumerate(pages))
    manager.close()


def test_budget_error_names_the_tier_and_bytes(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine, device_pages=2)
    pages = [manager.create_page("param", torch.float32) for _ in range(3)]
    with pytest.raises(BudgetError, match=r"device tier budget exceeded for 3 pages pinned at once: "
                                          r"requested 192.0 KiB \(196608 bytes\), 128.0 KiB available"):
        manager.acquire(pages, Tier.DEVICE)
    assert all(p.pin_count == 0 for p in pages)
    manager.close()


def test_pool_larger_than_the_machine_is_refused_before_allocation():
    with pytest.raises(BudgetError, match=r"host tier budget exceeded .* requested [\d.]+ TiB \(\d+ bytes\), "
                                          r"[\d.]+ [KMGT]iB available"):
        BufferPool(Tier.HOST, PAGE, 1 << 60)


def test_disk_budget_is_enforced(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine, device_pages=1, host_pages=1, disk_pages=1)
    a, b = manager.create_page("param", torch.float32), manager.create_page("param", torch.float32)
    with pytest.raises(BudgetError, match="disk tier budget exceeded"):
        manager.create_page("param", torch.float32)
    assert {a.state, b.state} == {PageState.HOST, PageState.DISK}
    manager.close()


def test_flipped_bytes_in_a_slot_file_raise_checksum_error(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine)
    page = manager.create_page("master", torch.float32)
    page.view().fill_(1.5)
    page.mark_dirty()
    manager.move(page, Tier.DISK)
    path = manager.disk.path("master")
    with open(path, "r+b") as f:
        f.seek(page.disk_slot * PAGE + 100)
        byte = f.read(1)
        f.seek(page.disk_slot * PAGE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match=rf"checksum mismatch for page master:0 in {path}"):
        manager.acquire([page], Tier.HOST)
    assert page.state is PageState.DISK
    assert manager.in_use()["host"] == 0
    manager.close()


def test_failed_write_leaves_the_page_intact_on_host(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine)
    page = manager.create_page("param", torch.float32)
    page.view().fill_(3.0)
    page.mark_dirty()
    io_engine.inject_fault(WRITE, errno.EIO, 1)
    with pytest.raises(PageIOError, match="EIO"):
        manager.move(page, Tier.DISK)
    assert page.state is PageState.HOST
    assert torch.all(page.view() == 3.0)
    assert not page.clean_on_disk
    manager.move(page, Tier.DISK)  # a retry succeeds and the data survives
    manager.move(page, Tier.HOST)
    assert torch.all(page.view() == 3.0)
    manager.close()


def test_failed_read_leaves_the_page_on_disk(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine)
    page = manager.create_page("param", torch.float32)
    page.view().fill_(4.0)
    page.mark_dirty()
    manager.move(page, Tier.DISK)
    io_engine.inject_fault(0, errno.EIO, 1)
    with pytest.raises(PageIOError):
        manager.acquire([page], Tier.DEVICE)
    assert page.state is PageState.DISK and page.pin_count == 0
    manager.acquire([page], Tier.DEVICE)
    assert torch.all(page.view() == 4.0)
    manager.close()


def test_belady_policy_evicts_the_page_used_farthest_ahead(tmp_path, io_engine):
    sequence = [0, 1, 2, 0, 1, 2]
    manager = make_manager(tmp_path, io_engine, device_pages=2, host_pages=8, policy=BeladyPolicy(sequence))
    pages = [manager.create_page("param", torch.float32) for _ in range(3)]
    for pid in sequence[:3]:
        manager.acquire([pages[pid]], Tier.DEVICE)
        manager.release([pages[pid]])
    # Bringing page 2 in had to evict 0 or 1; 0 is needed next, so Belady evicted 1.
    assert pages[0].state is PageState.DEVICE and pages[1].state is PageState.HOST
    manager.close()


def test_trace_records_every_move_with_in_use(tmp_path, io_engine):
    import json

    trace = TraceRecorder(tmp_path / "trace.jsonl")
    manager = make_manager(tmp_path, io_engine, trace=trace)
    page = manager.create_page("param", torch.float32)
    page.mark_dirty()
    manager.move(page, Tier.DISK)
    manager.close()
    trace.close()
    events = [json.loads(line) for line in open(tmp_path / "trace.jsonl")]
    assert [e["event"] for e in events] == ["mark", "alloc", "move", "moved", "interval"]  # the start mark first
    moved, span = events[-2], events[-1]
    assert span["lane"] == "disk" and span["dur"] >= 0 and span["bytes"] == PAGE
    assert moved["page"] == "param:0" and moved["src"] == "host" and moved["dst"] == "disk"
    assert moved["bytes"] == PAGE and moved["in_use"] == {"device": 0, "host": 0, "disk": PAGE}
    assert all(e["t"] >= 0 for e in events)


def test_evict_moves_a_batch_down_two_tiers(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine, device_pages=4, host_pages=4)
    pages = [manager.create_page("grad", torch.float32, tier=Tier.DEVICE) for _ in range(4)]
    for i, page in enumerate(pages):
        page.view().fill_(i)
        page.mark_dirty()
    manager.evict(pages, Tier.DISK)
    assert all(p.state is PageState.DISK for p in pages)
    assert manager.in_use() == {"device": 0, "host": 0, "disk": 4 * PAGE}
    manager.acquire(pages, Tier.DEVICE)
    assert [float(p.view()[0]) for p in pages] == [0.0, 1.0, 2.0, 3.0]
    manager.close()


def test_pools_trade_slots_and_keep_their_capacity():
    device, host = BufferPool(Tier.DEVICE, PAGE, 2 * PAGE), BufferPool(Tier.HOST, PAGE, 3 * PAGE)
    assert device.can_trade(host)
    page_buffer = host.alloc()
    page_buffer.fill_(7)
    host.trade(page_buffer, device)  # the page's slot now counts on the device; the host got a free one back
    assert device.owns(page_buffer) and not host.owns(page_buffer)
    assert (device.free_slots, host.free_slots) == (1, 3)
    assert (device.used_bytes, host.used_bytes) == (PAGE, 0)
    assert int(page_buffer[0]) == 7  # nothing was copied or cleared
    taken = [host.alloc() for _ in range(3)]
    assert len({b.data_ptr() for b in taken} | {page_buffer.data_ptr()}) == 4  # no slot handed out twice
    with pytest.raises(ValueError, match="not a slot of the host pool"):
        host.free(page_buffer)
    device.free(page_buffer)
    assert device.free_slots == 2


def test_a_pool_without_free_slots_cannot_trade_and_nothing_changes():
    device, host = BufferPool(Tier.DEVICE, PAGE, PAGE), BufferPool(Tier.HOST, PAGE, PAGE)
    on_device, on_host = device.alloc(), host.alloc()
    with pytest.raises(BudgetError, match="device"):
        host.trade(on_host, device)
    assert host.owns(on_host) and device.owns(on_device) and (device.free_slots, host.free_slots) == (0, 0)
    host.free(on_host)
    with pytest.raises(ValueError, match="free, not in use"):
        host.trade(on_host, device)


def test_pinned_pools_do_not_trade():
    host = BufferPool(Tier.HOST, PAGE, PAGE)
    other = BufferPool(Tier.DEVICE, PAGE, PAGE)
    other.pinned = True  # as a CUDA run's pinned host pool: another kind of memory
    assert not host.can_trade(other)
    with pytest.raises(ValueError, match="cannot trade"):
        host.trade(host.alloc(), other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_zero_copy_moves_between_device_and_host_keep_the_bytes_in_place(tmp_path, io_engine, dtype):
    manager = PageManager(BufferPool(Tier.DEVICE, PAGE, 2 * PAGE), BufferPool(Tier.HOST, PAGE, 2 * PAGE),
                          DiskTier(str(tmp_path / "disk"), PAGE, 8 * PAGE, io_engine), zero_copy=True)
    assert manager.zero_copy
    page = manager.create_page("param", dtype, tier=Tier.DEVICE)
    expected = random_page_data(dtype, 1)
    page.view().copy_(expected)
    page.mark_dirty()
    address = page.buffer.data_ptr()
    manager.move(page, Tier.HOST)
    assert page.state is PageState.HOST and page.buffer.data_ptr() == address  # the same memory, now a host slot
    assert manager.pools[Tier.HOST].used_bytes == PAGE and manager.pools[Tier.DEVICE].used_bytes == 0
    for tier, state in [(Tier.DISK, PageState.DISK), (Tier.HOST, PageState.HOST), (Tier.DEVICE, PageState.DEVICE)]:
        manager.move(page, tier)
        assert page.state is state
    assert torch.equal(page.view().view(torch.uint8), expected.view(torch.uint8))
    assert manager.bytes_moved == {"device->host": PAGE, "host->disk": PAGE, "disk->host": PAGE, "host->device": PAGE}
    # The budgets hold: two device slots, a third page displaces one (by trade, to the host)
    others = [manager.create_page("param", dtype, tier=Tier.DEVICE) for _ in range(2)]
    assert manager.pools[Tier.DEVICE].free_slots == 0
    assert sum(p.tier is Tier.DEVICE for p in [page, *others]) == 2
    assert sum(p.tier is Tier.HOST for p in [page, *others]) == 1
    manager.close()


def test_a_page_created_on_disk_is_dead_writes_nothing_and_comes_back_as_zeros(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine, host_pages=1)
    garbage = manager.create_page("exp_avg", torch.float32)  # dirty a host slot, so a reused buffer is not zero
    garbage.view().fill_(7.0)
    manager.evict([garbage], Tier.DISK)
    page = manager.create_page("exp_avg", torch.float32, tier=Tier.DISK)
    assert page.state is PageState.DISK and page.dead and page.disk_slot is not None
    assert manager.in_use()["disk"] == 2 * PAGE  # it holds its home slot, like a page written there
    assert manager.bytes_moved["host->disk"] == PAGE  # only the garbage page's write
    manager.acquire([page], Tier.DEVICE)  # materialized: a cleared slot, nothing read
    assert torch.count_nonzero(page.view()) == 0 and not page.dead
    page.view().fill_(3.0)
    manager.release([page], dirty=True)
    manager.evict([page], Tier.DISK)  # now its data is real: written to its slot, read back intact
    manager.acquire([page], Tier.HOST)
    assert torch.all(page.view() == 3.0)
    manager.release([page])
    assert manager.bytes_moved.get("disk->host", 0) == PAGE  # the one real read
    manager.close()


def test_an_untouched_page_leaves_without_a_write_until_its_first_acquire(tmp_path, io_engine):
    manager = make_manager(tmp_path, io_engine)
    untouched = manager.create_page("exp_avg", torch.float32, untouched=True)
    plain = manager.create_page("exp_avg", torch.float32)  # the default: written however it was changed
    plain.view().fill_(5.0)  # written through a view, no acquire, no mark_dirty
    manager.evict([untouched, plain], Tier.DISK)
    assert untouched.dead and untouched.disk_slot is not None and not plain.dead
    assert manager.bytes_moved["host->disk"] == PAGE  # the plain page only
    manager.acquire([plain], Tier.HOST)
    assert torch.all(plain.view() == 5.0)
    manager.release([plain])

    used = manager.create_page("exp_avg", torch.float32, untouched=True)
    manager.acquire([used], Tier.HOST)  # from now on an ordinary page
    used.view().fill_(2.0)
    manager.release([used])  # even released clean, its first acquire made it an ordinary page: written
    manager.evict([used], Tier.DISK)
    assert not used.dead and manager.bytes_moved["host->disk"] == 2 * PAGE
    manager.acquire([used], Tier.HOST)
    assert torch.all(used.view() == 2.0)
    manager.release([used])
    manager.close()


class FakeCudart:
    """Stands in for torch.cuda.cudart(): records what is page-locked."""

    def __init__(self, error=0):
        self.error, self.registered, self.unregistered = error, [], []

    def cudaHostRegister(self, address, nbytes, flags):
        self.registered.append((address, nbytes))
        return self.error

    def cudaHostUnregister(self, address):
        self.unregistered.append(address)
        return 0


def test_a_pinned_host_pool_locks_exactly_its_bytes_until_it_is_collected(monkeypatch):
    # torch's pin_memory=True would round 3 pages up to 4: the pool registers its own slab instead.
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host = BufferPool(Tier.HOST, PAGE, 3 * PAGE, "cpu", pin=True)
    slots = [host.alloc() for _ in range(3)]
    assert cudart.registered == [(min(s.data_ptr() for s in slots), 3 * PAGE)]
    assert host.pinned and not host.can_trade(BufferPool(Tier.DEVICE, PAGE, PAGE))
    del host
    gc.collect()
    assert cudart.unregistered == [cudart.registered[0][0]]


def test_a_refused_page_lock_is_a_budget_error_naming_the_host_tier(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(error=2))  # cudaErrorMemoryAllocation
    with pytest.raises(BudgetError, match=r"host tier budget exceeded for page-locked \(pinned\) memory: "
                                          r"cudaHostRegister failed with CUDA error 2: "
                                          r"requested 192.0 KiB \(196608 bytes\)"):
        BufferPool(Tier.HOST, PAGE, 3 * PAGE, "cpu", pin=True)


def test_a_watched_pages_prefetch_moved_back_down_unused_counts_as_wasted(tmp_path, io_engine):
    """MoE experts' pages are watched: bytes brought up ahead of an access that then go back down with no access in
    between are wasted prefetches (memory_stats' expert_prefetch_wasted); a prefetch an access uses, and an
    on-demand fetch, are not."""
    manager = make_manager(tmp_path, io_engine, device_pages=2, host_pages=8)
    pages = written_pages(manager, 6)
    unused, used, on_demand = pages[:3]
    assert {p.state for p in (unused, used, on_demand)} == {PageState.HOST}
    manager.watched = frozenset(p.id for p in (unused, used, on_demand))

    def push_out_of_the_device():
        for page in pages[3:]:
            manager.acquire([page], Tier.DEVICE)
            manager.release([page])

    manager.move(unused, Tier.DEVICE)  # brought up ahead of use
    assert unused.state is PageState.DEVICE and manager.watched_wasted == 0
    push_out_of_the_device()
    assert unused.state is PageState.HOST and manager.watched_wasted == PAGE
    manager.move(used, Tier.DEVICE)
    manager.acquire([used], Tier.DEVICE)  # served: not wasted
    assert torch.all(used.view() == 1)
    manager.release([used])
    manager.acquire([on_demand], Tier.DEVICE)  # fetched for this access: not a prefetch
    manager.release([on_demand])
    push_out_of_the_device()
    assert used.state is on_demand.state is PageState.HOST
    assert manager.watched_wasted == PAGE
    manager.close()


def test_bringing_an_unpinned_page_up_never_evicts_it_to_make_its_own_room(tmp_path, io_engine):
    """Device and host full: the device slot for a host page comes from evicting a device page to the host, whose
    room comes from evicting a host page to disk -- never the page being brought up (a prefetch holds no pin)."""
    manager = make_manager(tmp_path, io_engine, device_pages=2, host_pages=2)
    pages = written_pages(manager, 6)
    first = pages[0]
    manager.move(first, Tier.HOST)
    manager.move(first, Tier.DEVICE)
    assert first.state is PageState.DEVICE
    manager.acquire([first], Tier.DEVICE)
    assert torch.all(first.view() == 0)
    manager.release([first])
    manager.close()


def test_the_eviction_candidates_index_matches_a_scan_of_every_page(tmp_path, io_engine):
    """The candidates of each tier (kept by the pages' watchers) are exactly the pages resting there unpinned,
    through creations, acquires, releases, prefetches, evictions and discards."""
    manager = make_manager(tmp_path, io_engine, device_pages=3, host_pages=4)

    def scanned(tier):
        return [p.id for p in manager.pages if p.state is RESTING_STATE[tier] and p.pin_count == 0]

    def check():
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
            assert sorted(manager._candidates(tier)) == scanned(tier), tier

    pages = written_pages(manager, 9)
    check()
    rng = random.Random(0)
    for _ in range(60):
        page = rng.choice(pages)
        action = rng.choice(["acquire-device", "acquire-host", "prefetch", "evict", "discard"])
        if action.startswith("acquire"):
            tier = Tier.DEVICE if action.endswith("device") else Tier.HOST
            manager.acquire([page], tier)
            check()
            manager.release([page], dirty=rng.random() < 0.5)
        elif action == "prefetch":
            manager.prefetch([page], Tier.DEVICE)
        elif action == "evict" and page.state in (PageState.DEVICE, PageState.HOST):
            manager.evict([page])
        elif action == "discard":
            manager.discard([page])
        manager.flush()
        check()


def test_a_guard_sees_each_page_once_before_its_bytes_can_change(tmp_path, io_engine):
    """PageManager.guard (an asynchronous checkpoint's copy-on-write): told of a guarded page at its first writing
    pin, move, eviction or drop, while the slot the page had still holds its bytes; once only; never after
    `unguard`, nor for a read-only pin or an unpin."""
    manager = make_manager(tmp_path, io_engine, device_pages=2, host_pages=3)
    pages = written_pages(manager, 10)
    in_memory = [p for p in pages if p.buffer is not None]
    assert {p.state for p in in_memory} == {PageState.DEVICE, PageState.HOST}
    slots = {p.id: p.buffer for p in in_memory}  # what a snapshot keeps: the slots as they were at the guard
    seen = []

    def before_change(page):
        seen.append((page.id, bool(torch.all(slots[page.id].view(torch.float32) == page.index))))

    manager.guard(in_memory[1:], before_change)
    manager.unguard([in_memory[-1].id])
    for page in in_memory:  # a pin to read, and unpins, change no byte: no one is told
        manager.acquire([page], page.state.tier, read_only=True)
        manager.release([page])
    assert not seen
    for page in reversed(pages):  # pins every page; those in memory are pushed down (and reused) by the others
        manager.acquire([page], Tier.DEVICE)
        page.view().fill_(-1.0)  # a write, after the pin
        manager.release([page], dirty=True)
    guarded = {p.id for p in in_memory[1:-1]}
    assert sorted(i for i, _ in seen) == sorted(guarded)  # each once; the unguarded ones never
    assert all(intact for _, intact in seen)
    manager.close()
