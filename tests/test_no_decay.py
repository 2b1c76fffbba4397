"""optimizer.no_decay: the parameters a recipe keeps out of weight decay (biases, norms), as torch.optim.AdamW's
second param group with weight_decay 0 — on pages that hold decayed and spared tensors side by side, in every
placement, and through torch's optimizer state dicts both ways."""

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import ConfigValueError, StateDictError
from tests.test_engine_equivalence import assert_same_losses
from tests.test_odd_models import engine_losses, torch_losses

SPARED = ["*.bias", "*norm.*"]


def spared(name: str) -> bool:
    return name.endswith(".bias") or ".norm." in name


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(40, 40)
        self.norm = nn.LayerNorm(40)

    def forward(self, x):
        return x + torch.relu(self.norm(self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 40)
        self.layers = nn.ModuleList(Block() for _ in range(6))
        self.out = nn.Linear(40, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return (self.out(h) - x[:, :1].sin()).pow(2).mean()


def batches(n=5):
    g = torch.Generator().manual_seed(4)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def torch_run(model, data):
    decayed = [p for n, p in model.named_parameters() if not spared(n)]
    kept = [p for n, p in model.named_parameters() if spared(n)]
    opt = torch.optim.AdamW([{"params": decayed}, {"params": kept, "weight_decay": 0.0}], lr=1e-2,
                            betas=(0.9, 0.95), eps=1e-8, weight_decay=0.5)
    return torch_losses(model, data, opt), opt


def job(tmp_path, placement="device", no_decay=SPARED):
    memory = {"page_bytes": "4KiB", "disk_dir": str(tmp_path)}
    if placement == "disk":  # most states on disk: pages go up and down between the updates
        memory.update(device_budget="24KiB", host_budget="40KiB")
    return {"optimizer": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.5,
                          "no_decay": list(no_decay)},
            "memory": memory, "trainer": {"device": "cpu", "grad_clip": 0}}


train = engine_losses  # one AdamW step per batch through the engine


@pytest.mark.parametrize("placement", ["device", "disk"])
def test_spared_parameters_train_as_torchs_second_param_group(tmp_path, placement):
    reference = Net()
    expected, _ = torch_run(reference, batches())
    engine = angel_ptm.initialize(Net(), job(tmp_path, placement))
    try:
        on_page = {s.name: s.pages for s in engine.layout.slots}
        assert set(on_page["layers.0.lin.weight"]) & set(on_page["layers.0.lin.bias"])  # (pages hold both kinds)
        assert engine.optimizer.no_decay == {n for n, _ in reference.named_parameters() if spared(n)}
        losses = train(engine, batches())
        if placement == "disk":
            assert engine.memory_stats()["moved"]["disk->host"] > 0
        for name, param in reference.named_parameters():
            torch.testing.assert_close(engine.parameter(name), param.detach(), rtol=1e-5, atol=1e-7)
    finally:
        engine.close()
    assert_same_losses(expected, losses)
    plain = angel_ptm.initialize(Net(), job(tmp_path / "plain", placement, no_decay=()))
    try:
        assert train(plain, batches()) != losses  # (weight decay 0.5: sparing them shows)
    finally:
        plain.close()


def test_optimizer_state_dicts_have_torchs_two_groups_both_ways(tmp_path):
    data = batches(6)
    reference = Net()
    expected, _ = torch_run(reference, data)
    start = Net()
    _, opt = torch_run(start, data[:3])
    engine = angel_ptm.initialize(Net(), job(tmp_path))
    try:
        engine.load_state_dict(start.state_dict())
        engine.load_optimizer_state_dict(opt.state_dict())
        ours, theirs = engine.optimizer_state_dict(), opt.state_dict()
        assert ours["param_groups"] == theirs["param_groups"]
        for index, entry in theirs["state"].items():
            for kind in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours["state"][index][kind], entry[kind], rtol=0, atol=0)
        assert_same_losses(expected[3:], train(engine, data[3:]))
        count = len(list(reference.parameters()))
        one_group = dict(theirs, param_groups=[dict(theirs["param_groups"][0], params=list(range(count)))])
        with pytest.raises(StateDictError, match="expected 2 param groups"):
            engine.load_optimizer_state_dict(one_group)
    finally:
        engine.close()


def test_a_pattern_that_matches_no_parameter_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigValueError, match=r"optimizer.no_decay: pattern '\*\.bais' matches no parameter"):
        angel_ptm.initialize(Net(), job(tmp_path, no_decay=["*.bais"]))


def test_the_estimate_refuses_a_pattern_that_matches_nothing_as_the_engine_does():
    from angel_ptm.estimate import estimate_job

    tiny = {"vocab_size": 64, "seq_len": 16, "n_layer": 1, "n_head": 2, "dim": 32}
    with pytest.raises(ConfigValueError, match=r"optimizer\.no_decay: pattern '\*\.nothing' matches no parameter"):
        estimate_job({"optimizer": {"no_decay": ["*.nothing"]}, "model": tiny})
    estimate_job({"optimizer": {"no_decay": ["*norm*"]}, "model": tiny})


def test_patterns_given_on_the_command_line_need_no_quotes():
    """`--set optimizer.no_decay=[*.bias]`: YAML reads a leading `*` as an alias; the patterns field takes the
    bracketed items as text (quoted ones too). Elsewhere an invalid value is still an error."""
    from angel_ptm.config import load_config
    from angel_ptm.errors import ConfigError

    config = load_config(None, overrides=["optimizer.no_decay=[*.bias, 'norm*', *_norm.weight]"])
    assert config.optimizer.no_decay == ("*.bias", "norm*", "*_norm.weight")
    with pytest.raises(ConfigError, match="value is not valid YAML"):
        load_config(None, overrides=["run.name=[*x]"])
