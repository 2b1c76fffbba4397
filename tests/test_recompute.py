"""Recomputation (activations.checkpoint full | selective, activations/recompute.py) on forwards that write what they
read: a matrix product's output written in place after it (selective keeps a copy for the recomputation), and a
buffer read then updated (the recomputation reads it as the forward read it). Each as the run without
checkpointing, bitwise."""

from __future__ import annotations

import pytest
import torch

import angel_ptm


class _WritesItsProducts(torch.nn.Module):
    """Units whose matrix products' outputs are then written in place: nn.ReLU(inplace=True) after a Linear, and
    a CPU GRU, whose cells write the views unsafe_split makes of their matmuls' outputs (no version counter
    sees those writes)."""

    def __init__(self):
        super().__init__()
        self.mlps = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True),
                                                            torch.nn.Linear(16, 8)) for _ in range(2))
        self.grus = torch.nn.ModuleList(torch.nn.GRU(8, 8, batch_first=True) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for mlp, gru in zip(self.mlps, self.grus):
            x = x + mlp(x)
            x = x + gru(x)[0]
        return self.head(x[:, -1]).squeeze(-1)


def test_selective_gives_back_the_products_as_computed_when_the_forward_then_writes_them(tmp_path):
    """selective keeps the matrix products' outputs for backward: one the forward then writes in place is copied
    first, so the recomputation gets it as computed (torch's selective checkpoint keeps the very tensor: the GRU's
    gradients came out wrong, silently, and the in-place ReLU ended backward with torch's 'mutated' error)."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 5, 8, generator=g) for _ in range(4)]
    runs = {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        engine = angel_ptm.initialize(_WritesItsProducts(), {
            "memory": {"page_bytes": "4KiB", "scheduler": "on_demand"}, "trainer": {"device": "cpu"},
            "activations": {"checkpoint": mode}})
        try:
            losses = []
            for x in batches:
                loss = (engine(x) - x[:, -1].sum(-1).sin()).pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            runs[mode] = losses
        finally:
            engine.close()
    assert runs["selective"] == runs["none"]


class _ReadsThenUpdatesABuffer(torch.nn.Module):
    """A unit whose forward reads a buffer, then updates it (a decay kept in a buffer, a step counter)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Decaying() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class _Decaying(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        y = x + torch.tanh(self.linear(x)) * self.scale.clone() * (1 + self.calls)
        with torch.no_grad():
            self.scale.mul_(0.5)
            self.calls += 1
        return y


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_recomputation_reads_the_buffers_as_the_forward_read_them(tmp_path, mode):
    """A checkpointed unit's forward that reads a buffer and then updates it: the recomputation reads the value
    the forward read (it read the updated one: losses off from the second step, silently), and the update is made
    once."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    runs = {}
    for setting in ("none", mode):
        torch.manual_seed(0)
        model = _ReadsThenUpdatesABuffer()
        engine = angel_ptm.initialize(model, {"memory": {"page_bytes": "4KiB"}, "trainer": {"device": "cpu"},
                                              "activations": {"checkpoint": setting}})
        try:
            losses = []
            for _ in range(3):
                loss = engine(x)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            runs[setting] = losses, [(b.scale.item(), b.calls.item()) for b in model.blocks]
        finally:
            engine.close()
    assert runs[mode] == runs["none"]
