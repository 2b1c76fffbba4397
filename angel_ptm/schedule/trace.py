"""The step trace: the sequence of page accesses one training step makes, recorded as it runs.

Every labelled `PageManager.acquire` is one `Access`: which pages, on which tier, what the step was doing
("fwd:<module>", "bwd:<module>", "grad:<param>", "opt:<what>"), which other pages were pinned at that moment
(they cannot be evicted to make room), which of the pages the step then wrote, and the activation bytes alive at
that point. Training steps repeat the same accesses, so the trace of one step is the plan's input for the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from angel_ptm.memory.page import Tier


@dataclass
class Access:
    label: str
    pages: tuple[int, ...]  # page ids, in acquire order
    tier: Tier
    held: tuple[int, ...] = ()  # other pages pinned while this access is granted
    writes: set[int] = field(default_factory=set)  # pages this access's holder wrote (released dirty)
    discards: set[int] = field(default_factory=set)  # pages whose contents died after this access
    activation_bytes: int = 0

    @property
    def phase(self) -> str:
        return self.label.split(":", 1)[0]

    def key(self) -> tuple:
        """What must agree for a later step's access to be "the same" access (the plan's match)."""
        return self.pages, self.tier


@dataclass
class StepTrace:
    accesses: list[Access] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.accesses)

    def __getitem__(self, index: int) -> Access:
        return self.accesses[index]

    def keys(self) -> list[tuple]:
        return [a.key() for a in self.accesses]

    def flat_offsets(self) -> list[int]:
        """Position of each access's first page in the page-by-page sequence (what an eviction policy counts)."""
        offsets, position = [], 0
        for access in self.accesses:
            offsets.append(position)
            position += len(access.pages)
        offsets.append(position)
        return offsets

    def page_sequence(self) -> list[int]:
        return [pid for access in self.accesses for pid in access.pages]

    @property
    def activation_peak(self) -> int:
        return max((a.activation_bytes for a in self.accesses), default=0)

    def to_records(self) -> list[dict]:
        return [{"label": a.label, "pages": list(a.pages), "tier": a.tier.value, "held": list(a.held),
                 "writes": sorted(a.writes), "discards": sorted(a.discards),
                 "activation_bytes": a.activation_bytes} for a in self.accesses]

    @classmethod
    def from_records(cls, records: Iterable[dict]) -> "StepTrace":
        return cls([Access(r["label"], tuple(r["pages"]), Tier(r["tier"]), tuple(r.get("held", ())),
                           set(r.get("writes", ())), set(r.get("discards", ())), int(r.get("activation_bytes", 0)))
                    for r in records])


class StepRecorder:
    """Builds the StepTrace of the step under way; `finish()` hands it over and starts the next one."""

    def __init__(self):
        self._trace = StepTrace()
        self._last_access_of: dict[int, Access] = {}

    def record(self, label: str, pages: Sequence[int], tier: Tier, held: Iterable[int],
               activation_bytes: int) -> Access:
        pages = tuple(pages)
        wanted = set(pages)
        access = Access(label, pages, tier, tuple(sorted(p for p in held if p not in wanted)),
                        activation_bytes=activation_bytes)
        self._trace.accesses.append(access)
        for pid in pages:
            self._last_access_of[pid] = access
        return access

    def wrote(self, page_ids: Iterable[int]) -> None:
        """Pages released dirty: the last access that took each of them wrote it."""
        for pid in page_ids:
            access = self._last_access_of.get(pid)
            if access is not None:
                access.writes.add(pid)

    def discarded(self, page_ids: Iterable[int]) -> None:
        """Pages whose contents died: after the last access that took each of them."""
        for pid in page_ids:
            access = self._last_access_of.get(pid)
            if access is not None:
                access.discards.add(pid)

    def finish(self) -> StepTrace:
        trace, self._trace, self._last_access_of = self._trace, StepTrace(), {}
        return trace

    def __len__(self) -> int:
        return len(self._trace)


def merge_optional(learned: StepTrace, new: StepTrace, optional) -> StepTrace | None:
    """`learned` (the trace a plan was made from) and `new` (a later step's), where they differ only in optional
    accesses (`optional(access)`: an MoE expert's, made only when routed to): every access of either, the ones both
    make taken from `new`, each run of optional accesses between two others in the order of both. The plan made from
    it holds a layer's experts as a superset, so a step routing to experts some earlier step did makes no re-plan.
    None if their other accesses differ (a deviation: plan from `new` alone)."""
    a, b, out = learned.accesses, new.accesses, []
    i = j = 0
    while i < len(a) or j < len(b):
        run_a, run_b = [], []
        while i < len(a) and optional(a[i]):
            run_a.append(a[i])
            i += 1
        while j < len(b) and optional(b[j]):
            run_b.append(b[j])
            j += 1
        out.extend(_union(run_a, run_b))
        if i < len(a) and j < len(b):
            if a[i].key() != b[j].key():
                return None
            out.append(b[j])
            i, j = i + 1, j + 1
        elif i < len(a) or j < len(b):
            return None
    return StepTrace(out)


def _union(a: list[Access], b: list[Access]) -> list[Access]:
    """Both runs' accesses, each key once (b's where both have it), in an order both runs keep."""
    in_b = {access.key() for access in b}
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and j < len(b) and a[i].key() == b[j].key():
            out.append(b[j])
            i, j = i + 1, j + 1
        elif i < len(a) and a[i].key() not in in_b:
            out.append(a[i])
            i += 1
        elif j < len(b):
            out.append(b[j])
            j += 1
        else:  # a[i] is in b, further on: b's order places it
            i += 1
    return out
