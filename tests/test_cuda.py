"""The same guarantees on a GPU: the device tier in CUDA memory, a pinned host tier, copies on CUDA streams.

Every test here needs a CUDA device; without one, conftest skips them (the `cuda` marker). Training is compared with
plain PyTorch on the same GPU. Tolerance: 1e-5 relative on losses (1e-6 on CPU): the engine's update runs torch's
elementwise kernels where torch.optim.AdamW on CUDA runs its foreach kernels, whose fused multiply-adds may round
differently in the last bit, and the embedding's backward adds with atomics in no fixed order.
"""

import json
import math

import pytest
import torch

import angel_ptm
from angel_ptm.errors import BudgetError
from angel_ptm.memory import BufferPool, DiskTier, PageManager, Tier
from angel_ptm.memory.device import Copier
from angel_ptm.trainer import Trainer

from test_engine_equivalence import (CASES, PLACEMENTS, SCHEDULERS, SMALL_PLACEMENTS, assert_same_losses,
                                     assert_tiers_used, run_steps, train_engine, train_plain)
from test_manager import assert_round_trip_is_bitwise_identical
from test_trainer import tiny_config
import test_mixed_precision as mixed

pytestmark = pytest.mark.cuda

PAGE = 64 * 1024
CUDA_REL = 1e-5


def on_cuda(batches):
    return [tuple(t.cuda() for t in batch) for batch in batches]


# ------------------------------------------------------------------------------------------------- pages and tiers
@pytest.mark.parametrize("async_copies", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_round_trip_gpu_host_disk_is_bitwise_identical(tmp_path, io_engine, dtype, async_copies):
    manager = PageManager(BufferPool(Tier.DEVICE, PAGE, 2 * PAGE, "cuda"),
                          BufferPool(Tier.HOST, PAGE, 2 * PAGE, "cpu", pin=True),
                          DiskTier(str(tmp_path / "disk"), PAGE, 8 * PAGE, io_engine), async_copies=async_copies)

    def on_the_gpu_only_there(page, tier):
        if tier is not Tier.DISK:
            assert page.view().is_cuda is (tier is Tier.DEVICE)

    try:
        assert_round_trip_is_bitwise_identical(manager, dtype, on_the_gpu_only_there)
    finally:
        manager.close()


def test_host_pool_is_pinned_and_the_device_pool_is_on_the_gpu():
    host = BufferPool(Tier.HOST, PAGE, 2 * PAGE, "cpu", pin=True)
    device = BufferPool(Tier.DEVICE, PAGE, 2 * PAGE, "cuda")
    assert host.alloc().is_pinned()
    assert device.alloc().is_cuda
    assert not host.can_trade(device)  # different kinds of memory: pages are copied, never traded


def test_copies_wait_for_compute_and_report_completion():
    copier = Copier(torch.device("cuda"))
    n = 1 << 24
    src = torch.ones(n, device="cuda")
    for _ in range(20):  # queue work on the compute stream: the copy must see its result, not the ones
        src.mul_(2.0)
    expected = 2.0**20  # exact in fp32
    host = torch.empty(n, pin_memory=True)
    handle = copier.copy(host, src)
    handle.wait()
    assert handle.done()
    assert torch.all(host == expected)
    back = torch.zeros(n, device="cuda")
    copier.copy(back, host).wait()
    assert torch.equal(back.cpu(), host)
    copier.close()


def test_a_device_budget_beyond_the_gpu_is_refused_before_allocating():
    _, total = torch.cuda.mem_get_info()
    with pytest.raises(BudgetError, match="device"):
        BufferPool(Tier.DEVICE, 1 << 20, total + (1 << 30), "cuda")


# --------------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("case", list(CASES))
def test_training_on_the_gpu_matches_torch_adamw(case, placement, scheduler, tmp_path):
    make_model, make_batches, loss_fn = CASES[case]
    batches = on_cuda(make_batches())
    expected = train_plain(make_model().cuda(), batches, loss_fn)
    memory = dict((PLACEMENTS if case == "gpt" else SMALL_PLACEMENTS)[placement], disk_dir=str(tmp_path),
                  scheduler=scheduler)
    actual, stats = train_engine(make_model(), batches, loss_fn, memory, device="cuda")
    assert_same_losses(expected, actual, rel=CUDA_REL)
    assert_tiers_used(placement, stats)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_gradient_clipping_on_the_gpu_matches_torch(placement, tmp_path):
    make_model, make_batches, loss_fn = CASES["gpt"]
    batches = on_cuda(make_batches())
    expected = train_plain(make_model().cuda(), batches, loss_fn, clip=0.5)
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path))
    actual, _ = train_engine(make_model(), batches, loss_fn, memory, clip=0.5, device="cuda")
    assert_same_losses(expected, actual, rel=CUDA_REL)


@pytest.mark.parametrize("dtype", list(mixed.DTYPES))
@pytest.mark.parametrize("placement", list(mixed.PLACEMENTS))
def test_mixed_precision_on_the_gpu_follows_torch(dtype, placement, tmp_path):
    scale = mixed.REFERENCE_SCALE[dtype]
    expected, reference_master = mixed.train_reference(mixed.DTYPES[dtype], mixed.batches(), scale, device="cuda")
    engine = angel_ptm.initialize(mixed.gpt(), mixed.config(dtype, placement, tmp_path, device="cuda",
                                                            loss_scale=scale))
    try:
        actual = mixed.train(engine, on_cuda(mixed.batches()))
        assert all(math.isfinite(loss) for loss in actual)
        assert actual[-1] < actual[0] - 0.5, actual
        # The update on the GPU is torch's (not the CPU kernel's): the same ops, up to the last-bit differences
        # above, which may flip a bf16/fp16 rounding: as on the CPU, 1e-3 relative on losses.
        assert actual == pytest.approx(expected, rel=1e-3, abs=0)
        for name, master in reference_master.items():
            torch.testing.assert_close(engine.master_parameter(name), master.cpu(), rtol=0, atol=1e-3)
            assert torch.equal(engine.parameter(name), engine.master_parameter(name).to(mixed.DTYPES[dtype])), name
    finally:
        engine.close()


def test_fp16_overflow_on_the_gpu_skips_the_step_and_halves_the_scale(tmp_path):
    engine = angel_ptm.initialize(mixed.gpt(), mixed.config("float16", "device+host+disk", tmp_path, device="cuda"))
    try:
        data = on_cuda(mixed.batches(3))
        mixed.train(engine, data[:1])
        assert (engine.loss_scale, engine.last_step_skipped, engine.optimizer.step_count) == (65536.0, False, 1)
        before = mixed.snapshot(engine)
        x, y = data[1]
        engine.backward(engine(x, y) * 1e30)  # finite in fp32, but its gradients overflow fp16
        engine.step()
        assert (engine.loss_scale, engine.last_step_skipped, engine.optimizer.step_count) == (32768.0, True, 1)
        after = mixed.snapshot(engine)
        for key in before:  # parameters, master weights and both moments, bit for bit
            assert torch.equal(before[key], after[key]), key
        mixed.train(engine, data[2:])  # the next step proceeds, at the lowered scale
        assert (engine.loss_scale, engine.last_step_skipped, engine.optimizer.step_count) == (32768.0, False, 2)
    finally:
        engine.close()


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_gpu_run_is_the_same_twice(staleness, tmp_path):
    """An MLP (no embedding, whose CUDA backward adds in no fixed order): two runs give identical losses."""
    make_model, make_batches, loss_fn = CASES["mlp"]
    batches = on_cuda(make_batches())
    runs = []
    for run in range(2):
        memory = dict(SMALL_PLACEMENTS["device+host+disk"], disk_dir=str(tmp_path / str(run)))
        config = {"optimizer": {"lr": 1e-2, "staleness": staleness}, "memory": memory,
                  "trainer": {"device": "cuda", "grad_clip": 0}}
        engine = angel_ptm.initialize(make_model(), config)
        try:
            runs.append(run_steps(engine, batches, loss_fn))
        finally:
            engine.close()
    assert runs[0] == runs[1]
    assert all(math.isfinite(loss) for loss in runs[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_training_job_runs_on_the_gpu_with_pages_on_every_tier(dtype, tmp_path):
    """The Trainer with the real engine (as `angel-ptm train --set trainer.device=cuda` runs it)."""
    config = tiny_config(tmp_path / "run", trainer={"steps": 30, "eval_every": 0, "device": "cuda", "dtype": dtype},
                         memory={"page_bytes": "4KiB", "device_budget": "112KiB", "host_budget": "112KiB",
                                 "disk_dir": str(tmp_path / "pages")})  # a block's unit and the root's: 27 pages
    result = Trainer(config, progress=False).run()
    assert result.steps == 30 and all(math.isfinite(loss) for loss in result.losses)
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 1.0
    moves = [json.loads(line) for line in (result.run_dir / "trace.jsonl").read_text().splitlines()]
    assert {"host->disk", "disk->host", "device->host", "host->device"} <= {
        f"{event['src']}->{event['dst']}" for event in moves if event["event"] == "moved"}
