"""User-style models whose ranks read different parameters inside a paging unit (tests/dist_jobs.py runs them
under ZeRO-3 on a device too small to keep every page group gathered from forward to backward)."""

import torch
from torch import nn


class BranchyBlocks(nn.Module):
    """Blocks (paging units of their own) that each read one of two weights, chosen by the micro-batch's sign: each
    rank's backward reads other parameters of the same unit than its peer's (a user's own data-dependent model;
    MoE experts at ep 1 are one of these)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(self.make_blocks())
        self.head = nn.Linear(24, 1)

    def make_blocks(self) -> list[nn.Module]:
        return [BranchyBlock() for _ in range(3)]

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BranchyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(24, 48), nn.Linear(48, 24)
        self.pos, self.neg = nn.Linear(48, 48), nn.Linear(48, 48)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + (self.pos(h) if x.mean() > 0 else self.neg(h))
        return x + self.out(h)


class BranchyNested(BranchyBlocks):
    """The same reads, each block's output made by an inner unit (units=UNITS["nested"]: one node ends both), and
    between them a block that returns its input unchanged for micro-batches whose mean is negative (on some ranks
    only: its output node is then the block before it's)."""

    def make_blocks(self) -> list[nn.Module]:
        return [NestedBlock(), SkipBlock(), NestedBlock()]


class NestedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.inner = nn.Linear(24, 48), BranchyInner()

    def forward(self, x):
        return self.inner(x, torch.tanh(self.inp(x)))


class BranchyInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos, self.neg, self.out = nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 24)

    def forward(self, x, h):
        return x + self.out(h + (self.pos(h) if x.mean() > 0 else self.neg(h)))


class SkipBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(24, 48), nn.Linear(48, 24)

    def forward(self, x):
        return x if x.mean() < 0 else x + self.out(torch.tanh(self.inp(x)))


UNITS = {"nested": [NestedBlock, BranchyInner, SkipBlock]}  # a job's `units`: what initialize(..., units=) is given
