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


def copy_blocks_the_host(host: torch.Tensor) -> bool:
    """Whether a non_blocking copy from the GPU into `host` held the calling thread until it was done: it does
    into pageable memory (the driver stages it), never into page-locked memory. (torch's `is_pinned()` knows only
    its own allocator's blocks, not memory registered with cudaHostRegister.)"""
    busy = torch.randn(4096, 4096, device="cuda")
    source = torch.ones(host.numel(), dtype=host.dtype, device="cuda")
    torch.cuda.synchronize()
    for _ in range(50):  # ~tens of ms of GPU work queued ahead of the copy
        busy = busy @ busy
        busy /= busy.norm()
    host.copy_(source, non_blocking=True)
    blocked = torch.cuda.current_stream().query()  # all done already: the copy call waited for it
    torch.cuda.synchronize()
    assert torch.all(host == 1)
    return blocked


def test_host_pool_is_page_locked_and_the_device_pool_is_on_the_gpu():
    host = BufferPool(Tier.HOST, 1 << 24, 2 << 24, "cpu", pin=True)
    device = BufferPool(Tier.DEVICE, PAGE, 2 * PAGE, "cuda")
    assert not copy_blocks_the_host(host.alloc())
    assert copy_blocks_the_host(torch.empty(1 << 24, dtype=torch.uint8))  # the check tells pageable memory apart
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


def queue_gpu_work():
    """Tens of ms of work on the current stream, so what the host does next happens while the GPU is busy."""
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(50):
        busy = busy @ busy
        busy /= busy.norm()


def test_evictions_and_fetches_on_the_gpu_never_hold_the_host_and_slots_are_reused_in_order(tmp_path, io_engine):
    """A device slot freed by an eviction is reused at once: its copy and the next page's writes are ordered on the
    GPU (slot fences), the host does not wait for the work queued ahead of them; the bytes all arrive."""
    manager = PageManager(BufferPool(Tier.DEVICE, PAGE, PAGE, "cuda"),
                          BufferPool(Tier.HOST, PAGE, 2 * PAGE, "cpu", pin=True),
                          DiskTier(str(tmp_path / "disk"), PAGE, 8 * PAGE, io_engine))
    try:
        first = manager.create_page("param", torch.float32, tier=Tier.DEVICE)
        first.view().fill_(7.0)
        first.mark_dirty()
        queue_gpu_work()
        second = manager.create_page("param", torch.float32, tier=Tier.DEVICE)  # evicts `first` into the host
        second.view().fill_(1.0)
        second.mark_dirty()
        assert not torch.cuda.current_stream().query()  # still busy: the host went on
        manager.flush([first])
        assert first.state.name == "HOST" and torch.all(first.view() == 7.0)
        queue_gpu_work()
        manager.acquire([first], Tier.DEVICE)  # evicts `second`, copies `first` up into its slot
        assert not torch.cuda.current_stream().query()
        assert torch.all(first.view() == 7.0)  # (compute waits for the copy)
        manager.release([first])
        manager.flush([second])
        assert torch.all(second.view() == 1.0)
    finally:
        manager.close()


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


# ------------------------------------------------------------------------------------- NCCL (a world of one GPU)
@pytest.fixture
def nccl_world_of_one(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_collective_runs_over_nccl_with_gpu_tensors_and_cpu_ones_staged(nccl_world_of_one):
    """Each collective the engine issues, over NCCL (one rank: the results are the inputs), blocking and in flight;
    CPU tensors (agreements, host-tier pages) go through a GPU copy, counted in staged_bytes."""
    from angel_ptm.parallel.collectives import MAX, Collectives, world_group
    from angel_ptm.parallel.mesh import Mesh

    mesh = Mesh(backend="nccl")
    comm = Collectives(mesh, group=world_group(mesh))
    try:
        for device in ("cuda", "cpu"):
            staged_before = comm.staged_bytes
            x = torch.randn(64, device=device)
            out = [torch.full_like(x, float("nan"))]
            comm.all_gather(out, x, "gather")
            assert torch.equal(out[0], x)
            out = [torch.full_like(x, float("nan"))]
            comm.all_gather(out, x, "gather in flight", async_op=True).wait()
            assert torch.equal(out[0], x)
            reduced = torch.full_like(x, float("nan"))
            comm.reduce_scatter(reduced, [x], "reduce")
            assert torch.equal(reduced, x)
            reduced = torch.full_like(x, float("nan"))
            pending = comm.reduce_scatter(reduced, [x], "reduce in flight", async_op=True)
            assert pending.wait_for(30)
            pending.wait()
            assert torch.equal(reduced, x)
            y = x.clone()
            comm.all_reduce(y, "max", op=MAX)
            comm.broadcast(y, 0, "broadcast")
            assert torch.equal(y, x)
            listed = [torch.full_like(x, float("nan"))]
            comm.all_gather_list(listed, x, "gather list")
            comm.reduce_scatter_list(y, [x], "reduce list")
            assert torch.equal(listed[0], x) and torch.equal(y, x)
            rows = torch.full((64, 1), float("nan"), device=device)
            comm.all_to_all(rows, x.view(64, 1), [64], [64], "all to all")
            assert torch.equal(rows.view(-1), x)
            assert (comm.staged_bytes > staged_before) is (device == "cpu")
        assert comm.all_gather_object({"step": 3}, "objects") == [{"step": 3}]
        assert comm.broadcast_object("rank 0's", 0, "object") == "rank 0's"
        comm.verify_sequence("the end")  # the collectives' digest, agreed over NCCL
        side = [None]
        torch.distributed.all_gather_object(side, "gloo", group=comm.side_group())
        assert side == ["gloo"]
    finally:
        comm.close()


def test_torchrun_with_one_gpu_trains_over_an_nccl_process_group(tmp_path):
    """`torchrun --nproc-per-node 1 -m angel_ptm train` on the GPU: the engine sets up NCCL's process group (a
    world of one), takes cuda:0 and trains with pages on every tier."""
    import subprocess
    import sys

    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "angel_ptm", "train",
         "--set", "trainer.device=cuda", "--set", "trainer.steps=5", "--set", "trainer.eval_every=0",
         "--set", f"run.dir={run}", "--set", f"memory.disk_dir={tmp_path / 'pages'}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 5 and all(math.isfinite(loss) for loss in losses)


# ------------------------------------------------------------------------------ activations, checkpoints, MoE
@pytest.mark.parametrize("setting", ["full", "selective", "offload-host", "offload-disk", "full+offload-disk"])
def test_each_activations_setting_on_the_gpu_gives_keeps_losses(setting, tmp_path):
    """Recomputation and activation pages in GPU memory, pinned host memory and on disk: keep-everything's losses
    (1e-5 relative: the embedding's CUDA backward adds in no fixed order)."""
    import test_activations as act

    section = {"checkpoint": "full"} if setting == "full" else dict(act.SETTINGS[setting])
    kept, _, _ = act.train("gpt", "host", "planned", tmp_path / "keep", "none", device="cuda")
    losses, recomputed, _ = act.train("gpt", "host", "planned", tmp_path / setting, section, device="cuda")
    assert losses == pytest.approx(kept, rel=CUDA_REL, abs=0)
    assert recomputed == (15 * 2 if "checkpoint" in section else 0)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_checkpoint_saved_on_the_gpu_resumes_bitwise(staleness, tmp_path, monkeypatch):
    """Save at step 5 on the GPU (pages on every tier, the CUDA RNG state included), resume into a scrambled model:
    steps 6-10 and every state bit for bit (an MLP: no atomics in its backward)."""
    import test_checkpoint as ck

    on_cpu = ck.batches
    monkeypatch.setattr(ck, "batches", lambda case="gpt", count=ck.STEPS: on_cuda(on_cpu(case, count)))
    cfg = ck.config(tmp_path, "gpu", staleness=staleness)
    cfg["trainer"]["device"] = "cuda"
    losses, states = ck.train_with_checkpoint(tmp_path, "mlp", cfg, tmp_path / "ckpt")
    resumed, resumed_states = ck.resume_from("mlp", cfg, tmp_path / "ckpt")
    assert resumed == losses[ck.AT:]
    ck.assert_bitwise(states, resumed_states)


@pytest.mark.parametrize("gate", ["switch", "hash"])
def test_gpt_moe_on_the_gpu_trains_like_torch_adamw_with_experts_paged(gate, tmp_path):
    import test_moe
    from conformance_cases import place
    from test_engine_equivalence import engine_config

    batches = on_cuda(test_moe.skewed_batches())
    expected, _ = test_moe.train_torch(test_moe.gpt_moe(gate=gate).cuda(), batches)
    model = test_moe.gpt_moe(gate=gate)
    memory = {"page_bytes": 4096, "disk_dir": str(tmp_path), "scheduler": "planned"}
    engine = angel_ptm.initialize(model, place(engine_config(memory, device="cuda"), model, "disk"))
    try:
        losses = run_steps(engine, batches, lambda m, x, y: m(x, y))
    finally:
        engine.close()
    assert_same_losses(expected, losses, rel=CUDA_REL)
