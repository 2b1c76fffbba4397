"""Checkpoint benchmark: save and load of a GPT whose states live mostly on disk, against the disk's ceiling.

    python -m tools.bench.checkpoint --dir DIR [--dim 512] [--layers 8] [--page-mib 4] [--device-frac 0.1]
                                     [--host-frac 0.1] [--repeats 5] [--async-steps 6] [--async-gbps auto|G|none]
                                     [--every 20]

In one run, interleaved round by round so every figure sees the same disk weather:
- save: `engine.save_checkpoint` (every state kind, streamed page by page from whichever tier holds it, checksummed,
  fsynced, renamed) -> `save_gbps` = checkpoint bytes / seconds;
- load: `engine.load_checkpoint` of that checkpoint into the engine, the files first dropped from the page cache
  (posix_fadvise DONTNEED after fsync: no root needed) -> `load_gbps`; dropped again after it, so the next round's
  save reads the loaded pages (their disk slots read that checkpoint) from the disk, not from memory;
- raw: (before ours in even rounds, after in odd ones) the disk's ceiling for the same number of bytes, the
  fastest this round of three plain loops of 16 MiB writes and one fsync (buffered; buffered with each 32 MiB
  handed to the disk by posix_fadvise as written; O_DIRECT; the buffer in huge pages, as ours) -> `raw_write_gbps`
  (`raw_write_plain_gbps`: the buffered loop alone), and of two loops of 16 MiB reads after the same DONTNEED
  (buffered; O_DIRECT) ->
  `raw_read_gbps` (`raw_read_direct_gbps`: the O_DIRECT loop alone, how page files are read); `save_ratio` and
  `load_ratio` are ours over those (goal >= 0.8). A save also reads the pages
  resting on the disk tier (`save_read_bytes`): `save_ratio_io` compares it with that raw read plus the raw write
  of the checkpoint. A load that had to write pages into their page files (`load_page_write_bytes`; 0 since
  loaded pages back their slots with the checkpoint's bytes) is compared likewise in `load_ratio_io`;
- RSS: sampled every millisecond during each save; `rss_growth_pages` = (peak - before) / page size (goal <= 4),
  the median, and each round's. DCP's own import (`dcp_import_bytes`, ~700 modules) happens before, once;
- torch.save: what a plain-torch user does, `torch.save({"model": ..., "optimizer": ...})` of the same tensors
  held in RAM, fsynced -> `torch_save_s` (and its GB/s);
- async: `engine.save_checkpoint(..., background=True)` (`checkpoint.async_save`) while training steps go on:
  `async_step_slowdown` = the steps while it is written, plus the time `save_checkpoint` blocked (the snapshot),
  over as many median steps of the `--async-steps` before and after it (goal <= 1.1), with the steps it spanned,
  its seconds and the bytes it staged (pages in memory); `--async-gbps` paces it (`checkpoint.async_max_gbps`;
  "auto" with `--every`: the pace that writes it in half of `every` steps' time).
  `--repeats` saves, one after another, each round's figure and their median (`async_step_slowdown_each`).
GB/s are 1e9 bytes per second; every figure is the median over `--repeats` rounds, the ratios the median of each
round's ratio. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

import angel_ptm
from angel_ptm.io.slot_file import anonymous_aligned
from angel_ptm.models import GPT, GPTConfig

GB = 1e9
CHUNK = 16 << 20
WRITE_MODES = ("buffered", "kicked", "direct")


def make_engine(args, disk_dir: str, state_bytes_per_kind: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads, dim=args.dim))
    states = 4 * state_bytes_per_kind  # param, grad, exp_avg, exp_avg_sq
    page = args.page_mib << 20
    config = {"optimizer": {"lr": 1e-4, "weight_decay": 0.1},
              "memory": {"page_bytes": page, "disk_dir": disk_dir,
                         "device_budget": max(int(states * args.device_frac), 24 * page),
                         "host_budget": max(int(states * args.host_frac), 24 * page)},
              "trainer": {"device": "cpu", "grad_clip": 0},
              "checkpoint": {"async_max_gbps": args.async_gbps, "every": args.every}}
    return angel_ptm.initialize(model, config)


def drop_cache(paths) -> None:
    """Clean pages of these files leave the page cache, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.is_file()]


def raw_write(path: Path, nbytes: int, buffer, mode: str) -> float:
    """`nbytes` written by 16 MiB writes and fsynced, with `mode`: "buffered"; "kicked" (each 32 MiB written
    handed to the disk at once: posix_fadvise DONTNEED starts writeback); "direct" (O_DIRECT from an aligned
    buffer, the length rounded up to 4 KiB). Seconds."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if mode == "direct" else 0)
    fd = os.open(path, flags, 0o600)
    try:
        t0 = time.perf_counter()
        left, kicked, at = -(-nbytes // 4096) * 4096 if mode == "direct" else nbytes, 0, 0
        while left > 0:
            n = os.pwrite(fd, memoryview(buffer)[: min(left, CHUNK)], at)
            at, left = at + n, left - n
            if mode == "kicked" and at - kicked >= 32 << 20:
                os.posix_fadvise(fd, kicked, at - kicked, os.POSIX_FADV_DONTNEED)
                kicked = at
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()


def raw_read(path: Path, buffer, direct: bool) -> float:
    """The file read by 16 MiB reads after its pages left the cache, buffered or O_DIRECT. Seconds."""
    drop_cache([path])
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        at = 0
        while n := os.preadv(fd, [buffer], at):
            at += n
        return time.perf_counter() - t0
    finally:
        os.close(fd)


class PeakRSS:
    """The process's peak RSS while active, sampled every millisecond by a thread."""

    def __enter__(self):
        self.process = psutil.Process()
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def torch_save(engine, path: Path) -> tuple[float, int]:
    """A plain-torch checkpoint of the same states, held in RAM: the model's weights and AdamW's moments."""
    model = {slot.name: engine.state("param", slot.name) for slot in engine.layout.slots}
    optim = {slot.name: {"exp_avg": torch.randn(slot.shape), "exp_avg_sq": torch.rand(slot.shape),
                         "step": torch.tensor(2.0)} for slot in engine.layout.slots}
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model, "optimizer": optim}, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    return seconds, path.stat().st_size


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where page files and checkpoints go (an SSD)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--page-mib", type=int, default=4)
    parser.add_argument("--device-frac", type=float, default=0.1, help="share of the states on the device tier")
    parser.add_argument("--host-frac", type=float, default=0.1, help="share of the states on the host tier")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--async-steps", type=int, default=6,
                        help="steps timed before and after the save beside training")
    parser.add_argument("--async-gbps", type=lambda v: v if v == "auto" else None if v == "none" else float(v),
                        default="auto", help='checkpoint.async_max_gbps for the save beside training (default '
                        '"auto", as the config\'s: written in half the time of --every steps; "none": unpaced)')
    parser.add_argument("--every", type=int, default=20,
                        help="checkpoint.every, the interval an \"auto\" pace spreads a save over (default 20)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)

    # torch.distributed.checkpoint imports ~700 modules at first use (~47 MiB of RSS): a one-time cost of the
    # process, whatever the model, paid here so the saves' RSS growth is the checkpoint's own.
    rss0 = psutil.Process().memory_info().rss
    import angel_ptm.checkpoint  # noqa: F401

    import_bytes = psutil.Process().memory_info().rss - rss0
    med = statistics.median
    os.makedirs(args.dir, exist_ok=True)  # as every bench: a --dir that does not exist yet is made
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        probe = GPT(GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                              dim=args.dim))
        per_kind = sum(p.numel() * 4 for p in probe.parameters())
        del probe
        engine = make_engine(args, str(work / "pages"), per_kind)
        try:
            x = torch.randint(0, 256, (args.batch, args.seq))
            for _ in range(2):  # moments nonzero, pages settled on their tiers
                engine.backward(engine(x, x))
                engine.step()
            in_use = engine.memory_stats()["in_use"]
            saves, loads, writes, reads, growth, torch_s, landed = [], [], [], [], [], [], []
            plain_writes, save_reads, direct_reads = [], [], []
            ckpt_bytes = torch_bytes = 0
            # aligned for O_DIRECT, in transparent huge pages as ours are (O_DIRECT into 4 KiB pages ran 2-3x slower)
            buffer = memoryview(anonymous_aligned(CHUNK).numpy())
            buffer[:] = os.urandom(CHUNK)
            for r in range(args.repeats):
                ckpt, raw = work / f"ckpt-{r}", work / "raw.bin"
                size = ckpt_bytes or 310 << 20  # the first round's raw phases use a guess until the size is known

                def ours():
                    nonlocal ckpt_bytes
                    with PeakRSS() as rss:
                        t0 = time.perf_counter()
                        engine.save_checkpoint(ckpt, extra={"round": r})
                        saves.append(time.perf_counter() - t0)
                    save_reads.append(engine.last_checkpoint_read_bytes)
                    growth.append((rss.peak - rss.before) / (args.page_mib << 20))
                    ckpt_bytes = sum(p.stat().st_size for p in files(ckpt))
                    drop_cache(files(ckpt))
                    moved = engine.memory_stats()["moved"]
                    t0 = time.perf_counter()
                    engine.load_checkpoint(ckpt)
                    loads.append(time.perf_counter() - t0)
                    # The loaded pages' disk slots read this checkpoint's bytes (memory/backing.py): out of the
                    # page cache, as a load through it leaves them, the next save would find them in memory
                    drop_cache(files(ckpt))
                    after = engine.memory_stats()["moved"]
                    landed.append(after.get("host->disk", 0) - moved.get("host->disk", 0))

                def plain():  # the disk's ceiling: the fastest of the plain ways, this round
                    scale = (ckpt_bytes or size) / size
                    times = {mode: raw_write(raw, size, buffer, mode) * scale for mode in WRITE_MODES}
                    plain_writes.append(times["buffered"])
                    writes.append(min(times.values()))
                    fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    for at in range(0, size, CHUNK):  # the file to read back
                        os.pwrite(fd, memoryview(buffer)[: min(CHUNK, size - at)], at)
                    os.close(fd)
                    read = {direct: raw_read(raw, buffer, direct) * scale for direct in (False, True)}
                    reads.append(min(read.values()))
                    direct_reads.append(read[True])
                    raw.unlink()

                for phase in ((ours, plain) if r % 2 else (plain, ours)):  # neither always goes first
                    phase()
                seconds, torch_bytes = torch_save(engine, work / "torch.pt")
                torch_s.append(seconds)
                (work / "torch.pt").unlink()
                shutil.rmtree(ckpt)
            # A save beside training: step times while it is written against step times without one.
            def train_step() -> float:
                t0 = time.perf_counter()
                engine.backward(engine(x, x))
                engine.step()
                return time.perf_counter() - t0

            rounds = []  # (slowdown, steps during, blocking seconds, save seconds, staged bytes, median step)
            base = [train_step() for _ in range(args.async_steps)]
            for r in range(args.repeats):  # several saves beside training: the median, as for every figure
                t0 = time.perf_counter()
                pending = engine.save_checkpoint(work / f"async-{r}", background=True)
                blocking = time.perf_counter() - t0  # the snapshot, taken before training goes on
                during = []
                while not pending.done() or not during:
                    during.append(train_step())
                engine.wait_for_checkpoint()
                after = [train_step() for _ in range(args.async_steps)]
                step = med(base + after)
                rounds.append(((blocking + sum(during)) / (len(during) * step), len(during), blocking,
                               pending.seconds, pending.staged_bytes, step))
                shutil.rmtree(work / f"async-{r}", ignore_errors=True)
                base = after
        finally:
            engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "checkpoint_bytes": ckpt_bytes, "params": per_kind // 4, "page_bytes": args.page_mib << 20,
        "states_in_use": in_use,
        "save_s": med(saves), "load_s": med(loads),
        "save_gbps": ckpt_bytes / med(saves) / GB, "load_gbps": ckpt_bytes / med(loads) / GB,
        "raw_write_gbps": ckpt_bytes / med(writes) / GB, "raw_read_gbps": ckpt_bytes / med(reads) / GB,
        # per round, ours against the raw loop of the same round (the disk's speed drifts between rounds)
        "raw_write_plain_gbps": ckpt_bytes / med(plain_writes) / GB,
        # the O_DIRECT loop alone: the page files' own reads are O_DIRECT (a save reads disk pages that way)
        "raw_read_direct_gbps": ckpt_bytes / med(direct_reads) / GB,
        "save_ratio": med([w / s for w, s in zip(writes, saves)]),
        # a save also reads the pages resting on disk from the page files: its I/O floor is that read plus the
        # checkpoint's write, at the round's raw speeds
        "save_read_bytes": med(save_reads),
        "save_ratio_io": med([(w + r * b / ckpt_bytes) / s for w, r, b, s in zip(writes, reads, save_reads, saves)]),
        "load_ratio": med([r / l for r, l in zip(reads, loads)]),
        # a load also writes the pages that rest on disk into the page files: its I/O floor is the checkpoint's
        # read plus that write, at the round's raw speeds
        "load_page_write_bytes": med(landed),
        "load_ratio_io": med([(r + w * b / ckpt_bytes) / l for r, w, b, l in zip(reads, writes, landed, loads)]),
        "rss_growth_pages": med(growth), "dcp_import_bytes": import_bytes, "rss_growth_pages_each": [round(g, 2) for g in growth],
        "torch_save_s": med(torch_s), "torch_save_gbps": torch_bytes / med(torch_s) / GB,
        # steps while a background save ran, plus the time it blocked, against the median of the steps before and
        # after it; the median over the rounds (each round's too)
        "async_step_slowdown": med(r[0] for r in rounds),
        "async_step_slowdown_each": [round(r[0], 3) for r in rounds],
        "async_steps_during": med(r[1] for r in rounds), "async_max_gbps": args.async_gbps,
        "async_blocking_s": med(r[2] for r in rounds), "async_blocking_s_each": [round(r[2], 3) for r in rounds],
        "async_save_s": med(r[3] for r in rounds), "async_staged_bytes": med(r[4] for r in rounds),
        "step_s": med(r[5] for r in rounds),
        "repeats": args.repeats,
    }
    if not args.json:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
