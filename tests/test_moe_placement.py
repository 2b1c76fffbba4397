"""Load-driven expert placement's decisions (angel_ptm/parallel/moe/placement.py), without processes: the greedy
swaps at 8 ranks, hot-expert replicas, the balance ratio, the cost model, and the config's refusals; a replica
placement the layer refuses, and the binder's gradients added from elsewhere. The moves themselves, and that they
change no loss, are tested over gloo in tests/test_moe_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st

from angel_ptm.config import load_config
from angel_ptm.errors import ConfigValueError
from angel_ptm.parallel.moe.placement import balance_ratio, decide, plan_replicas, plan_swaps, rank_loads

RANKS, LOCAL = 8, 4
EXPERTS = RANKS * LOCAL
FIRST = [list(range(r * LOCAL, (r + 1) * LOCAL)) for r in range(RANKS)]  # where apply_expert_parallel puts them


def zipf(n: int, s: float = 1.2) -> list[float]:
    return [1000.0 / (i + 1) ** s for i in range(n)]


def test_swaps_at_8_ranks_lower_the_busiest_ranks_load_and_keep_every_expert_once():
    loads = zipf(EXPERTS, 0.7)  # experts 0-3, all on rank 0, take the most tokens
    before = balance_ratio(loads, FIRST)
    slots, swaps = plan_swaps(loads, FIRST)
    assert swaps and balance_ratio(loads, slots) < before / 1.9
    # here the best there is: the hottest expert's rank holds it and the three lightest (its slots must be filled)
    assert max(rank_loads(loads, slots)) == pytest.approx(loads[0] + sum(sorted(loads)[:LOCAL - 1]))
    assert [len(held) for held in slots] == [LOCAL] * RANKS  # slots stay: each rank keeps its page layout
    assert sorted(e for held in slots for e in held) == list(range(EXPERTS))
    assert max(rank_loads(loads, slots)) < max(rank_loads(loads, FIRST))
    assert plan_swaps(loads, FIRST) == (slots, swaps)  # every rank computes the same from the same loads


def test_one_expert_hotter_than_a_ranks_share_bounds_the_balance():
    """Moving experts cannot split one: the rank holding the hottest expert stays at least that busy."""
    loads = zipf(EXPERTS, 1.2)
    slots, _ = plan_swaps(loads, FIRST)
    assert max(loads) <= max(rank_loads(loads, slots)) < max(rank_loads(loads, FIRST)) / 1.5


def test_balanced_loads_move_nothing():
    assert plan_swaps([5.0] * EXPERTS, FIRST) == (FIRST, [])
    assert balance_ratio([0.0] * EXPERTS, FIRST) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=EXPERTS, max_size=EXPERTS))
def test_each_swap_lowers_the_larger_of_the_two_ranks_loads(counts):
    loads = [float(c) for c in counts]
    slots, swaps = plan_swaps(loads, FIRST)
    assert max(rank_loads(loads, slots)) <= max(rank_loads(loads, FIRST))
    assert sorted(e for held in slots for e in held) == list(range(EXPERTS))
    replay = [list(held) for held in FIRST]
    for e, f in swaps:  # replayed: each swap trades a hotter expert off the busiest rank for a lighter one
        per_rank = rank_loads(loads, replay)
        busy = next(r for r, held in enumerate(replay) if e in held)
        other = next(r for r, held in enumerate(replay) if f in held)
        assert per_rank[busy] == max(per_rank)
        assert loads[e] > loads[f]
        assert max(per_rank[busy] - loads[e] + loads[f], per_rank[other] + loads[e] - loads[f]) < per_rank[busy]
        replay[busy][replay[busy].index(e)], replay[other][replay[other].index(f)] = f, e
    assert replay == slots


def test_the_cost_model_moves_only_when_the_time_saved_exceeds_the_time_to_move():
    loads = zipf(EXPERTS)
    common = dict(layer="moe", loads=loads, slots=FIRST, threshold=1.25, seconds_per_row=1e-5, horizon=100)
    fast = decide(bandwidth=1e9, bytes_per_expert=1 << 20, **common)
    assert fast.moved and fast.new_slots is not None and fast.gain_s > fast.move_s > 0
    slow = decide(bandwidth=1e3, bytes_per_expert=1 << 20, **common)
    assert slow.swaps == fast.swaps and not slow.moved and slow.new_slots is None
    assert slow.move_s > slow.gain_s
    calm = decide(bandwidth=1e9, bytes_per_expert=1 << 20, **dict(common, threshold=100.0))
    assert not calm.swaps and not calm.moved and calm.ratio_after == calm.ratio_before


def test_a_replica_shares_a_hot_experts_load_which_no_swap_can_split():
    """One expert hotter than a rank's fair share: the swaps leave its rank the busiest; replicas (at most one per
    rank here) deal its rows over more ranks, each lowering the busiest rank's load, and never copy an expert onto a
    rank that holds it."""
    loads = zipf(EXPERTS, 1.2)
    slots, _ = plan_swaps(loads, FIRST)
    replicas = plan_replicas(loads, slots, per_rank=1)
    assert replicas and replicas == sorted(replicas) == plan_replicas(loads, slots, per_rank=1)  # deterministic
    owner = {e: r for r, held in enumerate(slots) for e in held}
    assert all(owner[e] != r for e, r in replicas) and len(set(replicas)) == len(replicas)
    assert all(sum(1 for _, h in replicas if h == r) <= 1 for r in range(RANKS))
    assert 0 in {e for e, _ in replicas}  # the hottest expert is copied
    assert max(rank_loads(loads, slots, replicas)) < max(loads) <= max(rank_loads(loads, slots))
    assert sum(rank_loads(loads, slots, replicas)) == pytest.approx(sum(loads))  # the rows are dealt, not added
    # the expert's load splits evenly over its holders
    ways = 1 + sum(1 for e, _ in replicas if e == 0)
    assert rank_loads([1.0 if e == 0 else 0.0 for e in range(EXPERTS)], slots, replicas)[owner[0]] == 1.0 / ways
    assert plan_replicas([5.0] * EXPERTS, FIRST, per_rank=2) == []  # balanced: nothing to copy


def test_the_cost_model_counts_each_replicas_traffic_every_step():
    loads = zipf(EXPERTS, 1.2)
    common = dict(layer="moe", loads=loads, slots=FIRST, threshold=1.25, seconds_per_row=1e-5, horizon=100,
                  bytes_per_expert=1 << 20, max_replicas=1, weight_bytes=1 << 18)
    fast = decide(bandwidth=1e12, **common)
    assert fast.moved and fast.replicas and fast.ratio_after < decide(bandwidth=1e12, **dict(common,
                                                                                        max_replicas=0)).ratio_after
    # the replicas' weights and gradients every step cost more than moving the swapped experts once
    slow = decide(bandwidth=1e6, **common)
    swaps_only = decide(bandwidth=1e6, **dict(common, max_replicas=0))
    assert slow.move_s > swaps_only.move_s
    assert not slow.moved and slow.replicas == []  # nothing changes: no replica was in place
    kept = decide(bandwidth=1e6, **dict(common, replicas=fast.replicas))
    assert kept.replicas == fast.replicas and kept.ratio_before < fast.ratio_before  # in place: they stay


@pytest.mark.parametrize("parallel, optimizer, needs", [
    ({"moe_rebalance_every": 10}, {}, "ep > 1"),
    ({"moe_rebalance_every": 10, "ep": 2}, {"staleness": 1}, "staleness 0"),
    ({"moe_rebalance_threshold": 0.5}, {}, ">= 1.0"),
    ({"moe_rebalance_ema": 1.0}, {}, "in [0, 1)"),
    ({"moe_replicas": 1, "ep": 2}, {}, "moe_rebalance_every > 0"),
    ({"moe_replicas": -1}, {}, ">= 0"),
])
def test_placement_settings_that_cannot_work_are_refused_with_the_key(parallel, optimizer, needs):
    with pytest.raises(ConfigValueError, match=r"parallel\.moe_re\w+:.*" + needs.replace("[", r"\[")
                       .replace("(", r"\(").replace(")", r"\)")):
        load_config({"parallel": parallel, "optimizer": optimizer})


def test_ep_groups_and_the_ranks_holding_the_same_experts_at_8_ranks():
    """ep < dp: groups of ep consecutive ranks each hold every expert once; the ranks at the same place of each
    group hold the same experts (their gradients all-reduced)."""
    from angel_ptm.parallel.mesh import mesh_groups

    assert mesh_groups("ep", 8, 1, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh_groups("expert-dp", 8, 1, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh_groups("ep", 8, 1, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh_groups("expert-dp", 8, 1, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for ep in (2, 4):  # every rank in exactly one group of each kind
        for kind in ("ep", "expert-dp"):
            assert sorted(r for g in mesh_groups(kind, 8, 1, ep) for r in g) == list(range(8))


def test_a_held_tensors_gradient_is_final_only_once_the_gradients_from_elsewhere_are_added():
    """ParamBinder.add_grads, as an owner adds its replicas' gradients in backward: a tensor in `held_grads` is not
    final at its own accumulation, so the planned scheduler's update during backward (one rank; 4 KiB pages, the
    tensor on two) applies the sum, as torch.optim.AdamW does with the same gradient added."""
    import angel_ptm

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 64))

    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    extra = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    ref = build()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        ref(x).pow(2).mean().backward()
        ref[2].weight.grad.add_(extra)
        opt.step()
        opt.zero_grad()
    engine = angel_ptm.initialize(build(), {
        "optimizer": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        "memory": {"page_bytes": 4096, "scheduler": "planned"}, "trainer": {"device": "cpu", "grad_clip": 0}})
    try:
        engine.binder.held_grads = {"2.weight"}

        def add_in_backward(_module, args):  # once layer 2's gradients are in
            args[0].register_hook(lambda _grad: engine.binder.add_grads({"2.weight": extra}))
        engine.model[2].register_forward_pre_hook(add_in_backward)
        eager = 0
        for _ in range(3):
            engine.backward(engine(x).pow(2).mean())
            eager += engine.optimizer.updated_this_step  # (page groups updated during backward)
            engine.step()
        assert eager > 0
        got = engine.state_dict()
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7)
    finally:
        engine.close()


def test_a_replica_placement_that_cannot_be_is_refused_and_one_without_weights_cannot_run():
    from angel_ptm.errors import DistributedError
    from angel_ptm.models.moe import MoE, MoESpec
    from angel_ptm.parallel.moe import EPComm, apply_expert_parallel

    holder = nn.Module()
    holder.moe = MoE(8, 16, MoESpec(experts=4, top_k=1, gate="switch"))
    apply_expert_parallel(holder, EPComm.planning(2))  # (rank 0 of 2: experts 0 and 1 here)
    for bad in ([(0, 0)], [(2, 0), (2, 0)], [(4, 1)], [(1, 2)]):  # the owner; twice; no such expert; no such rank
        with pytest.raises(DistributedError, match="MoE replicas"):
            holder.moe.set_placement(holder.moe.placement, bad)
    holder.moe.set_placement(holder.moe.placement, [(2, 0)])
    assert holder.moe.replica_modules == [None] and holder.moe._width == 3
    holder.moe.load_replicas({2: {n: torch.ones_like(p) for n, p in holder.moe.experts[0].named_parameters()}},
                             torch.device("cpu"))
    copy = holder.moe.replica_modules[0]
    assert all(p.eq(1).all() for p in copy.parameters()) and not any(p is q for p in copy.parameters()
                                                                     for q in holder.moe.parameters())
    assert not any(p is q for p in copy.parameters() for q in holder.parameters())  # (outside the model)
    holder.moe.set_placement(holder.moe.placement, [(2, 0), (3, 0)])
    assert holder.moe.replica_modules[0] is copy and holder.moe.replica_modules[1] is None  # kept where still held


def test_the_estimate_counts_each_ranks_hot_expert_copies_beside_the_pools():
    """parallel.moe_replicas K: a rank holds at most K copies per MoE layer (plan_replicas' limit), each an
    expert's weights and, in backward, their gradients, in the compute dtype, outside the page pools: on a CPU they
    count in the host RAM needed."""
    from angel_ptm.estimate import estimate_job
    from angel_ptm.parallel import Ownership

    base = {"model": {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "dim": 32,
                      "moe": {"experts": 4}},
            "memory": {"page_bytes": "4KiB"}, "trainer": {"device": "cpu"},
            "parallel": {"dp": 2, "ep": 2, "zero": 1, "moe_rebalance_every": 4}}
    without = estimate_job(base, ownership=Ownership(0, 2, 1))
    for copies, dtype, size in ((1, "float32", 4), (2, "float32", 4), (2, "bfloat16", 2)):
        cfg = dict(base, parallel=dict(base["parallel"], moe_replicas=copies), trainer={"device": "cpu",
                                                                                         "dtype": dtype})
        got = estimate_job(cfg, ownership=Ownership(0, 2, 1))
        expert = 3 * 32 * 4 * 32  # the SwiGLU expert's w1, w2, w3 (dim 32, hidden 4 x dim) ...
        assert got.replica_bytes == 2 * copies * 2 * expert * size  # ... x 2 layers, weights and gradients
        if dtype == "float32":
            assert got.host_ram_needed == without.host_ram_needed + got.replica_bytes
        assert "hot-expert copies" in got.format_table()
        # (not ZeRO-3's gathered copies, which page creation keeps device slots free for: the replicas' bytes
        # were, and no page started on the device under automatic budgets)
        assert got.gather_copy_pages == without.gather_copy_pages == 0
    assert without.replica_bytes == 0 and "hot-expert copies" not in without.format_table()


def test_experts_named_as_units_under_zero3_data_parallel_are_refused():
    from angel_ptm.errors import ConfigValueError
    from angel_ptm.units import expert_modules, experts_as_units, find_units

    from dist_jobs import gpt_moe

    model = gpt_moe()
    assert experts_as_units(dp=2, zero=2, ep=1) and experts_as_units(dp=2, zero=3, ep=2)
    assert not experts_as_units(dp=2, zero=3, ep=1)
    experts = set(expert_modules(model))
    assert not experts & {u.module for u in find_units(model, experts=False)}
    with pytest.raises(ConfigValueError, match="units: 8 MoE experts"):
        find_units(model, lambda m: m in experts, experts=False)
