"""Data: token sources (text corpus, token file), a train/val split and a resumable batch sampler."""

from __future__ import annotations

from typing import Any

import numpy as np

from angel_ptm.data.corpus import TextCorpus, TokenFile, write_token_file
from angel_ptm.data.sampler import BatchSampler, Split, split_train_val
from angel_ptm.errors import ConfigValueError, DataError

__all__ = [
    "BatchSampler",
    "Split",
    "TextCorpus",
    "TokenFile",
    "build_datasets",
    "check_part",
    "load_tokens",
    "split_train_val",
    "write_token_file",
]


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def load_tokens(data_cfg: Any) -> tuple[np.ndarray, int]:
    """``(tokens, vocab_size)`` for ``data_cfg`` (a dict or object with ``kind`` = "text" | "tokens", ``path``,
    ``token_dtype`` and optionally ``max_bytes``). A text corpus with no path reads the Python stdlib."""
    kind = _get(data_cfg, "kind", "text")
    path = _get(data_cfg, "path")
    if kind == "text":
        max_bytes = _get(data_cfg, "max_bytes")
        corpus = TextCorpus(path) if max_bytes is None else TextCorpus(path, max_bytes=max_bytes)
        return corpus.tokens, corpus.vocab_size
    if kind == "tokens":
        if path is None:
            raise ConfigValueError("data.path is required when data.kind is 'tokens'")
        token_file = TokenFile(path, _get(data_cfg, "token_dtype", "uint16"), _get(data_cfg, "vocab_size"))
        return token_file.tokens, token_file.vocab_size
    raise ConfigValueError(f"data.kind must be 'text' or 'tokens', got {kind!r}")


def build_datasets(data_cfg: Any, seq_len: int) -> Split:
    """Load the tokens and split them (``data_cfg.val_fraction``, default 0.1) into ``(train, val)``; each part
    must hold at least one window of ``seq_len + 1`` tokens (val may be empty when val_fraction is 0)."""
    tokens, _ = load_tokens(data_cfg)
    split = split_train_val(tokens, _get(data_cfg, "val_fraction", 0.1))
    for name, part in (("train", split.train), ("validation", split.val)):
        if name == "validation" and len(part) == 0:
            continue
        check_part(name, part, seq_len, data_cfg)
    return split


def check_part(name: str, part, seq_len: int, data_cfg: Any) -> None:
    """A DataError unless the split's part `name` holds one window of ``seq_len + 1`` tokens."""
    if len(part) < seq_len + 1:
        raise DataError(
            f"{name} split has {len(part)} tokens, need at least seq_len + 1 = {seq_len + 1} "
            f"(data.path={_get(data_cfg, 'path')}, data.val_fraction={_get(data_cfg, 'val_fraction', 0.1)})"
        )
