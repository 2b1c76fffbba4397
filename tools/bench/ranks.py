"""Benchmark ranks as torchrun starts them: `spawn(target, world, args, *extra)` runs target(rank, world, port,
args, out, *extra) in `world` spawned processes on one free port and returns each rank's result, the JSON a rank
wrote with `finish(out, rank, result)`."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import tempfile


def spawn(target, world: int, args, *extra, name: str = "bench") -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(prefix=f"{name}-bench-", dir=args.dir)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, args, out, *extra)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"{name} bench: a rank failed (exit codes {[p.exitcode for p in procs]})")
    results = []
    for r in range(world):
        with open(f"{out}.rank{r}") as f:
            results.append(json.load(f))
        os.unlink(f"{out}.rank{r}")
    return results


def finish(out: str, rank: int, result) -> None:
    """Write this rank's result and leave without interpreter teardown: now and then a rank aborted there
    ("terminate called without an active exception": a gloo thread still joinable during finalization) after its
    result was written, failing a finished benchmark (seen once in CI on tools/bench/tp.py's 2 ranks)."""
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
