"""Which pages a data-parallel rank holds: THE ownership rule, shared by the engine and the estimate.

The layout groups pages in `dp` consecutive pages; rank r owns page r of every group (`PageLayout.owner`). ZeRO's
stage says which kinds are sharded:

  stage 0   nothing: every rank holds every page of every kind (gradients all-reduced, as DDP)
  stage 1   optimizer states (exp_avg, exp_avg_sq and the fp32 master): a rank creates only the pages it owns;
            gradients are reduce-scattered once backward is over (only the owner's update reads a page's mean)
  stage 2   stage 1, and gradients are sharded during backward: a page group is reduce-scattered as soon as its
            gradients are final and the pages other ranks own die then
  stage 3   stage 2, and parameters: a page another rank owns exists here as a REMOTE page (no slot, no disk copy),
            filled by an all-gather of its group while a unit computes with it, and dropped after

Gradient pages exist on every rank in every stage: backward writes a rank's own gradient of every tensor, and the
reduction makes the owner's page the mean over ranks (stages 1-3 then drop the others unwritten).

Rank-local pages (expert parallelism's experts, `local_pages`) hold different tensors on the ranks of one
expert-parallel group; with ep < dp the `local_dp` ranks of an expert-dp group hold the same ones. Those shard the
experts' states as ZeRO shards the others: local page i is owned by expert-dp rank (i - start) % local_dp, which
alone keeps its master weights and moments (stages 1-3) and updates it; at stages 1-2 the others get the new
parameters from it after the step, at stage 3 they hold the page REMOTE and gather it while a layer computes
(zero.ExpertGatherer). At stages 2-3 the experts' gradients are reduce-scattered onto their owners during the last
backward, as each MoE layer's backward ends (parallel/expert_grads.py); at stages 0-1 at the step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq", "master")
SHARDED_KINDS = {0: (), 1: OPTIMIZER_KINDS, 2: OPTIMIZER_KINDS, 3: OPTIMIZER_KINDS + ("param",)}


@dataclass(frozen=True)
class Ownership:
    rank: int = 0
    dp: int = 1
    stage: int = 0
    # Pages [start, end) of rank-local tensors (PageLayout.local_pages: expert parallelism's experts, other ones on
    # every rank): never gathered; with ep < dp sharded over the ranks holding the same experts (module docstring).
    local_pages: tuple[int, int] | None = None
    local_dp: int = 1  # the ranks holding this rank's experts (the expert-dp group: dp / ep)
    local_rank: int = 0  # this rank's place in it

    def sharded(self, kind: str) -> bool:
        """Pages of `kind` live on their owner only (REMOTE elsewhere for parameters, absent for optimizer states)."""
        return self.dp > 1 and kind in SHARDED_KINDS[self.stage]

    def sharded_local(self, kind: str) -> bool:
        """Rank-local pages of `kind` live on their owner in the expert-dp group only (optimizer states at stage >= 1,
        parameters too at stage 3)."""
        return self.local_dp > 1 and kind in SHARDED_KINDS[self.stage]

    def sharded_at(self, kind: str, index: int) -> bool:
        """Page `index` of `kind` lives on its owner only (its group's: the dp group's, or the expert-dp group's)."""
        return self.sharded_local(kind) if self.rank_local(index) else self.sharded(kind)

    def rank_local(self, index: int) -> bool:
        return self.local_pages is not None and self.local_pages[0] <= index < self.local_pages[1]

    def home(self, index: int) -> int:
        """The owner's rank in the page's group: the dp group, or for a rank-local page the expert-dp group."""
        if self.rank_local(index):
            return (index - self.local_pages[0]) % self.local_dp
        return index % self.dp

    def owns(self, index: int) -> bool:
        return self.home(index) == (self.local_rank if self.rank_local(index) else self.rank)

    def local(self, kind: str, index: int) -> bool:
        """This rank holds page `index` of `kind` as its own (creates it, keeps it on its tiers)."""
        return not self.sharded_at(kind, index) or self.owns(index)

    def remote(self, kind: str, index: int) -> bool:
        """Page `index` of `kind` exists here as a REMOTE page (its group is gathered before use)."""
        return kind == "param" and self.sharded_at(kind, index) and not self.owns(index)

    def local_count(self, kind: str, n_pages: int) -> int:
        """Pages of `kind` this rank creates out of the `n_pages` the layout has."""
        return sum(1 for i in range(n_pages) if self.local(kind, i))

    def remote_count(self, n_pages: int) -> int:
        """Parameter pages of the `n_pages` that exist here as REMOTE pages (gathered in turn, ZeRO-3)."""
        return sum(1 for i in range(n_pages) if self.remote("param", i))

    def updated(self, index: int) -> bool:
        """This rank's optimizer updates page `index` (stage 0: every rank updates every page)."""
        if self.rank_local(index):
            return not self.sharded_local("master") or self.owns(index)
        return self.stage == 0 or self.dp == 1 or self.owns(index)

    @property
    def gathers(self) -> bool:
        """Parameters are gathered before use (stage 3 with more than one rank)."""
        return self.sharded("param")


def with_experts(own: Ownership, local_pages: tuple[int, int] | None, ep: int) -> Ownership:
    """`own` with the layout's rank-local pages (expert parallelism's experts): with ep < dp, the dp / ep ranks at the
    same place of each group of ep consecutive ranks hold the same experts (the mesh's expert-dp group), and this
    rank is the (rank // ep)-th of them. The engine and the estimate both call it."""
    if local_pages is None:
        return own
    return dataclasses.replace(own, local_pages=local_pages, local_dp=max(1, own.dp // ep), local_rank=own.rank // ep)


def gather_reserve(max_tensor_pages: int, update_pins: int) -> int:
    """Device slots a ZeRO-3 rank keeps for its own pages while gathered groups are held (pinned): the gradient
    pages of one tensor (written during backward), one optimizer update's pages when the update runs on the
    device (gathered groups are held until the step is over), and one for a page on its way."""
    return max_tensor_pages + update_pins + 1


def gather_capacity(chain_groups: int, dp: int, device_slots: int, reserve: int, n_groups: int) -> int:
    """Page groups a ZeRO-3 rank keeps gathered at once: every group the device has room for beside `reserve`
    (more held groups: fewer gathered again in backward, more gathered ahead), at least the groups of the largest
    unit with the units around it (all pinned while it runs), at most every group."""
    return min(n_groups, max(chain_groups, (device_slots - reserve) // dp))


def osdp_replicable(capacity_groups: int, chain_groups: int) -> int:
    """OSDP: page groups that may be kept replicated (gathered for good): half of the gathered-group room beside the
    largest unit's chain (the other half keeps prefetching the groups that stay sharded)."""
    return max(0, capacity_groups - chain_groups) // 2


def min_gather_device_pages(chain_groups: int, dp: int, reserve: int) -> int:
    """The fewest device slots ZeRO-3 runs with: the largest unit's chain of groups, gathered, beside `reserve`."""
    return chain_groups * dp + reserve


def collective_bytes(own: Ownership, layout, page_bytes: int) -> dict:
    """Per optimizer step, the bytes this rank hands to each collective (its inputs, as Collectives counts them):
    the gradient reduction over every trainable page (fp32), the parameters' all-gather of one page per group
    (stages 1 and 2: after the update; stage 3: before the forward and again before the backward of each unit, at
    most, when the gathered groups did not stay)."""
    if own.dp == 1:
        return {}
    trainable = layout.trainable_pages
    out = {"all_reduce" if own.stage == 0 else "reduce_scatter": trainable * page_bytes}
    if own.stage in (1, 2):
        out["all_gather"] = trainable // own.dp * page_bytes
    elif own.stage == 3:
        out["all_gather"] = 2 * (layout.n_pages // own.dp) * page_bytes
    return out
