"""Which MoE experts are warm: a routing history that decides whose planned fetches go ahead of their gate.

A plan holds every expert routed to in the steps it learned from (schedule/trace.merge_optional: a superset), and
until a layer's gate has routed, the plan's fetches bring all of them up ahead of use. An expert the gate rarely
picks then comes up for nothing most steps (`expert_prefetch_wasted`). `RoutingHistory` keeps, per expert page, an
exponential moving average over steps of whether the step ran that expert (1) or not (0) -- read from the step's
accesses, so it holds for any MoE layer, whatever its gate reports. A page whose average is below
`memory.expert_warm_threshold` is cold: its planned fetches are held at the start of a step (Scheduler._hold_cold)
until its gate routes to it -- then they go as planned, with what lead is left -- and dropped if the gate routes
nothing to it (a layer whose gate reports nothing, not ours, fetches a cold expert on demand when it runs it).
Warm experts' fetches go ahead as planned, as before.

    history = RoutingHistory(ema=0.8, threshold=0.5)
    history.routed(page_ids)      # the step ran these experts (their pages were accessed)
    history.end_step(optional)    # the step is over: every optional page's average moves
    history.cold                  # the pages whose fetches wait for their gate
"""

from __future__ import annotations

from typing import Iterable


class RoutingHistory:
    """Per optional page, the moving average of "its expert was routed to in a step" (1.0 before any step: every
    expert starts warm, as without a history). `threshold` 0 keeps every expert warm."""

    def __init__(self, ema: float = 0.8, threshold: float = 0.5):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.ema, self.threshold = ema, threshold
        self.average: dict[int, float] = {}
        self.cold: frozenset[int] = frozenset()
        self._routed: set[int] = set()

    def routed(self, page_ids: Iterable[int]) -> None:
        self._routed.update(page_ids)

    def end_step(self, optional: Iterable[int]) -> None:
        """The step is over: each of the `optional` pages' average takes this step's outcome; the cold set anew."""
        keep, routed, average = self.ema, self._routed, self.average
        for page_id in optional:
            hit = 1.0 if page_id in routed else 0.0
            average[page_id] = keep * average.get(page_id, 1.0) + (1.0 - keep) * hit
        self._routed = set()
        self.cold = frozenset(p for p, value in average.items() if value < self.threshold)
