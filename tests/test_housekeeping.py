"""Housekeeping around a run: the disk dir is checked before page files go there, page directories of killed runs
are removed, trace.jsonl is bounded, and SIGTERM stops a run as cleanly as Ctrl-C.

Tests run as root here, where permission bits stop no write and no read-only mount is at hand: the read-only and
permission cases replace the one system call that reports each (statvfs, access, open) for the directory under
test only, so the error path runs for real; the chmod test runs where it means something (not as root).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from angel_ptm import cli
from angel_ptm.errors import DiskDirError
from angel_ptm.memory.disk_dir import check_disk_dir, page_dir, remove_dead_page_dirs
from angel_ptm.trace import TraceRecorder
from angel_ptm.viz import build_report

REPO = Path(__file__).resolve().parent.parent
HOST = socket.gethostname()
NO_SUCH_PID = 2**22 + 1  # above the largest pid_max Linux allows (2**22): never a live process
# A tiny GPT whose states do not fit the device and host budgets: some pages live on disk.
TINY_ON_DISK = [
    "model.dim=32", "model.n_layer=1", "model.n_head=2", "model.seq_len=16", f"data.path={os.__file__}",
    "data.batch_size=4", "trainer.eval_every=0", "trainer.device=cpu", "memory.page_bytes=4KiB",
    "memory.device_budget=112KiB", "memory.host_budget=120KiB",
]


def set_args(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def train_error(capsys, *overrides: str) -> str:
    """Run `angel-ptm train` in this process; it must fail with one line and exit 2. Returns that line."""
    assert cli.main(["train", "--no-progress", *set_args(*TINY_ON_DISK, "trainer.steps=1", *overrides)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("angel-ptm: error: "), lines
    return lines[0]


def read_only_mount(monkeypatch, root: Path, free_bytes: int | None = None) -> None:
    """statvfs reports `root` (and what is under it) as a read-only mount, with `free_bytes` free if given."""
    real = os.statvfs

    def statvfs(path):
        result = real(path)
        if not os.path.abspath(os.fspath(path)).startswith(str(root)):
            return result
        fields = list(result)
        fields[8] |= os.ST_RDONLY  # f_flag
        if free_bytes is not None:
            fields[4] = free_bytes // result.f_frsize  # f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


# --- memory.disk_dir ------------------------------------------------------------------------------------------
def test_a_missing_disk_dir_is_created_and_probed(tmp_path):
    target = tmp_path / "a" / "pages"
    checked = check_disk_dir(str(target), needed_bytes=4096)
    assert target.is_dir() and list(target.iterdir()) == []  # the probe file is gone
    assert checked.path == str(target) and checked.direct in (True, False) and checked.free_bytes >= 4096


def test_the_estimate_checks_a_missing_disk_dir_without_creating_it(tmp_path):
    checked = check_disk_dir(str(tmp_path / "a" / "pages"), create=False)
    assert checked.direct is None and list(tmp_path.iterdir()) == []


def test_a_disk_dir_that_is_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DiskDirError) as info:
        check_disk_dir(str(blocker))
    assert str(info.value) == f"memory.disk_dir: {blocker} is a file, not a directory"
    with pytest.raises(DiskDirError) as info:
        check_disk_dir(str(blocker / "pages"), create=False)
    assert str(info.value) == (f"memory.disk_dir: cannot create {blocker / 'pages'}: {blocker} is a file, "
                               f"not a directory")


def test_a_disk_dir_on_a_read_only_mount_is_refused(tmp_path, monkeypatch):
    read_only_mount(monkeypatch, tmp_path)
    with pytest.raises(DiskDirError) as info:
        check_disk_dir(str(tmp_path))
    assert str(info.value) == f"memory.disk_dir: {tmp_path} is on a read-only file system"
    with pytest.raises(DiskDirError) as info:
        check_disk_dir(str(tmp_path / "pages"))
    assert str(info.value) == (f"memory.disk_dir: cannot create {tmp_path / 'pages'}: {tmp_path} is on a read-only "
                               f"file system")
    assert not (tmp_path / "pages").exists()


def test_a_disk_dir_that_refuses_writes_is_refused_with_the_reason(tmp_path, monkeypatch):
    # A mount that says read-write and refuses the write itself (an overlay, a full quota): the probe finds out.
    real_open = os.open

    def refusing_open(path, flags, mode=0o777, **kwargs):
        if os.path.dirname(os.fspath(path)) == str(tmp_path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(DiskDirError) as info:
        check_disk_dir(str(tmp_path))
    assert str(info.value) == f"memory.disk_dir: {tmp_path} is not writable: Read-only file system (EROFS)"


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_a_disk_dir_that_refuses_o_direct_gets_buffered_io_and_says_so(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def open_without_direct(path, flags, mode=0o777, **kwargs):
        if flags & os.O_DIRECT and os.path.dirname(os.fspath(path)) == str(tmp_path):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)  # as tmpfs did before Linux 6.6
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct)
    with caplog.at_level(logging.INFO, logger="angel_ptm"):
        checked = check_disk_dir(str(tmp_path))
    assert checked.direct is False and list(tmp_path.iterdir()) == []
    assert [r.getMessage().rsplit(", ", 1)[0] for r in caplog.records if r.name == "angel_ptm"] == [
        f"memory.disk_dir {tmp_path}: buffered I/O (the file system refuses O_DIRECT)"]


def test_a_disk_dir_without_write_permission_is_refused(tmp_path, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if os.fspath(path) == str(tmp_path)
                        else real_access(path, mode, **kw))
    with pytest.raises(DiskDirError) as info:
        check_disk_dir(str(tmp_path))
    assert str(info.value) == f"memory.disk_dir: {tmp_path} is not writable (permission denied)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the permission bits say")
def test_a_disk_dir_made_read_only_with_chmod_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(DiskDirError, match=r"^memory\.disk_dir: .*locked is not writable"):
            check_disk_dir(str(locked))
    finally:
        locked.chmod(0o700)


def test_a_disk_dir_without_room_for_the_page_files_is_refused(tmp_path):
    with pytest.raises(DiskDirError, match=rf"^memory\.disk_dir: {tmp_path} has \d+ bytes \(.*\) free, the page "
                                           rf"files need 1152921504606846976 bytes \(1048576\.0 TiB\); free space "
                                           rf"or lower memory\.disk_budget$"):
        check_disk_dir(str(tmp_path), needed_bytes=2**60)


def test_train_with_a_disk_dir_that_is_a_file_is_one_line_naming_the_key(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = train_error(capsys, f"memory.disk_dir={blocker}", f"run.dir={tmp_path / 'run'}")
    assert line == f"angel-ptm: error: memory.disk_dir: {blocker} is a file, not a directory"


def test_a_full_read_only_mount_is_reported_as_read_only_not_as_the_disk_budget(capsys, tmp_path, monkeypatch):
    disk = tmp_path / "ro"
    disk.mkdir()
    read_only_mount(monkeypatch, disk, free_bytes=0)
    line = train_error(capsys, f"memory.disk_dir={disk}", f"run.dir={tmp_path / 'run'}")
    assert line == f"angel-ptm: error: memory.disk_dir: {disk} is on a read-only file system"


def test_a_job_with_nothing_on_disk_ignores_its_disk_dir(tmp_path, monkeypatch):
    read_only_mount(monkeypatch, tmp_path / "ro")
    argv = ["train", "--no-progress", *set_args(*TINY_ON_DISK, "memory.device_budget=auto", "memory.host_budget=auto",
                                                "trainer.steps=1", f"memory.disk_dir={tmp_path / 'ro'}",
                                                f"run.dir={tmp_path / 'run'}")]
    assert cli.main(argv) == 0
    assert not (tmp_path / "ro").exists()


# --- page directories of killed runs --------------------------------------------------------------------------
def make_page_dir(disk: Path, name: str) -> Path:
    folder = disk / name
    folder.mkdir(parents=True)
    (folder / "rank0.param.slots").write_bytes(b"\0" * 8192)
    return folder


def test_page_dirs_are_named_for_host_and_process():
    assert page_dir("/d", 255) == f"/d/pages-{HOST}-{os.getpid()}-ff"


def test_page_dirs_of_dead_processes_on_this_host_are_removed_with_one_log_line_each(tmp_path, caplog):
    dead = make_page_dir(tmp_path, f"pages-{HOST}-{NO_SUCH_PID}-ab")
    dead_unnamed_host = make_page_dir(tmp_path, f"pages-{NO_SUCH_PID}-cd")  # named before hosts were
    alive = make_page_dir(tmp_path, f"pages-{HOST}-{os.getpid()}-ef")
    other_host = make_page_dir(tmp_path, f"pages-not-{HOST}-{NO_SUCH_PID}-ab")  # its pid means nothing here
    unrelated = make_page_dir(tmp_path, "pages-of-notes")
    with caplog.at_level(logging.WARNING, logger="angel_ptm"):
        removed = remove_dead_page_dirs(str(tmp_path))
    assert removed == [str(dead_unnamed_host), str(dead)]
    assert not dead.exists() and not dead_unnamed_host.exists()
    assert alive.exists() and other_host.exists() and unrelated.exists()
    assert [r.getMessage() for r in caplog.records if r.name == "angel_ptm"] == [
        f"removed {path}: page files of process {NO_SUCH_PID}, which is no longer running (8.0 KiB freed)"
        for path in removed]


def test_page_dirs_a_killed_rank_left_in_its_rank_directory_are_removed(tmp_path):
    """torchrun's ranks keep their page files in disk_dir/rank<R>: those of a killed job (any world size) go too."""
    dead = [make_page_dir(tmp_path / f"rank{r}", f"pages-{HOST}-{NO_SUCH_PID}-a{r}") for r in (0, 1, 3)]
    alive = make_page_dir(tmp_path / "rank0", f"pages-{HOST}-{os.getpid()}-ef")
    unrelated = make_page_dir(tmp_path / "ranks", f"pages-{HOST}-{NO_SUCH_PID}-ab")  # not a rank directory
    assert remove_dead_page_dirs(str(tmp_path)) == [str(d) for d in dead]
    assert not any(d.exists() for d in dead) and alive.exists() and unrelated.exists()


def test_a_missing_disk_dir_has_no_page_dirs_to_remove(tmp_path):
    assert remove_dead_page_dirs(str(tmp_path / "missing")) == []


def test_engine_start_removes_the_page_dirs_a_killed_run_left(tmp_path):
    disk = tmp_path / "pages"
    dead = make_page_dir(disk, f"pages-{HOST}-{NO_SUCH_PID}-ab")
    argv = ["train", "--no-progress", *set_args(*TINY_ON_DISK, "trainer.steps=1", f"memory.disk_dir={disk}",
                                                f"run.dir={tmp_path / 'run'}")]
    assert cli.main(argv) == 0
    assert not dead.exists() and list(disk.iterdir()) == []  # this run's own page dir is gone too


# --- trace.max_bytes ------------------------------------------------------------------------------------------
class FixedClockRecorder(TraceRecorder):
    """Every event at t = 1.0, so each line has a known length."""

    def now(self) -> float:
        return 1.0


def record_steps(path: Path, max_bytes: int | None, steps: int = 3) -> list[dict]:
    """Per step: ten pages moved host->device, a compute interval, the step event."""
    with mock.patch("time.time", return_value=1_700_000_000.5):  # the start mark's unix_s: a known length too
        trace = FixedClockRecorder(path, max_bytes=max_bytes)
    for step in range(1, steps + 1):
        for i in range(10):
            trace.event("moved", page=f"param:{i}", kind="param", src="host", dst="device", nbytes=4096,
                        in_use={"device": 4096 * (i + 1), "host": 0, "disk": 0})
        trace.interval("compute", f"step {step}", 1.0, 1.5)
        trace.event("step", step=step, loss=1.0)
    trace.close()
    start, *events = [json.loads(line) for line in path.read_text().splitlines()]
    assert start["name"] == "trace start"  # every trace's first line (the recorder's)
    return events


def line_bytes(path: Path, n: int) -> int:
    """The bytes of the trace's start line and its first `n` events."""
    return sum(len(line) + 1 for line in path.read_text().splitlines()[:n + 1])


def test_a_trace_under_its_bound_keeps_every_event(tmp_path):
    events = record_steps(tmp_path / "trace.jsonl", max_bytes=1 << 20)
    assert [e["event"] for e in events] == (["moved"] * 10 + ["interval", "step"]) * 3


def test_past_its_bound_the_trace_notes_the_cut_once_and_then_keeps_one_summary_per_step(tmp_path):
    full = record_steps(tmp_path / "full.jsonl", max_bytes=None)
    bound = line_bytes(tmp_path / "full.jsonl", 17)  # step 1 (12 events) and 5 pages of step 2
    events = record_steps(tmp_path / "trace.jsonl", max_bytes=bound)
    assert events[:17] == full[:17]
    assert events[17] == {"t": 1.0, "event": "mark", "name": "trace truncated", "max_bytes": bound}
    assert events[18:] == [
        {"t": 1.0, "event": "step", "step": 2, "loss": 1.0, "left_out": {"moved": 5, "interval": 1},
         "moved": {"host->device": 5 * 4096}, "in_use": {"device": 40960, "host": 0, "disk": 0}},
        {"t": 1.0, "event": "step", "step": 3, "loss": 1.0, "left_out": {"moved": 10, "interval": 1},
         "moved": {"host->device": 10 * 4096}, "in_use": {"device": 40960, "host": 0, "disk": 0}},
    ]


def test_a_trace_without_a_bound_is_never_cut(tmp_path):
    events = record_steps(tmp_path / "trace.jsonl", max_bytes=None, steps=20)
    assert len(events) == 20 * 12 and all(e["event"] != "mark" for e in events)


def test_viz_reads_a_truncated_trace(tmp_path):
    events = record_steps(tmp_path / "trace.jsonl", max_bytes=line_bytes_of_one_step(tmp_path), steps=5)
    result = build_report(tmp_path)
    assert result.events == 1 + len(events) == 1 + 12 + 1 + 4  # the start mark too
    assert "trace truncated" in result.html_path.read_text()


def line_bytes_of_one_step(tmp_path: Path) -> int:
    record_steps(tmp_path / "one.jsonl", max_bytes=None, steps=1)
    return line_bytes(tmp_path / "one.jsonl", 12)


# --- SIGTERM --------------------------------------------------------------------------------------------------
def test_sigterm_stops_a_run_cleanly_and_leaves_no_page_files(tmp_path):
    run_dir, disk = tmp_path / "run", tmp_path / "pages"
    argv = [sys.executable, "-m", "angel_ptm", "train", "--no-progress",
            *set_args(*TINY_ON_DISK, "trainer.steps=100000", f"memory.disk_dir={disk}", f"run.dir={run_dir}")]
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        assert [p.name.startswith("pages-") for p in disk.iterdir()] == [True]  # the run's own, in use
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM
    assert stderr.strip() == "angel-ptm: terminated (SIGTERM)"
    assert list(disk.iterdir()) == []


def test_initialize_bounds_a_recorder_made_without_one_by_trace_max_bytes(tmp_path):
    import torch

    import angel_ptm

    torch.manual_seed(0)
    trace = TraceRecorder(tmp_path / "trace.jsonl")  # no bound of its own
    engine = angel_ptm.initialize(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
                                  {"memory": {"page_bytes": "4KiB", "device_budget": "32KiB", "host_budget": "32KiB",
                                              "disk_dir": str(tmp_path / "pages")},
                                   "trainer": {"device": "cpu"}, "trace": {"max_bytes": 4096}}, trace=trace)
    try:
        for _ in range(3):
            engine.backward(engine(torch.randn(2, 64)).sum())
            engine.step()
    finally:
        engine.close()
        trace.close()
    events = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert trace.max_bytes == 4096 and any(e.get("name") == "trace truncated" for e in events)


def test_an_engine_dropped_without_close_is_collected_with_its_files_and_page_directory(tmp_path):
    import gc
    import weakref

    import torch

    import angel_ptm

    def fds():
        return len(os.listdir("/proc/self/fd"))

    job = {"memory": {"page_bytes": "4KiB", "device_budget": "16KiB", "host_budget": "16KiB",
                      "disk_dir": str(tmp_path)}, "trainer": {"device": "cpu"}}
    gc.collect()
    before = fds()
    for _ in range(3):
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        engine = angel_ptm.initialize(model, job)
        engine.backward(engine(torch.randn(2, 32)).sum())
        engine.step()
        dropped = weakref.ref(engine)
        assert list(tmp_path.glob("pages-*"))
        del engine, model
        gc.collect()
        assert dropped() is None  # (autograd's grad hooks, held in C++, no longer keep it alive)
    assert not list(tmp_path.glob("pages-*")) and fds() <= before


@pytest.mark.parametrize("backward, checkpoint", [(False, "none"), (True, "none"), (False, "full"),
                                                  (False, "selective")])
def test_an_engine_is_collected_though_its_model_kept_a_graph(tmp_path, backward, checkpoint):
    """A GPT-MoE keeps its aux loss on itself (a tensor with the forward's graph): autograd holds that graph's
    leaves and saved tensors from C++, where the collector cannot see a cycle back to the engine. Dropped with its
    model, after a forward alone or a whole step, the engine is collected all the same, also when the graph holds
    activations.checkpoint's recomputation (torch's checkpoint keeps it from C++ too)."""
    import gc
    import weakref

    import torch

    import angel_ptm
    from angel_ptm.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32,
                          moe={"experts": 4, "gate": "switch", "capacity_factor": 0.5}))
    engine = angel_ptm.initialize(model, {"memory": {"page_bytes": "4KiB", "device_budget": "256KiB",
                                                     "host_budget": "1MiB", "disk_dir": str(tmp_path)},
                                          "trainer": {"device": "cpu", "grad_clip": 0},
                                          "activations": {"checkpoint": checkpoint}})
    ids = torch.randint(0, 64, (4, 16))
    loss = engine(ids, ids)
    if backward:
        engine.backward(loss)
        engine.step()
    assert model.layers[0].feed_forward.aux_loss.grad_fn is not None
    dropped = weakref.ref(engine)
    del engine, model, loss
    gc.collect()
    assert dropped() is None and not list(tmp_path.glob("pages-*"))


def test_a_torch_older_than_the_runtime_needs_is_refused_at_import_with_one_line():
    from angel_ptm import MIN_TORCH, unsupported_torch

    assert MIN_TORCH == (2, 8)
    for ok in ("2.8.0+cu128", "2.11.0+cu130", "2.13.0+cpu", "2.14.0.dev20261101", "3.0.0"):
        assert unsupported_torch(ok) is None, ok
    assert unsupported_torch("2.4.1+cu121") == ("angel-ptm needs torch>=2.8 (this is torch 2.4.1+cu121): install a "
                                                "newer torch first, e.g. pip install torch==2.13.0")
    assert unsupported_torch("2.7.1") is not None and unsupported_torch("1.13.1") is not None
    result = subprocess.run([sys.executable, "-c", "import torch; torch.__version__ = '2.4.1'; import angel_ptm"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        "ImportError: angel-ptm needs torch>=2.8 (this is torch 2.4.1): install a newer torch first, e.g. pip "
        "install torch==2.13.0")
