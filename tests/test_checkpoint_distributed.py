"""Checkpoints on 2 gloo ranks (spawned once for the module): ZeRO-3 resumes bitwise from a checkpoint saved
mid-run (also one written beside training), and checkpoints move between 2 ranks with 64 KiB pages and 1 rank
with 16 KiB pages both ways."""

from __future__ import annotations

import pytest

from dist_harness import spawn, values
from dist_jobs import job, train


STEPS, AT = 10, 5


def one_rank(tmp, name, page_bytes, save_to=None, load=None):
    """The GPT on 1 rank with grad_accum 2 (the micro-batches of 2 ranks with 1 each), `page_bytes` pages on the
    device; saves at step 5 or starts from `load`. The losses of the steps it ran."""
    spec = job(name, zero=3, placement="device", accum=2, steps=STEPS, page_bytes=page_bytes, save_at=AT,
               save_to=save_to, load=load)
    return train(0, 1, spec, str(tmp))["losses"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt2")
    one = {"losses": one_rank(tmp, "one", "16KiB", save_to=str(tmp / "one-16k"))}
    jobs = [job("z3", steps=STEPS, save_at=AT, save_to=str(tmp / "z3"), final_states=True),
            job("z3-resumed", steps=STEPS, load=str(tmp / "z3"), final_states=True),
            job("z3-device", placement="device", steps=STEPS, save_at=AT, save_to=str(tmp / "z3-device"),
                final_states=True),
            job("z3-device-resumed", placement="device", steps=STEPS, load=str(tmp / "z3-device"), final_states=True),
            job("z3-host", placement="device+host", steps=STEPS, save_at=AT, save_to=str(tmp / "z3-host"),
                final_states=True),
            job("z3-host-resumed", placement="device+host", steps=STEPS, load=str(tmp / "z3-host"), final_states=True),
            job("z3-stale", staleness=1, steps=STEPS, save_at=AT, save_to=str(tmp / "z3-stale"), final_states=True),
            job("z3-stale-resumed", staleness=1, steps=STEPS, load=str(tmp / "z3-stale"), final_states=True),
            job("z3-bf16", dtype="bfloat16", steps=STEPS, save_at=AT, save_to=str(tmp / "z3-bf16"), final_states=True),
            job("z3-bf16-resumed", dtype="bfloat16", steps=STEPS, load=str(tmp / "z3-bf16"), final_states=True),
            job("z3-bg", steps=STEPS, save_at=AT, save_to=str(tmp / "z3-bg"), background=True),
            job("z3-bg-resumed", steps=STEPS, load=str(tmp / "z3-bg"), final_states=True),
            job("z3-bf16-stale", dtype="bfloat16", staleness=1, steps=STEPS, save_at=AT, save_to=str(tmp / "bf16"),
                final_states=True),
            job("z3-bf16-stale-resumed", dtype="bfloat16", staleness=1, steps=STEPS, load=str(tmp / "bf16"),
                final_states=True),
            job("z1-64k", zero=1, placement="device", page_bytes="64KiB", steps=STEPS, save_at=AT,
                save_to=str(tmp / "two-64k")),
            job("from-one-rank", placement="device", page_bytes="64KiB", steps=STEPS, load=str(tmp / "one-16k"))]
    from dist_jobs import run_jobs

    results = values(spawn(2, run_jobs, (jobs, str(tmp)), tmp))
    return tmp, one, results


@pytest.mark.parametrize("name", ["z3", "z3-stale", "z3-bf16", "z3-bf16-stale", "z3-device", "z3-host"])
def test_two_ranks_resume_bitwise_from_a_mid_run_checkpoint(ranks, name):
    _, _, results = ranks
    for rank in results:
        first, resumed = rank[name], rank[f"{name}-resumed"]
        assert "error" not in first and "error" not in resumed, (first.get("error"), resumed.get("error"))
        assert resumed["losses"] == first["losses"][AT:]
        assert resumed["states"]["final"] == first["states"]["final"]


def test_a_background_save_on_two_ranks_holds_its_steps_state(ranks):
    """Saved beside steps 6-10 (DCP's collectives on the checkpoint's own group while training's run): resuming
    from it gives the uninterrupted run's losses and final states bitwise."""
    _, _, results = ranks
    for rank in results:
        assert "error" not in rank["z3-bg"] and "error" not in rank["z3-bg-resumed"], rank["z3-bg-resumed"]
        assert rank["z3-bg"]["losses"] == rank["z3"]["losses"]
        assert rank["z3-bg-resumed"]["losses"] == rank["z3"]["losses"][AT:]
        assert rank["z3-bg-resumed"]["states"]["final"] == rank["z3"]["states"]["final"]


def test_a_one_rank_16k_checkpoint_resumes_on_two_ranks_with_64k_pages(ranks):
    _, one, results = ranks
    for rank in results:
        assert "error" not in rank["from-one-rank"], rank["from-one-rank"].get("error")
        assert rank["from-one-rank"]["losses"] == pytest.approx(one["losses"][AT:], rel=1e-6)


def test_a_two_rank_64k_checkpoint_resumes_on_one_rank_with_16k_pages(ranks):
    tmp, _, results = ranks
    two = results[0]["z1-64k"]
    assert "error" not in two, two.get("error")
    resumed = one_rank(tmp, "to-one-rank", "16KiB", load=str(tmp / "two-64k"))
    assert resumed == pytest.approx(two["losses"][AT:], rel=1e-6)
