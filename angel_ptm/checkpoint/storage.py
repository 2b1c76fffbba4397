"""DCP storage with checksums: files in FileSystemWriter's layout, so DCP's own reader and tools read them.

    writer = CheckedWriter(tmp_dir, info)    # dcp.save(..., storage_writer=writer)
    reader = CheckedReader(ckpt_dir)         # dcp.load(..., storage_reader=reader): every byte checked

A rank writes one file, `__<rank>_0.distcp`, its items in the order the planner lists them (page order, so each
page is read once), each item serialized as FileSystemWriter serializes it (`torch.save` of the chunk, raw bytes
for a bytes item). The writer records each item's CRC-32; the coordinator writes them into the manifest,
`angel_ptm.json` (with the CRC-32 of `.metadata` and of itself), then `.metadata` last by rename. Files are
fsynced, then the directory. A reader verifies the manifest, `.metadata`, and every item it reads against them,
so a torn, truncated or bit-flipped file is a CheckpointCorruptError naming it, never wrong values.

`FAULT`: a test hook called at named points of a save ("item-written", "before-metadata", "before-rename"), so a
test can kill the process (or raise ENOSPC) exactly there.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from angel_ptm.errors import CheckpointCorruptError, CheckpointWriteError

MANIFEST = "angel_ptm.json"
METADATA = ".metadata"
FORMAT = "angel-ptm checkpoint 1"
FAULT: Callable[[str], None] | None = None  # tests: called with a point's name during a save


def fault(point: str) -> None:
    if FAULT is not None:
        FAULT(point)


@dataclasses.dataclass
class _CheckedInfo(_StorageInfo):
    """A written item's place and its CRC-32 (the coordinator moves the CRC into the manifest: `.metadata` holds
    torch's own _StorageInfo, so any DCP reader reads it)."""

    crc: int = 0


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


def serialize(data: Any) -> memoryview:
    """A write item's bytes as FileSystemWriter stores them: a bytes item as is, a tensor chunk by torch.save."""
    if isinstance(data, io.BytesIO):
        return data.getbuffer()
    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getbuffer()


class CheckedWriter(FileSystemWriter):
    """FileSystemWriter's layout, written in the planner's order with a CRC-32 per item. `info`: JSON-able facts
    of the save the coordinator puts in the manifest (step, world size, layout)."""

    def __init__(self, path: str | os.PathLike, info: dict | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        self.info = info or {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0.distcp"
        path = Path(self.path) / name
        results: list[WriteResult] = []
        try:
            with open(path, "wb") as stream:
                for item in plan.items:
                    data = planner.resolve_data(item)
                    if item.type != WriteItemType.BYTE_IO:
                        data = data.detach().cpu()
                    raw = serialize(data)
                    offset = stream.tell()
                    stream.write(raw)
                    results.append(WriteResult(index=item.index, size_in_bytes=len(raw),
                                               storage_data=_CheckedInfo(name, offset, len(raw),
                                                                         crc=zlib.crc32(raw))))
                    fault("item-written")
                stream.flush()
                os.fsync(stream.fileno())
        except OSError as err:
            raise CheckpointWriteError(f"checkpoint: cannot write {path}: {err.strerror or err}", str(path),
                                       err.errno or 0) from None
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

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
                crcs.setdefault(info.relative_path, []).append([info.offset, info.length, info.crc])
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
    """FileSystemReader that checks `.metadata` and every item it reads against the manifest's CRC-32s."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.manifest = read_manifest(Path(path))
        self._crcs = {(name, offset): (length, crc) for name, items in self.manifest["files"].items()
                      for offset, length, crc in items}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """`.metadata`, checked against the manifest (callers read it once before DCP does: DCP takes a failure
        here for a missing global file and falls back to per-rank ones)."""
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
        return metadata

    def _slice_file(self, file, sinfo) -> io.BytesIO:
        """The item's bytes, read whole and checked (at most a page and torch.save's header)."""
        path = Path(self.path) / sinfo.relative_path
        expected = self._crcs.get((sinfo.relative_path, sinfo.offset))
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if expected is None or len(data) != sinfo.length or expected[0] != sinfo.length:
            raise CheckpointCorruptError(f"checkpoint {self.path}: {path} is truncated or does not match the "
                                         f"manifest (item at byte {sinfo.offset}, {sinfo.length} bytes)", str(path))
        if zlib.crc32(data) != expected[1]:
            raise CheckpointCorruptError(f"checkpoint {self.path}: {path} fails its checksum at byte "
                                         f"{sinfo.offset} ({sinfo.length} bytes)", str(path))
        return io.BytesIO(data)
