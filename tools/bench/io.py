"""I/O benchmark: pages written to and read from SSD through the PageManager's disk tier, against the disk's ceiling.

    python -m tools.bench.io --dir DIR [--gib 2] [--page-mib 64] [--threads 4] [--queue-depth 32] [--repeats 5]
                                       [--warmup 1]

In one run, interleaved repeat by repeat so that both see the same disk weather:
- angel: `--gib` of host pages evicted to the disk tier (`PageManager.evict`: every write in flight at once, CRC32C
  checksums computed in the I/O workers) and fsynced, then brought back (`prefetch(...).wait()`, checksums
  verified);
- raw: the same bytes written (and fsynced) then read in page-sized units by a plain O_DIRECT loop of `--threads`
  Python threads (os.pwritev / os.preadv release the GIL) — no checksums, no bookkeeping — on the very blocks the
  disk tier uses: its own O_DIRECT descriptor on the tier's slot file, each page's bytes at that page's slot. A
  virtual disk's regions differ in speed (two files written alike here differed by up to 20%), so a ceiling
  measured on another file would compare placements, not engines. Its buffers come from the same allocator as
  the host tier's slab (aligned_empty: transparent huge pages for large CPU buffers), so both transfer into the
  same kind of memory. The fsync in both write phases keeps a virtual disk's write-back cache from flattering
  one write phase and slowing the read phase that follows it;
- fio (if installed): the same sizes, psync engine, direct=1, `--threads` jobs;
- DeepSpeed's aio_handle (if it is installed and its op builds): tools/bench/peers/deepspeed_aio.py.
The last line is one JSON object: read/write GB/s (1e9 bytes/s, medians over `--repeats` rounds after `--warmup`
uncounted ones) and the ratios angel / raw.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import torch

from angel_ptm.io import aligned_empty, create_engine
from angel_ptm.io.engine import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS
from angel_ptm.memory import BufferPool, DiskTier, PageManager, Tier

GB = 1e9


def angel_write(manager: PageManager, pages) -> float:
    for page in pages:
        page.mark_dirty()  # so the write happens instead of dropping a clean page
    t0 = time.perf_counter()
    manager.evict(pages, Tier.DISK)
    for slot_file in manager.disk.files.values():
        os.fsync(slot_file.fd)  # the data is on the disk, not in a cache below us (the raw loop does the same)
    return time.perf_counter() - t0


def angel_read(manager: PageManager, pages) -> float:
    t0 = time.perf_counter()
    manager.prefetch(pages, Tier.HOST).wait()
    return time.perf_counter() - t0


class RawLoop:
    """The plain loop: each of `threads` threads moves its share of page-sized units with O_DIRECT pwritev/preadv,
    unit i at `offsets[i]` of the file at `path` (opened here with O_DIRECT, never created, resized or removed)."""

    def __init__(self, path: str, buffers, offsets, threads: int):
        self.page_bytes, self.threads = buffers[0].numel(), threads
        self.views = [memoryview(b.numpy()).cast("B") for b in buffers]
        self.offsets = list(offsets)
        self.fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))

    def _run(self, op) -> float:
        def worker(k):
            for i in range(k, len(self.views), self.threads):
                op(self.fd, [self.views[i]], self.offsets[i])

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(self.threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return time.perf_counter() - t0

    def write(self) -> float:
        seconds = self._run(os.pwritev)
        t0 = time.perf_counter()
        os.fsync(self.fd)
        return seconds + time.perf_counter() - t0

    def read(self) -> float:
        return self._run(os.preadv)

    def close(self) -> None:
        os.close(self.fd)


def fio_figures(directory: str, total: int, page_bytes: int, threads: int) -> dict:
    if shutil.which("fio") is None:
        return {}
    out = {}
    for mode, key in (("write", "fio_write_gbps"), ("read", "fio_read_gbps")):
        cmd = ["fio", "--name=angelbench", f"--directory={directory}", f"--rw={mode}", f"--bs={page_bytes}",
               f"--size={total // threads}", f"--numjobs={threads}", "--direct=1", "--ioengine=psync",
               "--group_reporting", "--output-format=json"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode == 0:
            job = json.loads(result.stdout)["jobs"][0][mode]
            out[key] = job["bw_bytes"] / GB
    for name in os.listdir(directory):
        if name.startswith("angelbench"):
            os.remove(os.path.join(directory, name))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="directory on the disk to measure")
    parser.add_argument("--gib", type=float, default=2.0, help="GiB written and read per round (>= 2 for the report)")
    parser.add_argument("--page-mib", type=int, default=64)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES >> 20,
                        help="size of one pread/pwrite inside the engine (the engine's default)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds measured (medians)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds run first and not counted (a virtual disk's first writes to fresh blocks are "
                             "slow for both contenders, and that is not what the ratio compares)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of pause between phases")
    parser.add_argument("--backend", default="auto", choices=["auto", "native", "python"])
    parser.add_argument("--no-peers", action="store_true", help="skip fio and DeepSpeed")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)

    page_bytes = args.page_mib << 20
    n_pages = max(1, int(args.gib * (1 << 30)) // page_bytes)
    total = n_pages * page_bytes
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < 2.2 * total:
        raise SystemExit(f"io bench: {args.dir} has {free / GB:.1f} GB free, needs {2.2 * total / GB:.1f} GB")
    work = tempfile.mkdtemp(prefix="angel-io-", dir=args.dir)
    say = (lambda *a: None) if args.json else print

    engine = create_engine(args.threads, args.queue_depth, args.chunk_mib << 20, backend=args.backend)
    manager = PageManager(
        BufferPool(Tier.DEVICE, page_bytes, 0),
        BufferPool(Tier.HOST, page_bytes, total),
        DiskTier(os.path.join(work, "tier"), page_bytes, total, engine),
    )
    pages = [manager.create_page("param", torch.uint8) for _ in range(n_pages)]
    gen = torch.Generator().manual_seed(0)
    for page in pages:  # real data (and every byte touched) so nothing is faster for being zero
        page.view().copy_(torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=gen))
    manager.disk.reserve("param", n_pages)
    raw_buffers = [aligned_empty(page_bytes) for _ in range(n_pages)]
    for src, dst in zip(pages, raw_buffers):
        dst.copy_(src.view())
    angel_write(manager, pages)  # untimed: gives every page its slot for good, so the raw loop knows where it is
    manager.prefetch(pages, Tier.HOST).wait()
    raw = RawLoop(manager.disk.path("param"), raw_buffers, [p.disk_slot * page_bytes for p in pages], args.threads)
    results = {"angel_write": [], "angel_read": [], "raw_write": [], "raw_read": []}
    for r in range(args.warmup + args.repeats):
        # Writes of both, a pause, then reads of both, the first of each pair alternating by round: a virtual
        # disk may still be flushing a write phase when the next phase starts, and both should pay for that alike.
        first_raw = r % 2 == 0
        counted = results if r >= args.warmup else {k: [] for k in results}
        phases = [("raw_write", raw.write), ("angel_write", lambda: angel_write(manager, pages))]
        for key, run in phases if first_raw else phases[::-1]:
            counted[key].append(total / run() / GB)
        time.sleep(args.settle)
        phases = [("raw_read", raw.read), ("angel_read", lambda: angel_read(manager, pages))]
        for key, run in phases if first_raw else phases[::-1]:
            counted[key].append(total / run() / GB)
        time.sleep(args.settle)
        label = f"round {r - args.warmup}" if r >= args.warmup else "warm-up"
        say(f"{label}: angel write {counted['angel_write'][-1]:.2f} read {counted['angel_read'][-1]:.2f} GB/s | "
            f"raw write {counted['raw_write'][-1]:.2f} read {counted['raw_read'][-1]:.2f} GB/s")
    raw.close()
    manager.close()
    engine.close()

    med = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "bytes": total, "page_bytes": page_bytes, "threads": args.threads, "queue_depth": args.queue_depth,
        "backend": engine.backend, "checksum": engine.checksum_algorithm,
        "repeats": args.repeats, "warmup": args.warmup,
        "read_gbps": round(med["angel_read"], 3), "write_gbps": round(med["angel_write"], 3),
        "raw_read_gbps": round(med["raw_read"], 3), "raw_write_gbps": round(med["raw_write"], 3),
        "read_ratio": round(med["angel_read"] / med["raw_read"], 3),
        "write_ratio": round(med["angel_write"] / med["raw_write"], 3),
    }
    if not args.no_peers:
        report.update({k: round(v, 3) for k, v in fio_figures(work, total, page_bytes, args.threads).items()})
        try:
            from tools.bench.peers import deepspeed_aio
        except ImportError:
            deepspeed_aio = None
        ds = deepspeed_aio.measure(work, total, page_bytes, args.queue_depth, args.threads) if deepspeed_aio else None
        if ds:
            report.update(ds)
            report["ratio_vs_deepspeed_read"] = round(report["read_gbps"] / ds["deepspeed_read_gbps"], 3)
            report["ratio_vs_deepspeed_write"] = round(report["write_gbps"] / ds["deepspeed_write_gbps"], 3)
        elif deepspeed_aio is not None:
            report["deepspeed"] = deepspeed_aio.unavailable_reason()
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
