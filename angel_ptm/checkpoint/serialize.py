"""How a checkpoint item's bytes are made: torch.save's archive, as FileSystemWriter writes it, with the zip records'
own CRC-32 off (the manifest's checksum covers every byte), a dense tensor's archive kept per layout and written
around its elements, and the checksum kept as the bytes pass (storage.py's CheckedWriter uses them)."""

from __future__ import annotations

import contextlib
import io
import zlib

import torch


class Containers:
    """torch.save of dense tensors, the archive around the elements written from a copy kept per tensor layout.

    With the zip records' own CRC-32 off (`no_zip_crc`), the bytes torch.save writes for a dense tensor are the same
    for every tensor of one dtype, shape and size but for its elements (checked when a layout is first seen: the
    elements are one write of exactly their bytes): the pickle, the records' headers and the central directory
    are taken once and written around each later tensor's elements, with no pickling (torch.save cost ~0.4 ms a
    page item here, in the thread a save beside training shares the GIL with). torch.load reads them as any."""

    MIN_BYTES = 4096  # smaller tensors: no layout cache (their elements could be mistaken for a header record)

    def __init__(self):
        self._known: dict[tuple, tuple[bytes, bytes] | None] = {}

    def write(self, data: torch.Tensor, sink, dense: bool) -> int | None:
        """torch.save of `data` into `sink`; where its elements begin in the bytes written, when known (a dense
        tensor of at least MIN_BYTES whose layout splits: a loader then reads them in place without searching the
        archive), else None."""
        nbytes = data.untyped_storage().nbytes()
        key = (data.dtype, tuple(data.shape), tuple(data.stride()), nbytes) if dense and nbytes >= self.MIN_BYTES \
            else None
        around = self._known.get(key) if key is not None else None
        if around is not None:
            sink.write(around[0])
            sink.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
            sink.write(around[1])
            return len(around[0])
        capture = _Capture(sink) if key is not None and key not in self._known else sink
        with no_zip_crc():  # the manifest's CRC-32 covers these bytes already
            torch.save(data, capture)
        if capture is sink:
            return None
        around = self._known[key] = capture.around(nbytes)
        return len(around[0]) if around is not None else None


class _Capture(io.RawIOBase):
    """Passes writes on to `sink`, keeping them (the elements' write by its length) to split the archive around
    the elements."""

    def __init__(self, sink):
        super().__init__()
        self.sink, self.parts = sink, []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self.parts.append(view.tobytes() if len(view) < Containers.MIN_BYTES else len(view))
        return self.sink.write(view)

    def around(self, nbytes: int) -> tuple[bytes, bytes] | None:
        """(the bytes before the elements, the bytes after), if the elements were one write of `nbytes` and every
        other write was smaller; else None (torch.save is used for this layout every time)."""
        large = [i for i, part in enumerate(self.parts) if isinstance(part, int)]
        if len(large) != 1 or self.parts[large[0]] != nbytes:
            return None
        i = large[0]
        return b"".join(self.parts[:i]), b"".join(self.parts[i + 1:])


@contextlib.contextmanager
def no_zip_crc():
    """torch.save without the zip archive's own CRC-32 of each record (the slowest part of torch.save: 1.15 vs
    1.54 GB/s into memory here), where torch has the switch; torch.load reads the archive either way."""
    switch, get = getattr(torch.serialization, "set_crc32_options", None), \
        getattr(torch.serialization, "get_crc32_options", None)
    if switch is None or get is None:
        yield
        return
    before = get()
    switch(False)
    try:
        yield
    finally:
        switch(before)


class CrcWriter(io.RawIOBase):
    """A write-only stream into `raw` that keeps the checksum (`function(data, value)`, zlib.crc32 by default)
    of what passed. Writes under `SMALL` bytes (torch.save's headers and records: ~40 per tensor) are gathered
    and passed on together: each checksum call releases the GIL, and on a save beside training every release
    hands the GIL to the training thread and waits up to a switch interval to get it back (a save of 225 items
    took 3.5-4 s that way, and slowed the steps around it by the handoffs). `finish()` passes the rest on."""

    SMALL = 64 << 10

    def __init__(self, raw, function=zlib.crc32):
        super().__init__()
        self.raw, self.function, self.crc = raw, function, 0
        self._pending = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        if len(view) < self.SMALL:
            self._pending += view
            if len(self._pending) >= self.SMALL:
                self.finish()
            return len(view)
        self.finish()
        self.crc = self.function(view, self.crc)
        self.raw.write(view)
        return len(view)

    def finish(self) -> None:
        """Everything written so far passed on (and checksummed)."""
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self.crc = self.function(pending, self.crc)
            self.raw.write(pending)

    def close(self) -> None:  # the file stays open for the next item
        pass
