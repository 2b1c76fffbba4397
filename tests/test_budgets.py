"""Resolving the tier budgets (angel_ptm/memory/budgets.py): "auto" in whole pages, room for the largest layer to
rotate through the device, and a job with an explicit device budget, an auto host and no disk that trains."""

from __future__ import annotations

import pytest
import torch

import angel_ptm
from angel_ptm.config import load_config
from angel_ptm.estimate import estimate_job
from angel_ptm.memory.budgets import plan_budgets, resolve_budgets
from angel_ptm.models import build_model

KiB, MiB = 1 << 10, 1 << 20


def test_auto_budgets_count_the_whole_pages_a_budget_holds():
    """An 800 KiB device budget of 64 KiB pages holds 768 KiB: the auto host budget takes the 32 KiB beyond it too
    (it came out one page short), and with a fixed host budget the auto disk budget holds what neither does (it was
    0: 'disk tier budget exceeded' on a job whose budgets were all but one auto; 80% of a GPU is rarely whole
    pages)."""
    cpu, page, states = torch.device("cpu"), 64 * KiB, 2 * MiB + 512 * KiB
    budgets = plan_budgets(800 * KiB, "auto", "auto", states, cpu, page, ram_available=1 << 40)
    assert budgets.host == states - 768 * KiB and budgets.disk == 0
    budgets = plan_budgets(800 * KiB, 1700 * KiB, "auto", states, cpu, page)  # holds 1664 KiB: 128 KiB left over
    assert budgets.disk == states
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    assert estimate_job({"memory": {"page_bytes": "16KiB", "device_budget": "100KiB"}}, model).fits


def test_offload_hosts_pages_the_host_cannot_hold_keep_an_auto_disk_tier_whatever_holds_the_states():
    """activations.offload host: a host budget that holds the states but not the activation pages beside them
    keeps the auto disk tier for them to spill to (it dropped it: refused at 500-896 pages where 400 and 897
    were accepted)."""
    cpu, page, states, acts = torch.device("cpu"), 4 * KiB, 400 * KiB, 200 * KiB
    spare = {host: plan_budgets(40 * KiB, host, "auto", states, cpu, page, activation_bytes=acts,
                                activation_tier="host").disk for host in (300 * KiB, 400 * KiB, 700 * KiB)}
    assert spare[300 * KiB] > 0 and spare[400 * KiB] > 0  # (the states need the disk at 300 KiB already)
    assert spare[700 * KiB] == 0  # the host holds both: no disk tier
    assert plan_budgets(40 * KiB, 400 * KiB, "auto", states, cpu, page).disk == 0  # (no activation pages)


@pytest.mark.parametrize("budgets", [("auto", "auto", "auto"), (256 * KiB, "auto", "auto"),
                                     (64 * KiB, 128 * KiB, "auto"), (64 * KiB, 64 * KiB, 8 * MiB)])
def test_auto_host_budget_leaves_room_to_rotate_the_largest_layer(budgets, tmp_path):
    device, host, disk = budgets
    states, page, slack = 2 * MiB, 16 * KiB, 3 * 16 * KiB
    cpu = torch.device("cpu")
    resolved = resolve_budgets(device, host, disk, states, cpu, str(tmp_path), page, slack_bytes=slack)
    assert resolved == plan_budgets(device, host, disk, states, cpu, page, slack_bytes=slack)
    if host == "auto":
        rest = states - resolved.device
        assert resolved.host == (max(rest + slack, 4 * page) if rest > 0 else 4 * page)


def test_an_explicit_device_budget_with_auto_host_and_no_disk_trains(tmp_path):
    # The device keeps the largest layer's pages free while pages are created; the auto host budget covers them.
    config = {"model": {"dim": 32, "n_layer": 1, "n_head": 2, "seq_len": 16, "vocab_size": 64},
              "memory": {"page_bytes": "4KiB", "device_budget": "128KiB", "host_budget": "auto", "disk_budget": 0,
                         "disk_dir": str(tmp_path)},
              "trainer": {"device": "cpu"}}
    model = build_model(load_config(config).model)
    estimate = estimate_job(config, model)
    assert estimate.fits and estimate.tiers["disk"].budget == 0
    engine = angel_ptm.initialize(model, config)
    try:
        x = torch.randint(0, 64, (2, 16))
        engine.backward(engine(x, x))
        engine.step()
    finally:
        engine.close()
