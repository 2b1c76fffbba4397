"""The one small device interface: where compute runs and how bytes cross between the host and device tiers.

On CUDA, host<->device copies run on two streams named for their direction and complete through events; on CPU
the "device" tier is a separate budgeted pool in ordinary memory and a copy is a plain memcpy.
"""

from __future__ import annotations

import torch


def compute_device(preference: str = "auto") -> torch.device:
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)


class CopyHandle:
    def __init__(self, event: "torch.cuda.Event | None" = None):
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


_DONE = CopyHandle()


class Copier:
    """Copies between page buffers; asynchronous on CUDA (pinned host memory), synchronous on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.host_to_device_stream = torch.cuda.Stream(device)
            self.device_to_host_stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        if not self.is_cuda:
            dst.copy_(src)
            return _DONE
        stream = self.host_to_device_stream if dst.device.type == "cuda" else self.device_to_host_stream
        # The copy must see everything compute has written to `src` (or still reads from `dst`) so far.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return CopyHandle(event)
