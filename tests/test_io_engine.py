import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from angel_ptm.errors import DiskFullError, PageIOError
from angel_ptm.io import WRITE, SlotFile, aligned_empty

PAGE = 256 * 1024


def filled(nbytes, seed):
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def test_write_then_read_returns_the_same_bytes_and_checksum(io_engine, tmp_path):
    big = 3 * 1024 * 1024 + 4096  # several chunks and checksum blocks, and a partial last block
    slots = SlotFile(str(tmp_path / "pages.slots"), big, io_engine)
    slots.grow(2)
    src = filled(big, 1)
    written = slots.write(1, src).wait()
    dst = aligned_empty(big)
    read = slots.read(1, dst).wait()
    assert torch.equal(src, dst)
    assert written == read == io_engine.checksum(src)
    slots.close()


def test_64_pages_in_flight_on_4_threads(io_engine, tmp_path):
    assert io_engine.threads == 4
    slots = SlotFile(str(tmp_path / "many.slots"), PAGE, io_engine)
    slots.grow(64)
    sources = [filled(PAGE, i) for i in range(64)]
    writes = [slots.write(i, buf) for i, buf in enumerate(sources)]  # all submitted before any wait
    checksums = [h.wait() for h in writes]
    targets = [aligned_empty(PAGE) for _ in range(64)]
    reads = [slots.read(i, buf) for i, buf in enumerate(targets)]
    assert [h.wait() for h in reads] == checksums
    assert all(torch.equal(a, b) for a, b in zip(sources, targets))
    slots.close()


def test_native_checksum_is_crc32c():
    native = pytest.importorskip("angel_ptm._native")
    buf = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert native.page_checksum(buf.data_ptr(), 9) == 0xE3069283


def test_injected_write_fault_is_raised_on_the_handle(io_engine, tmp_path):
    slots = SlotFile(str(tmp_path / "fault.slots"), PAGE, io_engine)
    slots.grow(1)
    io_engine.inject_fault(WRITE, errno.EIO, 1)
    with pytest.raises(PageIOError, match=r"write of 262144 bytes at offset 0 in .*fault.slots failed \(EIO\)") as info:
        slots.write(0, filled(PAGE, 0)).wait()
    assert info.value.errno == errno.EIO
    slots.write(0, filled(PAGE, 0)).wait()  # the fault was one-shot
    slots.close()


def test_injected_enospc_is_a_disk_full_error(io_engine, tmp_path):
    slots = SlotFile(str(tmp_path / "full.slots"), PAGE, io_engine)
    slots.grow(1)
    io_engine.inject_fault(None, errno.ENOSPC, 1)
    with pytest.raises(DiskFullError, match="ENOSPC"):
        slots.write(0, filled(PAGE, 0)).wait()
    slots.close()


def test_short_read_past_the_end_of_a_file_is_an_error(io_engine, tmp_path):
    path = tmp_path / "short.slots"
    slots = SlotFile(str(path), PAGE, io_engine)
    slots.grow(1)
    os.truncate(path, PAGE // 2)
    with pytest.raises(PageIOError, match="short read"):
        slots.read(0, aligned_empty(PAGE)).wait()
    slots.close()


def test_direct_io_falls_back_to_buffered_where_refused_and_says_so_once(io_engine, tmp_path, monkeypatch, caplog):
    # Older tmpfs and some network filesystems refuse O_DIRECT with EINVAL; newer kernels accept it on tmpfs,
    # so the refusal is simulated to keep the test the same on every machine.
    import angel_ptm.io.slot_file as slot_file

    real_open = os.open

    def refusing_open(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(slot_file.os, "open", refusing_open)
    monkeypatch.setattr(slot_file, "_buffered_announced", set())
    caplog.set_level("WARNING", logger="angel_ptm.io")
    slots = [SlotFile(str(tmp_path / f"buffered{i}.slots"), PAGE, io_engine) for i in range(2)]
    assert [s.direct for s in slots] == [False, False]
    assert sum("does not support O_DIRECT" in r.message for r in caplog.records) == 1
    slots[0].grow(1)
    src = filled(PAGE, 3)
    slots[0].write(0, src).wait()
    dst = aligned_empty(PAGE)
    slots[0].read(0, dst).wait()
    assert torch.equal(src, dst)
    for s in slots:
        s.close()


def test_files_on_this_disk_use_direct_io(io_engine, tmp_path):
    slots = SlotFile(str(tmp_path / "direct.slots"), PAGE, io_engine)
    assert slots.direct is hasattr(os, "O_DIRECT")
    slots.close()


def test_efbig_from_the_file_size_limit_is_a_disk_full_error(tmp_path):
    # RLIMIT_FSIZE in a child process: writes past the limit fail with EFBIG (SIGXFSZ ignored).
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from angel_ptm.errors import DiskFullError
        from angel_ptm.io import SlotFile, aligned_empty, create_engine
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        engine = create_engine(threads=2, backend=sys.argv[1])
        slots = SlotFile({str(tmp_path / 'limited.slots')!r}, {PAGE}, engine)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({PAGE}, {PAGE}))
        slots.n_slots = 2  # pretend the space exists: the limit, not fallocate, must stop the write
        buf = aligned_empty({PAGE}).fill_(7)
        slots.write(0, buf).wait()
        try:
            slots.write(1, buf).wait()
        except DiskFullError as exc:
            print("EFBIG" if exc.errno == 27 else exc.errno)
    """)
    from angel_ptm.io import native_available

    for backend in (["native"] if native_available() else []) + ["python"]:
        out = subprocess.run([sys.executable, "-c", script, backend], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "EFBIG", out.stderr


def test_missing_extension_falls_back_to_threads_with_a_warning_naming_why():
    script = textwrap.dedent("""
        import logging, sys
        sys.modules["angel_ptm._native"] = None  # as if the extension had not been built
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from angel_ptm.io import create_engine
        print(type(create_engine()).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ThreadEngine"
    assert "using the pure-Python thread engine (slower): native extension missing" in out.stderr


def test_large_cpu_buffers_are_huge_page_aligned_and_small_ones_page_aligned():
    from angel_ptm.io.slot_file import HUGE_PAGE

    big = aligned_empty(3 * HUGE_PAGE + 4096)  # not a multiple of the huge page: only the whole ones are advised
    small = aligned_empty(64 << 10)
    assert big.data_ptr() % HUGE_PAGE == 0 and big.numel() == 3 * HUGE_PAGE + 4096
    assert small.data_ptr() % 4096 == 0 and small.numel() == 64 << 10
    forced_off = aligned_empty(2 * HUGE_PAGE, huge=False)
    assert forced_off.data_ptr() % 4096 == 0
    big.fill_(5)  # the memory is usable whatever the kernel did with the advice
    assert int(big[-1]) == 5 and int(big[0]) == 5


def _thp_eligible(address: int) -> bool | None:
    """Whether the kernel may back the mapping holding `address` with transparent huge pages (/proc/self/smaps'
    THPeligible: advised, private, anonymous; unlike AnonHugePages it does not hang on a huge page being free at
    the fault), None where the kernel does not say."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


def test_transient_buffers_are_private_mappings_of_their_own_in_huge_pages_and_go_back_when_dropped():
    """A checkpoint save's page buffers and write chunks (anonymous_aligned): 2 MiB-aligned, out of the allocator's
    heap, and in transparent huge pages where the kernel grants them on advice (a shared anonymous mapping is shmem,
    which it does not: O_DIRECT into 4 KiB pages ran 2-3x slower here)."""
    import gc

    import psutil

    from angel_ptm.io.slot_file import HUGE_PAGE, anonymous_aligned

    small = anonymous_aligned(64 << 10)
    assert small.data_ptr() % 4096 == 0 and small.numel() == 64 << 10
    big = anonymous_aligned(2 * HUGE_PAGE)
    assert big.data_ptr() % HUGE_PAGE == 0 and big.numel() == 2 * HUGE_PAGE
    big.fill_(3)
    assert int(big[0]) == int(big[-1]) == 3
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        mode = ""
    eligible = _thp_eligible(big.data_ptr())
    if "[never]" not in mode and eligible is not None:
        assert eligible, f"the buffer may not use huge pages (THP: {mode.strip()})"
    rss = psutil.Process().memory_info().rss
    del big
    gc.collect()
    assert psutil.Process().memory_info().rss <= rss - HUGE_PAGE  # unmapped, not kept in a heap
