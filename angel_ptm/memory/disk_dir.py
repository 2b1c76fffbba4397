"""The disk tier's directory, `memory.disk_dir`: checked before a page file is made there, and cleared of the page
directories that killed runs left behind.

Each engine keeps its slot files in a directory of its own, `pages-<host>-<pid>-<hex>` under the disk dir, and
removes it when it closes, on an error and on Ctrl-C or SIGTERM too. A process killed outright (SIGKILL, the OOM
killer, a lost machine) cannot: its directory stays, with slot files as large as its disk budget. The next engine to
start on the same disk dir removes the directories of this host whose process is gone. The host is in the name
because a disk dir may be shared (NFS, Lustre): a process id only says something on the machine that issued it, and
another machine's live run must never lose its pages.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import mmap
import os
import pathlib
import re
import secrets
import shutil
import socket
from dataclasses import dataclass

import psutil

from angel_ptm.config import format_bytes
from angel_ptm.errors import DiskDirError

log = logging.getLogger("angel_ptm")

KEY = "memory.disk_dir"
PROBE_BYTES = 4096  # one O_DIRECT block (io/slot_file.ALIGNMENT)
# The host may hold dashes; the last two fields are the pid and the engine's hex id. No host: written before hosts
# were named (taken as this host's).
_RANK_DIR = re.compile(r"rank\d+")
_PAGE_DIR = re.compile(r"pages-(?:(?P<host>.+)-)?(?P<pid>\d+)-[0-9a-f]+")


@dataclass(frozen=True)
class DiskDir:
    """A disk dir that passed `check_disk_dir`."""

    path: str  # absolute
    direct: bool | None  # O_DIRECT transfers work there (False: buffered I/O); None: not probed (create=False)
    free_bytes: int


def page_dir(disk_dir: str, owner: int) -> str:
    """The directory of one engine's slot files: named for this host and process, so a later start can tell whether
    its owner is still running."""
    return os.path.join(disk_dir, f"pages-{_host()}-{os.getpid()}-{owner:x}")


def check_disk_dir(path: str, needed_bytes: int = 0, *, create: bool = True) -> DiskDir:
    """Make sure page files can live in `path`, or raise DiskDirError naming memory.disk_dir and the path.

    In order: the path is a directory, or does not exist and can be created (`create=False`: only checks that its
    nearest existing parent is a writable directory, creating nothing, as the estimate must); the filesystem is
    mounted read-write and the directory writable; with `create`, a probe block written there with O_DIRECT, or
    buffered where the filesystem refuses O_DIRECT (which one is logged); at least `needed_bytes` free. Writability
    comes before space, so a full read-only mount is reported as read-only, not as a budget too large."""
    directory = os.path.abspath(os.path.expanduser(path))
    existing = _nearest_existing(directory)
    # Named as the user wrote it when it exists, through its parent when it is still to be created.
    where = directory if existing == directory else f"cannot create {directory}: {existing}"
    if not os.path.isdir(existing):
        raise DiskDirError(f"{KEY}: {where} is {'a file, ' if os.path.isfile(existing) else ''}not a directory")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise DiskDirError(f"{KEY}: {where} is on a read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DiskDirError(f"{KEY}: {where} is not writable (permission denied)")
    direct = None
    if create:
        if existing != directory:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise DiskDirError(f"{KEY}: cannot create {directory}: {_reason(exc)}") from None
            existing, where = directory, directory
        direct = _probe_write(directory, where)
    free = int(shutil.disk_usage(existing).free)
    if free < needed_bytes:
        raise DiskDirError(f"{KEY}: {directory} has {free} bytes ({format_bytes(free)}) free, the page files need "
                           f"{needed_bytes} bytes ({format_bytes(needed_bytes)}); free space or lower "
                           f"memory.disk_budget")
    if direct is not None:
        log.info("%s %s: %s, %s free", KEY, directory,
                 "O_DIRECT I/O" if direct else "buffered I/O (the file system refuses O_DIRECT)", format_bytes(free))
    return DiskDir(directory, direct, free)


def remove_dead_page_dirs(disk_dir: str) -> list[str]:
    """Remove the `pages-<host>-<pid>-<hex>` directories in `disk_dir`, and in its `rank<R>` directories (where the
    ranks of a torchrun job keep theirs, for any world size), that this host's processes left and that no longer
    run (one log line each); return their paths. A missing or unreadable disk dir has none."""
    try:
        names = os.listdir(disk_dir)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        if _RANK_DIR.fullmatch(name) and os.path.isdir(os.path.join(disk_dir, name)):
            removed += remove_dead_page_dirs(os.path.join(disk_dir, name))
            continue
        match = _PAGE_DIR.fullmatch(name)
        path = os.path.join(disk_dir, name)
        if match is None or match["host"] not in (None, _host()) or not os.path.isdir(path):
            continue
        pid = int(match["pid"])
        if psutil.pid_exists(pid):
            continue
        size = _tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            log.warning("removed %s: page files of process %s, which is no longer running (%s freed)",
                        path, pid, format_bytes(size))
            removed.append(path)
    return removed


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "localhost"


def _nearest_existing(directory: str) -> str:
    probe = directory
    while not os.path.lexists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    return probe


def _probe_write(directory: str, where: str) -> bool:
    """Write one aligned block to a temporary file in `directory`: True if O_DIRECT works, False if only buffered
    I/O does (tmpfs and some network file systems refuse O_DIRECT, at open or at the first transfer)."""
    probe = os.path.join(directory, f".angel-ptm-probe-{os.getpid()}-{secrets.token_hex(4)}")
    o_direct = getattr(os, "O_DIRECT", 0)
    try:
        if o_direct:
            try:
                _write_block(probe, o_direct)
                return True
            except OSError as exc:
                if exc.errno not in (errno_mod.EINVAL, errno_mod.EOPNOTSUPP):
                    raise
        _write_block(probe, 0)
        return False
    except OSError as exc:
        raise DiskDirError(f"{KEY}: {where} is not writable: {_reason(exc)}") from None
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def _write_block(path: str, extra_flags: int) -> None:
    block = mmap.mmap(-1, PROBE_BYTES)  # anonymous memory is page-aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | extra_flags, 0o600)
        try:
            os.pwritev(fd, [block], 0)
        finally:
            os.close(fd)
    finally:
        block.close()


def _reason(exc: OSError) -> str:
    name = errno_mod.errorcode.get(exc.errno or 0)
    return f"{exc.strerror} ({name})" if name else str(exc.strerror or exc)


def _tree_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                pass
    return total


def free_disk_bytes(path: str) -> int:
    """Free bytes on the filesystem that holds (or will hold) `path`: its nearest existing ancestor."""
    probe = pathlib.Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(shutil.disk_usage(probe).free)
