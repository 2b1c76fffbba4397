"""The estimate of one rank among several: what a machine's ranks need together (host RAM), and what ZeRO-3 must
keep gathered where ranks read different parameters in backward."""

from types import SimpleNamespace

import pytest
import torch

from angel_ptm import estimate as estimate_module
from angel_ptm.config.sizes import format_bytes
from angel_ptm.errors import BudgetError
from angel_ptm.estimate import estimate_job

from test_estimate import CPU, KiB, job


def test_the_host_ram_check_counts_the_pools_of_every_rank_on_the_machine(monkeypatch):
    """Each process on a machine has host pools of its own in its RAM: 3 local ranks with a 4 GiB host budget need
    12 GiB, as the page files' check already counted each rank's slots (it used to pass on one rank's 4 GiB)."""
    GiB = 1 << 30
    monkeypatch.setattr(estimate_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=10 * GiB))
    config = job("default", "memory.host_budget=4GiB", "memory.device_budget=64MiB")
    alone = estimate_job(config, device=torch.device("cpu"))
    assert alone.fits and alone.host_ram_needed < 5 * GiB
    three = estimate_job(config, device=torch.device("cpu"), local_world_size=3)
    assert not three.fits and three.host_ram_needed == alone.host_ram_needed  # (per rank)
    with pytest.raises(BudgetError, match=r"by each of 3 ranks, in available RAM: requested 1[23]\.\d GiB"):
        three.check()
    assert f"{format_bytes(3 * alone.host_ram_needed)} for the 3 ranks here" in three.format_table()


def test_zero3_with_moe_experts_in_their_blocks_unit_needs_every_group_gathered():
    """dp 2, ZeRO-3, ep 1: the experts are in their block's unit, gathered with it on every rank, and each rank's
    backward reads only the experts its tokens reached. A device with room for fewer groups than all dropped some
    between forward and backward and regathered them on some ranks only: both ranks hung until parallel.timeout_s
    (probe a2). The estimate now asks for every group; ep = dp needs no such room."""
    from angel_ptm.parallel import Ownership

    model = {"name": "gpt", "vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "dim": 32,
             "moe": {"experts": 4, "top_k": 2, "gate": "ktop1", "capacity_factor": 0.5}}
    config = {"model": model, "memory": {"page_bytes": "4KiB", "device_budget": "300KiB", "host_budget": "4MiB"},
              "trainer": {"device": "cpu"}, "parallel": {"zero": 3}}
    tight = estimate_job(config, ownership=Ownership(0, 2, 3), local_world_size=2, device=CPU)
    assert not tight.fits
    with pytest.raises(BudgetError, match=r"MoE experts routed differently on each rank.*parallel.ep = the dp size"):
        tight.check()
    roomy = estimate_job(dict(config, memory=dict(config["memory"], device_budget="1MiB")),
                         ownership=Ownership(0, 2, 3), local_world_size=2, device=CPU)
    assert roomy.fits and tight.tiers["device"].needed > 300 * KiB
    dense = estimate_job(dict(config, model={k: v for k, v in model.items() if k != "moe"}),
                         ownership=Ownership(0, 2, 3), local_world_size=2, device=CPU)
    assert dense.fits  # (a dense model's backward reads what every rank's does: groups may go and come back)
