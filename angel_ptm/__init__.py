"""angel-ptm: pretraining runtime for models larger than GPU memory."""

__version__ = "0.1.0"


def initialize(model, config=None, trace=None, units=None):
    """Wrap `model` so its states live in pages; see angel_ptm.engine.Engine (`units`: the paging units,
    angel_ptm/units.py)."""
    from angel_ptm.engine import initialize as _initialize

    return _initialize(model, config, trace=trace, units=units)
