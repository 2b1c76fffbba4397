"""DCP storage with checksums: files in FileSystemWriter's layout, so DCP's own reader and tools read them.

    writer = CheckedWriter(tmp_dir, info)    # dcp.save(..., storage_writer=writer)
    reader = CheckedReader(ckpt_dir)         # dcp.load(..., storage_reader=reader): every byte checked

A rank writes one file, `__<rank>_0.distcp`, its items in the order the planner lists them (page order, so each
page is read once), each item serialized as FileSystemWriter serializes it (`torch.save` of the chunk, raw bytes
for a bytes item). The writer records each item's checksum (CRC-32C from the native extension, zlib's CRC-32
without it: the manifest's "item_checksum" names it); the coordinator writes them into the manifest,
`angel_ptm.json` (with the CRC-32 of `.metadata` and of itself), then `.metadata` last by rename. A rank's file
is written through io/stream.py's SequentialWriter (O_DIRECT chunks written while the next fills). Files are
fsynced, then the directory. A reader verifies the manifest, `.metadata`, and every item it reads against them,
so a torn, truncated or bit-flipped file is a CheckpointCorruptError naming it, never wrong values.

`FAULT`: a test hook called at named points of a save ("item-written", "before-metadata", "before-rename"), so a
test can kill the process (or raise ENOSPC) exactly there.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import queue
import sys
import threading
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from angel_ptm.checkpoint.direct_reads import DirectFile
from angel_ptm.checkpoint.files import CheckpointFile, ReadAhead, data_record_ends, record_start
from angel_ptm.checkpoint.page_reads import PAGES_IN_FLIGHT, InPlace, PageReads, Whole
from angel_ptm.checkpoint.serialize import Containers, CrcWriter
from angel_ptm.errors import CheckpointCorruptError, CheckpointWriteError, PageIOError
from angel_ptm.io import checksums
from angel_ptm.io.stream import Pace, SequentialWriter

MANIFEST = "angel_ptm.json"
METADATA = ".metadata"
FORMAT = "angel-ptm checkpoint 1"
FAULT: Callable[[str], None] | None = None  # tests: called with a point's name during a save


def fault(point: str) -> None:
    if FAULT is not None:
        FAULT(point)


@dataclasses.dataclass
class _CheckedInfo(_StorageInfo):
    """A written item's place and its checksum (the coordinator moves the CRC into the manifest: `.metadata` holds
    torch's own _StorageInfo, so any DCP reader reads it)."""

    crc: int = 0
    dense: bool = False  # a tensor whose one storage is exactly its elements in row-major order
    start: int | None = None  # where a dense item's elements begin in it, when the writer knows


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """`data` into `path` whole or not at all: a temporary name, fsync, rename, fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class CheckedWriter(FileSystemWriter):
    """FileSystemWriter's layout, written in the planner's order with a checksum per item. `info`: JSON-able facts
    of the save the coordinator puts in the manifest (step, world size, layout)."""

    def __init__(self, path: str | os.PathLike, info: dict | None = None, pace: float | Pace | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        self._containers = Containers()
        self.info = info or {}
        self.pace = pace  # a save beside training may be paced (bytes per second, or a Pace)
        self.checksum = checksums.PREFERRED  # the items' checksum, named in the manifest

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """The items in plan order into one file: this thread resolves them (a page read, the item's elements
        copied out), a writer thread serializes, checksums and writes them, at most `QUEUE` items behind."""
        name = f"{plan.storage_data.prefix}0.distcp"
        path = Path(self.path) / name
        results: list[WriteResult] = []
        try:
            with SequentialWriter(path, max_bytes_per_s=self.pace) as stream:
                crc = checksums.function(self.checksum)
                with Pipeline(lambda job: self._write(stream, crc, name, *job)) as pipe:
                    for item in plan.items:
                        data = planner.resolve_data(item)
                        if item.type != WriteItemType.BYTE_IO:
                            data = data.detach().cpu()
                        pipe.put((item, data, results))
                        del data  # the writer holds it until written: at most QUEUE + 1 items exist at once
                    pipe.drain()
        except (OSError, PageIOError) as err:
            detail = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise CheckpointWriteError(f"checkpoint: cannot write {path}: {detail}", str(path),
                                       err.errno or 0) from None
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write(self, stream, crc, name: str, item, data, results: list) -> None:
        """One item, serialized as FileSystemWriter serializes it, straight into the file through its checksum."""
        offset = stream.tell()
        sink = CrcWriter(stream, crc)
        dense, start = False, None
        if isinstance(data, io.BytesIO):
            sink.write(data.getbuffer())
        else:
            dense = bool(sys.byteorder == "little" and data.is_contiguous() and not data.storage_offset()
                         and data.untyped_storage().nbytes() == data.numel() * data.element_size())
            start = self._containers.write(data, sink, dense)
        sink.finish()
        length = stream.tell() - offset
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_CheckedInfo(name, offset, length, crc=sink.crc, dense=dense,
                                                              start=start if dense else None)))
        fault("item-written")


    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator, once every rank wrote: the manifest, then `.metadata` last (by rename), then the
        directory fsynced. Only then is the directory a checkpoint."""
        directory = Path(self.path)
        crcs: dict[str, list[list[int]]] = {}
        storage = {}
        for rank_results in results:
            for result in rank_results:
                info = result.storage_data
                storage[result.index] = _StorageInfo(info.relative_path, info.offset, info.length)
                # [offset, length, crc] (+ [1] for a dense item, + [where its elements begin] when known)
                crcs.setdefault(info.relative_path, []).append(
                    [info.offset, info.length, info.crc] + ([1] if info.dense else [])
                    + ([info.start] if info.dense and info.start is not None else []))
        metadata.version = "1.0.0"
        metadata.storage_data = storage
        metadata.storage_meta = StorageMeta(checkpoint_id=str(directory), save_id=self.save_id)
        body = pickle.dumps(metadata)
        try:
            tmp = directory / (METADATA + ".tmp")
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            manifest = {"format": FORMAT, "info": self.info, "metadata_crc": zlib.crc32(body),
                        "item_checksum": self.checksum,
                        "files": {name: sorted(items) for name, items in sorted(crcs.items())}}
            write_durably(directory / MANIFEST, seal(manifest))
            fault("before-metadata")
            os.replace(tmp, directory / METADATA)
            fsync_dir(directory)
        except OSError as err:
            raise CheckpointWriteError(f"checkpoint: cannot write {err.filename or directory}: "
                                       f"{err.strerror or err}", str(directory), err.errno or 0) from None


def seal(manifest: dict) -> bytes:
    """The manifest as JSON with the CRC-32 of its own body."""
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return json.dumps({"crc": zlib.crc32(body.encode()), "manifest": body}).encode()


def read_manifest(directory: Path) -> dict:
    """The checked manifest of a checkpoint directory (CheckpointCorruptError naming the file otherwise)."""
    path = Path(directory) / MANIFEST
    try:
        outer = json.loads(path.read_bytes())
        body = outer["manifest"]
        ok = zlib.crc32(body.encode()) == outer["crc"]
        manifest = json.loads(body)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint {directory}: no {MANIFEST} (not a complete angel-ptm "
                                     f"checkpoint)", str(path)) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(f"checkpoint {directory}: {path} is unreadable: {err}", str(path)) from None
    if not ok or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"checkpoint {directory}: {path} fails its checksum (or is not an "
                                     f"angel-ptm manifest)", str(path))
    return manifest


class CheckedReader(FileSystemReader):
    """FileSystemReader that checks `.metadata` and every item it reads against the manifest's checksums."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.manifest = read_manifest(Path(path))
        # (file, offset) -> (length, checksum, dense: the item's tensor bytes lie in it as they are in memory,
        # where they begin in it: None when the writer did not record it)
        try:  # manifests before "item_checksum" used zlib's CRC-32
            self.checksum = checksums.function(self.manifest.get("item_checksum", "crc32"))
        except KeyError as err:
            raise CheckpointCorruptError(f"checkpoint {path}: {MANIFEST}: {err.args[0]}",
                                         str(Path(path) / MANIFEST)) from None
        self._crcs = {(name, entry[0]): (entry[1], entry[2], len(entry) > 3 and bool(entry[3]),
                                         int(entry[4]) if len(entry) > 4 else None)
                      for name, items in self.manifest["files"].items() for entry in items}
        self._metadata: Metadata | None = None
        self._files: dict[tuple[str, str], CheckpointFile] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """`.metadata`, checked against the manifest (callers read it once before DCP does: DCP takes a failure
        here for a missing global file and falls back to per-rank ones)."""
        if self._metadata is not None:
            return self._metadata
        path = Path(self.path) / METADATA
        try:
            body = path.read_bytes()
        except OSError as err:
            raise CheckpointCorruptError(f"checkpoint {self.path}: cannot read {path}: {err.strerror}",
                                         str(path)) from None
        if zlib.crc32(body) != self.manifest["metadata_crc"]:
            raise CheckpointCorruptError(f"checkpoint {self.path}: {path} fails its checksum", str(path))
        metadata = pickle.loads(body)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._metadata = metadata
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """The items in plan order (PageLoadPlanner lists them page by page, the pages in the order their bytes lie
        in the files: each file is read front to back): out of O_DIRECT chunks read ahead (direct_reads.py: 310 MB
        came in at 0.13-0.17 s here, 0.17-0.30 s through the page cache), or where the filesystem refuses O_DIRECT
        through the page cache, the kernel reading the next READ_AHEAD bytes of items ahead (WILLNEED, from a
        thread: 0.44-0.58 s with the kernel's own read-ahead alone). A dense item that fills its target whole is
        read straight into the target (one copy, chunk or page cache to page: no mapping, no unpickling) and
        checked there; any other item is read whole, checked, then unpacked. With a planner that
        can hold several pages, a thread reads the items of up to PAGES_IN_FLIGHT pages, through descriptors of
        its own, while this thread takes the next page (makes room, zeroes it) and, as each page's reads land,
        checks its items, unpacks what needs it and hands the page back. Every byte is checked against the
        manifest before the load counts; a mismatch is a CheckpointCorruptError naming the file (the planner's
        pages then hold part of it: the engine refuses to train on them)."""
        items = plan.items
        infos = [self.storage_data[req.storage_index] for req in items]
        # pages held at once: the one being resolved and those being read (fewer where the host holds few pages)
        depth = min(PAGES_IN_FLIGHT, planner.holdable() - 1) if hasattr(planner, "holdable") else 0
        paged = depth > 0  # (a PageLoadPlanner: it also says which page an item fills and releases each)
        try:
            direct = self._open_direct(items, infos)
            ranges = [(self.open_file(info.relative_path), info.offset, info.length) if info.relative_path not in
                      direct else (None, 0, 0) for info in infos]
            with ReadAhead(ranges, READ_AHEAD) as ahead, PageReads(planner if paged else None, depth) as reads:
                for position, (req, sinfo) in enumerate(zip(items, infos)):
                    ahead.reached(position)
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(self.item(sinfo)))
                        continue
                    if paged:
                        reads.page(planner.page_of(req))
                    reads.add(self._in_place(req, sinfo, planner) or Whole(self, req, sinfo, planner))
        finally:
            self.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open_direct(self, items, infos) -> set[str]:
        """The files whose tensor items the page reads take through O_DIRECT chunks read ahead (direct_reads.py),
        opened as their "pages" descriptors; the others are read through the page cache, the kernel asked ahead."""
        wanted: dict[str, list[tuple[int, int]]] = {}
        for req, info in zip(items, infos):
            if req.type != LoadItemType.BYTE_IO:
                wanted.setdefault(info.relative_path, []).append((info.offset, info.length))
        opened = set()
        for relative_path, spans in wanted.items():
            file = DirectFile.open(Path(self.path).absolute() / relative_path, spans) if DIRECT_READS else None
            if file is not None:
                self._files[(relative_path, "pages")] = file
                opened.add(relative_path)
        return opened

    def _in_place(self, req, sinfo, planner) -> "InPlace | None":
        """A dense item whose elements fill the planner's target exactly (same dtype and shape, contiguous, in
        CPU memory): its read (`InPlace`: the bytes land, then `commit` checks them); None (nothing read)
        otherwise. The item is read front to back (the bytes before the elements, the elements into the target,
        the bytes after), where the manifest says its elements begin; a checkpoint that does not say (an older
        one) has the archive's directory searched for them first, except a small item, read whole and unpacked
        instead."""
        entry = self.checked_entry(sinfo)
        sizes, dtype = self._saved_chunk(req)
        if not entry[2] or sizes is None or any(req.storage_offsets) or tuple(req.lengths) != sizes:
            return None
        target = planner.resolve_tensor(req).detach()
        nbytes = math.prod(sizes) * dtype.itemsize
        if (target.dtype != dtype or tuple(target.size()) != sizes or not target.is_contiguous()
                or target.device.type != "cpu" or not nbytes):
            return None
        file = self.open_file(sinfo.relative_path)
        start = entry[3]
        if start is None:
            if sinfo.length <= SMALL_ITEM:
                return None
            start = record_start(lambda at, n: file.read(sinfo.offset + at, n), sinfo.length, nbytes)
            if start is None:
                return None
        elif not 0 < start <= sinfo.length - nbytes:
            raise self.corrupt(sinfo, f"the manifest places its {nbytes} bytes of elements at byte {start}")
        return InPlace(self, req, sinfo, planner, target, self.open_file(sinfo.relative_path, "pages"), start, nbytes,
                        entry[1])

    def unpack(self, req, sinfo, data: bytearray, planner) -> None:
        """One tensor item (its checked bytes) into the planner's target: its elements straight from `data` when
        the writer marked it dense, else through torch.load."""
        loaded, where = self._dense(req, sinfo, data)
        if loaded is None:
            loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(loaded, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointCorruptError(f"checkpoint {self.path}: item {req.storage_index.fqn} holds "
                                         f"{tuple(tensor.size())}, the plan expects {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
        note = getattr(planner, "loaded_from", None)
        # (the bytes lie as they are in the file: not where the copy converted them to another dtype)
        if note is not None and where is not None and tensor.is_contiguous() and tensor.dtype == target.dtype:
            note(req, target, self.open_file(sinfo.relative_path).path,
                 sinfo.offset + where + tensor.data_ptr() - loaded.data_ptr(), tensor.numel() * tensor.element_size())

    def open_file(self, relative_path: str, reader: str = "") -> CheckpointFile:
        """The file open for reading; `reader` names a descriptor of its own (the page-reads thread's: each
        descriptor keeps the kernel's sequential read-ahead of its own reads, which two threads reading at two
        places through one would defeat)."""
        file = self._files.get((relative_path, reader))
        if file is None:
            path = Path(self.path).absolute() / relative_path
            try:
                file = self._files[(relative_path, reader)] = CheckpointFile(path)
            except FileNotFoundError:
                raise CheckpointCorruptError(f"checkpoint {self.path}: {path} is missing", str(path)) from None
            except OSError as err:
                raise CheckpointCorruptError(f"checkpoint {self.path}: cannot read {path}: {err.strerror}",
                                             str(path)) from None
        return file

    def corrupt(self, sinfo, why: str = "") -> CheckpointCorruptError:
        path = Path(self.path) / sinfo.relative_path
        what = f"the item at byte {sinfo.offset} ({sinfo.length} bytes): {why}" if why else \
            f"fails its checksum at byte {sinfo.offset} ({sinfo.length} bytes)"
        return CheckpointCorruptError(f"checkpoint {self.path}: {path} {what}", str(path))

    def checked_entry(self, sinfo) -> tuple:
        """The manifest's (length, checksum, dense, where the elements begin) of an item, which must lie whole in
        its file."""
        entry = self._crcs.get((sinfo.relative_path, sinfo.offset))
        if entry is None or entry[0] != sinfo.length or sinfo.offset + sinfo.length > self.open_file(
                sinfo.relative_path).size:
            path = Path(self.path) / sinfo.relative_path
            raise CheckpointCorruptError(f"checkpoint {self.path}: {path} is truncated or does not match the "
                                         f"manifest (item at byte {sinfo.offset}, {sinfo.length} bytes)", str(path))
        return entry

    def item(self, sinfo) -> bytearray:
        """An item's bytes, checked against the manifest: CheckpointCorruptError naming the file if they are
        missing or do not match."""
        self.checked_entry(sinfo)
        return self.checked(sinfo, self.open_file(sinfo.relative_path).read(sinfo.offset, sinfo.length))

    def checked(self, sinfo, data: bytearray, got: int | None = None) -> bytearray:
        """`data`, an item's bytes, if they match the manifest's checksum (CheckpointCorruptError otherwise);
        `got`: their checksum, when already taken."""
        if (self.checksum(data) if got is None else got) != self.checked_entry(sinfo)[1]:
            raise self.corrupt(sinfo)
        return data

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def _saved_chunk(self, req) -> tuple[tuple | None, torch.dtype | None]:
        """The sizes and dtype of the saved chunk an item holds, if the metadata says (None, None otherwise)."""
        saved = self._metadata.state_dict_metadata.get(req.storage_index.fqn) if self._metadata else None
        if sys.byteorder != "little" or not isinstance(saved, TensorStorageMetadata):
            return None, None
        offsets = tuple(req.storage_index.offset or ())
        sizes = next((tuple(c.sizes) for c in saved.chunks if tuple(c.offsets) == offsets), None)
        return sizes, saved.properties.dtype

    def _dense(self, req, sinfo, data: bytearray) -> tuple[torch.Tensor | None, int | None]:
        """The item's tensor over `data`'s own bytes (no unpickling, no copy) when its writer marked it dense, and
        where those bytes begin in `data`; (None, None) otherwise (torch.load reads it)."""
        entry = self._crcs.get((sinfo.relative_path, sinfo.offset))
        sizes, dtype = self._saved_chunk(req)
        if entry is None or not entry[2] or sizes is None:
            return None, None
        numel = math.prod(sizes)
        start = entry[3]
        if start is None:
            start = record_start(lambda at, n: data[at: at + n], len(data), numel * dtype.itemsize)
        elif not (0 < start <= len(data) - numel * dtype.itemsize and data_record_ends(memoryview(data)[:start])):
            raise self.corrupt(sinfo, f"no tensor record of {numel * dtype.itemsize} bytes begins at byte {start}")
        if start is None:
            return None, None
        tensor = torch.frombuffer(data, dtype=dtype, count=numel, offset=start) if numel else \
            torch.empty(0, dtype=dtype)
        return tensor.view(sizes), start


READ_AHEAD = 32 << 20  # bytes of items a load asks the kernel to read ahead of the one being read
DIRECT_READS = True  # page reads through O_DIRECT chunks where the filesystem allows (False: the page cache)
SMALL_ITEM = 64 << 10  # a dense item up to this size with no recorded start is read whole, then unpacked
QUEUE = 1  # items waiting between the two threads of a save (each at most a page)


class Pipeline:
    """`put` hands jobs to one worker thread that runs `work(job)` in order; at most QUEUE wait. The worker's
    first error is raised by the next `put` or by `drain`; leaving the block stops the worker."""

    def __init__(self, work: Callable):
        self.work = work
        self.jobs: queue.Queue = queue.Queue(maxsize=QUEUE)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="angel-ptm-checkpoint-writer", daemon=True)

    def __enter__(self) -> "Pipeline":
        self.thread.start()
        return self

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.error is None:
                try:
                    self.work(job)
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    self.error = exc
            del job  # not held while the next is awaited: its data may be the last view of a page buffer

    def put(self, job) -> None:
        self._raise()
        self.jobs.put(job)

    def drain(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()
