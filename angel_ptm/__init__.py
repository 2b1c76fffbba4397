"""angel-ptm: pretraining runtime for models larger than GPU memory."""

__version__ = "0.1.0"


def initialize(model, config=None, trace=None):
    """Wrap `model` so its states live in pages; see angel_ptm.engine.Engine."""
    from angel_ptm.engine import initialize as _initialize

    return _initialize(model, config, trace=trace)
