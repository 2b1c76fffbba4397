"""Scale benchmark: a GPT of billions of parameters trained for a few steps with its states on SSD.

    python -m tools.bench.scale --dir DIR [--params 4e9] [--page-mib 64] [--steps 3] [--device-gib 4]
                                [--host-gib 6] [--ffn-pages 1] [--batch 1] [--seq 64] [--lr 5e-7] [--dry-run]
                                [--json]

The model: a byte-level GPT (vocab 256) shaped so that every weight fills one page: dim is the largest multiple
of 128 whose dim x dim fp32 weight fits in 97% of a page (3968 for 64 MiB pages: 31 heads of 128; the rest of the
page takes the next norm), ffn_hidden the largest multiple of 64 whose dim x hidden weight fits in `--ffn-pages`
pages (4224 for one page: a narrow FFN, 1.06 x dim), and as many layers as it takes to reach `--params` (36, i.e.
4.08 billion parameters, at the defaults). Why one page: a weight that spans pages is gathered into a contiguous
copy for its forward, and autograd keeps that copy until backward (binding.py), so `--ffn-pages 3` (the LLaMA
ratio, 12672; 19 layers) holds 19 x 3 FFN weights of 192 MiB, 11 GiB, in RAM during each step.
It is built on the meta device and materialized straight into its pages (angel_ptm/memory/materialize.py): its
fp32 weights alone are 16 GB, its training states (param, grad, exp_avg, exp_avg_sq) 4 x the layout's pages,
about 68 GB — far beyond this machine's RAM. The device and host tiers get `--device-gib` / `--host-gib` (4 + 6
GiB by default, so the process stays well under 24 GiB); everything else lives in page files under `--dir`,
which the engine preallocates (a slot per page and kind). Free disk space is checked first: without enough, the
run refuses with the numbers (one line, exit status 1) and names the largest `--params` that would fit.

Training: AdamW (lr `--lr`, no warm-up, weight decay 0.1), memory.scheduler "planned", trainer.grad_clip 0 (so
each page group is updated as soon as its gradients are final, overlapping the rest of backward), on one batch of
`--batch` x `--seq` bytes of the default text corpus, the same batch every step: at this size and in 3 steps a
fresh batch per step would measure the data, not whether the updates land. The default lr is small because the
first AdamW step moves every weight by about lr (m / sqrt(v) = sign(g)), and at width ~4000 that adds up: in plain
PyTorch, two such layers go 6.27 -> 16.75 (up) after one step at lr 1e-3 and 6.27 -> 7.63 at 3e-4; four layers
go 6.27, 0.63, 0.04, 0.30 at 1e-5 (the last step overshoots) and 6.27, 2.88, 0.88, 0.15 at 3e-6; the effect
grows with depth: at 4 billion parameters, 19 layers of the --ffn-pages 3 shape go 6.35, 1.30, 0.19 at 2e-6, but
the default 36 layers go 5.84, 9.17, 1.52 at 2e-6 and 5.84, 3.40, 1.93 at 5e-7, the default.

Figures: the seconds and tokens/s of every step (step 0 also records the trace the planned scheduler plans
from); the peak RSS of the process (ru_maxrss); disk bytes read and written during the training steps, from the
engine's counters (pages moved disk->host and host->disk) and from /proc/self/io (read_bytes / write_bytes: the
same I/O as the kernel saw it), and the same during `initialize`. The page files are deleted at the end. The
last line is one JSON object: `params`, `steps`, `losses`, `step_s`, `tokens_per_s`, `peak_rss_gib`,
`disk_read_gb`, `disk_written_gb` and the plan, init and /proc/self/io figures. `--dry-run` prints the plan only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import time

import torch

import angel_ptm
from angel_ptm.config.schema import MemoryConfig
from angel_ptm.data.corpus import TextCorpus
from angel_ptm.data.sampler import BatchSampler
from angel_ptm.memory import build_layout
from angel_ptm.models import GPT, GPTConfig

GB, GIB = 1e9, 1 << 30
STATE_KINDS = 4  # param, grad, exp_avg, exp_avg_sq: one page file slot per page and kind
DISK_SLACK = 2 * GIB  # headroom left on the disk beyond the preallocated page files
VOCAB = 256


def model_config(params: int, page_bytes: int, seq: int, ffn_pages: int = 1) -> GPTConfig:
    """The GPT of at least `params` parameters whose weights fill whole pages (see the module docstring)."""
    elems = page_bytes // 4
    dim = max(128, math.isqrt(int(0.97 * elems)) // 128 * 128)
    hidden = max(64, ffn_pages * elems // dim // 64 * 64)
    per_layer = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    fixed = VOCAB * dim + dim  # the tied embedding / output weight and the final norm
    layers = max(1, -(-(params - fixed) // per_layer))
    return GPTConfig(vocab_size=VOCAB, seq_len=seq, n_layer=layers, n_head=dim // 128, dim=dim, ffn_hidden=hidden)


def meta_model(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def plan_for(cfg: GPTConfig, page_bytes: int) -> dict:
    model = meta_model(cfg)
    n_pages = build_layout(model, page_bytes).n_pages
    states = STATE_KINDS * n_pages * page_bytes
    return {"params": model.num_params(), "dim": cfg.dim, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "ffn_hidden": cfg.hidden_dim, "pages_per_kind": n_pages, "page_bytes": page_bytes,
            "states_bytes": states, "disk_needed_bytes": states + DISK_SLACK}


def largest_that_fits(cfg: GPTConfig, page_bytes: int, free: int) -> int:
    """The most parameters of this shape (fewer layers) whose page files fit in `free` bytes; 0 if none."""
    for layers in range(cfg.n_layer - 1, 0, -1):
        plan = plan_for(GPTConfig(**{**cfg.__dict__, "n_layer": layers}), page_bytes)
        if plan["disk_needed_bytes"] <= free:
            return plan["params"]
    return 0


def proc_io() -> dict[str, int]:
    """This process's bytes read from / written to storage, as the kernel counts them (all threads)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return {"read": int(fields["read_bytes"]), "written": int(fields["write_bytes"])}
    except (OSError, KeyError, ValueError):
        return {"read": 0, "written": 0}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is in KiB on Linux


def disk_moved(before: dict, after: dict) -> dict[str, int]:
    return {"read": after.get("disk->host", 0) - before.get("disk->host", 0),
            "written": after.get("host->disk", 0) - before.get("host->disk", 0)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where the page files go (an SSD)")
    parser.add_argument("--params", type=float, default=4e9, help="at least this many parameters")
    parser.add_argument("--page-mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device-gib", type=float, default=4.0, help="device tier budget (CPU pool here)")
    parser.add_argument("--host-gib", type=float, default=6.0, help="host tier budget")
    parser.add_argument("--ffn-pages", type=int, default=1, help="pages per FFN weight (3: the LLaMA ratio)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-7)
    parser.add_argument("--io-threads", type=int, default=MemoryConfig.io_threads)
    parser.add_argument("--dry-run", action="store_true", help="print the plan (sizes, budgets, disk) and stop")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))

    page_bytes = args.page_mib << 20
    cfg = model_config(int(args.params), page_bytes, args.seq, args.ffn_pages)
    plan = plan_for(cfg, page_bytes)
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    device_budget, host_budget = int(args.device_gib * GIB), int(args.host_gib * GIB)
    plan.update({"device_budget": device_budget, "host_budget": host_budget, "disk_free_bytes": free,
                 "batch": args.batch, "seq": args.seq, "lr": args.lr})
    fits = free >= plan["disk_needed_bytes"]
    if not fits and not args.dry_run:
        fitting = largest_that_fits(cfg, page_bytes, free)
        raise SystemExit(
            f"scale bench: {args.dir} has {free / GB:.1f} GB free, needs {plan['disk_needed_bytes'] / GB:.1f} GB "
            f"({STATE_KINDS} state kinds x {plan['pages_per_kind']} pages x {args.page_mib} MiB for "
            f"{plan['params'] / 1e9:.2f}B parameters, + {DISK_SLACK / GB:.1f} GB slack); "
            + (f"--params {fitting:.3g} fits" if fitting else "no size of this shape fits"))
    say(f"GPT {plan['params'] / 1e9:.3f}B params: dim {cfg.dim}, {cfg.n_layer} layers, {cfg.n_head} heads, "
        f"ffn {cfg.hidden_dim}, vocab {VOCAB}; batch {args.batch} x seq {args.seq}")
    say(f"states {plan['states_bytes'] / GB:.1f} GB = {STATE_KINDS} kinds x {plan['pages_per_kind']} pages of "
        f"{args.page_mib} MiB; device {device_budget / GIB:.2f} GiB, host {host_budget / GIB:.2f} GiB, "
        f"the rest on disk; disk needed {plan['disk_needed_bytes'] / GB:.1f} GB, free {free / GB:.1f} GB in "
        f"{args.dir}" + ("" if fits else " -- does NOT fit"))
    if args.dry_run:
        report = {"dry_run": True, "fits": fits, **plan}
        print(json.dumps(report))
        return report

    x, y = BatchSampler(TextCorpus(max_bytes=1 << 20).tokens, args.batch, args.seq, seed=0).batch(0)
    config = {"optimizer": {"lr": args.lr, "weight_decay": 0.1},
              "memory": {"page_bytes": page_bytes, "device_budget": device_budget, "host_budget": host_budget,
                         "disk_dir": args.dir, "scheduler": "planned", "io_threads": args.io_threads},
              "trainer": {"grad_clip": 0}}  # no clipping: updates overlap backward
    torch.manual_seed(0)
    model = meta_model(cfg)
    io_before, t0 = proc_io(), time.perf_counter()
    engine = angel_ptm.initialize(model, config)  # a failed start closes what it made, page files included
    init_s = time.perf_counter() - t0
    init_disk, init_io = disk_moved({}, engine.manager.bytes_moved), proc_io()
    init_io = {k: init_io[k] - io_before[k] for k in init_io}
    say(f"initialize: {init_s:.1f}s (materialize {engine.meta_init.seconds:.1f}s, scratch "
        f"{engine.meta_init.scratch_bytes / 2**20:.0f} MiB); disk read {init_disk['read'] / GB:.1f} GB, "
        f"written {init_disk['written'] / GB:.1f} GB; peak RSS {peak_rss_gib():.2f} GiB")

    losses, step_s, read, written, io_read, io_written = [], [], [], [], [], []
    try:
        for step in range(args.steps):
            moved_before, io_before = dict(engine.manager.bytes_moved), proc_io()
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_s.append(time.perf_counter() - t0)
            losses.append(loss.item())
            moved, io_now = disk_moved(moved_before, engine.manager.bytes_moved), proc_io()
            read.append(moved["read"])
            written.append(moved["written"])
            io_read.append(io_now["read"] - io_before["read"])
            io_written.append(io_now["written"] - io_before["written"])
            say(f"step {step}: loss {losses[-1]:.4f}, {step_s[-1]:.1f}s, {args.batch * args.seq / step_s[-1]:.2f} "
                f"tokens/s; disk read {read[-1] / GB:.1f} GB, written {written[-1] / GB:.1f} GB "
                f"(/proc/self/io {io_read[-1] / GB:.1f} / {io_written[-1] / GB:.1f} GB); "
                f"stall {engine.memory_stats()['schedule'].get('stall_s', 0):.1f}s; peak RSS {peak_rss_gib():.2f} GiB")
    finally:
        engine.close()  # deletes its page files

    report = {
        "params": plan["params"], "steps": args.steps, "losses": [round(v, 4) for v in losses],
        "step_s": [round(s, 2) for s in step_s],
        "tokens_per_s": [round(args.batch * args.seq / s, 3) for s in step_s],
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "disk_read_gb": [round(b / GB, 2) for b in read], "disk_written_gb": [round(b / GB, 2) for b in written],
        "proc_io_read_gb": [round(b / GB, 2) for b in io_read],
        "proc_io_written_gb": [round(b / GB, 2) for b in io_written],
        "init_s": round(init_s, 1), "materialize_s": round(engine.meta_init.seconds, 1),
        "init_disk_read_gb": round(init_disk["read"] / GB, 2), "init_disk_written_gb": round(init_disk["written"] / GB, 2),
        "init_proc_io_read_gb": round(init_io["read"] / GB, 2),
        "init_proc_io_written_gb": round(init_io["written"] / GB, 2),
        "loss_finite_and_falling": all(map(math.isfinite, losses)) and all(
            b < a for a, b in zip(losses, losses[1:])),
        "device": str(engine.device), **{k: plan[k] for k in ("dim", "n_layer", "n_head", "ffn_hidden",
                                                            "pages_per_kind", "page_bytes", "states_bytes",
                                                            "device_budget", "host_budget", "batch", "seq", "lr")},
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
