"""Token sources: a byte-level text corpus read from a directory, and a memory-mapped flat token file.

Both expose the same small surface: ``tokens`` (a 1-D numpy array or memmap), ``len()`` and ``vocab_size``.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

from angel_ptm.errors import ConfigValueError, DataError

PathLike = Union[str, os.PathLike]

DEFAULT_SUFFIXES = (".py", ".txt", ".md", ".rst")
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
# Directories skipped when walking: installed third-party packages and test suites are not "the stdlib",
# and they differ between installs, which would make the default corpus machine-dependent.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def default_text_path() -> Path:
    """The running Python's standard-library source directory."""
    return Path(sysconfig.get_paths()["stdlib"])


class TextCorpus:
    """Byte-level tokens (vocab 256) from the text files under ``path``, read recursively in sorted order and
    joined with ``b"\\n"``; reading stops after ``max_bytes`` bytes. ``path`` may also be a single file."""

    vocab_size = 256

    def __init__(
        self,
        path: Optional[PathLike] = None,
        suffixes: Iterable[str] = DEFAULT_SUFFIXES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        if max_bytes <= 0:
            raise ConfigValueError(f"data.max_bytes must be > 0, got {max_bytes}")
        self.path = Path(path) if path is not None else default_text_path()
        self.suffixes = tuple(suffixes)
        self.max_bytes = int(max_bytes)
        self.files = self._list_files()
        self.tokens = self._read(self.files)

    def _list_files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if not self.path.is_dir():
            raise DataError(f"text corpus directory not found: {self.path}")
        files = []
        for root, dirs, names in os.walk(self.path):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
            found = (Path(root, n) for n in sorted(names) if n.endswith(self.suffixes))
            # (a FIFO, socket or device named *.txt is no text file: reading it would block or never end; a broken
            # link stays, and reading it is the error it names)
            files.extend(f for f in found if f.is_file() or not f.exists())
        if not files:
            raise DataError(f"no text files ({', '.join(self.suffixes)}) found under {self.path}")
        return files

    def _read(self, files: list[Path]) -> np.ndarray:
        buf = bytearray()
        for i, file in enumerate(files):
            if len(buf) >= self.max_bytes:
                break
            if i:
                buf += b"\n"
            try:
                buf += file.read_bytes()
            except OSError as err:
                raise DataError(f"cannot read text file {file}: {err.strerror}") from err
        del buf[self.max_bytes :]
        if not buf:
            raise DataError(f"text corpus under {self.path} is empty")
        return np.frombuffer(buf, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.tokens)


def _token_dtype(dtype: str) -> type:
    if dtype not in TOKEN_DTYPES:
        raise ConfigValueError(f"data.token_dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    return TOKEN_DTYPES[dtype]


class TokenFile:
    """A flat binary file of little-endian uint16 / uint32 token ids (nanoGPT / Megatron style), memory-mapped
    read-only so a corpus larger than RAM costs nothing until sampled."""

    def __init__(self, path: PathLike, dtype: str = "uint16", vocab_size: Optional[int] = None):
        self.path = Path(path)
        self.dtype = dtype
        np_dtype = np.dtype(_token_dtype(dtype)).newbyteorder("<")
        if not self.path.is_file():
            raise DataError(f"token file not found: {self.path}")
        size = self.path.stat().st_size
        if size == 0:
            raise DataError(f"token file {self.path} is empty")
        if size % np_dtype.itemsize != 0:
            raise DataError(
                f"token file {self.path} has {size} bytes, not a multiple of {np_dtype.itemsize} ({dtype})"
            )
        self.tokens = np.memmap(self.path, dtype=np_dtype, mode="r")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        """As given, else max token + 1 (one pass over the file, computed on first use)."""
        if self._vocab_size is None:
            self._vocab_size = int(self.tokens.max()) + 1
        return self._vocab_size

    def __len__(self) -> int:
        return len(self.tokens)


def write_token_file(path: PathLike, tokens: Union[np.ndarray, Iterable[int]], dtype: str = "uint16") -> Path:
    """Write ``tokens`` as a flat token file; atomic (temp file + fsync + rename), so a reader never sees a
    half-written file."""
    path = Path(path)
    np_dtype = np.dtype(_token_dtype(dtype)).newbyteorder("<")
    array = np.asarray(tokens).reshape(-1)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np_dtype).max):
        raise DataError(
            f"tokens in [{array.min()}, {array.max()}] do not fit {dtype} for token file {path}"
        )
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(array.astype(np_dtype).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
