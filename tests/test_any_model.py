"""Regression tests for issue 16: models the engine was not written for, misuse, state dicts, failed steps.

Each test states one behaviour; the failures found by outside probes each have one here (NaN for saved multi-page
parameters, MultiheadAttention, the estimate accepting an impossible staging job, frozen/unused parameters, a torn
optimizer step)."""

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import (BudgetError, EngineClosedError, EngineFailedError, PageIOError, ParameterAccessError,
                              StateDictError)
from angel_ptm.estimate import estimate_job
from angel_ptm.lr import lr_at
from angel_ptm.memory import Tier
from angel_ptm.units import find_units
from tests.test_engine_equivalence import assert_same_losses, run_steps

ADAMW = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
STEPS = 5


def config(memory, **trainer):
    return {"optimizer": ADAMW, "memory": memory, "trainer": {"device": "cpu", "grad_clip": 0, **trainer}}


def torch_losses(model, batches, loss_fn, lrs=None):
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for step, batch in enumerate(batches):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[step]
        loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


class MatmulWeight(nn.Module):
    """A 64x512 weight (128 KiB) used as `pre(x) @ w`: autograd saves the parameter itself, and it spans pages."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(16, 64)
        self.w = nn.Parameter(torch.randn(64, 512) * 0.05)

    def forward(self, x):
        return (self.pre(x) @ self.w).tanh().mean(dim=1)


def matmul_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=g),) for _ in range(STEPS)]


def regression_loss(model, x):
    return (model(x) - x[:, 0].sin()).pow(2).mean()


@pytest.mark.parametrize("scheduler", ["on_demand", "planned"])
def test_a_saved_parameter_spanning_pages_trains_like_torch(scheduler, tmp_path):
    expected, _ = torch_losses(MatmulWeight(), matmul_batches(), regression_loss)
    engine = angel_ptm.initialize(MatmulWeight(), config({"page_bytes": "64KiB", "disk_dir": str(tmp_path),
                                                          "scheduler": scheduler}))
    assert engine.layout.slot("w").spans_pages
    try:
        actual = run_steps(engine, matmul_batches(), regression_loss)
    finally:
        engine.close()
    assert_same_losses(expected, actual)


class Encoder(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean(dim=(1, 2))


def test_multihead_attention_reads_out_proj_inside_its_layer_unit(tmp_path):
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(4, 6, 32, generator=g),) for _ in range(STEPS)]

    def loss_fn(model, x):
        return (model(x) - 1.0).pow(2).mean()

    expected, _ = torch_losses(Encoder(), batches, loss_fn)
    model = Encoder()
    assert [u.name for u in find_units(model)] == ["<root>", "encoder.layers.0", "encoder.layers.1"]
    engine = angel_ptm.initialize(model, config({"page_bytes": "4KiB", "disk_dir": str(tmp_path)}))
    try:
        actual = run_steps(engine, batches, loss_fn)
    finally:
        engine.close()
    assert_same_losses(expected, actual)


def three_layer_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))


def test_the_estimate_refuses_a_unit_the_host_cannot_stage_from_disk(tmp_path):
    # Units of 3 pages (a 64 KiB weight and a page for its bias, 32 KiB pages); 9 pages per kind, 36 state pages;
    # the device holds 4, the host 3: pages on disk rise through the host, which must hold a unit's pages plus one.
    memory = {"page_bytes": "32KiB", "device_budget": "128KiB", "host_budget": "96KiB", "disk_dir": str(tmp_path)}
    estimate = estimate_job(config(memory), three_layer_mlp())
    assert not estimate.fits and estimate.problems[0].tier == "host"
    with pytest.raises(BudgetError, match="host tier budget exceeded for staging unit"):
        angel_ptm.initialize(three_layer_mlp(), config(memory))
    memory["host_budget"] = "128KiB"  # one slot more than the unit: it fits, and it runs
    assert estimate_job(config(memory), three_layer_mlp()).fits
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 128, generator=g),) for _ in range(STEPS)]
    def loss_fn(model, x):
        return (model(x) - x.sin()).pow(2).mean()

    expected, _ = torch_losses(three_layer_mlp(), batches, loss_fn)
    engine = angel_ptm.initialize(three_layer_mlp(), config(memory))
    try:
        actual = run_steps(engine, batches, loss_fn)
        assert engine.memory_stats()["moved"]["disk->host"] > 0
    finally:
        engine.close()
    assert_same_losses(expected, actual)


class FrozenAndUnused(nn.Module):
    """More pages of tensors without gradients (frozen, unused: 7 of 4 KiB) than the auto host budget's 4 slots."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.used = nn.Linear(64, 1)
        self.unused = nn.Parameter(torch.ones(64, 32))

    def forward(self, x):
        return self.used(torch.relu(self.frozen(x))).squeeze(1)


@pytest.mark.parametrize("scheduler", ["on_demand", "planned"])
def test_frozen_and_unused_parameters_train_on_with_everything_on_the_device(scheduler, tmp_path):
    # Used to crash the second step: their grad pages were zeroed on the host each step until it had to evict one,
    # with no disk tier. Now a grad page that only tensors without gradients use is never materialized.
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(4, 64, generator=g),) for _ in range(STEPS)]
    expected, opt = torch_losses(FrozenAndUnused(), batches, regression_loss)
    engine = angel_ptm.initialize(FrozenAndUnused(), config({"page_bytes": "4KiB", "disk_dir": str(tmp_path),
                                                             "scheduler": scheduler}))
    try:
        actual = run_steps(engine, batches, regression_loss)
        torch.testing.assert_close(engine.parameter("frozen.weight"), FrozenAndUnused().frozen.weight.detach())
        torch.testing.assert_close(engine.parameter("unused"), torch.ones(64, 32))
        # Frozen tensors are on parameter pages only (no grad, exp_avg or exp_avg_sq pages at all)...
        layout = engine.layout
        assert all(layout.frozen(layout.slot(n)) for n in ("frozen.weight", "frozen.bias"))
        assert {kind: len(pages) for kind, pages in engine.pages.items()} == {
            kind: layout.n_pages if kind == "param" else layout.trainable_pages for kind in engine.pages}
        assert layout.n_pages - layout.trainable_pages == 5  # a 16 KiB weight and a bias, in pages of 4 KiB
        # ...and a grad page that only the unused tensor uses is never materialized.
        for index in layout.slot("unused").pages:
            assert {slot.name for slot in layout.tensors_on(index)} == {"unused"}
            assert engine.pages["grad"][index].dead or engine.pages["grad"][index].untouched
        state = engine.optimizer_state_dict()["state"]
        assert sorted(state) == sorted(opt.state_dict()["state"])  # no state for the frozen and the unused
    finally:
        engine.close()
    assert_same_losses(expected, actual)


def test_a_parameter_touched_outside_its_unit_raises_naming_it_and_its_unit(tmp_path):
    model = Encoder()
    engine = angel_ptm.initialize(model, config({"page_bytes": "4KiB", "disk_dir": str(tmp_path)}))
    try:
        with pytest.raises(ParameterAccessError, match=r"'head\.weight' used outside .* unit '<root>'"):
            model.head.weight.sum()
        with pytest.raises(ParameterAccessError, match=r"'encoder\.layers\.1\.linear1\.weight' .* "
                                                       r"unit 'encoder\.layers\.1'"):
            model.encoder.layers[1].linear1(torch.randn(2, 32))
        with pytest.raises(ParameterAccessError, match=r"unit '<root>' ran with gradients enabled outside engine"):
            model(torch.randn(2, 6, 32))  # autograd would save views of pages that move
        with torch.no_grad():
            torch.testing.assert_close(model(torch.randn(2, 6, 32)).shape, torch.Size([2]))  # evaluating is fine
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in Encoder().parameters())
        assert "values in pages" in repr(model.head.weight)
        assert model.head.weight.shape == (1, 32) and model.head.weight.dtype == torch.float32
    finally:
        engine.close()


def disk_memory(tmp_path, scheduler="on_demand"):
    # MatmulWeight: 3 pages of 64 KiB per kind (w spans two), 12 state pages; 4 on the device, 4 on the host
    return {"page_bytes": "64KiB", "device_budget": "256KiB", "host_budget": "256KiB", "disk_dir": str(tmp_path),
            "scheduler": scheduler}


def test_state_dicts_hold_real_values_in_torch_formats(tmp_path):
    batches = matmul_batches()
    reference = MatmulWeight()
    _, opt = torch_losses(reference, batches, regression_loss)
    model = MatmulWeight()
    engine = angel_ptm.initialize(model, config(disk_memory(tmp_path)))
    try:
        run_steps(engine, batches, regression_loss)
        expected = reference.state_dict()
        pages = [page for kind in engine.pages.values() for page in kind]
        tiers, moved = [page.tier for page in pages], dict(engine.memory_stats()["moved"])
        assert Tier.DISK in tiers  # some states are read from disk
        states = (engine.state_dict(), model.state_dict(), engine.optimizer_state_dict())
        assert [page.tier for page in pages] == tiers and engine.memory_stats()["moved"] == moved  # nothing moved
        for state in states[:2]:
            assert list(state) == list(expected)
            for key in expected:
                torch.testing.assert_close(state[key], expected[key], rtol=1e-5, atol=1e-6)
        ours, theirs = states[2], opt.state_dict()
        assert ours["param_groups"] == theirs["param_groups"]
        assert sorted(ours["state"]) == sorted(theirs["state"])
        for index, entry in theirs["state"].items():
            assert float(ours["state"][index]["step"]) == float(entry["step"])
            for kind in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours["state"][index][kind], entry[kind], rtol=1e-5, atol=1e-8)
        torch.save(model.state_dict(), tmp_path / "model.pt")  # real values, saveable during training
        with pytest.raises(ParameterAccessError):
            model.w.sum()  # ...and unbound again once state_dict() returned
    finally:
        engine.close()


def test_a_run_moves_from_torch_and_back_through_state_dicts(tmp_path):
    batches = matmul_batches() * 2
    reference = MatmulWeight()
    expected, _ = torch_losses(reference, batches, regression_loss)
    half = len(batches) // 2
    start = MatmulWeight()
    _, opt = torch_losses(start, batches[:half], regression_loss)  # a plain torch run, resumed in the engine
    engine = angel_ptm.initialize(MatmulWeight(), config(disk_memory(tmp_path)))
    try:
        engine.load_state_dict(start.state_dict())
        engine.load_optimizer_state_dict(opt.state_dict())
        actual = run_steps(engine, batches[half:], regression_loss)
        with pytest.raises(StateDictError, match="missing keys"):
            engine.load_state_dict({"w": torch.zeros(64, 512)})
        with pytest.raises(StateDictError, match=r"'w' has shape \(2, 2\)"):
            engine.load_state_dict(dict(start.state_dict(), w=torch.zeros(2, 2)))
    finally:
        engine.close()
    assert_same_losses(expected[half:], actual)


def test_after_close_the_model_holds_its_trained_weights(tmp_path):
    batches = matmul_batches()
    reference = MatmulWeight()
    torch_losses(reference, batches, regression_loss)
    model = MatmulWeight()
    engine = angel_ptm.initialize(model, config(disk_memory(tmp_path)))
    run_steps(engine, batches, regression_loss)
    engine.close()
    engine.close()  # a second close does nothing
    assert type(model.w) is nn.Parameter
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    x = batches[0][0]
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    regression_loss(model, x).backward()  # an ordinary module again
    assert model.w.grad is not None
    with pytest.raises(EngineClosedError, match="the engine was closed"):  # not a silent no-op
        regression_loss(engine, x)
    for call in (engine.step, engine.zero_grad, lambda: engine.save_checkpoint(tmp_path / "ckpt")):
        with pytest.raises(EngineClosedError):
            call()


def test_an_io_error_inside_step_fails_the_engine_instead_of_training_on(tmp_path, monkeypatch):
    engine = angel_ptm.initialize(MatmulWeight(), config(disk_memory(tmp_path)))
    try:
        batches = matmul_batches()
        run_steps(engine, batches[:2], regression_loss)
        disk = engine.manager.disk
        real_read, reads = disk.read, []

        class FailingHandle:
            def wait(self):
                raise PageIOError("injected read error", errno=5, path=disk.path("exp_avg"))

        def read(kind, slot, buffer):
            reads.append(kind)
            return FailingHandle() if len(reads) == 3 else real_read(kind, slot, buffer)

        monkeypatch.setattr(disk, "read", read)
        engine.backward(regression_loss(engine, *batches[2]))
        with pytest.raises(PageIOError, match="injected"):
            engine.step()
        assert len(reads) >= 3
        monkeypatch.setattr(disk, "read", real_read)
        for call in (lambda: engine(*batches[3]), engine.step, engine.state_dict):
            with pytest.raises(EngineFailedError, match="during step 3 .*injected read error.*resume"):
                call()
    finally:
        engine.close()  # frees everything without touching the torn pages
    with pytest.raises(ParameterAccessError):
        engine.model.w.sum()  # no weights are handed back from a torn step


def test_the_engine_applies_the_configs_lr_schedule_until_set_lr(tmp_path):
    batches = matmul_batches()
    schedule = {"warmup_steps": 2, "decay": "linear", "min_lr_ratio": 0.5}
    lrs = [lr_at(s, ADAMW["lr"], 4, 2, "linear", 0.5) for s in range(STEPS)]
    expected, _ = torch_losses(MatmulWeight(), batches, regression_loss, lrs)
    engine = angel_ptm.initialize(MatmulWeight(), dict(config({"page_bytes": "64KiB", "disk_dir": str(tmp_path)},
                                                              steps=4), lr_schedule=schedule))
    try:
        seen = []
        actual = []
        for batch in batches:
            seen.append(engine.lr)
            loss = regression_loss(engine, *batch)
            engine.backward(loss)
            engine.step()
            actual.append(loss.item())
        assert seen == pytest.approx(lrs)
        assert_same_losses(expected, actual)
        engine.set_lr(1e-4)
        engine.backward(regression_loss(engine, *batches[0]))
        engine.step()
        assert engine.lr == 1e-4  # driven by hand from now on
    finally:
        engine.close()


def test_keyword_inputs_reach_the_model_on_the_device_in_the_compute_dtype(tmp_path):
    class Keyworded(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, *, extra, pair):
            assert extra.dtype == torch.bfloat16 and pair[0].dtype == torch.bfloat16
            assert pair[1].dtype == torch.int64  # integers are never cast
            return self.lin(x + extra + pair[0]).float().mean()

    engine = angel_ptm.initialize(Keyworded(), config({"page_bytes": "4KiB", "disk_dir": str(tmp_path)},
                                                      dtype="bfloat16"))
    try:
        loss = engine(torch.randn(2, 4), extra=torch.randn(2, 4), pair=(torch.randn(2, 4), torch.ones(2).long()))
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()


def test_frozen_parameters_under_mixed_precision_stay_as_they_were_rounded_once(tmp_path):
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(4, 64, generator=g),) for _ in range(3)]
    model = FrozenAndUnused()
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = angel_ptm.initialize(model, config({"page_bytes": "4KiB", "disk_dir": str(tmp_path)}, dtype="bfloat16"))
    try:
        assert "master" in engine.pages and len(engine.pages["master"]) == engine.layout.trainable_pages
        losses = run_steps(engine, batches, lambda m, x: regression_loss(m, x).float())
        assert all(torch.isfinite(torch.tensor(losses)))
        state = engine.state_dict()
        for name in ("frozen.weight", "frozen.bias"):
            assert state[name].dtype == torch.float32
            torch.testing.assert_close(state[name], original[name].bfloat16().float())
        assert not torch.equal(state["used.weight"], original["used.weight"])  # trained, in fp32
    finally:
        engine.close()


def tiny_gpt():
    from angel_ptm.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, dim=32))


ONE_RULE_MODELS = {  # model, one batch, loss
    "mlp": (three_layer_mlp, lambda: (torch.randn(4, 128),), lambda m, x: (m(x) - x.sin()).pow(2).mean()),
    "matmul": (MatmulWeight, lambda: (torch.randn(4, 16),), regression_loss),
    "gpt": (tiny_gpt, lambda: (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))), lambda m, x, y: m(x, y)),
}


@pytest.mark.parametrize("scheduler", ["on_demand", "planned"])
@pytest.mark.parametrize("case", list(ONE_RULE_MODELS))
def test_the_estimate_accepts_exactly_the_budgets_the_engine_runs(case, scheduler, tmp_path):
    # One rule for what a unit needs on each tier: over a grid of tight budgets, every job the estimate accepts
    # trains (two steps, pages on disk), and every job it refuses is refused by initialize with the same error.
    build, batch, loss_fn = ONE_RULE_MODELS[case]
    page = 16 * 1024
    largest = estimate_job(config({"page_bytes": page}), build()).largest_layer_pages
    ran = refused = 0
    for device_pages in (largest - 1, largest, largest + 2):
        for host_pages in (largest - 1, largest, largest + 1, largest + 3):
            memory = {"page_bytes": page, "device_budget": max(1, device_pages) * page,
                      "host_budget": max(1, host_pages) * page, "disk_dir": str(tmp_path), "scheduler": scheduler}
            estimate = estimate_job(config(memory), build())
            if not estimate.fits:
                with pytest.raises(BudgetError) as info:
                    angel_ptm.initialize(build(), config(memory))
                assert str(info.value) == str(estimate.problems[0].error())
                refused += 1
                continue
            engine = angel_ptm.initialize(build(), config(memory))
            try:
                for _ in range(2):
                    inputs = batch()
                    engine.backward(loss_fn(engine, *inputs))
                    engine.step()
            finally:
                engine.close()
            ran += 1
    assert ran and refused
