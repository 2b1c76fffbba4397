"""What a checkpoint load refuses, as an outside probe found it: a checkpoint with buffers this model does not have
(torch's strict load refuses them), and a load into a closed engine (it wrote the buffers and RNG only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import CheckpointError, EngineClosedError


def job(tmp_path):
    return {"optimizer": {"lr": 1e-2}, "memory": {"page_bytes": "4KiB", "disk_dir": str(tmp_path / "pages")},
            "trainer": {"device": "cpu", "grad_clip": 0}}


def net(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), norm, nn.Linear(16, 1))


def trained(model, tmp_path):
    engine = angel_ptm.initialize(model, job(tmp_path))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return engine


def test_a_checkpoint_with_buffers_this_model_lacks_is_refused(tmp_path):
    engine = trained(net(nn.BatchNorm1d(16, affine=False)), tmp_path)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    other = angel_ptm.initialize(net(nn.Identity()), job(tmp_path))
    try:
        with pytest.raises(CheckpointError, match="does not fit this model: 'buffer.1.running_mean'"):
            other.load_checkpoint(tmp_path / "ck")
    finally:
        other.close()


def test_a_closed_engine_refuses_a_load_and_its_model_keeps_its_state(tmp_path):
    model = net(nn.BatchNorm1d(16))
    engine = trained(model, tmp_path)
    engine.save_checkpoint(tmp_path / "ck")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.close()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(EngineClosedError, match="load_checkpoint"):
        engine.load_checkpoint(tmp_path / "ck")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
