"""The training loop (angel_ptm.trainer) and the learning-rate schedule (angel_ptm.lr).

The trainer runs here on ``PlainEngine``, a test double with the Engine interface over plain torch AdamW, so these
tests specify the loop itself and run whether or not the paging engine is present.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from angel_ptm.config import Config, load_config
from angel_ptm.data import BatchSampler, load_tokens, split_train_val
from angel_ptm.errors import ConfigValueError, DataError, RunDirInUseError, Terminated
from angel_ptm.lr import lr_at
from angel_ptm.models import build_model
from angel_ptm.trainer import Trainer, TrainResult, resolve_device

TEXT_FILE = Path(os.__file__)  # real text (os.py, ~40 KB) that a tiny model learns from in a few steps
MOVED_PAIRS = ("host->device", "device->host", "host->disk", "disk->host")


class PlainEngine:
    """Test double for ``angel_ptm.engine.Engine``: the same interface, plain torch AdamW, no paging.

    Every model state counts as "device" bytes in use and nothing is ever moved. ``fail_at_step`` makes
    ``step()`` raise on that (1-based) call, to test cleanup on errors.
    """

    def __init__(self, model, config: Config, trace=None, fail_at_step: int | None = None):
        opt = config.optimizer
        self.model, self.trace = model.to(resolve_device(config.trainer.device)), trace  # where batches go
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.fail_at_step, self.steps, self.closed = fail_at_step, 0, False
        self.lrs: list[float] = []

    def __call__(self, *inputs):
        return self.model(*inputs)

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def set_lr(self, lr: float) -> None:
        self.lrs.append(lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.steps}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def memory_stats(self) -> dict:
        states = [p for p in self.model.parameters()]
        states += [p.grad for p in self.model.parameters() if p.grad is not None]
        states += [t for s in self.optimizer.state.values() for t in s.values() if t.dim() > 0]
        in_use = sum(t.numel() * t.element_size() for t in states)
        return {"in_use": {"device": in_use, "host": 0, "disk": 0}, "moved": {pair: 0 for pair in MOVED_PAIRS}}

    def eval(self) -> None:
        self.model.eval()

    def train(self) -> None:
        self.model.train()

    def close(self) -> None:
        self.closed = True


def tiny_config(run_dir: Path, **sections) -> Config:
    raw = {
        "model": {"dim": 32, "n_layer": 1, "n_head": 2, "seq_len": 16},
        "data": {"path": str(TEXT_FILE), "batch_size": 4, "val_fraction": 0.1},
        "optimizer": {"lr": 1e-2},
        "lr_schedule": {"warmup_steps": 2},
        "trainer": {"steps": 4, "eval_every": 2, "eval_steps": 2},
        "run": {"dir": str(run_dir)},
    }
    for section, settings in sections.items():
        raw[section] = {**raw.get(section, {}), **settings}
    return load_config(raw)


def train(config: Config, **engine_options) -> tuple[TrainResult, list[PlainEngine]]:
    engines: list[PlainEngine] = []

    def factory(model, cfg, trace=None):
        engines.append(PlainEngine(model, cfg, trace, **engine_options))
        return engines[-1]

    return Trainer(config, engine_factory=factory, progress=False).run(), engines


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- learning-rate schedule -----------------------------------------------------------------------------------
def test_warmup_is_linear_and_reaches_base_lr_on_its_last_step():
    assert [lr_at(step, 1.0, 100, warmup_steps=4) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_decays_from_base_to_min_lr_at_total_steps():
    def lr(step):
        return lr_at(step, 1.0, 110, warmup_steps=10, decay="cosine", min_lr_ratio=0.1)

    assert lr(10) == 1.0
    assert lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))  # a quarter of the way
    assert lr(60) == pytest.approx(0.55)  # halfway: the mean of base and floor
    assert lr(110) == pytest.approx(0.1)
    assert lr(500) == pytest.approx(0.1)  # held after the end


def test_linear_decay_is_a_straight_line_to_the_floor():
    lrs = [lr_at(step, 2.0, 10, warmup_steps=0, decay="linear", min_lr_ratio=0.0) for step in (0, 5, 10)]
    assert lrs == pytest.approx([2.0, 1.0, 0.0])


def test_constant_schedule_holds_base_lr_after_warmup():
    assert lr_at(0, 0.5, 100, 10, "constant") == pytest.approx(0.05)
    assert lr_at(99, 0.5, 100, 10, "constant") == 0.5


def test_unknown_decay_is_rejected():
    with pytest.raises(ValueError, match="exponential"):
        lr_at(0, 1.0, 10, 0, "exponential")


# --- the training loop ----------------------------------------------------------------------------------------
def test_every_step_logs_one_metrics_line_with_the_contract_keys(tmp_path):
    result, _ = train(tiny_config(tmp_path))
    lines = [line for line in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in line]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert set(line) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_s", "in_use", "moved"}
        assert set(line["in_use"]) == {"device", "host", "disk"}
        assert line["moved"] == {pair: 0 for pair in MOVED_PAIRS}
        assert line["tokens_per_s"] > 0 and line["grad_norm"] > 0
    assert [line["loss"] for line in lines] == result.losses
    assert all(line["in_use"]["device"] > 0 for line in lines)


def test_learning_rate_follows_the_schedule(tmp_path):
    _, [engine] = train(tiny_config(tmp_path, trainer={"steps": 4}, lr_schedule={"warmup_steps": 2}))
    assert engine.lrs == [lr_at(step, 1e-2, 4, 2, "cosine", 0.1) for step in range(4)]
    assert engine.lrs[:2] == [5e-3, 1e-2]


def test_validation_loss_is_logged_every_eval_every_steps_and_at_the_end(tmp_path):
    result, _ = train(tiny_config(tmp_path, trainer={"steps": 5, "eval_every": 2}))
    evals = [line for line in read_jsonl(tmp_path / "metrics.jsonl") if "val_loss" in line]
    assert [line["step"] for line in evals] == [2, 4, 5]
    assert set(evals[0]) == {"step", "val_loss", "moved"}  # (moved: the evaluation's own traffic)
    assert result.final_val_loss == evals[-1]["val_loss"]


class CountingEngine(PlainEngine):
    """PlainEngine reporting made-up traffic and scheduler figures: step k moves 100 k bytes host->device and has
    k % 2 deviations, k planned moves and 0.001 k s of stall (replanned at step 2); an evaluation forward moves
    7 bytes disk->host; the forward of step `nan_at` returns NaN (the run diverges from there)."""

    def __init__(self, *args, nan_at: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.moved = {pair: 0 for pair in MOVED_PAIRS}
        self.nan_at = nan_at

    def __call__(self, *inputs):
        if not self.model.training:
            self.moved["disk->host"] += 7
        loss = self.model(*inputs)
        return loss * float("nan") if self.steps + 1 == self.nan_at and self.model.training else loss

    def step(self) -> None:
        super().step()
        self.moved["host->device"] += 100 * self.steps

    def memory_stats(self) -> dict:
        k = self.steps
        return dict(super().memory_stats(), moved=dict(self.moved),
                    schedule={"stall_s": 0.001 * k, "deviations": k % 2, "issued": k, "replanned": k == 2,
                              "repair_reads": 0})


def test_a_metrics_line_sums_the_steps_since_the_line_before_and_an_evaluation_logs_its_own_traffic(tmp_path):
    """log_every 3: each line's bytes moved and scheduler figures are those of every step since the line before
    (summed; replanned if any was), not the last step's alone; an evaluation's traffic is on its own line, not on
    the next step's; a loss that is not finite is logged as null (strict JSON), in the trace too."""
    engines = []

    def factory(model, cfg, trace=None):
        engines.append(CountingEngine(model, cfg, trace, nan_at=6))
        return engines[-1]

    Trainer(tiny_config(tmp_path, trainer={"steps": 7, "eval_every": 4, "eval_steps": 2, "log_every": 3}),
            engine_factory=factory, progress=False).run()

    def strict(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    lines = [json.loads(line, parse_constant=strict) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {line["step"]: line for line in lines if "loss" in line}
    evals = {line["step"]: line for line in lines if "val_loss" in line}
    assert sorted(train) == [3, 6, 7] and sorted(evals) == [4, 7]
    assert [train[k]["moved"]["host->device"] for k in (3, 6, 7)] == [600, 1500, 700]
    assert [train[k]["deviations"] for k in (3, 6, 7)] == [2, 1, 1]
    assert [train[k]["planned_moves"] for k in (3, 6, 7)] == [6, 15, 7]
    assert [train[k]["replanned"] for k in (3, 6, 7)] == [True, False, False]
    assert [train[k]["stall_s"] for k in (3, 6, 7)] == pytest.approx([0.006, 0.015, 0.007])
    assert all(line["moved"]["disk->host"] == 0 for line in train.values())
    assert [evals[k]["moved"] for k in (4, 7)] == [{**dict.fromkeys(MOVED_PAIRS, 0), "disk->host": 14}] * 2
    assert train[3]["loss"] is not None and train[6]["loss"] is None and train[7]["loss"] is None
    assert evals[4]["val_loss"] is not None and evals[7]["val_loss"] is None
    steps = [json.loads(line, parse_constant=strict) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [e["loss"] is None for e in steps if e["event"] == "step"] == [False] * 5 + [True] * 2


def test_validation_uses_the_same_held_out_batches_every_time(tmp_path):
    # lr so small the weights barely move: two evaluations on the same batches then agree closely.
    train(tiny_config(tmp_path, optimizer={"lr": 1e-9}, trainer={"steps": 2, "eval_every": 1}))
    first, second = [line["val_loss"] for line in read_jsonl(tmp_path / "metrics.jsonl") if "val_loss" in line]
    assert first == pytest.approx(second, abs=1e-5)


def test_eval_every_zero_never_evaluates(tmp_path):
    result, _ = train(tiny_config(tmp_path, trainer={"eval_every": 0}))
    assert result.final_val_loss is None
    assert not any("val_loss" in line for line in read_jsonl(tmp_path / "metrics.jsonl"))


def test_loss_falls_over_thirty_steps(tmp_path):
    result, _ = train(tiny_config(tmp_path, trainer={"steps": 30, "eval_every": 0}))
    assert result.steps == 30 and len(result.losses) == 30
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 1.0


def test_logged_loss_of_an_accumulated_step_is_the_mean_over_its_micro_batches(tmp_path):
    config = tiny_config(tmp_path, trainer={"steps": 1, "grad_accum": 2, "eval_every": 0})
    result, _ = train(config)
    torch.manual_seed(config.trainer.seed)
    model = build_model(config.model)  # the same initial weights the trainer built
    tokens, _ = load_tokens(config.data)
    batches = BatchSampler(split_train_val(tokens, 0.1).train, 4, 16, config.data.seed)
    with torch.no_grad():
        expected = sum(model(*batches.batch(k)).item() for k in (0, 1)) / 2
    assert result.losses == [pytest.approx(expected, rel=1e-5)]


def test_saved_config_loads_back_with_the_run_dir_filled_in(tmp_path):
    config = tiny_config(tmp_path)
    result, _ = train(config)
    saved = load_config(tmp_path / "config.yaml")
    assert saved.run.dir == str(tmp_path.resolve()) == str(result.run_dir)
    assert saved.model == config.model and saved.trainer == config.trainer


def test_trace_has_a_step_event_and_a_compute_interval_per_step(tmp_path):
    train(tiny_config(tmp_path, trainer={"steps": 3}))
    events = read_jsonl(tmp_path / "trace.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all({"t", "loss", "step_s"} <= set(e) for e in steps)
    compute = [e for e in events if e["event"] == "interval" and e["lane"] == "compute"]
    assert [e["name"] for e in compute] == ["step 1", "step 2", "step 3"]


def test_without_run_dir_a_timestamped_directory_under_runs_is_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tiny_config(tmp_path, trainer={"steps": 1, "eval_every": 0})
    config.run.dir = None
    first, _ = train(config)
    second, _ = train(config)
    assert first.run_dir.parent == tmp_path / "runs" and re.fullmatch(r"\d{8}-\d{6}(-\d+)?", first.run_dir.name)
    assert second.run_dir != first.run_dir  # two runs in the same second do not share a directory
    assert (first.run_dir / "metrics.jsonl").is_file()
    config.run.name = "gpt-small"  # a name: the directory says it
    named, _ = train(config)
    assert named.run_dir.parent == tmp_path / "runs" and re.fullmatch(r"gpt-small-\d{8}-\d{6}(-\d+)?",
                                                                       named.run_dir.name)
    with pytest.raises(ConfigValueError, match="run.name: must be a non-empty name without '/'"):
        tiny_config(tmp_path, run={"name": "a/b"})


def test_engine_and_trace_are_closed_when_a_step_fails(tmp_path):
    engines: list[PlainEngine] = []

    def failing_engine(model, cfg, trace=None):
        engines.append(PlainEngine(model, cfg, trace, fail_at_step=3))
        return engines[-1]

    with pytest.raises(RuntimeError, match="injected failure"):
        Trainer(tiny_config(tmp_path, trainer={"steps": 5}), engine_factory=failing_engine, progress=False).run()
    assert engines[0].closed
    trace = read_jsonl(tmp_path / "trace.jsonl")  # flushed by close, though far below the recorder's batch size
    assert [e["step"] for e in trace if e["event"] == "step"] == [1, 2]
    assert [line["step"] for line in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 2]  # 2 twice: + val_loss


def test_engine_is_closed_after_a_normal_run(tmp_path):
    _, [engine] = train(tiny_config(tmp_path))
    assert engine.closed and engine.steps == 4


def test_a_vocabulary_smaller_than_the_data_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigValueError, match=r"model\.vocab_size.*256.*got 100"):
        train(tiny_config(tmp_path / "run", model={"vocab_size": 100}))
    assert not (tmp_path / "run").exists()  # checked before anything is written


def test_a_validation_split_shorter_than_one_window_is_a_data_error(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("x" * 100)
    with pytest.raises(DataError, match=r"validation split has 10 tokens.*data\.val_fraction"):
        train(tiny_config(tmp_path / "run", data={"path": str(text)}))


def test_a_run_dir_that_cannot_be_created_is_a_config_error_naming_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigValueError, match=r"run\.dir: cannot create .*file"):
        train(tiny_config(blocker / "run"))


# --- a run directory holds one run ----------------------------------------------------------------------------
def test_a_run_dir_with_an_earlier_runs_metrics_is_refused_and_left_as_it_was(tmp_path):
    train(tiny_config(tmp_path, trainer={"steps": 1, "eval_every": 0}))
    before = {name: (tmp_path / name).read_bytes() for name in ("metrics.jsonl", "config.yaml", "trace.jsonl")}
    size = len(before["metrics.jsonl"])
    with pytest.raises(RunDirInUseError) as info:
        train(tiny_config(tmp_path, trainer={"steps": 2, "eval_every": 0}))
    assert str(info.value) == (f"run.dir: {tmp_path.resolve()} already holds the metrics of an earlier run "
                               f"({tmp_path.resolve() / 'metrics.jsonl'}, {size} bytes); choose another run.dir or "
                               f"move that file away")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_an_empty_metrics_file_left_by_a_refused_start_does_not_block_the_next_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    result, _ = train(tiny_config(tmp_path, trainer={"steps": 1, "eval_every": 0}))
    assert [line["step"] for line in read_jsonl(tmp_path / "metrics.jsonl")] == [1]


# --- progress without a terminal ------------------------------------------------------------------------------
def test_without_a_terminal_one_plain_line_is_printed_per_logged_step(tmp_path, capsys):
    config = tiny_config(tmp_path, trainer={"steps": 5, "log_every": 2, "eval_every": 0})
    result = Trainer(config, engine_factory=PlainEngine, progress=True).run()  # capsys: stdout is no terminal
    lines = capsys.readouterr().out.splitlines()
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in metrics] == [2, 4, 5]
    assert lines == [f"step {m['step']}/5 | loss {m['loss']:.4f} | lr {m['lr']:.3e} | {m['tokens_per_s']:,.0f} tokens/s"
                     for m in metrics]
    assert [m["loss"] for m in metrics] == [result.losses[1], result.losses[3], result.losses[4]]


def test_no_progress_prints_nothing_per_step(tmp_path, capsys):
    train(tiny_config(tmp_path, trainer={"steps": 3, "eval_every": 0}))
    assert capsys.readouterr().out == ""


# --- trace.max_bytes ------------------------------------------------------------------------------------------
def test_trace_max_bytes_bounds_the_runs_trace_to_one_step_event_per_step(tmp_path):
    train(tiny_config(tmp_path, trainer={"steps": 4, "eval_every": 0}, trace={"max_bytes": 200}))  # the start line and one interval line
    events = read_jsonl(tmp_path / "trace.jsonl")
    assert [e["event"] for e in events] == ["mark", "interval", "mark", "step", "step", "step", "step"]
    assert events[0]["name"] == "trace start" and events[2]["name"] == "trace truncated"
    assert events[2]["max_bytes"] == 200
    assert [e["left_out"] for e in events[3:]] == [{}, {"interval": 1}, {"interval": 1}, {"interval": 1}]


def _trace_lines(path, events):
    path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))


def test_a_resumed_runs_trace_drops_the_earlier_runs_events_after_the_checkpoints_step(tmp_path):
    """The steps after the checkpoint, which the resumed run takes again, are traced once: the earlier run's events
    from the start of the next step (its compute interval's start) on leave the file; the save at the checkpoint's
    step, before that start, stays; so do the resumed run's own events, after."""
    from angel_ptm.trace import TraceRecorder

    path = tmp_path / "trace.jsonl"
    first = [{"t": 0.0, "event": "mark", "name": "trace start", "unix_s": 1.0},
             {"t": 0.1, "event": "alloc", "page": "p0", "kind": "param", "src": None, "dst": "host", "bytes": 4},
             {"t": 0.1, "event": "interval", "lane": "compute", "name": "step 1", "dur": 0.2},
             {"t": 0.3, "event": "step", "step": 1, "loss": 2.0, "step_s": 0.2},
             {"t": 0.35, "event": "moved", "page": "p0", "kind": "param", "src": "host", "dst": "disk", "bytes": 4},
             {"t": 0.4, "event": "moved", "page": "p0", "kind": "param", "src": "disk", "dst": "host", "bytes": 4},
             {"t": 0.4, "event": "interval", "lane": "compute", "name": "step 2", "dur": 0.2},
             {"t": 0.6, "event": "step", "step": 2, "loss": 1.5, "step_s": 0.2}]
    _trace_lines(path, first)
    recorder = TraceRecorder(path)
    recorder.event("alloc", page="p1", kind="param", dst="host", nbytes=4)
    assert recorder.resumed_at(1) > 0
    recorder.event("step", step=2, loss=1.5)
    recorder.close()
    events = read_jsonl(path)
    assert events[:5] == first[:5]  # up to step 2's start: its moves from t = 0.4 on go, the save's before stay
    assert [e["event"] for e in events[5:]] == ["mark", "alloc", "step"] and events[5]["name"] == "trace start"
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]
    assert recorder.bytes == path.stat().st_size

    # No compute intervals (a trace past trace.max_bytes): up to the next step's event (its summary); a step not
    # in the trace (another run's) leaves the file as it is
    _trace_lines(path, [e for e in first if e["event"] != "interval"])
    recorder = TraceRecorder(path)
    assert recorder.resumed_at(7) == 0
    assert recorder.resumed_at(1) > 0
    recorder.close()
    assert [e["event"] for e in read_jsonl(path)] == ["mark", "alloc", "step", "moved", "moved", "mark"]

    # A run that ended at the step resumed from: its evaluation and save after the step's event stay
    ended = first + [{"t": 0.65, "event": "moved", "page": "p0", "kind": "param", "src": "disk", "dst": "host",
                      "bytes": 4}]  # (the final evaluation's)
    _trace_lines(path, ended)
    recorder = TraceRecorder(path)
    assert recorder.resumed_at(2) == 0
    recorder.close()
    assert read_jsonl(path)[:len(ended)] == ended


# --- SIGTERM --------------------------------------------------------------------------------------------------
def test_sigterm_during_a_run_raises_terminated_closes_the_engine_and_restores_the_handler(tmp_path):
    engines: list[PlainEngine] = []

    class SignalledEngine(PlainEngine):
        def step(self):
            super().step()
            if self.steps == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    def factory(model, cfg, trace=None):
        engines.append(SignalledEngine(model, cfg, trace))
        return engines[-1]

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as info:
        Trainer(tiny_config(tmp_path, trainer={"steps": 5, "eval_every": 0}), engine_factory=factory,
                progress=False).run()
    assert info.value.signum == signal.SIGTERM and isinstance(info.value, KeyboardInterrupt)
    assert engines[0].closed and engines[0].steps == 2
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_that_stops_one_rank_closes_its_engine_without_collectives():
    """With several ranks a signal may stop this rank alone (checkpoint.on_signal false, a second signal during the
    signal's save): closing the engine then read the weights back with ZeRO-3 collectives its peers never joined,
    so the rank waited parallel.timeout_s and exited 2 blaming a peer instead of 143 at once. Its engine is marked
    failed before it closes (a failed engine closes without collectives); other errors, and one rank, are left
    as they were."""
    from types import SimpleNamespace

    from angel_ptm.failure import Failure
    from angel_ptm.trainer import _interrupted_alone

    for exc_type, world, failed in ((Terminated, 2, True), (KeyboardInterrupt, 2, True), (RuntimeError, 2, False),
                                    (None, 2, False), (Terminated, 1, False)):
        engine = SimpleNamespace(failure=Failure())  # (not `distributed`: the test's process group is untouched)
        mesh = SimpleNamespace(distributed=world > 1, rank=1)
        assert _interrupted_alone(engine, mesh)(exc_type, None, None) is False  # the exception goes on
        assert (engine.failure.reason is not None) == failed
        if failed:
            assert "interrupted on rank 1" in engine.failure.reason


def test_a_signal_delivered_twice_at_once_asks_for_one_save_and_a_later_one_stops_at_once(monkeypatch):
    """Slurm signals every task of a step, torchrun's agent among them, which passes SIGTERM on to its workers: a
    worker gets it twice within milliseconds and took the second for "stop at once", so no checkpoint was saved
    (probe e2). A second signal within SAME_REQUEST_S of the first is the same request; after it, one stops."""
    from angel_ptm.trainer import StopSignals

    now = [100.0]
    monkeypatch.setattr("angel_ptm.trainer.time.monotonic", lambda: now[0])
    with StopSignals() as signals:
        signals.save_first = True
        signals._on_signal(signal.SIGTERM, None)
        now[0] += 0.01
        signals._on_signal(signal.SIGTERM, None)  # the same request again: still a save at the step's end
        assert signals.requested(None) == signal.SIGTERM
        now[0] += StopSignals.SAME_REQUEST_S
        with pytest.raises(Terminated):
            signals._on_signal(signal.SIGTERM, None)
