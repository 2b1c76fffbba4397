"""What a checkpoint load refuses, as an outside probe found it: a checkpoint with buffers this model does not have
(torch's strict load refuses them), and a load into a closed engine (it wrote the buffers and RNG only)."""

from __future__ import annotations

import shutil

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


def train_save_close(engine, xs, path) -> None:
    """`engine` trained a step on each of `xs` (a squared-output loss), saved to `path`, closed."""
    for x in xs:
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    engine.save_checkpoint(path)
    engine.close()


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


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (1.0 + 0.01 * self.calls)


class Counted(Plain):
    """A module whose forward depends on extra state it keeps outside its tensors (torch's `_extra_state`)."""

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]


def test_a_modules_extra_state_is_saved_and_restored_so_resume_is_exact(tmp_path):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=g) for _ in range(6)]

    def run(engine, batches):
        losses = []
        for x in batches:
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    first = angel_ptm.initialize(net(Counted()), job(tmp_path))
    run(first, xs[:3])
    first.save_checkpoint(tmp_path / "ck")
    expected = run(first, xs[3:])
    first.close()
    second = angel_ptm.initialize(net(Counted()), job(tmp_path / "2"))
    try:
        second.load_checkpoint(tmp_path / "ck")
        assert second.model[1].calls == 3
        assert run(second, xs[3:]) == expected
    finally:
        second.close()
    other = angel_ptm.initialize(net(Plain()), job(tmp_path / "3"))
    try:
        with pytest.raises(CheckpointError, match="extra states"):
            other.load_checkpoint(tmp_path / "ck")
    finally:
        other.close()


@pytest.mark.parametrize("saved, loaded", [("bfloat16", "float16"), ("float16", "bfloat16")])
def test_parameters_of_another_dtype_are_rounded_from_the_saved_master(saved, loaded, tmp_path):
    def engine_of(dtype, where):
        return angel_ptm.initialize(net(nn.Tanh()), dict(job(tmp_path / where), trainer={
            "device": "cpu", "grad_clip": 0, "dtype": dtype}))

    train_save_close(engine_of(saved, "a"), [torch.randn(8, 16, generator=torch.Generator().manual_seed(1))],
                     tmp_path / "ck")
    second = engine_of(loaded, "b")
    try:
        second.load_checkpoint(tmp_path / "ck")
        for name in ("0.weight", "2.bias"):
            master = second.master_parameter(name)
            assert torch.equal(second.parameter(name), master.to(getattr(torch, loaded)))
    finally:
        second.close()


@pytest.mark.parametrize("saved, loaded, staleness", [("float32", "bfloat16", 0), ("bfloat16", "float16", 0),
                                                     ("float32", "bfloat16", 1)])
def test_pages_loaded_in_another_dtype_with_a_disk_tier_are_not_backed_by_the_checkpoints_bytes(saved, loaded,
                                                                                             staleness, tmp_path):
    """A loaded page whose items came byte for byte from the checkpoint is backed by its file (the disk tier reads
    it there). One converted to another dtype was offered too, so its first read from disk checked the file's
    bytes of the saved dtype against it: ChecksumError naming an intact checkpoint. Now it trains on."""
    def engine_of(dtype, where, stale=0):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
        return angel_ptm.initialize(model, {
            "optimizer": {"lr": 1e-2, "staleness": stale},
            "memory": {"page_bytes": "4KiB", "device_budget": "48KiB", "host_budget": "32KiB",
                       "disk_dir": str(tmp_path / where)},
            "trainer": {"device": "cpu", "grad_clip": 0, "dtype": dtype}})

    xs = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    train_save_close(engine_of(saved, "a", staleness), xs[:2], tmp_path / "ck")
    second = engine_of(loaded, "b")
    try:
        second.load_checkpoint(tmp_path / "ck")
        for x in xs[2:]:
            loss = second(x).float().pow(2).mean()
            second.backward(loss)
            second.step()
            assert torch.isfinite(loss)
        assert second.memory_stats()["moved"].get("disk->host", 0) > 0  # (pages came back from the disk)
    finally:
        second.close()


def test_a_signal_that_lands_inside_a_save_ends_the_run_as_a_signal_not_a_checkpoint_error():
    """DCP reports what a save raised as a CheckpointException: a second SIGTERM (or Ctrl-C) during the signal's
    own save comes out as itself (exit 143 or 130), not as a failed checkpoint (exit 2)."""
    import types

    from torch.distributed.checkpoint.api import CheckpointException

    from angel_ptm.checkpoint.save_load import _run
    from angel_ptm.errors import Terminated

    def save():
        raise CheckpointException("save", {0: (Terminated(15), None)})

    with pytest.raises(Terminated):
        _run(types.SimpleNamespace(world=None), "save", save)


def test_every_error_pickles_as_raised():
    """A rank's error reaches the others pickled (DCP gathers a failed save's errors): every error class comes back
    with its type, message and attributes, whatever arguments its __init__ takes."""
    import inspect
    import pickle

    import angel_ptm.errors as errors

    classes = [c for c in vars(errors).values()
               if inspect.isclass(c) and issubclass(c, BaseException) and c.__module__ == errors.__name__]
    assert {"BudgetError", "ChecksumError", "Terminated", "CheckpointWriteError"} <= {c.__name__ for c in classes}
    for cls in classes:
        params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
                  if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        error = cls(*[7 if "int" in str(p.annotation) else f"{p.name}-x" for p in params])
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and str(back) == str(error) and back.__dict__ == error.__dict__, cls


def test_a_failed_collective_in_a_save_marks_the_engine_failed_so_close_uses_none():
    """A save whose collective failed (a peer died, or the ranks took different paths) leaves the ranks' collectives
    out of step: the engine is marked failed, so closing it reads no weights with collectives that would wait
    parallel.timeout_s for peers that are elsewhere."""
    import types

    from angel_ptm.checkpoint.save_load import _run
    from angel_ptm.failure import Failure

    engine = types.SimpleNamespace(world=object(), mesh=types.SimpleNamespace(rank=1), failure=Failure())

    def save():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(CheckpointError, match="on rank 1: a collective failed"):
        _run(engine, "save", save)
    assert "Connection closed by peer" in engine.failure.reason


def test_memory_stats_after_close_show_nothing_in_use_and_keep_the_record(tmp_path):
    engine = trained(net(nn.Tanh()), tmp_path)
    moved = engine.memory_stats()["moved"]
    engine.close()
    stats = engine.memory_stats()
    assert set(stats["in_use"].values()) == {0} and stats["moved"] == moved


def test_a_checkpoint_between_a_forward_and_its_backward_is_refused_and_a_dropped_forward_is_no_step(tmp_path):
    """The forward moved the RNG and BatchNorm's statistics, not yet the weights: a checkpoint there would not
    resume the run. Once the output is dropped (the step abandoned) or backwarded and stepped, saving goes on."""
    engine = trained(net(nn.BatchNorm1d(16)), tmp_path)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    try:
        loss = engine(x).pow(2).mean()
        with pytest.raises(CheckpointError, match="between a training forward and its backward"):
            engine.save_checkpoint(tmp_path / "ck")
        del loss
        engine.save_checkpoint(tmp_path / "ck")
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        engine.save_checkpoint(tmp_path / "ck2")
    finally:
        engine.close()


def test_a_load_keeps_the_learning_rate_rule_of_the_loading_job():
    """The saving job's "a schedule drives the lr" flag was restored onto the loading job: one with no lr_schedule
    then followed the default schedule (lr 0.001 where 0.007 was saved), and one spelling a schedule out lost it.
    Now a job without a schedule goes on at the saved lr (as torch's optimizer state carries it), and one with a
    schedule follows it from the step reached."""
    import tempfile

    from angel_ptm.lr import lr_at

    with tempfile.TemporaryDirectory() as tmp:
        def engine_of(schedule):
            config = {"optimizer": {"lr": 1e-2}, "memory": {"page_bytes": "4KiB"}, "trainer": {
                "device": "cpu", "grad_clip": 0, "steps": 10}}
            if schedule is not None:
                config["lr_schedule"] = schedule
            return angel_ptm.initialize(net(nn.Tanh()), config)

        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        linear = {"warmup_steps": 0, "decay": "linear", "min_lr_ratio": 0.1}
        for saved, loaded in ((linear, None), (None, linear)):
            first = engine_of(saved)
            for _ in range(3):
                first.backward(first(x).pow(2).mean())
                first.step()
            first.save_checkpoint(f"{tmp}/ck")
            saved_lr = first.optimizer.lr
            first.close()
            second = engine_of(loaded)
            try:
                second.load_checkpoint(f"{tmp}/ck")
                expected = saved_lr if loaded is None else lr_at(3, 1e-2, 10, 0, "linear", 0.1)
                assert second.optimizer.lr == pytest.approx(expected, rel=1e-12)
                second.backward(second(x).pow(2).mean())
                second.step()
                expected = saved_lr if loaded is None else lr_at(4, 1e-2, 10, 0, "linear", 0.1)
                assert second.optimizer.lr == pytest.approx(expected, rel=1e-12)
            finally:
                second.close()
            shutil.rmtree(f"{tmp}/ck", ignore_errors=True)
