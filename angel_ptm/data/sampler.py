"""Train / validation split of a token stream, and a resumable random-window batch sampler."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from angel_ptm.errors import ConfigValueError, DataError


class Split(NamedTuple):
    train: np.ndarray
    val: np.ndarray


def split_train_val(tokens: np.ndarray, val_fraction: float = 0.1) -> Split:
    """The last ``floor(len * val_fraction)`` tokens are validation; everything before them is training.
    Contiguous views, no copy, no overlap."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(len(tokens) * val_fraction)
    cut = len(tokens) - n_val
    return Split(train=tokens[:cut], val=tokens[cut:])


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens; ``x`` is the first ``seq_len``, ``y`` the last ``seq_len``.

    Batch ``k`` is a pure function of ``(seed, k)``: each batch gets its own PCG64 generator seeded with
    ``[seed, k]``, so a run resumed at step ``k`` sees exactly the batches an uninterrupted run would.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, start_step: int = 0):
        if batch_size <= 0 or seq_len <= 0:
            raise ConfigValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be > 0")
        if start_step < 0:
            raise ConfigValueError(f"start_step must be >= 0, got {start_step}")
        tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
        if tokens.ndim != 1:
            raise DataError(f"token stream must be 1-D, got shape {tuple(tokens.shape)}")
        if len(tokens) < seq_len + 1:
            raise DataError(f"token stream has {len(tokens)} tokens, need at least seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.step = start_step
        self._offsets = np.arange(seq_len + 1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(x, y)`` int64 tensors of shape [batch_size, seq_len] for batch number ``step``."""
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        # Highest start is len - seq_len - 1, so the window's last token (start + seq_len) is in range.
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        windows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> "BatchSampler":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(self.step)
        self.step += 1
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.seed = int(state.get("seed", self.seed))
