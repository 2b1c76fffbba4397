"""Engine overhead when everything fits on the device tier: Engine step vs a plain PyTorch loop, same model and data.

    python -m tools.bench.overhead [--dim 384] [--layers 6] [--seq 128] [--batch 8] [--steps 5] [--repeats 5]

Each repeat times `--steps` training steps (forward, backward, AdamW step) of the plain loop and of the engine,
alternating which goes first, after warm-up steps; the figures are medians over repeats of the mean step time.
Last line: JSON with `engine_s`, `torch_s` and `ratio` = engine_s / torch_s (goal <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import angel_ptm
from angel_ptm.models import GPT, GPTConfig


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads, dim=args.dim))


def batches(args, n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (args.batch, args.seq), generator=g),
             torch.randint(0, 256, (args.batch, args.seq), generator=g)) for _ in range(n)]


class TorchLoop:
    def __init__(self, args):
        self.model = make_model(args)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)

    def step(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class EngineLoop:
    def __init__(self, args):
        config = {"optimizer": {"lr": 1e-4, "weight_decay": 0.1},
                  "memory": {"page_bytes": args.page_bytes, "device_budget": "auto", "host_budget": "auto"},
                  "trainer": {"device": "cpu"}}
        self.engine = angel_ptm.initialize(make_model(args), config)

    def step(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()


def time_steps(loop, data) -> float:
    t0 = time.perf_counter()
    for x, y in data:
        loop.step(x, y)
    return (time.perf_counter() - t0) / len(data)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--page-bytes", default="16MiB")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())

    loops = {"torch": TorchLoop(args), "engine": EngineLoop(args)}
    data = batches(args, args.steps)
    for loop in loops.values():
        time_steps(loop, batches(args, args.warmup))
    times = {"torch": [], "engine": []}
    for r in range(args.repeats):
        order = ["torch", "engine"] if r % 2 == 0 else ["engine", "torch"]
        for name in order:
            times[name].append(time_steps(loops[name], data))
        if not args.json:
            print(f"repeat {r}: torch {times['torch'][-1] * 1e3:.1f} ms/step, engine {times['engine'][-1] * 1e3:.1f} ms/step")
    loops["engine"].engine.close()
    engine_s, torch_s = statistics.median(times["engine"]), statistics.median(times["torch"])
    n_params = sum(p.numel() for p in loops["torch"].model.parameters())
    report = {"params": n_params, "engine_s": round(engine_s, 5), "torch_s": round(torch_s, 5),
              "ratio": round(engine_s / torch_s, 4), "repeats": args.repeats, "steps": args.steps}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
