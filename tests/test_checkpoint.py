"""Checkpoints (angel_ptm/checkpoint): exact resume from every placement, resharding to another page size, DCP
interop, and the faults a long run meets: a torn or bit-flipped file, a full disk, a process killed mid-save."""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.checkpoint import storage
from angel_ptm.checkpoint.boxes import box_start, flat_boxes
from angel_ptm.checkpoint.directory import Checkpoints
from angel_ptm.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError, EngineFailedError

from dist_jobs import PLACEMENTS
from test_engine_equivalence import CASES, engine_config

TESTS = Path(__file__).parent
STEPS, AT = 10, 5


def config(tmp_path, name, placement="device+host+disk", page_bytes="4KiB", dtype="float32", staleness=0, clip=None):
    memory = dict(PLACEMENTS[placement], disk_dir=str(tmp_path / f"pages-{name}"), page_bytes=page_bytes)
    return engine_config(memory, clip, dtype=dtype, staleness=staleness)


def batches(case="gpt", count=STEPS):
    data = CASES[case][1]()
    return [data[i % len(data)] for i in range(count)]


def step(engine, loss_fn, batch, clip=None):
    loss = loss_fn(engine, *batch)
    engine.backward(loss)
    if clip:
        engine.clip_grad_norm(clip)
    engine.step()
    return loss.item()


def final_states(engine) -> dict:
    """Every kind's values of every tensor (after the pending update lands)."""
    engine.flush()
    out = {}
    for slot in engine.layout.slots:
        for kind in ("param", "master", "exp_avg", "exp_avg_sq"):
            if kind in engine.pages and not (kind != "param" and engine.layout.frozen(slot)):
                out[f"{kind}.{slot.name}"] = engine.state(kind, slot.name)
    return out


def scrambled(build):
    """The case's model with other initial values: everything the resumed run has comes from the checkpoint."""
    torch.manual_seed(1234)
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def train_with_checkpoint(tmp_path, case, cfg, ckpt, clip=None):
    build, _, loss_fn = CASES[case]
    data = batches(case)
    engine = angel_ptm.initialize(build(), cfg)
    try:
        losses = []
        for s in range(STEPS):
            losses.append(step(engine, loss_fn, data[s], clip))
            if s + 1 == AT:
                engine.save_checkpoint(ckpt, extra={"step": AT})
        return losses, final_states(engine)
    finally:
        engine.close()


def resume_from(case, cfg, ckpt, clip=None):
    build, _, loss_fn = CASES[case]
    data = batches(case)
    engine = angel_ptm.initialize(scrambled(build), cfg)
    try:
        extra = engine.load_checkpoint(ckpt)
        assert extra == {"step": AT}
        return [step(engine, loss_fn, data[s], clip) for s in range(AT, STEPS)], final_states(engine)
    finally:
        engine.close()


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --- boxes --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4, 6), (3, 4, 5), (7,), (2, 1, 3, 2), (5, 1), ()])
def test_flat_runs_are_tiled_by_contiguous_boxes_in_element_order(shape):
    n = math.prod(shape)
    values = torch.arange(n).view(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            at = start
            for offsets, sizes in flat_boxes(shape, start, stop):
                piece = values[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                assert box_start(shape, offsets) == at
                assert torch.equal(piece, torch.arange(at, at + piece.numel()))
                at += piece.numel()
            assert at == stop or start == stop


# --- exact resume ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("dtype,staleness", [("float32", 0), ("float32", 1), ("bfloat16", 0), ("bfloat16", 1)])
def test_resume_from_step_5_gives_steps_6_to_10_bitwise(tmp_path, placement, dtype, staleness):
    cfg = config(tmp_path, "a", placement, dtype=dtype, staleness=staleness)
    losses, states = train_with_checkpoint(tmp_path, "gpt", cfg, tmp_path / "ckpt")
    resumed, resumed_states = resume_from("gpt", config(tmp_path, "b", placement, dtype=dtype, staleness=staleness),
                                          tmp_path / "ckpt")
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)


def test_resume_with_clipping_and_fp16_loss_scaling_is_exact(tmp_path):
    """The loss scaler's scale and growth tracker come back too."""
    cfg = config(tmp_path, "a", dtype="float16", clip=1.0)
    losses, states = train_with_checkpoint(tmp_path, "mlp", cfg, tmp_path / "ckpt", clip=1.0)
    resumed, resumed_states = resume_from("mlp", config(tmp_path, "b", dtype="float16", clip=1.0), tmp_path / "ckpt",
                                          clip=1.0)
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)


@pytest.mark.parametrize("saved,loaded", [(("4KiB", "device+host+disk"), ("16KiB", "device")),
                                          (("16KiB", "device"), ("4KiB", "device+host+disk"))])
def test_a_checkpoint_loads_at_another_page_size_and_placement(tmp_path, saved, loaded):
    """Tensors span pages differently (the GPT's embedding spans several 4 KiB pages): the continuation equals
    the uninterrupted run within 1e-6 relative (bitwise, in fact: the arithmetic is per element)."""
    losses, _ = train_with_checkpoint(tmp_path, "gpt", config(tmp_path, "a", saved[1], page_bytes=saved[0]),
                                      tmp_path / "ckpt")
    resumed, _ = resume_from("gpt", config(tmp_path, "b", loaded[1], page_bytes=loaded[0]), tmp_path / "ckpt")
    assert resumed == pytest.approx(losses[AT:], rel=1e-6)


def test_a_checkpoint_moves_between_fp32_and_mixed_precision(tmp_path):
    """fp32 -> bf16: the master takes the saved fp32 weights; bf16 with staleness 1 -> fp32: the parameters take
    the master (the saved parameters lag it by one update)."""
    train_with_checkpoint(tmp_path, "mlp", config(tmp_path, "a"), tmp_path / "fp32")
    train_with_checkpoint(tmp_path, "mlp", config(tmp_path, "b", dtype="bfloat16", staleness=1), tmp_path / "bf16")
    for ckpt, dtype in (("fp32", "bfloat16"), ("bf16", "float32")):
        engine = angel_ptm.initialize(scrambled(CASES["mlp"][0]), config(tmp_path, f"c{ckpt}", dtype=dtype))
        try:
            engine.load_checkpoint(tmp_path / ckpt)
            probe = angel_ptm.initialize(scrambled(CASES["mlp"][0]), config(tmp_path, f"d{ckpt}"))
            probe.load_checkpoint(tmp_path / ckpt)
            name = engine.layout.slots[0].name
            assert torch.equal(engine.master_parameter(name), probe.parameter(name))
            probe.close()
        finally:
            engine.close()


class BatchNormNet(nn.Module):
    """A torch built-in with persistent buffers (BatchNorm's running statistics) and a frozen parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.out = nn.Linear(24, 32), nn.BatchNorm1d(32), nn.Linear(32, 24)
        self.scale = nn.Parameter(torch.ones(24), requires_grad=False)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x)))) * self.scale


def test_buffers_and_frozen_parameters_round_trip(tmp_path):
    loss_fn = CASES["mlp"][2]
    data = batches("mlp")
    engine = angel_ptm.initialize(BatchNormNet(), config(tmp_path, "a"))
    losses = []
    for s in range(STEPS):
        losses.append(step(engine, loss_fn, data[s]))
        if s + 1 == AT:
            engine.save_checkpoint(tmp_path / "ckpt", extra={"step": AT})
    engine.close()
    fresh = BatchNormNet()
    fresh.norm.running_mean.fill_(3.0)
    engine = angel_ptm.initialize(fresh, config(tmp_path, "b"))
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert [step(engine, loss_fn, data[s]) for s in range(AT, STEPS)] == losses[AT:]
    finally:
        engine.close()


# --- format and interop -------------------------------------------------------------------------------------------
def test_dcp_reads_it_with_the_models_names(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = CASES["mlp"][0]()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine = angel_ptm.initialize(model, config(tmp_path, "a"))
    try:
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "__0_0.distcp", "angel_ptm.json"]
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    for name, value in expected.items():
        assert torch.equal(plain[f"param.{name}"], value)
        assert torch.equal(plain[f"exp_avg.{name}"], torch.zeros_like(value))


def test_save_refuses_an_existing_directory_and_a_half_done_step(tmp_path):
    build, _, loss_fn = CASES["mlp"]
    engine = angel_ptm.initialize(build(), config(tmp_path, "a"))
    try:
        engine.save_checkpoint(tmp_path / "ckpt")
        with pytest.raises(CheckpointError, match="already exists"):
            engine.save_checkpoint(tmp_path / "ckpt")
        engine.backward(loss_fn(engine, *batches("mlp")[0]))
        with pytest.raises(CheckpointError, match="between backward"):
            engine.save_checkpoint(tmp_path / "other")
        engine.step()
    finally:
        engine.close()


def test_another_models_checkpoint_is_refused_naming_the_tensors(tmp_path):
    def refused(name, saved, loading, match):
        engine = angel_ptm.initialize(saved, config(tmp_path, f"{name}-saved"))
        engine.save_checkpoint(tmp_path / name)
        engine.close()
        other = angel_ptm.initialize(loading, config(tmp_path, f"{name}-loading"))
        try:
            with pytest.raises(CheckpointError, match=match):
                other.load_checkpoint(tmp_path / name)
        finally:
            other.close()

    def layers(n):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])

    refused("other", CASES["mlp"][0](), nn.Sequential(nn.Linear(24, 7), nn.Linear(7, 3), nn.Linear(3, 3),
                                                      nn.Linear(3, 3)),
            r"does not fit this model: 'param\.0\.weight' has shape \(64, 24\), the model's \(7, 24\).*"
            r"no 'param\.1\.weight'")
    # a larger model's checkpoint (a layer this one lacks) is refused too, not loaded in part
    refused("larger", layers(3), layers(2), r"does not fit this model: 'param\.2\.weight' is none of this model's")

    # one whose modules' extra states differ: refused before a page is written, the engine trains on as it was (it
    # was refused after the pages were filled: the engine failed, its state lost)
    class Extra(nn.Linear):
        def get_extra_state(self):
            return {"k": 1}

        def set_extra_state(self, state):
            pass

    torch.manual_seed(0)
    engine = angel_ptm.initialize(layers(2), config(tmp_path, "plain"))
    engine.save_checkpoint(tmp_path / "plain")
    engine.close()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), Extra(8, 8))
    other = angel_ptm.initialize(model, config(tmp_path, "extra"))
    try:
        before = other.state_dict()
        with pytest.raises(CheckpointError, match=r"extra states \[\] saved, \['1._extra_state'\] in the model"):
            other.load_checkpoint(tmp_path / "plain")
        after = other.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before if isinstance(before[k], torch.Tensor))
        other.backward(other(torch.randn(2, 8)).sum())
        other.step()  # not failed
    finally:
        other.close()


# --- faults -------------------------------------------------------------------------------------------------------
def save_two(tmp_path, name="a"):
    """Checkpoints at steps 2 and 4 of the MLP in a Checkpoints directory; the engine, still open, and the losses."""
    build, _, loss_fn = CASES["mlp"]
    data = batches("mlp")
    ckpts = Checkpoints(tmp_path / "ckpts", keep=2)
    engine = angel_ptm.initialize(build(), config(tmp_path, name))
    losses = []
    for s in range(4):
        losses.append(step(engine, loss_fn, data[s]))
        if s + 1 in (2, 4):
            ckpts.save(engine, s + 1, {"step": s + 1})
    return engine, ckpts, losses


@pytest.mark.parametrize("damage", ["bit-flip", "truncate", "metadata"])
def test_a_damaged_checkpoint_is_a_typed_error_naming_the_file_and_the_previous_one_loads(tmp_path, damage):
    engine, ckpts, losses = save_two(tmp_path)
    engine.close()
    newest = ckpts.path(4)
    victim = newest / (".metadata" if damage == "metadata" else "__0_0.distcp")
    raw = bytearray(victim.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 2] ^= 0x10
    victim.write_bytes(bytes(raw))
    fresh = angel_ptm.initialize(scrambled(CASES["mlp"][0]), config(tmp_path, "b"))
    try:
        with pytest.raises(CheckpointCorruptError, match=victim.name) as info:
            fresh.load_checkpoint(newest)
        assert str(victim) in str(info.value)
        if damage != "metadata":  # found while reading: the pages hold part of it, nothing trains on them
            with pytest.raises(EngineFailedError, match="failed part-way"):
                fresh.zero_grad()
        with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
            extra, path = ckpts.load_latest(fresh)
        assert path == ckpts.path(2) and extra == {"step": 2}
        # set aside, not deleted: the resumed run saves the same step again where the corrupt one was
        assert not newest.exists() and newest.with_name("step-4.corrupt").is_dir()
        loss_fn, data = CASES["mlp"][2], batches("mlp")
        assert [step(fresh, loss_fn, data[s]) for s in (2, 3)] == losses[2:]
        ckpts.save(fresh, 4, {"step": 4})
        assert ckpts.latest() == newest and ckpts.load_latest(fresh) == ({"step": 4}, newest)
    finally:
        fresh.close()


def test_a_full_disk_during_a_save_is_a_typed_error_that_leaves_training_and_the_last_checkpoint_intact(tmp_path):
    engine, ckpts, losses = save_two(tmp_path)
    reference, _, _ = save_two(tmp_path / "ref", "r")
    calls = []

    def disk_full(point):
        calls.append(point)
        if point == "item-written" and len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")

    storage.FAULT = disk_full
    try:
        with pytest.raises(CheckpointWriteError, match="No space left") as info:
            ckpts.save(engine, 5, {"step": 5})
        assert info.value.errno == errno.ENOSPC
    finally:
        storage.FAULT = None
    try:
        assert not ckpts.path(5).exists() and not Path(f"{ckpts.path(5)}.tmp").exists()
        assert ckpts.latest() == ckpts.path(4)
        loss_fn, data = CASES["mlp"][2], batches("mlp")
        assert [step(engine, loss_fn, data[s]) for s in (4, 5)] == [step(reference, loss_fn, data[s]) for s in (4, 5)]
    finally:
        engine.close()
        reference.close()


KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import angel_ptm
from angel_ptm.checkpoint import storage
from angel_ptm.checkpoint.directory import Checkpoints
from test_checkpoint import CASES, batches, config, step
from pathlib import Path
tmp = Path({tmp!r})
build, _, loss_fn = CASES["mlp"]
data = batches("mlp")
ckpts = Checkpoints(tmp / "ckpts", keep=2)
engine = angel_ptm.initialize(build(), config(tmp, "killed"))
for s in range(4):
    step(engine, loss_fn, data[s])
    if s + 1 == 2:
        ckpts.save(engine, 2, {{"step": 2}})
seen = []
def kill(point):
    seen.append(point)
    if point == {point!r} and (point != "item-written" or len(seen) == 5):
        os.kill(os.getpid(), signal.SIGKILL)
storage.FAULT = kill
ckpts.save(engine, 4, {{"step": 4}})
print("not killed")
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["item-written", "before-metadata", "before-rename"])
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_and_resume_is_exact(tmp_path, point):
    script = KILLED_SAVE.format(tests=str(TESTS), tmp=str(tmp_path), point=point)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    ckpts = Checkpoints(tmp_path / "ckpts")
    assert [s for s, _ in ckpts.complete()] == [2]
    assert Path(f"{ckpts.path(4)}.tmp").exists()  # the torn save is no checkpoint ...
    _, _, losses = save_two(tmp_path / "ref", "r")
    engine = angel_ptm.initialize(scrambled(CASES["mlp"][0]), config(tmp_path, "resumed"))
    try:
        assert ckpts.load_latest(engine)[0] == {"step": 2}
        loss_fn, data = CASES["mlp"][2], batches("mlp")
        assert [step(engine, loss_fn, data[s]) for s in (2, 3)] == losses[2:]
        ckpts.save(engine, 4, {"step": 4})  # ... and the next save replaces it
        assert [s for s, _ in ckpts.complete()] == [2, 4] and not Path(f"{ckpts.path(4)}.tmp").exists()
    finally:
        engine.close()
    # the killed process's page directory was removed by the next engine to start on its disk dir
    assert not any((tmp_path / "pages-killed").glob("pages-*"))


def test_keep_deletes_the_oldest_and_latest_names_the_newest(tmp_path):
    engine, ckpts, _ = save_two(tmp_path)
    try:
        ckpts.save(engine, 5, {"step": 5})
    finally:
        engine.close()
    assert [s for s, _ in ckpts.complete()] == [4, 5]
    assert (ckpts.root / "latest").read_text().strip() == "step-5"


@pytest.mark.slow
def test_a_soak_with_ssd_offload_and_frequent_checkpoints_leaks_nothing(tmp_path):
    """tools/soak.py, shortened: RSS, page files, checkpoints, threads and descriptors stay flat."""
    sys.path.insert(0, str(TESTS.parent))
    from tools.soak import run

    result = run(tmp_path, steps=120, every=10, keep=2)
    assert result["flat"], result
    assert result["checkpoints"] == 2 and result["page_files_left"] == 0


# --- a save beside training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,staleness,slowed", [("float32", 0, "sleeps"), ("bfloat16", 1, "sleeps"),
                                                    ("float32", 1, "paced")])
def test_a_background_save_holds_exactly_the_state_of_its_step_while_training_goes_on(tmp_path, dtype, staleness,
                                                                                      slowed, monkeypatch):
    """The save is slowed (a sleep after each item, or `checkpoint.async_max_gbps` at 20 kB/s in 16 KiB chunks until
    it is waited for: its 0.8 MB would take 40 s, far longer than the steps beside it even on a loaded machine) so
    that steps 6-8 update (and evict to disk) pages it has not written yet: it must still hold step 5's values
    (torch's async_save writes values from after the next update: pytorch #144657)."""
    import time as clock

    from angel_ptm.memory.tiers import DiskTier

    from angel_ptm.errors import BudgetError

    rehomed, refused = [], []
    rehome, alloc = DiskTier.rehome, DiskTier.alloc
    monkeypatch.setattr(DiskTier, "rehome", lambda self, *a: rehomed.append(a[:2]) or rehome(self, *a))

    def counted_alloc(self, kind):
        try:
            return alloc(self, kind)
        except BudgetError:
            refused.append(kind)  # in rehome: training would wait for the checkpoint to read a slot
            raise

    monkeypatch.setattr(DiskTier, "alloc", counted_alloc)

    build, _, loss_fn = CASES["gpt"]
    data = batches("gpt")
    cfg = config(tmp_path, "a", dtype=dtype, staleness=staleness)
    losses, states = train_with_checkpoint(tmp_path, "gpt", cfg, tmp_path / "sync")
    cfg = config(tmp_path, "b", dtype=dtype, staleness=staleness)
    if slowed == "paced":
        cfg["checkpoint"] = {"async_max_gbps": 2e-5}
        monkeypatch.setattr("angel_ptm.io.stream.CHUNK", 16 << 10)
    else:
        storage.FAULT = lambda point: clock.sleep(0.01) if point == "item-written" else None
    engine = angel_ptm.initialize(build(), cfg)
    try:
        for s in range(STEPS):
            step(engine, loss_fn, data[s])
            if s + 1 == AT:
                started = clock.monotonic()
                pending = engine.save_checkpoint(tmp_path / "bg", extra={"step": AT}, background=True)
                assert not pending.done()
        if slowed == "paced":  # its file's bytes at no more than 2e4 a second until it is waited for (then lifted)
            partial = tmp_path / "bg.tmp" / "__0_0.distcp"
            written = partial.stat().st_size if partial.exists() else 0
            assert written <= (clock.monotonic() - started) * 2e4 + 2 * (16 << 10)
            assert not pending.done() and pending.pace.bytes_per_s == 2e4
        assert engine.wait_for_checkpoint() == tmp_path / "bg"
        assert pending.staged_bytes > 0  # pages in memory at the save, changed by training before they were written
        assert rehomed  # pages written back while the save still held their slots went to other slots
        assert not refused  # ... always at once: training never waited for the checkpoint
        assert not engine.manager.disk._held and not engine.manager.disk._orphans  # every held slot released
        assert final_states(engine).keys() == states.keys()
    finally:
        storage.FAULT = None
        engine.close()
    resumed, resumed_states = resume_from("gpt", config(tmp_path, "c", dtype=dtype, staleness=staleness),
                                          tmp_path / "bg")
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)
