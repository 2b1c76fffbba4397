"""Misuse of the engine's API and of a managed model, each taken as torch takes it or refused with a typed one-line
error that says what to do: tied names, a NaN clip, a backward torch refuses, parameters added, replaced or
unfrozen after initialize, moving or casting the model, two losses of one forward (retain_graph)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import ConfigValueError, ParameterAccessError, StateDictError
from tests.test_any_model import config
from tests.test_model_entry_points import memory


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # one parameter, two names

    def forward(self, x):
        return self.head(self.emb(x))


def test_tied_names_misuse_and_a_nan_clip_are_taken_as_torch_takes_them_or_refused_typed(tmp_path):
    """A tied parameter under either of its names; of a state dict whose two names of it differ, the last one
    (torch's load copies each key in order); a name the model lacks, a non-module, an optimizer state that is
    not a dict and a NaN max_norm (torch's clip then makes every gradient NaN) each a typed one-line error."""
    with pytest.raises(ConfigValueError, match="initialize: the model must be a torch.nn.Module"):
        angel_ptm.initialize(lambda x: x, config(memory(tmp_path / "fn", placement={"page_bytes": "4KiB"})))
    torch.manual_seed(0)
    model = _Tied()
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"}), grad_clip=1.0))
    try:
        assert torch.equal(engine.parameter("head.weight"), engine.parameter("emb.weight"))
        with pytest.raises(ParameterAccessError, match=r"no parameter named 'emb.weights' .*did you mean 'emb.weight'"):
            engine.parameter("emb.weights")
        reference = _Tied()
        loaded = {"emb.weight": torch.zeros(16, 8), "head.weight": torch.ones(16, 8)}
        reference.load_state_dict(loaded)
        engine.load_state_dict(loaded)
        assert torch.equal(engine.parameter("emb.weight"), reference.emb.weight.detach())  # ones, the last
        with pytest.raises(StateDictError, match="load_optimizer_state_dict: expected .* got a list"):
            engine.load_optimizer_state_dict([1, 2, 3])
        with pytest.raises(StateDictError, match="load_state_dict: expected a dict of tensors"):
            engine.load_state_dict([("emb.weight", torch.zeros(16, 8))])
        engine.backward(engine(torch.tensor([[1, 2, 3]])).pow(2).mean())
        with pytest.raises(ConfigValueError, match="clip_grad_norm: max_norm must be a number"):
            engine.clip_grad_norm(float("nan"))
        engine.clip_grad_norm(float("inf"))  # no clipping, as torch
        engine.step()  # usable: nothing failed
    finally:
        engine.close()


def test_a_backward_torch_refuses_at_once_does_not_count_as_a_micro_batch(tmp_path):
    """A loss that is not a scalar, or has no graph: torch's own error, and the step goes on as if the call had not
    been made (it counted as a micro-batch, and the next backward was refused as one too many for grad_accum)."""
    torch.manual_seed(0)
    engine = angel_ptm.initialize(nn.Linear(4, 2), config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        x = torch.randn(3, 4)
        with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
            engine.backward(engine(x))
        with torch.no_grad():
            detached = engine(x).sum()
        with pytest.raises(RuntimeError, match="does not require grad"):
            engine.backward(detached)
        engine.backward(engine(x).sum())
        engine.step()
    finally:
        engine.close()


def test_a_parameter_added_replaced_or_unfrozen_after_initialize_is_refused_at_the_next_forward(tmp_path):
    """The engine pages the parameters it was given (gradient pages for those requiring grad then): a parameter
    assigned or made by a lazy module after initialize, or one unfrozen, is a one-line error at the next forward
    (it trained silently never, and close() failed part-way on it, the trained weights lost); close() gives the
    model the trained weights of every parameter the engine has."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model[0].bias.requires_grad_(False)
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    x = torch.randn(3, 4)
    try:
        engine.backward(engine(x).sum())
        engine.step()
        trained = engine.parameter("0.weight")
        model[0].bias.requires_grad_(True)
        with pytest.raises(ConfigValueError, match="parameter '0.bias' was frozen at angel_ptm.initialize"):
            engine(x)
        model[0].bias.requires_grad_(False)
        model[2].weight = nn.Parameter(torch.zeros(1, 4))
        with pytest.raises(ConfigValueError, match=r"parameter '2.weight' was added or replaced after "):
            engine(x)
        with pytest.raises(ConfigValueError, match=r"parameter '2.weight' was added or replaced after "):
            engine.optimizer_state_dict()
        model.extra = nn.LazyLinear(2)
        with pytest.raises(ConfigValueError, match="added or replaced"):
            engine(x)
    finally:
        engine.close()
    assert torch.equal(model[0].weight.detach(), trained) and torch.equal(model[2].weight.detach(), torch.zeros(1, 4))


@pytest.mark.parametrize("move", ["to_cpu", "half", "data"])
def test_moving_or_casting_a_managed_model_says_so(tmp_path, move):
    """model.to / .half / p.data = ... after initialize: refused naming what it is and what to do (it said
    'used outside the forward of its paging unit (_has_compatible_shallow_copy_type)')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        with pytest.raises(ParameterAccessError, match=r"is not moved, cast or given new tensors .*trainer\.device"):
            {"to_cpu": lambda: model.to("cpu"), "half": model.half,
             "data": lambda: setattr(model[0].weight, "data", torch.zeros(4, 4))}[move]()
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()  # usable
    finally:
        engine.close()


def test_two_losses_of_one_forward_backward_with_retain_graph_as_in_torch(tmp_path):
    """engine.backward(loss, retain_graph=True) then the second loss's backward (two micro-batches of
    trainer.grad_accum): the gradients of both, as torch's (it was a TypeError)."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    reference = build()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    expected = []
    for _ in range(3):
        out = reference(x)
        first, second = out[:, 0].pow(2).mean(), out[:, 1].abs().mean()
        first.backward(retain_graph=True)
        second.backward()
        opt.step()
        opt.zero_grad()
        expected.append(first.item() + second.item())
    engine = angel_ptm.initialize(build(), config(memory(tmp_path, placement={"page_bytes": "4KiB"}), grad_accum=2))
    try:
        got = []
        for _ in range(3):
            out = engine(x)
            first, second = out[:, 0].pow(2).mean(), out[:, 1].abs().mean()
            engine.backward(first, retain_graph=True)
            engine.backward(second)
            engine.step()
            got.append(first.item() + second.item())
    finally:
        engine.close()
    assert got == pytest.approx(expected, rel=1e-6)
