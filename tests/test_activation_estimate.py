"""The estimate's activation rules against what the engine then does: the room activations.offload's pages take
on the device and the disk, and the views the offloader leaves on the device (tests/test_activations.py holds the
rest)."""

from __future__ import annotations

import pytest
import torch

import angel_ptm
from angel_ptm.config import load_config


def test_the_estimate_counts_the_open_activation_page_and_the_activation_pages_on_disk(tmp_path):
    """activations.offload: the page being filled sits on the device beside the largest unit's pages, and an
    explicit disk budget holds the activation pages beside the states' page files. The smallest budgets the
    estimate accepts run; one page less of either is refused at start, not in the first forward."""
    from angel_ptm.estimate import estimate_job
    from angel_ptm.models import build_model

    page = 8192

    def job(offload, device_pages, disk=None):
        return {"model": {"dim": 64, "n_layer": 2, "n_head": 4, "seq_len": 32, "vocab_size": 96},
                "data": {"batch_size": 2}, "trainer": {"device": "cpu", "grad_clip": 0.0},
                "memory": {"page_bytes": page, "device_budget": device_pages * page, "disk_dir": str(tmp_path),
                           "host_budget": "64MiB" if disk is None else 4 * page,
                           **({} if disk is None else {"disk_budget": disk})},
                "activations": {"offload": offload, "offload_min_bytes": 1024}}

    def fits(config):
        return estimate_job(load_config(config), device=torch.device("cpu")).fits

    largest = estimate_job(load_config(job("host", 1000)), device=torch.device("cpu")).largest_layer_pages
    assert fits(job("none", largest)) and not fits(job("host", largest)) and fits(job("host", largest + 1))
    roomy = estimate_job(load_config(job("disk", 1000, disk="1GiB")), device=torch.device("cpu"))
    disk_needed = roomy.tiers["disk"].needed
    assert disk_needed >= roomy.activation_page_bytes > 0
    assert not fits(job("disk", 1000, disk=disk_needed - page))
    for config in (job("host", largest + 1), job("disk", 1000, disk=disk_needed)):
        assert fits(config)
        model = build_model(load_config(config).model)
        engine = angel_ptm.initialize(model, config)
        try:
            x = torch.randint(0, 96, (2, 32))
            for _ in range(2):
                engine.backward(engine(x, x))
                engine.step()
        finally:
            engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_views_the_offloader_leaves_on_the_device_are_counted_there(tmp_path, dtype):
    """HF GPT-2 splits q, k and v from one projection: each is a view reaching over three times itself, which the
    offloader leaves with autograd on the device. The estimate's trace counts those storages there (it counted them
    paged: 1.9 KB on the device against 38.8 KB measured)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=48, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    job = {"memory": {"page_bytes": "4KiB", "disk_dir": str(tmp_path)}, "trainer": {"device": "cpu", "dtype": dtype},
           "activations": {"offload": "host", "offload_min_bytes": 512}}
    engine = angel_ptm.initialize(model, job, example_inputs={"input_ids": ids, "labels": ids})
    try:
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        assert engine.estimate.activation_bytes == engine.scheduler.last_trace.activation_peak
    finally:
        engine.close()


def test_under_offload_the_estimate_bounds_a_skewed_routings_device_bytes(tmp_path):
    """Under activations.offload the tensors an expert saves stay on the device when under offload_min_bytes; a
    skewed routing leaves many experts' that small, which the trace's even deal of the rows pages: the estimate
    bounds each layer's by min(their sum, their count x the threshold), so the measured peak stays within it (it
    was 3.8-17.7x the estimate)."""
    from angel_ptm.models import GPT, GPTConfig

    g = torch.Generator().manual_seed(2)
    weights = torch.tensor([0.8 ** i for i in range(64)])  # skewed token ids: skewed routing (hash of the token)
    batches = [torch.multinomial(weights, 4 * 64, True, generator=g).view(4, 64) for _ in range(2)]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=64, n_layer=2, n_head=2, dim=64,
                          moe={"experts": 8, "gate": "hash", "capacity_factor": 0.0}))
    measured, estimate = measured_and_estimated(model, {
        "memory": {"page_bytes": "16KiB", "disk_dir": str(tmp_path)}, "trainer": {"device": "cpu"},
        "data": {"batch_size": 4}, "activations": {"offload": "host", "offload_min_bytes": "8KiB"}}, batches)
    assert 0 < measured <= estimate, (measured, estimate)


def measured_and_estimated(model, job, batches) -> tuple[int, int]:
    """A GPT's activation peak as the trace measures it over `batches`, and the estimate's."""
    engine = angel_ptm.initialize(model, job)
    try:
        for tokens in batches:
            engine.backward(engine(tokens, tokens))
            engine.step()
        return engine.scheduler.last_trace.activation_peak, engine.estimate.activation_bytes
    finally:
        engine.close()


def test_with_offload_host_and_no_disk_the_activation_pages_the_host_cannot_hold_count_on_the_device(tmp_path):
    """activations.offload host without a disk tier: what the host cannot hold beside the states goes up to the
    device (the manager's rule), so the device's expected peak counts it (it counted only the states: 70 pages
    against 120 measured)."""
    import json

    from angel_ptm.models import GPT, GPTConfig
    from angel_ptm.trace import TraceRecorder

    page = 4096
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32))
    trace = TraceRecorder(tmp_path / "trace.jsonl")
    engine = angel_ptm.initialize(model, {"memory": {"page_bytes": page, "device_budget": 120 * page,
                                                     "host_budget": 167 * page},
                                          "trainer": {"device": "cpu"}, "activations": {"offload": "host"}},
                                  trace=trace)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x = torch.randint(0, 64, (8, 16), generator=g)
            engine.backward(engine(x, x))
            engine.step()
        expected = engine.estimate.peaks()["device"]
    finally:
        engine.close()
        trace.close()
    measured = max(json.loads(line).get("in_use", {}).get("device", 0)
                   for line in (tmp_path / "trace.jsonl").read_text().splitlines())
    assert expected == pytest.approx(measured, rel=0.10), (expected, measured)
