"""optimizer.no_decay: which parameters AdamW updates with weight decay 0 (the engine's and the estimate's rule)."""

from __future__ import annotations

import fnmatch

from angel_ptm.errors import ConfigValueError


def no_decay_names(model, patterns) -> frozenset[str]:
    """The parameter names optimizer.no_decay's patterns match (fnmatch, case-sensitive); a pattern that matches
    nothing is a ConfigValueError (a misspelt one would otherwise decay what it meant to spare)."""
    names = [name for name, _ in model.named_parameters()]
    matched: set[str] = set()
    for pattern in patterns:
        hits = {name for name in names if fnmatch.fnmatchcase(name, pattern)}
        if not hits:
            raise ConfigValueError(f"optimizer.no_decay: pattern {pattern!r} matches no parameter (names look like "
                                   f"{names[0]!r})" if names else "optimizer.no_decay: the model has no parameters")
        matched |= hits
    return frozenset(matched)
