"""Soak: a long run with SSD offload and frequent checkpoints must not leak memory, page files, checkpoints,
threads or file descriptors.

    python -m tools.soak --dir DIR [--steps 1000] [--every 50] [--keep 2] [--json]

A small GPT whose states live mostly on disk trains `--steps` steps, saving a checkpoint every `--every` through
`Checkpoints` (keep `--keep`), as the trainer does. After every step it records the process's RSS, the bytes of the
page files and of the checkpoint directory, the live threads and open file descriptors. Each series is reported as
min / max over the run after the first `--every` steps (the allocator and the scheduler's plan settle there) and
over its first and last quarters: flat means the last quarter's max is no higher than the first quarter's max (with
a 5% and one-page margin for RSS, 4 KiB for the checkpoints, whose records grow as the step number gains digits). The last line is one JSON object with `flat` true or false and the series' bounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

import angel_ptm
from angel_ptm.checkpoint.directory import Checkpoints
from angel_ptm.models import GPT, GPTConfig


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def bounds(series: list[float]) -> dict:
    q = max(1, len(series) // 4)
    return {"min": min(series), "max": max(series), "first_quarter_max": max(series[:q]),
            "last_quarter_max": max(series[-q:])}


def run(directory: Path, steps: int, every: int, keep: int, page_kib: int = 64) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, dim=128))
    page = page_kib << 10
    pages_dir, ckpt_dir = directory / "pages", directory / "checkpoints"
    config = {"optimizer": {"lr": 1e-3}, "trainer": {"device": "cpu", "grad_clip": 1.0},
              "memory": {"page_bytes": page, "device_budget": 24 * page, "host_budget": 24 * page,
                         "disk_dir": str(pages_dir)}}
    engine = angel_ptm.initialize(model, config)
    process = psutil.Process()
    series: dict[str, list[float]] = {"rss": [], "page_file_bytes": [], "checkpoint_bytes": [], "threads": [],
                                      "fds": []}
    ckpts = Checkpoints(ckpt_dir, keep=keep)
    generator = torch.Generator().manual_seed(1)
    losses = []
    t0 = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            x = torch.randint(0, 256, (4, 64), generator=generator)
            loss = engine(x, x)
            engine.backward(loss)
            engine.clip_grad_norm(1.0)
            engine.step()
            losses.append(loss.item())
            if step % every == 0:
                ckpts.save(engine, step, {"step": step})
            series["rss"].append(process.memory_info().rss)
            series["page_file_bytes"].append(tree_bytes(pages_dir))
            series["checkpoint_bytes"].append(tree_bytes(ckpt_dir))
            series["threads"].append(threading.active_count())
            series["fds"].append(process.num_fds())
    finally:
        engine.close()
    seconds = time.perf_counter() - t0
    settled = {name: values[every:] or values for name, values in series.items()}
    report = {name: bounds(values) for name, values in settled.items()}
    rss = report["rss"]
    ckpt = report["checkpoint_bytes"]
    flat = (rss["last_quarter_max"] <= rss["first_quarter_max"] * 1.05 + page
            # a checkpoint's records grow by a byte or two as the step number gains digits
            and ckpt["last_quarter_max"] <= ckpt["first_quarter_max"] + 4096
            and all(report[k]["last_quarter_max"] <= report[k]["first_quarter_max"]
                    for k in ("page_file_bytes", "threads", "fds")))
    return {"steps": steps, "every": every, "keep": keep, "checkpoints": len(ckpts.complete()),
            "seconds": seconds, "first_loss": losses[0], "last_loss": losses[-1],
            "page_files_left": tree_bytes(pages_dir), "flat": flat, **report}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="soak-", dir=args.dir))
    try:
        result = run(work, args.steps, args.every, args.keep)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.json:
        for key, value in result.items():
            print(f"{key:>18}: {value}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
