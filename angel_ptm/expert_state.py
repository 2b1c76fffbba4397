"""State dicts under expert parallelism (parallel.ep > 1): each rank of an ep group holds some experts of every MoE
layer. A state dict holds the unsplit model's: every expert under its index in the unsplit layer, in the order a
one-rank run gives (gathered over the ep group: each of its ranks calls), and a whole state dict loads each expert
into the rank that holds it, as checkpoints do.

    view = ExpertView.of(engine)          # None without expert parallelism
    view.order(local_names)               # the unsplit order of a list of this rank's names
    view.gather(mine, what)               # every rank's {unsplit name: value}, merged
"""

from __future__ import annotations

import re

EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.*)$")  # <layer>.experts.<index>.<tensor>


def _split(name: str) -> tuple[str, int, str]:
    prefix, index, rest = EXPERT.match(name).groups()
    return prefix, int(index), rest


class ExpertView:
    def __init__(self, collectives, names: dict[str, str]):
        self.collectives = collectives
        self.global_of = dict(names)  # this rank's expert names -> the unsplit model's
        self.local_of = {g: n for n, g in names.items()}
        # every rank's expert names (unsplit), each rank's in its own order: one small gather per state dict (the
        # experts a rank holds change when parallel.moe_rebalance_every moves them)
        self.everyone: list[list[str]] = collectives.all_gather_object(
            [names[n] for n in names], "expert names for state dicts")
        self.every = {g for names_ in self.everyone for g in names_}

    @classmethod
    def of(cls, engine) -> "ExpertView | None":
        ep = getattr(engine.split, "ep", None)
        if ep is None or ep.collectives is None or not engine.expert_names:
            return None
        return cls(ep.collectives, engine.expert_names)

    def order(self, local_names: list[str]) -> list[str]:
        """`local_names` in the unsplit model's order: each MoE layer's experts (at the place of this rank's first
        one of the layer) replaced by every rank's of that layer, by index, each expert's tensors in their order;
        of another rank's experts only the tensors whose counterparts are in `local_names` (a param group)."""
        kept = {(_split(self.global_of[n])[0], _split(self.global_of[n])[2]) for n in local_names
                if n in self.global_of}
        by_layer: dict[str, dict[int, list[str]]] = {}
        for names in self.everyone:
            for name in names:
                prefix, index, rest = _split(name)
                if (prefix, rest) in kept:
                    by_layer.setdefault(prefix, {}).setdefault(index, []).append(name)
        out, done = [], set()
        for name in local_names:
            unsplit = self.global_of.get(name)
            if unsplit is None:
                out.append(name)
                continue
            prefix = _split(unsplit)[0]
            if prefix not in done:
                done.add(prefix)
                out.extend(n for index in sorted(by_layer[prefix]) for n in by_layer[prefix][index])
        return out

    def gather(self, mine: dict, what: str) -> dict:
        """Every rank's {unsplit expert name: value} of the ep group, merged (values pickled: state-dict sizes)."""
        merged: dict = {}
        for part in self.collectives.all_gather_object(mine, what):
            merged.update(part)
        return merged
