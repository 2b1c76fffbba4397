"""Launch modes of data parallelism: torchrun running the CLI, dead and hung peers, and jobs that differ by rank."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from angel_ptm.viz.chrome import validate_chrome_trace
from dist_harness import free_port, spawn, values
from dist_jobs import die_mid_step, job, rank_local_failures, start_with
from dist_save_faults import die_while_saving, fail_while_saving

JOB = """\
model: {vocab_size: 256, seq_len: 32, n_layer: 2, n_head: 2, dim: 96}
data: {batch_size: 4, seed: 7}
trainer: {steps: 4, eval_every: 2, eval_steps: 2, device: cpu, grad_clip: 1.0}
memory: {page_bytes: 64KiB, device_budget: 1216KiB, host_budget: 960KiB}
parallel: {zero: 3, timeout_s: 60}
lr_schedule: {warmup_steps: 2}
"""


def cli(*args, env=None, **kwargs):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), **kwargs)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def peaks(trace_path):
    top = {}
    with open(trace_path) as f:
        for line in f:
            in_use = json.loads(line).get("in_use")
            for tier, n in (in_use or {}).items():
                top[tier] = max(top.get(tier, 0), n)
    return top


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    (tmp / "job.yaml").write_text(JOB)
    two = cli("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
              "-m", "angel_ptm", "train", str(tmp / "job.yaml"), "--no-progress", "--set", f"run.dir={tmp / 'two'}")
    one = cli("-m", "angel_ptm", "train", str(tmp / "job.yaml"), "--no-progress",
              "--set", f"run.dir={tmp / 'one'}", "--set", "trainer.grad_accum=2")
    estimate = cli("-m", "angel_ptm", "estimate", str(tmp / "job.yaml"), "--world-size", "2", "--json")
    return tmp, two, one, estimate


@pytest.fixture(scope="module")
def launched_tp(launched):
    """The same job under torchrun with tensor parallelism (tp 2, sequence parallelism), and on one rank."""
    tmp = launched[0]
    tp = cli("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
             "-m", "angel_ptm", "train", str(tmp / "job.yaml"), "--no-progress", "--set", f"run.dir={tmp / 'tp'}",
             "--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true")
    one = cli("-m", "angel_ptm", "train", str(tmp / "job.yaml"), "--no-progress", "--set", f"run.dir={tmp / 'tp1'}")
    return tmp, tp, one


def test_torchrun_tp2_with_sequence_parallelism_logs_the_losses_of_one_rank(launched_tp):
    """Tensor-parallel peers take the same batches; the loss, the clipped norm and the validation loss are those of
    one rank within 1e-5; rank 0 writes the metrics, each rank its trace."""
    tmp, tp, one = launched_tp
    assert tp.returncode == 0, tp.stderr[-3000:]
    assert one.returncode == 0, one.stderr[-3000:]
    got, expected = metrics(tmp / "tp"), metrics(tmp / "tp1")
    assert [sorted(row) for row in got] == [sorted(row) for row in expected]
    for a, e in zip(got, expected):
        for key in ("loss", "grad_norm", "val_loss", "lr"):
            if key in e:
                assert a[key] == pytest.approx(e[key], rel=1e-5), (a["step"], key)
    assert sorted(p.name for p in (tmp / "tp").glob("trace.rank*.jsonl")) == ["trace.rank0.jsonl",
                                                                              "trace.rank1.jsonl"]


def test_torchrun_two_ranks_log_the_losses_of_one_rank_with_grad_accum_2(launched):
    tmp, two, one, _ = launched
    assert two.returncode == 0, two.stderr[-3000:]
    assert one.returncode == 0, one.stderr[-3000:]
    drop = ("tokens_per_s", "step_s", "in_use", "moved", "stall_s", "deviations", "planned_moves", "replanned",
            "repair_reads")
    strip = lambda rows: [{k: v for k, v in row.items() if k not in drop} for row in rows]  # noqa: E731
    assert strip(metrics(tmp / "two")) == strip(metrics(tmp / "one"))  # loss, lr, grad_norm, val_loss: exact
    assert two.stdout.count("final train loss") == 1  # rank 0 reports the run


def test_every_rank_writes_its_trace_and_rank_0_the_metrics(launched):
    tmp = launched[0]
    assert sorted(p.name for p in (tmp / "two").iterdir()) == \
        [".angel_ptm.lock", "config.yaml", "metrics.jsonl", "pages", "trace.rank0.jsonl", "trace.rank1.jsonl"]
    assert list((tmp / "two" / "pages").iterdir()) == []  # each rank's page files (pages/rank<R>) removed


def test_the_estimate_for_two_ranks_is_within_10_percent_of_each_ranks_measured_peaks(launched):
    tmp, _, _, estimate = launched
    assert estimate.returncode == 0, estimate.stderr
    expected = {tier: t["peak"] for tier, t in json.loads(estimate.stdout)["tiers"].items()}
    assert all(expected.values())  # pages on every tier
    for rank in (0, 1):
        measured = peaks(tmp / "two" / f"trace.rank{rank}.jsonl")
        for tier, n in expected.items():
            assert measured[tier] == pytest.approx(n, rel=0.10), (rank, tier, measured[tier], n)


def test_a_torchrun_run_checkpoints_and_resumes_on_one_rank_from_its_two_rank_checkpoint(launched):
    """2 ranks save at steps 2 and 4 (step 4's save is then torn); `train --resume` on 1 rank with grad_accum 2
    continues from step 2 and logs the uninterrupted run's losses, each step once."""
    tmp, _, one, _ = launched
    run = tmp / "ckpt"
    two = cli("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
              "-m", "angel_ptm", "train", str(tmp / "job.yaml"), "--no-progress", "--set", f"run.dir={run}",
              "--set", "checkpoint.every=2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-2", "step-4"]
    (run / "checkpoints" / "step-4").rename(run / "checkpoints" / "step-4.tmp")  # killed while saving step 4
    resumed = cli("-m", "angel_ptm", "train", "--resume", str(run), "--no-progress", "--set", "trainer.grad_accum=2",
                  "--set", "parallel.dp=null")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from:" in resumed.stdout and "(step 2)" in resumed.stdout
    logged = [(r["step"], r["loss"]) for r in metrics(run) if "loss" in r]
    expected = [(r["step"], r["loss"]) for r in metrics(tmp / "one") if "loss" in r]
    assert [step for step, _ in logged] == [1, 2, 3, 4]
    assert [loss for _, loss in logged] == pytest.approx([loss for _, loss in expected], rel=1e-6)


def test_a_rank_killed_mid_step_ends_the_other_with_a_collective_error_at_once(tmp_path):
    t0 = time.monotonic()
    results = spawn(2, die_mid_step, (job("die", timeout_s=60), str(tmp_path)), tmp_path, timeout_s=120)
    assert results[1]["type"] == "exited"  # os._exit without a result
    assert results[0]["type"] == "CollectiveError", results[0]
    assert results[0]["message"].startswith("rank 0 of 2: ")
    assert "a peer rank died, hung or took another path" in results[0]["message"]
    assert time.monotonic() - t0 < 60  # seen long before parallel.timeout_s


@pytest.mark.parametrize("background", [False, True])
def test_a_rank_killed_while_saving_a_checkpoint_ends_the_other_with_a_checkpoint_error(tmp_path, background):
    t0 = time.monotonic()
    results = spawn(2, die_while_saving, (job("die-saving", timeout_s=20, background=background), str(tmp_path)),
                    tmp_path, timeout_s=120)
    assert results[1]["type"] == "exited"
    assert results[0]["type"] == "CheckpointError", results[0]
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "ckpt-dead-peer").exists()  # never renamed from .tmp: no checkpoint counts


def test_an_error_on_one_rank_during_a_save_reaches_every_rank_at_once_and_training_goes_on(tmp_path):
    """Rank 1's save raises (ChecksumError, then Terminated: a second signal during a signal's save): every rank
    gets it from the save's result gather at once — before, errors whose __init__ takes other arguments than the
    message did not unpickle on rank 0, so rank 1 waited for the result until parallel.timeout_s and both ranks
    then closed with collectives out of step. After the first the ranks train on alike and save again."""
    results = values(spawn(2, fail_while_saving, (job("fail-saving", timeout_s=60), str(tmp_path)), tmp_path,
                           timeout_s=150))
    for rank, got in enumerate(results):
        checksum, after, interrupted = got["raised"]
        assert checksum[0] == "CheckpointError" and checksum[1].startswith("rank 1: ChecksumError: "), checksum
        assert "exp_avg page 3" in checksum[1] and after is None, got["raised"]
        assert interrupted == ["Terminated", "terminated by signal 15"], (rank, interrupted)
        assert max(got["seconds"]) < 30, got["seconds"]  # not parallel.timeout_s
    assert results[0]["complete"] == ["ckpt-after"]  # rank 0 removed the failed saves' directories
    assert results[0]["losses"][0] != results[1]["losses"][0]  # (the ranks' own micro-batches)


def test_a_tensor_parallel_peer_killed_mid_step_ends_the_other_with_a_collective_error(tmp_path):
    """Rank 1 of tp 2 dies after its forward: rank 0's next tp collective (in backward) fails at once."""
    t0 = time.monotonic()
    results = spawn(2, die_mid_step, (job("die-tp", tp=2, timeout_s=60), str(tmp_path)), tmp_path, timeout_s=120)
    assert results[1]["type"] == "exited"
    assert results[0]["type"] == "CollectiveError", results[0]
    assert results[0]["message"].startswith("rank 0 (tp rank 0 of 2): ")
    assert time.monotonic() - t0 < 60


def test_a_hung_rank_ends_the_other_with_a_collective_error_after_parallel_timeout_s(tmp_path):
    results = spawn(2, die_mid_step, (job("hang", timeout_s=3, hang=10), str(tmp_path)), tmp_path, timeout_s=60)
    assert results[0]["type"] == "CollectiveError", results[0]
    # Within the timeout, counted from when the collective was issued (the hung rank's own receive times out first
    # when it was issued earlier, closing the connection: then a little sooner)
    seconds = float(re.search(r"failed after ([0-9.]+) s", results[0]["message"]).group(1))
    assert 1.0 <= seconds <= 3.5 and "(parallel.timeout_s 3)" in results[0]["message"], results[0]


def test_ranks_with_different_configs_or_a_mesh_the_world_does_not_divide_refuse_to_start(tmp_path):
    spec = job("mismatch", rank_overrides={"1": {"optimizer": {"lr": 0.5}}})
    results = spawn(2, start_with, (spec, str(tmp_path)), tmp_path, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["type"] == "ConfigMismatchError", result
        assert result["message"].startswith(f"rank {rank}: ranks [1] started with a different config than rank 0")
    spec = job("dp3", rank_overrides={"0": {"parallel": {"dp": 3}}, "1": {"parallel": {"dp": 3}}})
    results = spawn(2, start_with, (spec, str(tmp_path)), tmp_path, timeout_s=120)
    for result in results:
        assert result["type"] == "DistributedError", result
        assert result["message"] == "parallel.dp: 3 does not divide the world size 2"


def test_viz_of_a_torchrun_run_shows_every_rank_side_by_side(launched):
    tmp = launched[0]
    result = cli("-m", "angel_ptm", "viz", str(tmp / "two"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # gathered copies and their drops are events the report knows
    assert "(2 ranks side by side)" in result.stdout
    index = (tmp / "two" / "report.html").read_text()
    for rank in (0, 1):
        assert f'<iframe src="report.rank{rank}.html" title="rank {rank}">' in index
        assert "angel-ptm report" in (tmp / "two" / f"report.rank{rank}.html").read_text()
        chrome = json.loads((tmp / "two" / f"trace.rank{rank}.chrome.json").read_text())["traceEvents"]
        read = sum(1 for line in (tmp / "two" / f"trace.rank{rank}.jsonl").read_text().splitlines() if line.strip())
        # (the Chrome trace's own count: it said the trace's lines read as the Chrome file's events)
        assert f"report.rank{rank}.html from {read:,} trace events, trace.rank{rank}.chrome.json " \
               f"({len(chrome):,} events)" in result.stdout
    # One Chrome trace with every rank a process, on the clock of the ranks' start marks
    merged = json.loads((tmp / "two" / "trace.chrome.json").read_text())
    assert validate_chrome_trace(merged) == []
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "rank 0", 2: "rank 1"}
    comm = {pid: [e for e in merged["traceEvents"] if e.get("cat") == "comm" and e["pid"] == pid] for pid in (1, 2)}
    assert comm[1] and comm[2]
    assert "every rank a process on one time axis" in result.stdout


def test_a_rank_local_error_in_a_step_ends_every_rank_with_a_typed_error_and_nothing_else(tmp_path):
    """A forward that raised before the rank's first collective of the step may be retried (ranks stay in step); an
    error out of a backward fails that rank's engine and leaves its peer a CollectiveError, and neither issues
    another collective on that process group (gloo would abort the process on a mismatched one): a new engine is
    refused on both. Dropped engines leave no waiter thread."""
    results = values(spawn(2, rank_local_failures, (job("local", zero=2, timeout_s=20), str(tmp_path)), tmp_path,
                           timeout_s=150))
    assert results[1]["retried"] and results[0]["recovered_digest"] == results[1]["recovered_digest"]
    # a save while only rank 0 holds a forward's output: both ranks refuse it at once (rank 1 used to wait in the
    # save's first collective until parallel.timeout_s, and fail its engine: probe e2)
    assert results[0]["held_save"].startswith("CheckpointError: save_checkpoint: called between a training forward")
    assert results[1]["held_save"].startswith("CheckpointError: save_checkpoint: called between a training forward")
    assert results[1]["held_save"].endswith("(on rank 0)") and max(r["held_save_s"] for r in results) < 10
    assert results[0]["waiters_left"] == results[1]["waiters_left"] == []
    assert results[1]["fatal_step"].startswith("RuntimeError: rank-local failure in backward"), results[1]
    assert results[0]["fatal_step"].startswith("CollectiveError: rank 0 of 2: "), results[0]
    # an error out of a backward fails that rank's engine (its gradients are part-written), and its peer's
    assert results[0]["after"] == results[1]["after"] == "EngineFailedError", results
    for result in results:
        assert result["new_engine"].startswith("CollectiveError: rank ") and "out of step" in result["new_engine"]


def test_a_rank_whose_peers_never_start_gives_up_about_parallel_timeout_s_later(monkeypatch):
    """torch's store client alone tries for twice its timeout and more (7.8 s for 4 s); a rank whose rank 0 never
    comes ends with a DistributedError naming it about parallel.timeout_s after it started."""
    from angel_ptm.config import ParallelConfig
    from angel_ptm.errors import DistributedError
    from angel_ptm.parallel.mesh import init_mesh

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"^rank 1: cannot set up the gloo process group of 2 ranks"):
        init_mesh(ParallelConfig(timeout_s=5))
    assert time.monotonic() - t0 < 5 * 1.6
