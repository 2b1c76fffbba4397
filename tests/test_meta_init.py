"""A model built on the meta device is materialized straight into its pages, with a normal build's values."""

import math

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import ConfigValueError
from angel_ptm.memory import Tier
from angel_ptm.models import GPT, GPTConfig

KIB = 1024
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, dim=32)


def built(cfg: GPTConfig = CFG, seed: int = 0, meta: bool = False, factory=GPT) -> nn.Module:
    torch.manual_seed(seed)
    if not meta:
        return factory(cfg)
    with torch.device("meta"):
        return factory(cfg)


def engine_for(model, tmp_path, page_bytes=16 * KIB, **memory):
    config = {"optimizer": {"lr": 1e-2, "weight_decay": 0.0},
              "memory": {"page_bytes": page_bytes, "disk_dir": str(tmp_path), **memory},
              "trainer": {"grad_clip": 0}}
    return angel_ptm.initialize(model, config)


def batches(n, vocab=64, seq=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (4, seq), generator=g)
    return [(x, torch.roll(x, -1, dims=1))] * n  # one batch, learned step by step


def train(engine, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_meta_built_gpt_has_exactly_the_parameters_of_a_normal_build_and_the_same_rng_state_after(tmp_path):
    reference = built()
    rng_after_build = torch.get_rng_state()
    engine = engine_for(built(meta=True), tmp_path)
    try:
        assert torch.equal(torch.get_rng_state(), rng_after_build)
        for name, param in reference.named_parameters():
            assert torch.equal(engine.parameter(name), param.detach()), name
    finally:
        engine.close()


@pytest.mark.parametrize("overrides", [dict(tie_embeddings=False), dict(n_head=4, n_kv_head=2)])
def test_untied_and_grouped_query_gpts_built_on_meta_match_their_normal_builds(tmp_path, overrides):
    cfg = GPTConfig(**{**CFG.__dict__, **overrides})
    reference = built(cfg)
    engine = engine_for(built(cfg, meta=True), tmp_path)
    try:
        for name, param in reference.named_parameters():
            assert torch.equal(engine.parameter(name), param.detach()), name
    finally:
        engine.close()


def test_meta_built_gpt_trains_exactly_like_the_normally_built_one_with_a_finite_falling_loss(tmp_path):
    data = batches(6)
    normal = engine_for(built(), tmp_path / "normal")
    meta = engine_for(built(meta=True), tmp_path / "meta")
    try:
        losses = train(meta, data)
        assert losses == train(normal, data)
    finally:
        normal.close()
        meta.close()
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5


def test_rope_tables_of_a_meta_built_gpt_are_computed_on_the_compute_device(tmp_path):
    reference, model = built(), built(meta=True)
    engine = engine_for(model, tmp_path)
    try:
        assert model.rope.cos.device == engine.device and model.rope.sin.device == engine.device
        assert torch.equal(model.rope.cos.cpu(), reference.rope.cos)
        assert torch.equal(model.rope.sin.cpu(), reference.rope.sin)
    finally:
        engine.close()


def test_initial_statistics_follow_the_gpt_init_rule(tmp_path):
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=4, dim=256)
    engine = engine_for(built(cfg, meta=True), tmp_path, page_bytes=256 * KIB)
    try:
        assert engine.parameter("layers.0.attention.wq.weight").std().item() == pytest.approx(0.02, rel=0.05)
        assert engine.parameter("layers.3.feed_forward.w1.weight").std().item() == pytest.approx(0.02, rel=0.05)
        residual = 0.02 / math.sqrt(2 * cfg.n_layer)
        assert engine.parameter("layers.0.attention.wo.weight").std().item() == pytest.approx(residual, rel=0.05)
        assert engine.parameter("layers.7.feed_forward.w2.weight").std().item() == pytest.approx(residual, rel=0.05)
        assert abs(engine.parameter("tok_embeddings.weight").mean().item()) < 1e-3
        assert torch.equal(engine.parameter("layers.5.ffn_norm.weight"), torch.ones(256))
        assert torch.equal(engine.parameter("norm.weight"), torch.ones(256))
    finally:
        engine.close()


def test_a_model_larger_than_device_plus_host_is_materialized_one_module_at_a_time_onto_disk(tmp_path):
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, dim=64)  # 62 pages of each kind
    reference = built(cfg)
    model = built(cfg, meta=True)
    # The device holds the largest unit (a block with the root's pages: 17); the host stages it (one slot more).
    engine = engine_for(model, tmp_path, page_bytes=16 * KIB, device_budget=20 * 16 * KIB, host_budget=18 * 16 * KIB)
    try:
        states_bytes = 4 * engine.layout.n_pages * engine.layout.page_bytes
        assert states_bytes > 4 * (engine.budgets.device + engine.budgets.host)
        param_pages = engine.pages["param"]
        assert sum(page.tier is Tier.DISK for page in param_pages) >= len(param_pages) // 2
        largest_module = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
        assert engine.meta_init.scratch_bytes == largest_module == 64 * 192 * 4  # one FFN weight (hidden 192)
        assert engine.meta_init.bytes_written == reference.num_params() * 4
        # Initialization moved nothing but the parameter values that do not fit: each such page written once,
        # nothing read back, no page of zeros (the other kinds) written at all.
        on_disk = sum(page.tier is Tier.DISK for page in param_pages)
        assert engine.manager.bytes_moved == {"host->disk": on_disk * engine.layout.page_bytes}
        for name, param in reference.named_parameters():
            assert torch.equal(engine.parameter(name), param.detach()), name
        losses = train(engine, batches(3))
        assert all(math.isfinite(v) for v in losses) and losses[2] < losses[0]
    finally:
        engine.close()


class MLP(nn.Sequential):
    def __init__(self, _cfg=None):
        super().__init__(nn.Linear(24, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 1))


def test_plain_torch_layers_get_their_reset_parameters_values(tmp_path):
    reference = built(factory=MLP)
    engine = engine_for(built(meta=True, factory=MLP), tmp_path)
    try:
        for name, param in reference.named_parameters():
            assert torch.equal(engine.parameter(name), param.detach()), name
    finally:
        engine.close()


def test_a_normally_built_model_is_copied_as_it_is(tmp_path):
    engine = engine_for(built(), tmp_path)
    try:
        assert engine.meta_init is None
    finally:
        engine.close()


class Scaled(nn.Module):
    def __init__(self, _cfg=None):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))  # set by the constructor only: a meta build cannot know it

    def forward(self, x):
        return self.proj(x) * self.gain


def test_a_meta_parameter_that_nothing_initializes_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigValueError, match="parameter 'gain' is on the meta device and nothing initializes it"):
        engine_for(built(meta=True, factory=Scaled), tmp_path)


class WithTable(nn.Module):
    def __init__(self, _cfg=None):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0))

    def forward(self, x):
        return self.proj(x) + self.table


def test_a_meta_buffer_without_reset_buffers_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigValueError, match="buffer 'table' is on the meta device"):
        engine_for(built(meta=True, factory=WithTable), tmp_path)
