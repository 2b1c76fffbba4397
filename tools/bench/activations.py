"""Activations benchmark: one GPT's step time and largest trainable batch under each activations setting.

    python -m tools.bench.activations --dir DIR [--dim 384] [--layers 4] [--seq 256] [--batch 8] [--repeats 5]
                                      [--device-mib M] [--device cpu|cuda]

Settings, all on the same model, data and seed (one engine each, in this process): keep every activation
(`keep`), `activations.checkpoint: full` (`checkpoint`, torch.utils.checkpoint per paging unit), `offload: host`
and `offload: disk` (saved tensors in activation pages the scheduler moves; page files under --dir).
- step time: the median of `--repeats` steps after two warm-up steps (the planned scheduler's first step records,
  the second runs the plan) -> `keep_s`, `checkpoint_s`, `offload_host_s`, `offload_disk_s`, and their ratios
  over `keep_s`; every setting's losses must equal keep's (bitwise), or the run stops.
- measured activation peak on the device (the scheduler's trace: saved tensors outside the page pools) and the
  most bytes in activation pages, against the estimate (`*_device_bytes`, `*_estimate_bytes`).
- largest trainable batch x sequence under a fixed device budget (`--device-mib`; default: the device pool plus
  0.6 of keep's measured activation peak at --batch, so that half the batch is not on the budget's edge, where the
  few KiB the estimate leaves out decide): the most tokens whose estimated device memory (pool plus
  the activation peak, tests/test_activations.py holds the estimate within 10% of the trace) fits, then one step
  run at that batch (up to 4x --batch) to confirm its measured peak fits too -> `max_tokens_keep`, `max_tokens_checkpoint`,
  `max_tokens_offload`.
On a CPU machine the "device" is RAM with a pool budget like a GPU's; transfers host<->device are slot trades
there, so offload's cost is its copies. With `--device cuda` the pools are GPU memory and pinned host memory, and
`*_cuda_peak_bytes` adds what the CUDA allocator saw (torch.cuda.max_memory_allocated over a step, less the pool);
losses then agree within 1e-4 relative instead of bitwise (the embedding's CUDA backward adds in no fixed order,
and recomputed kernels may pick other algorithms; seen: 1.2e-5 after 5 steps at dim 1024).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import angel_ptm
from angel_ptm.activations.source import activation_footprint_of
from angel_ptm.estimate import estimate_job
from angel_ptm.config import load_config
from angel_ptm.models import GPT, GPTConfig

SETTINGS = {
    "keep": {},
    "checkpoint": {"checkpoint": "full"},
    "offload_host": {"offload": "host"},
    "offload_disk": {"offload": "disk"},
}


def job(args, activations: dict, batch: int, device_bytes: int | None = None) -> dict:
    memory = {"page_bytes": f"{args.page_kib}KiB", "disk_dir": args.dir, "scheduler": "planned"}
    if device_bytes is not None:
        memory["device_budget"] = device_bytes
    return {"memory": memory, "trainer": {"device": args.device}, "data": {"batch_size": batch},
            "activations": dict(activations)}


def same_losses(a: list[float], b: list[float], exact: bool, rel: float = 1e-4) -> bool:
    return a == b if exact else len(a) == len(b) and all(abs(x - y) <= rel * abs(x) for x, y in zip(a, b))


def build(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                         dim=args.dim))


def run(args, name: str, batch: int, steps: int, device_bytes: int | None = None) -> dict:
    engine = angel_ptm.initialize(build(args), job(args, SETTINGS[name], batch, device_bytes))
    generator = torch.Generator().manual_seed(1)
    losses, times, peaks, cuda_peaks = [], [], [], []
    cuda = engine.device.type == "cuda"
    try:
        for _ in range(steps):
            tokens = torch.randint(0, args.vocab, (batch, args.seq), generator=generator).to(engine.device)
            if cuda:
                torch.cuda.synchronize(engine.device)
                torch.cuda.reset_peak_memory_stats(engine.device)
            start = time.perf_counter()
            loss = engine(tokens, tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())  # waits for the device
            times.append(time.perf_counter() - start)
            peaks.append(engine.scheduler.last_trace.activation_peak)
            if cuda:
                cuda_peaks.append(torch.cuda.max_memory_allocated(engine.device))
        pool = engine.estimate.tiers["device"].budget
        return {"losses": losses, "step_s": statistics.median(times[2:]) if steps > 2 else times[-1],
                "cuda_peak": max(cuda_peaks[1:] or cuda_peaks) - pool if cuda else 0,
                "device_peak": max(peaks[1:] or peaks), "paged_peak": engine.binder.offload.peak_bytes if engine.binder.offload else 0,
                "estimate": engine.estimate.activation_bytes, "pool": pool}
    finally:
        engine.close()


def max_tokens(args, name: str, budget: int, pool: int) -> int:
    """The most batch x seq (batch up to 1024) whose estimated device memory (pool + activation peak) fits
    `budget` and whose job the engine's estimate accepts (activation pages in host RAM and on disk)."""
    best, batch = 0, 1
    while batch <= 1024:
        config = load_config(job(args, SETTINGS[name], batch))
        model = build_meta(args)
        footprint = activation_footprint_of(model, config)
        if pool + footprint.device > budget or not estimate_job(config, model).fits:
            break
        best, batch = batch, batch * 2 if batch < 8 else batch + max(1, batch // 4)
    return best * args.seq


def build_meta(args) -> GPT:
    with torch.device("meta"):
        return build(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--page-kib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device-mib", type=float, default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    results = {name: run(args, name, args.batch, args.repeats + 2) for name in SETTINGS}
    keep = results["keep"]
    for name, result in results.items():
        if not same_losses(keep["losses"], result["losses"], exact=args.device == "cpu"):
            raise SystemExit(f"{name}: losses differ from keep's: {result['losses']} vs {keep['losses']}")
    out = {"device": args.device}
    out.update({f"{name}_s": round(r["step_s"], 4) for name, r in results.items()})
    out.update({f"{name}_ratio": round(r["step_s"] / keep["step_s"], 3) for name, r in results.items()})
    out.update({f"{name}_device_bytes": r["device_peak"] for name, r in results.items()})
    out.update({f"{name}_estimate_bytes": r["estimate"] for name, r in results.items()})
    out.update({f"{name}_cuda_peak_bytes": r["cuda_peak"] for name, r in results.items() if r["cuda_peak"]})
    out.update({f"{name}_paged_bytes": r["paged_peak"] for name, r in results.items() if r["paged_peak"]})
    pool = keep["pool"]
    budget = int(args.device_mib * 2**20) if args.device_mib else pool + int(0.6 * keep["device_peak"])
    out["device_budget_bytes"] = budget
    for key, name in (("max_tokens_keep", "keep"), ("max_tokens_checkpoint", "checkpoint"),
                      ("max_tokens_offload", "offload_host")):
        tokens = max_tokens(args, name, budget, pool)
        out[key] = tokens
        if tokens and tokens <= 4 * args.batch * args.seq:  # one step there: its measured peak must fit as well
            checked = run(args, name, tokens // args.seq, 2)
            out[f"{key}_measured_fits"] = pool + checked["device_peak"] <= budget
    for key in ("keep_s", "checkpoint_s", "offload_host_s", "offload_disk_s"):
        print(f"{key:>16}: {out[key]:.3f} s  ({out[key.replace('_s', '_ratio')]}x keep)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
