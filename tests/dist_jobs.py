"""Jobs the multi-process tests run in each rank (tests/dist_harness.py spawns them): the same models, micro-batches
and optimizer as tests/test_engine_equivalence.py, with micro-batches dealt over ranks as the trainer deals them."""

from __future__ import annotations

import functools
import hashlib
import os
import time

import torch

import angel_ptm
from angel_ptm.models.moe import moe_metrics
from angel_ptm.parallel import collectives as collectives_module
from torch import nn

from branchy_models import UNITS, BranchyBlocks, BranchyNested
from hf_cases import hf_llama_bias_tp, hf_llama_tp, hf_qwen2_tp, hf_qwen3_tp
from test_engine_equivalence import CASES, engine_config, mlp_loss


class Branchy(nn.Module):
    """A branch taken only for micro-batches whose mean is positive (an expert routed or not): ranks disagree on
    which tensors get a gradient, so one rank's gradient groups are final during backward and the other's only
    after the agreement."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.expert, self.out = nn.Linear(24, 48), nn.Linear(48, 48), nn.Linear(48, 24)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        if x.mean() > 0:
            h = h + self.expert(h)
        return self.out(h)


def branchy_batches():
    """Micro-batch i takes the branch for i in (0, 3, 4): in steps 0-2 of 2 ranks exactly one rank does, in step 3
    neither (the expert gets no gradient anywhere)."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 24, generator=g).abs() * (1.0 if i in (0, 3, 4) else -1.0),) for i in range(8)]


class Normed(nn.Sequential):
    """An MLP with BatchNorm: its running statistics are buffers each rank updates with its own micro-batches."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Linear(24, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1))


def llama_loss(model, input_ids, labels):
    return model(input_ids, labels=labels).loss


def llama_batches():
    from conformance_cases import next_tokens

    return next_tokens()


def gpt_moe():
    """A GPT-MoE: 4 experts in every block, top-2 by k-top-1 (deterministic, so ranks and one rank route alike)
    with drops (capacity 0.5 of the even share)."""
    from angel_ptm.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32,
                         moe={"experts": 4, "top_k": 2, "gate": "ktop1", "capacity_factor": 0.5}))


def gpt_moe_batches():
    g = torch.Generator().manual_seed(2)
    weights = torch.tensor([0.8 ** i for i in range(64)])  # skewed: some experts get no token in some steps
    return [(torch.multinomial(weights, 64, True, generator=g).view(4, 16), torch.randint(0, 64, (4, 16), generator=g))
            for _ in range(8)]


def gpt_moe_hash():
    """A GPT-MoE whose hash gate sends token id t to expert t mod 8 (Knuth's multiplier is 1 mod 8), dropless."""
    from angel_ptm.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32,
                         moe={"experts": 8, "gate": "hash", "capacity_factor": 0.0}))


def gpt_moe_hash_batches():
    """Global micro-batch g holds ids of two residues mod 8, {g, g + 1}: on 4 ranks with ep 2, the two ranks that
    hold the same experts route to different ones (some experts get tokens on one holder only) and three experts
    get none anywhere in a step."""
    g = torch.Generator().manual_seed(3)
    return [((torch.randint(0, 8, (4, 16), generator=g) * 8 + (i + torch.randint(0, 2, (4, 16), generator=g)) % 8),
             torch.randint(0, 64, (4, 16), generator=g)) for i in range(16)]


# a copy: other modules parametrize over theirs
CASES = {**CASES, "branchy": (Branchy, branchy_batches, mlp_loss),
         "branchy-blocks": (BranchyBlocks, branchy_batches, mlp_loss),
         "branchy-nested": (BranchyNested, branchy_batches, mlp_loss), "normed": (Normed, CASES["mlp"][1], mlp_loss), "llama": (hf_llama_tp, llama_batches, llama_loss),
         "qwen2": (hf_qwen2_tp, llama_batches, llama_loss), "qwen3": (hf_qwen3_tp, llama_batches, llama_loss),
         "llama-bias": (hf_llama_bias_tp, llama_batches, llama_loss),
         "gpt-moe": (gpt_moe, gpt_moe_batches, CASES["gpt"][2]),
         "gpt-moe-hash": (gpt_moe_hash, gpt_moe_hash_batches, CASES["gpt"][2])}

STEPS = 4
# Per-rank budgets of 4 KiB pages. The GPT's paging unit (a block with the root's pages) takes 21 pages; ZeRO-3
# gathers up to 13 groups of 2 pages; states per rank are about 100 pages (gradients are whole on every rank).
PLACEMENTS = {
    "device": {"page_bytes": "4KiB", "device_budget": "4MiB", "host_budget": "1MiB"},
    "device+host": {"page_bytes": "4KiB", "device_budget": "128KiB", "host_budget": "4MiB"},
    "device+host+disk": {"page_bytes": "4KiB", "device_budget": "128KiB", "host_budget": "96KiB"},
}


def job(name, zero=3, placement="device+host+disk", scheduler="planned", clip=None, staleness=0,
        dtype="float32", model="gpt", accum=1, steps=STEPS, **extra):
    return dict(name=name, zero=zero, placement=placement, scheduler=scheduler, clip=clip, staleness=staleness,
                dtype=dtype, model=model, accum=accum, steps=steps, **extra)


def micro_batches(case: str, count: int):
    """`count` micro-batches of the case's data (the equivalence tests' generators, repeated as needed)."""
    _, data, _ = CASES[case]
    batches = data()
    return [batches[i % len(batches)] for i in range(count)]


def config_of(spec: dict, world: int, disk_dir: str) -> dict:
    memory = dict(PLACEMENTS[spec["placement"]], disk_dir=disk_dir, scheduler=spec["scheduler"])
    if spec.get("page_bytes"):
        memory["page_bytes"] = spec["page_bytes"]
    memory.update(spec.get("memory", {}))
    cfg = engine_config(memory, spec["clip"], dtype=spec["dtype"], staleness=spec["staleness"])
    cfg["trainer"]["grad_accum"] = spec["accum"]
    cfg["parallel"] = {"zero": spec["zero"], "timeout_s": spec.get("timeout_s", 60), "osdp": spec.get("osdp", False),
                       "tp": spec.get("tp", 1), "sequence_parallel": spec.get("sp", False), "ep": spec.get("ep", 1),
                       # (a reference run of one ep rank has no all-to-all to make hierarchical)
                       "moe_a2a": spec.get("moe_a2a", "flat") if spec.get("ep", 1) > 1 else "flat",
                       "moe_rebalance_every": spec.get("rebalance", 0),
                       "moe_rebalance_threshold": spec.get("rebalance_threshold", 1.25),
                       "moe_replicas": spec.get("replicas", 0)}
    cfg["optimizer"].update(spec.get("optimizer", {}))
    if spec.get("batch_size"):  # our GPT's micro-batch, for the estimate's activations (traced at data.batch_size)
        cfg.setdefault("data", {})["batch_size"] = spec["batch_size"]
    if spec.get("activations"):  # a checkpoint setting or a whole activations section
        act = spec["activations"]
        cfg["activations"] = {"checkpoint": act} if isinstance(act, str) else act
    return cfg


def one_thread(fn):
    """Run with one intra-op thread, as the spawned ranks do (dist_harness): an in-process reference run compared
    bitwise with them must sum in the same order, which a matrix product with another thread count may not (seen
    on a 16-core machine: the last bit of a loss)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapped


@one_thread
def train(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """Train `spec` on this rank: step s, micro-batch m takes global micro-batch s*world*accum + rank*accum + m
    (what 1 rank with grad_accum world*accum takes in step s). The logged loss is the mean over ranks and
    micro-batches."""
    build, _, loss_fn = CASES[spec["model"]]
    if spec.get("meta"):  # built on the meta device: materialized into the pages
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build()
    else:
        model = build()
    tp = spec.get("tp", 1)
    rank, world = rank // tp, world // tp  # tensor-parallel peers take the same micro-batches
    accum, steps = spec["accum"], spec["steps"]
    batches = micro_batches(spec["model"], steps * world * accum)
    disk_dir = os.path.join(tmp, f"{spec['name']}-w{world}")
    # pairwise False: gloo's own collectives, reductions on a process group of their own (NCCL's way)
    collectives_module.PAIRWISE_ON_GLOO = spec.get("pairwise", True)
    try:
        units = {"units": UNITS[spec["units"]]} if spec.get("units") else {}
        engine = angel_ptm.initialize(model, config_of(spec, world, disk_dir), **units)
    finally:
        collectives_module.PAIRWISE_ON_GLOO = True
    if spec.get("rebalance_pays"):  # the cost model told that moving pays (timings would make the test flaky)
        engine.rebalancer._measured = lambda: (1.0, 1e12)
    if spec.get("hot_expert") is not None:  # the router's counts skewed: that expert looks hot (to place replicas)
        for _, layer in engine.rebalancer.layers:
            def skewed(take=layer.take_load_counts, hot=spec["hot_expert"]):
                counts = take()
                counts[hot] += 10 * counts.sum()
                return counts
            layer.take_load_counts = skewed
    losses, skipped, scales, routed = [], [], [], []
    eager = 0  # page groups updated during the last backward of a step (reduced there first with >1 rank)
    live_expert_grads = 0
    cancelled = deviations = 0  # planned fetches of experts that got no token, cancelled; the plan's deviations
    try:
        pages = {kind: sum(1 for p in ps if p is not None and p.home is None) for kind, ps in engine.pages.items()}
        start = 0
        if spec.get("load"):  # a checkpoint (any rank count, page size): training goes on from its step
            start = engine.load_checkpoint(spec["load"])["step"]
        for step in range(start, steps):
            total = 0.0
            for m in range(accum):
                batch = batches[step * world * accum + rank * accum + m]
                loss = loss_fn(engine, *batch)
                if tuple(spec.get("overflow_at") or ()) == (step, rank):  # this rank's gradients overflow (fp16)
                    loss = loss * float("inf")
                engine.backward(loss / accum)
                total += loss.item()
            eager += engine.optimizer.updated_this_step
            if engine.layout.local_pages is not None:  # expert gradient pages holding data after the last backward
                first, end = engine.layout.local_pages
                live_expert_grads = max(live_expert_grads, sum(not engine.pages["grad"][i].dead
                                                               for i in range(first, end)))
            if spec.get("drop_at") == step:  # this step's gradients are thrown away: zero_grad, no update
                engine.zero_grad()
                losses.append(engine.mean_over_ranks(total / accum))
                skipped.append(True)
                scales.append(engine.loss_scale)
                continue
            if spec["clip"]:
                engine.clip_grad_norm(spec["clip"])
            if spec.get("eval_before_step"):  # an evaluation forward between backward and step: eval mode at step
                engine.model.eval()
                with torch.no_grad():
                    loss_fn(engine, *batches[rank])
            engine.step()
            engine.model.train()
            schedule = engine.memory_stats()["schedule"]
            cancelled += schedule.get("optional_cancelled", 0)
            deviations += schedule.get("deviations", 0)
            losses.append(engine.mean_over_ranks(total / accum))
            if spec.get("routing"):  # the step's routing, every rank's tokens (the trainer's metrics `moe`)
                routed.append(moe_metrics(model, engine.sum_over_ranks))
            skipped.append(engine.last_step_skipped)
            scales.append(engine.loss_scale)
            if spec.get("save_at") == step + 1:  # background: written while the next steps train
                engine.save_checkpoint(spec["save_to"], extra={"step": step + 1}, background=spec.get("background"))
        engine.wait_for_checkpoint()
        engine.flush()
        with torch.no_grad():  # each rank's own forward after the flush (staleness 1: the last update everywhere)
            after = loss_fn(engine, *batches[0]).item() if spec["staleness"] else None
        stats = engine.memory_stats()
        gatherer = engine.data_parallel.gatherer
        states: dict = {}
        if spec.get("final_states"):  # every kind of every tensor (collective reads), as digests
            kinds = [k for k in ("param", "master", "exp_avg", "exp_avg_sq") if k in engine.pages]
            states["final"] = digests({f"{k}.{engine.expert_names.get(s.name, s.name)}": engine.state(k, s.name)
                                       for s in engine.layout.slots for k in kinds})  # experts by their own index
        if spec.get("state_dicts"):  # collective reads of sharded pages; digests keep the result small
            states |= {"model": digests(engine.state_dict()),
                      "optimizer": digests({f"{i}.{k}": v for i, s in engine.optimizer_state_dict()["state"].items()
                                            for k, v in s.items()})}
        return {"losses": losses, "after": after, "routed": routed, "skipped": skipped, "scales": scales, "pages": pages, "moved": stats["moved"],
                "gathers": gatherer.gathers if gatherer is not None else 0, "states": states,
                "comm_bytes": engine.collectives.bytes_sent if engine.collectives is not None else 0,
                "eager_updates": eager,
                "activation_pages": len(engine.binder.offload.pages) if engine.binder.offload is not None else 0,
                "osdp": stats.get("osdp_replicated", {}),
                "param_numel": {s.name: s.numel for s in engine.layout.slots},
                "tp_calls": engine.tp.collectives.calls if engine.tp is not None else 0,
                "osdp_allowed": engine.estimate.osdp_groups,
                "overlapped": getattr(getattr(engine.data_parallel, "sync", None), "overlapped", 0),
                "expert_overlapped": stats.get("expert_reductions_in_backward", 0),
                "live_expert_grads": live_expert_grads,
                "activations": (engine.scheduler.last_trace.activation_peak if engine.scheduler.last_trace else 0,
                                engine.estimate.activation_bytes),
                "rebalances": engine.rebalancer.decisions if engine.rebalancer is not None else [],
                "expert_names": dict(engine.expert_names), "cancelled": cancelled, "deviations": deviations,
                "local_pages": engine.layout.local_pages}
    finally:
        engine.close()


def digests(tensors: dict) -> dict:
    return {name: hashlib.sha256(torch.as_tensor(t).detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                                 .tobytes()).hexdigest()[:16]
            for name, t in tensors.items()}


def run_jobs(rank: int, world: int, specs: list, tmp: str) -> dict:
    """Every job in turn in one process group; per job its result or its error."""
    out = {}
    for spec in specs:
        t0 = time.perf_counter()
        try:
            out[spec["name"]] = train(rank, world, spec, tmp)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            out[spec["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
        out[spec["name"]]["seconds"] = time.perf_counter() - t0
    return out


def die_mid_step(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """Rank 1 dies (os._exit) after the forward of step 1, before its collectives (or first hangs for
    spec['hang'] seconds); the others must raise."""
    build, _, loss_fn = CASES[spec["model"]]
    engine = angel_ptm.initialize(build(), config_of(spec, world, os.path.join(tmp, "die")))
    batches = micro_batches(spec["model"], 4 * world)
    t0 = time.perf_counter()
    for step in range(3):
        loss = loss_fn(engine, *batches[step * world + rank])
        if step == 1 and rank == 1:
            if spec.get("hang"):  # hung for that many seconds (longer than parallel.timeout_s), then gone
                time.sleep(spec["hang"])
            os._exit(3)
        t0 = time.perf_counter()
        engine.backward(loss)
        engine.step()
    return {"seconds": time.perf_counter() - t0}


def start_with(rank: int, world: int, spec: dict, tmp: str) -> str:
    """Initialize with a per-rank config change (spec['rank_overrides'][rank]); returns 'started' or raises."""
    build, _, _ = CASES[spec["model"]]
    cfg = config_of(spec, world, os.path.join(tmp, "mismatch"))
    for section, values in spec.get("rank_overrides", {}).get(str(rank), {}).items():
        cfg[section].update(values)
    engine = angel_ptm.initialize(build(), cfg)
    engine.close()
    return "started"


@one_thread
def resume(rank: int, world: int, spec: dict, tmp: str) -> list:
    """Train `spec`'s steps, take model.state_dict() and AdamW's state dict (collective reads), load them into a
    fresh engine over a differently initialized model (writes of each rank's own pages), and train as many steps
    more on the next micro-batches (dealt as `train` deals them); the losses of the second engine."""
    build, _, loss_fn = CASES[spec["model"]]
    steps, accum = spec["steps"], spec["accum"]
    batches = micro_batches(spec["model"], 2 * steps * world * accum)

    def step(engine, s):
        total = 0.0
        for m in range(accum):
            loss = loss_fn(engine, *batches[(s * world + rank) * accum + m])
            engine.backward(loss / accum)
            total += loss.item()
        engine.step()
        return engine.mean_over_ranks(total / accum)

    first = angel_ptm.initialize(build(), config_of(spec, world, os.path.join(tmp, f"resume-a-w{world}")))
    try:
        for s in range(steps):
            step(first, s)
        model_state, optimizer_state = first.state_dict(), first.optimizer_state_dict()
    finally:
        first.close()
    torch.manual_seed(123)  # a model that starts elsewhere: everything it trains from comes from the state dicts
    fresh = build()
    for p in fresh.parameters():
        p.data.normal_()
    second = angel_ptm.initialize(fresh, config_of(spec, world, os.path.join(tmp, f"resume-b-w{world}")))
    try:
        second.load_state_dict(model_state)
        second.load_optimizer_state_dict(optimizer_state)
        losses = [step(second, s) for s in range(steps, 2 * steps)]
        if not spec.get("keys"):
            return losses
        return {"losses": losses, "keys": list(model_state), "numbered": len(optimizer_state["state"]),
                "experts": digests({k: v for k, v in model_state.items() if ".experts." in k})}
    finally:
        second.close()


def rank_local_failures(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """On one process group, in order: (1) rank 1's forward raises before the step issued any collective (ZeRO-2
    forwards issue none): it retries and every rank trains on alike; (2) engines dropped without close() leave no
    waiter thread; (3) rank 1's backward raises late, after its reductions began: both ranks end with typed
    errors (no gloo abort), and a later engine on the same process group is refused on both."""
    import gc
    import threading

    from angel_ptm.parallel.collectives import issued_count

    build, _, loss_fn = CASES[spec["model"]]
    batches = micro_batches(spec["model"], 3 * world)
    out: dict = {}
    engine = angel_ptm.initialize(build(), config_of(spec, world, os.path.join(tmp, "recover")))
    failed_once = []

    def fail_first_forward(module, args):
        if rank == 1 and not failed_once:
            failed_once.append(issued_count())
            raise RuntimeError("rank-local failure in forward")

    hook = engine.model.register_forward_pre_hook(fail_first_forward)
    for step in range(2):
        batch = batches[step * world + rank]
        try:
            loss = loss_fn(engine, *batch)
        except RuntimeError:
            loss = loss_fn(engine, *batch)
        engine.backward(loss)
        engine.step()
    hook.remove()
    # a save while one rank still holds a training forward's output: refused on every rank at once, not only there
    held = loss_fn(engine, *batches[rank]) if rank == 0 else None
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(os.path.join(tmp, "held"))
        out["held_save"] = "saved"
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        out["held_save"] = f"{type(exc).__name__}: {exc}"
    out["held_save_s"] = time.monotonic() - t0
    del held
    engine.save_checkpoint(os.path.join(tmp, "held"))  # the output dropped: the same save goes through
    model = engine.model
    engine.close()
    out["retried"] = bool(failed_once)
    out["recovered_digest"] = digests(model.state_dict())
    del engine, model
    for i in range(2):
        dropped = angel_ptm.initialize(build(), config_of(spec, world, os.path.join(tmp, f"dropped{i}")))
        dropped.backward(loss_fn(dropped, *batches[rank]))
        dropped.step()
        del dropped
    gc.collect()
    # a dropped engine's waiter is told to stop when it is collected, and ends once it next runs (a loaded machine
    # may take a moment to schedule it)
    deadline = time.monotonic() + 10
    while True:
        out["waiters_left"] = [t.name for t in threading.enumerate() if t.name.startswith("angel-ptm-reductions")]
        if not out["waiters_left"] or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    engine = angel_ptm.initialize(build(), config_of(spec, world, os.path.join(tmp, "fatal")))
    model = engine.model
    first = next(module for module in model.modules() if isinstance(module, nn.Linear))

    def fail_late(module, args, output):  # the first layer's gradient comes last in backward
        def boom(grad):
            raise RuntimeError("rank-local failure in backward")
        output.register_hook(boom)

    handle = first.register_forward_hook(fail_late) if rank == 1 else None
    try:
        for step in range(2):
            engine.backward(loss_fn(engine, *batches[step * world + rank]))
            engine.step()
        out["fatal_step"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        out["fatal_step"] = f"{type(exc).__name__}: {exc}"
    if handle is not None:
        handle.remove()
    try:
        loss_fn(engine, *batches[rank])
        out["after"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["after"] = f"{type(exc).__name__}"
    engine.close()
    try:
        angel_ptm.initialize(build(), config_of(spec, world, os.path.join(tmp, "again")))
        out["new_engine"] = "started"
    except Exception as exc:  # noqa: BLE001
        out["new_engine"] = f"{type(exc).__name__}: {exc}"
    return out
