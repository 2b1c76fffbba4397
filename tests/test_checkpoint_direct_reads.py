"""A load's O_DIRECT chunk reads (checkpoint/direct_reads.py): the spans cover the planned ranges in whole blocks,
every read returns the file's bytes (and, asked, their CRC-32Cs taken as they are copied) whether it lies in a
chunk, between chunks, before the chunk being read or in the file's last partial block, and a failed chunk read is a CheckpointCorruptError naming the file."""

from __future__ import annotations

import errno
import os
import random

import pytest

from angel_ptm.checkpoint.direct_reads import GAP, DirectFile, spans_of
from angel_ptm.checkpoint.files import CheckpointFile
from angel_ptm.errors import CheckpointCorruptError
from angel_ptm.io import READ, checksums

KIB = 1024


def test_spans_cover_the_ranges_in_whole_blocks_join_near_ones_and_stop_at_the_limit():
    assert spans_of([], 1 << 20) == []
    assert spans_of([(5000, 10)], 1 << 20) == [(4096, 8192)]
    # near ranges (within GAP) are one span; a far one starts its own; each span at most a chunk
    near = [(0, 100), (100 + GAP - 4096, 10), (10 << 20, 1)]
    assert spans_of(near, 64 << 20, chunk=1 << 20) == [(0, GAP), ((10 << 20), (10 << 20) + 4096)]
    assert spans_of([(0, 3 << 20)], 64 << 20, chunk=1 << 20) == [(0, 1 << 20), (1 << 20, 2 << 20), (2 << 20, 3 << 20)]
    # nothing past the last whole block (O_DIRECT cannot read the partial one)
    assert spans_of([(8000, 500)], 8192) == [(4096, 8192)]
    assert spans_of([(8192, 500)], 8192) == []


def direct_file(path, ranges, chunk=64 * KIB, depth=2):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as err:  # (tmpfs)
        pytest.skip(f"no O_DIRECT in {path.parent}: {err.strerror}")
    return DirectFile(path, fd, ranges, chunk=chunk, depth=depth)


@pytest.mark.parametrize("seed", range(6))
def test_every_read_returns_the_files_bytes_in_a_chunk_between_chunks_backwards_or_in_the_last_block(tmp_path, seed):
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(600 * KIB, 900 * KIB))
    path = tmp_path / "ckpt.distcp"
    path.write_bytes(data)
    # items back to back with holes between some (another rank's), as a load plans them
    ranges, at = [], rng.randrange(0, 5000)
    while at < len(data):
        length = min(rng.randrange(1, 40 * KIB), len(data) - at)
        ranges.append((at, length))
        at += length + (rng.randrange(0, 3 * GAP) if rng.random() < 0.2 else 0)
    file = direct_file(path, ranges)
    try:
        reads = list(ranges)
        for _ in range(4):  # reads the plan did not make: in the holes, backwards, the file's tail
            at = rng.randrange(0, len(data) - 1)
            reads.insert(rng.randrange(0, len(reads)), (at, rng.randrange(1, min(20 * KIB, len(data) - at) + 1)))
        reads.append((len(data) - 10, 10))
        i = 0
        while i < len(reads):
            group = reads[i: i + rng.randrange(1, 4)]  # a run of items read by one call, into several views
            i += len(group)
            start = group[0][0]
            group = [(a, n) for a, n in group if a == start] or group[:1]
            sizes = [rng.randrange(0, n + 1) for _, n in group]
            total = sum(sizes)
            parts = [bytearray(size) for size in sizes]
            chain = [rng.random() < 0.5 for _ in parts] if rng.random() < 0.7 else None
            sums = file.readinto_parts([memoryview(p) for p in parts], start, chain)
            assert b"".join(parts) == data[start: start + total]
            # the CRC-32Cs taken while copying out of the chunks (or after a page-cache read) are the parts' own,
            # chained where a part goes on from the one before; the same as a buffered file's
            assert sums == (None if chain is None else checksums.chained_crc32c(parts, chain))
            if chain is not None:
                buffered = CheckpointFile(path)
                try:
                    again = [bytearray(size) for size in sizes]
                    assert buffered.readinto_parts([memoryview(p) for p in again], start, chain) == sums
                finally:
                    buffered.close()
    finally:
        file.close()


def test_a_failed_chunk_read_is_a_typed_error_naming_the_file_and_close_waits_for_reads_in_flight(tmp_path):
    path = tmp_path / "ckpt.distcp"
    path.write_bytes(os.urandom(512 * KIB))
    file = direct_file(path, [(0, 512 * KIB)])
    try:
        file.readinto_parts([memoryview(bytearray(10))], 0)  # the first chunks are read (or in flight)
        file._engine.inject_fault(READ, errno.EIO)  # the next one fails
        with pytest.raises(CheckpointCorruptError, match="ckpt.distcp"):
            file.readinto_parts([memoryview(bytearray(512 * KIB))], 0)
    finally:
        file.close()
    file = direct_file(path, [(0, 512 * KIB)])
    file.readinto_parts([memoryview(bytearray(10))], 0)  # the next chunks are in flight
    file.close()
    assert file.direct_fd == -1 and file.fd == -1


def test_the_chunks_and_threads_go_once_the_last_planned_byte_is_read(tmp_path):
    path = tmp_path / "ckpt.distcp"
    data = os.urandom(300 * KIB + 5)
    path.write_bytes(data)
    file = direct_file(path, [(100, 200 * KIB)])
    try:
        assert file._engine is None  # nothing made before the first read
        part = bytearray(200 * KIB)
        file.readinto_parts([memoryview(part)], 100)
        assert bytes(part) == data[100: 100 + 200 * KIB]
        assert file._engine is None and not file._free
        late = bytearray(1000)  # a read after them: through the page cache
        file.readinto_parts([memoryview(late)], 5000)
        assert bytes(late) == data[5000: 6000]
    finally:
        file.close()
