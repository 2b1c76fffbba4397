"""The memory estimate: what each tier needs per rank, from the config alone, checked against the engine it predicts
and against the peaks a short training run records in its trace.
"""

from __future__ import annotations

import dataclasses

import json
import os
from types import SimpleNamespace

import pytest
import torch

from angel_ptm.config.sizes import format_bytes

import angel_ptm
from angel_ptm import cli
from angel_ptm import estimate as estimate_module
from angel_ptm.config import load_config
from angel_ptm.errors import BudgetError, ConfigValueError
from angel_ptm.estimate import estimate_job
from angel_ptm.memory.placement import CREATION_ORDER
from angel_ptm.memory import Tier, build_layout
from angel_ptm.models import build_model, estimate_activation_bytes
from angel_ptm.trace import TraceRecorder
from angel_ptm.trainer import Trainer
from angel_ptm.viz.reader import ReadIssues, iter_events

KiB, MiB = 1 << 10, 1 << 20
CPU = torch.device("cpu")
TIERS = ("device", "host", "disk")
DEFAULT = cli.default_config_path()
SMALL_GPT = ["model.dim=128", "model.n_layer=2", "model.n_head=4", "model.seq_len=64"]
SHORT_RUN = [f"data.path={os.__file__}", "data.batch_size=4"]

# The default job and three others: different model sizes, page sizes and budgets.
JOBS = {
    "default": (DEFAULT, []),  # 60 pages of 1 MiB per kind; device 56 MiB, host 72 MiB, the rest on disk
    "device": (None, [*SMALL_GPT, *SHORT_RUN, "memory.page_bytes=64KiB"]),  # "auto": every state on the device
    "device+host": (None, ["model.dim=192", "model.n_layer=3", "model.n_head=6", "model.seq_len=64", *SHORT_RUN,
                           "memory.page_bytes=256KiB", "memory.device_budget=4MiB", "memory.host_budget=64MiB"]),
    "device+host+disk": (None, ["model.dim=256", "model.n_layer=4", "model.n_head=4", "model.seq_len=64",
                                *SHORT_RUN, "memory.page_bytes=128KiB", "memory.device_budget=4MiB",
                                "memory.host_budget=4MiB"]),  # a tiny device: 32 pages, 31 of them the first block's
                                                              # unit with the root's; the host stages 32
    # activations.offload disk: the activation pages on the disk tier beside the states' (the peaks left them out)
    "offload disk": (None, ["model.dim=128", "model.n_layer=3", "model.n_head=4", "model.seq_len=64", *SHORT_RUN,
                            "memory.page_bytes=64KiB", "memory.device_budget=2MiB", "memory.host_budget=2MiB",
                            "activations.offload=disk", "activations.offload_min_bytes=0"]),
}


def job(name: str, *extra: str):
    source, overrides = JOBS[name]
    return load_config(source, [*overrides, *extra])


def measured_peaks(trace_path) -> dict[str, int]:
    """The highest bytes in use per tier over every page event of the trace (its `in_use` fields)."""
    peaks = dict.fromkeys(TIERS, 0)
    for event in iter_events(trace_path, ReadIssues()):
        for tier, value in (event.get("in_use") or {}).items():
            peaks[tier] = max(peaks.get(tier, 0), value)
    return peaks


def relative_error(estimated: int, measured: int) -> float:
    if measured == estimated:
        return 0.0
    return abs(estimated - measured) / max(measured, 1)


# --- estimated vs measured --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(JOBS))
def test_estimated_peak_of_each_tier_is_within_10_percent_of_the_trace(name, tmp_path):
    config = job(name, "trainer.steps=2", "trainer.eval_every=0", f"run.dir={tmp_path}")
    estimate = estimate_job(config)
    assert estimate.fits
    Trainer(config, progress=False).run()
    measured = measured_peaks(tmp_path / "trace.jsonl")
    estimated = estimate.peaks()
    for tier in TIERS:
        assert relative_error(estimated[tier], measured[tier]) <= 0.10, (tier, estimated, measured)


def test_the_default_job_uses_all_three_tiers_and_the_others_the_tiers_they_name():
    used = {name: {tier for tier, peak in estimate_job(job(name)).peaks().items() if peak} for name in JOBS}
    assert used == {"default": set(TIERS), "device": {"device", "host"}, "device+host": {"device", "host"},
                    "device+host+disk": set(TIERS), "offload disk": set(TIERS)}
    assert estimate_job(job("device")).start_pages["host"] == 4  # "auto" host: the four pages created first


# --- what the estimate counts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(JOBS))
def test_page_counts_equal_the_real_layout(name):
    config = job(name)
    model = build_model(config.model)
    layout = build_layout(model, config.memory.page_bytes)
    estimate = estimate_job(config)
    assert estimate.n_pages == layout.n_pages
    assert estimate.params == model.num_params()
    assert estimate.kind_bytes == dict.fromkeys(("param", "grad", "exp_avg", "exp_avg_sq"),
                                                layout.n_pages * config.memory.page_bytes)
    assert estimate.states_bytes == 4 * layout.n_pages * config.memory.page_bytes


def test_the_default_job_in_numbers():
    estimate = estimate_job(job("default"), device=CPU)  # (trainer.device auto: a CUDA machine would plan a GPU)
    assert (estimate.params, estimate.page_bytes, estimate.n_pages) == (10_720_128, MiB, 60)
    assert estimate.master_extra_bytes == 0  # fp32 parameter pages are the master weights
    assert (estimate.largest_layer, estimate.largest_layer_pages) == ("layers.1", 13)  # a block's unit
    assert estimate.update_tier == "host"  # CPU, states larger than the device tier
    assert estimate.activation_bytes == estimate_activation_bytes(build_model(job("default").model).cfg, 8)
    assert estimate.pinned_host_bytes == 0  # pinned only with CUDA
    assert {t: estimate.tiers[t].budget for t in TIERS} == {"device": 56 * MiB, "host": 72 * MiB, "disk": 240 * MiB}
    assert estimate.tiers["disk"].needed == 240 * MiB  # a slot for every state page (125 rest there at start)
    assert estimate.start_pages == {"device": 43, "host": 72, "disk": 125}  # the device keeps 13 pages free


def test_config_alone_builds_the_model_on_the_meta_device(monkeypatch):
    built = []

    def build_and_keep(model_cfg):
        built.append(build_model(model_cfg))
        return built[-1]

    monkeypatch.setattr(estimate_module, "build_model", build_and_keep)
    estimate_job(job("default"))
    assert {p.device.type for p in built[0].parameters()} == {"meta"}


def test_estimate_of_a_module_equals_the_estimate_of_its_config():
    config = job("device+host+disk")
    from_config, from_module = estimate_job(config), estimate_job(config, build_model(config.model))
    for field in ("n_pages", "params", "largest_layer", "largest_layer_pages", "activation_bytes", "start_pages"):
        assert getattr(from_module, field) == getattr(from_config, field), field
    assert from_module.peaks() == from_config.peaks()


def test_a_module_that_is_not_a_gpt_has_no_activation_estimate():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 8, bias=False))
    estimate = estimate_job({"memory": {"page_bytes": "4KiB"}}, model)
    assert estimate.activation_bytes is None
    assert estimate.n_pages == build_layout(model, 4 * KiB).n_pages == 5
    assert (estimate.largest_layer, estimate.largest_layer_pages) == ("0", 4)  # 64 x 64 fp32 = 16 KiB
    assert estimate.fits


def test_creation_order_is_the_engines():
    from angel_ptm.engine import STATE_KINDS

    assert CREATION_ORDER == STATE_KINDS


def test_estimate_agrees_with_the_engine_it_predicts(tmp_path):
    config = load_config(None, [*SMALL_GPT, "memory.page_bytes=64KiB", "memory.device_budget=1280KiB",
                                "memory.host_budget=1280KiB", f"memory.disk_dir={tmp_path}", "trainer.device=cpu"])
    model = build_model(config.model)
    estimate = estimate_job(config, model, disk_dir=str(tmp_path))
    trace = TraceRecorder(tmp_path / "trace.jsonl")
    engine = angel_ptm.initialize(model, config, trace=trace)
    try:
        assert engine.layout.n_pages == estimate.n_pages
        assert vars(engine.budgets) == {t: estimate.tiers[t].budget for t in TIERS}
        assert engine._min_device_pages == estimate.largest_layer_pages
        assert engine.optimizer.update_tier.value == estimate.update_tier
        for tier in ("device", "host"):
            pool = engine.manager.pools[angel_ptm.memory.Tier(tier)]
            assert pool.capacity * pool.page_bytes == estimate.tiers[tier].pool
        assert engine.manager.disk.reserved_bytes == estimate.tiers["disk"].pool
        # The pages that start on disk were created there dead: zeros are never written nor read back. Only the
        # parameter values that do not fit in memory are written (once each).
        on_disk = [page for pages in engine.pages.values() for page in pages if page.tier is Tier.DISK]
        assert len(on_disk) == estimate.start_pages["disk"] > 0
        assert all(page.dead for page in on_disk if page.kind != "param")
        params_on_disk = sum(1 for page in on_disk if page.kind == "param")
        assert engine.manager.bytes_moved.get("host->disk", 0) == params_on_disk * config.memory.page_bytes
        assert engine.manager.bytes_moved.get("disk->host", 0) == 0
    finally:
        engine.close()
        trace.close()
    allocs = [e for e in iter_events(tmp_path / "trace.jsonl", ReadIssues()) if e["event"] == "alloc"]
    after_creation = allocs[4 * estimate.n_pages - 1]["in_use"]
    assert after_creation == {t: n * config.memory.page_bytes for t, n in estimate.start_pages.items()}


# --- jobs that cannot fit ---------------------------------------------------------------------------------------
def test_disk_budget_below_the_spill_is_a_budget_error_with_the_numbers():
    estimate = estimate_job(job("default", "memory.disk_budget=10MiB"))
    assert not estimate.fits and not estimate.tiers["disk"].fits
    with pytest.raises(BudgetError) as info:
        estimate.check()
    assert (info.value.tier, info.value.requested, info.value.available) == ("disk", 240 * MiB, 10 * MiB)


def test_device_smaller_than_the_largest_layer_is_refused_like_the_engine_refuses_it():
    config = load_config(None, ["model.dim=32", "model.n_layer=1", "model.n_head=2", "model.seq_len=16",
                                "memory.page_bytes=4KiB", "memory.device_budget=8KiB"])
    with pytest.raises(BudgetError) as info:
        estimate_job(config).check()
    assert str(info.value) == ("device tier budget exceeded for unit 'layers.0' (25 pages of 4.0 KiB): "
                               "requested 100.0 KiB (102400 bytes), 8.0 KiB available")


def test_too_little_free_disk_space_for_the_page_files_is_refused(monkeypatch):
    monkeypatch.setattr(estimate_module, "free_disk_bytes", lambda path: 100 * MiB)
    with pytest.raises(BudgetError) as info:
        estimate_job(job("default")).check()
    assert (info.value.tier, info.value.requested, info.value.available) == ("disk", 240 * MiB, 100 * MiB)


def test_checkpoints_written_beside_training_count_a_second_slot_per_disk_page(monkeypatch):
    monkeypatch.setattr(estimate_module, "free_disk_bytes", lambda path: 300 * MiB)
    config = job("default")
    estimate_job(config).check()  # 240 MiB of slots fit in 300
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, async_save=True))
    with pytest.raises(BudgetError, match="checkpoint.async_save") as info:
        estimate_job(config).check()
    assert (info.value.tier, info.value.requested, info.value.available) == ("disk", 480 * MiB, 300 * MiB)


def test_checkpoints_written_beside_training_count_their_copy_of_the_pages_in_memory(monkeypatch):
    """The save's snapshot copies the saved pages (not gradients) resting in the device and host pools into host
    RAM: the estimate adds the smaller of those pools and those pages, and refuses what RAM cannot hold."""
    config = job("default")
    plain = estimate_job(config)
    background = estimate_job(dataclasses.replace(
        config, checkpoint=dataclasses.replace(config.checkpoint, async_save=True)))
    pools = plain.tiers["device"].pool + plain.tiers["host"].pool
    saved = sum(n for kind, n in plain.kind_bytes.items() if kind != "grad")
    assert plain.checkpoint_staging_bytes == 0
    assert background.checkpoint_staging_bytes == min(pools, saved) > 0
    assert background.host_ram_needed == plain.host_ram_needed + background.checkpoint_staging_bytes
    assert "checkpoint.async_save's copy" in background.format_table()
    monkeypatch.setattr(estimate_module.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=plain.host_ram_needed))
    estimate_job(config).check()  # exactly fits without the copy
    with pytest.raises(BudgetError, match="checkpoint.async_save's copy of the saved pages"):
        estimate_job(dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint,
                                                                                async_save=True))).check()


def test_optimizer_update_needs_four_pages_on_its_tier(tmp_path):
    # Three Linear(64, 64) units of 2 pages each (a 16 KiB weight, a page for its bias): 6 pages per kind.
    config = load_config(None, ["memory.page_bytes=16KiB", "memory.device_budget=48KiB", "memory.host_budget=48KiB",
                                f"memory.disk_dir={tmp_path}", "trainer.device=cpu"])

    def model():
        return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))

    estimate = estimate_job(config, model())
    assert estimate.largest_layer_pages == 2 and estimate.update_tier == "device"  # neither tier has 4 pages
    with pytest.raises(BudgetError) as info:
        estimate.check()
    assert (info.value.tier, info.value.requested, info.value.available) == ("device", 64 * KiB, 48 * KiB)
    with pytest.raises(BudgetError) as engine_info:
        angel_ptm.initialize(model(), config).close()
    assert str(engine_info.value) == str(info.value)


def test_pools_and_activations_beyond_available_ram_are_refused(monkeypatch):
    monkeypatch.setattr(estimate_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=200 * MiB))
    estimate = estimate_job(job("default"), device=CPU)
    # On a CPU the device pool is RAM too: 56 + 72 MiB of pools and the activation peak.
    assert estimate.host_ram_needed == 128 * MiB + estimate.activation_bytes
    with pytest.raises(BudgetError) as info:
        estimate.check()
    assert (info.value.tier, info.value.requested, info.value.available) == ("host", estimate.host_ram_needed,
                                                                             200 * MiB)


# --- a GPU job estimated where there is no GPU -------------------------------------------------------------------
@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without CUDA, even where the tests run on one: the estimate must not ask it anything."""
    def no_cuda(*args, **kwargs):
        raise AssertionError("the estimate asked CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda)


def test_an_auto_device_budget_resolves_against_the_given_gpu_memory(no_gpu):
    estimate = estimate_job(job("default", "memory.device_budget=auto"), device=torch.device("cuda"),
                            gpu_memory=100 * MiB)
    device = estimate.tiers["device"]
    assert (device.budget, device.available) == (80 * MiB, 100 * MiB)  # plan_budgets' 80% of the GPU's memory
    assert estimate.compute_device == "cuda" and estimate.gpu_memory_given and estimate.update_tier == "device"
    assert estimate.pinned_host_bytes == estimate.tiers["host"].pool == 72 * MiB  # the host pool is pinned
    assert estimate.host_ram_needed == 72 * MiB  # the device pool and activations are GPU memory, not RAM
    assert "compute device cuda (100.0 MiB of GPU memory given, not measured)" in estimate.format_table()


def test_an_auto_device_budget_takes_every_state_when_the_gpu_holds_them(no_gpu):
    estimate = estimate_job(job("default", "memory.device_budget=auto"), device=torch.device("cuda"),
                            gpu_memory=80 << 30)
    assert estimate.tiers["device"].budget == estimate.states_bytes == 240 * MiB and estimate.fits


def test_a_gpu_too_small_for_the_pool_and_activations_is_refused_in_readable_sizes(no_gpu):
    estimate = estimate_job(job("default"), device=torch.device("cuda"), gpu_memory=100 * MiB)
    with pytest.raises(BudgetError) as info:
        estimate.check()
    activation = estimate.activation_bytes
    message = str(info.value)
    assert message.startswith(f"device tier budget exceeded for the device pool (56.0 MiB) and activations "
                              f"({format_bytes(activation)}) in the given GPU memory; these fit: "
                              f"activations.checkpoint full (")
    assert message.endswith(f": requested {format_bytes(56 * MiB + activation)} ({56 * MiB + activation} bytes), "
                            f"100.0 MiB available")


def test_cuda_without_a_gpu_and_without_its_memory_is_still_refused(no_gpu):
    with pytest.raises(ConfigValueError, match='trainer.device: "cuda" requested but no CUDA device is available'):
        estimate_job(job("default"), device=torch.device("cuda"))


def test_gpu_memory_for_a_cpu_job_is_refused():
    with pytest.raises(ConfigValueError, match="gpu_memory is the memory of a CUDA device, but the compute device "
                                               "is cpu"):
        estimate_job(job("default"), device=torch.device("cpu"), gpu_memory=80 << 30)


# --- the command line -------------------------------------------------------------------------------------------
def test_cli_estimate_prints_the_table_and_exits_0(capsys):
    assert cli.main(["estimate"]) == 0
    out = capsys.readouterr().out
    assert "needed" in out and "expected peak" in out and "fits: yes" in out
    rows = [line.split()[0] for line in out.splitlines() if line.strip().split(" ")[0] in TIERS]
    assert rows == list(TIERS)


def test_cli_estimate_with_a_too_small_budget_exits_2_with_one_line(capsys):
    assert cli.main(["estimate", "--set", "memory.device_budget=512KiB"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    assert lines[0] == ("angel-ptm: error: device tier budget exceeded for unit 'layers.1' "
                        "(13 pages of 1.0 MiB): requested 13.0 MiB (13631488 bytes), 512.0 KiB available")
    assert "fits: no" in captured.out  # the numbers are still printed


def test_cli_estimate_json_is_one_object(capsys):
    assert cli.main(["estimate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["problems"] == []
    assert data["n_pages"] == 60 and data["master_extra_bytes"] == 0
    assert set(data["tiers"]) == set(TIERS)
    assert set(data["tiers"]["disk"]) == {"tier", "needed", "budget", "pool", "peak", "available", "fits"}


def test_cli_estimate_for_a_gpu_that_is_not_here(capsys, no_gpu):
    assert cli.main(["estimate", "--device", "cuda", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory estimate, rank 0 of 1, compute device cuda (80.0 GiB of GPU memory given, "
                          "not measured)")
    assert "  pinned host memory 72.0 MiB; host RAM needed 72.0 MiB" in out
    device_row = next(line.split() for line in out.splitlines() if line.startswith("  device "))
    assert device_row[-3:] == ["80.0", "GiB", "yes"]


def test_cli_estimate_with_gpu_memory_alone_means_cuda(capsys, no_gpu):
    assert cli.main(["estimate", "--json", "--gpu-memory", "2GiB", "--set", "memory.device_budget=auto"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["compute_device"], data["gpu_memory_given"]) == ("cuda", True)
    assert data["tiers"]["device"]["budget"] == 240 * MiB  # every state: 80% of 2 GiB holds them


def test_cli_estimate_for_cuda_without_a_gpu_says_to_give_its_memory(capsys, no_gpu):
    assert cli.main(["estimate", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == ("angel-ptm: error: --device cuda: no CUDA device is available here to "
                                       "measure; to estimate for a GPU elsewhere, give its memory: --gpu-memory "
                                       "80GiB\n")


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory", "lots"], "--gpu-memory: not a byte size"),
    (["--device", "cpu", "--gpu-memory", "8GiB"], "--gpu-memory is the memory of a GPU: use it with --device cuda"),
])
def test_cli_estimate_refuses_a_bad_gpu_memory_in_one_line(capsys, argv, message):
    assert cli.main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"angel-ptm: error: {message}") and err.count("\n") == 1


def test_osdp_allowance_is_half_the_gathered_group_room_beside_the_largest_unit():
    from angel_ptm.parallel import Ownership
    from angel_ptm.parallel.ownership import osdp_replicable

    config = job("default", "parallel.osdp=true")
    estimate = estimate_job(config, ownership=Ownership(0, 2, 3), local_world_size=2)
    assert estimate.gather_groups > estimate.largest_unit_groups  # the default job has room to spare
    assert estimate.osdp_groups == osdp_replicable(estimate.gather_groups, estimate.largest_unit_groups) > 0
    assert f"OSDP: up to {estimate.osdp_groups} of those groups kept replicated" in estimate.format_table()
    assert estimate_job(job("default"), ownership=Ownership(0, 2, 3)).osdp_groups == 0  # osdp off
    assert estimate_job(config).osdp_groups == 0  # one rank gathers nothing


def test_reduce_scatter_buffers_count_in_ram_on_a_cpu_for_zero_2_and_3_only():
    from angel_ptm.parallel import Ownership
    from angel_ptm.parallel.grad_sync import GradSync

    page = MiB  # the default job's pages
    for stage, expected in ((1, 0), (2, GradSync.IN_FLIGHT * 2 * 2 * page), (3, GradSync.IN_FLIGHT * 2 * 2 * page)):
        estimate = estimate_job(job("default"), ownership=Ownership(0, 2, stage), local_world_size=2, device=CPU)
        alone = estimate_job(job("default"), ownership=Ownership(0, 2, 1), local_world_size=2, device=CPU)
        assert estimate.collective_buffer_bytes == expected, stage
        assert estimate.host_ram_needed - expected == alone.host_ram_needed  # the same pools otherwise
        assert ("reduce-scatter buffers" in estimate.format_table()) == bool(expected)


@pytest.mark.parametrize("device_budget", ["auto", "1MiB"])
@pytest.mark.parametrize("page", ["4KiB", "64MiB"])
def test_zero3_on_a_model_smaller_than_its_gather_room_fits_any_ample_budget(device_budget, page, tmp_path):
    """ZeRO-3 on 2 ranks needs the largest unit's gathered groups beside the pages a rank pins of its own, which can
    be more slots than a small model has pages: an ample (or "auto") device budget is not cut below that."""
    from angel_ptm.parallel import Ownership

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8))
    model[0].bias.requires_grad_(False)
    config = load_config(None, [f"memory.page_bytes={page}", f"memory.device_budget={device_budget}",
                                f"memory.disk_dir={tmp_path}", "trainer.device=cpu"])
    estimate = estimate_job(config, model, ownership=Ownership(0, 2, 3), local_world_size=2, device=CPU)
    floor = estimate.device_floor_pages
    assert floor * estimate.page_bytes > estimate.states_bytes  # (the case: more room than the model's pages)
    if device_budget == "auto" or page == "4KiB":
        assert estimate.fits, estimate.problems
        assert estimate.tiers["device"].budget >= floor * estimate.page_bytes
    else:  # 1 MiB is less than one 64 MiB page: refused with the numbers
        assert not estimate.fits


@pytest.mark.parametrize("disk_budget", [150, 239])
def test_a_disk_budget_below_a_slot_for_every_state_page_is_refused_naming_the_page_files(disk_budget, tmp_path):
    """Once states rest on disk, each kind's page file keeps a slot for every page of the kind (which pages rest
    there changes as they move; a kind's free slots are no room for another's): the default job's 240 state pages
    need 240 MiB, which the table says, and a smaller budget is refused with those numbers, not as the host's."""
    short = estimate_job(job("default", f"memory.disk_budget={disk_budget}MiB", f"memory.disk_dir={tmp_path}"),
                         device=CPU)
    assert short.tiers["disk"].needed == 240 * MiB and not short.fits
    problem = short.problems[0]
    assert (problem.tier, problem.requested, problem.available) == ("disk", 240 * MiB, disk_budget * MiB)
    assert "125.0 MiB of states fit neither the device nor the host" in problem.what
    assert estimate_job(job("default", "memory.disk_budget=240MiB", f"memory.disk_dir={tmp_path}"), device=CPU).fits


@pytest.mark.parametrize("overrides", [[], ["trainer.dtype=bfloat16"], ["optimizer.staleness=1"]],
                         ids=["fp32", "bf16", "staleness1"])
def test_the_estimate_reports_how_many_page_groups_one_optimizer_access_updates(overrides, tmp_path):
    # A host with room to spare beyond the estimate's needs: the update batches several of a unit's page groups,
    # as many as the estimate reports (and its table shows), each of the pages the optimizer really pins.
    config = load_config(None, [*SMALL_GPT, "memory.page_bytes=64KiB", "memory.device_budget=1280KiB",
                                "memory.host_budget=4MiB", f"memory.disk_dir={tmp_path}", "trainer.device=cpu",
                                *overrides])
    model = build_model(config.model)
    estimate = estimate_job(config, model, disk_dir=str(tmp_path))
    assert estimate.update_tier == "host" and estimate.update_batch_groups > 1
    assert f"up to {estimate.update_batch_groups} page groups of {estimate.update_group_pages} pages" \
        in estimate.format_table()
    assert estimate.as_dict()["update_batch_groups"] == estimate.update_batch_groups
    engine = angel_ptm.initialize(model, config)
    try:
        assert engine.optimizer.batch_groups == estimate.update_batch_groups
        assert len(engine.optimizer.group_kinds) == estimate.update_group_pages
    finally:
        engine.close()
