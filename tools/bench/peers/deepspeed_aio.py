"""DeepSpeed's async I/O op (`aio_handle`, the ZeRO-Infinity NVMe swapper) on our benchmark's sizes.

Access pattern, as DeepSpeed's swapper (deepspeed/runtime/swap_tensor) does it: one file per swapped tensor,
`async_pwrite(tensor, path)` for a batch of tensors, then `wait()`; swap-in is the same with `async_pread`.
Here a tensor is one page: `total_bytes // page_bytes` files of `page_bytes` each, from page-aligned, page-locked
buffers made by the handle itself (`new_cpu_locked_tensor`, so no bounce copy), `queue_depth` of them in flight
per batch. The handle gets our `queue_depth` (libaio requests in flight per thread) and our thread count
(`intra_op_parallelism`: every page is split across that many threads), DeepSpeed's default 1 MiB block size,
and its defaults `single_submit=False, overlap_events=True`. DeepSpeed always opens with O_DIRECT, and every page
is written before any is read, so no read can come from the page cache. Each repeat uses fresh files; the figures
are medians over repeats, in GB/s (1e9 bytes).

Setup (CPU-only torch is fine; the op is JIT-built with ninja on first load, about 5 minutes on 2 cores, then
cached under ~/.cache/torch_extensions):
    apt-get install -y libaio-dev && pip install deepspeed
    python -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; assert B().is_compatible(); B().load()"
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

GB = 1e9
_state: dict = {}  # "op": the loaded async_io module, or "reason": why it is not available


def _load_op():
    if "op" not in _state and "reason" not in _state:
        try:
            import deepspeed
            import deepspeed.utils
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if not AsyncIOBuilder().is_compatible():
                raise RuntimeError("AsyncIOBuilder is not compatible (libaio-dev missing?)")
            _state["op"] = AsyncIOBuilder().load(verbose=False)
            _state["version"] = deepspeed.__version__
            deepspeed.utils._deepspeed_nvme_write_warning_emitted = True  # keep its SSD-endurance notice quiet
        except Exception as exc:  # ImportError, build failure, missing compiler...
            _state["reason"] = f"deepspeed aio unavailable: {type(exc).__name__}: {exc}".splitlines()[0][:300]
    return _state.get("op")


def unavailable_reason() -> str | None:
    """Why `measure` returned / would return None; None when DeepSpeed's aio op is usable."""
    _load_op()
    return _state.get("reason")


def _run(handle, submit, buffers, paths) -> float:
    """Moves every page in batches of len(buffers) in flight, then waits; returns seconds."""
    t0 = time.perf_counter()
    for start in range(0, len(paths), len(buffers)):
        batch = paths[start : start + len(buffers)]
        for buf, path in zip(buffers, batch):
            if submit(buf, path, 0) != 0:
                raise RuntimeError(f"submit failed on {path}")
        if handle.wait() != len(batch):
            raise RuntimeError("wait() completed fewer operations than submitted")
    return time.perf_counter() - t0


def measure(directory: str, total_bytes: int, page_bytes: int, queue_depth: int = 32, threads: int = 4,
            repeats: int = 1, block_bytes: int = 1 << 20) -> dict | None:
    """Write then read `total_bytes` as page-sized files in `directory` with DeepSpeed's aio_handle.

    Returns {"deepspeed_write_gbps", "deepspeed_read_gbps", "deepspeed_version"}, or None when DeepSpeed or its
    aio op is not usable or the measurement failed (see `unavailable_reason()`).
    """
    op = _load_op()
    if op is None:
        return None
    import torch

    n_pages = max(1, total_bytes // page_bytes)
    total = n_pages * page_bytes
    handle = op.aio_handle(min(block_bytes, page_bytes), queue_depth, False, True, threads)
    if page_bytes % handle.get_alignment():
        _state["reason"] = f"page_bytes must be a multiple of {handle.get_alignment()} for DeepSpeed aio"
        return None
    example = torch.empty(0, dtype=torch.uint8)
    buffers, work = [], None
    writes, reads = [], []
    try:
        gen = torch.Generator().manual_seed(0)
        for _ in range(min(queue_depth, n_pages)):
            buf = handle.new_cpu_locked_tensor(page_bytes, example)
            buf.copy_(torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=gen))
            buffers.append(buf)
        os.makedirs(directory, exist_ok=True)
        work = tempfile.mkdtemp(prefix="deepspeed-aio-", dir=directory)
        for r in range(repeats):
            paths = [os.path.join(work, f"r{r}_page{i}.swp") for i in range(n_pages)]
            expected = buffers[0].clone()
            writes.append(total / _run(handle, handle.async_pwrite, buffers, paths) / GB)
            for buf in buffers:
                buf.zero_()  # so the check below proves the bytes came back from the files
            reads.append(total / _run(handle, handle.async_pread, buffers, paths) / GB)
            if not torch.equal(buffers[0], expected):
                raise RuntimeError("data read back differs from data written")
            for path in paths:
                os.remove(path)
    except Exception as exc:
        _state["reason"] = f"deepspeed aio measurement failed: {type(exc).__name__}: {exc}"
        return None
    finally:
        for buf in buffers:
            handle.free_cpu_locked_tensor(buf)
        if work:
            shutil.rmtree(work, ignore_errors=True)
    _state.pop("reason", None)
    return {
        "deepspeed_write_gbps": round(statistics.median(writes), 3),
        "deepspeed_read_gbps": round(statistics.median(reads), 3),
        "deepspeed_version": _state["version"],
    }
