"""MoE layer and gates (angel_ptm/models/moe.py, gates.py) against a dense reference written here: every expert on
every token, combined with the gate's capacity-masked weights. Outputs and gradients (of the input, the experts and
the gate) equal within 1e-12 in fp64 and 1e-5 in fp32, with forced drops; capacity is respected and choice-major;
each gate's own math (aux losses, BASE's balance, hash determinism, SAM's alignment, DTS's schedule) checked."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from angel_ptm.errors import ConfigValueError
from angel_ptm.models.gates import TokenIds, balanced_assignment
from angel_ptm.models.moe import MoE, MoESpec, choice_major_slots

DIM, HIDDEN, TOKENS = 12, 16, 24


def build(gate: str, dtype=torch.float64, capacity_factor=0.5, **spec):
    torch.manual_seed(0)
    ids = TokenIds()
    moe = MoE(DIM, HIDDEN, MoESpec(gate=gate, capacity_factor=capacity_factor, **{"experts": 6, **spec}),
              token_ids=ids)
    moe = moe.to(dtype)
    ids.ids = torch.arange(TOKENS) * 7 % 50
    return moe


def dense_reference(moe: MoE, x: torch.Tensor, routing) -> torch.Tensor:
    """Every expert on every token; token t takes sum_e W[t, e] * expert_e(x_t) with W the kept weights."""
    every = torch.stack([expert(x) for expert in moe.experts], 1)  # [T, E, dim]
    valid = routing.expert >= 0
    weights = torch.zeros(x.shape[0], len(moe.experts), dtype=x.dtype)
    weights = weights.scatter_add(1, routing.expert.clamp(min=0),
                                  (routing.weight * (routing.kept & valid)).to(x.dtype))
    out = (weights.unsqueeze(-1) * every).sum(1)
    if routing.passthrough is not None:
        out = out + routing.passthrough.unsqueeze(-1).to(x.dtype) * x
    return out


def run_both(moe: MoE, x: torch.Tensor):
    """The layer's output and the dense reference's, from the same routing, and their gradients."""
    seen = []
    handle = moe.gate.register_forward_hook(lambda module, args, out: seen.append(out))
    out = moe(x)
    handle.remove()
    ref = dense_reference(moe, x, seen[0])
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    params = [p for p in moe.parameters() if p.requires_grad]
    got = torch.autograd.grad((out * g).sum() + moe.aux_loss, [x] + params, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad((ref * g).sum() + moe.aux_loss, [x] + params, allow_unused=True)
    return out, ref, got, want, seen[0]


GATES = ["switch", "gshard", "ktop1", "hash", "base", "sam", "dts"]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_each_gate_equals_the_dense_reference_with_drops(gate, dtype, tol):
    moe = build(gate, dtype)
    x = torch.randn(TOKENS, DIM, dtype=dtype, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(5)  # gshard's and dts's Gumbel noise
    out, ref, got, want, routing = run_both(moe, x)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for a, b in zip(got, want):
        if b is None:
            assert a is None or not a.abs().max()
            continue
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if gate not in ("base", "dts"):  # capacity 0.5 of the even share: some choices dropped
        assert not routing.kept.all()


@pytest.mark.parametrize("gate", ["switch", "gshard", "ktop1", "hash", "sam"])
def test_capacity_is_respected_and_dropless_keeps_every_choice(gate):
    moe = build(gate)
    x = torch.randn(TOKENS, DIM, dtype=torch.float64)
    routing = moe.gate(x)
    k = routing.expert.shape[1]
    assert routing.capacity == k * math.ceil(TOKENS / 6 * 0.5)
    counts = torch.bincount(routing.expert[routing.kept], minlength=6)
    assert counts.max() <= routing.capacity
    dropless = build(gate, capacity_factor=0.0).gate(x)
    assert dropless.capacity == 0 and dropless.kept.all()


def test_slots_are_given_choice_major():
    """Every first choice (in token order) before any second choice: a second choice never displaces a first."""
    expert = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    slot, kept = choice_major_slots(expert, 3, capacity=2)
    assert slot.tolist() == [[0, 1], [1, 0], [2, 2], [0, 3]]
    assert kept.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    _, everything = choice_major_slots(expert, 3, capacity=0)
    assert everything.all()


def test_switch_and_gshard_follow_their_references():
    x = torch.randn(TOKENS, DIM, dtype=torch.float64)
    switch = build("switch", capacity_factor=0.0)
    probs = switch.gate.router(x).softmax(-1)
    routing = switch.gate(x)
    assert routing.expert[:, 0].tolist() == probs.argmax(-1).tolist()
    torch.testing.assert_close(routing.weight[:, 0], probs.max(-1).values)
    mask = F.one_hot(probs.argmax(-1), 6).double()
    torch.testing.assert_close(routing.aux["balance"], 0.01 * 6 * (probs.mean(0) * mask.mean(0)).sum())
    gshard = build("gshard", capacity_factor=0.0, z_loss_weight=0.1).eval()  # eval: the second is the runner-up
    logits = gshard.gate.router(x)
    probs = logits.softmax(-1)
    routing = gshard.gate(x)
    top2 = probs.topk(2, -1)
    assert routing.expert.tolist() == top2.indices.tolist()
    torch.testing.assert_close(routing.weight, top2.values / top2.values.sum(-1, keepdim=True))
    torch.testing.assert_close(routing.aux["z_loss"], 0.1 * torch.logsumexp(logits, -1).square().mean())
    gshard.train()
    torch.manual_seed(0)
    sampled = gshard.gate(x).expert
    assert (sampled[:, 0] == top2.indices[:, 0]).all() and (sampled[:, 1] != sampled[:, 0]).all()
    torch.manual_seed(0)
    assert torch.equal(gshard.gate(x).expert, sampled)  # the sampling is the generator's, reproducible


def test_ktop1_routes_one_expert_per_prototype():
    moe = build("ktop1", capacity_factor=0.0, experts=6, top_k=3)
    routing = moe.gate(torch.randn(TOKENS, DIM, dtype=torch.float64))
    for j in range(3):
        assert ((routing.expert[:, j] >= 2 * j) & (routing.expert[:, j] < 2 * j + 2)).all()


def test_hash_routing_is_a_fixed_function_of_the_token_id():
    moe = build("hash", capacity_factor=0.0)
    a = moe.gate(torch.randn(TOKENS, DIM, dtype=torch.float64)).expert
    b = moe.gate(torch.randn(TOKENS, DIM, dtype=torch.float64)).expert
    assert torch.equal(a, b)
    assert a[:, 0].tolist() == [(int(i) * 2654435761 % 2**32) % 6 for i in moe.gate.token_ids.ids]
    assert len(moe.gate.state_dict()) == 0  # no parameters


def test_base_gives_every_expert_exactly_its_share_and_the_best_assignment():
    moe = build("base")
    routing = moe.gate(torch.randn(TOKENS, DIM, dtype=torch.float64))
    assert torch.bincount(routing.expert[:, 0], minlength=6).tolist() == [TOKENS // 6] * 6
    scores = torch.randn(6, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = balanced_assignment(scores, 2)
    best = max(sum(scores[t, e] for t, e in enumerate(p)) for p in set(itertools.permutations([0, 0, 1, 1, 2, 2])))
    assert float(sum(scores[t, e] for t, e in enumerate(got.tolist()))) == pytest.approx(float(best), abs=1e-6)
    with pytest.raises(ConfigValueError, match="25 tokens do not divide over 6 experts"):
        moe.gate(torch.randn(25, DIM, dtype=torch.float64))


def test_base_assignment_is_the_optimum_itself_and_the_last_bits_of_the_scores_do_not_change_it():
    """The optimum by brute force on small cases (an auction stopping within a tolerance of it landed on another
    near-optimal assignment, and expert parallelism's last-bit changes in the scores then changed the routing:
    EP=2 drifted from EP=1 by 2.5e-5 in two steps); larger cases are balanced and unmoved by 1-ulp noise."""
    for seed, (t, e) in enumerate([(6, 3), (8, 2), (8, 4), (9, 3), (6, 1)] * 4):
        scores = torch.randn(t, e, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        got = balanced_assignment(scores, t // e)
        shares = sum(([x] * (t // e) for x in range(e)), [])
        best = max(sum(float(scores[i, x]) for i, x in enumerate(p)) for p in set(itertools.permutations(shares)))
        assert sum(float(scores[i, x]) for i, x in enumerate(got.tolist())) == pytest.approx(best, abs=1e-9)
    for seed, (t, e) in enumerate([(256, 8), (512, 16)]):
        g = torch.Generator().manual_seed(seed)
        scores = torch.randn(t, e, generator=g)
        got = balanced_assignment(scores, t // e)
        assert torch.bincount(got, minlength=e).tolist() == [t // e] * e
        assert torch.equal(got, balanced_assignment(scores * (1 + 1.2e-7 * torch.randn(t, e, generator=g)), t // e))


def test_sam_routes_inside_the_group_with_the_most_mass_and_reports_its_alignment_loss():
    moe = build("sam", capacity_factor=0.0, groups=2, top_k=2)
    x = torch.randn(TOKENS, DIM, dtype=torch.float64)
    probs = moe.gate.router(x).softmax(-1).view(-1, 2, 3)
    mass = probs.sum(-1)
    group = mass.argmax(-1)
    routing = moe.gate(x)
    assert ((routing.expert // 3) == group.unsqueeze(-1)).all()
    torch.testing.assert_close(routing.aux["alignment"], 0.01 * (1 - mass.max(-1).values).mean())
    inside = probs[torch.arange(TOKENS), group]
    torch.testing.assert_close(routing.weight, inside.topk(2, -1).values / inside.sum(-1, keepdim=True))


@pytest.mark.parametrize("decay", ["exponential", "linear"])
def test_dts_temperature_decays_then_the_gate_turns_top1(decay):
    moe = build("dts", capacity_factor=1.0, dts_decay=decay, dts_decay_steps=100, dts_top1_step=150)
    gate = moe.gate
    expected = (lambda s: 1.0 * 0.5 ** (min(s, 100) / 100)) if decay == "exponential" else \
        (lambda s: 1.0 - 0.5 * min(s, 100) / 100)
    for step in (0, 50, 100, 140):
        gate.set_step(step)
        assert gate.temperature() == pytest.approx(expected(step))
    x = torch.randn(TOKENS, DIM, dtype=torch.float64)
    gate.set_step(10)
    dense = gate(x)
    assert dense.expert.shape == (TOKENS, 6) and dense.capacity == 0
    assert torch.equal(dense.kept, dense.weight > 0.001)
    gate.set_step(150)
    sparse = gate(x)
    assert sparse.expert.shape == (TOKENS, 1) and sparse.capacity == math.ceil(TOKENS / 6)
    assert "gate.step" in moe.state_dict()  # persistent: a resumed run continues the schedule


def test_specs_that_cannot_route_are_refused():
    with pytest.raises(ConfigValueError, match="model.moe.gate: 'top3' is not a gate"):
        MoESpec(gate="top3")
    with pytest.raises(ConfigValueError, match="model.moe.top_k: 3 prototypes must divide model.moe.experts .8."):
        MoESpec(gate="ktop1", experts=8, top_k=3)
    with pytest.raises(ConfigValueError, match="model.moe.top_k: 9 choices"):
        MoESpec(gate="sam", experts=8, groups=1, top_k=9)
    # a top_k the gate would ignore (gshard is top-2, switch/hash/base top-1, dts dense then top-1)
    with pytest.raises(ConfigValueError, match="model.moe.top_k: gate gshard routes 2 choice.s. per token, so "
                                               "top_k 3 would be ignored"):
        MoESpec(gate="gshard", experts=8, top_k=3)
    for gate in ("switch", "hash", "base", "dts"):
        with pytest.raises(ConfigValueError, match=f"gate {gate} routes 1 choice"):
            MoESpec(gate=gate, experts=8, top_k=2)
        assert MoESpec(gate=gate, experts=8).top_k == MoESpec(gate=gate, experts=8, top_k=1).top_k == 1
    with pytest.raises(ConfigValueError, match="model.moe.top_k: 2 choices for gate gshard with 1 experts"):
        MoESpec(gate="gshard", experts=1)  # top-2 of one expert
    with pytest.raises(ConfigValueError, match="model.moe.groups: must be >= 1, got 0"):
        MoESpec(gate="sam", experts=8, groups=0)
    assert MoESpec(gate="ktop1", experts=8).top_k == MoESpec(gate="sam", experts=8).top_k == 2


def test_dts_dense_phase_counts_no_drops_for_inactive_experts():
    """In DTS's dense phase an expert under the threshold is no choice of the token, not a dropped one: with no
    capacity (dropless), the drop rate is 0, the choices counted are the active ones, and the tokens per expert
    count each active expert."""
    moe = build("dts", capacity_factor=0.0, experts=4, dts_threshold=0.3)
    moe.train()
    x = torch.randn(TOKENS, DIM, dtype=torch.float64)
    moe(x)
    stats = moe.stats.take()
    assert stats["drop_rate"] == 0.0
    active = sum(stats["tokens_per_expert"])
    assert 0 < active < 4 * TOKENS  # some experts are under the threshold, every token has an active one


# ------------------------------------------------------------------------------------------------- GPT-MoE, engine
def gpt_moe(**moe):
    from angel_ptm.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32,
                         moe={"experts": 8, "gate": "gshard", "capacity_factor": 0.5, "every": 1,
                              **moe}))


def skewed_batches(steps=8):
    """Token ids drawn mostly from a few values, so some experts get no token in some steps."""
    g = torch.Generator().manual_seed(2)
    weights = torch.tensor([0.25 ** i for i in range(64)])
    return [(torch.multinomial(weights, 32, True, generator=g).view(2, 16),
             torch.randint(0, 64, (2, 16), generator=g)) for _ in range(steps)]


def train_torch(model, batches):
    """torch.optim.AdamW (test_engine_equivalence's settings); the losses and, per step, each layer's tokens per
    expert."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses, routed = [], []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()  # set_to_none: an expert that did not run keeps grad None and is skipped next step
        losses.append(loss.item())
        routed.append([block.feed_forward.stats.take()["tokens_per_expert"] for block in model.layers])
    return losses, routed


@pytest.mark.parametrize("gate", ["gshard", "switch", "hash"])
@pytest.mark.parametrize("placement", ["device", "disk"])
def test_gpt_moe_in_the_engine_trains_like_torch_adamw(tmp_path, gate, placement):
    """The engine gives the losses of torch.optim.AdamW (fp32, within 1e-6), with pages smaller than the tensors.
    An expert that got no token in a step has no gradient (it never ran): as torch skips a parameter whose .grad is
    None, its update is skipped (moments and bias-correction step untouched), not applied to zeros."""
    import angel_ptm
    from conformance_cases import place
    from test_engine_equivalence import assert_same_losses, engine_config, run_steps

    batches = skewed_batches()
    plain = gpt_moe(gate=gate)
    torch.manual_seed(11)  # gshard's sampling
    expected, routed = train_torch(plain, batches)
    if gate != "gshard":  # (its sampled second choices reach every expert)
        assert any(0 in tokens for step in routed for tokens in step), "no step left an expert idle"
    model = gpt_moe(gate=gate)
    memory = {"page_bytes": 4096, "disk_dir": str(tmp_path), "scheduler": "planned"}
    engine = angel_ptm.initialize(model, place(engine_config(memory), model, placement))
    try:
        torch.manual_seed(11)
        losses = run_steps(engine, batches, lambda m, x, y: m(x, y))
    finally:
        engine.close()
    assert_same_losses(expected, losses)


@pytest.mark.parametrize("acts", [{"checkpoint": "full"}, {"checkpoint": "selective", "offload": "host"}])
def test_gpt_moe_recomputes_its_blocks_with_their_experts_inside(tmp_path, acts):
    """activations.checkpoint on a GPT-MoE: each block is recomputed in backward with its experts (paging units of
    their own, nested in it) bound to copies as the block's parameters are, gshard's sampling replayed: the losses
    of keeping every activation, bitwise."""
    import angel_ptm
    from test_engine_equivalence import engine_config, run_steps

    batches = skewed_batches()
    runs = []
    for activations in ({}, dict(acts, offload_min_bytes="1KiB")):
        model = gpt_moe(gate="gshard")
        config = engine_config({"page_bytes": 4096, "disk_dir": str(tmp_path / str(len(runs)))})
        engine = angel_ptm.initialize(model, dict(config, activations=activations))
        try:
            torch.manual_seed(11)
            runs.append(run_steps(engine, batches, lambda m, x, y: m(x, y)))
        finally:
            engine.close()
    assert runs[0] == runs[1]


def test_configs_moe_trains_through_the_cli_with_loss_falling_and_logs_the_routing(tmp_path):
    """`angel-ptm train configs/moe.yaml` (shrunk to seconds): the loss falls, and every step's metrics name each
    MoE layer's tokens per expert, drop rate and aux loss; the DTS gate's schedule step is set by the trainer."""
    import json
    from pathlib import Path

    from angel_ptm import cli

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"

    def train(run_dir, steps, *overrides):
        small = ["model.dim=64", "model.n_head=2", "model.seq_len=32", "trainer.eval_every=0",
                 f"trainer.steps={steps}", f"run.dir={run_dir}", *overrides]
        return cli.main(["train", str(root / "configs" / "moe.yaml"), "--no-progress",
                         *[arg for key in small for arg in ("--set", key)]])

    assert train(run, 16, "memory.page_bytes=64KiB", "memory.device_budget=4MiB", "memory.host_budget=2MiB") == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert len(steps) == 16
    assert sum(r["loss"] for r in steps[-4:]) < sum(r["loss"] for r in steps[:4])
    for row in steps:
        assert set(row["moe"]) == {"layers.1.feed_forward", "layers.3.feed_forward"}
        assert {"expert_moved", "expert_prefetch_wasted", "deviations", "stall_s"} <= set(row)  # experts' traffic
        assert {"expert_accesses_skipped", "expert_accesses_unplanned", "expert_fetches_cancelled",  # on every line
                "expert_accesses_reordered", "expert_fetches_resumed", "experts_cold_pages"} <= set(row)
        for layer in row["moe"].values():
            assert len(layer["tokens_per_expert"]) == 8 and 0 <= layer["drop_rate"] < 1 and layer["aux_loss"] > 0
            # top-2 over 8 x 32 tokens, less the dropped choices
            assert sum(layer["tokens_per_expert"]) == round(2 * 8 * 32 * (1 - layer["drop_rate"]))
    assert train(tmp_path / "dts", 3, "model.moe.gate=dts", "model.moe.dts_top1_step=2",
                 "model.moe.capacity_factor=0") == 0
    last = [json.loads(line) for line in (tmp_path / "dts" / "metrics.jsonl").read_text().splitlines()][-1]
    assert all(sum(layer["tokens_per_expert"]) == 8 * 32 for layer in last["moe"].values())  # top-1 from step 2


def test_the_moe_settings_are_checked_by_key():
    from angel_ptm.config import load_config
    from angel_ptm.errors import UnknownKeyError

    with pytest.raises(UnknownKeyError, match="unknown config key 'model.moe.expert' .valid keys in model.moe: every"):
        load_config({"model": {"moe": {"expert": 8}}})
    with pytest.raises(ConfigValueError, match="model.moe.every: must be >= 1, got 0"):
        load_config(None, ["model.moe.every=0"])
    config = load_config(None, ["model.moe.experts=4", "model.moe.gate=switch"])
    assert config.model.moe["experts"] == 4 and config.model.moe["capacity_factor"] == 1.25
    from angel_ptm.config import config_to_dict

    assert load_config(config_to_dict(config)).model.moe == config.model.moe


def test_a_gpt_moe_built_on_the_meta_device_materializes_the_values_of_a_normal_build(tmp_path):
    import angel_ptm
    from angel_ptm.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32, moe={"experts": 4, "gate": "dts"})
    torch.manual_seed(0)
    expected = GPT(cfg).state_dict()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    engine = angel_ptm.initialize(model, {"memory": {"disk_dir": str(tmp_path)}})
    try:
        got = engine.state_dict()
    finally:
        engine.close()
    assert got.keys() == expected.keys() and "layers.0.feed_forward.gate.step" in got
    for name, value in expected.items():
        assert torch.equal(got[name].cpu(), value), name  # (the engine's device: a GPU where there is one)


@pytest.mark.parametrize("gate", ["gshard", "dts", "hash"])
def test_experts_run_in_any_order_give_the_same_output_and_gradients_bitwise(gate):
    """MoE.expert_order (set by the paging runtime to run the experts whose weights are in place first): any order
    of the experts gives the same output and gradients, bit for bit -- also where a token's choices are more than
    two (DTS's dense phase: every expert a choice), where the order of a sum matters."""
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def run(order):
        moe = build(gate, dtype=torch.float32, capacity_factor=0.0, dts_threshold=0.0)
        calls = []
        if order is not None:
            moe.expert_order = lambda experts: calls.append(list(experts)) or order(experts)
        torch.manual_seed(5)  # (gshard's and DTS's sampling)
        out = moe(x)
        grads = torch.autograd.grad(out.square().sum(), [x] + list(moe.parameters()), allow_unused=True)
        return out, grads, calls

    out, grads, _ = run(None)
    for order in (lambda e: e[::-1], lambda e: e[1::2] + e[0::2]):
        got, got_grads, calls = run(order)
        assert calls and len(calls[0]) > 2
        assert torch.equal(got, out)
        for a, b in zip(got_grads, grads):
            assert (a is None and b is None) or torch.equal(a, b)

