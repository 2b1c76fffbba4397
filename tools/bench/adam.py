"""Fused CPU Adam benchmark: the native kernel against torch's fused AdamW and DeepSpeed's CPU Adam, and the roofline.

    python -m tools.bench.adam [--params 67108864] [--repeats 11] [--warmup 2] [--threads N] [--isa auto]
                               [--no-peers] [--json]

The job is the mixed-precision host update of ZeRO-Offload-style training: fp32 master params, fp32 exp_avg and
exp_avg_sq, a bf16 gradient, and a bf16 copy of the updated params for the device. Measured in one run, interleaved
step by step (the order rotates every repeat) so that all see the same machine weather:
- angel: `fused_adamw_` — one pass that reads the bf16 gradient and writes the bf16 copy;
- torch: `torch.optim.AdamW(fused=True)` doing the same job: the bf16 gradient upcast into the fp32 `.grad`
  (`copy_`), `step()`, the bf16 copy written with `copy_`;
- deepspeed (if its cpu_adam op loads; it JIT-builds with ninja on first use, minutes on 2 cores, then is cached
  under ~/.cache/torch_extensions): `DeepSpeedCPUAdam.step()` on fp32 params and an fp32 gradient, no copy-out —
  its ZeRO-Offload path. It moves the same 28 bytes per parameter (4-byte gradient, no 2-byte copy), but more of
  them are reads (16 read, 12 written against our 14 and 14), which DRAM serves a few percent faster; so the kernel
  is also timed on exactly that job (`angel_fp32_ms`, `ratio_vs_deepspeed_same_job`);
- stream: the in-place streaming bandwidth of this machine, an in-place multiply over one fp32 buffer of the same
  size as the update's buffers (16 bytes per parameter) on all threads, counted as read + write. The faster of the
  native pool's multiply and torch's `mul_` is the reference.
Each figure is the median over `--repeats` timed steps after `--warmup` steps. Every timed step directly follows an
untimed step of the same contender, which absorbs the switching cost (torch's and DeepSpeed's OpenMP workers spin
for a while after each parallel region and take the cores from whatever runs next: about 6% on 2 cores), so the
timed one is a steady-state step as in training. `roofline_fraction` is the update's traffic (master, exp_avg and
exp_avg_sq read and written, gradient read, copy written: 28 bytes/param) per angel step time, over the stream
bandwidth. Last line: one JSON object (`ratio_vs_torch` = torch_fused_copy_ms / angel_ms, `ratio_vs_deepspeed` =
deepspeed_ms / angel_ms, or `deepspeed_unavailable` with the reason).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import time

import torch

from angel_ptm.optim import fused_adam
from angel_ptm.optim.fused_adam import fused_adamw_

GB = 1e9
BYTES_PER_PARAM = 4 * 2 * 3 + 2 + 2  # master, exp_avg, exp_avg_sq read + written; bf16 grad read; bf16 copy written
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def random_problem(n: int):
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen) * 0.02
    grad = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    return param, grad


class Angel:
    """fused_adamw_ on the given buffers (`out=None`: no copy)."""

    def __init__(self, name, param, grad, exp_avg, exp_avg_sq, out, isa: str):
        self.name, self.param, self.grad, self.exp_avg, self.exp_avg_sq = name, param, grad, exp_avg, exp_avg_sq
        self.out, self.isa, self.t = out, isa, 0

    @classmethod
    def mixed_precision(cls, param, grad, isa: str) -> "Angel":
        return cls("angel", param.clone(), grad, torch.zeros_like(param), torch.zeros_like(param),
                   torch.empty(param.shape, dtype=torch.bfloat16), isa)

    def same_job_as_deepspeed(self) -> "Angel":
        """The kernel on DeepSpeed's job (fp32 gradient, no copy), on this run's states (it only times them)."""
        return Angel("angel_fp32", self.param, self.grad.to(torch.float32), self.exp_avg, self.exp_avg_sq, None,
                     self.isa)

    def step(self) -> None:
        self.t += 1
        fused_adamw_(self.param, self.grad, self.exp_avg, self.exp_avg_sq, step=self.t, out=self.out, isa=self.isa,
                     **HYPER)


class TorchFused:
    name = "torch"

    def __init__(self, param, grad):
        self.param = param.clone().requires_grad_(True)
        self.param.grad = torch.empty_like(param)
        self.grad = grad
        self.out = torch.empty(param.shape, dtype=torch.bfloat16)
        self.opt = torch.optim.AdamW([self.param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                     eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)

    def step(self) -> None:
        self.param.grad.copy_(self.grad)
        self.opt.step()
        self.out.copy_(self.param.detach())


class DeepSpeed:
    name = "deepspeed"

    def __init__(self, param, grad):
        quiet = io.StringIO()
        with contextlib.redirect_stdout(quiet):  # it announces itself on stdout; our last line must be the JSON
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            self.param = torch.nn.Parameter(param.clone())
            self.param.grad = grad.to(torch.float32)
            self.opt = DeepSpeedCPUAdam([self.param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                        eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
            self.opt.step()  # builds/loads the op and allocates the states outside the timed steps
        import deepspeed

        self.version = deepspeed.__version__

    def step(self) -> None:
        self.opt.step()


class Stream:
    """The in-place multiply that gives the bandwidth reference, by the native pool or by torch."""

    def __init__(self, n_params: int, native: bool):
        self.buffer = torch.ones(n_params * 4)  # 16 bytes per parameter, the update's buffer footprint
        self.native, self.flip = native, False
        self.name = "stream_native" if native else "stream_torch"

    def step(self) -> None:
        self.flip = not self.flip
        factor = 0.5 if self.flip else 2.0  # exact, so the values never drift towards denormals
        if self.native:
            fused_adam._native.stream_scale(self.buffer.data_ptr(), self.buffer.numel(), factor)
        else:
            self.buffer.mul_(factor)

    @property
    def bytes_moved(self) -> int:
        return 2 * self.buffer.numel() * self.buffer.element_size()


def timed(run) -> float:
    t0 = time.perf_counter()
    run.step()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=64 << 20, help="parameters updated per step")
    parser.add_argument("--repeats", type=int, default=11, help="timed steps of each (median; at least 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--isa", default="auto", choices=["auto", "avx512", "avx2", "scalar"])
    parser.add_argument("--no-peers", action="store_true", help="skip DeepSpeed")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5")
    say = (lambda *a: None) if args.json else print

    torch.set_num_threads(args.threads)
    fused_adam.set_threads(args.threads)
    info = fused_adam.kernel_info()
    native = info["implementation"] == "native"
    param, grad = random_problem(args.params)
    runs = [Angel.mixed_precision(param, grad, args.isa), TorchFused(param, grad), Stream(args.params, native=False)]
    if native:
        runs.append(Stream(args.params, native=True))
    report_extra: dict = {}
    if not args.no_peers:
        try:
            runs.append(DeepSpeed(param, grad))
            report_extra["deepspeed_version"] = runs[-1].version
            runs.append(runs[0].same_job_as_deepspeed())
        except Exception as exc:  # ImportError, build failure, missing compiler...
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            report_extra["deepspeed_unavailable"] = reason
            say(f"deepspeed unavailable: {reason}")
    del param

    for run in runs:
        for _ in range(args.warmup):
            run.step()
    times: dict[str, list[float]] = {run.name: [] for run in runs}
    for r in range(args.repeats):
        order = runs[r % len(runs):] + runs[: r % len(runs)]
        for run in order:
            run.step()  # settles the switch from the previous contender (see the module docstring)
            times[run.name].append(timed(run))
        say("repeat {}: ".format(r) + ", ".join(f"{name} {ts[-1] * 1e3:.1f} ms" for name, ts in times.items()))

    med = {name: statistics.median(ts) for name, ts in times.items()}
    stream_bw = {run.name: run.bytes_moved / med[run.name] / GB for run in runs if isinstance(run, Stream)}
    stream_gbps = max(stream_bw.values())
    angel_s, torch_s = med["angel"], med["torch"]
    angel_gbps = BYTES_PER_PARAM * args.params / angel_s / GB
    report = {
        "params": args.params,
        "angel_ms": round(angel_s * 1e3, 3),
        "torch_fused_copy_ms": round(torch_s * 1e3, 3),
        "ratio_vs_torch": round(torch_s / angel_s, 3),
        "angel_gbps": round(angel_gbps, 2),
        "stream_gbps": round(stream_gbps, 2),
        **{f"{name}_gbps": round(bw, 2) for name, bw in stream_bw.items()},
        "roofline_fraction": round(angel_gbps / stream_gbps, 3),
        "threads": args.threads,
        "isa": info["isa"] if args.isa == "auto" else args.isa,
        "implementation": info["implementation"],
        "repeats": args.repeats,
    }
    if "deepspeed" in med:
        report["deepspeed_ms"] = round(med["deepspeed"] * 1e3, 3)
        report["ratio_vs_deepspeed"] = round(med["deepspeed"] / angel_s, 3)
        report["angel_fp32_ms"] = round(med["angel_fp32"] * 1e3, 3)
        report["ratio_vs_deepspeed_same_job"] = round(med["deepspeed"] / med["angel_fp32"], 3)
    report.update(report_extra)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
