"""Checkpoint I/O pieces: item checksums by the name the manifest gives (native CRC-32C, zlib CRC-32, the
pure-Python fallback), the save's buffer pool, the load's read-ahead (through the page cache, and O_DIRECT
chunks)."""

from __future__ import annotations

import pytest
import torch

import angel_ptm
from angel_ptm.checkpoint import storage
from angel_ptm.errors import CheckpointCorruptError

from test_checkpoint import (AT, CASES, STEPS, assert_bitwise, batches, config, final_states, resume_from, scrambled,
                             step, train_with_checkpoint)


# --- item checksums and write-back -----------------------------------------------------------------------------------
def test_crc32c_native_and_python_agree_with_the_standard_check_value():
    from angel_ptm.io import checksums

    data = bytes(range(256)) * 37 + b"tail"
    assert checksums.crc32c_python(b"123456789") == 0xE3069283  # RFC 3720's check value
    assert checksums.crc32c(b"123456789") == 0xE3069283
    assert checksums.crc32c(data) == checksums.crc32c_python(data)
    assert checksums.crc32c(data[1000:], checksums.crc32c(data[:1000])) == checksums.crc32c(data)
    floats = torch.arange(100, dtype=torch.float32).numpy()
    assert checksums.crc32c(floats) == checksums.crc32c(floats.tobytes())
    with pytest.raises(KeyError, match="crc32c"):
        checksums.function("md5")


def test_crc32c_native_joins_its_interleaved_chains_at_every_length():
    """The native CRC runs three chains over consecutive runs (32 KiB, then 256 B) and joins them: lengths around
    each run boundary, from unaligned starts and continued values, agree with the byte-at-a-time table loop."""
    from angel_ptm.io import checksums

    if checksums.crc32c is checksums.crc32c_python:
        pytest.skip("the native extension is not built")
    data = torch.randint(0, 256, (3 * 32768 + 3 * 256 + 40,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.uint8).numpy().tobytes()
    for n in (0, 7, 8, 767, 768, 769, 3 * 32768 - 1, 3 * 32768, len(data) - 1):
        for start in (0, 3):
            chunk = data[start: start + n]
            assert checksums.crc32c(chunk, 0x1234) == checksums.crc32c_python(chunk, 0x1234), (n, start)


@pytest.mark.parametrize("native", [True, False])
def test_copy_crc32c_copies_and_checksums_in_one_pass_at_every_length(monkeypatch, native):
    """A load copies an item out of its O_DIRECT chunk and takes its CRC-32C in one pass (in pieces of 128 KiB,
    the GIL released from 1 MiB): the bytes and the CRC are a copy's and crc32c's, at lengths around the pieces,
    continuing from a value; sizes that differ and a read-only destination are refused; without the extension the
    same results come from a copy and the pure-Python CRC."""
    from angel_ptm.io import checksums

    if native and checksums.crc32c is checksums.crc32c_python:
        pytest.skip("the native extension is not built")
    if not native:
        monkeypatch.setattr(checksums, "crc32c", checksums.crc32c_python)
    data = torch.randint(0, 256, ((1 << 20) + (3 << 17) + 5,), generator=torch.Generator().manual_seed(1),
                         dtype=torch.uint8).numpy().tobytes()
    lengths = (0, 1, 4095, (1 << 17) - 1, 1 << 17, (1 << 17) + 1, 1 << 20, len(data) - 7) if native else (0, 1, 5000)
    for n in lengths:
        out = bytearray(n + 3)
        crc = checksums.copy_crc32c(memoryview(out)[2: 2 + n], data[7: 7 + n], 0xBEEF)
        assert out[2: 2 + n] == data[7: 7 + n] and out[:2] == b"\0\0" and out[-1:] == b"\0", n
        assert crc == checksums.crc32c_python(data[7: 7 + n], 0xBEEF), n
    if native:
        with pytest.raises(ValueError, match="differ in size"):
            checksums.copy_crc32c(bytearray(3), data[:4])
        with pytest.raises(BufferError):
            checksums.copy_crc32c(data[:4], data[4:8])
    parts = [data[:10], data[10:10], data[10:300], data[300:301]]
    assert checksums.chained_crc32c(parts, [True, False, True, False]) == [
        checksums.crc32c_python(data[:10]), checksums.crc32c_python(data[:10]),
        checksums.crc32c_python(data[10:300]), checksums.crc32c_python(data[10:301])]


@pytest.mark.parametrize("written,read", [("crc32", "crc32"), ("crc32c", "python")])
def test_a_checkpoint_is_checked_with_the_checksum_its_manifest_names(tmp_path, monkeypatch, written, read):
    """Each checksum kind round-trips and still catches a flipped bit: zlib's CRC-32 (a build without the native
    extension writes it, through the thread engine; manifests before "item_checksum" imply it), and native CRC-32C
    checked by the pure-Python fallback. The file is written in 8 KiB chunks (items span chunks)."""
    from angel_ptm.io import checksums

    monkeypatch.setattr("angel_ptm.io.stream.CHUNK", 8 << 10)
    monkeypatch.setattr(checksums, "PREFERRED", written)
    if written == "crc32":  # as a build without the native extension writes: the thread engine, zlib's CRC-32
        from angel_ptm.io import engine as io_engine, stream

        monkeypatch.setattr(stream, "create_engine", lambda **kw: io_engine.create_engine(backend="python", **kw))
    losses, states = train_with_checkpoint(tmp_path, "mlp", config(tmp_path, "a"), tmp_path / "ckpt")
    assert storage.read_manifest(tmp_path / "ckpt")["item_checksum"] == written
    if read == "python":
        monkeypatch.setitem(checksums.ALGORITHMS, "crc32c", checksums.crc32c_python)
    resumed, resumed_states = resume_from("mlp", config(tmp_path, "b"), tmp_path / "ckpt")
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)
    victim = tmp_path / "ckpt" / "__0_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    victim.write_bytes(bytes(raw))
    engine = angel_ptm.initialize(scrambled(CASES["mlp"][0]), config(tmp_path, "c"))
    try:
        with pytest.raises(CheckpointCorruptError, match="fails its checksum"):
            engine.load_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()


def test_a_manifest_naming_an_unknown_checksum_is_a_typed_error(tmp_path, monkeypatch):
    train_with_checkpoint(tmp_path, "mlp", config(tmp_path, "a"), tmp_path / "ckpt")
    manifest = storage.read_manifest(tmp_path / "ckpt")
    manifest["item_checksum"] = "sha0"
    (tmp_path / "ckpt" / storage.MANIFEST).write_bytes(storage.seal(manifest))
    with pytest.raises(CheckpointCorruptError, match="unknown checksum 'sha0'"):
        storage.CheckedReader(tmp_path / "ckpt")


def test_a_saves_page_buffers_are_reused_once_unviewed_and_capped(monkeypatch):
    from angel_ptm.checkpoint import buffers

    if buffers._views(torch.empty(1)) is None:
        pytest.skip("this torch does not count a storage's users: buffers are never reused")
    pool = buffers.BufferPool(8192, cap=2, patience=0.05)
    a, b = pool.take(), pool.take()
    item = a[100:200].view(torch.int32)  # the writer still holds an item of `a`
    pool.give_back(a)
    pool.give_back(b)
    assert pool.take() is b  # `a` is still viewed
    del item
    assert pool.take() is a
    pool.give_back(a)
    held = a[:8]
    started = __import__("time").monotonic()
    c = pool.take()  # cap reached and `a` still viewed: waits `patience`, then makes one more
    assert c is not a and __import__("time").monotonic() - started >= 0.05
    del held


def test_read_ahead_advises_in_order_within_its_window_and_stops(tmp_path):
    from angel_ptm.checkpoint.files import CheckpointFile, ReadAhead

    path = tmp_path / "f"
    path.write_bytes(bytes(100))
    file = CheckpointFile(path)
    seen = []
    file.advise = lambda offset, length: seen.append(offset)
    ranges = [(file, 10 * i, 10) for i in range(10)]
    clock = __import__("time")

    def settles_at(expected):
        deadline = clock.monotonic() + 5
        while len(seen) < len(expected) and clock.monotonic() < deadline:
            clock.sleep(0.005)
        clock.sleep(0.02)  # and goes no further
        assert seen == expected

    with ReadAhead(ranges, window=25) as ahead:
        settles_at([0, 10, 20, 30])  # the current range, then whole ranges until 25 bytes lie beyond it
        ahead.reached(5)
        settles_at([10 * i for i in range(9)])
    file.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_a_dense_tensors_archive_is_written_around_its_elements_byte_for_byte_as_torch_save_writes_it(dtype):
    """The checkpoint writer keeps the archive torch.save writes around a dense tensor's elements, per layout
    (serialize.Containers), and writes later tensors of that layout as the same bytes with their own elements in:
    byte for byte what torch.save writes (its records' CRC-32 off, as the writer has them; its serialization id
    aside, should a torch draw one per save), which torch.load reads;
    a small or non-dense tensor goes through torch.save every time."""
    import io

    from angel_ptm.checkpoint.serialize import Containers, no_zip_crc

    class Sink(io.RawIOBase):
        def __init__(self):
            super().__init__()
            self.data = bytearray()

        def writable(self):
            return True

        def write(self, b):
            self.data += memoryview(b).cast("B")
            return len(memoryview(b).cast("B"))

    containers = Containers()
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(64, 40, generator=g) * 50).to(dtype) for _ in range(3)]
    tensors += [torch.ones(3, dtype=dtype), (torch.randn(64, 40, generator=g) * 50).to(dtype).t()]  # small, strided
    for tensor in tensors:
        ours, theirs = Sink(), Sink()
        dense = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        start = containers.write(tensor, ours, dense)
        nbytes = tensor.numel() * tensor.element_size()
        if dense and nbytes >= Containers.MIN_BYTES:  # where its elements begin is known (a loader reads them there)
            assert bytes(ours.data[start: start + nbytes]) == tensor.contiguous().view(torch.uint8).numpy().tobytes()
        else:
            assert start is None
        with no_zip_crc():
            torch.save(tensor, theirs)
        mine, torchs = bytes(ours.data), bytes(theirs.data)
        assert len(mine) == len(torchs)
        differ = [i for i, (a, b) in enumerate(zip(mine, torchs)) if a != b]
        at = torchs.find(b".data/serialization_id")  # (an id torch may draw per save: its record alone may differ)
        assert all(at < i < at + 22 + 30 + 64 for i in differ), differ[:8]
        assert torch.equal(torch.load(io.BytesIO(mine)), tensor)
    assert list(containers._known.values()) != [] and all(v is not None for v in containers._known.values())


# --- the load's reads -----------------------------------------------------------------------------------------------
def _rewrite_manifest(directory, change) -> None:
    manifest = storage.read_manifest(directory)
    for items in manifest["files"].values():
        for entry in items:
            change(entry)
    (directory / storage.MANIFEST).write_bytes(storage.seal(manifest))


def test_a_load_reads_elements_where_the_manifest_says_finds_them_without_and_refuses_a_wrong_place(tmp_path):
    """A dense item's manifest entry says where its elements begin, so a load reads the item front to back in one
    read into its page. A checkpoint without those places (an older one) still resumes exactly (the archive's
    directory is searched); a place that is wrong yet covered by the item's checksum is a typed error naming the
    file, never shifted values."""
    def cfg(name):  # larger pages than the other tests' (items of several KiB), some on disk
        job = config(tmp_path, name, page_bytes="16KiB")
        job["memory"].update(device_budget="256KiB", host_budget="224KiB")
        return job

    losses, states = train_with_checkpoint(tmp_path, "gpt", cfg("a"), tmp_path / "ckpt")
    entries = [e for items in storage.read_manifest(tmp_path / "ckpt")["files"].values() for e in items]
    placed = [e for e in entries if len(e) == 5]
    assert placed and all(e[3] == 1 and 0 < e[4] < e[1] for e in placed)
    resumed, resumed_states = resume_from("gpt", cfg("b"), tmp_path / "ckpt")
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)

    _rewrite_manifest(tmp_path / "ckpt", lambda e: e[4:] and e.pop())  # as a checkpoint before the places
    resumed, resumed_states = resume_from("gpt", cfg("c"), tmp_path / "ckpt")
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)

    victim = max(placed, key=lambda e: e[1])
    _rewrite_manifest(tmp_path / "ckpt", lambda e: e[:2] == victim[:2] and e.append(victim[4] + 64))
    engine = angel_ptm.initialize(scrambled(CASES["gpt"][0]), cfg("d"))
    try:
        with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp .*no tensor record"):
            engine.load_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()


def test_a_load_reads_pages_on_a_thread_holding_at_most_the_pages_in_flight_and_one(tmp_path, monkeypatch):
    """The load's pages are read on a thread while the next page's items are resolved: more than one page is held
    at a time, never more than PAGES_IN_FLIGHT + 1, and none once the load is done; a flipped bit in a late item
    is still the typed error, with every page handed back."""
    from angel_ptm.checkpoint.planners import PageLoadPlanner

    most = []
    hold = PageLoadPlanner._hold

    def counting(self, page):
        held = hold(self, page)
        most.append(len(self._held))
        return held

    monkeypatch.setattr(PageLoadPlanner, "_hold", counting)
    losses, states = train_with_checkpoint(tmp_path, "gpt", config(tmp_path, "a"), tmp_path / "ckpt")
    engine = angel_ptm.initialize(scrambled(CASES["gpt"][0]), config(tmp_path, "b"))
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert 1 < max(most) <= storage.PAGES_IN_FLIGHT + 1
        assert all(page.pin_count == 0 for page in engine.manager.pages)
        victim = tmp_path / "ckpt" / "__0_0.distcp"
        raw = bytearray(victim.read_bytes())
        raw[len(raw) * 9 // 10] ^= 0x01
        victim.write_bytes(bytes(raw))
        with pytest.raises(CheckpointCorruptError, match="fails its checksum"):
            engine.load_checkpoint(tmp_path / "ckpt")
        assert all(page.pin_count == 0 for page in engine.manager.pages)
    finally:
        engine.close()


def test_reading_into_parts_fills_them_in_file_order_across_calls_and_names_a_short_file(tmp_path, monkeypatch):
    """A run of items is one front-to-back read into many buffers (each item's head, elements and tail): at most
    IOV_MAX buffers a call, empty ones skipped, a buffer a call fills only in part finished by the next."""
    from angel_ptm.checkpoint import files

    data = bytes(range(256)) * 40
    (tmp_path / "f").write_bytes(data)
    file = files.CheckpointFile(tmp_path / "f")
    monkeypatch.setattr(files, "IOV_MAX", 3)
    sizes = [5, 0, 700, 1, 3000, 0, 17, 2000, 1]
    parts = [bytearray(n) for n in sizes]
    file.readinto_parts([memoryview(p) for p in parts], 123)
    assert b"".join(parts) == data[123: 123 + sum(sizes)]
    real = files.os.preadv
    monkeypatch.setattr(files.os, "preadv", lambda fd, views, at: real(fd, [views[0][:7]], at))  # short reads
    parts = [bytearray(n) for n in sizes]
    file.readinto_parts([memoryview(p) for p in parts], 0)
    assert b"".join(parts) == data[: sum(sizes)]
    monkeypatch.setattr(files.os, "preadv", real)
    with pytest.raises(CheckpointCorruptError, match="ends before byte"):
        file.readinto_parts([memoryview(bytearray(100)), memoryview(bytearray(100))], len(data) - 150)
    file.close()


def test_a_host_that_holds_few_pages_loads_one_page_at_a_time(tmp_path, monkeypatch):
    from angel_ptm.checkpoint.planners import PageLoadPlanner

    most = []
    hold = PageLoadPlanner._hold
    monkeypatch.setattr(PageLoadPlanner, "_hold", lambda self, page: (hold(self, page), most.append(len(self._held)))[0])
    monkeypatch.setattr(PageLoadPlanner, "holdable", lambda self: 1)  # a host pool of two pages: one held, one moving
    losses, states = train_with_checkpoint(tmp_path, "mlp", config(tmp_path, "a"), tmp_path / "ckpt")
    resumed, resumed_states = resume_from("mlp", config(tmp_path, "b"), tmp_path / "ckpt")
    assert max(most) == 1
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)


def test_the_load_plan_lists_pages_in_the_order_their_bytes_lie_in_the_files():
    from types import SimpleNamespace

    from angel_ptm.checkpoint.planners import in_file_order

    item = lambda name: SimpleNamespace(storage_index=name)  # noqa: E731
    storage = {"a": SimpleNamespace(relative_path="__0_0.distcp", offset=900),
               "b": SimpleNamespace(relative_path="__0_0.distcp", offset=100),
               "c": SimpleNamespace(relative_path="__1_0.distcp", offset=0),
               "d": SimpleNamespace(relative_path="__0_0.distcp", offset=500)}
    groups = [[item("c")], [item("a"), item("d")], [], [item("b")]]  # pages as the plan makes them, kind by kind
    assert [i.storage_index for i in in_file_order(groups, storage)] == ["b", "d", "a", "c"]
    assert [i.storage_index for i in in_file_order(groups, None)] == ["c", "a", "d", "b"]  # no map: as given


@pytest.mark.parametrize("direct", [True, False])
def test_a_load_at_the_saved_layout_reads_its_file_front_to_back(tmp_path, monkeypatch, direct):
    """The pages' reads go through the file front to back, never back: the save wrote the kinds page by page,
    the load plan makes the pages kind by kind, and the reads follow the file (through O_DIRECT chunks read ahead
    where the filesystem allows, else the page cache, the kernel reading ahead), and the resumed run is exact."""
    from angel_ptm.checkpoint import direct_reads, files, storage

    losses, states = train_with_checkpoint(tmp_path, "gpt", config(tmp_path, "a"), tmp_path / "ckpt")
    monkeypatch.setattr(storage, "DIRECT_READS", direct)
    reads: list[tuple[int, int]] = []
    cls = direct_reads.DirectFile if direct else files.CheckpointFile
    real = cls.readinto_parts

    def recording(self, views, offset, chain=None):
        if type(self) is cls:  # (a DirectFile's reads outside its chunks come through CheckpointFile's)
            reads.append((offset, sum(len(v) for v in views)))
        return real(self, views, offset, chain)

    monkeypatch.setattr(cls, "readinto_parts", recording)
    opened = []
    real_open = direct_reads.DirectFile.open.__func__
    monkeypatch.setattr(direct_reads.DirectFile, "open", classmethod(
        lambda c, path, ranges: opened.append(real_open(c, path, ranges)) or opened[-1]))
    engine = angel_ptm.initialize(scrambled(CASES["gpt"][0]), config(tmp_path, "b"))
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
        loss_fn, data = CASES["gpt"][2], batches("gpt")
        assert [step(engine, loss_fn, data[s]) for s in range(AT, STEPS)] == losses[AT:]
        assert_bitwise(states, final_states(engine))
    finally:
        engine.close()
    if direct and opened == [None]:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert len(reads) > 10 and len(opened) == (1 if direct else 0)
    if not direct:  # the engine record, read before the pages (does the checkpoint fit the model?), then in order
        reads = reads[1:]
    assert all(b[0] >= a[0] + a[1] for a, b in zip(reads, reads[1:]))
