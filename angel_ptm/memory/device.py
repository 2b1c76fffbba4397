"""The one small device interface: where compute runs and how bytes cross between the host and device tiers.

On CUDA, host<->device copies run on two streams named for their direction and complete through events; on CPU
the "device" tier is a separate budgeted pool in ordinary memory and a copy is a plain memcpy.

A slot freed while the GPU may still use it carries a fence (a `CopyHandle`): its next user orders itself after
the fence, on the GPU where it runs there (`order_before_use`), so the host never waits for a copy or for queued
compute only to reuse a slot (tiers.BufferPool keeps the fences; the manager frees an evicted page's device slot as
soon as its copy is queued).
"""

from __future__ import annotations

import contextlib
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import psutil
import torch

from angel_ptm.errors import BudgetError
from angel_ptm.memory import memops


def compute_device(preference: str = "auto") -> torch.device:
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)


def pin_host_memory(owner: object, buffer: torch.Tensor) -> Callable[[], None]:
    """Page-lock the CPU memory of `buffer`, exactly its bytes, for asynchronous CUDA copies; it is unlocked when
    `owner` (which must keep `buffer` alive) is collected or when the returned callable is called.

    torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two, so a 40 GiB host pool
    would lock 64 GiB; registering an ordinary allocation with CUDA locks what the budget says."""
    address, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if nbytes == 0:
        return lambda: None
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(address, nbytes, 0))
    if error != 0:
        raise BudgetError("host", nbytes, int(psutil.virtual_memory().available),
                          what=f"page-locked (pinned) memory: cudaHostRegister failed with CUDA error {error}")
    return weakref.finalize(owner, _unpin, cudart, address)


def _unpin(cudart, address: int) -> None:
    finish_copies()
    cudart.cudaHostUnregister(address)  # at exit CUDA may already be gone: nothing to do then


def finish_copies(device: torch.device | None = None) -> None:
    """Let every copy queued on the GPU finish (a pool's memory is about to go: copies the host did not wait for,
    since their completion is ordered on the GPU, may still touch it). At exit CUDA may already be gone: then
    there is nothing to wait for."""
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(device)


class CopyHandle:
    """Completion of one copy: a CUDA event, a future of the CPU copy thread, or nothing (already done)."""

    def __init__(self, event: "torch.cuda.Event | None" = None, future: Future | None = None):
        self._event, self._future = event, future

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or self._event.query()

    @property
    def pending(self) -> bool:
        """Something may still be under way (a copy that was not done inline)."""
        return self._event is not None or self._future is not None

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()  # re-raises a failed copy here
            self._future = None
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def order_before_use(self, device: torch.device) -> None:
        """Order what is issued next on `device` after this: on CUDA, the current stream waits for the event (the
        host does not); on the host (a pool in CPU memory, or a CPU copy thread's future), wait here."""
        if self._event is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self._event)
        elif self._future is not None:
            self._future.result()
        elif self._event is not None:
            self._event.synchronize()

    def order_stream(self, stream: "torch.cuda.Stream") -> None:
        """`stream`'s work issued from now on runs after this (a CPU future: waited here)."""
        if self._event is not None:
            stream.wait_event(self._event)
        elif self._future is not None:
            self._future.result()


NO_WAIT = CopyHandle()  # a copy done inline, or a slot that nothing may still use


def compute_fence(device: torch.device) -> CopyHandle | None:
    """The point the current stream of a CUDA `device` has reached (what it has queued so far), for a slot freed now:
    the slot's next user waits for that much compute, not for all compute queued by the time it starts. None on CPU,
    where compute has run by the time the host frees anything."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return CopyHandle(event)


class Copier:
    """Copies between page buffers: on CUDA on two streams (pinned host memory); on CPU on a copy thread when
    `asynchronous` (torch's copy releases the GIL, so it overlaps compute), else inline."""

    def __init__(self, device: torch.device, asynchronous: bool = False):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._pool: ThreadPoolExecutor | None = None
        if self.is_cuda:
            self.host_to_device_stream = torch.cuda.Stream(device)
            self.device_to_host_stream = torch.cuda.Stream(device)
        elif asynchronous:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="angel-copy")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, wait: bool = False,
             after: CopyHandle | None = None) -> CopyHandle:
        """Start a copy of `src` into `dst`; `wait=True` says the caller waits at once (done inline on CPU).

        A copy to the device writes a slot whose last users are behind `after` (the fence the slot was freed with;
        `NO_WAIT`: nothing to wait for); without it, behind everything compute has queued so far. A copy to the host
        reads what compute wrote, so it always comes after everything compute has queued."""
        if not self.is_cuda:
            if after is not None:
                after.order_before_use(dst.device)
            if self._pool is None or wait:
                memops.copy_(dst, src)
                return NO_WAIT
            # One plain memcpy on the copy thread (numpy releases the GIL and uses no thread team of its own, so
            # it does not contend with compute's intra-op threads the way a second torch parallel copy would).
            return CopyHandle(future=self._pool.submit(np.copyto, dst.numpy(), src.numpy()))
        to_device = dst.device.type == "cuda"
        stream = self.host_to_device_stream if to_device else self.device_to_host_stream
        if to_device and after is not None:
            after.order_stream(stream)  # (its source, a host page, is settled: written by the host or a landed copy)
        else:  # the copy must see everything compute has written to `src` (or still reads from `dst`) so far
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return CopyHandle(event)

    def close(self) -> None:
        if self.is_cuda:  # copies the host no longer waits for end before the memory they touch may be freed
            for stream in (self.host_to_device_stream, self.device_to_host_stream):
                with contextlib.suppress(RuntimeError):  # (a CUDA error already raised: nothing more to wait for)
                    stream.synchronize()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
