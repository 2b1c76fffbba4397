"""Paged MoE experts (each expert a paging unit of its own) against the scheduler: only routed experts come in and
no deviation is counted; a layer's experts run resident first and their accesses match the plan in any order;
a routing history holds the fetches of cold experts until their gate routes to them. The losses are torch's, or
those of the same job without the mechanism under test, bit for bit."""

from __future__ import annotations

import pytest
import torch

from test_moe import train_torch


def hash_moe_gpt():
    """A GPT-MoE of 16 experts routed by a hash of the token id (the paged-expert tests' model)."""
    from angel_ptm.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, dim=64,
                         moe={"experts": 16, "top_k": 1, "gate": "hash", "capacity_factor": 0}))


def zipf_batches(exponent: float, steps: int):
    """Batches of token ids drawn with Zipf weights (so the hash gate's routing is that skewed)."""
    g = torch.Generator().manual_seed(2)
    zipf = torch.tensor([1.0 / (i + 1) ** exponent for i in range(256)])
    return [(torch.multinomial(zipf, 4 * 32, True, generator=g).view(4, 32),
             torch.randint(0, 256, (4, 32), generator=g)) for _ in range(steps)]


def train_paged(engine, batches):
    """Train on `batches`: the losses, each step's scheduler stats and the memory stats at the end; the engine
    closed after."""
    losses, steps = [], []
    try:
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            steps.append(engine.scheduler.last_stats)
        return losses, steps, engine.memory_stats()
    finally:
        engine.close()


def paged_memory(disk_dir, **extra) -> dict:
    """A device budget far below the experts: most experts come up from the host when routed to."""
    return {"page_bytes": "16KiB", "disk_dir": str(disk_dir), "scheduler": "planned", "device_budget": "3MiB",
            "host_budget": "32MiB", **extra}


def test_paged_experts_bring_in_only_routed_experts_without_deviating_from_the_plan(tmp_path, monkeypatch):
    """Each expert is a paging unit of its own (inside its block's) and its pages are optional to the scheduler: with
    a skewed router (Zipf token ids, hash gate) and a device budget far below the experts, a step brings in only the
    experts it routes to, the planned scheduler never counts a deviation (a planned expert access that does not
    come, or an unplanned one, is expected of MoE routing), and the losses are torch's. Against the same job with the
    experts inside their blocks' units (every expert brought in whenever its block runs), far fewer bytes move."""
    import angel_ptm
    from angel_ptm.models.gpt import Block
    from test_engine_equivalence import engine_config

    batches = zipf_batches(2.0, 6)
    expected, _ = train_torch(hash_moe_gpt(), batches)

    def run(units):
        # (cancelling by the gate alone: the history has its own test)
        memory = paged_memory(tmp_path / str(units), expert_warm_threshold=0)
        losses, steps, stats = train_paged(angel_ptm.initialize(hash_moe_gpt(), engine_config(memory), units=units),
                                           batches)
        return (losses, [s.deviations for s in steps], sum(s.optional_skipped for s in steps), stats["moved"],
                dict(stats["expert_moved"], cancelled=sum(s.optional_cancelled for s in steps),
                     wasted=stats["expert_prefetch_wasted"],
                     replans=[(s.replanned, s.optional_unplanned) for s in steps]))

    losses, deviations, skipped, moved, experts = run(None)
    assert losses == pytest.approx(expected, rel=1e-6)
    assert deviations == [0] * len(batches)
    assert skipped > 0  # planned expert accesses the routing did not make
    # The plan holds every expert routed to in the steps it learned from (a superset): a step re-plans only when
    # its routing reaches an expert none of them did, never when it merely leaves some out
    replans = experts["replans"]
    assert all(replanned == (i == 0 or unplanned > 0) for i, (replanned, unplanned) in enumerate(replans)), replans
    assert sum(replanned for replanned, _ in replans) < len(batches)
    whole, _, _, moved_whole, _ = run([Block])  # experts inside their blocks' units
    assert whole == losses
    # (the superset's planned fetches of experts a step does not route to are cancelled once its gate has routed;
    # those issued before that come up unused: 0.62 here, 0.54 when every step re-planned from its own routing)
    assert moved["host->device"] < 0.7 * moved_whole["host->device"]
    assert 0 < experts["host->device"] <= moved["host->device"]  # the experts' share, counted apart
    # Once the gate has routed, the planned fetches of experts with no token are cancelled: against the same job
    # with cancelling turned off, fewer expert bytes come up and fewer prefetches are wasted, the same losses
    assert experts["cancelled"] > 0
    from angel_ptm.schedule.executor import Scheduler

    monkeypatch.setattr(Scheduler, "route", lambda self, unrouted, routed: None)
    uncancelled, deviations_uncancelled, _, _, kept = run(None)
    assert uncancelled == losses and deviations_uncancelled == [0] * len(batches) and kept["cancelled"] == 0
    assert experts["host->device"] < kept["host->device"]
    assert experts["wasted"] < kept["wasted"] <= kept["host->device"] + kept.get("disk->host", 0)


@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_paged_experts_run_resident_first_and_in_any_order_without_deviating(tmp_path, monkeypatch, checkpoint):
    """Each MoE layer orders its routed experts (units.resident_first): in the step that records the trace (no plan
    yet) those whose weights rest on the device first, then by how far their pages are; in planned steps the
    plan's order, which is the recorded one (no access out of the plan's order). And the scheduler matches a
    layer's expert accesses in any order within their run of the plan: with every layer running its experts in
    a random order, steps make accesses out of the plan's order (optional_reordered > 0) with no deviation, and re-plan
    only where routing reaches an expert the plan lacks, as in plan order; the losses are the same bit for bit
    (the layer's output does not depend on the order). With the blocks recomputed in backward, the recomputation
    runs the experts in its forward's order (recompute.same_in_recompute): torch's checkpoint matches the saved
    tensors by order."""
    import angel_ptm
    from angel_ptm import units
    from test_engine_equivalence import engine_config

    batches = zipf_batches(1.2, 6)
    readiness = units._READINESS
    first_step_orders = []
    resident_first = units.resident_first

    def logged(weight_pages, planned_order=None):
        order = resident_first(weight_pages, planned_order)

        def log(experts):
            ready = [max(readiness[p.state] for p in weight_pages[e]) for e in experts]
            got = order(experts)
            no_plan = planned_order(experts, [0] * len(weight_pages)) is None
            if no_plan and torch._C._current_graph_task_id() == -1:  # (not a recomputation: it replays)
                first_step_orders.append((got, dict(zip(experts, ready))))
            return got
        return log

    def run(name):
        memory = paged_memory(tmp_path / name)
        config = dict(engine_config(memory), activations={"checkpoint": checkpoint})
        losses, steps, _ = train_paged(angel_ptm.initialize(hash_moe_gpt(), config), batches)
        return losses, [(s.deviations, s.replanned, s.optional_unplanned, s.optional_reordered) for s in steps]

    def replans_only_to_learn(steps):
        return all(replanned == (i == 0 or unplanned > 0) for i, (_, replanned, unplanned, _) in enumerate(steps))

    monkeypatch.setattr(units, "resident_first", logged)
    losses, steps = run("resident-first")
    assert [d for d, *_ in steps] == [0] * len(batches) and replans_only_to_learn(steps), steps
    assert [reordered for *_, reordered in steps[1:]] == [0] * (len(batches) - 1)  # the plan's order
    assert first_step_orders
    for order, ready in first_step_orders:  # the recorded step: by readiness, then index
        assert order == sorted(ready, key=lambda e: (ready[e], e))

    import random

    shuffle = random.Random(0)  # every layer, every forward: another order

    def shuffled(experts):
        experts = list(experts)
        shuffle.shuffle(experts)
        return experts
    monkeypatch.setattr(units, "resident_first", lambda weight_pages, planned_order=None:
                        lambda experts: units.same_in_recompute(lambda: shuffled(experts)))
    shuffled_losses, steps = run("shuffled")
    assert [d for d, *_ in steps] == [0] * len(batches) and replans_only_to_learn(steps), steps
    assert sum(reordered for *_, reordered in steps[1:]) > 0, steps
    assert shuffled_losses == losses


def test_resident_first_orders_by_where_the_weights_are_unless_a_plan_says():
    """units.resident_first: with no plan, the experts whose pages rest on the device first, then on their way
    there, the host's, those coming from disk, the disk's -- an expert counts by its slowest page -- by index among
    equals; under a plan, the plan's order."""
    from types import SimpleNamespace

    from angel_ptm.memory.page import PageState
    from angel_ptm.units import resident_first

    ids = iter(range(100, 200))

    def pages(*states):
        return [SimpleNamespace(id=next(ids), state=getattr(PageState, s)) for s in states]

    weight_pages = [pages("DISK"), pages("DEVICE", "HOST"), pages("DEVICE"), pages("FROM_DISK"), pages("TO_DEVICE"),
                    pages("DEVICE", "DEVICE")]
    assert resident_first(weight_pages)([0, 1, 2, 3, 4, 5]) == [2, 5, 4, 1, 3, 0]
    assert resident_first(weight_pages)([0, 1, 3]) == [1, 3, 0]
    planned = resident_first(weight_pages, lambda experts, first: sorted(experts, key=lambda e: -first[e]))
    assert planned([0, 2, 5]) == [5, 2, 0]  # (here the "plan" orders by the first page's id, descending)
    unplanned = resident_first(weight_pages, lambda experts, first: None)
    assert unplanned([0, 1, 2]) == [2, 1, 0]


def test_cold_experts_wait_for_their_gate_and_the_losses_do_not_change(tmp_path):
    """memory.expert_warm_threshold: with Zipf-skewed token ids (hash gate: some experts are routed to in few
    steps) the routing history finds cold experts; their planned fetches are held until their gate routes to them
    (some are: resumed) or dropped. Against the same job fetching every planned expert ahead (threshold 0): fewer
    prefetches come up unused, no deviation, the same losses bit for bit."""
    import angel_ptm
    from test_engine_equivalence import engine_config

    batches = zipf_batches(2.0, 14)

    def run(threshold):
        memory = paged_memory(tmp_path / str(threshold), expert_warm_threshold=threshold)
        losses, steps, stats = train_paged(angel_ptm.initialize(hash_moe_gpt(), engine_config(memory)), batches)
        return (losses, [s.experts_cold for s in steps], sum(s.optional_resumed for s in steps),
                sum(s.deviations for s in steps), stats["expert_prefetch_wasted"])

    losses, cold, resumed, deviations, wasted = run(0.5)
    ahead, cold_ahead, resumed_ahead, deviations_ahead, wasted_ahead = run(0.0)
    assert losses == ahead
    assert deviations == deviations_ahead == 0
    assert cold[0] == 0 and max(cold) > 0 and cold_ahead == [0] * len(batches)
    assert resumed > 0 and resumed_ahead == 0
    assert wasted < wasted_ahead


class _TopOneMoE(torch.nn.Module):
    """An MoE layer written without angel_ptm: a linear gate, an experts list, top-1 by argmax."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.gate = torch.nn.Linear(dim, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x):
        choice, out = self.gate(x).argmax(-1), torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out = out.index_put((mask,), expert(x[mask]))
        return out


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 64)
        self.layers = torch.nn.ModuleList(_TopOneMoE(64, 4) for _ in range(2))
        self.out = torch.nn.Linear(64, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return ((self.out(h) - y) ** 2).mean()


@pytest.mark.parametrize("page_kib", [4, 20])
def test_an_moe_layer_written_elsewhere_trains_like_torch_with_its_experts_paged(tmp_path, page_kib):
    """A module with a `gate` and an `experts` list that is not ours: its experts are paging units with optional
    pages (only the ones it runs come in), its gate's output is left alone (not our Routing: no routing hook
    reads it), the routing history learns from the accesses, and the losses are torch.optim.AdamW's. With pages
    that the experts' sizes do not divide (20 KiB) each expert is still on pages of its own (layout.py), so no
    step deviates from the plan."""
    import angel_ptm
    from test_engine_equivalence import assert_same_losses, engine_config, run_steps

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(6)]
    torch.manual_seed(0)
    plain = _Net()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    expected = []
    for x, y in batches:
        loss = plain(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    torch.manual_seed(0)
    engine = angel_ptm.initialize(_Net(), engine_config(paged_memory(tmp_path, page_bytes=f"{page_kib}KiB",
                                                                     device_budget=f"{24 * page_kib}KiB")))
    try:
        assert engine.scheduler.optional_pages and engine.scheduler.history is not None
        names = {id(p): n for n, p in engine.model.named_parameters()}
        expert_pages = {page.id for layer in engine.model.layers for p in layer.experts.parameters()
                        for i in engine.layout.slot(names[id(p)]).pages for page in [engine.pages["param"][i]]}
        assert expert_pages <= engine.scheduler.optional_pages  # every page an expert's tensors are on
        losses, deviations = [], []
        for batch in batches:
            losses += run_steps(engine, [batch], lambda m, x, y: m(x, y))
            deviations.append(engine.scheduler.last_stats.deviations)
        assert deviations == [0] * len(batches)
    finally:
        engine.close()
    assert_same_losses(expected, losses)
