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

import errno as errno_mod
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from angel_ptm.errors import PageIOError
from angel_ptm.io.slot_file import ALIGNMENT, HUGE_PAGE, anonymous_aligned, open_direct_readonly, whole_blocks
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
    """Read-only descriptors of checkpoint files, open while any offer or backed slot refers to them: one
    through the page cache and, where the filesystem allows, one with O_DIRECT (`direct`)."""

    def __init__(self):
        self._fds: dict[str, list[int]] = {}  # path -> [fd, references, O_DIRECT fd or -1, size]
        self._lock = threading.Lock()
        self._closing: list[threading.Thread] = []

    def ref(self, paths) -> None:
        with self._lock:
            for path in paths:
                entry = self._fds.get(path)
                if entry is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError as exc:
                        raise PageIOError(f"cannot open checkpoint file {path}: {exc.strerror}",
                                          errno=exc.errno or 0, path=path) from None
                    entry = self._fds[path] = [fd, 0, _open_direct(path), os.fstat(fd).st_size]
                entry[1] += 1

    def unref(self, paths) -> None:
        with self._lock:
            for path in paths:
                entry = self._fds[path]
                entry[1] -= 1
                if not entry[1]:
                    del self._fds[path]
                    self._close_later(entry[0], entry[2])

    def _close_later(self, *fds: int) -> None:
        """Closed by a thread of its own (there is one per checkpoint file, once): the last descriptor of a
        deleted (pruned) checkpoint file frees its blocks on close, ~60 ms for 300 MB here, which is no reason for
        a step or a save to wait."""
        self._closing = [t for t in self._closing if t.is_alive()]
        thread = threading.Thread(target=_close_all, args=fds, name="angel-ptm-backed-close", daemon=True)
        thread.start()
        self._closing.append(thread)

    def fd(self, path: str) -> int:
        with self._lock:
            return self._fds[path][0]

    def direct(self, path: str) -> tuple[int, int]:
        """(the O_DIRECT descriptor or -1, the file's size)."""
        with self._lock:
            entry = self._fds[path]
            return entry[2], entry[3]

    @property
    def open_files(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        with self._lock:
            for fd, _refs, direct, _size in self._fds.values():
                _close_all(fd, direct)
            self._fds.clear()
            closing, self._closing = self._closing, []
        for thread in closing:
            thread.join()


def _open_direct(path: str) -> int:
    try:
        return open_direct_readonly(path)  # (-1 where refused, as on tmpfs: the page cache serves)
    except OSError:
        return -1


def _close_all(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


class BackedRead:
    """A read of a backed slot under way on the tier's reader thread; `wait()` returns the bytes' checksum."""

    def __init__(self, future: Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> int:
        return self._future.result()


STAGE_MAX = 16 << 20  # bytes of blocks a backed read stages at most (larger pages read through the page cache)


class BackedReader:
    """Reads a source's extents into a page buffer off the caller's thread. Where the file takes O_DIRECT, the
    whole blocks around a file's extents come in with one read into a huge-page staging buffer of this reader's
    and each extent is copied out of it (a page read just after a load, its file not in the page cache, took
    ~3x as long through the page cache here); the rest (the file's last partial block) through the page cache
    (preadv: the GIL is released)."""

    def __init__(self, files: SourceFiles, checksum):
        self.files, self.checksum = files, checksum
        self._pool: ThreadPoolExecutor | None = None
        # The pool's one thread's O_DIRECT staging buffer, kept between reads; dropped (`release_staging`) once no
        # slot is backed any more
        self._staging: torch.Tensor | None = None

    def submit(self, source: Source, buffer: torch.Tensor) -> BackedRead:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="angel-backed-read")
        paths = source.paths
        self.files.ref(paths)  # the files stay open for the read, even if the slot is unbacked meanwhile
        fds = {path: self.files.fd(path) for path in paths}
        direct = {path: self.files.direct(path) for path in paths}
        return BackedRead(self._pool.submit(self._read_then_unref, source, fds, direct, buffer))

    def _read_then_unref(self, source: Source, fds: dict[str, int], direct: dict, buffer: torch.Tensor) -> int:
        try:
            return self._read(source, fds, direct, buffer)
        finally:
            self.files.unref(source.paths)

    def _read(self, source: Source, fds: dict[str, int], direct: dict, buffer: torch.Tensor) -> int:
        view = memoryview(buffer.numpy()).cast("B")
        staged = self._stage(source, direct, len(view))
        position = 0
        for extent in source.extents:
            if extent.page_offset > position:
                memops.zero_(buffer[position: extent.page_offset])
            target = view[extent.page_offset: extent.page_offset + extent.nbytes]
            done = 0
            if extent.path in staged:  # the part of it the staged blocks hold
                start, data = staged[extent.path]
                at = extent.offset - start
                done = max(0, min(extent.nbytes, len(data) - at))
                target[:done] = data[at: at + done]
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

    def _stage(self, source: Source, direct: dict, page_bytes: int) -> dict[str, tuple[int, memoryview]]:
        """path -> (where in the file they start, the whole blocks around the source's extents in that file, read
        with O_DIRECT into the staging buffer), for the files that take O_DIRECT and whose extents lie close
        together (their blocks at most twice the page and STAGE_MAX, with the file's last partial block left
        out)."""
        spans = {}
        for extent in source.extents:
            lo, hi = spans.get(extent.path, (extent.offset, extent.offset + extent.nbytes))
            spans[extent.path] = (min(lo, extent.offset), max(hi, extent.offset + extent.nbytes))
        blocks = {}
        for path, (lo, hi) in spans.items():
            fd, size = direct[path]
            start, end = whole_blocks(lo, hi, size)
            if fd >= 0 and start < end:
                blocks[path] = (fd, start, end)
        total = sum(end - start for _, start, end in blocks.values())
        if not total or total > min(STAGE_MAX, 2 * page_bytes + len(blocks) * 2 * ALIGNMENT):
            return {}
        buffer = self._staging
        if buffer is None or buffer.numel() < total:
            buffer = self._staging = anonymous_aligned(-(-total // HUGE_PAGE) * HUGE_PAGE)
        staging = memoryview(buffer.numpy()).cast("B")
        staged, at = {}, 0
        for path, (fd, start, end) in blocks.items():
            done = 0
            while done < end - start:
                try:
                    got = os.preadv(fd, [staging[at + done: at + end - start]], start + done)
                except OSError as exc:
                    if exc.errno == errno_mod.EINVAL:  # O_DIRECT refused after all: the page cache serves
                        break
                    raise PageIOError(f"cannot read {end - start} bytes at offset {start} of checkpoint file "
                                      f"{path}: {exc.strerror}", errno=exc.errno or 0, path=path) from None
                if got <= 0:
                    break  # (shorter than it was: the reads through the page cache name it)
                done += got
            staged[path] = (start, staging[at: at + done])
            at += end - start
        return staged

    def release_staging(self) -> None:
        """No slot reads a checkpoint any more: the staging buffer goes (a read under way keeps its own)."""
        self._staging = None

    def close(self) -> None:
        self._staging = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
