"""The load's reads of checkpoint items into their pages (CheckedReader, storage.py, makes them): a dense item's
bytes land with its elements straight in the page (`InPlace`), any other item's whole (`Whole`); `PageReads` runs
one page's reads on a thread of its own while the loading thread takes the next page, and commits and hands back
each page once its reads have landed. The reading thread also checksums what it read (each item, and a page that
may rest on its checkpoint file) so the loading thread only compares: on two cores the loading thread's own work is
what a load waits for."""

from __future__ import annotations

import collections
import concurrent.futures

import torch

from angel_ptm.checkpoint.files import data_record_ends
from angel_ptm.io import checksums

PAGES_IN_FLIGHT = 2  # pages whose reads run while the next page's items are resolved


class InPlace:
    """One dense item read into its target: its bytes land (`parts`: the bytes before the elements, the elements
    in the target, the bytes after, read by `run_all` on any thread, which then checksums them: `landed`), then
    `commit` (the planner's thread) checks them and commits the target."""

    def __init__(self, reader, req, sinfo, planner, target, file, start: int, nbytes: int, crc: int):
        self.reader, self.req, self.sinfo, self.planner, self.target = reader, req, sinfo, planner, target
        self.file, self.start, self.nbytes, self.crc = file, start, nbytes, crc

    def parts(self) -> list[memoryview]:
        self.head, self.tail = bytearray(self.start), bytearray(self.sinfo.length - self.start - self.nbytes)
        self.view = memoryview(self.target.reshape(-1).view(torch.uint8).numpy()).cast("B")
        return [memoryview(self.head), self.view, memoryview(self.tail)]

    def landed(self, crc: int | None = None) -> None:
        """The bytes are in: their checksum (`crc`, the item's CRC-32C when the read took it)."""
        if crc is None:
            checksum = self.reader.checksum
            crc = checksum(self.tail, checksum(self.view, checksum(self.head)))
        self.got = crc

    def commit(self) -> None:
        if self.got != self.crc:
            raise self.reader.corrupt(self.sinfo)
        if not data_record_ends(self.head):  # checked bytes, but the elements are not where the manifest says
            raise self.reader.corrupt(self.sinfo, f"no tensor record ends at byte {self.start}")
        self.view = None
        self.planner.commit_tensor(self.req, self.target)
        note = getattr(self.planner, "loaded_from", None)
        if note is not None:  # the bytes lie as they are in the file
            note(self.req, self.target, self.file.path, self.sinfo.offset + self.start, self.nbytes)


class Whole:
    """Any other tensor item: read whole (`parts`) and checksummed (`landed`), then checked and unpacked into its
    target (`commit`, the planner's thread)."""

    def __init__(self, reader, req, sinfo, planner):
        self.reader, self.req, self.sinfo, self.planner = reader, req, sinfo, planner
        reader.checked_entry(sinfo)  # (the file is opened, a missing or short one named, in this thread)
        self.file = reader.open_file(sinfo.relative_path, "pages")
        self.data: bytearray | None = None

    def parts(self) -> list[memoryview]:
        self.data = bytearray(self.sinfo.length)
        return [memoryview(self.data)]

    def landed(self, crc: int | None = None) -> None:
        self.got = crc if crc is not None else self.reader.checksum(self.data)

    def commit(self) -> None:
        data, self.data = self.data, None
        self.reader.unpack(self.req, self.sinfo, self.reader.checked(self.sinfo, data, self.got), self.planner)


class PageReads:
    """Tensor items' reads grouped by the page they fill. Without a planner (one that cannot hold two pages, or
    a host too small to), each read runs and commits at once. With one, a page's reads run on a thread of this
    object's while the caller resolves the next page's items; once more than `depth` pages are being read, the
    oldest is waited for, its items checked and committed and the page released (`planner.release_page`, with
    the page's checksum taken on the thread after its reads when `planner.page_checksum` offered a function).
    Leaving the block finishes them (or, on an error, waits for the thread before the pages go back)."""

    def __init__(self, planner, depth: int = 1):
        self.planner, self.depth = planner, depth
        self._page, self._reads = None, []  # the page whose items are being resolved, and its reads
        self._running: collections.deque = collections.deque()  # (page, reads, future) on the thread, in order
        self._pool = None

    def __enter__(self) -> "PageReads":
        if self.planner is not None:
            self.planner.keep_held = True
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="angel-ptm-checkpoint-read")
        return self

    def page(self, page) -> None:
        """The next items go into `page` (None: a model buffer)."""
        if page is not self._page:
            self._submit()
            self._page = page

    def add(self, read: "InPlace | Whole") -> None:
        if self._pool is None:
            run_all([read])
            read.commit()
        else:
            self._reads.append(read)

    def _submit(self, depth: int | None = None) -> None:
        """The current page's reads to the thread; the pages before them finished, all but `depth`."""
        if self._reads or self._page is not None:
            reads, self._reads = self._reads, []
            # a page filled only by in-place reads holds its final bytes once they land
            sums = self.planner.page_checksum(self._page) if self._page is not None and all(
                isinstance(read, InPlace) for read in reads) else None
            self._running.append((self._page, reads, self._pool.submit(read_page, reads, sums)))
        while len(self._running) > (self.depth if depth is None else depth):
            page, reads, future = self._running.popleft()
            page_sum = future.result()
            for read in reads:
                read.commit()
            if page is not None and page is not self._page and all(page is not r[0] for r in self._running):
                self.planner.release_page(page, page_sum)

    def __exit__(self, kind, value, traceback) -> None:
        if self._pool is None:
            return
        try:
            if kind is None:
                self._submit()
                self._page = None
                self._submit(depth=0)
        finally:
            self._pool.shutdown(wait=True)  # no read still writes into a page when the pages go back
            self.planner.keep_held = False


def read_page(reads: list, page_checksum) -> int | None:
    """`run_all`, then `page_checksum()` (the page's checksum once its bytes are in) when given."""
    run_all(reads)
    return None if page_checksum is None else page_checksum()


def run_all(reads: list) -> None:
    """The reads' bytes, each run of items lying back to back in one file read by one preadv (a page's items
    usually are one run), each item checksummed as it lands: as its bytes are copied where the manifest's checksum
    is CRC-32C (checksums.copy_crc32c), after the read otherwise."""
    i = 0
    while i < len(reads):
        start, first, parts, chain, ends, end = i, reads[i], [], [], [], None
        while i < len(reads) and reads[i].file is first.file and (end is None or reads[i].sinfo.offset == end):
            new = reads[i].parts()
            parts += new
            chain += [True] + [False] * (len(new) - 1)
            ends.append(len(parts) - 1)
            end = reads[i].sinfo.offset + reads[i].sinfo.length
            i += 1
        fused = first.reader.checksum is checksums.crc32c
        sums = first.file.readinto_parts(parts, first.sinfo.offset, chain if fused else None)
        for read, last in zip(reads[start:i], ends):
            read.landed(sums[last] if sums is not None else None)
