"""Expert parallelism over gloo on CPU (angel_ptm/parallel/moe): an MoE layer whose experts are split over 2 ranks
gives, on each rank's tokens, the output and the gradients of the unsplit layer (fp32 within 1e-5): the input's
and the gate's per rank, each expert's summed over the ranks whose tokens it served; top-1 and top-2 with drops
and dropless."""

from __future__ import annotations

import os

import pytest
import torch

from angel_ptm.models.moe import MoE, MoESpec

from dist_harness import spawn, values
from dist_jobs import job, run_jobs, train

DIM, HIDDEN, TOKENS, EXPERTS = 12, 16, 20, 4
SPECS = {
    "switch-drops": dict(gate="switch", capacity_factor=0.5),
    "top2-drops": dict(gate="gshard", capacity_factor=0.5),
    "top2-dropless": dict(gate="gshard", capacity_factor=0.0),
    "ktop1": dict(gate="ktop1", top_k=2, capacity_factor=1.0),
}


def layer(name: str) -> MoE:
    torch.manual_seed(0)
    return MoE(DIM, HIDDEN, MoESpec(**{"experts": EXPERTS, **SPECS[name]})).eval()  # eval: no sampling


def tokens(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)


def split_layers(rank: int, world: int, tmp: str, hierarchical: bool = False, names=tuple(SPECS),
                 replicas=()) -> dict:
    from angel_ptm.config import load_config
    from angel_ptm.parallel.mesh import init_mesh
    from angel_ptm.parallel.moe import EPComm, apply_expert_parallel, expert_names

    mesh = init_mesh(load_config({}).parallel)
    comm = EPComm(mesh, mesh.dp_ranks, hierarchical=hierarchical, node_size=2)  # 4 ranks: 2 "nodes" of 2
    out = {}
    for name in names:
        moe = layer(name)
        holder = torch.nn.Module()
        holder.moe = moe
        apply_expert_parallel(holder, comm)
        if replicas:  # hot-expert copies (expert, rank), with their owners' weights (the unsplit layer's)
            moe.set_placement(moe.placement, replicas)
            every = dict(layer(name).experts.named_parameters())
            moe.load_replicas({e: {n.partition(".")[2]: p.detach() for n, p in every.items() if n.startswith(f"{e}.")}
                               for e, _ in replicas}, torch.device("cpu"))
        x = tokens(rank)
        y = moe(x)
        (y * y).sum().backward()
        names = expert_names(holder)
        out[name] = {"y": y.tolist(), "x_grad": x.grad.tolist(), "experts": len(moe.experts),
                     "grads": {names.get(f"moe.{n}", f"moe.{n}"): p.grad.tolist() if p.grad is not None else None
                               for n, p in moe.named_parameters()}}
    return out


def four_ways(rank: int, world: int, tmp: str) -> dict:
    names = ("switch-drops", "top2-drops", "top2-dropless")
    out = {"flat": split_layers(rank, world, tmp, False, names), "hierarchical": split_layers(rank, world, tmp, True,
                                                                                               names)}
    out["engine"] = run_jobs(rank, world, dp4_jobs(tmp), tmp)
    out["tmp"] = tmp
    return out


# ep 2 on 4 data-parallel ranks: two expert-parallel groups of 2, each holding every expert once; the ranks with the
# same experts (0 and 2, 1 and 3) all-reduce their gradients
def dp4_jobs(tmp: str) -> list:
    base = dict(ep=2, model="gpt-moe", steps=4, memory=ROOM)
    roomier = dict(base, memory={"device_budget": "512KiB", "host_budget": "512KiB"})  # ZeRO 1/2: whole gradients
    return [job("ep2-dp4-zero0", zero=0, **base), job("ep2-dp4-zero1", zero=1, **roomier),
            job("ep2-dp4-zero2-stale", zero=2, staleness=1, **roomier),
            job("ep2-dp4-zero2-hash", zero=2, **dict(roomier, model="gpt-moe-hash")),
            # staleness 1 with the states paged: an expert page whose owner's tokens never reached it takes its
            # replica's mean before any write of its own ran the pending update (which then read the new mean)
            job("ep2-dp4-zero3-hash-stale", zero=3, staleness=1, **dict(base, model="gpt-moe-hash")),
            job("ep2-dp4-zero2-accum2", zero=2, accum=2, **roomier),
            job("ep2-dp4-zero2-grouped", zero=2, pairwise=False, **roomier),  # NCCL's way: gloo's own collectives
            job("ep2-dp4-zero0-bf16", zero=0, dtype="bfloat16", state_dicts=True, **roomier),
            job("ep2-dp4-zero1-bf16", zero=1, dtype="bfloat16", state_dicts=True, **roomier),
            job("ep2-dp4-zero3-clip", zero=3, clip=0.5, save_at=2, save_to=os.path.join(tmp, "dp4"), **base),
            job("ep2-dp4-zero3", zero=3, **base),
            job("ep2-dp4-zero3-recompute", zero=3, activations="full", **base),
            job("ep2-dp4-zero3-moved", zero=3, rebalance=2, rebalance_threshold=1.0, rebalance_pays=True, **base)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep4")
    return values(spawn(4, four_ways, (str(tmp),), tmp))


@pytest.mark.parametrize("a2a", ["flat", "hierarchical"])
@pytest.mark.parametrize("name", ["switch-drops", "top2-drops", "top2-dropless"])
def test_ep4_as_two_nodes_of_two_flat_and_hierarchical_give_the_unsplit_layer(four_ranks, a2a, name):
    """4 ranks as 2 "nodes" x 2: the hierarchical all-to-all (gather on each node's leader, leaders exchange,
    scatter) delivers what the flat one does; both give the unsplit layer's outputs and gradients."""
    check_against_the_unsplit_layer([r[a2a] for r in four_ranks], name)


@pytest.mark.parametrize("name", ["ep2-dp4-zero0", "ep2-dp4-zero1", "ep2-dp4-zero2-stale", "ep2-dp4-zero2-hash",
                                  "ep2-dp4-zero3-hash-stale", "ep2-dp4-zero2-accum2", "ep2-dp4-zero2-grouped",
                                  "ep2-dp4-zero3", "ep2-dp4-zero3-clip", "ep2-dp4-zero3-recompute"])
def test_ep2_on_4_data_parallel_ranks_gives_the_losses_of_one_rank_with_grad_accum_4(four_ranks, name, tmp_path):
    """ep < dp: experts replicated over the expert-parallel groups, their gradients reduced over the ranks that
    hold the same ones (ZeRO >= 1: onto the owner of each page, which alone updates it and sends the others the new
    weights, or at ZeRO 3 has them gather it while a layer computes, recomputation too; clipping counts each
    expert once; ZeRO >= 2 during the last backward, micro-batches before it accumulating); the losses are one
    rank's within 1e-5."""
    spec = next(j for j in dp4_jobs(str(tmp_path)) if j["name"] == name)
    results = [r["engine"][name] for r in four_ranks]
    for got in results:
        assert "error" not in got, got.get("error")
        assert got["losses"] == results[0]["losses"]
    one = train(0, 1, dict(spec, ep=1, accum=4 * spec["accum"], save_at=None), str(tmp_path))
    for step, (a, e) in enumerate(zip(results[0]["losses"], one["losses"])):
        assert a == pytest.approx(e, rel=1e-5), f"step {step}: one rank {e}, ep 2 x dp 4 {a}"
    # ZeRO >= 2: every expert page group is reduced during the last backward, from its MoE layer's hook
    groups = (results[0]["local_pages"][1] - results[0]["local_pages"][0]) // 2
    assert [got["expert_overlapped"] for got in results] == [groups * spec["steps"] if spec["zero"] >= 2 else 0] * 4


@pytest.mark.parametrize("name", ["ep2-dp4-zero0", "ep2-dp4-zero1", "ep2-dp4-zero2-stale", "ep2-dp4-zero3"])
def test_expert_optimizer_states_are_sharded_over_the_ranks_holding_the_same_experts(four_ranks, name):
    """ZeRO >= 1 with ep 2 on 4 ranks: each rank keeps 1/4 of the shared pages' AdamW moments and 1/2 of its
    experts' (the two ranks holding the same experts split them), and at ZeRO 3 the weights alike (the others are
    gathered while a layer computes); ZeRO 0 keeps them all."""
    for got in (r["engine"][name] for r in four_ranks):
        assert "error" not in got, got.get("error")
        start, end = got["local_pages"]
        zero = int(name.split("zero")[1][0])
        sharded = start // 4 + (end - start) // 2
        assert got["pages"]["exp_avg"] == got["pages"]["exp_avg_sq"] == (end if zero == 0 else sharded), \
            (got["pages"], start, end)
        assert got["pages"]["param"] == (sharded if zero == 3 else end)
        assert got["pages"]["grad"] == end
        # ZeRO >= 2: the gradient pages of the experts this rank does not own are dead once backward is over (their
        # groups reduced during it); below, they hold data until the step reduces them
        assert got["live_expert_grads"] <= ((end - start) // 2 if zero >= 2 else end - start), got["live_expert_grads"]
        if zero < 2:
            assert got["live_expert_grads"] > (end - start) // 2


def test_sharded_expert_states_under_bf16_give_the_replicated_run_bitwise(four_ranks):
    """Mixed precision: the fp32 masters and moments of the experts live on their owners only, the others get the
    bf16 weights from them; losses, model and AdamW state dicts equal those of ZeRO 0 (experts whole everywhere)."""
    for r in four_ranks:
        whole, sharded = r["engine"]["ep2-dp4-zero0-bf16"], r["engine"]["ep2-dp4-zero1-bf16"]
        assert "error" not in whole and "error" not in sharded, (whole.get("error"), sharded.get("error"))
        assert sharded["pages"]["master"] < whole["pages"]["master"]
        assert sharded["losses"] == whole["losses"] and sharded["states"] == whole["states"]


def test_experts_moved_under_ep_smaller_than_dp_move_alike_in_every_group_and_change_no_loss(four_ranks):
    """Every expert-parallel group decides alike (the loads are summed over all ranks) and moves the same experts,
    so the replicas stay replicas: the losses are those of the run that moved none, bitwise."""
    moved = [r["engine"]["ep2-dp4-zero3-moved"] for r in four_ranks]
    still = four_ranks[0]["engine"]["ep2-dp4-zero3"]
    assert "error" not in moved[0], moved[0].get("error")
    assert any(layer["moved"] for d in moved[0]["rebalances"] for layer in d["layers"].values())
    assert moved[0]["expert_names"] == moved[2]["expert_names"] and moved[1]["expert_names"] == moved[3]["expert_names"]
    assert moved[0]["expert_names"] != moved[1]["expert_names"]
    assert moved[0]["losses"] == still["losses"]


def test_an_ep2_dp4_checkpoint_resumes_on_one_rank(four_ranks, tmp_path):
    """Each expert written once (by the first of the ranks holding it); one rank resumes and continues as the
    4 ranks did."""
    saved = four_ranks[0]["engine"]["ep2-dp4-zero3-clip"]
    spec = next(j for j in dp4_jobs(four_ranks[0]["tmp"]) if j["name"] == "ep2-dp4-zero3-clip")
    resumed = train(0, 1, dict(spec, ep=1, accum=4, save_at=None, load=os.path.join(four_ranks[0]["tmp"], "dp4")),
                    str(tmp_path))
    assert len(resumed["losses"]) == 2
    for a, e in zip(resumed["losses"], saved["losses"][2:]):
        assert a == pytest.approx(e, rel=1e-5)


@pytest.mark.parametrize("name", list(SPECS))
def test_ep2_gives_the_unsplit_layers_outputs_and_gradients(two_ranks, name):
    check_against_the_unsplit_layer(two_ranks, name)


def check_against_the_unsplit_layer(results, name):
    whole = layer(name)
    world = len(results)
    expert_grads: dict[str, torch.Tensor] = {}
    for rank in range(world):
        whole.zero_grad(set_to_none=True)
        x = tokens(rank)
        y = whole(x)
        (y * y).sum().backward()
        got = results[rank][name]
        assert got["experts"] == EXPERTS // world
        torch.testing.assert_close(torch.tensor(got["y"]), y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["x_grad"]), x.grad, rtol=1e-5, atol=1e-6)
        gate = got["grads"]["moe.gate.router.weight"]
        torch.testing.assert_close(torch.tensor(gate), whole.gate.router.weight.grad, rtol=1e-5, atol=1e-6)
        for n, p in whole.named_parameters():
            if ".experts." in f".{n}" and p.grad is not None:
                expert_grads[n] = expert_grads.get(n, 0) + p.grad
    for n, expected in expert_grads.items():
        owner = int(n.split(".")[1]) // (EXPERTS // world)
        got = results[owner][name]["grads"][f"moe.{n}"]
        torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)


REPLICAS = [(0, 1), (3, 0)]  # (expert, rank): a copy of rank 0's expert 0 on rank 1 and of rank 1's expert 3 on 0


# ------------------------------------------------------------------------------------------------ in the engine
ROOM = {"device_budget": "512KiB", "host_budget": "256KiB"}  # a block with its 4 experts (2 per rank at ep 2)
ENGINE_JOBS = [job(f"ep2-zero{z}", zero=z, ep=2, model="gpt-moe", steps=6, memory=ROOM, routing=z == 3,
                   batch_size=4) for z in (0, 1, 3)] + [
    job("ep2-zero2-device+host", zero=2, ep=2, model="gpt-moe", steps=6, placement="device+host", clip=0.5,
        memory=ROOM),
    job("ep2-hierarchical", zero=3, ep=2, model="gpt-moe", steps=6, memory=ROOM, moe_a2a="hierarchical"),
    job("ep2-zero3-meta", zero=3, ep=2, model="gpt-moe", steps=6, memory=ROOM, meta=True)]


# Every expert on every rank (ep 1), the ranks routing their own tokens differently: under ZeRO-3 the experts stay
# in their block's paging unit, gathered with it on every rank (units.experts_as_units); ZeRO-2 reduces what each
# rank's routing gave a gradient, as agreed over the ranks.
DP_JOBS = [job(f"dp2-zero{z}", zero=z, model="gpt-moe", steps=6, memory=ROOM) for z in (2, 3)]


@pytest.mark.parametrize("name", [j["name"] for j in DP_JOBS])
def test_moe_data_parallel_without_ep_gives_the_losses_of_one_rank(two_ranks, name, tmp_path):
    spec = next(j for j in DP_JOBS if j["name"] == name)
    got = two_ranks[0][name]
    assert "error" not in got, got.get("error")
    assert two_ranks[1][name]["losses"] == got["losses"]
    one = train(0, 1, dict(spec, accum=2), str(tmp_path))
    for step, (a, e) in enumerate(zip(got["losses"], one["losses"])):
        assert a == pytest.approx(e, rel=1e-5), f"step {step}: one rank {e}, dp 2 {a}"


# Load-driven placement: experts swap ranks at steps 2, 4 and 6 (threshold 1.0: any imbalance a swap lowers; the cost
# model told that moving pays, as measured timings would make the test flaky); the checkpoint after step 4 holds the
# moved experts under their own indexes.
REBALANCE = dict(zero=3, ep=2, model="gpt-moe", steps=6, memory=ROOM, final_states=True)


def rebalance_jobs(tmp: str) -> list:
    bf16 = dict(REBALANCE, zero=2, dtype="bfloat16")  # fp32 masters move; the compute copies are recast
    return [job("not-moved", **REBALANCE),
            job("moved", rebalance=2, rebalance_threshold=1.0, rebalance_pays=True, save_at=4,
                save_to=os.path.join(tmp, "moved"), **REBALANCE),
            job("not-moved-bf16", **bf16),
            job("moved-bf16", rebalance=2, rebalance_threshold=1.0, rebalance_pays=True, **bf16),
            job("replicated", rebalance=2, rebalance_threshold=1.0, rebalance_pays=True, replicas=1, hot_expert=1,
                save_at=4, save_to=os.path.join(tmp, "replicated"), **REBALANCE),
            job("replicated-bf16", rebalance=2, rebalance_threshold=1.0, rebalance_pays=True, replicas=1,
                hot_expert=1, **bf16),
            job("too-costly", rebalance=2, rebalance_threshold=1.0, **dict(REBALANCE, steps=2))]


def both(rank: int, world: int, tmp: str) -> dict:
    from angel_ptm.parallel.moe import placement

    out = split_layers(rank, world, tmp)
    out["replicated-layers"] = split_layers(rank, world, tmp, replicas=REPLICAS)
    out.update(run_jobs(rank, world, ENGINE_JOBS + DP_JOBS, tmp))
    out.update(run_jobs(rank, world, rebalance_jobs(tmp)[:-1], tmp))
    measured = placement.Rebalancer._measured
    placement.Rebalancer._measured = lambda self: (measured(self)[0], 1.0)  # 1 byte/s: moving never pays
    try:
        out.update(run_jobs(rank, world, rebalance_jobs(tmp)[-1:], tmp))
    finally:
        placement.Rebalancer._measured = measured
    out["tmp"] = tmp
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep2")
    return values(spawn(2, both, (str(tmp),), tmp))


@pytest.mark.parametrize("name", list(SPECS))
def test_hot_expert_replicas_give_the_unsplit_layer(two_ranks, name):
    """Experts 0 (rank 0's) and 3 (rank 1's) copied onto the other rank: each rank deals its rows of them over the
    owner and the copy; the outputs and input gradients are the unsplit layer's, and each expert's gradient on its
    owner (its rows' there plus its copy's, sent back in backward) is the sum over every rank's tokens."""
    check_against_the_unsplit_layer([r["replicated-layers"] for r in two_ranks], name)


def test_the_estimate_counts_each_ranks_expert_activations_under_ep(two_ranks):
    """An expert-parallel GPT-MoE traced for the estimate (activations/footprint.py): each rank's own experts at
    the kept choices' bound, the ranks' loads taken as balanced, no all-to-all. The activation peak each rank
    measures in the last step (k-top-1 with a capacity) lies within 20% below it, where the capacity dropped
    choices, and at most 10% above, where the routing favoured one rank's experts (seen: -11% to +3%)."""
    for rank in two_ranks:
        measured, estimate = rank["ep2-zero3"]["activations"]
        assert 0.8 * estimate <= measured <= 1.1 * estimate, (measured, estimate)


@pytest.mark.parametrize("name", [j["name"] for j in ENGINE_JOBS])
def test_ep2_in_the_engine_gives_the_losses_of_one_rank_with_grad_accum_2(two_ranks, name, tmp_path):
    """Each rank holds half the experts (rank-local pages: never sharded, gathered or reduced; their gradients, the
    sums over every rank's tokens, divided by dp like a mean), the rest data-parallel under ZeRO; the losses are
    those of one rank taking both micro-batches, within 1e-5 (clipping too: the norm sums every rank's experts)."""
    spec = next(j for j in ENGINE_JOBS if j["name"] == name)
    got = two_ranks[0][name]
    assert "error" not in got, got.get("error")
    assert two_ranks[1][name]["losses"] == got["losses"]
    one = train(0, 1, dict(spec, ep=1, accum=2), str(tmp_path))
    for step, (a, e) in enumerate(zip(got["losses"], one["losses"])):
        assert a == pytest.approx(e, rel=1e-5), f"step {step}: one rank {e}, ep 2 {a}"
    whole = one["param_numel"]
    local = got["param_numel"]
    experts = [n for n in whole if ".experts." in n]
    assert sum(local.get(n, 0) for n in experts) == sum(whole[n] for n in experts) // 2  # half the experts each
    if spec.get("routing"):  # the logged routing is the job's: both ranks' tokens, as one rank taking both batches
        assert got["routed"] == two_ranks[1][name]["routed"]
        for step, (a, e) in enumerate(zip(got["routed"], one["routed"])):
            for layer in e:
                assert a[layer]["tokens_per_expert"] == e[layer]["tokens_per_expert"], (step, layer)
                assert a[layer]["drop_rate"] == pytest.approx(e[layer]["drop_rate"], abs=1e-12), (step, layer)
                assert a[layer]["aux_loss"] == pytest.approx(e[layer]["aux_loss"], rel=1e-5), (step, layer)
        assert all(sum(layer["tokens_per_expert"]) > 0 for layer in got["routed"][0].values())


def test_under_ep_the_fetches_of_local_experts_no_rank_routed_to_are_cancelled(two_ranks):
    """Once the counts are exchanged, a rank knows which of its experts get rows from some rank: the planned
    fetches of the others are cancelled (the losses are those of one rank: the test above)."""
    cancelled = {name: [two_ranks[r][name]["cancelled"] for r in range(2)] for name in
                 (j["name"] for j in ENGINE_JOBS)}
    assert sum(sum(c) for c in cancelled.values()) > 0, cancelled


def test_an_ep2_checkpoint_resumes_on_one_rank_and_the_reverse(tmp_path):
    """Checkpoints name experts by their index in the unsplit layer: ep 2's ranks each write their own experts, and
    one rank (every expert) resumes from them, within 1e-5 of the run that saved; one rank's checkpoint resumes at
    ep 2 likewise."""
    base = dict(job("ckpt", zero=3, ep=2, model="gpt-moe", steps=6, memory=ROOM), save_at=3)
    specs = [dict(base, name="save", save_to=str(tmp_path / "ep2"))]
    one = train(0, 1, dict(base, ep=1, accum=2, save_to=str(tmp_path / "ep1")), str(tmp_path))
    specs.append(dict(base, name="load", save_at=None, load=str(tmp_path / "ep1")))
    two = values(spawn(2, run_jobs, (specs, str(tmp_path)), tmp_path))
    saved, loaded = two[0]["save"], two[0]["load"]
    assert "error" not in saved and "error" not in loaded, (saved.get("error"), loaded.get("error"))
    resumed = train(0, 1, dict(base, ep=1, accum=2, save_at=None, load=str(tmp_path / "ep2")), str(tmp_path))
    for got, expected in ((resumed["losses"], saved["losses"][3:]), (loaded["losses"], one["losses"][3:]),
                          (saved["losses"], one["losses"])):
        assert len(got) == len(expected)
        for a, e in zip(got, expected):
            assert a == pytest.approx(e, rel=1e-5)


@pytest.mark.parametrize("suffix", ["", "-bf16"])
def test_experts_moving_ranks_change_no_loss_and_no_final_state(two_ranks, suffix):
    """parallel.moe_rebalance_every: experts swapped between the ranks (weights or fp32 masters, moments, step
    counts) at steps 2, 4 and 6 give the losses of the run that never moved one, bitwise, and the same final state
    of every expert under its own index (fp32, and bf16 compute under ZeRO-2); the dispatch follows the placement,
    and each rank's expert names follow its slots."""
    moved, still = two_ranks[0]["moved" + suffix], two_ranks[0]["not-moved" + suffix]
    assert "error" not in moved, moved.get("error")
    assert moved["losses"] == still["losses"] == two_ranks[1]["moved" + suffix]["losses"]
    decisions = moved["rebalances"]
    assert [d["step"] for d in decisions] == [2, 4, 6]
    assert decisions == two_ranks[1]["moved" + suffix]["rebalances"]  # decided alike on every rank
    swaps = [s for d in decisions[:2] for layer in d["layers"].values() if layer["moved"] for s in layer["swaps"]]
    assert swaps, decisions  # experts moved before the last steps, so those steps ran with them elsewhere
    for d in decisions:
        for layer in d["layers"].values():
            assert layer["ratio_after"] <= layer["ratio_before"]
    for rank in range(2):
        got = two_ranks[rank]["moved" + suffix]["states"]["final"]
        want = two_ranks[rank]["not-moved" + suffix]["states"]["final"]
        experts = {n for n in want if ".experts." in n}
        shared = set(want) - experts
        assert {n: got[n] for n in shared} == {n: want[n] for n in shared}
    union = lambda job: {n: d for r in range(2) for n, d in two_ranks[r][job]["states"]["final"].items()
                         if ".experts." in n}  # noqa: E731
    assert union("moved" + suffix) == union("not-moved" + suffix)  # every expert's states, wherever it went
    names = [two_ranks[r]["moved" + suffix]["expert_names"] for r in range(2)]
    assert names != [two_ranks[r]["not-moved" + suffix]["expert_names"] for r in range(2)]
    held = sorted(v for n in names for v in n.values())
    assert held == sorted(v for r in range(2) for v in two_ranks[r]["not-moved" + suffix]["expert_names"].values())


@pytest.mark.parametrize("suffix, rel", [("", 1e-6), ("-bf16", 1e-3)])
def test_hot_expert_replicas_placed_mid_run_change_no_loss(two_ranks, suffix, rel):
    """parallel.moe_replicas 1 with expert 1's counts skewed (it looks hot): at step 2 every rank places the same
    copies; from then each replica computes its share of the expert's rows, its gradients go back to the owner in
    backward (before the owner's eager update, and ZeRO's), and after every step it takes the owner's new weights.
    The losses are those of the run without replicas within 1e-6 (fp32: a gradient summed in two parts), and in
    bf16 compute within bf16's rounding of an expert's output (its rows in another batch)."""
    got, still = two_ranks[0]["replicated" + suffix], two_ranks[0]["not-moved" + suffix]
    assert "error" not in got, got.get("error")
    assert got["losses"] == two_ranks[1]["replicated" + suffix]["losses"]
    assert got["rebalances"] == two_ranks[1]["replicated" + suffix]["rebalances"]  # decided alike
    placed = [layer["replicas"] for d in got["rebalances"] for layer in d["layers"].values()]
    assert placed[0] and any(1 in [e for e, _ in r] for r in placed)  # copies of the hot expert from step 2
    for step, (a, e) in enumerate(zip(got["losses"], still["losses"])):
        assert a == pytest.approx(e, rel=rel), f"step {step}: without replicas {e}, with {a}"


def test_a_checkpoint_taken_with_replicas_in_place_resumes_on_one_rank(two_ranks, tmp_path):
    """Copies are not saved (the owner holds every state): the checkpoint after step 4, with copies in place since
    step 2, resumes on one rank and continues as the 2-rank run did (within 1e-5)."""
    saved = two_ranks[0]["replicated"]
    assert any(layer["replicas"] for d in saved["rebalances"] if d["step"] <= 4 for layer in d["layers"].values())
    resumed = train(0, 1, dict(job("resume", **dict(REBALANCE, final_states=False)), ep=1, accum=2,
                               load=os.path.join(two_ranks[0]["tmp"], "replicated")), str(tmp_path))
    assert len(resumed["losses"]) == 2
    for a, e in zip(resumed["losses"], saved["losses"][4:]):
        assert a == pytest.approx(e, rel=1e-5)


def test_a_checkpoint_after_experts_moved_resumes_on_one_rank(two_ranks, tmp_path):
    """The checkpoint saved after step 4's move names each expert by its own index: one rank resumes from it and
    continues as the 2-rank run did (within 1e-5, the tolerance between 1 and 2 ranks)."""
    saved = two_ranks[0]["moved"]
    resumed = train(0, 1, dict(job("resume", **dict(REBALANCE, final_states=False)), ep=1, accum=2,
                               load=os.path.join(two_ranks[0]["tmp"], "moved")), str(tmp_path))
    assert len(resumed["losses"]) == 2
    for a, e in zip(resumed["losses"], saved["losses"][4:]):
        assert a == pytest.approx(e, rel=1e-5)


def test_experts_stay_where_moving_them_costs_more_than_it_saves(two_ranks):
    """With the measured bandwidth at 1 byte/s the planned swaps never pay: the decision is logged, nothing moves."""
    got = two_ranks[0]["too-costly"]
    assert "error" not in got, got.get("error")
    layers = got["rebalances"][0]["layers"].values()
    assert any(layer["swaps"] for layer in layers)  # there was a better placement ...
    assert not any(layer["moved"] for layer in layers)  # ... not worth its move
    assert got["expert_names"] == two_ranks[0]["not-moved"]["expert_names"]


def test_ep2_on_a_meta_built_model_starts_from_the_1_rank_weights(two_ranks):
    """Built on the meta device, each rank materializes only its experts, with the values a 1-rank build gives them
    (every expert's draws replayed in the 1-rank order): the losses are those of the CPU-built model's, bitwise."""
    meta, built = two_ranks[0]["ep2-zero3-meta"], two_ranks[0]["ep2-zero3"]
    assert "error" not in meta, meta.get("error")
    assert meta["losses"] == built["losses"] == two_ranks[1]["ep2-zero3-meta"]["losses"]


def test_the_estimate_of_an_ep_job_counts_one_ranks_experts_and_their_sharded_states():
    """`angel-ptm estimate --world-size 4` at ep 2: one rank holds half of every MoE layer's experts, their weights
    and AdamW moments split with the other rank holding them (ZeRO 3), the shared pages 1/4."""
    from angel_ptm.config import load_config
    from angel_ptm.errors import BudgetError
    from angel_ptm.estimate import estimate_job
    from angel_ptm.memory import build_layout
    from angel_ptm.models import build_model
    from angel_ptm.parallel import Ownership
    from angel_ptm.parallel.moe import EPComm, apply_expert_parallel, expert_names

    cfg = {"model": {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "dim": 32,
                     "moe": {"experts": 4, "top_k": 2}},
           "memory": {"page_bytes": "4KiB"}, "trainer": {"device": "cpu"}, "parallel": {"dp": 4, "ep": 2, "zero": 3}}
    model = apply_expert_parallel(build_model(load_config(cfg).model), EPComm.planning(2))
    layout = build_layout(model, 4096, dp_world_size=4, local=expert_names(model))
    start, end = layout.local_pages
    got = estimate_job(cfg, ownership=Ownership(0, 4, 3)).kind_bytes
    assert got["exp_avg"] == (start // 4 + (end - start) // 2) * 4096
    assert got["param"] == got["exp_avg"]  # ZeRO 3: the experts' weights sharded alike
    whole = estimate_job(dict(cfg, parallel={"dp": 4, "ep": 1, "zero": 3}), ownership=Ownership(0, 4, 3)).kind_bytes
    assert got["param"] < whole["param"] * 4 and end - start < layout.n_pages
    # A layer's experts are gathered whole while it computes: the device must hold them (a typed error if not)
    layer_pages = (end - start) // 2  # 2 MoE layers, each on its own pages here
    assert estimate_job(cfg, ownership=Ownership(0, 4, 3)).expert_gather_pages == layer_pages
    small = dict(cfg, memory={"page_bytes": "4KiB", "device_budget": (layer_pages - 1) * 4096})
    with pytest.raises(BudgetError, match="MoE layer 'layers.[01].feed_forward'"):
        estimate_job(small, ownership=Ownership(0, 4, 3)).check()


def test_under_ep_state_dicts_hold_the_unsplit_model_and_load_back_on_every_rank(tmp_path):
    """State dicts under ep 2 are the unsplit model's, alike on both ranks; loaded back, each rank takes its experts
    and they train on as one rank does from its own."""
    from dist_jobs import resume
    spec = job("resume-ep2", zero=3, ep=2, model="gpt-moe", steps=3, memory=ROOM, keys=True)
    two = values(spawn(2, resume, (spec, str(tmp_path)), tmp_path))
    assert two[0] == two[1]  # the same whole state dicts on both ranks (experts named as unsplit), the same losses
    alone = resume(0, 1, dict(spec, ep=1, accum=2), str(tmp_path))
    assert two[0]["keys"] == alone["keys"] and two[0]["numbered"] == alone["numbered"]
    assert two[0]["losses"] == pytest.approx(alone["losses"], rel=1e-5)
