"""Data parallelism on CPU over gloo: N ranks give the losses of 1 rank with grad_accum N (bitwise for 2 ranks), and
of torch.optim.AdamW on the global batch, under every ZeRO stage, placement, clipping, staleness and bf16.

The ranks are spawned once per group of jobs (tests/dist_harness.py: torchrun's environment, so the engine sets the
process group up itself) and run every job in turn; each test then reads its job's result.
"""

import pytest
import torch

from dist_harness import spawn, values
from dist_jobs import CASES, PLACEMENTS, job, micro_batches, run_jobs, train
from test_engine_equivalence import train_plain

STAGES = [1, 2, 3]
JOBS = (
    [job(f"zero{z}-{p}", zero=z, placement=p, state_dicts=p == "device+host+disk") for z in STAGES
     for p in PLACEMENTS]
    + [job("zero0-device+host+disk", zero=0)]
    + [job("zero3-on_demand", zero=3, scheduler="on_demand")]
    + [job(f"zero{z}-clip", zero=z, clip=0.05) for z in STAGES]
    + [job(f"zero{z}-staleness1", zero=z, staleness=1) for z in STAGES]
    + [job(f"zero{z}-bf16", zero=z, dtype="bfloat16") for z in STAGES]
    + [job("zero2-mlp-accum2", zero=2, model="mlp", accum=2), job("zero3-tied", zero=3, model="tied",
                                                                    placement="device+host")]
    + [job(f"zero{z}-branchy", zero=z, model="branchy", placement="device+host") for z in (2, 3)]
    # units whose parameters each rank reads differently in backward, on a device with room for a few groups only
    + [job("zero3-branchy-blocks-tight", zero=3, model="branchy-blocks", placement="device+host", timeout_s=20,
           memory={"device_budget": "64KiB"}),
       job("zero3-moe-ep1-tight", zero=3, model="gpt-moe", placement="device+host", timeout_s=20,
           memory={"device_budget": "300KiB"}),
       job("zero3-branchy-nested-tight", zero=3, model="branchy-nested", units="nested", placement="device+host",
           timeout_s=20, memory={"device_budget": "64KiB"})]
    + [job("zero3-batchnorm", zero=3, model="normed", placement="device", state_dicts=True),
       job("zero1-batchnorm-eval", zero=1, model="normed", placement="device", state_dicts=True, eval_before_step=True)]
    + [job("zero3-osdp", zero=3, osdp=True, steps=5)]
    # the defaults: auto budgets, on a model smaller than ZeRO-3's gathered groups' room (16 KiB pages)
    + [job("zero3-auto-budgets", zero=3, placement="device", page_bytes="16KiB",
           memory={"device_budget": "auto", "host_budget": "auto"})]
    + [job("zero3-recompute", zero=3, activations="full")]
    + [job("zero3-selective", zero=3, activations="selective"),
       job("zero3-offload-host", zero=3, activations={"checkpoint": "none", "offload": "host", "offload_min_bytes": 0},
           memory={"host_budget": "2MiB"}),
       job("zero2-selective-offload-disk", zero=2,
           activations={"checkpoint": "selective", "offload": "disk", "offload_min_bytes": 0})]
    + [job(f"zero{z}-collective-group", zero=z, pairwise=False) for z in (2, 3)]
    + [job(f"zero{z}-dropped-step", zero=z, drop_at=2, optimizer={"overlap_updates": False}) for z in (2, 3)]
    + [job("zero2-fp16-overflow", zero=2, dtype="float16", placement="device+host", overflow_at=[1, 1],
           optimizer={"loss_scale_initial": 1024.0})]
)
BY_NAME = {spec["name"]: spec for spec in JOBS}
# torch on the global batch: not for the branchy model, whose branch is decided per micro-batch, nor a dropped step
# (nor BatchNorm, whose batch statistics are a micro-batch's)
FP32_JOBS = [s["name"] for s in JOBS if s["dtype"] == "float32" and not s["staleness"]
             and s["model"] not in ("branchy", "branchy-blocks", "branchy-nested", "gpt-moe", "normed")
             and "drop_at" not in s]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-ranks")
    return values(spawn(2, run_jobs, (JOBS, str(tmp)), tmp))


def one_rank(spec, world, tmp_path):
    """The same job on one rank with world * grad_accum micro-batches per step."""
    return train(0, 1, dict(spec, accum=spec["accum"] * world, overflow_at=None), str(tmp_path))


def torch_reference(spec, world):
    """torch.optim.AdamW on the global batch of each step (the micro-batches of every rank concatenated)."""
    build, _, loss_fn = CASES[spec["model"]]
    per_step = world * spec["accum"]
    micro = micro_batches(spec["model"], spec["steps"] * per_step)
    batches = [tuple(torch.cat(parts) for parts in zip(*micro[s * per_step:(s + 1) * per_step]))
               for s in range(spec["steps"])]
    return train_plain(build(), batches, loss_fn, clip=spec["clip"])


def result(results, name):
    for rank, by_job in enumerate(results):
        assert "error" not in by_job[name], f"rank {rank}: {by_job[name]['error']}"
    return results[0][name]


@pytest.mark.parametrize("name", [f"zero{z}-staleness1" for z in STAGES])
def test_after_a_flush_every_rank_computes_with_the_last_update(two_ranks, name, tmp_path):
    """staleness 1: Engine.flush (the trainer's, after the last step) lands the pending update in every rank's
    parameters, not only in its owners' pages: each rank's forward then gives one rank's."""
    assert [by_job[name]["after"] for by_job in two_ranks] == [one_rank(BY_NAME[name], 2, tmp_path)["after"]] * 2


@pytest.mark.parametrize("name", [s["name"] for s in JOBS if "overflow_at" not in s])
def test_two_ranks_give_the_losses_of_one_rank_with_grad_accum_2_bitwise(two_ranks, name, tmp_path):
    spec = BY_NAME[name]
    got = result(two_ranks, name)
    assert two_ranks[1][name]["losses"] == got["losses"]  # every rank logs the mean over ranks
    want = one_rank(spec, 2, tmp_path)["losses"]
    if spec["accum"] == 1:  # one rank adds the two micro-batches' gradients, as the reduction adds the two ranks'
        assert got["losses"] == want
    else:  # 1 rank sums ((a + b) + c) + d, 2 ranks (a + b) + (c + d): equal only up to rounding
        assert got["losses"] == pytest.approx(want, rel=1e-6, abs=0)


@pytest.mark.parametrize("name", FP32_JOBS)
def test_two_ranks_match_torch_adamw_on_the_global_batch(two_ranks, name):
    spec = BY_NAME[name]
    expected = torch_reference(spec, 2)
    for step, (e, a) in enumerate(zip(expected, result(two_ranks, name)["losses"])):
        assert a == pytest.approx(e, rel=1e-5), f"step {step}: torch {e} two ranks {a}"


def test_zero3_with_recomputed_units_gives_the_losses_of_keeping_every_activation(two_ranks):
    """activations.checkpoint full: each block's forward runs again in backward, its parameter groups gathered
    again for it; the losses are those of the same job keeping every activation, bit for bit."""
    assert result(two_ranks, "zero3-recompute")["losses"] == result(two_ranks, "zero3-device+host+disk")["losses"]


@pytest.mark.parametrize("name", ["zero3-selective", "zero3-offload-host", "zero2-selective-offload-disk"])
def test_selective_recomputation_and_activation_pages_under_zero_keep_the_losses_bitwise(two_ranks, name):
    """activations.checkpoint selective and offload host | disk under ZeRO: the activation pages are every rank's
    own (never sharded, gathered or reduced), the recomputation gathers its parameter groups again, and the
    losses are those of the same job keeping every activation, bit for bit."""
    zero = BY_NAME[name]["zero"]
    got = result(two_ranks, name)
    assert got["losses"] == result(two_ranks, f"zero{zero}-device+host+disk")["losses"]
    if "offload" in name:
        for rank in (0, 1):
            assert two_ranks[rank][name]["activation_pages"] > 0, rank


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_each_rank_holds_its_share_of_the_sharded_kinds(two_ranks, zero, tmp_path):
    name = f"zero{zero}-device+host+disk"
    alone = one_rank(BY_NAME[name], 2, tmp_path)["pages"]
    padded = {kind: n + n % 2 for kind, n in alone.items()}  # two ranks pad the layout to whole groups of 2
    sharded = {0: (), 1: ("exp_avg", "exp_avg_sq"), 2: ("exp_avg", "exp_avg_sq"),
               3: ("exp_avg", "exp_avg_sq", "param")}[zero]
    for rank in (0, 1):
        pages = two_ranks[rank][name]["pages"]
        for kind, n in padded.items():
            assert pages[kind] == (n // 2 if kind in sharded else n), (rank, kind)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_each_placement_uses_its_tiers_on_every_rank(two_ranks, placement):
    for rank in (0, 1):
        moved = two_ranks[rank][f"zero3-{placement}"]["moved"]
        if placement == "device":
            assert not moved.get("device->host") and not moved.get("host->disk"), rank
        else:
            assert moved["device->host"] > 0, rank
        if placement == "device+host+disk":
            assert moved["host->disk"] > 0 and moved["disk->host"] > 0, rank


@pytest.mark.parametrize("zero", STAGES)
def test_state_dicts_read_from_every_rank_equal_one_ranks_bitwise(two_ranks, zero, tmp_path):
    name = f"zero{zero}-device+host+disk"
    alone = one_rank(BY_NAME[name], 2, tmp_path)["states"]
    for rank in (0, 1):
        assert two_ranks[rank][name]["states"] == alone, rank  # model.state_dict() and AdamW's state, every tensor


def test_buffers_are_rank_0s_after_every_step_so_state_dicts_agree_as_under_ddp(two_ranks, tmp_path):
    """BatchNorm's running statistics: each rank updates them with its own micro-batch, then takes rank 0's after
    the step (DDP's broadcast_buffers); the losses are one rank's (batch statistics in training)."""
    name = "zero3-batchnorm"
    states = [two_ranks[rank][name]["states"]["model"] for rank in (0, 1)]
    assert states[0] == states[1] and "1.running_mean" in states[0]
    # an evaluation forward between backward and step (eval mode at step on every rank): the broadcast ran on
    # whether the model was training then, so the ranks' statistics stayed their own
    states = [two_ranks[rank]["zero1-batchnorm-eval"]["states"]["model"] for rank in (0, 1)]
    assert states[0] == states[1]
    assert two_ranks[0][name]["losses"] == one_rank(BY_NAME[name], 2, tmp_path)["losses"]


def test_zero3_gathers_parameter_groups_and_stages_1_2_do_not_gather_before_use(two_ranks):
    assert result(two_ranks, "zero3-device")["gathers"] > 0
    assert result(two_ranks, "zero1-device")["gathers"] == 0


@pytest.mark.parametrize("zero", [2, 3])
def test_gradients_are_reduced_and_applied_during_backward_from_the_second_step(two_ranks, zero):
    """Stages 2-3 reduce a page group as soon as its gradients are final (in the order agreed after step 0) and,
    with no clipping, the owner updates its page then; with clipping only the reduction moves into backward."""
    for rank in (0, 1):
        plain, clipped = two_ranks[rank][f"zero{zero}-device+host+disk"], two_ranks[rank][f"zero{zero}-clip"]
        assert plain["overlapped"] > 0 and plain["eager_updates"] > 0, rank
        assert clipped["overlapped"] > 0 and clipped["eager_updates"] == 0, rank
        group = two_ranks[rank][f"zero{zero}-collective-group"]  # NCCL's way: reductions on a group of their own
        assert group["overlapped"] > 0 and group["eager_updates"] > 0, rank
    assert result(two_ranks, "zero1-device+host+disk")["overlapped"] == 0  # stage 1 reduces after backward


def test_osdp_keeps_the_groups_compute_waited_on_replicated_within_the_estimates_allowance(two_ranks):
    """The same groups on every rank (agreed), no more than the estimate allows, each one waited on when chosen;
    the losses (bitwise equal to one rank's, within 1e-5 of torch: the parametrized tests) are unchanged."""
    first = result(two_ranks, "zero3-osdp")
    assert first["osdp"] and two_ranks[1]["zero3-osdp"]["osdp"] == first["osdp"]
    assert len(first["osdp"]) <= first["osdp_allowed"]
    assert all(seconds > 1e-4 for seconds in first["osdp"].values())
    assert result(two_ranks, "zero3-device+host+disk")["osdp"] == {}


def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(two_ranks):
    name = "zero2-fp16-overflow"
    first = result(two_ranks, name)
    for rank in (0, 1):
        assert two_ranks[rank][name]["skipped"] == [False, True, False, False], rank
        assert two_ranks[rank][name]["scales"] == [1024.0, 512.0, 512.0, 512.0], rank
    assert two_ranks[1][name]["losses"] == first["losses"]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("four-ranks")
    jobs = [job("zero3-clip", zero=3, clip=0.05), job("zero1-device+host", zero=1, placement="device+host")]
    return values(spawn(4, run_jobs, (jobs, str(tmp)), tmp)), {j["name"]: j for j in jobs}


def test_four_ranks_match_one_rank_and_torch_within_1e_5(four_ranks, tmp_path):
    results, jobs = four_ranks
    for name, spec in jobs.items():
        got = result(results, name)["losses"]
        for rank in range(4):
            assert results[rank][name]["losses"] == got
        for reference in (one_rank(spec, 4, tmp_path)["losses"], torch_reference(spec, 4)):
            for step, (e, a) in enumerate(zip(reference, got)):
                assert a == pytest.approx(e, rel=1e-5), f"{name} step {step}: {e} vs four ranks {a}"


@pytest.mark.parametrize("zero", [1, 3])
def test_state_dicts_saved_and_loaded_on_two_ranks_resume_one_ranks_run(zero, tmp_path):
    from dist_jobs import resume

    spec = job(f"resume-zero{zero}", zero=zero, dtype="bfloat16" if zero == 1 else "float32", steps=3)
    two = values(spawn(2, resume, (spec, str(tmp_path)), tmp_path))
    assert two[0] == two[1]
    alone = resume(0, 1, dict(spec, accum=2), str(tmp_path))  # one rank, the same micro-batches
    assert two[0] == alone  # each rank loads its own pages: nothing lost or doubled
