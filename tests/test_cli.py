"""The ``angel-ptm`` command line: user mistakes are one line on stderr and exit code 2; training runs a job.

Error-path tests fail before the engine is created, so they run anywhere; tests that train need the paging engine
(``angel_ptm.engine``) and are skipped until it is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from angel_ptm import cli
from angel_ptm.config import load_config, parse_bytes
from angel_ptm.models import build_model

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "model.dim=32", "model.n_layer=1", "model.n_head=2", "model.seq_len=16",
    f"data.path={os.__file__}", "data.batch_size=4", "trainer.eval_steps=1", "memory.page_bytes=64KiB",
]


def set_args(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("angel-ptm: error: "), stderr
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0]


def run_error(capsys, argv: list[str], *fragments: str) -> None:
    assert cli.main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, *fragments)


# --- user mistakes --------------------------------------------------------------------------------------------
def test_unknown_key_names_the_closest_valid_key(capsys, tmp_path):
    run_error(capsys, ["train", *set_args("trainer.stepz=2", f"run.dir={tmp_path}")],
              "unknown config key 'trainer.stepz'", "did you mean trainer.steps?")


def test_missing_config_file_is_an_error(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    run_error(capsys, ["train", str(missing)], f"config file not found: {missing}")


def test_missing_data_directory_is_an_error_and_leaves_no_run_directory(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_error(capsys, ["train", "--no-progress", *set_args("data.path=/nonexistent", f"run.dir={run_dir}")],
              "/nonexistent")
    assert not run_dir.exists()


def test_negative_budget_is_an_error(capsys):
    run_error(capsys, ["train", *set_args("memory.host_budget=-1GiB")], "memory.host_budget")


def test_invalid_value_type_is_an_error(capsys):
    run_error(capsys, ["train", *set_args("trainer.steps=many")], "trainer.steps", "expected int")


def test_device_budget_smaller_than_the_largest_layer_is_a_budget_error(capsys, tmp_path):
    # The tiny GPT's first block with the root's pages (its unit and the one around it) needs 27 pages of 4 KiB;
    # the device holds 2.
    run_error(capsys, ["train", "--no-progress", *set_args(*TINY, "memory.page_bytes=4KiB",
                                                          "memory.device_budget=8KiB", f"run.dir={tmp_path}")],
              "device tier budget exceeded for unit 'layers.0'", "requested 100.0 KiB (102400 bytes), 8.0 KiB available")


@pytest.mark.parametrize("argv", [[], ["fly"], ["train", "--bogus"], ["train", "a.yaml", "b.yaml"]])
def test_bad_command_lines_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "usage: angel-ptm" in capsys.readouterr().err


def test_missing_default_config_falls_back_to_built_in_defaults_with_a_warning(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "default_config_path", lambda: tmp_path / "gone.yaml")
    assert cli.main(["train", *set_args("data.path=/nonexistent", f"run.dir={tmp_path / 'run'}")]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("angel-ptm: warning: ") and "gone.yaml" in warning
    assert error.startswith("angel-ptm: error: ")


def test_python_dash_m_prints_one_error_line_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "angel_ptm", "train", "--no-progress",
         *set_args("data.path=/nonexistent", f"run.dir={tmp_path / 'run'}")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "/nonexistent")


# --- the packaged default job ---------------------------------------------------------------------------------
def test_default_config_loads_and_puts_pages_on_all_three_tiers():
    path = cli.default_config_path()
    assert path == REPO / "configs" / "default.yaml"
    config = load_config(path)
    params = build_model(config.model).num_params()
    states = 16 * params  # fp32 parameter, gradient and two Adam moments
    assert 10e6 <= params <= 30e6
    assert config.memory.page_bytes == parse_bytes("1MiB", "memory.page_bytes")
    assert config.memory.device_budget < states
    assert config.memory.device_budget + config.memory.host_budget < states  # the rest must go to disk
    assert config.data.path is None and config.memory.disk_dir is None


# --- training (needs the paging engine) -----------------------------------------------------------------------
def test_train_runs_a_small_job_and_reports_the_run(capsys, tmp_path):
    pytest.importorskip("angel_ptm.engine")
    run_dir = tmp_path / "run"
    argv = ["train", "--no-progress", *set_args(*TINY, "trainer.steps=2", "trainer.eval_every=2", f"run.dir={run_dir}")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"run dir: {run_dir}" in out and "final val loss:" in out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert load_config(run_dir / "config.yaml").run.dir == str(run_dir)


def test_train_reads_a_config_file_and_applies_overrides_on_top(capsys, tmp_path):
    pytest.importorskip("angel_ptm.engine")
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump({"trainer": {"steps": 5, "eval_every": 0}}))
    run_dir = tmp_path / "run"
    argv = ["train", str(config_file), "--no-progress", *set_args(*TINY, "trainer.steps=1", f"run.dir={run_dir}")]
    assert cli.main(argv) == 0
    saved = load_config(run_dir / "config.yaml")
    assert saved.trainer.steps == 1 and saved.trainer.eval_every == 0 and saved.model.dim == 32


def test_a_run_started_with_relative_paths_resumes_from_any_directory(capsys, caplog, tmp_path, monkeypatch):
    """config.yaml holds the paths as the run read them (absolute): `--resume RUN_DIR` from another directory finds
    the run's data and checkpoints; `--set run.dir=...` with --resume (another directory) is refused, not ignored;
    a seed torch cannot take is a one-line error."""
    pytest.importorskip("angel_ptm.engine")
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "data.txt").write_text("hello paging world\n" * 400)
    monkeypatch.chdir(project)
    job = [*TINY, "data.path=data.txt", "trainer.eval_every=0", "trainer.steps=2", "checkpoint.every=2",
           "checkpoint.dir=ckpts", "run.dir=runs/a"]
    assert cli.main(["train", "--no-progress", *set_args(*job)]) == 0
    run_dir = project / "runs" / "a"
    saved = load_config(run_dir / "config.yaml")
    assert (saved.data.path, saved.checkpoint.dir) == (str(project / "data.txt"), str(project / "ckpts"))
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli.main(["train", "--no-progress", "--resume", str(run_dir), *set_args("trainer.steps=3")]) == 0
    assert "(step 2)" in capsys.readouterr().out
    with caplog.at_level("WARNING", logger="angel_ptm"):  # resumed at its last step: said, not silently nothing
        assert cli.main(["train", "--no-progress", "--resume", str(run_dir), *set_args("trainer.steps=3")]) == 0
    assert any("nothing to train" in r.getMessage() for r in caplog.records)
    run_error(capsys, ["train", "--resume", str(run_dir), *set_args("run.dir=other")], "--resume", "'run.dir=other'")
    run_error(capsys, ["train", *set_args("trainer.seed=18446744073709551616")], "trainer.seed: must be >= 0 and < 2**64")
    # A copy of the run directory resumes with its page files in its own directory, not in the source's
    import shutil

    shutil.copytree(run_dir, project / "runs" / "b")
    shutil.rmtree(run_dir / "pages", ignore_errors=True)
    assert cli.main(["train", "--no-progress", "--resume", str(project / "runs" / "b"),
                     *set_args("trainer.steps=4")]) == 0
    assert load_config(project / "runs" / "b" / "config.yaml").memory.disk_dir == str(project / "runs" / "b" / "pages")
    assert not (run_dir / "pages").exists()


@pytest.mark.parametrize("world, setting, message", [
    ("3", "parallel.ep=2", "parallel.ep: 2 expert-parallel ranks do not divide parallel.dp 3"),
    ("2", "parallel.dp=4", "parallel.dp: 4 does not divide the world size 2"),
])
def test_estimate_refuses_a_world_the_training_mesh_refuses(world, setting, message, capsys):
    args = ["estimate", str(Path(__file__).parent.parent / "configs" / "moe.yaml"), "--world-size", world,
            "--set", setting]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_a_checkpoint_dir_is_checked_at_start_and_a_refused_resume_keeps_the_runs_config(capsys, tmp_path):
    """checkpoint.dir that cannot be a directory, or that holds another run's checkpoints (a resume would take them
    for its own, and pruning would delete them): one-line errors before any step; a --resume refused at start
    (another model) leaves the run's config.yaml as it was, so the run still resumes."""
    pytest.importorskip("angel_ptm.engine")
    (tmp_path / "a-file").write_text("")
    run_error(capsys, ["train", *set_args(*TINY, "trainer.steps=1", f"run.dir={tmp_path / 'r0'}",
                                          f"checkpoint.dir={tmp_path / 'a-file'}")], "checkpoint.dir: cannot create")
    assert not (tmp_path / "r0" / "metrics.jsonl").exists()
    job = [*TINY, "trainer.eval_every=0", "trainer.steps=2", "checkpoint.every=2",
           f"checkpoint.dir={tmp_path / 'ckpts'}"]
    assert cli.main(["train", "--no-progress", *set_args(*job, f"run.dir={tmp_path / 'r1'}")]) == 0
    run_error(capsys, ["train", *set_args(*job, f"run.dir={tmp_path / 'r2'}")],
              "checkpoint.dir:", "holds another run's checkpoints (step-2)")
    config = (tmp_path / "r1" / "config.yaml").read_bytes()
    assert cli.main(["train", "--no-progress", "--resume", str(tmp_path / "r1"), *set_args("model.dim=64")]) == 2
    assert (tmp_path / "r1" / "config.yaml").read_bytes() == config
    capsys.readouterr()
    assert cli.main(["train", "--no-progress", "--resume", str(tmp_path / "r1"), *set_args("trainer.steps=3")]) == 0


def test_a_run_dir_a_run_is_training_in_is_refused_to_another_start_or_resume(capsys, tmp_path):
    """The run directory is locked while its run trains (here: held as a running run holds it): a --resume of it,
    or a new run there, is refused instead of swapping its metrics and colliding with its checkpoints."""
    from angel_ptm.run_dir import lock_run_dir, release_run_dir

    pytest.importorskip("angel_ptm.engine")
    run_dir, fresh = tmp_path / "live", tmp_path / "fresh"
    job = [*TINY, "trainer.eval_every=0", "trainer.steps=1", "checkpoint.every=1", f"run.dir={run_dir}"]
    assert cli.main(["train", "--no-progress", *set_args(*job)]) == 0
    fresh.mkdir()
    lock_run_dir(run_dir)
    lock_run_dir(fresh)
    try:
        run_error(capsys, ["train", "--resume", str(run_dir), *set_args("trainer.steps=2")],
                  f"run.dir: {run_dir} is in use by a run training now (pid {os.getpid()})")
        run_error(capsys, ["train", *set_args(*TINY, f"run.dir={fresh}")], "is in use by a run training now")
    finally:
        release_run_dir(run_dir)
        release_run_dir(fresh)
    assert cli.main(["train", "--no-progress", "--resume", str(run_dir), *set_args("trainer.steps=2")]) == 0


def test_viz_of_a_run_resumed_at_another_data_parallel_size_says_what_it_leaves_out(capsys, tmp_path):
    """A run trained on 2 ranks then resumed on 1 holds trace.rank<R>.jsonl beside trace.jsonl: the report draws
    trace.jsonl and says that the ranks' part is not in it."""
    pytest.importorskip("angel_ptm.engine")
    run_dir = tmp_path / "run"
    assert cli.main(["train", "--no-progress", *set_args(*TINY, "trainer.eval_every=0", "trainer.steps=1",
                                                         f"run.dir={run_dir}")]) == 0
    (run_dir / "trace.rank0.jsonl").write_bytes((run_dir / "trace.jsonl").read_bytes())
    (run_dir / "trace.rank1.jsonl").write_bytes((run_dir / "trace.jsonl").read_bytes())
    capsys.readouterr()
    assert cli.main(["viz", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert "also holds per-rank traces (trace.rank0.jsonl, trace.rank1.jsonl)" in err and "Traceback" not in err


def test_a_library_warning_under_the_cli_is_one_line(capsys, tmp_path):
    """The newest checkpoint corrupt: --resume falls back to the one before, and its warning is one
    `angel-ptm: warning:` line, not Python's file, line and source."""
    pytest.importorskip("angel_ptm.engine")
    run_dir = tmp_path / "run"
    job = [*TINY, "trainer.eval_every=0", "trainer.steps=2", "checkpoint.every=1", f"run.dir={run_dir}"]
    assert cli.main(["train", "--no-progress", *set_args(*job)]) == 0
    (run_dir / "checkpoints" / "step-2" / ".metadata").write_bytes(b"not a checkpoint")
    resumed = subprocess.run([sys.executable, "-m", "angel_ptm", "train", "--no-progress", "--resume", str(run_dir),
                              *set_args("trainer.steps=3")], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    lines = [line for line in resumed.stderr.splitlines() if "corrupt" in line]
    assert len(lines) == 1 and lines[0].startswith("angel-ptm: warning: skipping corrupt checkpoint"), lines
