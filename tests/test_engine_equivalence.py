"""The engine trains exactly like plain PyTorch with torch.optim.AdamW, wherever the pages live."""

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.models import GPT, GPTConfig

KIB = 1024
STEPS = 20


def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32))


def gpt_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
            for _ in range(STEPS)]


class MLP(nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


class TransposedDecoder(nn.Module):
    def __init__(self, weight: nn.Parameter, out_dim: int):
        super().__init__()
        self.weight = weight  # the encoder's Parameter object itself
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, h):
        return torch.nn.functional.linear(h, self.weight.t(), self.bias)


class TiedAutoencoder(nn.Module):
    """One weight shared by two modules: encode with W, decode with W transposed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(96, 48)
        self.decoder = TransposedDecoder(self.encoder.weight, 96)

    def forward(self, x):
        return self.decoder(torch.tanh(self.encoder(x)))


def regression_batches(in_dim):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, in_dim, generator=g),) for _ in range(STEPS)]


def mlp_loss(model, x):
    return (model(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()


def tied_loss(model, x):
    return (model(x) - x).pow(2).mean()


def gpt_loss(model, x, y):
    return model(x, y)


CASES = {  # model, data and loss of each test model (test_schedule, test_staleness)
    "gpt": (gpt, gpt_batches, gpt_loss),
    "mlp": (MLP, lambda: regression_batches(24), mlp_loss),
    "tied": (TiedAutoencoder, lambda: regression_batches(96), tied_loss),
}


def train_plain(model, batches, loss_fn, clip=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for batch in batches:
        loss = loss_fn(model, *batch)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_config(memory, clip=None, device="cpu", dtype="float32", **optimizer):
    """The engine job of train_plain's optimizer (lr 1e-2, betas (0.9, 0.95), eps 1e-8, weight decay 0.1)."""
    # Without clipping, trainer.grad_clip 0 lets the planned scheduler update pages during backward.
    return {"optimizer": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, **optimizer},
            "memory": memory, "trainer": {"device": device, "grad_clip": clip or 0, "dtype": dtype}}


def run_steps(engine, batches, loss_fn, clip=None):
    """One optimizer step per batch; the losses."""
    losses = []
    for batch in batches:
        loss = loss_fn(engine, *batch)
        engine.backward(loss)
        if clip:
            engine.clip_grad_norm(clip)
        engine.step()
        losses.append(loss.item())
    return losses


def train_engine(model, batches, loss_fn, memory, clip=None, device="cpu"):
    engine = angel_ptm.initialize(model, engine_config(memory, clip, device))
    try:
        return run_steps(engine, batches, loss_fn, clip), engine.memory_stats()
    finally:
        engine.close()


# The device holds the largest paging unit with the units around it (a GPT block and the root's pages: 21 of
# 4 KiB) and little more; with pages on disk the host stages a unit's pages (one slot more than the unit has);
# the models' states take 150-160 pages.
PLACEMENTS = {
    "device": {"page_bytes": "4KiB", "device_budget": "4MiB", "host_budget": "1MiB"},
    "device+host": {"page_bytes": "4KiB", "device_budget": "96KiB", "host_budget": "4MiB"},
    "device+host+disk": {"page_bytes": "4KiB", "device_budget": "112KiB", "host_budget": "96KiB"},
}


# The MLP and the tied autoencoder: 28-32 state pages, units of at most 7 pages.
SMALL_PLACEMENTS = dict(PLACEMENTS, **{
    "device+host": {"page_bytes": "4KiB", "device_budget": "32KiB", "host_budget": "4MiB"},
    "device+host+disk": {"page_bytes": "4KiB", "device_budget": "32KiB", "host_budget": "32KiB"},
})


def assert_tiers_used(placement, stats):
    moved = stats["moved"]
    if placement == "device":
        assert moved.get("host->disk", 0) == 0 and moved.get("device->host", 0) == 0
    if placement == "device+host":
        assert moved["device->host"] > 0 and moved.get("host->disk", 0) == 0
    if placement == "device+host+disk":
        assert moved["host->disk"] > 0 and moved["disk->host"] > 0


def assert_same_losses(expected, actual, rel=1e-6):
    assert len(actual) == len(expected)
    for step, (e, a) in enumerate(zip(expected, actual)):
        assert a == pytest.approx(e, rel=rel), f"step {step}: torch {e} engine {a}"


SCHEDULERS = ["on_demand", "planned"]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_gpt_matches_torch_adamw(placement, scheduler, tmp_path):
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler=scheduler)
    expected = train_plain(gpt(), gpt_batches(), gpt_loss)
    actual, stats = train_engine(gpt(), gpt_batches(), gpt_loss, memory)
    assert_same_losses(expected, actual)
    assert_tiers_used(placement, stats)
    assert stats["zero_copy"] is True  # CPU: pages trade slots between the pools


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("placement", ["device+host", "device+host+disk"])
def test_gpt_with_copies_between_device_and_host_matches_torch_adamw(placement, scheduler, tmp_path):
    # memory.zero_copy false: on CPU, pages are copied between the device and host pools (the copy thread under
    # the planned scheduler), as on a GPU, instead of trading slots
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler=scheduler, zero_copy=False)
    expected = train_plain(gpt(), gpt_batches(), gpt_loss)
    actual, stats = train_engine(gpt(), gpt_batches(), gpt_loss, memory)
    assert_same_losses(expected, actual)
    assert_tiers_used(placement, stats)
    assert stats["zero_copy"] is False


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_gpt_with_gradient_clipping_matches_torch(placement, scheduler, tmp_path):
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler=scheduler)
    expected = train_plain(gpt(), gpt_batches(), gpt_loss, clip=0.5)
    actual, _ = train_engine(gpt(), gpt_batches(), gpt_loss, memory, clip=0.5)
    assert_same_losses(expected, actual)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_sequential_mlp_matches_torch_adamw(placement, scheduler, tmp_path):
    memory = dict(SMALL_PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler=scheduler)
    expected = train_plain(MLP(), regression_batches(24), mlp_loss)
    actual, stats = train_engine(MLP(), regression_batches(24), mlp_loss, memory)
    assert_same_losses(expected, actual)
    assert_tiers_used(placement, stats)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_shared_weights_match_torch_adamw(placement, scheduler, tmp_path):
    memory = dict(SMALL_PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler=scheduler)
    expected = train_plain(TiedAutoencoder(), regression_batches(96), tied_loss)
    actual, stats = train_engine(TiedAutoencoder(), regression_batches(96), tied_loss, memory)
    assert_same_losses(expected, actual)
    assert_tiers_used(placement, stats)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("placement", ["device", "device+host+disk"])
def test_gradient_accumulation_matches_torch(placement, scheduler, tmp_path):
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path), scheduler=scheduler)
    data = gpt_batches()
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    expected = []
    for i in range(0, STEPS, 2):
        losses = []
        for x, y in data[i : i + 2]:
            loss = model(x, y) / 2
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        expected.extend(losses)
    config = {"optimizer": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
              "memory": memory, "trainer": {"device": "cpu", "grad_accum": 2, "grad_clip": 0}}
    engine = angel_ptm.initialize(gpt(), config)
    actual = []
    for i in range(0, STEPS, 2):
        for x, y in data[i : i + 2]:
            loss = engine(x, y) / 2
            engine.backward(loss)
            actual.append(loss.item())
        engine.step()
    engine.close()
    assert_same_losses(expected, actual)


def test_parameter_reads_back_the_trained_value(tmp_path):
    model = MLP()
    reference = MLP()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    engine = angel_ptm.initialize(model, {"optimizer": {"lr": 1e-2, "betas": [0.9, 0.95]},
                                          "memory": dict(SMALL_PLACEMENTS["device+host+disk"], disk_dir=str(tmp_path)),
                                          "trainer": {"device": "cpu"}})
    for (x,) in regression_batches(24)[:3]:
        mlp_loss(reference, x).backward()
        opt.step()
        opt.zero_grad()
        engine.backward(mlp_loss(engine, x))
        engine.step()
    torch.testing.assert_close(engine.parameter("2.weight"), reference[2].weight.detach(), rtol=1e-6, atol=1e-7)
    engine.close()
