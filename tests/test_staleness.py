"""optimizer.staleness 1: the delayed parameter update (ZeRO-Offload's DPU) against a reference loop written here.

The reference: step t+1's forward and backward use the parameters after update t-1, and update t applies g_t to the
master weights after update t-1. Its updates use the same fused AdamW kernel the engine runs on CPU pages (the kernel
is elementwise, so where a tensor sits in a page does not change a bit), so the losses must be *equal*, not close.
"""

import pytest
import torch

import angel_ptm
from angel_ptm.optim.fused_adam import fused_adamw_

from test_engine_equivalence import CASES, PLACEMENTS, gpt, gpt_batches, gpt_loss

HP = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def apply_update(master, grads, exp_avg, exp_avg_sq, step):
    for p, g, m, v in zip(master, grads, exp_avg, exp_avg_sq):
        fused_adamw_(p.view(-1), g.reshape(-1), m.view(-1), v.view(-1), lr=HP["lr"], beta1=HP["betas"][0],
                     beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"], step=step)


def train_delayed_reference(model, batches, loss_fn, grad_accum=1, flush=False, clip=None):
    """Plain PyTorch with a delayed update; returns the losses of every micro-batch and the final master weights."""
    params = list(model.parameters())
    master = [p.detach().clone() for p in params]
    exp_avg = [torch.zeros_like(p) for p in master]
    exp_avg_sq = [torch.zeros_like(p) for p in master]
    pending, step, losses = None, 0, []
    for start in range(0, len(batches), grad_accum):
        for batch in batches[start : start + grad_accum]:
            loss = loss_fn(model, *batch) / grad_accum
            loss.backward()
            losses.append(loss.item())
        if clip:  # the coefficient of step t's gradients, applied by update t
            torch.nn.utils.clip_grad_norm_(params, clip)
        grads = [p.grad.detach().clone() for p in params]
        for p in params:
            p.grad = None
        if pending is not None:  # update t-1, then the next step computes with its result
            step += 1
            apply_update(master, pending, exp_avg, exp_avg_sq, step)
            with torch.no_grad():
                for p, w in zip(params, master):
                    p.copy_(w)
        pending = grads
    if flush and pending is not None:
        apply_update(master, pending, exp_avg, exp_avg_sq, step + 1)
    return losses, master


def train_engine(model, batches, loss_fn, memory, grad_accum=1, flush=False, dtype="float32", clip=None):
    config = {"optimizer": dict(HP, staleness=1), "memory": memory,
              "trainer": {"device": "cpu", "grad_clip": clip or 0, "grad_accum": grad_accum, "dtype": dtype}}
    engine = angel_ptm.initialize(model, config)
    names = [name for name, _ in model.named_parameters()]
    losses = []
    try:
        for start in range(0, len(batches), grad_accum):
            for batch in batches[start : start + grad_accum]:
                loss = loss_fn(engine, *batch) / grad_accum
                engine.backward(loss)
                losses.append(loss.item())
            if clip:
                engine.clip_grad_norm(clip)
            engine.step()
        if flush:
            engine.flush()
        master = [engine.master_parameter(name) for name in names]
        return losses, master, engine.memory_stats()
    finally:
        engine.close()



@pytest.mark.parametrize("scheduler", ["on_demand", "planned"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_gpt_losses_equal_the_delayed_update_reference(placement, scheduler, tmp_path):
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler=scheduler)
    expected, _ = train_delayed_reference(gpt(), gpt_batches(), gpt_loss)
    actual, _, stats = train_engine(gpt(), gpt_batches(), gpt_loss, memory)
    assert actual == expected
    if placement == "device+host+disk":
        assert stats["moved"]["host->disk"] > 0 and stats["moved"]["disk->host"] > 0


@pytest.mark.parametrize("case", ["mlp", "tied"])
def test_other_models_equal_the_reference_and_flush_lands_the_last_update(case, tmp_path):
    build, data, loss_fn = CASES[case]
    memory = dict(PLACEMENTS["device+host+disk"], disk_dir=str(tmp_path))
    expected, expected_master = train_delayed_reference(build(), data(), loss_fn, flush=True)
    actual, master, _ = train_engine(build(), data(), loss_fn, memory, flush=True)
    assert actual == expected
    for want, got in zip(expected_master, master):
        assert torch.equal(want, got)


def test_gradient_accumulation_equals_the_reference(tmp_path):
    memory = dict(PLACEMENTS["device+host+disk"], disk_dir=str(tmp_path))
    expected, _ = train_delayed_reference(gpt(), gpt_batches(), gpt_loss, grad_accum=2)
    actual, _, _ = train_engine(gpt(), gpt_batches(), gpt_loss, memory, grad_accum=2)
    assert actual == expected


def test_gradient_clipping_matches_the_reference(tmp_path):
    """Clipping reads step t+1's gradients after update t has read step t's; the coefficient goes with its update.
    The global norm is summed in a different order than torch's (per page segment), hence approx, not equal."""
    memory = dict(PLACEMENTS["device+host+disk"], disk_dir=str(tmp_path), scheduler="planned")
    expected, _ = train_delayed_reference(gpt(), gpt_batches(), gpt_loss, clip=0.5)
    actual, _, _ = train_engine(gpt(), gpt_batches(), gpt_loss, memory, clip=0.5)
    assert actual == pytest.approx(expected, rel=1e-6)


def test_staleness_changes_the_trajectory_and_differs_from_staleness_0(tmp_path):
    """The delayed update is not a relabelled synchronous one: from the third step on the losses differ."""
    memory = dict(PLACEMENTS["device"], disk_dir=str(tmp_path))
    delayed, _, _ = train_engine(gpt(), gpt_batches(), gpt_loss, memory)
    config = {"optimizer": HP, "memory": memory, "trainer": {"device": "cpu", "grad_clip": 0}}
    engine = angel_ptm.initialize(gpt(), config)
    synchronous = []
    for x, y in gpt_batches():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        synchronous.append(loss.item())
    engine.close()
    x2, y2 = gpt_batches()[1]
    assert delayed[0] == synchronous[0]
    assert delayed[1] == gpt()(x2, y2).item()  # step 2 still computes with the initial weights
    assert all(d != s for d, s in zip(delayed[1:], synchronous[1:]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_runs_give_identical_losses(dtype, tmp_path):
    runs = []
    for k in range(2):
        memory = dict(PLACEMENTS["device+host+disk"], disk_dir=str(tmp_path / str(k)), scheduler="planned")
        losses, _, _ = train_engine(gpt(), gpt_batches(), gpt_loss, memory, dtype=dtype)
        runs.append(losses)
    assert runs[0] == runs[1]
    assert all(torch.isfinite(torch.tensor(runs[0])))


def test_updates_run_during_the_next_forward(tmp_path):
    """Update t is spread over step t+1's forward: by the time backward starts, every group has been updated."""
    memory = dict(PLACEMENTS["device+host+disk"], disk_dir=str(tmp_path))
    config = {"optimizer": dict(HP, staleness=1), "memory": memory, "trainer": {"device": "cpu", "grad_clip": 0}}
    engine = angel_ptm.initialize(gpt(), config)
    try:
        (x, y), (x2, y2) = gpt_batches()[:2]
        engine.backward(engine(x, y))
        engine.step()
        assert len(engine.delayed.pending) == engine.layout.n_pages  # opened, nothing run yet
        loss = engine(x2, y2)
        assert not engine.delayed.pending  # the forward ran them all
        assert engine.delayed.unpublished  # but the parameters still hold the old values
        engine.backward(loss)
        engine.step()
        assert len(engine.delayed.pending) == engine.layout.n_pages and not engine.delayed.unpublished
    finally:
        engine.close()


def test_estimate_counts_master_pages_for_fp32_with_staleness_1():
    from angel_ptm.memory.placement import creation_order
    from angel_ptm.config import load_config

    assert "master" not in creation_order(load_config({"optimizer": {"staleness": 0}}))
    assert "master" in creation_order(load_config({"optimizer": {"staleness": 1}}))


def test_state_dicts_hold_the_pending_update_and_leave_the_run_as_it_was(tmp_path):
    """staleness 1: state_dict() and optimizer_state_dict() run the pending update first, as save_checkpoint does
    (update t, not only t-1, and step t), and the run goes on with the losses it has without them."""
    build, batches_of, loss_fn = CASES["mlp"]
    batches = batches_of()[:5]
    config = {"optimizer": dict(HP, staleness=1), "trainer": {"device": "cpu", "grad_clip": 0},
              "memory": dict(PLACEMENTS["device"], disk_dir=str(tmp_path))}
    runs = []
    for read in (False, True):
        engine = angel_ptm.initialize(build(), config)
        try:
            losses = []
            for i, batch in enumerate(batches):
                loss = loss_fn(engine, *batch)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if read and i == 2:
                    state, optimizer = engine.state_dict(), engine.optimizer_state_dict()
                    assert {s["step"].item() for s in optimizer["state"].values()} == {3}
            runs.append(losses)
        finally:
            engine.close()
    assert runs[0] == runs[1]
    _, master = train_delayed_reference(build(), batches[:3], loss_fn, flush=True)
    for (name, value), expected in zip(state.items(), master):
        assert torch.equal(value, expected), name


class Residual(torch.nn.Module):
    """Three residual blocks of one 61x61 page-sized linear each, between an input and an output layer (the root's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(13, 61)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(61, 61), torch.nn.LayerNorm(61))
                                          for _ in range(3))
        self.out = torch.nn.Linear(61, 3)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return (self.out(h) - y).pow(2).mean()


def test_a_device_too_small_for_the_delayed_update_beside_the_open_units_is_refused_at_start(tmp_path):
    """The delayed update runs its page groups during the next step's forward and backward, beside the pages the
    open units pin: a device budget that holds the largest unit but not that is refused at start (it trained one
    step, then raised a BudgetError mid-forward); one page more trains."""
    from angel_ptm.errors import BudgetError

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]

    def job(device_kib):
        return {"optimizer": {"lr": 1e-2, "staleness": 1},
                "memory": {"page_bytes": "20KiB", "device_budget": f"{device_kib}KiB", "host_budget": "84KiB",
                           "disk_dir": str(tmp_path)}, "trainer": {"device": "cpu", "grad_clip": 0}}
    with pytest.raises(BudgetError, match="delayed update's page group \\(4 pages"):
        angel_ptm.initialize(Residual(), job(104))
    engine = angel_ptm.initialize(Residual(), job(120))
    try:
        for x, y in data:
            engine.backward(engine(x, y))
            engine.step()
    finally:
        engine.close()


class Branch(torch.nn.Module):
    """A branch (`b`) that some steps skip: its pages get no gradient then."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.out = torch.nn.Linear(13, 61), torch.nn.Linear(61, 61), torch.nn.Linear(61, 3)

    def forward(self, x, y, branch: bool):
        h = torch.tanh(self.a(x))
        if branch:
            h = h + torch.tanh(self.b(h))
        return (self.out(h) - y).pow(2).mean()


def test_a_step_dropped_after_its_backward_leaves_the_parameters_after_the_pending_update_whole(tmp_path):
    """backward then zero_grad (a step dropped, say for a bad batch) under staleness 1: that backward published the
    pending update on the pages that became final in it (a and out, not the skipped branch's), and the next step
    computed with a mix of two updates' parameters (a different mix on each rank: 2.7e-2 between 2 ranks and 1 in a
    probe). Now the rest is published too: the next step computes as after flush()."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g)) for _ in range(4)]
    config = {"optimizer": dict(HP, staleness=1), "memory": {"page_bytes": "4KiB", "disk_dir": str(tmp_path)},
              "trainer": {"device": "cpu"}}

    def run(drop: bool) -> float:
        engine = angel_ptm.initialize(Branch(), config)
        try:
            for x, y in batches[:2]:
                engine.backward(engine(x, y, True))
                engine.step()
            if drop:
                engine.backward(engine(*batches[2], False))  # the branch gets no gradient: its pages never final
                engine.zero_grad()
            else:
                engine.flush()
            return engine(*batches[3], True).item()
        finally:
            engine.close()

    assert run(drop=True) == run(drop=False)
