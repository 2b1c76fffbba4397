"""Tensor-parallel benchmark: the same GPT at tp 1 (one process) and tp N (N gloo ranks, dp 1), step time, bytes
per rank and the share of the step spent in the tensor-parallel collectives; and tp N again with every tp
collective blocking (`blocking_step_s`), against which `overlap_gain` says what Megatron's overlap of the region
entries' backward collectives with the weight gradients (parallel/tensor/layers.py) saves.

    python -m tools.bench.tp --nproc 2 --dir DIR [--dim 512] [--layers 4] [--heads 8] [--seq 128] [--batch 4]
                             [--vocab 4096] [--sequence-parallel] [--steps 5] [--warmup 2] [--device cpu|cuda]

Both runs use the engine with the same config (device-only placement unless budgets say otherwise), the same
micro-batches, and median step times after `--warmup` steps. tp 1 runs first in its own process with every core;
the tp N ranks split the cores. Per rank: parameter bytes (the layout's param slots) and the pages of every kind;
`comm_share`: the seconds a step spent inside tp collectives over the step time (rank 0's medians). The losses of
the two runs are compared too (they agree within 1e-5 relative in fp32). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tools.bench.ranks import finish
from tools.bench.ranks import spawn as spawn_ranks


def make_model(args):
    from angel_ptm.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                         dim=args.dim))


def config(args, tp: int, disk_dir: str) -> dict:
    return {"optimizer": {"lr": 1e-4, "weight_decay": 0.1},
            "memory": {"page_bytes": args.page_kib << 10, "disk_dir": disk_dir},
            "trainer": {"device": args.device, "grad_clip": 0},
            "parallel": {"tp": tp, "sequence_parallel": args.sequence_parallel and tp > 1, "timeout_s": 300}}


def run(rank: int, world: int, port: int, args, out: str, overlap: bool = True) -> None:
    """One rank of a tp `world` run (world 1: the baseline, no process group); `overlap` False: every tp
    collective blocks (no weight gradient computed beside the region entries' backward collectives)."""
    from angel_ptm.parallel.tensor import layers

    layers.ANCHORED_ENTRY = overlap
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import angel_ptm

    device = torch.device(args.device if args.device != "cuda" else f"cuda:{rank}")
    g = torch.Generator().manual_seed(1)  # tp peers take the same batch
    data = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)) for _ in range(args.warmup + args.steps)]
    engine = angel_ptm.initialize(make_model(args), config(args, world, os.path.join(args.dir, f"tp{world}-{port}")))
    collectives = engine.tp.collectives if engine.tp is not None else None
    steps, comm, losses = [], [], []
    try:
        for x, y in data:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            before = collectives.seconds if collectives is not None else 0.0
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            steps.append(time.perf_counter() - t0)
            comm.append((collectives.seconds if collectives is not None else 0.0) - before)
            losses.append(loss.item())
        pages = {kind: sum(1 for p in ps if p is not None) for kind, ps in engine.pages.items()}
        result = {"rank": rank, "step_s": statistics.median(steps[args.warmup:]),
                  "comm_s": statistics.median(comm[args.warmup:]), "losses": losses,
                  "param_bytes": sum(s.numel for s in engine.layout.slots) * 4, "pages": pages,
                  "page_bytes": args.page_kib << 10, "in_use": engine.memory_stats()["in_use"]}
    finally:
        engine.close()
    finish(out, rank, result)


def spawn(world: int, args, overlap: bool = True) -> list[dict]:
    return spawn_ranks(run, world, args, overlap, name="tp")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="tp degree of the second run (one rank each)")
    parser.add_argument("--dir", required=True, help="where the page files go")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--page-kib", type=int, default=1024)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    say = (lambda *a: None) if args.json else print
    os.makedirs(args.dir, exist_ok=True)
    one = spawn(1, args)[0]
    many = spawn(args.nproc, args)
    blocking = spawn(args.nproc, args, overlap=False)[0]
    first = many[0]
    for r in [one] + many:
        who = "tp 1" if r is one else f"tp {args.nproc} rank {r['rank']}"
        say(f"{who}: step {r['step_s']:.3f}s, "
            f"tp collectives {r['comm_s']:.3f}s, param bytes {r['param_bytes']:,}, pages {r['pages']}")
    say(f"tp {args.nproc} rank 0, every collective blocking: step {blocking['step_s']:.3f}s, "
        f"tp collectives {blocking['comm_s']:.3f}s")
    worst = max(abs(a - b) / abs(b) for a, b in zip(first["losses"], one["losses"]))
    report = {
        "nproc": args.nproc, "sequence_parallel": args.sequence_parallel, "device": args.device,
        "tp1_step_s": round(one["step_s"], 4), "tp_step_s": round(first["step_s"], 4),
        "tp_step_max_s": round(max(r["step_s"] for r in many), 4),
        "step_ratio": round(first["step_s"] / one["step_s"], 3),
        "comm_s": round(first["comm_s"], 4), "comm_share": round(first["comm_s"] / first["step_s"], 3),
        "blocking_step_s": round(blocking["step_s"], 4), "blocking_comm_s": round(blocking["comm_s"], 4),
        "overlap_gain": round(blocking["step_s"] / first["step_s"], 3),
        "param_bytes_tp1": one["param_bytes"], "param_bytes_per_rank": first["param_bytes"],
        "param_fraction": round(first["param_bytes"] / one["param_bytes"], 4),
        "pages_tp1": one["pages"], "pages_per_rank": first["pages"],
        "loss_max_rel_diff": worst,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
