"""The training loop on the real paging Engine (tests/test_trainer.py specifies the loop on a plain-torch stand-in).

The stand-in's set_lr changes torch's param group, so those tests pass whether or not the real Engine's does anything;
here the schedule must reach the pages: the page-wise AdamW uses the scheduled learning rate in every update, and
the run's losses equal the stand-in's (plain torch AdamW) step for step."""

from __future__ import annotations

import dataclasses

import pytest

from angel_ptm.lr import lr_at
from angel_ptm.optim.paged_adamw import PagedAdamW
from angel_ptm.trainer import Trainer
from tests.test_trainer import read_jsonl, tiny_config, train

PAGES = {"page_bytes": "4KiB", "device_budget": "128KiB", "host_budget": "128KiB"}  # all three tiers in use


def engine_config(run_dir, scheduler="planned", **sections):
    return tiny_config(run_dir, memory={**PAGES, "scheduler": scheduler},
                       trainer={"steps": 6, "eval_every": 3, "device": "cpu"}, **sections)


@pytest.mark.parametrize("scheduler", ["on_demand", "planned"])
def test_the_real_engine_trains_like_plain_torch_through_the_trainer(scheduler, tmp_path):
    plain, _ = train(engine_config(tmp_path / "plain", scheduler))
    paged = Trainer(engine_config(tmp_path / "paged", scheduler), progress=False).run()
    assert paged.losses == pytest.approx(plain.losses, rel=1e-5)
    assert paged.final_val_loss == pytest.approx(plain.final_val_loss, rel=1e-5)
    moved = [line["moved"] for line in read_jsonl(tmp_path / "paged" / "metrics.jsonl") if "loss" in line]
    assert sum(m["disk->host"] for m in moved) > 0  # the pages really lived on disk


def test_the_learning_rate_schedule_reaches_every_page_update(tmp_path, monkeypatch):
    used: dict[int, set[float]] = {}  # optimizer step -> learning rates its page updates used
    update = PagedAdamW._update

    def spy(self, *args, **kwargs):
        used.setdefault(self.step_count, set()).add(self.step_lr)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(PagedAdamW, "_update", spy)
    config = engine_config(tmp_path, lr_schedule={"warmup_steps": 3, "decay": "linear", "min_lr_ratio": 0.2})
    Trainer(config, progress=False).run()
    expected = [lr_at(step, 1e-2, 6, 3, "linear", 0.2) for step in range(6)]
    assert [sorted(used[step]) for step in range(1, 7)] == [[lr] for lr in expected]
    logged = [line["lr"] for line in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in line]
    assert logged == pytest.approx(expected)


# --- checkpoints and resume -----------------------------------------------------------------------------------
def checkpointed(run_dir, steps=10, **checkpoint):
    config = tiny_config(run_dir, memory=PAGES, trainer={"steps": steps, "eval_every": 0, "device": "cpu"},
                         checkpoint={"every": 5, **checkpoint})
    return config


def losses_logged(run_dir):
    return [(line["step"], line["loss"]) for line in read_jsonl(run_dir / "metrics.jsonl") if "loss" in line]


def test_sigterm_saves_a_checkpoint_at_the_steps_end_and_train_resume_continues_the_run_exactly(tmp_path):
    import os
    import signal

    from angel_ptm import cli
    from angel_ptm.config import save_config
    from angel_ptm.engine import initialize
    from angel_ptm.errors import Terminated

    whole = Trainer(checkpointed(tmp_path / "whole"), progress=False).run()
    assert [p.name for p in sorted((tmp_path / "whole" / "checkpoints").iterdir())] == ["latest", "step-10",
                                                                                          "step-5"]

    def signalled(model, cfg, trace=None):  # SIGTERM arrives during step 7's forward
        engine = initialize(model, cfg, trace=trace)
        calls = {"n": 0}
        forward = engine.__call__

        class Engine(type(engine)):
            def __call__(self, *args, **kwargs):
                calls["n"] += 1
                if calls["n"] == 7:
                    os.kill(os.getpid(), signal.SIGTERM)
                return forward(*args, **kwargs)

        engine.__class__ = Engine
        return engine

    run_dir = tmp_path / "stopped"
    with pytest.raises(Terminated):
        Trainer(checkpointed(run_dir), engine_factory=signalled, progress=False).run()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-7"  # saved after step 7, then stopped
    assert not any((run_dir / "pages").glob("pages-*"))  # page files removed on the way out
    save_config(checkpointed(run_dir), run_dir / "config.yaml")  # as the run wrote it
    assert cli.main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    assert losses_logged(run_dir) == [(i + 1, loss) for i, loss in enumerate(whole.losses)]  # each step once


def test_a_torchrun_restart_resumes_from_the_latest_checkpoint_by_itself(tmp_path, monkeypatch):
    whole = Trainer(checkpointed(tmp_path / "whole"), progress=False).run()
    run_dir = tmp_path / "restarted"
    Trainer(checkpointed(run_dir), progress=False).run()  # the first attempt was killed saving step 10's checkpoint
    (run_dir / "checkpoints" / "step-10").rename(run_dir / "checkpoints" / "step-10.tmp")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = Trainer(checkpointed(run_dir), progress=False).run()
    assert again.resumed_from.name == "step-5" and again.start_step == 6
    assert again.losses == whole.losses[5:]
    assert losses_logged(run_dir) == [(i + 1, loss) for i, loss in enumerate(whole.losses)]
    # The trace is appended to as well: the first attempt's events up to its checkpoint's step stay (those of
    # steps 6-10, taken again, go, as their metrics lines do), the restart's follow on one clock
    events = read_jsonl(run_dir / "trace.jsonl")
    starts = [i for i, e in enumerate(events) if e.get("name") == "trace start"]
    assert len(starts) == 2 and starts[0] == 0
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 11))
    compute = [e["name"] for e in events if e["event"] == "interval" and e["lane"] == "compute"]
    assert compute == [f"step {k}" for k in range(1, 11)]
    from angel_ptm.viz.reader import ReadIssues, iter_events

    issues = ReadIssues()
    t = [e["t"] for e in iter_events(run_dir / "trace.jsonl", issues) if e["event"] == "step"]
    assert issues.segments == 2 and t == sorted(t)  # the restart's steps after the first attempt's
    assert t[5] - t[4] >= events[starts[1]]["unix_s"] - events[0]["unix_s"] - t[4] - 1e-6


def test_checkpoints_written_beside_training_resume_exactly(tmp_path):
    whole = Trainer(checkpointed(tmp_path / "whole"), progress=False).run()
    run_dir = tmp_path / "async"
    result = Trainer(checkpointed(run_dir, async_save=True), progress=False).run()
    assert result.losses == whole.losses and result.last_checkpoint.name == "step-10"
    (run_dir / "checkpoints" / "step-10").rename(run_dir / "checkpoints" / "step-10.tmp")
    again = Trainer(checkpointed(run_dir, async_save=True), progress=False)
    again.config = dataclasses.replace(again.config, run=dataclasses.replace(again.config.run, resume="auto"))
    assert again.run().losses == whole.losses[5:]


def test_resume_auto_with_no_checkpoint_starts_over_keeping_the_earlier_record(tmp_path, monkeypatch, caplog):
    """A torchrun restart (resume auto) in a run.dir whose first attempt died before its first checkpoint: this
    attempt starts at step 0 and gives the same losses, and the first one's metrics and trace are renamed, kept."""
    first = Trainer(checkpointed(tmp_path, steps=3, every=0), progress=False).run()  # (died before one)
    before = {name: (tmp_path / name).read_bytes() for name in ("metrics.jsonl", "trace.jsonl")}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with caplog.at_level("WARNING", logger="angel_ptm"):
        again = Trainer(checkpointed(tmp_path, steps=3, every=0), progress=False).run()
    assert again.resumed_from is None and again.losses == first.losses
    assert losses_logged(tmp_path) == [(i + 1, loss) for i, loss in enumerate(first.losses)]
    assert {name: (tmp_path / f"{name}.1").read_bytes() for name in before} == before
    assert "the earlier metrics.jsonl is kept as metrics.jsonl.1" in caplog.text


def test_with_log_every_the_logged_lines_count_every_steps_bytes_moved(tmp_path):
    every = Trainer(engine_config(tmp_path / "every", "on_demand"), progress=False).run()  # (its moves: no timing)
    sparse = engine_config(tmp_path / "sparse", "on_demand")
    sparse = dataclasses.replace(sparse, trainer=dataclasses.replace(sparse.trainer, log_every=4),
                                 checkpoint=dataclasses.replace(sparse.checkpoint, every=3))
    assert Trainer(sparse, progress=False).run().losses == every.losses

    def total(run):
        lines = [line for line in read_jsonl(tmp_path / run / "metrics.jsonl") if "loss" in line]
        return [line["step"] for line in lines], {pair: sum(line["moved"][pair] for line in lines)
                                                  for pair in lines[0]["moved"]}

    # steps 1-2 and 5 are in the lines after them; a checkpoint's step has a line (a resume from it keeps every
    # step before it in the lines it keeps)
    steps, moved = total("sparse")
    assert steps == [3, 4, 6] and moved == total("every")[1]


def test_a_run_resumed_with_another_grad_accum_goes_on_with_the_next_micro_batches(tmp_path, monkeypatch):
    import angel_ptm.trainer as trainer_module

    seen = []
    batch = trainer_module.BatchSampler.batch
    monkeypatch.setattr(trainer_module.BatchSampler, "batch", lambda self, k: seen.append(k) or batch(self, k))
    first = checkpointed(tmp_path / "run", steps=6)
    first = dataclasses.replace(first, trainer=dataclasses.replace(first.trainer, grad_accum=2))
    Trainer(first, progress=False).run()  # checkpoints at steps 5 and 6: 12 micro-batches
    assert seen == list(range(12))
    seen.clear()
    (tmp_path / "run" / "checkpoints" / "step-6").rename(tmp_path / "run" / "checkpoints" / "step-6.tmp")
    again = checkpointed(tmp_path / "run", steps=8)
    again = dataclasses.replace(again, run=dataclasses.replace(again.run, resume="auto"))
    assert Trainer(again, progress=False).run().start_step == 6  # from step 5's checkpoint, grad_accum 1 now
    assert seen == [10, 11, 12]  # not 5, 6, 7 (step * grad_accum): those were trained on before


def test_a_finished_staleness_1_run_extended_by_resume_continues_as_the_longer_run(tmp_path):
    """optimizer.staleness 1: the checkpoint after the last step is saved before that step's update lands in the
    parameters (the run's final flush), a step behind as a longer run has them, so resuming it with more steps
    continues that run bit for bit (it was saved flushed: the extension's losses differed from step 4 on)."""
    def config(run_dir, steps, **run):
        return tiny_config(run_dir, memory=PAGES, optimizer={"lr": 1e-2, "staleness": 1},
                           lr_schedule={"warmup_steps": 0, "decay": "constant"},
                           trainer={"steps": steps, "eval_every": 0, "device": "cpu"}, checkpoint={"every": 3},
                           run=run)

    longer = Trainer(config(tmp_path / "longer", 6), progress=False).run()
    Trainer(config(tmp_path / "short", 3), progress=False).run()
    extended = Trainer(config(tmp_path / "short", 6, resume="auto"), progress=False).run()
    assert extended.start_step == 4 and extended.losses == longer.losses[3:]
