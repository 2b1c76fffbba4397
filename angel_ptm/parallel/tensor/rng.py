"""Random numbers under tensor parallelism (Megatron's model-parallel RNG), with no state of their own.

A tp rank's activations are in one of two states, and a dropout needs a different stream in each:

  replicated  outside the tensor-parallel region without sequence parallelism (every tp rank holds the same tensor):
              every rank must draw the same mask, or the ranks' copies part ways and the split math is wrong
  split       inside the region (heads, feed-forward columns; from the region's entry to its row-parallel exit), and
              under sequence parallelism everywhere between the regions (sequence shards): each rank must draw a
              mask of its own, or every head group / sequence shard gets the same mask

The replicated stream is torch's default generator (the CPU one, and the current GPU's), the same on every tp rank:
`sync_random_state` makes it so when the model is split. A split scope (`ShardedRandom.fork`, a forward pre-hook
the plan puts on the region's modules) draws one number from the default generator -- the same draw on every tp
rank, so the replicated stream stays in step -- seeds the generator from it and the tp rank, and puts the default
generator's state back when the scope ends (`join`, a forward hook that runs on errors too) or where the
activations turn replicated again (`replicated`, called by the region's exit without sequence parallelism). No
state is kept between scopes: activation recomputation (torch's checkpoint restores the default generator where
the unit began) draws the same masks again, and the masks do not depend on how the step was scheduled.

Scopes are installed only on a model with dropout (`has_dropout`: a dropout module or a `*dropout*` rate above
zero): the draw changes the default generator's sequence, which a model without random ops keeps exactly as a
1-rank run has it.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from angel_ptm.parallel.collectives import FAKE_TRACE

_MIX = 0x9E3779B97F4A7C15  # the golden-ratio constant: spreads consecutive ranks' seeds apart
_SEED_RANGE = 1 << 62


def has_dropout(model: nn.Module) -> bool:
    """Whether `model` draws random numbers in its forward the way transformers do: a dropout module with p > 0,
    or a module attribute named like a dropout rate (`dropout`, `attention_dropout`, `dropout_p`, ...) above zero
    (HuggingFace's attention modules keep the rate as a float and call the functional dropout)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for key, value in vars(module).items():
            if ("dropout" in key.lower() and isinstance(value, (int, float)) and not isinstance(value, bool)
                    and value > 0):
                return True
    return False


def sync_random_state(comm) -> None:
    """Tp rank 0's default generator states (CPU, and the current GPU's where CUDA is in use) on every tp rank:
    the replicated stream starts equal everywhere (a script that seeded its ranks differently would otherwise get
    a different replicated dropout mask on each rank)."""
    if comm.collectives is None:
        return
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    states = comm.collectives.broadcast_object(states, 0, "tp rank 0's random state")
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class _Frame:
    __slots__ = ("cpu", "cuda", "active")

    def __init__(self, cpu, cuda, active: bool):
        self.cpu, self.cuda, self.active = cpu, cuda, active


class ShardedRandom:
    """One tp rank's split scopes (see the module docstring). Frames are per thread: a GPU backward recomputes on
    autograd's device thread."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self._local = threading.local()
        self.forks = 0  # scopes entered (forward and recomputation)
        self.scoped: list[nn.Module] = []  # the modules whose forward is a split scope

    def _frames(self) -> list:
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def fork(self) -> None:
        """Enter a split scope: this rank's stream until `join` (or `replicated`)."""
        frames = self._frames()
        if self.size == 1 or getattr(FAKE_TRACE, "on", False):  # a fake-tensor trace draws nothing real
            frames.append(_Frame(None, None, False))
            return
        seed = int(torch.empty((), dtype=torch.int64).random_(0, _SEED_RANGE))  # the replicated stream's draw
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        frames.append(_Frame(torch.get_rng_state(), cuda, True))
        mine = (seed * _MIX + self.rank + 1) % _SEED_RANGE
        torch.default_generator.manual_seed(mine)
        if cuda is not None:
            torch.cuda.manual_seed(mine)
        self.forks += 1

    def join(self) -> None:
        """Leave the innermost scope: the stream it was entered from goes on where it left off."""
        frames = self._frames()
        if frames:
            self._restore(frames.pop())

    def replicated(self) -> None:
        """The activations turn replicated inside a scope (the row-parallel exit without sequence parallelism): the
        replicated stream again, for the rest of every open scope."""
        frames = self._frames()
        outermost = next((f for f in frames if f.active), None)
        if outermost is not None:
            self._restore(outermost)
            for frame in frames:
                frame.active = False

    @staticmethod
    def _restore(frame: _Frame) -> None:
        if frame.active:
            torch.set_rng_state(frame.cpu)
            if frame.cuda is not None:
                torch.cuda.set_rng_state(frame.cuda)
            frame.active = False

    def scope(self, module: nn.Module) -> None:
        """`module`'s forward runs in a split scope (its pre-hook forks, its forward hook joins, on errors too)."""
        module.register_forward_pre_hook(lambda *_: self.fork())
        module.register_forward_hook(lambda *_: self.join(), always_call=True)
        self.scoped.append(module)
