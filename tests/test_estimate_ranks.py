"""The estimate of one rank among several: what a machine's ranks need together (host RAM), and what ZeRO-3 must
keep gathered where ranks read different parameters in backward."""

from types import SimpleNamespace

import pytest
import torch

from angel_ptm import estimate as estimate_module
from angel_ptm.config.sizes import format_bytes
from angel_ptm.errors import BudgetError
from angel_ptm.estimate import estimate_job

from test_estimate import CPU, job


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


def test_zero3_with_moe_experts_in_their_blocks_unit_needs_no_more_groups_than_a_dense_model():
    """dp 2, ZeRO-3, ep 1: the experts are in their block's unit, and each rank's backward reads only the experts
    its tokens reached. The unit's groups are gathered when backward reaches its output, on every rank alike, so a
    group dropped between forward and backward costs a gather, not a hang (probe a2; the run is
    test_distributed's zero3-moe-ep1-tight): the estimate asks for no room beyond the units' own groups."""
    from angel_ptm.parallel import Ownership

    model = {"name": "gpt", "vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "dim": 32,
             "moe": {"experts": 4, "top_k": 2, "gate": "ktop1", "capacity_factor": 0.5}}
    config = {"model": model, "memory": {"page_bytes": "4KiB", "device_budget": "300KiB", "host_budget": "4MiB"},
              "trainer": {"device": "cpu"}, "parallel": {"zero": 3}}
    tight = estimate_job(config, ownership=Ownership(0, 2, 3), local_world_size=2, device=CPU)
    roomy = estimate_job(dict(config, memory=dict(config["memory"], device_budget="1MiB")),
                         ownership=Ownership(0, 2, 3), local_world_size=2, device=CPU)
    assert tight.fits and tight.gather_groups < roomy.gather_groups  # (groups dropped between forward and backward)
    assert tight.gather_groups >= tight.largest_unit_groups

def test_a_budget_error_names_the_tiers_whole_need_when_another_need_of_it_is_larger():
    """ZeRO-3 at 2 ranks, 32 KiB of device: the first problem found is the largest unit (76 KiB), but the gathered
    groups need 108 KiB; asking for 76 KiB would fail again (probe e2). The one line names both."""
    from angel_ptm.parallel import Ownership

    model = {"name": "gpt", "vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "dim": 32}
    config = {"model": model, "memory": {"page_bytes": "4KiB", "device_budget": "32KiB", "host_budget": "4MiB"},
              "trainer": {"device": "cpu"}, "parallel": {"zero": 3}}
    tight = estimate_job(config, ownership=Ownership(0, 2, 3), local_world_size=2, device=CPU)
    needed = tight.tiers["device"].needed
    assert tight.problems[0].requested < needed
    with pytest.raises(BudgetError, match=rf"the device tier needs {format_bytes(needed)} in all"):
        tight.check()
    enough = dict(config, memory=dict(config["memory"], device_budget=needed))
    assert estimate_job(enough, ownership=Ownership(0, 2, 3), local_world_size=2, device=CPU).fits
