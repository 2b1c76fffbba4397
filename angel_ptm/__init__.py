"""angel-ptm: pretraining runtime for models larger than GPU memory."""

__version__ = "0.1.0"

# The oldest torch the test suite has been run on: 2.8.0 (a CPU venv: all but four tests pass: two bf16 comparisons
# at the edge of their tolerance, and the activation trace under tensor parallelism with dropout, which 2.8's fake
# tensors refuse, so the estimate warns and leaves those activations out); 2.11 and 2.13 pass whole. torch 2.4.1
# failed 164 tests: it lacks what the runtime uses (torch.utils.checkpoint.create_selective_checkpoint_contexts,
# gloo's reduce_scatter, dcp.save's no_dist), which surfaced only mid-run as AttributeErrors and failed collectives.
MIN_TORCH = (2, 8)


def unsupported_torch(version: str) -> str | None:
    """Why torch `version` cannot run angel-ptm, or None when it can."""
    parts = version.split("+")[0].split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None  # a build whose version says nothing usable: let it run
    if found >= MIN_TORCH:
        return None
    return (f"angel-ptm needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]} (this is torch {version}): install a newer torch "
            f"first, e.g. pip install torch==2.13.0")


def _check_torch() -> None:
    import torch

    problem = unsupported_torch(torch.__version__)
    if problem is not None:
        raise ImportError(problem)


_check_torch()


def initialize(model, config=None, trace=None, units=None, example_inputs=None):
    """Wrap `model` so its states live in pages; see angel_ptm.engine.initialize (`units`: the paging units,
    angel_ptm/units.py; `example_inputs`: one micro-batch's forward arguments, so the estimate counts the
    activations of any model)."""
    from angel_ptm.config import Config, load_config
    from angel_ptm.config.combinations import warn_trainer_only
    from angel_ptm.engine import initialize as _initialize

    if not isinstance(config, Config):
        config = load_config(config)
    warn_trainer_only(config)
    return _initialize(model, config, trace=trace, units=units, example_inputs=example_inputs)
