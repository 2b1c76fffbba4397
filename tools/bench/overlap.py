"""Overlap benchmark: does the scheduler hide page movement behind compute?

    python -m tools.bench.overlap --dir DIR [--dim 512] [--layers 8] [--batch 2] [--seq 64] [--page-mib 4]
                                  [--device-frac 0.15] [--host-frac 0.15] [--steps 6] [--warmup 2] [--staleness 0]
                                  [--copy]

One GPT, the same data, four measurements in one run, interleaved step by step so all see the same machine:
  (a) compute only:   an engine with every page on the device tier (nothing moves);
  (b) I/O only:       the scheduled step's page accesses replayed with no compute between them (acquire and
                      release in the recorded order, with the same plan), i.e. the same page moves and nothing else;
  (c) scheduled:      states mostly on disk (`--device-frac` / `--host-frac` of them on the device / host tiers),
                      memory.scheduler = planned;
  (d) on demand:      the same budgets, memory.scheduler = on_demand (LRU, fetch when touched).
Every figure is the median step time after `--warmup` steps. The last line is one JSON object with `compute_s`,
`io_s`, `scheduled_s`, `on_demand_s`, `overlap` = max(a, b) / c (goal >= 0.90), `speedup_vs_on_demand` = d / c
and `stall_fraction` (the scheduled step's time spent waiting for pages / its step time), plus bytes moved per
step and the device the run used. `--staleness 1` runs every engine with the delayed update (optimizer.staleness
1: fp32 master pages of their own, update t spread over step t+1). On CPU the device and host tiers are both
plain memory and a page changes between them by trading pool slots (memory.zero_copy), as a GPU's copy engines
leave the compute cores alone; `--copy` copies instead (each copy then takes a core from compute).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import angel_ptm
from angel_ptm.config.schema import MemoryConfig
from angel_ptm.models import GPT, GPTConfig
from angel_ptm.schedule import StepTrace

STATE_KINDS = 4  # param, grad, exp_avg, exp_avg_sq (and master under --staleness 1)


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads, dim=args.dim))


def make_engine(args, device_budget, host_budget, scheduler: str, disk_dir: str):
    config = {"optimizer": {"lr": 1e-4, "weight_decay": 0.1, "staleness": args.staleness},
              "memory": {"page_bytes": args.page_mib << 20, "device_budget": device_budget,
                         "host_budget": host_budget, "disk_dir": disk_dir, "scheduler": scheduler,
                         "io_threads": args.io_threads, "zero_copy": not args.copy},
              "trainer": {"device": args.device, "grad_clip": 0}}  # no clipping: updates overlap backward
    return angel_ptm.initialize(make_model(args), config)


def train_step(engine, x, y) -> float:
    t0 = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0


def replay_step(engine, trace: StepTrace) -> float:
    """The scheduled step without compute: its accesses in order, each acquired and released at once (of another
    rank's pages under ZeRO-3, none: their collectives are not I/O)."""
    scheduler, pages = engine.scheduler, engine.manager.pages
    t0 = time.perf_counter()
    for access in trace.accesses:
        group = [pages[pid] for pid in access.pages if pages[pid].home is None]
        if not group:
            continue
        scheduler.acquire(group, access.tier, label=access.label)
        written = [p for p in group if p.id in access.writes]
        scheduler.release([p for p in group if p.id not in access.writes])
        if written:
            scheduler.release(written, dirty=True)
    engine.scheduler.end_step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where the page files go (an SSD)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--page-mib", type=int, default=4)
    parser.add_argument("--device-frac", type=float, default=0.15, help="share of the states on the device tier")
    parser.add_argument("--host-frac", type=float, default=0.15, help="share of the states on the host tier")
    parser.add_argument("--io-threads", type=int, default=MemoryConfig.io_threads)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--staleness", type=int, default=0, choices=[0, 1],
                        help="optimizer.staleness of every engine (1: update t runs during step t+1)")
    parser.add_argument("--copy", action="store_true",
                        help="CPU: copy pages between the device and host pools instead of trading slots")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    say = (lambda *a: None) if args.json else print
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="angel-overlap-", dir=args.dir)
    page_bytes = args.page_mib << 20
    n_params = sum(p.numel() for p in make_model(args).parameters())
    states = (STATE_KINDS + args.staleness) * n_params * 4
    device_budget = max(int(args.device_frac * states), 8 * page_bytes)
    host_budget = max(int(args.host_frac * states), 8 * page_bytes)
    say(f"GPT {n_params / 1e6:.1f}M params, {states / 2**20:.0f} MiB of states, pages of {args.page_mib} MiB; "
        f"device {device_budget / 2**20:.0f} MiB, host {host_budget / 2**20:.0f} MiB, the rest on disk in {work}")

    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 256, (args.batch, args.seq), generator=g).to(args.device),
             torch.randint(0, 256, (args.batch, args.seq), generator=g).to(args.device))
            for _ in range(args.warmup + args.steps)]
    engines = {
        "compute": make_engine(args, states + 8 * page_bytes, 8 * page_bytes, "on_demand", os.path.join(work, "a")),
        "io": make_engine(args, device_budget, host_budget, "planned", os.path.join(work, "b")),
        "scheduled": make_engine(args, device_budget, host_budget, "planned", os.path.join(work, "c")),
        "on_demand": make_engine(args, device_budget, host_budget, "on_demand", os.path.join(work, "d")),
    }
    zero_copy = engines["scheduled"].manager.zero_copy
    times: dict[str, list[float]] = {name: [] for name in engines}
    stall: list[float] = []
    moved: dict[str, list[dict]] = {"scheduled": [], "on_demand": []}
    try:
        # The I/O engine's warm-up steps record the trace and plan. Under staleness 1 the first step has no update to
        # run during its forward, so the trace settles from the third step on.
        for x, y in data[: 1 + 2 * args.staleness]:
            train_step(engines["io"], x, y)
        io_trace = engines["io"].scheduler.plan.trace
        for i, (x, y) in enumerate(data):
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]
            for name in order:
                engine = engines[name]
                before = dict(engine.manager.bytes_moved)
                seconds = replay_step(engine, io_trace) if name == "io" else train_step(engine, x, y)
                if i < args.warmup:
                    continue
                times[name].append(seconds)
                if name in moved:
                    moved[name].append({k: v - before.get(k, 0) for k, v in engine.manager.bytes_moved.items()})
                if name == "scheduled":
                    stall.append(engine.memory_stats()["schedule"]["stall_s"] / seconds)
            if i >= args.warmup:
                say(f"step {i}: " + " ".join(f"{name} {times[name][-1]:.3f}s" for name in engines))
        plan_s = engines["scheduled"].scheduler.plan_s
        deviations = engines["scheduled"].scheduler.last_stats.deviations
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(work, ignore_errors=True)

    med = {name: statistics.median(values) for name, values in times.items()}
    per_step_gb = {name: round(statistics.median(sum(m.values()) for m in moved[name]) / 1e9, 3) for name in moved}
    pairs_gb = {pair: round(statistics.median(m.get(pair, 0) for m in moved["scheduled"]) / 1e9, 3)
                for pair in sorted({pair for m in moved["scheduled"] for pair in m})}
    report = {
        "device": args.device, "staleness": args.staleness, "zero_copy": zero_copy, "params": n_params,
        "states_bytes": states, "page_bytes": page_bytes,
        "device_budget": device_budget, "host_budget": host_budget, "steps": args.steps,
        "compute_s": round(med["compute"], 4), "io_s": round(med["io"], 4),
        "scheduled_s": round(med["scheduled"], 4), "on_demand_s": round(med["on_demand"], 4),
        "overlap": round(max(med["compute"], med["io"]) / med["scheduled"], 3),
        "speedup_vs_on_demand": round(med["on_demand"] / med["scheduled"], 3),
        "stall_fraction": round(statistics.median(stall), 3),
        "moved_gb_per_step": per_step_gb, "scheduled_moved_gb_by_pair": pairs_gb, "plan_s": round(plan_s, 4),
        "deviations": deviations,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
