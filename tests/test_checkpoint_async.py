"""A save beside training: what its snapshot copies, and its pace (checkpoint.async_max_gbps)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import angel_ptm
from angel_ptm.checkpoint.planners import SAVED_KINDS
from angel_ptm.checkpoint.save_load import async_rate
from angel_ptm.config import load_config

from test_checkpoint import AT, STEPS, assert_bitwise, batches, config, resume_from, step, train_with_checkpoint
from test_engine_equivalence import CASES


def test_a_background_save_copies_nothing_that_training_does_not_change_before_it_is_written(tmp_path):
    """The snapshot is copy-on-write: a save awaited before the next step copies no page aside (the writer reads
    each one from its slot as it comes to it), and holds exactly its step's state."""
    build, _, loss_fn = CASES["gpt"]
    data = batches("gpt")
    losses, states = train_with_checkpoint(tmp_path, "gpt", config(tmp_path, "a"), tmp_path / "sync")
    engine = angel_ptm.initialize(build(), config(tmp_path, "b"))
    try:
        for s in range(STEPS):
            step(engine, loss_fn, data[s])
            if s + 1 == AT:
                pending = engine.save_checkpoint(tmp_path / "bg", extra={"step": AT}, background=True)
                assert pending.wait() == tmp_path / "bg"
                assert pending.staged_bytes == 0
                assert any(p.buffer is not None and p.kind in SAVED_KINDS for p in engine.manager.pages)
                assert not engine.manager._guards  # every guard dropped with the save
    finally:
        engine.close()
    resumed, resumed_states = resume_from("gpt", config(tmp_path, "c"), tmp_path / "bg")
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)


def test_an_auto_pace_spreads_a_save_over_half_the_time_to_the_next():
    auto = load_config({"checkpoint": {"async_max_gbps": "auto", "every": 10}}).checkpoint
    assert async_rate(auto, 4_000_000, step_seconds=0.2) == pytest.approx(4_000_000 / (0.5 * 10 * 0.2))
    assert async_rate(auto, 4_000_000, step_seconds=None) is None  # no step time yet: unpaced
    no_every = load_config({"checkpoint": {"async_max_gbps": "auto"}}).checkpoint
    assert async_rate(no_every, 4_000_000, step_seconds=0.2) is None  # saves only when asked: unpaced
    fixed = load_config({"checkpoint": {"async_max_gbps": 0.25}}).checkpoint
    assert async_rate(fixed, 4_000_000, step_seconds=0.2) == 0.25e9
    assert async_rate(load_config(None).checkpoint, 4_000_000, step_seconds=0.2) is None


def test_waiting_for_a_paced_save_lifts_its_pace(tmp_path):
    """An "auto" pace over 10000 steps would take hours; waiting for the save (as the next save, a load, close
    or a signal does) lets the rest go at once, and the checkpoint is whole."""
    build, _, loss_fn = CASES["gpt"]
    data = batches("gpt")
    cfg = config(tmp_path, "a")
    cfg["checkpoint"] = {"async_max_gbps": "auto", "every": 10000}
    engine = angel_ptm.initialize(build(), cfg)
    try:
        for s in range(3):
            step(engine, loss_fn, data[s])
        assert engine.step_seconds is not None and engine.step_seconds > 0
        pending = engine.save_checkpoint(tmp_path / "bg", extra={"step": 3}, background=True)
        rate = pending.pace.bytes_per_s
        expected = async_rate(engine.config.checkpoint, engine.layout.page_bytes * sum(
            1 for p in engine.manager.pages if p.kind in SAVED_KINDS), engine.step_seconds)
        assert rate is not None and rate == pytest.approx(expected, rel=0.5)
        time.sleep(0.2)
        assert not pending.done()  # paced: a few KB a second
        t0 = time.monotonic()
        assert engine.wait_for_checkpoint() == tmp_path / "bg"
        assert pending.pace.bytes_per_s is None and time.monotonic() - t0 < 60
    finally:
        engine.close()
    other = angel_ptm.initialize(build(), config(tmp_path, "b"))
    try:
        assert other.load_checkpoint(tmp_path / "bg") == {"step": 3}
    finally:
        other.close()


def test_a_failed_background_save_whose_error_was_raised_fails_no_later_save(tmp_path, monkeypatch):
    """A save beside training that fails raises its typed error from its own wait(); the engine's next save (the
    disk fine again) is not failed by that error a second time, and writes its checkpoint. One whose error nobody
    waited for is raised by the next save (nothing is dropped unseen)."""
    import errno

    from angel_ptm.checkpoint import storage
    from angel_ptm.errors import CheckpointWriteError

    build, _, loss_fn = CASES["mlp"]
    data = batches("mlp")
    engine = angel_ptm.initialize(build(), config(tmp_path, "a"))

    def full(point):
        raise OSError(errno.ENOSPC, "No space left on device")
    try:
        step(engine, loss_fn, data[0])
        monkeypatch.setattr(storage, "FAULT", full)
        pending = engine.save_checkpoint(tmp_path / "first", background=True)
        with pytest.raises(CheckpointWriteError):
            pending.wait()
        monkeypatch.setattr(storage, "FAULT", None)
        assert engine.save_checkpoint(tmp_path / "second") == tmp_path / "second"
        monkeypatch.setattr(storage, "FAULT", full)
        engine.save_checkpoint(tmp_path / "third", background=True)
        while not engine.pending_checkpoint.done():
            time.sleep(0.01)
        monkeypatch.setattr(storage, "FAULT", None)
        with pytest.raises(CheckpointWriteError, match="third"):  # (not waited for: the next save says so)
            engine.save_checkpoint(tmp_path / "fourth")
    finally:
        engine.close()
    assert (tmp_path / "second" / ".metadata").is_file() and not (tmp_path / "first").exists()


EXIT_SCRIPT = """
import sys, torch
import angel_ptm
from angel_ptm.models import GPT, GPTConfig
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=64))
engine = angel_ptm.initialize(model, {"memory": {"page_bytes": 1 << 14, "device_budget": 1 << 20,
                                                 "host_budget": 1 << 20, "disk_dir": sys.argv[1] + "/pages"},
                                      "trainer": {"device": "cpu"},
                                      "checkpoint": {"async_max_gbps": 1e-6}})  # a year at this pace
x = torch.randint(0, 64, (2, 16))
engine.backward(engine(x, x))
engine.step()
engine.save_checkpoint(sys.argv[1] + "/ckpt", background=True)
print("returned", flush=True)
"""


def test_a_script_that_returns_while_a_background_save_is_written_exits_once_it_is_whole(tmp_path):
    """No close(), no wait(): the interpreter's exit lifts the save's pace and waits for it (its thread was a
    daemon, cut off at exit: no checkpoint and status 0, or an abort inside a native call), says so in one line,
    and the checkpoint loads."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(angel_ptm.__file__).parents[1]),
                                                                        os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "returned" in run.stdout
    assert f"the checkpoint {tmp_path / 'ckpt'} is still being written: the exit waits for it" in run.stderr
    assert (tmp_path / "ckpt" / ".metadata").is_file() and not (tmp_path / "ckpt.tmp").exists()
    from angel_ptm.models import GPT, GPTConfig

    engine = angel_ptm.initialize(GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=64)),
                                  {"memory": {"page_bytes": 1 << 14, "disk_dir": str(tmp_path / "pages2")},
                                   "trainer": {"device": "cpu"}})
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert engine._steps_done == 1
    finally:
        engine.close()
