"""ZeRO's page logic at 8 ranks, cheaply: torch's threaded process group (one thread per rank, one process), real
page managers, no engine. Ownership, the gradient reduction, the norm and the stage-3 gatherer."""

import math
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from angel_ptm.memory import BufferPool, PageManager, Tier, build_layout
from angel_ptm.parallel.collectives import Collectives
from angel_ptm.parallel.mesh import Mesh
from angel_ptm.parallel.ownership import Ownership
from angel_ptm.parallel.grad_sync import GradSync
from angel_ptm.parallel.zero import ParamGatherer
from angel_ptm.schedule import Scheduler

WORLD = 8
PAGE = 4096  # 1024 fp32 elements


def model():
    torch.manual_seed(0)  # 3 tensors over 12 pages, padded to 16: two groups of 8
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 63, bias=False))


def run_threaded(fn, world=WORLD):
    """fn(rank) in `world` threads over torch's threaded process group; every rank's return value."""
    mtpg = pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")
    mtpg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # each thread its own group registry
    store, results, errors = dist.HashStore(), [None] * world, []

    def main(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001
            errors.append((rank, exc))
            raise

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        mtpg._uninstall_threaded_pg()
    assert not errors, errors
    return results


def setup(rank, stage):
    layout = build_layout(model(), PAGE, dp_world_size=WORLD)
    own = Ownership(rank, WORLD, stage)
    manager = PageManager(BufferPool(Tier.DEVICE, PAGE, 64 * PAGE), BufferPool(Tier.HOST, PAGE, 64 * PAGE))
    pages = {"grad": [manager.create_page("grad", torch.float32, index=i) for i in range(layout.n_pages)]}
    pages["param"] = [manager.create_page("param", torch.float32, index=i) if own.local("param", i) else
                      manager.create_remote_page("param", torch.float32, i, own.home(i))
                      for i in range(layout.n_pages)]
    comm = Collectives(Mesh(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD, dp=WORLD,
                            backend="threaded"))
    return layout, own, manager, pages, comm


def rank_gradient(rank, index):
    """Rank `rank`'s gradient page `index`: distinct small integers, so every sum is exact."""
    return torch.arange(PAGE // 4, dtype=torch.float32) % 7 + rank * 10 + index


def test_every_page_of_every_kind_has_exactly_one_owner_at_8_ranks():
    layout = build_layout(model(), PAGE, dp_world_size=WORLD)
    assert layout.n_pages % WORLD == 0
    for stage, sharded in ((1, ("exp_avg", "master")), (3, ("exp_avg", "param"))):
        for kind in sharded:
            holders = [[r for r in range(WORLD) if Ownership(r, WORLD, stage).local(kind, i)]
                       for i in range(layout.n_pages)]
            assert holders == [[i % WORLD] for i in range(layout.n_pages)]
    assert sum(Ownership(r, WORLD, 3).remote_count(layout.n_pages) for r in range(WORLD)) == \
        layout.n_pages * (WORLD - 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_expert_page_has_one_owner_among_the_ranks_holding_the_same_experts_at_8_ranks(stage):
    """ep 2 on 8 ranks: 4 ranks hold each set of experts. Their optimizer states (stage >= 1) live on one of the 4
    each, which alone updates the page, and at stage 3 their weights too (REMOTE on the other 3, gathered by the
    MoE layer: zero.ExpertGatherer); their gradients stay on all 4."""
    local, holders = (8, 24), 4  # the rank-local pages (whole page groups of the 8 ranks)
    owns = [Ownership(r, WORLD, stage, local, local_dp=holders, local_rank=r // 2) for r in range(WORLD)]
    for i in range(*local):
        group = [o for r, o in enumerate(owns) if r % 2 == 0]  # the ranks at place 0 of each ep group
        for kind in ("exp_avg", "exp_avg_sq", "master"):
            keep = [o.local_rank for o in group if o.local(kind, i)]
            assert keep == ([(i - 8) % holders] if stage else [0, 1, 2, 3]), (kind, i, keep)
        assert [o.local_rank for o in group if o.updated(i)] == keep
        assert all(o.local("grad", i) for o in group)
        params = [o.local_rank for o in group if o.local("param", i)]
        assert params == (keep if stage == 3 else [0, 1, 2, 3])
        assert [o.local_rank for o in group if o.remote("param", i)] == [r for r in range(4) if r not in params]
    assert owns[0].local_count("exp_avg", 24) == (8 // WORLD if stage else 8) + (16 // holders if stage else 16)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_reduction_leaves_each_owner_the_mean_gradient_at_8_ranks(stage):
    def rank_main(rank):
        layout, own, manager, pages, comm = setup(rank, stage)
        for i, page in enumerate(pages["grad"]):
            manager.acquire([page], Tier.HOST)
            page.view(torch.float32).copy_(rank_gradient(rank, i))
            manager.release([page], dirty=True)
        GradSync(manager, layout, pages, comm, own, Tier.HOST).reduce(without_grad=set())
        out = {}
        for i in range(layout.trainable_pages):
            if not layout.tensors_on(i):
                continue  # padding of the last group: no tensor, nothing to reduce
            if own.owns(i):
                out[i] = pages["grad"][i].view(torch.float32).clone()
            else:  # another rank's gradient: dropped, never written back
                assert pages["grad"][i].dead
        return out

    results = run_threaded(rank_main)
    for rank, owned in enumerate(results):
        for i, value in owned.items():
            expected = sum(rank_gradient(r, i) for r in range(WORLD)) / WORLD
            assert torch.equal(value, expected), (rank, i)


def test_the_norm_of_pages_summed_on_8_ranks_equals_one_process_exactly():
    squares = {i: float(rank_gradient(3, i).double().square().sum()) / (i + 1) for i in range(16)}

    def rank_main(rank):
        layout, own, manager, pages, comm = setup(rank, 2)
        mine = {i: v for i, v in squares.items() if own.owns(i) and i < layout.trainable_pages}
        return GradSync(manager, layout, pages, comm, own, Tier.HOST).grad_norm(mine)

    layout = build_layout(model(), PAGE, dp_world_size=WORLD)
    expected = math.sqrt(math.fsum(v for i, v in squares.items() if i < layout.trainable_pages))
    assert run_threaded(rank_main) == [expected] * WORLD


def test_the_stage_3_gatherer_fills_every_page_with_its_owners_values_and_follows_the_recording():
    accesses = [[0, 1, 2], [9, 10], [3], [12, 13, 14, 15], [0, 9]]  # page indices, as units would acquire them

    def rank_main(rank):
        layout, own, manager, pages, comm = setup(rank, 3)
        for i, page in enumerate(pages["param"]):
            if page.home is None:
                manager.acquire([page], Tier.HOST)
                page.view(torch.float32).fill_(100 * i + rank)
                manager.release([page], dirty=True)
        gatherer = ParamGatherer(manager, pages["param"], comm, own, capacity=1, access=Scheduler(manager))
        seen, gathers = [], []
        for step in range(3):
            before = gatherer.gathers
            for access in accesses:
                wanted = [pages["param"][i] for i in access]
                gatherer.acquire(wanted, Tier.DEVICE, label=f"fwd:{access}")
                seen.append([float(p.view(torch.float32)[0]) for p in wanted])
                gatherer.release(wanted)
            gathers.append(gatherer.gathers - before)
            gatherer.clear()
        return seen, gathers, gatherer.prefetched

    results = run_threaded(rank_main)
    for seen, gathers, prefetched in results:
        # every page holds its owner's value (100 i + owner), on every rank, every time
        expected = [[100 * i + i % WORLD for i in access] for access in accesses] * 3
        assert seen == expected
        assert gathers == results[0][1] and prefetched == results[0][2]  # the same collectives on every rank
    assert results[0][2] > 0  # steps after the first gathered ahead


def test_ranks_that_issued_different_collectives_of_one_size_all_raise_at_the_next_check():
    from angel_ptm.errors import CollectiveError

    def rank_main(rank):
        _, _, _, _, comm = setup(rank, 3)
        page = torch.zeros(4)
        outputs = [torch.zeros(4) for _ in range(WORLD)]
        comm.all_gather(outputs, page, "param group 1")
        comm.all_gather(outputs, page, f"param group {2 if rank != 5 else 3}")  # rank 5 went its own way
        comm.verify_sequence("step 1")  # what a good step looks like is checked too: this one is not
        return None

    def checked(rank):
        try:
            rank_main(rank)
        except CollectiveError as exc:
            return str(exc)
        return "no error"

    messages = run_threaded(checked)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank} of 8: ranks [5] issued other collectives than rank 0 before step 1")


def test_ranks_that_issued_the_same_collectives_pass_the_check_and_start_a_new_count():
    def rank_main(rank):
        _, _, _, _, comm = setup(rank, 3)
        page, outputs = torch.zeros(4), [torch.zeros(4) for _ in range(WORLD)]
        for step in range(2):
            comm.all_gather(outputs, page, f"param group {step}")
            comm.verify_sequence(f"step {step}")
        return comm.calls

    assert run_threaded(rank_main) == [4] * WORLD


@pytest.mark.parametrize("kind", ["ep", "expert-dp"])
def test_a_second_group_like_an_expert_group_spans_the_same_ranks_at_8_ranks(kind):
    """new_groups_like (reductions on a process group of their own, NCCL's way; gloo for checkpoint planning) of an
    expert-parallel or expert-dp group at 8 ranks, ep 2: the same ranks, and a sum over it adds theirs only (it
    made a world group before, and an expert replica's reduce-scatter failed on a list of its size)."""
    from angel_ptm.parallel.mesh import _make_groups, mesh_groups, new_groups_like

    def rank_main(rank):
        mesh = Mesh(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD, dp=WORLD, ep=2,
                    backend="threaded")
        groups = {name: _make_groups(name, mesh_groups(name, WORLD, 1, 2), rank, "threaded", 60)
                  for name in ("ep", "expert-dp")}
        group = groups[kind]
        like = new_groups_like(group, mesh, "threaded")
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=like.pg)
        return like.ranks, group.ranks, float(value)

    for rank, (like, ranks, total) in enumerate(run_threaded(rank_main)):
        assert like == ranks and rank in ranks and total == sum(ranks)
        assert len(ranks) == (2 if kind == "ep" else WORLD // 2)


def test_closing_after_an_error_this_rank_could_have_retried_fails_the_engine_so_close_uses_no_collective(
        monkeypatch):
    """A forward that raised before this rank's first collective of the step may be retried; closing the engine
    instead (what `angel-ptm train` does on an error) leaves the peers waiting on this step's collectives. The
    engine then fails, so close reads no weights with collectives: it used to, waited parallel.timeout_s for peers
    that were elsewhere, and replaced the rank's own error with a CollectiveError blaming a peer."""
    import angel_ptm.failure as failure_module

    marked = []
    monkeypatch.setattr(failure_module, "mark_out_of_step", marked.append)  # (this process's group untouched)
    failure = failure_module.Failure()
    failure.distributed = True
    with pytest.raises(RuntimeError):  # nothing issued in the step yet: an error a retry may follow
        with failure.in_step("forward"):
            raise RuntimeError("a hook of this rank's model")
    assert failure.reason is None  # a retry may follow
    failure.closing()
    assert failure.reason.startswith("closed in step 1 after RuntimeError in this rank's forward")
    assert marked == [failure.reason]  # and the process group is not used again
    alone = failure_module.Failure()  # one rank: nothing waits on it
    alone._raised_in_step = "RuntimeError in this rank's forward"
    alone.closing()
    assert alone.reason is None


def test_a_models_collectives_under_an_activation_watch_count_what_the_caller_keeps_not_what_the_backend_holds(
        monkeypatch):
    """A checkpointed unit counts the storages its ops made that are still alive at its end (recompute._Outputs).
    gloo's worker thread keeps what a collective was handed a moment after the wait returns, so a tensor-parallel
    unit's count took the collective's buffers at random (a flaky estimate test: 1-3 buffers more in 1 of ~10
    runs). Here the backend keeps everything it is handed for good, and the count is still only the caller's."""
    from torch.utils._pytree import tree_leaves

    from angel_ptm.activations.recompute import _Outputs

    held = []  # the backend's references, never dropped
    for name in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all_single"):
        def keeping(*args, _real=getattr(dist, name), **kwargs):
            held.append([t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
            return _real(*args, **kwargs)
        monkeypatch.setattr(dist, name, keeping)

    def rank_main(rank):
        comm = Collectives(Mesh(rank=rank, world_size=2, local_rank=rank, local_world_size=2, dp=2,
                                backend="threaded"))
        x = torch.full((4, 8), float(rank + 1))
        watch = _Outputs()
        with watch:
            y = x * 2  # 128 bytes the caller keeps
            parts = [torch.empty_like(y) for _ in range(2)]
            comm.all_gather_list(parts, y, "test")
            gathered = torch.cat(parts)  # 256
            del parts
            out = torch.empty(4, 8)  # 128
            comm.reduce_scatter_list(out, [c.contiguous() for c in gathered.chunk(2)], "test")
            comm.all_reduce(out, "test")
            moved = torch.empty(8, 8)  # 256
            comm.all_to_all(moved, gathered, [4, 4], [4, 4], "test")
        kept = watch.alive_bytes(())
        return kept, gathered.sum().item(), out.sum().item(), moved.sum().item()

    results = run_threaded(rank_main, world=2)
    assert all(kept == 128 + 256 + 128 + 256 for kept, *_ in results), results
    # (the results landed: y is 2s on rank 0 and 4s on rank 1)
    assert [r[1:] for r in results] == [(192.0, 384.0, 128.0), (192.0, 384.0, 256.0)]
    assert held  # the backend was handed tensors, and keeps them


def test_at_exit_the_waiter_threads_are_stopped_and_joined_before_the_interpreter_finalizes(monkeypatch):
    """A waiter thread still inside a collective's wait while the interpreter finalizes (a peer died; the wait
    returned its error just as this rank exited on the same error) was ended mid-call: std::terminate through
    pybind11's GIL guard, SIGABRT instead of exit status 1 (seen under gdb, ~1 run in 8 at 4 ranks). The exit hook
    stops the waiters and joins them once their waits return (the process group, destroyed first, ends them)."""
    from angel_ptm.parallel import collectives as module
    from angel_ptm.parallel.collectives import Pending

    monkeypatch.setattr(module, "_WAITERS", [])  # (this process's other waiters untouched)
    gone = threading.Event()

    class Work:  # a collective the process group's destruction ends
        def wait(self):
            gone.wait(30)

        def is_completed(self):
            return gone.is_set()

    comm = Collectives(Mesh())
    pending = Pending(comm, [Work()], "test", background=True, channel="reductions")
    waiter = module._WAITERS[-1][0]
    assert waiter.is_alive() and not pending.done()
    threading.Timer(0.2, gone.set).start()  # the process group destroyed by mesh's exit hook, which runs first
    module._join_waiters_at_exit()
    assert not waiter.is_alive() and pending.done() and not module._WAITERS


def test_a_peer_gone_while_the_checkpoint_planning_group_is_made_is_a_collective_error(monkeypatch):
    """The gloo group checkpoint saves plan over is made at the first save: a peer that died then left this rank
    torch's untyped DistStoreError after the store's timeout, and an engine that went on to close with collectives
    (probe b2). Now it is this rank's CollectiveError, and the collectives are failed (close issues none)."""
    from angel_ptm.errors import CollectiveError
    from angel_ptm.parallel import collectives as module

    def store_timeout(*args, **kwargs):
        raise dist.DistStoreError("wait timeout after 10000ms, keys: /default_pg/0//1//cpu//0/1")

    monkeypatch.setattr(module, "new_groups_like", store_timeout)
    monkeypatch.setattr(module, "mark_out_of_step", lambda reason: None)  # (this process's group untouched)
    failures = []
    comm = Collectives(Mesh(), on_failure=failures.append)
    with pytest.raises(CollectiveError, match=r"new_group \(a gloo group for checkpoint planning\) failed after .* "
                                              r"a peer rank died.*wait timeout after 10000ms"):
        comm.side_group()
    assert comm.failed is not None and failures == [comm.failed]


class _Binder:
    """What ParamGatherer.follow_units reads of the engine's binder."""

    def __init__(self, units, unit_pages):
        self.units, self.unit_pages = units, unit_pages
        self.in_backward, self.hooks_on = False, True

    def release_node_pins(self):
        pass


def test_reads_inside_a_units_backward_that_differ_by_rank_issue_the_same_collectives_on_every_rank():
    """Stage 3, 4 ranks, room for fewer groups than the model has: each unit's groups are gathered when backward
    reaches it (enter_backward), then rank r reads only one of the unit's two layers (r's parity): an MoE expert
    routed on some ranks only. Every rank issues the same collectives (the sequence check passes every step), every
    read sees the owners' values, groups dropped after the forward are gathered again, and later steps prefetch."""
    from angel_ptm.units import PagingUnit

    world = 4
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 3 units of 2 layers, about 8 pages each

    def rank_main(rank):
        layout = build_layout(net, PAGE, dp_world_size=world)
        own = Ownership(rank, world, 3)
        manager = PageManager(BufferPool(Tier.DEVICE, PAGE, 64 * PAGE), BufferPool(Tier.HOST, PAGE, 64 * PAGE))
        pages = [manager.create_page("param", torch.float32, index=i) if own.local("param", i) else
                 manager.create_remote_page("param", torch.float32, i, own.home(i)) for i in range(layout.n_pages)]
        for i, page in enumerate(pages):
            if page.home is None:
                manager.acquire([page], Tier.HOST)
                page.view(torch.float32).fill_(100 * i + rank)
                manager.release([page], dirty=True)
        comm = Collectives(Mesh(rank=rank, world_size=world, local_rank=rank, local_world_size=world, dp=world,
                                backend="threaded"))
        layer_pages = [sorted({p for name in (f"{k}.weight", f"{k}.bias") for p in layout.slot(name).pages})
                       for k in range(6)]
        units = [PagingUnit(net[2 * u], f"unit{u}") for u in range(3)]
        binder = _Binder(units, {id(u): [pages[i] for i in layer_pages[2 * k] + layer_pages[2 * k + 1]]
                                 for k, u in enumerate(units)})
        n_groups = layout.n_pages // world
        gatherer = ParamGatherer(manager, pages, comm, own, capacity=3, access=Scheduler(manager))
        gatherer.follow_units(binder)
        seen, gathers, most_held = [], [], 0
        for _ in range(3):
            before = gatherer.gathers
            for unit in units:  # forward: every rank reads the whole unit
                gatherer.acquire(binder.unit_pages[id(unit)], Tier.DEVICE)
                gatherer.release(binder.unit_pages[id(unit)])
            binder.in_backward = True
            for k in reversed(range(3)):
                gatherer.enter_backward(units[k])
                if k == 1:  # a unit called twice in forward: its backward is entered twice
                    gatherer.enter_backward(units[k])
                most_held = max(most_held, len(gatherer.held))
                mine = [pages[i] for i in layer_pages[2 * k + rank % 2]]  # this rank's own reads
                gatherer.acquire(mine, Tier.DEVICE, label="bwd")
                seen.append([float(p.view(torch.float32)[0]) for p in mine])
                gatherer.release(mine)
            binder.in_backward = False
            gatherer.end_backward()
            comm.verify_sequence("the step's gathers")  # a CollectiveError on every rank if any differed
            gathers.append(gatherer.gathers - before)
            gatherer.clear()
        gatherer.close()
        return seen, gathers, gatherer.prefetched, n_groups, gatherer.recorded, most_held

    results = run_threaded(rank_main, world=world)
    for rank, (seen, gathers, prefetched, n_groups, recorded, most_held) in enumerate(results):
        layout = build_layout(net, PAGE, dp_world_size=world)
        mine = [sorted({p for name in (f"{k}.weight", f"{k}.bias") for p in layout.slot(name).pages})
                for k in range(6)]
        expected = [[100 * i + i % world for i in mine[2 * k + rank % 2]] for k in reversed(range(3))] * 3
        assert seen == expected
        assert gathers == results[0][1] and prefetched == results[0][2]
        assert recorded == results[0][4] and len(recorded) == 7  # the units' accesses only, not the rank's reads
        assert most_held <= 4  # capacity 3, or one unit's groups (3 or 4) with the next one's prefetched: no pin leaks
        assert gathers[0] > n_groups  # groups dropped after the forward were gathered again for backward
    assert results[0][2] > 0


def test_an_accesss_missing_groups_are_all_issued_before_any_is_waited_on():
    """On demand (nothing prefetched: the first step), the gathers of one access overlap: issued together, then
    landed, not issue-wait-issue-wait."""
    def rank_main(rank):
        layout, own, manager, pages, comm = setup(rank, 3)
        log = []
        gather = comm.all_gather

        def logged(outputs, tensor, what, async_op=False):
            handle = gather(outputs, tensor, what, async_op=async_op)
            log.append(f"issue {what}")
            wait = handle.wait
            handle.wait = lambda: (wait(), log.append(f"wait {what}"))[0]
            return handle
        comm.all_gather = logged
        gatherer = ParamGatherer(manager, pages["param"], comm, own, capacity=2, access=Scheduler(manager))
        both = [pages["param"][0], pages["param"][WORLD]]  # one page of each of the two groups
        gatherer.acquire(both, Tier.DEVICE, label="fwd")
        gatherer.release(both)
        return log

    for log in run_threaded(rank_main):
        assert log == ["issue param group 0", "issue param group 1", "wait param group 0", "wait param group 1"]
