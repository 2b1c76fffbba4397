"""The benchmarks in tools/bench run end to end at toy sizes and print the JSON line their issues ask for.

Nothing here times anything or compares speeds (these machines are noisy, and a tiny run says nothing about a real
one): the tests keep the scripts working and their reports complete and consistent, so that a full-size run is
never the first to find a broken benchmark.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tools/ is not installed: the benchmarks run from a checkout
    sys.path.insert(0, str(ROOT))

from tools.bench import adam, checkpoint, io, overhead, overlap, scale  # noqa: E402


def last_json_line(capsys) -> dict:
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    return json.loads(lines[-1])


def positive(report: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(report[key], (int, float)) and math.isfinite(report[key]) and report[key] > 0, key


def test_io_bench_reports_both_ratios(tmp_path, capsys):
    report = io.main(["--dir", str(tmp_path), "--gib", str(4 / 1024), "--page-mib", "1", "--repeats", "1",
                      "--warmup", "0", "--settle", "0", "--no-peers", "--json"])
    assert last_json_line(capsys) == report
    positive(report, "read_gbps", "write_gbps", "raw_read_gbps", "raw_write_gbps", "read_ratio", "write_ratio")
    assert report["read_ratio"] == pytest.approx(report["read_gbps"] / report["raw_read_gbps"], rel=0.01)
    assert report["bytes"] == 4 << 20 and list(tmp_path.iterdir()) == []  # its files are removed


def test_adam_bench_reports_the_ratio_and_roofline(capsys):
    report = adam.main(["--params", "65536", "--repeats", "5", "--warmup", "1", "--no-peers", "--json"])
    assert last_json_line(capsys) == report
    positive(report, "angel_ms", "torch_fused_copy_ms", "ratio_vs_torch", "roofline_fraction")
    assert report["params"] == 65536 and report["repeats"] == 5


def test_overlap_bench_reports_the_four_measurements(tmp_path, capsys):
    report = overlap.main(["--dir", str(tmp_path), "--dim", "64", "--layers", "2", "--heads", "2", "--seq", "16",
                           "--page-mib", "1", "--device-frac", "0.4", "--host-frac", "0.4", "--steps", "1",
                           "--warmup", "1", "--device", "cpu", "--json"])
    assert last_json_line(capsys) == report
    positive(report, "compute_s", "io_s", "scheduled_s", "on_demand_s", "overlap", "speedup_vs_on_demand")
    # (the times are rounded to 0.1 ms in the report, which at toy sizes is a few percent)
    assert report["overlap"] == pytest.approx(max(report["compute_s"], report["io_s"]) / report["scheduled_s"],
                                              rel=0.05)
    assert 0 <= report["stall_fraction"] <= 1 and report["deviations"] == 0


def test_checkpoint_bench_reports_every_figure(tmp_path, capsys):
    report = checkpoint.main(["--dir", str(tmp_path), "--dim", "64", "--layers", "2", "--heads", "2", "--page-mib",
                              "1", "--repeats", "1", "--async-steps", "2", "--json"])
    assert last_json_line(capsys) == report
    positive(report, "save_gbps", "load_gbps", "raw_write_gbps", "raw_read_gbps", "raw_read_direct_gbps",
             "save_ratio", "load_ratio", "torch_save_s", "async_step_slowdown")
    assert report["raw_read_direct_gbps"] <= report["raw_read_gbps"] * 1.0001  # the ceiling is the faster loop
    assert report["load_page_write_bytes"] == 0 and report["rss_growth_pages"] >= 0
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_overhead_bench_runs(capsys):
    report = overhead.main(["--dim", "64", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2",
                            "--steps", "1", "--warmup", "1", "--repeats", "1", "--page-bytes", "64KiB", "--json"])
    assert last_json_line(capsys) == report


def test_scale_bench_plans_and_refuses_without_disk_space(tmp_path, capsys, monkeypatch):
    plan = scale.main(["--dir", str(tmp_path), "--dry-run", "--json"])
    assert last_json_line(capsys) == plan
    assert plan["params"] >= 4e9 and plan["states_bytes"] == 4 * plan["pages_per_kind"] * plan["page_bytes"]
    monkeypatch.setattr(scale.shutil, "disk_usage", lambda path: SimpleNamespace(total=1e12, used=0, free=20e9))
    with pytest.raises(SystemExit) as refused:  # a message (exit status 1) with the numbers and what would fit
        scale.main(["--dir", str(tmp_path), "--json"])
    message = str(refused.value.code)
    assert "has 20.0 GB free, needs 69.8 GB" in message and "--params" in message and "fits" in message


def test_zero_bench_runs_two_ranks_against_fsdp2_and_reports_every_figure(tmp_path, capsys):
    from tools.bench import zero

    report = zero.main(["--nproc", "2", "--dir", str(tmp_path), "--dim", "64", "--layers", "2", "--heads", "2",
                        "--seq", "16", "--batch", "2", "--page-kib", "16", "--steps", "1", "--warmup", "1",
                        "--json"])
    assert last_json_line(capsys) == report
    positive(report, "compute_s", "comm_s", "io_s", "scheduled_s", "fsdp2_s", "overlap", "ratio_vs_fsdp2",
             "comm_bytes_per_step", "estimate_comm_bytes_per_step", "gathers_per_step")
    # the figures are rounded to 0.1 ms, a sizeable share of a toy step's milliseconds
    assert report["overlap"] == pytest.approx(
        max(report["compute_s"], report["comm_s"], report["io_s"]) / report["scheduled_s"], rel=0.05, abs=0.01)
    # ZeRO-3 on 2 ranks: each holds half of every sharded kind (a padding page at most)
    assert all(0.45 <= share <= 0.55 for share in report["sharded_kinds_fraction"].values())
    assert report["states_bytes_per_rank"] < report["states_bytes_one_rank"]
    assert report["reductions_in_backward"] > 0  # from the second step on, stage 3 reduces during backward
    assert set(report["cpu_s"]) == {"compute", "comm", "io", "scheduled", "fsdp2"}
    assert all(seconds > 0 for seconds in report["cpu_s"].values()) and report["cores_per_rank"] > 0
    assert [p.name for p in tmp_path.iterdir()] == []  # page files and the result file removed


def test_tp_bench_runs_tp1_and_two_ranks_and_reports_every_figure(tmp_path, capsys):
    from tools.bench import tp

    report = tp.main(["--nproc", "2", "--dir", str(tmp_path), "--dim", "32", "--layers", "1", "--heads", "2",
                      "--seq", "16", "--batch", "2", "--vocab", "64", "--page-kib", "4", "--steps", "1",
                      "--warmup", "1", "--sequence-parallel", "--json"])
    assert last_json_line(capsys) == report
    positive(report, "tp1_step_s", "tp_step_s", "comm_s", "comm_share", "param_bytes_tp1", "param_bytes_per_rank")
    assert 0.5 <= report["param_fraction"] < 0.55  # half of every split tensor; the norms stay whole
    assert report["loss_max_rel_diff"] < 1e-5


def test_moe_bench_runs_the_four_ways_and_reports_every_figure(tmp_path, capsys):
    from tools.bench import moe

    report = moe.main(["--dir", str(tmp_path), "--experts", "4", "--dim", "32", "--layers", "2", "--seq", "16",
                       "--batch", "2", "--page-kib", "8", "--steps", "2", "--warmup", "1", "--repeats", "1", "--json"])
    assert last_json_line(capsys) == report
    positive(report, "paged_s", "stream_all_s", "on_demand_s", "resident_s", "ratio_vs_resident",
             "expert_bytes_moved", "stream_all_bytes_moved", "max_experts_on_ssd")
    assert report["paged_deviations_per_step"] == [0, 0]


@pytest.mark.slow
def test_ep_bench_runs_the_three_placements_on_two_ranks_and_reports_every_figure(tmp_path, capsys):
    from tools.bench import ep

    report = ep.main(["--dir", str(tmp_path), "--experts", "4", "--dim", "32", "--layers", "1", "--seq", "32",
                      "--batch", "4", "--every", "2", "--steps", "1", "--warmup", "3", "--repeats", "1", "--json"])
    assert last_json_line(capsys) == report
    positive(report, "fixed_s", "migrate_s", "replicate_s", "speedup_migrate", "speedup_replicate", "balance_fixed")
    assert report["max_loss_rel_diff"] < 1e-6
