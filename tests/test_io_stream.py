"""io/stream.py: a file written front to back through aligned chunks (O_DIRECT where allowed)."""

from __future__ import annotations

import errno
import os

import pytest

from angel_ptm.errors import DiskFullError
from angel_ptm.io import engine as io_engine
from angel_ptm.io import stream as io_stream
from angel_ptm.io.stream import SequentialWriter


def pieces(seed: int = 0) -> list[bytes]:
    rng = __import__("random").Random(seed)
    return [rng.randbytes(rng.choice([0, 1, 7, 100, 4095, 4096, 4097, 9000, 20000])) for _ in range(60)]


@pytest.mark.parametrize("direct", [True, False])
def test_the_file_holds_exactly_what_was_written_in_any_pieces(tmp_path, monkeypatch, direct):
    if not direct:  # the buffered path (a filesystem refusing O_DIRECT), handing bytes to the disk every 16 KiB
        monkeypatch.setattr(io_stream, "open_direct", lambda path: (os.open(path, os.O_RDWR | os.O_CREAT, 0o600),
                                                                    False))
        monkeypatch.setattr(io_stream, "KICK", 16 << 10)
    path = tmp_path / "out.bin"
    path.write_bytes(b"x" * 100_000)  # a leftover of that name is replaced, not overwritten in part
    data = pieces()
    with SequentialWriter(path, chunk=8192) as out:
        for piece in data:
            assert out.write(memoryview(piece)) == len(piece)
        assert out.tell() == sum(map(len, data))
    assert path.read_bytes() == b"".join(data)


def test_an_empty_file_and_one_exact_chunk(tmp_path):
    with SequentialWriter(tmp_path / "empty", chunk=4096):
        pass
    assert (tmp_path / "empty").read_bytes() == b""
    with SequentialWriter(tmp_path / "one", chunk=4096) as out:
        out.write(b"\1" * 4096)
    assert (tmp_path / "one").read_bytes() == b"\1" * 4096


def test_a_full_disk_is_a_disk_full_error_naming_the_file_and_nothing_waits_forever(tmp_path, monkeypatch):
    made = []

    def engine(**kwargs):
        made.append(io_engine.create_engine(**kwargs))
        made[-1].inject_fault(io_engine.WRITE, errno.ENOSPC, count=100)
        return made[-1]

    monkeypatch.setattr(io_stream, "create_engine", engine)
    path = tmp_path / "full.bin"
    with pytest.raises(DiskFullError, match="full.bin") as info:
        with SequentialWriter(path, chunk=4096) as out:
            out.write(b"\0" * 40_000)
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(ValueError, match="multiple of 4096"):
        SequentialWriter(tmp_path / "odd", chunk=1000)


def test_a_paced_writer_takes_at_least_its_bytes_over_its_rate(tmp_path):
    import time

    started = time.monotonic()
    with SequentialWriter(tmp_path / "paced", chunk=8192, max_bytes_per_s=1e6) as out:
        out.write(b"\0" * 100_000)
    assert time.monotonic() - started >= 0.1 - 1e-3
    assert (tmp_path / "paced").stat().st_size == 100_000
