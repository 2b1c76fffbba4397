"""Multi-process tests on CPU over gloo: spawn N ranks once, run a list of jobs in each, collect their results.

    results = spawn(2, run_jobs, (jobs, str(tmp_path)), tmp_path)   # one dict per rank
    results = spawn(2, run_jobs, ..., expect_failure=True)          # a rank may die; the others' results

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), so the
engine sets up the process group itself, as under torchrun. A rank writes its result (or its error's type and
message) to a JSON file; a rank that does not finish within the time limit is killed and reported.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

SPAWN_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, port: int, args: tuple, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which asserts on it
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown handshake with a dead peer


def spawn(world: int, fn, args: tuple, tmp_path, timeout_s: float = SPAWN_TIMEOUT_S) -> list[dict]:
    """Run fn(rank, world, *args) in `world` spawned processes; per rank {"ok", "value"} or {"ok": False, "type",
    "message"}, or {"ok": False, "type": "killed"/"exited"} for a rank that hung or died without a result."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    outs = [str(Path(tmp_path) / f"rank{r}-{time.monotonic_ns()}.json") for r in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, args, outs[r]), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    results = []
    for r, p in enumerate(procs):
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"ok": False, "type": "killed", "message": f"rank {r} still running after {timeout_s} s"})
        elif Path(outs[r]).exists():
            results.append(json.loads(Path(outs[r]).read_text()))
        else:
            results.append({"ok": False, "type": "exited", "message": f"rank {r} exited {p.exitcode} silently"})
    return results


def values(results: list[dict]) -> list:
    """Every rank's value, or an AssertionError with the first failure's traceback."""
    for rank, result in enumerate(results):
        if not result["ok"]:
            raise AssertionError(f"rank {rank}: {result['type']}: {result.get('message')}\n"
                                 f"{result.get('traceback', '')}")
    return [result["value"] for result in results]
