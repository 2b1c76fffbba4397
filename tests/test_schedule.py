"""The unified scheduler: plans for hand-built traces, Belady against LRU on recorded traces, deviations."""

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import ScheduleError
from angel_ptm.memory import Tier
from angel_ptm.schedule import Access, StepTrace, plan_step
from angel_ptm.schedule.planner import order_updates

from test_engine_equivalence import (CASES, PLACEMENTS, assert_same_losses, gpt, gpt_batches, regression_batches,
                                     train_plain)

D, H, K = Tier.DEVICE, Tier.HOST, Tier.DISK
PAGE = 4096


def ops(plan):
    return [[str(op) for op in after] for after in plan.ops_after]


def test_plan_of_a_four_layer_forward_is_belady_issued_early():
    # Four pages read in turn, a device of 2 slots and a host of 2, all clean on disk at first. In the steady
    # state the plan makes Belady's (MIN's) moves: page 3 stays on the device, the others rotate through the
    # second slot; a clean page leaving the device goes to a free host slot, else it is dropped (no write). Each
    # group of moves is issued right after the last use of the page it evicts, one access ahead of need.
    trace = StepTrace([Access(f"fwd:layer{i}", (i,), D) for i in range(4)])
    plan = plan_step(trace, {i: K for i in range(4)}, {D: 2, H: 2}, PAGE)
    assert ops(plan) == [
        ["evict(0 device->host)", "fetch(1 host->device)"],
        ["fetch(2 disk->host)", "evict(1 device->disk)", "fetch(2 host->device)"],
        [],
        ["evict(3 device->host)", "fetch(0 host->device)"],
    ]
    assert [op.serves for op in plan.ops_after[3] if op.kind == "fetch"] == [4]  # the next step's first access
    assert plan.demand == []
    assert dict(plan.moved_bytes) == {"device->host": PAGE, "host->device": 2 * PAGE, "disk->host": PAGE}


def test_plan_keeps_a_written_page_off_the_disk_while_a_clean_one_can_be_dropped():
    # One device slot and two host slots for three pages; page 0 is written (a gradient) at access 0. The dirty
    # page moves between device and host; clean pages are dropped (no write) when the host is full.
    trace = StepTrace([Access("grad:w", (0,), D, writes={0}), Access("fwd:x", (1,), D), Access("fwd:y", (2,), D)])
    plan = plan_step(trace, {0: D, 1: K, 2: K}, {D: 1, H: 2}, PAGE, dirty=[0])
    assert ops(plan) == [
        ["fetch(1 disk->host)", "evict(2 host->disk)", "evict(0 device->host)", "fetch(1 host->device)"],
        ["fetch(2 disk->host)", "evict(1 device->disk)", "fetch(2 host->device)"],
        ["evict(2 device->host)", "fetch(0 host->device)"],
    ]
    assert dict(plan.moved_bytes) == {"disk->host": 2 * PAGE, "host->device": 3 * PAGE, "device->host": 2 * PAGE}
    assert "host->disk" not in plan.moved_bytes  # only clean pages left the host: dropped, not written
    assert plan.grad_final_after == [[0], [], []] and plan.update_order == [0]


def test_a_dead_page_is_created_where_it_is_needed_not_read():
    # Page 0 (a gradient) is discarded after access 1 (its update); access 2 writes it again from scratch.
    trace = StepTrace([Access("fwd:a", (1,), D), Access("opt:update", (0, 1), H, discards={0}),
                       Access("grad:a", (0,), D, writes={0})])
    plan = plan_step(trace, {0: K, 1: K}, {D: 2, H: 2}, PAGE)
    assert [str(op) for op in plan.demand] == ["fetch(0 disk->device)"]  # created zeroed when the gradient lands
    assert plan.total_moved_bytes == 0  # never read from or written to disk


def test_lookahead_bounds_how_far_ahead_moves_are_issued_not_which_moves():
    sweep = list(range(6)) + list(range(5, -1, -1))  # a forward then a backward over six layers
    trace = StepTrace([Access(f"layer{i}", (p,), D) for i, p in enumerate(sweep)])
    far = plan_step(trace, {i: K for i in range(6)}, {D: 3, H: 2}, PAGE)
    near = plan_step(trace, {i: K for i in range(6)}, {D: 3, H: 2}, PAGE, lookahead=2)
    assert max(op.serves - op.at for op in far.ops if op.kind == "fetch") == 3
    assert max(op.serves - op.at for op in near.ops if op.kind == "fetch") == 2
    assert near.moved_bytes == far.moved_bytes and near.demand == far.demand == []


def test_a_group_goes_ahead_of_a_blocked_earlier_one_but_only_within_the_reorder_window(monkeypatch):
    # Host of 2 slots. Access 11 brings page 2 in place of page 1, which is busy until access 10; access 12 brings
    # page 3 in place of page 0, idle since access 0. In order, page 3's read waits behind page 2's group; within
    # the window it starts right after page 0's last use, and never further ahead of its use than the window.
    import angel_ptm.schedule.planner as planner

    seq = [0] + [1] * 10 + [2, 3, 2, 0, 1]
    trace = StepTrace([Access(f"a{t}", (p,), H) for t, p in enumerate(seq)])

    def issued_after(window):
        monkeypatch.setattr(planner, "REORDER_WINDOW", window)
        plan = plan_step(trace, {i: K for i in range(4)}, {D: 0, H: 2}, PAGE, reserve={D: 0, H: 0})
        assert plan.demand == [] and dict(plan.moved_bytes) == {"disk->host": 4 * PAGE}
        return {str(op): op.at for op in plan.ops if op.serves in (11, 12)}

    in_order = {"evict(1 host->disk)": 10, "fetch(2 disk->host)": 10, "evict(0 host->disk)": 10,
                "fetch(3 disk->host)": 10}
    assert issued_after(0) == in_order
    assert issued_after(32) == {**in_order, "evict(0 host->disk)": 0, "fetch(3 disk->host)": 0}
    assert issued_after(5) == {**in_order, "evict(0 host->disk)": 7, "fetch(3 disk->host)": 7}


def assert_no_eviction_before_a_use(plan):
    """No planned eviction sends its page down while an access before the one it serves still takes or holds it
    (the executor would skip it as needed sooner, and the step would part from the plan's residency)."""
    n = len(plan.trace)
    for op in plan.ops:
        if op.kind == "evict":
            users = [t for t in range(op.at + 1, op.serves)
                     if op.page in plan.trace[t % n].pages or op.page in plan.trace[t % n].held]
            assert not users, f"{op} issued after access {op.at}, but accesses {users} still use its page"


def test_a_group_on_a_borrowed_slot_sends_its_victim_down_only_after_its_last_use():
    # A host of 3 slots, one kept as a prefetch buffer. Access 7 brings page 2 in place of page 1, used until
    # access 6: the read may start earlier on the borrowed slot, but page 1 leaves only after access 6.
    seq = [1, 0, 0, 0, 0, 0, 1, 2, 0, 1]
    trace = StepTrace([Access(f"a{t}", (p,), H) for t, p in enumerate(seq)])
    plan = plan_step(trace, {i: K for i in range(3)}, {D: 0, H: 3}, PAGE, reserve={D: 0, H: 1}, dirty=[0, 1, 2])
    evictions = {(op.page, op.serves): op.at for op in plan.ops if op.kind == "evict"}
    assert evictions == {(1, 7): 6, (2, 9): 7}
    assert_no_eviction_before_a_use(plan)


def test_updates_follow_the_order_gradients_become_final():
    # Backward writes the gradient of page 12 first, then 11, then 10: the optimizer updates them in that order.
    accesses = [Access("fwd:a", (0,), D), Access("fwd:b", (1,), D), Access("fwd:c", (2,), D),
                Access("grad:c", (12,), D, writes={12}), Access("grad:b", (11,), D, writes={11}),
                Access("grad:a", (10,), D, writes={10}),
                Access("opt:update", (0, 10), H), Access("opt:update", (1, 11), H), Access("opt:update", (2, 12), H)]
    ordered = order_updates(StepTrace(accesses))
    assert [a.pages for a in ordered.accesses[6:]] == [(2, 12), (1, 11), (0, 10)]
    plan = plan_step(StepTrace(accesses), {p: H for p in (0, 1, 2, 10, 11, 12)}, {D: 8, H: 8}, PAGE)
    assert plan.update_order == [12, 11, 10]


def test_an_access_pinning_more_than_the_tier_holds_is_refused():
    trace = StepTrace([Access("fwd:big", (0, 1, 2), D)])
    with pytest.raises(ScheduleError, match="no room to bring page 2 to the device tier .*device 2 slots"):
        plan_step(trace, {0: K, 1: K, 2: K}, {D: 2, H: 4}, PAGE)


# ---------------------------------------------------------------------------------------------------- recorded
def recorded_trace(model_fn, batches, loss_fn, memory):
    config = {"optimizer": {"lr": 1e-2}, "memory": memory, "trainer": {"device": "cpu"}}
    engine = angel_ptm.initialize(model_fn(), config)
    try:
        for batch in batches[:2]:
            loss = loss_fn(engine, *batch)
            engine.backward(loss)
            engine.step()
        manager = engine.manager
        residency = {p.id: p.tier or Tier.HOST for p in manager.pages}
        dirty = [p.id for p in manager.pages if not p.clean_on_disk]
        capacity = {t: manager.pools[t].capacity for t in (D, H)}
        return engine.scheduler.last_trace, residency, dirty, capacity
    finally:
        engine.close()


# The device holds the largest unit (a GPT block with the root's pages: 21 of 4 KiB), the host stages it.
BUDGETS = {"gpt": [("96KiB", "96KiB"), ("112KiB", "112KiB"), ("128KiB", "160KiB"), ("96KiB", "4MiB")],
           # the MLP and the tied autoencoder: 20-28 state pages, units of at most 5 pages
           "small": [("24KiB", "24KiB"), ("28KiB", "28KiB"), ("24KiB", "40KiB"), ("24KiB", "4MiB")]}


@pytest.mark.parametrize("case", list(CASES))
def test_belady_plan_never_moves_more_bytes_than_lru_on_recorded_traces(case, tmp_path):
    model_fn, batches_fn, loss_fn = CASES[case]
    lru_bytes = []
    for device_budget, host_budget in BUDGETS["gpt" if case == "gpt" else "small"]:
        memory = {"page_bytes": "4KiB", "device_budget": device_budget, "host_budget": host_budget,
                  "disk_dir": str(tmp_path), "scheduler": "on_demand"}
        trace, residency, dirty, capacity = recorded_trace(model_fn, batches_fn(), loss_fn, memory)
        assert len(trace) >= 8 and {a.phase for a in trace.accesses} >= {"fwd", "grad", "opt"}
        has_disk = any(t is K for t in residency.values()) or sum(capacity.values()) < len(residency)
        belady = plan_step(trace, residency, capacity, PAGE, dirty=dirty, has_disk=has_disk)
        lru = plan_step(trace, residency, capacity, PAGE, dirty=dirty, has_disk=has_disk, policy="lru")
        no_prefetch = plan_step(trace, residency, capacity, PAGE, dirty=dirty, has_disk=has_disk, prefetch=False)
        assert belady.total_moved_bytes <= lru.total_moved_bytes, (device_budget, host_budget)
        assert_no_eviction_before_a_use(belady)
        assert no_prefetch.total_moved_bytes <= lru.total_moved_bytes
        assert lru.ops == []  # LRU cannot look ahead: everything it moves, it moves on demand
        lru_bytes.append(lru.total_moved_bytes)
    assert max(lru_bytes) > 0  # the budgets are tight enough that pages move


# ---------------------------------------------------------------------------------------------------- engine
class Branchy(nn.Module):
    """Data-dependent control flow: the branch taken depends on the batch, so steps differ from the trace."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(24, 48)
        self.left = nn.Linear(48, 48)
        self.right = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48))
        self.out = nn.Linear(48, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = self.left(h) if float(x[0, 0]) > 0 else self.right(h)
        return self.out(h)


def branchy_loss(model, x):
    return (model(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()


@pytest.mark.parametrize("placement", ["device+host", "device+host+disk"])
def test_data_dependent_branches_train_like_torch_and_count_deviations(placement, tmp_path):
    batches = regression_batches(24)
    assert len({float(b[0][0, 0]) > 0 for b in batches}) == 2  # both branches are taken
    expected = train_plain(Branchy(), batches, branchy_loss)
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler="planned")
    config = {"optimizer": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
              "memory": memory, "trainer": {"device": "cpu", "grad_clip": 0}}
    engine = angel_ptm.initialize(Branchy(), config)
    losses, deviations, replans = [], 0, 0
    try:
        for (x,) in batches:
            loss = branchy_loss(engine, x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            stats = engine.memory_stats()["schedule"]
            deviations += stats["deviations"]
            replans += stats["replanned"]
    finally:
        engine.close()
    assert_same_losses(expected, losses)
    assert deviations > 0 and replans > 1  # each branch switch deviates and the plan is rebuilt


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_planned_steps_follow_the_plan(placement, tmp_path):
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler="planned")
    config = {"optimizer": {"lr": 1e-2}, "memory": memory, "trainer": {"device": "cpu", "grad_clip": 0}}
    engine = angel_ptm.initialize(gpt(), config)
    per_step = []
    try:
        for x, y in gpt_batches()[:6]:
            engine.backward(engine(x, y))
            engine.step()
            per_step.append(engine.memory_stats()["schedule"])
    finally:
        engine.close()
    assert per_step[0]["replanned"] and per_step[0]["issued"] == 0  # warm-up: record, then plan
    for stats in per_step[1:]:
        assert stats["deviations"] == 0 and not stats["replanned"]
        assert stats["accesses"] == per_step[0]["accesses"]
    if placement != "device":
        assert sum(s["issued"] for s in per_step[1:]) > 0  # pages moved ahead of need


def test_evaluation_passes_do_not_disturb_the_plan(tmp_path):
    memory = dict(PLACEMENTS["device+host+disk"], disk_dir=str(tmp_path), scheduler="planned")
    config = {"optimizer": {"lr": 1e-2}, "memory": memory, "trainer": {"device": "cpu"}}
    engine = angel_ptm.initialize(gpt(), config)
    try:
        for i, (x, y) in enumerate(gpt_batches()[:5]):
            engine.backward(engine(x, y))
            engine.step()
            if i >= 1:
                assert engine.memory_stats()["schedule"]["deviations"] == 0
            engine.eval()
            with torch.no_grad():
                engine(x, y)
            engine.train()
    finally:
        engine.close()


def test_trainer_logs_stall_moves_and_deviations_per_step(tmp_path):
    import json

    from angel_ptm.config import load_config
    from angel_ptm.trainer import Trainer

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    config = load_config({
        "model": {"dim": 32, "n_layer": 2, "n_head": 2, "seq_len": 16},
        "data": {"path": str(tmp_path), "batch_size": 4, "val_fraction": 0.1},
        "memory": {"page_bytes": "4KiB", "device_budget": "112KiB", "host_budget": "112KiB", "scheduler": "planned"},
        "trainer": {"steps": 4, "eval_every": 0, "grad_clip": 0, "device": "cpu"},
        "run": {"dir": str(tmp_path / "run")},
    })
    Trainer(config, progress=False).run()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert len(steps) == 4
    assert all(line["stall_s"] >= 0 and line["deviations"] == 0 for line in steps[1:])
    assert steps[0]["replanned"] and sum(line["planned_moves"] for line in steps[1:]) > 0
    assert all(line["moved"]["disk->host"] > 0 for line in steps)
    events = [json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").read_text().splitlines()]
    lanes = {e["lane"] for e in events if e["event"] == "interval"}
    assert {"compute", "disk", "copy"} <= lanes
    assert any(e["event"] == "mark" and e.get("name") == "plan" for e in events)


def test_merging_optional_accesses_keeps_every_expert_in_an_order_both_steps_keep():
    """An MoE step's trace and the trace its plan was made from, which differ only in optional accesses (experts
    routed to in one and not the other): the union, in order; other accesses that differ give None."""
    from angel_ptm.schedule.trace import Access, StepTrace, merge_optional

    def trace(*labels):
        return StepTrace([Access(label, (int(label[1:]),), Tier.DEVICE) for label in labels])

    def optional(access):
        return access.label.startswith("e")

    learned = trace("a1", "e11", "e13", "a2", "e12", "a3")
    new = trace("a1", "e12", "e13", "e14", "a2", "a3")
    merged = merge_optional(learned, new, optional)
    assert [a.label for a in merged.accesses] == ["a1", "e11", "e12", "e13", "e14", "a2", "e12", "a3"]
    assert merged.accesses[0] is new.accesses[0]  # the accesses both make: the new step's
    assert merge_optional(learned, trace("a1", "e11", "a4", "a3"), optional) is None
    assert merge_optional(learned, trace("a1", "a2"), optional) is None


def test_a_run_of_optional_accesses_is_matched_in_any_order():
    """schedule/runs.py: the plan's runs of consecutive optional accesses (a layer's experts); an access of the run
    under way is found wherever it lies in it, each position once; the first position still to come is the lowest
    one not made nor skipped (an expert routed nothing), else the cursor; the counts of a step."""
    from angel_ptm.schedule.runs import OptionalRuns

    keys = [((0,), "d"), ((10,), "d"), ((11,), "d"), ((12,), "d"), ((1,), "d"), ((13,), "d"), ((14,), "d")]
    runs = OptionalRuns(keys, lambda ids: all(i >= 10 for i in ids))
    assert runs.start_of == [-1, 1, 1, 1, -1, 5, 5] and runs.end_of == {1: 4, 5: 7} and runs.total == 5
    assert runs.find([2]) is None  # no run under way yet: the scheduler's own search places the first access
    runs.made(0, 0)
    runs.made(3, 1)  # the layer runs expert 12 first: the cursor goes to 4
    assert runs.find([2]) == 2 and runs.find([3]) is None  # 12 is made; 11 still to come
    assert runs.low(4, skip=lambda p: False) == 1  # 10 has not run: the plan's "now" stays there
    assert runs.low(4, skip=lambda p: p == 1) == 2  # 10 routed nothing: 11 is the first still to come
    runs.made(2, 4)
    assert runs.low(4, skip=lambda p: p == 1) == 4  # every routed expert ran: the cursor
    runs.made(4, 4)  # the next access, not optional: no run under way
    assert runs.find([5, 6]) is None and runs.low(5, skip=lambda p: False) == 5
    runs.made(6, 5)
    runs.made(5, 7)
    assert (runs.matched, runs.reordered) == (4, 2)
    runs.begin_step()
    assert (runs.matched, runs.reordered, runs.start) == (0, 0, -1)


def test_the_routing_history_finds_the_experts_its_gates_rarely_route_to():
    """schedule/predictor.py: per optional page, the moving average over steps of "its expert was routed to"
    (starting at 1: every expert warm); below the threshold a page is cold, and one routing makes it warm again
    where the average climbs back over the threshold."""
    from angel_ptm.schedule.predictor import RoutingHistory

    history = RoutingHistory(ema=0.5, threshold=0.3)
    pages = [1, 2, 3]
    history.routed([1, 2])
    history.end_step(pages)
    assert history.average == {1: 1.0, 2: 1.0, 3: 0.5} and history.cold == frozenset()
    history.routed([1])
    history.end_step(pages)
    assert history.average == {1: 1.0, 2: 0.5, 3: 0.25} and history.cold == {3}
    history.routed([3])
    history.end_step(pages)
    assert history.average[3] == 0.625 and history.cold == {2}  # (2 went unrouted twice)
    with pytest.raises(ValueError):
        RoutingHistory(ema=1.0)


def test_planned_reads_leave_a_host_slot_for_the_device_pages_an_update_displaces(tmp_path):
    """bf16 with clipping at the estimate's tightest host: the plan's disk reads of an update group's pages used to
    fill the host, leaving no slot for the device pages the group displaces (BudgetError in step 2)."""
    from angel_ptm.models import GPT, GPTConfig

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, dim=32))

    job = {"optimizer": {"lr": 1e-3}, "trainer": {"device": "cpu", "dtype": "bfloat16", "grad_clip": 1.0},
           "memory": {"page_bytes": "64KiB", "device_budget": "320KiB", "host_budget": "256KiB",
                      "disk_dir": str(tmp_path), "scheduler": "planned"}}
    engine = angel_ptm.initialize(model(), job)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(4):
            x, y = (torch.randint(0, 256, (4, 32), generator=g) for _ in range(2))
            engine.backward(engine(x, y))
            engine.clip_grad_norm(1.0)
            engine.step()
        assert engine.scheduler.plan is not None
    finally:
        engine.close()


def test_a_page_the_plan_keeps_in_place_but_found_on_disk_is_read_back_ahead_of_its_access(tmp_path):
    # Every page fits on the host, so the plan moves nothing. Page 3 is then sent to disk behind the plan's back
    # (as an evaluation pass or an on-demand eviction may): the next step reads it back a few accesses ahead of
    # its use instead of on demand when it is touched.
    from angel_ptm.io import create_engine
    from angel_ptm.memory import BufferPool, DiskTier, PageManager
    from angel_ptm.schedule import Scheduler

    engine = create_engine()
    manager = PageManager(BufferPool(D, PAGE, PAGE), BufferPool(H, PAGE, 8 * PAGE),
                          DiskTier(str(tmp_path / "disk"), PAGE, 16 * PAGE, engine))
    pages = [manager.create_page("param", torch.float32) for _ in range(4)]
    for i, page in enumerate(pages):
        page.view().fill_(i)
        page.mark_dirty()
    scheduler = Scheduler(manager)
    order = [0, 1, 2, 0, 1, 3, 2, 3]

    def step(watch=None):
        seen = []
        for j, p in enumerate(order):
            scheduler.acquire([pages[p]], H, label=f"fwd:{j}")
            scheduler.release([pages[p]])
            if watch is not None:
                seen.append(watch.state.name)
        return scheduler.end_step(), seen

    try:
        step()  # recorded, then planned
        assert scheduler.plan is not None and scheduler.plan.ops == []
        assert step()[0].repair_reads == 0
        manager.move(pages[3], K)
        stats, seen = step(watch=pages[3])
        assert stats.repair_reads == 1 and stats.deviations == 0
        assert seen[0] in ("FROM_DISK", "HOST")  # its read started right after the step's first access
        assert float(pages[3].view()[0]) == 3.0
        assert step()[0].repair_reads == 0  # back where the plan has it
    finally:
        manager.close()
        engine.close()


def test_a_planned_eviction_of_a_page_still_held_waits_for_its_release_instead_of_being_dropped(tmp_path):
    # The plan sends a page down right after its last access, and the executor's pump runs while that access
    # still holds it: the eviction is retried on the next pump, once the page is released.
    from angel_ptm.io import create_engine
    from angel_ptm.memory import BufferPool, DiskTier, PageManager
    from angel_ptm.schedule import Executor, Op

    engine = create_engine()
    manager = PageManager(BufferPool(D, PAGE, PAGE), BufferPool(H, PAGE, 4 * PAGE),
                          DiskTier(str(tmp_path / "disk"), PAGE, 16 * PAGE, engine))
    try:
        page = manager.create_page("param", torch.float32)
        page.mark_dirty()
        executor = Executor(manager)
        manager.acquire([page], H)
        executor.submit([Op("evict", page.id, H, K, 0, 1)])
        executor.pump(now=1)
        assert page.state.name == "HOST" and len(executor.moves) == 1  # held: kept, not dropped
        manager.release([page], dirty=True)
        executor.pump(now=1)
        manager.poll()
        assert page.state.name in ("TO_DISK", "DISK") and executor.moves == []
    finally:
        manager.close()
        engine.close()


def test_an_access_whose_planned_moves_fail_after_its_pages_were_pinned_gives_the_pins_back(tmp_path, monkeypatch):
    """A planned move issued after an access pinned its pages can fail (a full disk, an I/O error); the caller never
    got the pages, so the scheduler unpins them before the error goes on (they were left pinned: closing the engine
    then failed on them, hiding the disk error)."""
    from angel_ptm.errors import DiskFullError
    from angel_ptm.memory import BufferPool, PageManager
    from angel_ptm.schedule import Scheduler

    manager = PageManager(BufferPool(D, PAGE, 2 * PAGE), BufferPool(H, PAGE, 2 * PAGE), None)
    pages = [manager.create_page("param", torch.float32) for _ in range(2)]
    scheduler = Scheduler(manager)

    def full(*args):
        raise DiskFullError("write of 4096 bytes failed (ENOSPC)", 28, "slots")

    monkeypatch.setattr(scheduler, "_after_acquire", full)
    with pytest.raises(DiskFullError):
        scheduler.acquire(pages, D, label="fwd:0")
    assert [p.pin_count for p in pages] == [0, 0]
    manager.close()
