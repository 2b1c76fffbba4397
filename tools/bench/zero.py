"""ZeRO benchmark: a data-parallel GPT whose sharded states live mostly on disk, against PyTorch FSDP2.

    python -m tools.bench.zero --nproc 2 --dir DIR [--zero 3] [--dim 384] [--layers 4] [--batch 4] [--seq 64]
                               [--page-kib 512] [--device-frac 0.25] [--host-frac 0.25] [--steps 5] [--warmup 2]
                               [--osdp]

N ranks over gloo (NCCL on GPUs), each its own process, as torchrun starts them. Per rank, interleaved step by step
so all see the same machine, the median step time after `--warmup` steps of:
  (a) compute only:   the same model, plain torch forward, backward and torch.optim.AdamW on this rank's batch;
  (b) communication:  the collectives one scheduled step issued (all-gathers of parameter groups, the gradient
                      reduction, the agreements), replayed on page-sized buffers with no compute;
  (c) I/O only:       the scheduled step's page accesses of this rank's own pages replayed with no compute (the
                      same moves between device, host and disk);
  (d) scheduled:      the engine, ZeRO stage `--zero`, states mostly on disk, memory.scheduler planned;
  (e) FSDP2:          `fully_shard` on every block and the root with CPUOffloadPolicy (pin_memory on GPUs only),
                      torch.optim.AdamW, the same model and batch.
The last line is one JSON object: the medians (rank 0's; the maximum over ranks is `*_max_s`), `overlap` =
max(a, b, c) / d (goal >= 0.85), `ratio_vs_fsdp2` = e / d (goal >= 1.0), per-rank state bytes against one rank's
(the estimate of the same job at world 1), and the collective bytes per step measured against the estimate.
`cpu_s`: the CPU seconds per step of each phase in a rank's process, all its threads (compute, gloo's, the SSD
engine's): with `cores_per_rank` cores, no schedule makes a step shorter than its CPU seconds / cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from tools.bench.overlap import replay_step

STATE_KINDS = 4


def make_model(args):
    from angel_ptm.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads, dim=args.dim))


def engine_config(args, device_budget, host_budget, disk_dir):
    return {"optimizer": {"lr": 1e-4, "weight_decay": 0.1},
            "memory": {"page_bytes": args.page_kib << 10, "device_budget": device_budget,
                       "host_budget": host_budget, "disk_dir": disk_dir, "scheduler": "planned",
                       "io_threads": args.io_threads},
            "trainer": {"device": args.device, "grad_clip": 0},
            "parallel": {"zero": args.zero, "timeout_s": 300, "osdp": args.osdp}}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CPU_SECONDS: dict[str, list[float]] = {}  # phase -> CPU seconds this process (every thread) spent in each run


def timed(fn, name: str = "") -> float:
    """Wall seconds of fn(), every rank starting it together (a barrier first: a rank that finished the phase before
    sooner would otherwise count the wait for the others inside this one); the CPU seconds of the whole process
    (compute, gloo's and the SSD engine's threads) go to CPU_SECONDS[name]."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    CPU_SECONDS.setdefault(name, []).append(time.process_time() - c0)
    return seconds


def engine_step(engine, x, y):
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    sync(engine.device)


def replay_own_pages(engine, trace):
    """The scheduled step's accesses of this rank's own pages, acquired and released in order, no compute
    (ZeRO-3: the collectives are (b)'s)."""
    if engine.data_parallel.gatherer is not None:  # ZeRO-3: no gathered copies, the device is this rank's alone
        engine.data_parallel.gatherer.drop_all()
    replay_step(engine, trace)


class CommReplay:
    """The collectives of one scheduled step on scratch buffers: `gathers` all-gathers of one page per rank, one
    reduction per gradient page group, and the step's three small agreements."""

    def __init__(self, engine, gathers: int):
        from angel_ptm.parallel.collectives import MAX

        self.comm, self.gathers, self.max = engine.collectives, gathers, MAX
        self.stage, dp, page_bytes = engine.ownership.stage, engine.mesh.dp, engine.layout.page_bytes
        device = engine.mesh.comm_device
        self.groups = engine.layout.trainable_pages // dp
        self.page = torch.zeros(page_bytes // 4, device=device)
        self.pages = [torch.zeros_like(self.page) for _ in range(dp)]
        self.slots = torch.zeros(len(engine.layout.slots))
        self.publish = self.stage in (1, 2)

    def __call__(self):
        comm = self.comm
        for _ in range(self.gathers):
            comm.all_gather(self.pages, self.page, "replay")
        comm.all_reduce(self.slots, "replay", op=self.max)
        comm.all_reduce(torch.zeros(1), "replay", op=self.max)
        for _ in range(self.groups):
            if self.stage <= 1:
                for page in self.pages:
                    comm.all_reduce(page, "replay")
            else:
                comm.reduce_scatter(self.page, self.pages, "replay")
        if self.stage:
            comm.all_reduce(torch.zeros(self.groups * len(self.pages), dtype=torch.float64), "replay")
        for _ in range(self.groups if self.publish else 0):
            comm.all_gather(self.pages, self.page, "replay")


def make_fsdp2(args, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = make_model(args)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.layers:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def plain_step(model, opt, x, y, device):
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sync(device)


def worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import angel_ptm
    from angel_ptm.estimate import estimate_job
    from angel_ptm.parallel import Ownership

    device = torch.device(args.device if args.device != "cuda" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The process group made here, as a torchrun script would (the engine uses it): a world of one too, so the
    # collectives FSDP2 runs exist there (NCCL's path with one GPU)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    page_bytes = args.page_kib << 10
    n_params = sum(p.numel() for p in make_model(args).parameters())
    states = STATE_KINDS * n_params * 4 // world  # this rank's share, roughly (gradients are whole: see the note)
    work = os.path.join(args.dir, f"zero-bench-{port}")
    # The shares asked for, raised to what the job needs at least (the estimate's figures: a unit's pages, ZeRO-3's
    # gathered groups, the host staging a unit up from disk), so a small model still runs.
    device_budget, host_budget = int(args.device_frac * states), int(args.host_frac * states)
    needs = estimate_job(engine_config(args, device_budget, host_budget, work), make_model(args), device=device,
                         ownership=Ownership(rank, world, args.zero), local_world_size=world).tiers
    device_budget, host_budget = max(device_budget, needs["device"].needed), max(host_budget, needs["host"].needed)
    g = torch.Generator().manual_seed(1 + rank)  # every rank its own micro-batches
    data = [(torch.randint(0, 256, (args.batch, args.seq), generator=g).to(device),
             torch.randint(0, 256, (args.batch, args.seq), generator=g).to(device))
            for _ in range(args.warmup + args.steps)]
    scheduled = angel_ptm.initialize(make_model(args), engine_config(args, device_budget, host_budget,
                                                                      os.path.join(work, "scheduled")))
    io = angel_ptm.initialize(make_model(args), engine_config(args, device_budget, host_budget,
                                                               os.path.join(work, "io")))
    plain = make_model(args).to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1)
    fsdp, fsdp_opt = make_fsdp2(args, device)
    times = {name: [] for name in ("compute", "comm", "io", "scheduled", "fsdp2")}
    comm_bytes, gathers = [], []
    try:
        x0, y0 = data[0]
        engine_step(io, x0, y0)  # records the trace and plans
        trace = io.scheduler.plan.trace
        engine_step(scheduled, x0, y0)
        replay = None
        for i, (x, y) in enumerate(data):
            comm = scheduled.collectives  # None: a world of one (nothing to communicate)
            sent, gathered = comm.bytes_sent if comm else 0, scheduled.data_parallel.gatherer
            before = gathered.gathers if gathered is not None else 0
            steps = {
                "scheduled": lambda: engine_step(scheduled, x, y),
                "io": lambda: replay_own_pages(io, trace),
                "compute": lambda: plain_step(plain, plain_opt, x, y, device),
                "fsdp2": lambda: plain_step(fsdp, fsdp_opt, x, y, device),
            }
            seconds = {name: timed(fn, name) for name, fn in (steps.items() if i % 2 == 0 else reversed(steps.items()))}
            gathers.append((gathered.gathers - before) if gathered is not None else 0)
            comm_bytes.append((comm.bytes_sent if comm else 0) - sent)
            if replay is None:
                replay = CommReplay(scheduled, gathers[-1]) if comm else (lambda: None)
            seconds["comm"] = timed(replay, "comm")
            if i >= args.warmup:
                for name, s in seconds.items():
                    times[name].append(s)
        own_bytes = sum(1 for p in scheduled.manager.pages if p.home is None) * page_bytes
        stats = {k: v for k, v in scheduled.memory_stats().items() if k in ("reductions_in_backward",
                                                                              "osdp_replicated")}
        estimate = scheduled.estimate
        alone = estimate_job(scheduled.config, make_model(args), device=device)
    finally:
        for engine in (scheduled, io):
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "rank": rank, "med": med, "states_bytes": own_bytes, "one_rank_states_bytes": alone.states_bytes,
        "estimate_states_bytes": estimate.states_bytes, "comm_bytes": statistics.median(comm_bytes),
        "estimate_comm_bytes": sum(estimate.collective_bytes.values()), "gathers": statistics.median(gathers),
        "kind_bytes": estimate.kind_bytes, "one_rank_kind_bytes": alone.kind_bytes, "params": n_params,
        "device_budget": device_budget, "host_budget": host_budget,
        "collectives": stats,
        "cpu": {name: statistics.median(v[args.warmup:]) for name, v in CPU_SECONDS.items()},
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter teardown: about one run in eight, a rank aborted at exit ("terminate called without
    # an active exception", a native thread still joinable during finalization) after its work and results were
    # done, which made the whole benchmark fail. Everything this rank owned is closed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", required=True, help="where the page files go (an SSD)")
    parser.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--page-kib", type=int, default=512)
    parser.add_argument("--device-frac", type=float, default=0.25, help="share of a rank's states on the device")
    parser.add_argument("--host-frac", type=float, default=0.25, help="share of a rank's states on the host")
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--osdp", action="store_true", help="parallel.osdp: keep exposed groups replicated")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    say = (lambda *a: None) if args.json else print
    os.makedirs(args.dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(prefix="zero-bench-", suffix=".json", dir=args.dir)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args.nproc, port, args, out)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs) or not os.path.exists(out):
        raise SystemExit(f"zero bench: a rank failed (exit codes {[p.exitcode for p in procs]})")
    with open(out) as f:
        ranks = json.load(f)
    os.unlink(out)
    first = ranks[0]
    med = first["med"]
    for r in ranks:
        say(f"rank {r['rank']}: " + " ".join(f"{k} {v:.3f}s" for k, v in r["med"].items()))
    slowest = {name: max(r["med"][name] for r in ranks) for name in med}
    sharded = ("exp_avg", "exp_avg_sq") + (("param",) if args.zero == 3 else ())
    report = {
        "nproc": args.nproc, "zero": args.zero, "device": args.device, "params": first["params"],
        "device_budget": first["device_budget"], "host_budget": first["host_budget"],
        "compute_s": round(med["compute"], 4), "comm_s": round(med["comm"], 4), "io_s": round(med["io"], 4),
        "scheduled_s": round(med["scheduled"], 4), "fsdp2_s": round(med["fsdp2"], 4),
        "scheduled_max_s": round(slowest["scheduled"], 4), "fsdp2_max_s": round(slowest["fsdp2"], 4),
        "overlap": round(max(med["compute"], med["comm"], med["io"]) / med["scheduled"], 3),
        "ratio_vs_fsdp2": round(slowest["fsdp2"] / slowest["scheduled"], 3),
        "states_bytes_per_rank": first["states_bytes"], "states_bytes_one_rank": first["one_rank_states_bytes"],
        "sharded_kinds_fraction": {kind: round(first["kind_bytes"][kind] / first["one_rank_kind_bytes"][kind], 3)
                                   for kind in sharded},
        "comm_bytes_per_step": first["comm_bytes"], "estimate_comm_bytes_per_step": first["estimate_comm_bytes"],
        "gathers_per_step": first["gathers"],
        # CPU seconds per step of each rank's process (all its threads): with fewer cores than ranks x threads,
        # a step cannot take less wall time than its CPU seconds divided by the cores it has
        "cpu_s": {name: round(v, 4) for name, v in first["cpu"].items()},
        "cores_per_rank": round((os.cpu_count() or 1) / args.nproc, 2),
        "reductions_in_backward": first["collectives"].get("reductions_in_backward", 0),
        "osdp_replicated_groups": len(first["collectives"].get("osdp_replicated", {})),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
