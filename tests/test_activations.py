"""activations.checkpoint: full — every paging unit but the root recomputes its forward in backward. The losses
equal the run that keeps every activation (bitwise on our GPT and torch's nn.TransformerEncoder: the same kernels
recompute the same values; within 1e-6 on a HuggingFace GPT-2, which recomputes without its key/value cache), in
every placement and both schedulers, with dropout too (the RNG state is restored for the recomputation); the
activations autograd keeps in forward fall."""

from __future__ import annotations

import pytest
import torch

import angel_ptm
from angel_ptm.config import load_config
from angel_ptm.errors import ConfigValueError

from conformance_cases import MODELS, PAGE_BYTES, one_compute_thread, place  # noqa: F401 (an autouse fixture)
from test_any_model import Encoder
from test_engine_equivalence import engine_config, run_steps


def train(name, placement, scheduler, tmp_path, mode, build=None, **job):
    """Losses of 15 steps, how many unit recomputations backward ran, and the most activation bytes autograd
    kept at once in forward (the binder's count of saved tensors that are not pages)."""
    case = MODELS[name]
    model = (build or case.build)()
    memory = {"page_bytes": PAGE_BYTES, "disk_dir": str(tmp_path / f"{mode}-{placement}-{scheduler}"),
              "scheduler": scheduler}
    config = place(engine_config(memory, **job), model, placement)
    config["activations"] = {"checkpoint": mode}
    torch.manual_seed(7)  # dropout's masks
    engine = angel_ptm.initialize(model, config)
    recomputed, peak = [], [0]
    binder = engine.binder
    access = binder.param_access

    class Counting:
        def acquire(self, pages, tier, label=""):
            if label.startswith("recompute:"):
                recomputed.append(label)
            return access.acquire(pages, tier, label=label)

        def __getattr__(self, attr):
            return getattr(access, attr)

    binder.param_access = Counting()
    pack = binder._pack

    def counted_pack(tensor):
        packed = pack(tensor)
        peak[0] = max(peak[0], binder.activation_bytes)
        return packed

    binder._pack = counted_pack
    try:
        losses = run_steps(engine, case.batches(), case.loss)
    finally:
        engine.close()
    return losses, len(recomputed), peak[0]


@pytest.mark.parametrize("placement", ["device", "host", "disk"])
@pytest.mark.parametrize("scheduler", ["on_demand", "planned"])
def test_full_recomputation_gives_the_same_losses_in_every_placement(tmp_path, placement, scheduler):
    kept, none, kept_peak = train("gpt", placement, scheduler, tmp_path, "none")
    recomputed, count, peak = train("gpt", placement, scheduler, tmp_path, "full")
    assert recomputed == kept
    assert none == 0 and count == 15 * 2  # the GPT's two blocks, every step
    assert peak < kept_peak / 2


@pytest.mark.parametrize("name", ["hf-gpt2", "transformer", "dropout"])
def test_full_recomputation_on_models_it_was_not_written_for(tmp_path, name):
    build = (lambda: Encoder(dropout=0.1)) if name == "dropout" else None  # the recomputation draws the same masks
    case = "transformer" if name == "dropout" else name
    kept, _, _ = train(case, "disk", "planned", tmp_path, "none", build)
    recomputed, count, _ = train(case, "disk", "planned", tmp_path, "full", build)
    assert count > 0
    if name == "hf-gpt2":  # recomputed without its key/value cache (use_cache off): another attention code path
        assert recomputed == pytest.approx(kept, rel=1e-6)
    else:
        assert recomputed == kept


@pytest.mark.parametrize("dtype,staleness", [("bfloat16", 0), ("float32", 1)])
def test_full_recomputation_under_mixed_precision_and_the_delayed_update(tmp_path, dtype, staleness):
    kept, _, _ = train("gpt", "disk", "planned", tmp_path, "none", dtype=dtype, staleness=staleness)
    recomputed, count, _ = train("gpt", "disk", "planned", tmp_path, "full", dtype=dtype, staleness=staleness)
    assert count == 15 * 2 and recomputed == kept


def test_selective_recomputation_is_refused_until_it_is_built():
    assert load_config({"activations": {"checkpoint": "full"}}).activations.checkpoint == "full"
    with pytest.raises(ConfigValueError, match="activations.checkpoint"):
        load_config({"activations": {"checkpoint": "selective"}})


def test_the_estimate_keeps_each_blocks_input_and_one_blocks_activations_under_recomputation():
    from angel_ptm.estimate import estimate_job
    from angel_ptm.models import GPTConfig, estimate_activation_bytes

    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, dim=32)
    tokens, per_layer = 2 * cfg.seq_len, 8 * cfg.dim + 4 * cfg.kv_heads * cfg.head_dim + 4 * cfg.hidden_dim
    kept, recomputed = estimate_activation_bytes(cfg, 2), estimate_activation_bytes(cfg, 2, recompute=True)
    assert kept - recomputed == tokens * 4 * ((cfg.n_layer - 1) * per_layer - cfg.n_layer * cfg.dim)
    job = {"model": {"vocab_size": 64, "seq_len": 16, "n_layer": 4, "n_head": 2, "dim": 32}, "data": {"batch_size": 2},
           "trainer": {"device": "cpu"}}
    assert estimate_job(job).activation_bytes == kept
    assert estimate_job(dict(job, activations={"checkpoint": "full"})).activation_bytes == recomputed
