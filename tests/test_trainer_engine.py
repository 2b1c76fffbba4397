"""The training loop on the real paging Engine (tests/test_trainer.py specifies the loop on a plain-torch stand-in).

The stand-in's set_lr changes torch's param group, so those tests pass whether or not the real Engine's does anything;
here the schedule must reach the pages: the page-wise AdamW uses the scheduled learning rate in every update, and
the run's losses equal the stand-in's (plain torch AdamW) step for step."""

from __future__ import annotations

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
