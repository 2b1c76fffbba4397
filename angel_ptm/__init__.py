"""angel-ptm: pretraining runtime for models larger than GPU memory."""

__version__ = "0.1.0"


def initialize(model, config=None, trace=None, units=None, example_inputs=None):
    """Wrap `model` so its states live in pages; see angel_ptm.engine.initialize (`units`: the paging units,
    angel_ptm/units.py; `example_inputs`: one micro-batch's forward arguments, so the estimate counts the
    activations of any model)."""
    from angel_ptm.engine import initialize as _initialize

    return _initialize(model, config, trace=trace, units=units, example_inputs=example_inputs)
