"""MoE benchmark: a GPT-MoE whose experts live mostly on host and disk, with a skewed (Zipf) router, four ways.

    python -m tools.bench.moe --dir DIR [--experts 16] [--dim 128] [--layers 4] [--seq 64] [--batch 8]
                              [--zipf 1.5] [--device-frac 0.2] [--steps 6] [--warmup 2] [--repeats 3]
                              [--warm-threshold 0.5]

  paged       each expert a paging unit of its own, the planned scheduler (only routed experts come in; an expert
              the routing skipped is not a deviation)
  stream_all  the experts inside their blocks' units: every expert comes in whenever its block runs, routed or not
              (Megatron's offloading pattern), planned scheduler
  on_demand   paged experts, the on-demand scheduler (LRU, no plan)
  resident    every page on the device (compute only)
The gate is a hash of the token id (so the skew of the token ids is the skew of the routing); the same model, data
and seed in every run (their losses are compared). Per run: the median step time after `--warmup` steps of each
repeat, then the median over repeats; the bytes the experts' pages moved per tier pair, over the timed steps. The
last line is one JSON object with `paged_s`, `stream_all_s`, `on_demand_s`, `resident_s`, `ratio_vs_resident`,
`expert_bytes_moved`, `stream_all_bytes_moved`, the paged run's deviations per step, its expert accesses made out
of the plan's order per step (resident experts run first) and its wasted-prefetch bytes (experts' pages brought
up ahead of use that went back down unused), and
`max_experts_on_ssd`: the most experts per MoE layer this machine's free disk holds at the same device and host
budgets (each expert a paging unit: the budgets need not grow with them), checked by `angel-ptm estimate`'s rules
up to 4096 experts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

import angel_ptm
from angel_ptm.estimate import estimate_job
from angel_ptm.models import GPT, GPTConfig
from angel_ptm.models.gpt import Block


def model_config(args, experts: int | None = None) -> dict:
    return {"vocab_size": 256, "seq_len": args.seq, "n_layer": args.layers, "n_head": 4, "dim": args.dim,
            "moe": {"experts": experts or args.experts, "top_k": 1, "gate": "hash", "capacity_factor": 0}}


def build(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**model_config(args)))


def batches(args, n: int):
    g = torch.Generator().manual_seed(2)
    zipf = torch.tensor([1.0 / (i + 1) ** args.zipf for i in range(256)])
    return [(torch.multinomial(zipf, args.batch * args.seq, True, generator=g).view(args.batch, args.seq),
             torch.randint(0, 256, (args.batch, args.seq), generator=g)) for _ in range(n)]


def job(args, scheduler: str, device_budget, host_budget, disk_dir: str) -> dict:
    return {"optimizer": {"lr": 1e-3, "weight_decay": 0.1},
            "memory": {"page_bytes": f"{args.page_kib}KiB", "device_budget": device_budget,
                       "host_budget": host_budget, "disk_dir": disk_dir, "scheduler": scheduler,
                       "expert_warm_threshold": args.warm_threshold},
            "trainer": {"device": "cpu", "grad_clip": 0}}


def run(args, name: str, budgets: tuple, data) -> dict:
    units = [Block] if name == "stream_all" else None
    scheduler = "on_demand" if name == "on_demand" else "planned"
    disk = Path(args.dir) / f"moe-bench-{name}"
    engine = angel_ptm.initialize(build(args), job(args, scheduler, *budgets, str(disk)), units=units)
    times, losses, deviations, reordered = [], [], [], []
    try:
        before = {}
        for step, (x, y) in enumerate(data):
            if step == args.warmup:
                stats = engine.memory_stats()
                before = dict(stats.get("expert_moved", {}), wasted=stats.get("expert_prefetch_wasted", 0))
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            if step >= args.warmup:
                deviations.append(engine.scheduler.last_stats.deviations)
                reordered.append(engine.scheduler.last_stats.optional_reordered)
        stats = engine.memory_stats()
        moved = {pair: n - before.get(pair, 0) for pair, n in stats.get("expert_moved", {}).items()}
        wasted = stats.get("expert_prefetch_wasted", 0) - before.get("wasted", 0)
    finally:
        engine.close()
        shutil.rmtree(disk, ignore_errors=True)
    return {"step_s": statistics.median(times[args.warmup:]), "losses": losses, "expert_moved": moved,
            "wasted": wasted, "deviations": deviations, "reordered": reordered}


def max_experts_on_ssd(args, device_budget: int, host_budget: int) -> tuple[int, bool]:
    """The most experts per MoE layer this machine's disk holds with the same device and host budgets (each expert
    a paging unit, so the budgets need not grow with them): the disk space the estimate finds, over one expert's
    states (16 bytes a parameter, every MoE layer), after the rest of the model's; then the estimate of that job,
    built on the meta device, when it has at most 4096 experts (True: the estimate accepted it)."""

    def estimate(experts: int):
        with torch.device("meta"):
            model = GPT(GPTConfig(**model_config(args, experts)))
        config = job(args, "planned", device_budget, host_budget, str(Path(args.dir) / "estimate"))
        return estimate_job(dict(config, model=model_config(args, experts)), model)

    small, large = estimate(args.experts), estimate(2 * args.experts)
    per_expert = (large.states_bytes - small.states_bytes) / args.experts
    available = small.tiers["disk"].available
    if not available or per_expert <= 0:
        return 0, False
    most = int((available - (small.states_bytes - per_expert * args.experts)) // per_expert)
    if most > 4096:
        return most, False
    while most > 0 and not estimate(most).fits:
        most -= max(1, most // 32)
    return most, True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where the page files go (an SSD)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.5, help="exponent of the token ids' (so the routing's) skew")
    parser.add_argument("--warm-threshold", type=float, default=0.5,
                        help="memory.expert_warm_threshold (0: every planned expert fetched ahead of its gate)")
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--device-frac", type=float, default=0.2, help="share of the states the device holds")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    say = (lambda *a: None) if args.json else print
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    states = 16 * sum(p.numel() for p in build(args).parameters())
    # the device holds a share of the states, at least what one block with all its experts needs (stream_all)
    with torch.device("meta"):
        meta = GPT(GPTConfig(**model_config(args)))
    needed = estimate_job(dict(job(args, "planned", "auto", "auto", args.dir), model=model_config(args)), meta,
                          units=None).tiers["device"].needed
    device = max(int(args.device_frac * states), 2 * needed)
    budgets = {"resident": (4 * states, states), "default": (device, states // 4)}
    data = batches(args, args.warmup + args.steps)
    results: dict[str, list[dict]] = {name: [] for name in ("paged", "stream_all", "on_demand", "resident")}
    for _ in range(args.repeats):  # interleaved: each repeat runs every way once
        for name in results:
            results[name].append(run(args, name, budgets["resident" if name == "resident" else "default"], data))
    med = {name: statistics.median(r["step_s"] for r in runs) for name, runs in results.items()}
    reference = results["resident"][0]["losses"]
    for name, runs in results.items():
        if runs[0]["losses"] != reference:
            diff = max(abs(a - b) / abs(b) for a, b in zip(runs[0]["losses"], reference))
            say(f"{name}: losses differ from resident's by up to {diff:.2e} (relative)")
        say(f"{name:>10}: {med[name]:.3f} s/step, expert bytes moved {runs[0]['expert_moved']}")
    report = {
        "experts": args.experts, "zipf": args.zipf, "warm_threshold": args.warm_threshold, "states_bytes": states, "device_budget": budgets["default"][0],
        "paged_s": round(med["paged"], 4), "stream_all_s": round(med["stream_all"], 4),
        "on_demand_s": round(med["on_demand"], 4), "resident_s": round(med["resident"], 4),
        "ratio_vs_resident": round(med["paged"] / med["resident"], 3),
        "ratio_stream_all_vs_paged": round(med["stream_all"] / med["paged"], 3),
        "expert_bytes_moved": sum(results["paged"][0]["expert_moved"].values()),
        "stream_all_bytes_moved": sum(results["stream_all"][0]["expert_moved"].values()),
        "on_demand_bytes_moved": sum(results["on_demand"][0]["expert_moved"].values()),
        "paged_deviations_per_step": results["paged"][0]["deviations"],
        # expert accesses made after a later one of their layer's (resident experts first)
        "paged_reordered_per_step": results["paged"][0]["reordered"],
        # bytes of experts' pages brought up ahead of use that went back down unused (the routing skipped them)
        "paged_wasted_prefetch_bytes": results["paged"][0]["wasted"],
    }
    report["max_experts_on_ssd"], report["max_experts_checked_by_estimate"] = max_experts_on_ssd(
        args, budgets["default"][0], budgets["default"][1])
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
