"""Disk pages backed by the checkpoint they were loaded from (memory/backing.py): a load writes no page files,
the slots read the checkpoint's bytes (checked), survive its deletion, go back to page files when written or
before `Checkpoints` prunes the checkpoint, and resume stays exact."""

from __future__ import annotations

import shutil
import time as clock

import pytest
import torch

import angel_ptm
from angel_ptm.checkpoint import storage
from angel_ptm.checkpoint.directory import Checkpoints
from angel_ptm.checkpoint.planners import SAVED_KINDS, held_pages, page_runs, segments_by_page
from angel_ptm.errors import ChecksumError, EngineFailedError
from angel_ptm.memory import PageState, Tier, memops
from angel_ptm.memory.tiers import DiskTier

from test_checkpoint import (AT, CASES, STEPS, assert_bitwise, batches, config, final_states, resume_from,
                             scrambled, step, train_with_checkpoint)


def loaded_with_page_writes_counted(tmp_path, monkeypatch, case="gpt", dtype="float32", page_bytes="4KiB",
                                    saved_page_bytes="4KiB"):
    """Train 10 steps checkpointing at 5, then a fresh engine (device+host+disk) loads it; page-file writes
    during the load are counted. Returns (engine, losses, states, writes)."""
    cfg = config(tmp_path, "a", dtype=dtype, page_bytes=saved_page_bytes)
    losses, states = train_with_checkpoint(tmp_path, case, cfg, tmp_path / "ckpt")
    writes = []
    write = DiskTier.write
    monkeypatch.setattr(DiskTier, "write", lambda self, kind, slot, buf: writes.append(kind) or write(self, kind,
                                                                                                       slot, buf))
    engine = angel_ptm.initialize(scrambled(CASES[case][0]),
                                  config(tmp_path, "b", dtype=dtype, page_bytes=page_bytes))
    writes.clear()  # those of its start
    assert engine.load_checkpoint(tmp_path / "ckpt") == {"step": AT}
    return engine, losses, states, writes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_load_writes_no_page_files_its_disk_pages_read_the_checkpoint_and_resume_stays_exact(tmp_path, monkeypatch,
                                                                                              dtype):
    engine, losses, states, writes = loaded_with_page_writes_counted(tmp_path, monkeypatch, dtype=dtype)
    try:
        disk = engine.manager.disk
        assert writes == [] and disk.backed_slots > 0
        loss_fn, data = CASES["gpt"][2], batches("gpt")
        assert [step(engine, loss_fn, data[s]) for s in range(AT, STEPS)] == losses[AT:]
        assert_bitwise(states, final_states(engine))
        assert writes  # updated pages are written to their slots as ever
    finally:
        engine.close()
    assert disk.sources.open_files == 0


@pytest.mark.parametrize("saved,loaded", [("8KiB", "4KiB"), ("4KiB", "8KiB")])
def test_a_load_at_another_page_size_backs_what_it_can_and_stays_exact(tmp_path, monkeypatch, saved, loaded):
    """A page gathers pieces of several saved pages, or a saved box is cut over two pages (a piece that is not
    contiguous in the file is written to the page's slot as ever)."""
    engine, losses, states, writes = loaded_with_page_writes_counted(tmp_path, monkeypatch, page_bytes=loaded,
                                                                     saved_page_bytes=saved)
    try:
        loss_fn, data = CASES["gpt"][2], batches("gpt")
        assert engine.manager.disk.backed_slots > 0
        resumed = [step(engine, loss_fn, data[s]) for s in range(AT, STEPS)]
        assert resumed == pytest.approx(losses[AT:], rel=1e-6)
    finally:
        engine.close()


def test_the_loaded_checkpoint_may_be_deleted_and_a_save_right_after_the_load_is_exact(tmp_path, monkeypatch):
    engine, losses, states, _writes = loaded_with_page_writes_counted(tmp_path, monkeypatch)
    try:
        disk = engine.manager.disk
        backed = disk.backed_slots
        engine.save_checkpoint(tmp_path / "again", extra={"step": AT})  # pages go on reading the loaded one
        assert disk.backed_slots == backed > 0
        ckpts = Checkpoints(tmp_path / "ckpts", keep=1)  # this save prunes it: the pages copy its bytes first
        ckpts.save(engine, AT, {"step": AT})
        assert disk.backed_slots == 0 and disk.sources.open_files == 0
        assert disk._reader._staging is None  # the backed reads' staging buffer went with the last backed slot
        shutil.rmtree(tmp_path / "ckpt")
        loss_fn, data = CASES["gpt"][2], batches("gpt")
        assert [step(engine, loss_fn, data[s]) for s in range(AT, STEPS)] == losses[AT:]
    finally:
        engine.close()
    resumed, resumed_states = resume_from("gpt", config(tmp_path, "c"), tmp_path / "again")
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)


def test_a_deleted_checkpoint_still_serves_its_pages_and_a_damaged_one_is_a_checksum_error(tmp_path, monkeypatch):
    engine, losses, _states, _writes = loaded_with_page_writes_counted(tmp_path, monkeypatch)
    shutil.rmtree(tmp_path / "ckpt")  # unlinked: the open descriptors still read the bytes
    loss_fn, data = CASES["gpt"][2], batches("gpt")
    try:
        assert step(engine, loss_fn, data[AT]) == losses[AT]
    finally:
        engine.close()
    engine, losses, _states, _writes = loaded_with_page_writes_counted(tmp_path / "2", monkeypatch)
    try:
        disk = engine.manager.disk
        sources = [disk.backing(p.kind, p.disk_slot) for p in engine.manager.pages]
        extents = [e for source in sources if source is not None for e in source.extents]
        for victim in {e.path for e in extents}:  # flipped in place: the open descriptors see it
            with open(victim, "r+b") as handle:
                raw = bytearray(handle.read())
                for e in extents:
                    if e.path == victim:
                        raw[e.offset + e.nbytes // 2] ^= 0x08
                handle.seek(0)
                handle.write(raw)
        with pytest.raises(ChecksumError, match=r"\.distcp"):
            step(engine, loss_fn, data[AT])
        with pytest.raises(EngineFailedError):
            engine.zero_grad()
    finally:
        engine.close()


def test_a_background_save_right_after_a_load_holds_the_loaded_state(tmp_path, monkeypatch):
    """Its held slots are backed by the loaded checkpoint while the steps beside it rewrite those pages."""
    engine, losses, states, _writes = loaded_with_page_writes_counted(tmp_path, monkeypatch)
    loss_fn, data = CASES["gpt"][2], batches("gpt")
    storage.FAULT = lambda point: clock.sleep(0.01) if point == "item-written" else None
    try:
        backed = engine.manager.disk.backed_slots
        engine.save_checkpoint(tmp_path / "bg", extra={"step": AT}, background=True)
        assert [step(engine, loss_fn, data[s]) for s in range(AT, STEPS)] == losses[AT:]
        assert engine.wait_for_checkpoint() == tmp_path / "bg"
        assert backed > 0
    finally:
        storage.FAULT = None
        engine.close()
    resumed, resumed_states = resume_from("gpt", config(tmp_path, "c"), tmp_path / "bg")
    assert resumed == losses[AT:]
    assert_bitwise(states, resumed_states)


def test_a_load_zeroes_only_the_padding_of_the_pages_it_makes_afresh_and_leaves_the_clearers_as_they_were(
        tmp_path, monkeypatch):
    """Pages the load makes afresh reuse slots that held other bytes (here 0xFF): their padding is zeroed (not the
    whole page, then overwritten), so every byte outside the tensors is zero and the disk pages backed by the
    checkpoint read back their checksum."""
    cfg = config(tmp_path, "a")
    losses, states = train_with_checkpoint(tmp_path, "gpt", cfg, tmp_path / "ckpt")
    engine = angel_ptm.initialize(scrambled(CASES["gpt"][0]), config(tmp_path, "b"))
    try:
        manager = engine.manager
        before = dict(manager.clearers)
        for page in manager.pages:  # the slots the load discards, then hands out again, hold garbage
            if page.state is PageState.HOST:
                page.buffer.fill_(0xFF)
        cleared = []
        zero = memops.zero_
        monkeypatch.setattr(memops, "zero_", lambda t: cleared.append(t.numel()) or zero(t))
        engine.load_checkpoint(tmp_path / "ckpt")
        assert manager.clearers == before
        page_bytes = engine.layout.page_bytes
        assert all(n < page_bytes for n in cleared)  # the gaps, never a whole page
        on_page = segments_by_page(engine.layout)
        for kind in SAVED_KINDS:
            for index, page in held_pages(engine, kind):
                runs = sorted((r.offset * r.dtype.itemsize, (r.offset + r.numel) * r.dtype.itemsize)
                              for _, _, r in page_runs(engine.layout, on_page[index], kind, index, page.dtype))
                manager.acquire([page], Tier.HOST, read_only=True)
                try:
                    outside = torch.ones(page_bytes, dtype=torch.bool)
                    for start, end in runs:
                        outside[start:end] = False
                    assert not page.buffer.view(torch.uint8)[outside].any(), page.name
                finally:
                    manager.release([page])
        loss_fn, data = CASES["gpt"][2], batches("gpt")
        assert [step(engine, loss_fn, data[s]) for s in range(AT, STEPS)] == losses[AT:]
        assert_bitwise(states, final_states(engine))
    finally:
        engine.close()


@pytest.mark.parametrize("direct", [True, False])
def test_backed_slots_read_the_same_bytes_through_o_direct_staging_and_through_the_page_cache(tmp_path, monkeypatch,
                                                                                             direct):
    """A backed page's blocks come in with one O_DIRECT read and are copied out (the file's last partial block
    through the page cache), or, where O_DIRECT is refused, every extent through the page cache: either way the
    page checks against its checksum and training resumes exactly."""
    from angel_ptm.memory import backing

    if not direct:
        monkeypatch.setattr(backing, "_open_direct", lambda path: -1)
    staged = []
    stage = backing.BackedReader._stage
    monkeypatch.setattr(backing.BackedReader, "_stage",
                        lambda self, *a: (lambda out: staged.append(len(out)) or out)(stage(self, *a)))
    engine, losses, states, _writes = loaded_with_page_writes_counted(tmp_path, monkeypatch)
    try:
        loss_fn, data = CASES["gpt"][2], batches("gpt")
        assert [step(engine, loss_fn, data[s]) for s in range(AT, STEPS)] == losses[AT:]
        assert_bitwise(states, final_states(engine))
    finally:
        engine.close()
    if direct and not any(staged) and backing._open_direct(str(tmp_path / "ckpt" / ".metadata")) < 0:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert staged and (any(staged) if direct else not any(staged))
