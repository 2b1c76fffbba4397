"""Expert-parallel placement benchmark: a GPT-MoE with a skewed (Zipf) router on 2 gloo ranks at ep 2, three ways.

    python -m tools.bench.ep --dir DIR [--experts 8] [--dim 256] [--layers 2] [--seq 128] [--batch 8] [--zipf 2.0]
                             [--every 4] [--replicas 1] [--zero 1] [--steps 6] [--warmup 5] [--repeats 3]

  fixed      every expert where apply_expert_parallel puts it (rank r holds experts r*E/ep ..)
  migrate    parallel.moe_rebalance_every `--every`: experts swap ranks where the load is unbalanced and it pays
  replicate  the same with parallel.moe_replicas `--replicas`: hot experts also get weight copies on other ranks
The gate is a hash of the token id, so the skew of the token ids (Zipf) is the routing's: one expert gets the most
frequent ids' tokens (at Zipf 2.0 token 0 alone is 61% of them), more than a rank's share, which no swap can split.
The decisions are the engine's own, from its measured timings (nothing is forced). Per way and repeat: rank 0's
median step time after `--warmup` steps (the first rebalance comes at step `--every`), then the median over
repeats. The last line is one JSON object with `fixed_s`, `migrate_s`, `replicate_s`, `speedup_migrate` and
`speedup_replicate` (fixed / the way), the modelled balance ratio (the busiest rank's expert rows over the mean
rank's) after the last decision of each way (`balance_fixed`: before the first), the replicas in place, and
`max_loss_rel_diff`: the largest relative difference of any step's loss from the fixed way's (placement changes no
math).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tools.bench.moe import batches, model_config
from tools.bench.ranks import finish, spawn

WAYS = ("fixed", "migrate", "replicate")


def engine_config(args, way: str, disk_dir: str) -> dict:
    parallel = {"ep": 2, "zero": args.zero, "timeout_s": 300}
    if way != "fixed":
        parallel["moe_rebalance_every"] = args.every
    if way == "replicate":
        parallel["moe_replicas"] = args.replicas
    return {"optimizer": {"lr": 1e-3, "weight_decay": 0.1}, "memory": {"disk_dir": disk_dir},
            "trainer": {"device": "cpu", "grad_clip": 0}, "parallel": parallel}


def run(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import torch.distributed as dist

    import angel_ptm
    from angel_ptm.models import GPT, GPTConfig

    dist.init_process_group("gloo")
    data = batches(args, 2 * (args.warmup + args.steps))[rank::2]  # (each rank its own micro-batches)
    results = {way: [] for way in WAYS}
    for repeat in range(args.repeats):
        for way in WAYS:
            torch.manual_seed(0)
            model = GPT(GPTConfig(**model_config(args)))
            engine = angel_ptm.initialize(model, engine_config(args, way, os.path.join(args.dir, f"ep-{way}")))
            steps, losses = [], []
            try:
                for x, y in data:
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                    steps.append(time.perf_counter() - t0)
                    losses.append(loss.item())
                decisions = engine.rebalancer.decisions if engine.rebalancer is not None else []
                stats = engine.rebalancer.stats() if engine.rebalancer is not None else {}
                results[way].append({"step_s": statistics.median(steps[args.warmup:]), "losses": losses,
                                     "decisions": decisions, "replicas": stats.get("replicas", 0),
                                     "migrations": stats.get("migrations", 0)})
            finally:
                engine.close()
    finish(out, rank, results)


def balance(decisions: list, first: bool = False) -> float | None:
    """The modelled balance ratio after the last decision (before the first, with `first`), the largest over the
    layers."""
    if not decisions:
        return None
    layers = (decisions[0] if first else decisions[-1])["layers"].values()
    return max(layer["ratio_before" if first or not layer["moved"] else "ratio_after"] for layer in layers)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where the page files go")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=2.0, help="exponent of the token ids' (so the routing's) skew")
    parser.add_argument("--every", type=int, default=4, help="parallel.moe_rebalance_every")
    parser.add_argument("--replicas", type=int, default=1, help="parallel.moe_replicas")
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed (the first rebalance comes after "
                        "step --every)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    results = spawn(run, 2, args, name="ep")[0]  # (rank 0's)
    step = {way: statistics.median(run["step_s"] for run in results[way]) for way in WAYS}
    fixed_losses = results["fixed"][0]["losses"]
    diff = max(abs(a - b) / abs(b) for way in WAYS for run in results[way]
               for a, b in zip(run["losses"], fixed_losses))
    last = {way: results[way][-1] for way in WAYS}
    report = {"experts": args.experts, "zipf": args.zipf, "every": args.every, "replicas_per_rank": args.replicas,
              "fixed_s": step["fixed"], "migrate_s": step["migrate"], "replicate_s": step["replicate"],
              "speedup_migrate": step["fixed"] / step["migrate"],
              "speedup_replicate": step["fixed"] / step["replicate"],
              "each_s": {way: [round(run["step_s"], 4) for run in results[way]] for way in WAYS},
              "balance_fixed": balance(last["migrate"]["decisions"], first=True),
              "balance_migrate": balance(last["migrate"]["decisions"]),
              "balance_replicate": balance(last["replicate"]["decisions"]),
              "replicas": last["replicate"]["replicas"], "migrations": last["migrate"]["migrations"],
              "max_loss_rel_diff": diff}
    if not args.json:
        for way in ("migrate", "replicate"):
            for d in last[way]["decisions"][-1:]:
                print(way, "step", d["step"], json.dumps(d["layers"]))
        for way in WAYS:
            print(f"{way:10s} step {step[way]:.4f}s  each {report['each_s'][way]}")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
