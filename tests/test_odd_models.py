"""Models with parts the engine was not written for, as an outside probe found them: a 0-dim parameter, a float64
one under clipping, batch norm under bf16, sparse embeddings, and offloaded activations of a model whose footprint
is unknown. Each trains as torch does, or is refused with a typed error that says what to change."""

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import ActivationError, BudgetError, ConfigValueError, ParameterAccessError
from tests.conformance_cases import place
from tests.test_engine_equivalence import assert_same_losses

ADAMW = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def config(tmp_path, **trainer):
    return {"optimizer": ADAMW, "memory": {"page_bytes": "4KiB", "disk_dir": str(tmp_path)},
            "trainer": {"device": "cpu", "grad_clip": 0, **trainer}}


def torch_losses(model: nn.Module, batches, opt=None) -> list[float]:
    """Plain torch: the model's own loss per batch, one step of `opt` each (default AdamW with the settings of
    `config`)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for x in batches:
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_losses(engine, batches) -> list[float]:
    """The same through the engine."""
    losses = []
    for x in batches:
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class OddParameters(nn.Module):
    """A learnable 0-dim temperature and a float64 vector beside an ordinary layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.scale = nn.Parameter(torch.randn(8, dtype=torch.float64))

    def forward(self, x):
        return ((torch.tanh(self.lin(x)) * self.temperature).double() * self.scale).float().pow(2).mean()


def test_a_0dim_and_a_float64_parameter_train_like_torch_with_clipping(tmp_path):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=g) for _ in range(4)]
    model = OddParameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    expected, norms = [], []
    for x in batches:
        loss = model(x)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    engine = angel_ptm.initialize(OddParameters(), config(tmp_path, grad_clip=0.05))
    losses, engine_norms = [], []
    try:
        for x in batches:
            loss = engine(x)
            engine.backward(loss)
            engine_norms.append(engine.clip_grad_norm(0.05))
            engine.step()
            losses.append(loss.item())
        assert engine.parameter("temperature").shape == () and engine.parameter("scale").dtype == torch.float64
        assert torch.allclose(engine.parameter("scale"), model.scale.detach(), rtol=1e-6, atol=0)
        assert float(engine.parameter("temperature")) == pytest.approx(model.temperature.item(), rel=1e-6)
    finally:
        engine.close()
    assert_same_losses(expected, losses)
    assert engine_norms == pytest.approx(norms, rel=1e-6)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x).float().pow(2).mean()


def test_batch_norm_under_bf16_keeps_its_running_statistics_in_bf16_as_model_to_does(tmp_path):
    """trainer.dtype bfloat16: a module's floating buffers go to the compute dtype with its parameters (batch norm's
    kernels take its running statistics in its weight's dtype), as `model.to(torch.bfloat16)` has them; the
    losses and statistics are those of plain torch in bf16 with fp32 master weights."""
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(16, 6, generator=g) for _ in range(4)]
    plain = Normed()
    master = [p.detach().clone() for p in plain.parameters()]
    plain.to(torch.bfloat16)
    opt = torch.optim.AdamW(master, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    expected = []
    for x in batches:
        loss = plain(x.bfloat16())
        loss.backward()
        for m, p in zip(master, plain.parameters()):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, plain.parameters()):
                p.copy_(m)
        expected.append(loss.item())
    model = Normed()
    engine = angel_ptm.initialize(model, config(tmp_path, dtype="bfloat16"))
    try:
        losses = engine_losses(engine, batches)
        bn, ref = model.net[1], plain.net[1]
        assert bn.running_mean.dtype == torch.bfloat16 and bn.num_batches_tracked.dtype == torch.int64
        assert torch.equal(bn.running_mean, ref.running_mean) and torch.equal(bn.running_var, ref.running_var)
    finally:
        engine.close()
    assert losses == expected
    # closed, the model keeps fp32 weights and its buffers in their own dtypes again: usable as a plain fp32 model
    assert bn.running_mean.dtype == torch.float32 and bn.num_batches_tracked.dtype == torch.int64
    assert torch.equal(bn.running_var, ref.running_var.float())
    model(batches[0])


def test_a_sparse_embedding_is_refused_at_initialize_naming_it(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ConfigValueError, match=r"^0: Embedding\(sparse=True\) gives sparse gradients"):
        angel_ptm.initialize(model, config(tmp_path))


class Wide(nn.Module):
    """Activations far larger than the states: 64 x 4096 floats saved per step, 2 KiB of parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 128)
        self.b = nn.Linear(128, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def test_offloaded_activations_of_an_unknown_footprint_warn_then_say_whose_room_ran_out(tmp_path, caplog):
    job = dict(config(tmp_path), activations={"offload": "disk", "offload_min_bytes": 256})
    with caplog.at_level("WARNING", logger="angel_ptm"):
        engine = angel_ptm.initialize(Wide(), job)
    assert "pass example_inputs= to angel_ptm.initialize" in caplog.text
    try:
        with pytest.raises(BudgetError, match="activation pages .* the room the estimate made for them is spent"):
            loss = engine(torch.randn(4096, 4))
            engine.backward(loss)
    finally:
        engine.close()


def test_a_lazy_module_not_materialized_is_refused_naming_its_parameter(tmp_path):
    model = nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 1))
    with pytest.raises(ConfigValueError, match="'0.weight' is not materialized yet"):
        angel_ptm.initialize(model, config(tmp_path))
    model(torch.ones(2, 5))  # materialized: it trains
    engine = angel_ptm.initialize(model, config(tmp_path))
    engine.close()


def test_a_model_an_open_engine_manages_is_refused_by_a_second_initialize(tmp_path):
    model = Normed()
    engine = angel_ptm.initialize(model, config(tmp_path / "a"))
    try:
        with pytest.raises(ConfigValueError, match="'net.0.weight' is managed by an engine already"):
            angel_ptm.initialize(model, config(tmp_path / "b"))
        loss = engine(torch.randn(4, 6))  # the first engine is untouched by the refusal
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()
    angel_ptm.initialize(model, config(tmp_path / "c")).close()  # once it is closed, a new engine may take it


def test_the_estimates_trace_leaves_a_module_registered_twice_as_it_was(tmp_path):
    """example_inputs' trace on fake tensors swaps the parameters for fakes and back: a block registered in two
    places (one block applied three times) gets its own parameters back, and the engine trains it as without."""
    from angel_ptm.config import load_config
    from angel_ptm.estimate import estimate_job

    class SameThrice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
            self.emb, self.blocks = nn.Linear(16, 16), nn.ModuleList([block, block, block])

        def forward(self, x):
            x = self.emb(x)
            for block in self.blocks:
                x = block(x)
            return x

    job = {"memory": {"page_bytes": "4KiB", "disk_dir": str(tmp_path)}, "trainer": {"device": "cpu"}}
    example = (torch.empty(4, 16, device="meta"),)
    model = SameThrice()
    before = {name: p for name, p in model.named_parameters()}
    estimate_job(load_config(job), model, example_inputs=example, device=torch.device("cpu"))
    assert all(p is before[name] for name, p in model.named_parameters())
    x = torch.randn(4, 16)
    losses = []
    for given in (None, example):
        engine = angel_ptm.initialize(SameThrice(), job, example_inputs=given)
        try:
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        finally:
            engine.close()
    assert losses[0] == losses[1]


class DetachedUse(nn.Module):
    """A weight also read detached (a stop-gradient) early in the forward: the node that reads it runs in backward
    after the weight's own gradient is final, when the planned scheduler would already update its page."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(40, 40)
        self.proj = nn.Linear(40, 40)
        self.layers = nn.ModuleList([nn.Linear(40, 40) for _ in range(2)])
        self.head = nn.Linear(40, 1)

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        h = torch.tanh(h @ self.proj.weight.detach().t())
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return (self.head(torch.tanh(self.proj(h))).squeeze(-1) - x.sum(1).sin()).pow(2).mean()


@pytest.mark.parametrize("placement", ["device", "disk"])
def test_a_weight_read_detached_is_not_updated_before_backward_reads_it(placement, tmp_path):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 40, generator=g) for _ in range(4)]
    expected = torch_losses(DetachedUse(), batches)
    job = config(tmp_path)  # planned, no clipping: pages are updated during backward as they become final
    job["memory"]["page_bytes"] = 4096
    model = DetachedUse()
    engine = angel_ptm.initialize(model, place(job, model, placement))
    try:
        losses = engine_losses(engine, batches)
        if placement == "disk":
            assert engine.memory_stats()["in_use"]["disk"] > 0
        assert engine.optimizer.step_count == 4
    finally:
        engine.close()
    assert_same_losses(expected, losses)


def test_a_backward_through_a_graph_from_before_the_step_is_refused_as_torch_refuses_it(tmp_path):
    model = DetachedUse()
    engine = angel_ptm.initialize(model, config(tmp_path))
    g = torch.Generator().manual_seed(1)
    xa, xb, xc = (torch.randn(8, 40, generator=g) for _ in range(3))
    try:
        la, lb = engine(xa), engine(xb)
        engine.backward(la)
        engine.step()
        with pytest.raises(ParameterAccessError, match="forward ran before the weights changed"):
            engine.backward(lb)
        del lb
        engine.zero_grad()
        engine.backward(engine(xc))  # a forward made now trains on
        engine.step()
        assert engine.optimizer.step_count == 2
    finally:
        engine.close()


class NormedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(24, 24, bias=False), nn.BatchNorm1d(24), nn.ReLU())
                                     for _ in range(2)])
        self.head = nn.Linear(24, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return (self.head(x) - x.sum(-1, keepdim=True).sin()).pow(2).mean()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recomputed_unit_updates_batch_norm_statistics_once_as_torch_does(mode, tmp_path):
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(16, 24, generator=g) for _ in range(3)]
    model = NormedBlocks()
    torch_losses(model, batches)
    engine = angel_ptm.initialize(NormedBlocks(), dict(config(tmp_path), activations={"checkpoint": mode}))
    try:
        engine_losses(engine, batches)
        buffers = dict(engine.model.named_buffers())
        for name, expected in model.named_buffers():
            assert torch.allclose(buffers[name], expected, rtol=1e-6, atol=1e-7), name
    finally:
        engine.close()


class ScaledInput(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean()


@pytest.mark.parametrize("activations", [{}, {"checkpoint": "full"}, {"offload": "host", "offload_min_bytes": 0}])
def test_an_input_changed_in_place_between_forward_and_backward_is_refused_as_torch_refuses_it(activations, tmp_path):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    engine = angel_ptm.initialize(ScaledInput(), dict(config(tmp_path), activations=activations),
                                  example_inputs=(x,))
    try:
        loss = engine(x)
        x.mul_(2)  # torch: "modified by an inplace operation" at backward
        with pytest.raises(ActivationError, match="modified by an in-place operation"):
            engine.backward(loss)
    finally:
        engine.close()


def test_example_inputs_the_forward_cannot_take_are_one_warning_line_not_a_traceback(tmp_path, capfd, caplog):
    """A wrong shape in example_inputs: the activations are not counted (a warning says why, once), and torch's
    fake-tensor code does not print its own traceback of the failed kernel to stderr."""
    import logging

    fake_records: list = []
    handler = logging.Handler()
    handler.emit = fake_records.append
    logging.getLogger("torch._subclasses.fake_tensor").addHandler(handler)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    try:
        with caplog.at_level("WARNING", logger="angel_ptm"):
            engine = angel_ptm.initialize(model, config(tmp_path), example_inputs=(torch.ones(8, 31),))
        engine.close()
    finally:
        logging.getLogger("torch._subclasses.fake_tensor").removeHandler(handler)
    assert any("could not be traced with example_inputs" in r.getMessage() for r in caplog.records)
    assert not fake_records and "Traceback" not in capfd.readouterr().err
