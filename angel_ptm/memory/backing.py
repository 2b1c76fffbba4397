"""Disk slots backed by a checkpoint: a loaded page's bytes already lie in a checkpoint file, so the slot that is
its disk copy points there instead of being written.

Loading a checkpoint fills every page; a page placed on disk would then be written to its slot, only for the next
step to read it back. Instead the loader *offers* the page's source (`Extent`s: byte ranges of checkpoint files
and where each lands in the page; every other byte of the page is zero) together with the page's version and
checksum. When the page next leaves host memory unchanged, `DiskTier.adopt` takes a slot for it and records the
extents there (no write): reading that slot reads the extents, and the bytes must match the checksum taken at
load. Writing the slot, freeing it, or `settle` (which copies what is still backed into the slots themselves, so
no checkpoint file is needed any longer) ends the backing.

Files are held open from the offer on (`SourceFiles`, counted references): pruning or deleting the checkpoint
directory does not pull the bytes away from a page that still reads them.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from angel_ptm.errors import PageIOError
from angel_ptm.memory import memops


@dataclass(frozen=True)
class Extent:
    """`nbytes` bytes at `offset` in file `path`, which are the page's bytes at `page_offset`."""

    path: str
    offset: int
    nbytes: int
    page_offset: int


@dataclass(frozen=True)
class Source:
    """All of a page's bytes at `version`: the extents (sorted by page offset, disjoint), zeros elsewhere."""

    extents: tuple[Extent, ...]
    version: int
    checksum: int

    @property
    def paths(self) -> set[str]:
        return {e.path for e in self.extents}


def zero_outside(buffer: torch.Tensor, extents: tuple[Extent, ...]) -> bool:
    """Whether every byte of `buffer` (uint8, CPU) outside `extents` is zero."""
    position = 0
    for extent in extents:
        if extent.page_offset > position and buffer[position: extent.page_offset].any():
            return False
        position = extent.page_offset + extent.nbytes
    return not (position < buffer.numel() and buffer[position:].any())


class ZeroOutsideRuns:
    """A clearer of one page kind (PageManager.clearers) for a checkpoint load: a page made afresh while it runs is
    zeroed only outside the byte ranges (`runs`: page index -> [(start, end)]) its items will fill -- the padding
    between tensors and after the last -- not whole and then overwritten (4 MiB pages: ~40 ms of a 310 MB load's
    ~200 here). Its bytes outside them are zeros, as `zero_outside` would find."""

    def __init__(self, runs: dict[int, list[tuple[int, int]]]):
        self.runs = {index: sorted(ranges) for index, ranges in runs.items()}

    def __call__(self, index: int, buffer: torch.Tensor) -> None:
        flat = buffer.view(torch.uint8).reshape(-1)
        at = 0
        for start, end in self.runs.get(index, ()):
            if start > at:
                memops.zero_(flat[at:start])
            at = max(at, end)
        if at < flat.numel():
            memops.zero_(flat[at:])


class SourceFiles:
    """Read-only descriptors of checkpoint files, open while any offer or backed slot refers to them."""

    def __init__(self):
        self._fds: dict[str, list[int]] = {}  # path -> [fd, references]
        self._lock = threading.Lock()
        self._closing: list[threading.Thread] = []

    def ref(self, paths) -> None:
        with self._lock:
            for path in paths:
                entry = self._fds.get(path)
                if entry is None:
                    try:
                        entry = self._fds[path] = [os.open(path, os.O_RDONLY), 0]
                    except OSError as exc:
                        raise PageIOError(f"cannot open checkpoint file {path}: {exc.strerror}",
                                          errno=exc.errno or 0, path=path) from None
                entry[1] += 1

    def unref(self, paths) -> None:
        with self._lock:
            for path in paths:
                entry = self._fds[path]
                entry[1] -= 1
                if not entry[1]:
                    del self._fds[path]
                    self._close_later(entry[0])

    def _close_later(self, fd: int) -> None:
        """Closed by a thread of its own (there is one per checkpoint file, once): the last descriptor of a
        deleted (pruned) checkpoint file frees its blocks on close, ~60 ms for 300 MB here, which is no reason for
        a step or a save to wait."""
        self._closing = [t for t in self._closing if t.is_alive()]
        thread = threading.Thread(target=os.close, args=(fd,), name="angel-ptm-backed-close", daemon=True)
        thread.start()
        self._closing.append(thread)

    def fd(self, path: str) -> int:
        with self._lock:
            return self._fds[path][0]

    @property
    def open_files(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        with self._lock:
            for fd, _refs in self._fds.values():
                os.close(fd)
            self._fds.clear()
            closing, self._closing = self._closing, []
        for thread in closing:
            thread.join()


class BackedRead:
    """A read of a backed slot under way on the tier's reader thread; `wait()` returns the bytes' checksum."""

    def __init__(self, future: Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> int:
        return self._future.result()


class BackedReader:
    """Reads a source's extents into a page buffer off the caller's thread (preadv releases the GIL)."""

    def __init__(self, files: SourceFiles, checksum):
        self.files, self.checksum = files, checksum
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, source: Source, buffer: torch.Tensor) -> BackedRead:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="angel-backed-read")
        paths = source.paths
        self.files.ref(paths)  # the files stay open for the read, even if the slot is unbacked meanwhile
        fds = {path: self.files.fd(path) for path in paths}
        return BackedRead(self._pool.submit(self._read_then_unref, source, fds, buffer))

    def _read_then_unref(self, source: Source, fds: dict[str, int], buffer: torch.Tensor) -> int:
        try:
            return self._read(source, fds, buffer)
        finally:
            self.files.unref(source.paths)

    def _read(self, source: Source, fds: dict[str, int], buffer: torch.Tensor) -> int:
        view = memoryview(buffer.numpy()).cast("B")
        position = 0
        for extent in source.extents:
            if extent.page_offset > position:
                memops.zero_(buffer[position: extent.page_offset])
            target = view[extent.page_offset: extent.page_offset + extent.nbytes]
            done = 0
            while done < extent.nbytes:
                try:
                    got = os.preadv(fds[extent.path], [target[done:]], extent.offset + done)
                except OSError as exc:
                    raise PageIOError(f"cannot read {extent.nbytes} bytes at offset {extent.offset} of checkpoint "
                                      f"file {extent.path}: {exc.strerror}", errno=exc.errno or 0,
                                      path=extent.path) from None
                if got <= 0:
                    raise PageIOError(f"checkpoint file {extent.path} ends before offset "
                                      f"{extent.offset + extent.nbytes} (truncated?)", path=extent.path)
                done += got
            position = extent.page_offset + extent.nbytes
        if position < len(view):
            memops.zero_(buffer[position:])
        return self.checksum(buffer)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
