"""Tensor parallelism (Megatron 1-D, sequence parallelism optional) over gloo on CPU, fp32: the split model's
forward outputs and every full parameter's gradient (re-assembled from the shards) equal the 1-rank model's within
1e-5; 20 steps of tp 2 give the 1-rank losses within 1e-5 in each placement, with and without sequence
parallelism, for our GPT and a HuggingFace Llama (meta-device init and clipping too); dp 2 x tp 2 on 4 ranks with
ZeRO 3 gives the losses of 1 rank with grad_accum 2; each rank holds 1/tp of every split tensor. Plans and
dimensions that do not split: tests/test_tensor_parallel_plans.py. Dropout
draws one mask on replicated activations and each rank's own on split ones, and recomputation redraws the same.
Each region entry's backward collective runs while the column-parallel weight gradients are computed.

The ranks are spawned once per module group (tests/dist_harness.py) and run every job in turn.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.models import GPT, GPTConfig
from angel_ptm.parallel.tensor import Plan, TPComm, parallelize, plan_for

from dist_harness import spawn, values
from dist_jobs import CASES, PLACEMENTS, job, micro_batches, run_jobs, train

STEPS = 20
TP_JOBS = (
    [job(f"gpt-{p}", tp=2, placement=p, steps=STEPS) for p in PLACEMENTS]
    + [job(f"gpt-sp-{p}", tp=2, sp=True, placement=p, steps=STEPS) for p in PLACEMENTS]
    + [job("llama", tp=2, model="llama", placement="device+host", steps=STEPS),
       job("llama-sp", tp=2, sp=True, model="llama", steps=STEPS),
       job("gpt-meta", tp=2, meta=True, steps=6), job("gpt-clip", tp=2, clip=0.05, steps=6),
       job("gpt-selective", tp=2, sp=True, activations="selective", steps=6),
       job("gpt-staleness1", tp=2, sp=True, staleness=1, steps=6), job("gpt-bf16", tp=2, dtype="bfloat16", steps=6)]

)
FOUR_JOBS = [job("dp2-tp2", zero=3, tp=2, steps=6), job("dp2-tp2-sp", zero=3, tp=2, sp=True, steps=6),
             job("llama-dp2-tp2", zero=3, tp=2, model="llama", placement="device+host", steps=6)]
BY_NAME = {spec["name"]: spec for spec in TP_JOBS + FOUR_JOBS}


def layer_grads(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """One forward and backward of the split model (no engine): the loss, the whole logits and every full
    parameter's gradient, re-assembled from the shards."""
    from angel_ptm.config import load_config
    from angel_ptm.parallel.mesh import init_mesh
    from angel_ptm.parallel.tensor import TPComm, gather_logits, shards_of

    build, _, loss_fn = CASES[spec["model"]]
    mesh = init_mesh(load_config({"parallel": {"tp": world, "sequence_parallel": spec["sp"]}}).parallel)
    model = build()
    comm = TPComm(mesh)
    parallelize(model, comm, plan_for(model))
    batch = micro_batches(spec["model"], 1)[0]
    loss = loss_fn(model, *batch)
    loss.backward()
    shards = shards_of(model)
    grads = {name: (comm.all_gather(p.grad, shards[name].dim, "test") if name in shards else p.grad).tolist()
             for name, p in model.named_parameters()}
    with torch.no_grad():
        out = model(batch[0])
        logits = gather_logits(out if torch.is_tensor(out) else out.logits)
    return {"loss": loss.item(), "grads": grads, "logits": logits.tolist(), "calls": comm.collectives.calls,
            "overlapped": comm.overlapped}


ACTIVATIONS = [{"checkpoint": "none"}, {"checkpoint": "full"}, {"checkpoint": "selective"}, {"offload": "host"},
               {"checkpoint": "full", "offload": "disk"}, {"checkpoint": "selective", "offload": "host"}]


def activation_peaks(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """Per activations setting, one rank's activation peak the trace measures and the most bytes in activation
    pages, beside the estimate's figures (a GQA bf16 GPT unlike the equivalence tests')."""
    import os

    from angel_ptm.config import load_config
    from angel_ptm.activations.source import activation_footprint_of

    out = {}
    for acts in ACTIVATIONS:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=96, seq_len=32, n_layer=3, n_head=4, n_kv_head=2, dim=48))
        job_config = {"memory": {"page_bytes": "16KiB", "disk_dir": os.path.join(tmp, f"acts-{rank}")},
                      "trainer": {"device": "cpu", "dtype": "bfloat16"}, "data": {"batch_size": 6},
                      "parallel": {"tp": world, "sequence_parallel": spec["sp"]},
                      "activations": dict(acts, offload_min_bytes="2KiB")}
        engine = angel_ptm.initialize(model, job_config)
        try:
            tokens = torch.randint(0, 96, (6, 32), generator=torch.Generator().manual_seed(0))
            for _ in range(2):
                loss = engine(tokens, tokens)
                engine.backward(loss)
                engine.step()
            out["+".join(acts.values())] = {
                "measured": engine.scheduler.last_trace.activation_peak, "estimate": engine.estimate.activation_bytes,
                "paged": engine.binder.offload.peak_bytes if engine.binder.offload is not None else 0,
                "paged_estimate": activation_footprint_of(model, load_config(job_config)).paged}
        finally:
            engine.close()
    return out


def whole_state_dicts(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """State dicts at tp 2: the model's (whole tensors, the initial ones equal to the unsplit model's), after two
    steps the model's and AdamW's (rank 0 saves them for the test), and their round trip through a second tp 2
    engine over a scrambled model."""
    import os

    from dist_jobs import config_of

    build, _, loss_fn = CASES[spec["model"]]
    expected = build().state_dict()
    engine = angel_ptm.initialize(build(), config_of(spec, 1, os.path.join(tmp, f"sd-{rank}")))
    try:
        initial = engine.state_dict()
        differ = [k for k in expected if not torch.equal(initial[k], expected[k])]
        for batch in micro_batches(spec["model"], 2):
            engine.backward(loss_fn(engine, *batch))
            engine.step()
        model_sd, optim_sd = engine.state_dict(), engine.optimizer_state_dict()
    finally:
        engine.close()
    if rank == 0:
        torch.save({"model": model_sd, "optimizer": optim_sd}, os.path.join(tmp, "tp2-state.pt"))
    scrambled = build()
    with torch.no_grad():
        for p in scrambled.parameters():
            p.normal_()
    again = angel_ptm.initialize(scrambled, config_of(spec, 1, os.path.join(tmp, f"sd2-{rank}")))
    try:
        again.load_state_dict(model_sd)
        again.load_optimizer_state_dict(optim_sd)
        back, back_optim = again.state_dict(), again.optimizer_state_dict()
    finally:
        again.close()
    return {"initial_differs": differ, "shapes": {k: list(v.shape) for k, v in model_sd.items()},
            "round_trip": all(torch.equal(back[k], model_sd[k]) for k in model_sd) and all(
                torch.equal(back_optim["state"][i][kind], s[kind])
                for i, s in optim_sd["state"].items() for kind in ("exp_avg", "exp_avg_sq")),
            "path": os.path.join(tmp, "tp2-state.pt")}


def dropout_streams(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """A GPT with dropout 0.2 at tp 2, each rank's generator seeded differently after the build: the residual
    dropout's masks (which elements it zeroed) and the block outputs of one training forward, and 3 engine steps
    under each activations setting (recomputation must draw the masks the forward drew)."""
    import os

    from angel_ptm.config import load_config
    from angel_ptm.parallel.mesh import init_mesh

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=96, seq_len=32, n_layer=2, n_head=4, dim=48, dropout=0.2))

    mesh = init_mesh(load_config({"parallel": {"tp": world, "sequence_parallel": spec["sp"]}}).parallel)
    model = build()
    torch.manual_seed(100 + rank)  # parallelize() gives every tp rank tp rank 0's generator
    comm = TPComm(mesh)
    parallelize(model, comm, plan_for(model))
    masks, outputs = [], []
    model.layers[0].resid_dropout.register_forward_hook(lambda m, a, out: masks.append((out == 0).tolist()))
    model.layers[1].register_forward_hook(lambda m, a, out: outputs.append(out.tolist()))
    tokens = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    model(tokens, tokens).backward()
    out = {"masks": masks, "block_output": outputs[0], "forks": comm.random.forks}
    for acts in ("none", "full", "selective", "offload"):
        engine = angel_ptm.initialize(build(), {
            "memory": {"page_bytes": "16KiB", "disk_dir": os.path.join(tmp, f"drop-{acts}-{rank}")},
            "trainer": {"device": "cpu"}, "model": {"dropout": 0.2}, "data": {"batch_size": 4},
            "parallel": {"tp": world, "sequence_parallel": spec["sp"]},
            "activations": {"offload": "host"} if acts == "offload" else {"checkpoint": acts}})
        try:
            torch.manual_seed(5)
            losses = []
            for _ in range(3):
                loss = engine(tokens, tokens)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[acts] = losses
            if acts in ("none", "full"):  # traced (not the dropout-free formula), the vocabulary-parallel loss too
                out[f"peak-{acts}"] = (engine.scheduler.last_trace.activation_peak, engine.estimate.activation_bytes)
        finally:
            engine.close()
    # A HuggingFace Llama split by its plan: its activations traced with the example inputs (one rank's share)
    build_llama, batches, llama_loss = CASES["llama"]
    ids, labels = batches()[0]
    engine = angel_ptm.initialize(build_llama(), {
        "memory": {"page_bytes": "16KiB", "disk_dir": os.path.join(tmp, f"drop-llama-{rank}")},
        "trainer": {"device": "cpu"}, "parallel": {"tp": world, "sequence_parallel": spec["sp"]}},
        example_inputs={"input_ids": ids, "labels": labels})
    try:
        for _ in range(2):
            engine.backward(llama_loss(engine, ids, labels))
            engine.step()
        out["peak-llama"] = (engine.scheduler.last_trace.activation_peak, engine.estimate.activation_bytes)
    finally:
        engine.close()
    return out


class _ResidualInside(nn.Module):
    """An attention-like block (BERT's BertAttention) whose residual is added inside it, after the output
    projection: as an `enter` module its input is used again after the row-parallel exit."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.down(torch.tanh(self.up(x))) + x)


def residual_inside(rank: int, world: int, spec: dict, tmp: str) -> str:
    from angel_ptm.config import load_config
    from angel_ptm.errors import TensorParallelError
    from angel_ptm.parallel.mesh import init_mesh

    mesh = init_mesh(load_config({"parallel": {"tp": world}}).parallel)
    torch.manual_seed(0)
    model = nn.Sequential(_ResidualInside())
    parallelize(model, TPComm(mesh), Plan(styles={"0": ("enter",), "0.up": ("colwise",), "0.down": ("rowwise",)}))
    try:
        model(torch.randn(2, 8)).sum().backward()
    except TensorParallelError as err:
        return str(err)
    return "no error"


SPECIAL = {"layers": layer_grads, "activations": activation_peaks, "state_dicts": whole_state_dicts,
           "dropout": dropout_streams, "residual_inside": residual_inside}


def run_all(rank: int, world: int, specs: list, tmp: str) -> dict:
    out = run_jobs(rank, world, [s for s in specs if s.get("kind") not in SPECIAL], tmp)
    for spec in specs:
        if spec.get("kind") in SPECIAL:
            out[spec["name"]] = SPECIAL[spec["kind"]](rank, world, spec, tmp)
    return out


LAYER_JOBS = [dict(name=f"layers-{m}-{'sp' if sp else 'tp'}", kind="layers", model=m, sp=sp)
              for m in ("gpt", "llama", "qwen2") for sp in (False, True)]  # (qwen2: q, k, v with biases)
LAYER_JOBS += [dict(name="layers-qwen3-tp", kind="layers", model="qwen3", sp=False),  # per-head q/k norms
               dict(name="layers-llama-bias-sp", kind="layers", model="llama-bias", sp=True)]  # row biases
ACTIVATION_JOBS = [dict(name=f"activations-{'sp' if sp else 'tp'}", kind="activations", sp=sp) for sp in (False, True)]
STATE_DICT_JOB = job("state-dicts", kind="state_dicts", tp=2, placement="device+host")
DROPOUT_JOBS = [dict(name=f"dropout-{'sp' if sp else 'tp'}", kind="dropout", sp=sp) for sp in (False, True)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    jobs = list(TP_JOBS) + LAYER_JOBS + ACTIVATION_JOBS + [STATE_DICT_JOB] + DROPOUT_JOBS + [
        dict(name="residual-inside", kind="residual_inside")]
    return values(spawn(2, run_all, (jobs, str(tmp)), tmp))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2-tp2")
    return values(spawn(4, run_jobs, (FOUR_JOBS, str(tmp)), tmp))


def result(results, name):
    for rank, by_job in enumerate(results):
        assert "error" not in by_job[name], f"rank {rank}: {by_job[name]['error']}"
    return results[0][name]


def one_rank(spec, tmp_path, accum=1):
    return train(0, 1, dict(spec, tp=1, sp=False, accum=spec["accum"] * accum), str(tmp_path))


def assert_close(got, expected, rel=1e-5):
    for step, (a, e) in enumerate(zip(got, expected)):
        assert a == pytest.approx(e, rel=rel), f"step {step}: 1 rank {e}, tensor-parallel {a}"
    assert len(got) == len(expected)


@pytest.mark.parametrize("name", [j["name"] for j in LAYER_JOBS])
def test_forward_and_every_full_gradient_equal_the_unsplit_models(two_ranks, name):
    spec = next(j for j in LAYER_JOBS if j["name"] == name)
    build, _, loss_fn = CASES[spec["model"]]
    model = build()
    batch = micro_batches(spec["model"], 1)[0]
    loss = loss_fn(model, *batch)
    loss.backward()
    with torch.no_grad():
        out = model(batch[0])
        logits = out if torch.is_tensor(out) else out.logits
    for rank in (0, 1):
        got = two_ranks[rank][name]
        assert got["loss"] == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(torch.tensor(got["logits"]), logits, rtol=1e-5, atol=1e-5)
        for pname, p in model.named_parameters():
            grad = torch.tensor(got["grads"][pname])
            scale = p.grad.abs().max().item()
            assert (grad - p.grad).abs().max().item() <= 1e-5 * scale, pname
    calls = two_ranks[0][name]["calls"]
    assert calls > 0
    # Megatron's overlap: each region entry's backward collective (attention, feed-forward and output head of
    # every layer) ran while the column-parallel weight gradients were computed (layers.WeightGradStash)
    n_layer = model.config.num_hidden_layers if hasattr(model, "config") else model.cfg.n_layer
    assert two_ranks[0][name]["overlapped"] == 2 * n_layer + 1


@pytest.mark.parametrize("name", [j["name"] for j in TP_JOBS if "save_at" not in j])
def test_tp2_gives_the_one_rank_losses_within_1e_5(two_ranks, name, tmp_path):
    spec = BY_NAME[name]
    got = result(two_ranks, name)
    assert two_ranks[1][name]["losses"] == got["losses"]  # the loss is whole on every tp rank
    # bf16: each rank's partial products are rounded to bf16 before the sum over tp (one rank rounds the sum)
    assert_close(got["losses"], one_rank(spec, tmp_path)["losses"], rel=1e-5 if spec["dtype"] == "float32" else 1e-2)


def test_an_enter_module_using_its_input_after_its_row_parallel_exit_is_refused(two_ranks):
    """A residual added inside the `enter` module, after the exit (a plan putting 'enter' on BERT's attention): the
    input's gradient, all-reduced at the entry, would be summed over the tp ranks (losses 1e-3 off, silently):
    refused at the first forward, on every rank."""
    for rank in range(2):
        assert "('enter') uses its input again after its row-parallel exit" in two_ranks[rank]["residual-inside"]


def test_sequence_parallelism_adds_its_collectives(two_ranks):
    """With sequence parallelism the region's edges are all-gathers and reduce-scatters (and the norms' gradients
    all-reduced): more collectives than the all-reduces alone, the same losses."""
    plain, sp = result(two_ranks, "gpt-device+host"), result(two_ranks, "gpt-sp-device+host")
    assert sp["tp_calls"] > plain["tp_calls"] > 0
    assert_close(sp["losses"], plain["losses"], rel=1e-6)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_each_rank_holds_one_tp_th_of_every_split_tensor(two_ranks, model, tmp_path):
    name = {"gpt": "gpt-device+host", "llama": "llama"}[model]
    whole = one_rank(dict(BY_NAME[name], steps=1), tmp_path)["param_numel"]
    for rank in (0, 1):
        local = two_ranks[rank][name]["param_numel"]
        assert local.keys() == whole.keys()
        split = {n for n in whole if local[n] != whole[n]}
        assert all(local[n] * 2 == whole[n] for n in split)
        replicated = sum(whole[n] for n in whole if n not in split)
        assert replicated < 0.05 * sum(whole.values())  # norms (and nothing else) stay whole
        assert sum(local.values()) == (sum(whole.values()) - replicated) // 2 + replicated


@pytest.mark.parametrize("name", [j["name"] for j in FOUR_JOBS])
def test_dp2_tp2_on_four_ranks_gives_the_one_rank_losses_with_grad_accum_2(four_ranks, name, tmp_path):
    spec = BY_NAME[name]
    got = result(four_ranks, name)
    for rank in range(4):
        assert four_ranks[rank][name]["losses"] == got["losses"]
    assert_close(got["losses"], one_rank(spec, tmp_path, accum=2)["losses"])


@pytest.mark.parametrize("name", [j["name"] for j in DROPOUT_JOBS])
def test_dropout_draws_shared_masks_on_replicated_activations_and_own_masks_on_shards(two_ranks, name):
    """Megatron's model-parallel RNG: without sequence parallelism the residual stream is replicated, so every tp
    rank draws the same residual-dropout mask and the block outputs stay equal on both ranks (although their
    generators were seeded differently); with it, the residual stream is sequence shards and each rank draws its
    own mask. Recomputation and offload draw what the forward drew: the same losses, bitwise."""
    result(two_ranks, name)
    got = [by_job[name] for by_job in two_ranks]
    assert got[0]["forks"] > 0 and got[1]["forks"] == got[0]["forks"]
    same_masks = got[0]["masks"] == got[1]["masks"]
    if name.endswith("-tp"):
        assert same_masks
        assert got[0]["block_output"] == got[1]["block_output"]
    else:
        assert not same_masks
    for rank in (0, 1):
        runs = got[rank]
        assert runs["none"] == runs["full"] == runs["selective"] == runs["offload"], runs
        assert runs["none"] == got[0]["none"]  # the loss is the same on both tp ranks
        for key in ("peak-none", "peak-full", "peak-llama"):  # one rank's activations, traced, against the trace
            measured, estimate = runs[key]
            assert estimate is not None and abs(estimate - measured) <= 0.1 * measured, (key, measured, estimate)


@pytest.mark.parametrize("name", [j["name"] for j in ACTIVATION_JOBS])
def test_the_activation_estimate_of_one_tp_rank_matches_its_trace(two_ranks, name):
    """models.gpt.activation_footprint with tp (and sequence parallelism): each rank's device-side activation peak
    and its most bytes in activation pages within 10% of the estimate, for every activations setting, and below
    the 1-rank estimate."""
    from angel_ptm.models.gpt import activation_footprint

    whole = activation_footprint(GPTConfig(vocab_size=96, seq_len=32, n_layer=3, n_head=4, n_kv_head=2, dim=48), 6,
                                 2).device
    for rank in (0, 1):
        for setting, got in two_ranks[rank][name].items():
            small = 4096 if "host" in setting or "disk" in setting else 0  # offload: only tensors below 2 KiB stay
            assert got["measured"] == pytest.approx(got["estimate"], rel=0.10, abs=small), setting
            assert got["paged"] == pytest.approx(got["paged_estimate"], rel=0.10), setting
            assert (got["paged"] > 0) == ("host" in setting or "disk" in setting), setting
        assert two_ranks[rank][name]["none"]["measured"] < 0.75 * whole


def test_a_tp2_checkpoint_resumes_at_tp1_and_the_reverse(tmp_path):
    """Checkpoints hold full tensors (a shard's boxes at its place in the full tensor; row-parallel weights split
    along their input features): tp 2 saved, tp 1 resumed, and tp 1 saved, tp 2 resumed, each continue as the run
    that saved them within 1e-6 relative."""
    base = dict(job("ckpt", tp=1, steps=6, placement="device+host"), save_at=3)
    one = train(0, 1, dict(base, save_to=str(tmp_path / "tp1")), str(tmp_path))
    specs = [dict(base, name="save", tp=2, save_to=str(tmp_path / "tp2")),
             dict(base, name="load", tp=2, save_at=None, load=str(tmp_path / "tp1"))]
    two = values(spawn(2, run_jobs, (specs, str(tmp_path)), tmp_path))
    saved, loaded = result(two, "save"), result(two, "load")
    assert_close(saved["losses"], one["losses"])
    assert_close(loaded["losses"], one["losses"][3:], rel=1e-6)  # tp 1's state, trained on at tp 2
    resumed = train(0, 1, dict(base, name="resumed", save_at=None, load=str(tmp_path / "tp2")), str(tmp_path))
    assert_close(resumed["losses"], saved["losses"][3:], rel=1e-6)  # tp 2's state, trained on at tp 1


def test_state_dicts_at_tp2_hold_whole_tensors_that_load_at_tp1_and_round_trip(two_ranks, tmp_path):
    """engine.state_dict() and optimizer_state_dict() at tp 2 give whole tensors (gathered over the tp group): the
    initial ones are the unsplit model's, both ranks agree, they load back into a tp 2 engine bit for bit, and a
    tp 1 engine takes them as plain PyTorch does (and gives them back unchanged)."""
    from test_engine_equivalence import engine_config

    got = result(two_ranks, "state-dicts")
    assert got["initial_differs"] == [] and got["round_trip"] is True
    assert two_ranks[1]["state-dicts"]["shapes"] == got["shapes"]
    build = CASES["gpt"][0]
    assert got["shapes"] == {k: list(v.shape) for k, v in build().state_dict().items()}  # whole, not shards
    saved = torch.load(got["path"])
    engine = angel_ptm.initialize(build(), engine_config({"page_bytes": "4KiB", "disk_dir": str(tmp_path)}))
    try:
        engine.load_state_dict(saved["model"])
        engine.load_optimizer_state_dict(saved["optimizer"])
        back = engine.state_dict()
        assert all(torch.equal(back[k], v) for k, v in saved["model"].items())
        moments = engine.optimizer_state_dict()["state"]
        assert all(torch.equal(moments[i][kind], s[kind]) for i, s in saved["optimizer"]["state"].items()
                   for kind in ("exp_avg", "exp_avg_sq"))
    finally:
        engine.close()
    plain = build()  # and torch itself takes the model's
    plain.load_state_dict(saved["model"])
