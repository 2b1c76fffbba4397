"""Conformance (issue 16): any nn.Module trains through the engine as with torch.optim.AdamW, wherever its pages live.

Each model (conformance_cases.MODELS) trains 15 steps in three placements (device; device+host; device+host+disk,
with tensors spanning pages) under both schedulers. The losses must be within 1e-6 relative of plain PyTorch's on
the same seed and data, the final parameters within 1e-5 relative and the buffers (BatchNorm's running statistics)
the same, or `initialize` must refuse the model with a typed error (angel_ptm.errors) that says why.
"""

import functools
import itertools
import re

import pytest

from conformance_cases import (MODELS, PLACEMENTS, SCHEDULERS, assert_placement_is_real, assert_state_matches,
                               run_engine, trained_state)
from conformance_cases import one_compute_thread  # noqa: F401  (an autouse fixture)
from test_engine_equivalence import assert_same_losses, train_plain

COMBINATIONS = list(itertools.product(MODELS, PLACEMENTS, SCHEDULERS))
# Models the engine refuses at initialize, with the pattern of the one-line reason it gives (listed in the README).
# None today: a refusal of any other model fails its test.
REFUSED: dict[str, str] = {}


@functools.cache
def torch_run(name: str):
    """The losses, final parameters and buffers of plain PyTorch with AdamW, once per model."""
    case = MODELS[name]
    model = case.build()
    losses = train_plain(model, case.batches(), case.loss)
    return (losses, *trained_state(model))


@pytest.mark.parametrize("name, placement, scheduler", COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS])
def test_training_matches_torch_adamw(name, placement, scheduler, tmp_path):
    expected_losses, expected_params, expected_buffers = torch_run(name)
    engine, losses = run_engine(name, placement, scheduler, tmp_path)
    if losses is None:  # refused at initialize: only where the refusal is expected and says why
        assert name in REFUSED and re.search(REFUSED[name], str(engine)), f"{name} refused: {engine}"
        return
    assert name not in REFUSED, f"{name} was expected to be refused at initialize ({REFUSED[name]})"
    try:
        assert_same_losses(expected_losses, losses)
        assert_state_matches(engine, expected_params, expected_buffers, MODELS[name].gradient_free)
        assert_placement_is_real(engine, placement)
    finally:
        engine.close()
