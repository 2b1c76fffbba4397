import math

import pytest
import torch

from angel_ptm.errors import ConfigValueError
from angel_ptm.models import GPT, GPTConfig, build_model, estimate_activation_bytes


def tiny(**overrides) -> GPTConfig:
    fields = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=4, dim=32)
    fields.update(overrides)
    return GPTConfig(**fields)


def seeded_model(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def test_logits_have_shape_batch_seq_vocab():
    model = seeded_model(tiny())
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)


def test_loss_at_init_is_a_scalar_close_to_ln_vocab():
    model = seeded_model(tiny())
    idx, targets = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    loss = model(idx, targets)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.3


def test_tied_output_weight_is_the_embedding_parameter_and_counted_once():
    tied, untied = seeded_model(tiny()), seeded_model(tiny(tie_embeddings=False))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert untied.num_params() - tied.num_params() == 256 * 32


def test_num_params_matches_the_formula():
    cfg = tiny()  # dim 32 -> hidden int(8 * 32 / 3) = 85 rounded up to 128
    assert cfg.hidden_dim == 128
    per_layer = 4 * 32 * 32 + 3 * 32 * 128 + 2 * 32
    assert seeded_model(cfg).num_params() == 256 * 32 + 2 * per_layer + 32


def test_llama_hidden_rule_for_default_dim():
    assert GPTConfig().hidden_dim == 704  # int(8 * 256 / 3) = 682 -> 704
    assert GPTConfig(ffn_hidden=100).hidden_dim == 100


def test_same_seed_gives_identical_parameters():
    a, b = seeded_model(tiny(), seed=7), seeded_model(tiny(), seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_output_projections_are_scaled_by_inverse_sqrt_two_n_layer():
    model = seeded_model(tiny(n_layer=8, dim=256, n_head=4))
    expected = 0.02 / math.sqrt(16)
    assert model.layers[0].attention.wo.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_grouped_query_attention_runs_with_fewer_kv_heads():
    cfg = tiny(n_head=4, n_kv_head=2)
    model = seeded_model(cfg)
    assert model.layers[0].attention.wk.weight.shape == (2 * 8, 32)
    assert model(torch.randint(0, 256, (2, 16))).shape == (2, 16, 256)


def test_rope_tables_are_not_in_the_state_dict():
    model = seeded_model(tiny())
    keys = set(model.state_dict())
    assert not any("rope" in k or k.endswith((".cos", ".sin")) for k in keys)
    assert {name for name, _ in model.named_buffers()} == {"rope.cos", "rope.sin"}


def test_one_backward_step_moves_every_parameter():
    model = seeded_model(tiny())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx.roll(-1, dims=1)).backward()
    opt.step()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert not torch.equal(p, before[name]), name


def test_a_future_token_does_not_change_earlier_logits():
    model = seeded_model(tiny()).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize(
    "fields",
    [dict(dim=30, n_head=4), dict(n_head=4, n_kv_head=3), dict(dim=12, n_head=4), dict(n_layer=0)],
    ids=["dim_not_divisible_by_heads", "heads_not_divisible_by_kv_heads", "odd_head_dim", "zero_layers"],
)
def test_impossible_sizes_raise_config_value_error(fields):
    with pytest.raises(ConfigValueError):
        tiny(**fields)


def test_from_mapping_reads_dicts_and_objects_and_ignores_name():
    class ModelSection:
        name, dim, n_head, n_layer = "gpt", 64, 2, 1

    assert GPTConfig.from_mapping({"name": "gpt", "dim": 64, "n_head": 2}) == GPTConfig(dim=64, n_head=2)
    assert GPTConfig.from_mapping(ModelSection()) == GPTConfig(dim=64, n_head=2, n_layer=1)


def test_build_model_builds_gpt_and_rejects_unknown_names():
    assert isinstance(build_model({"name": "gpt", "dim": 32, "n_layer": 1}), GPT)
    with pytest.raises(ConfigValueError, match="bert"):
        build_model({"name": "bert"})


def test_input_longer_than_seq_len_is_rejected():
    with pytest.raises(ConfigValueError, match="17"):
        seeded_model(tiny())(torch.zeros(1, 17, dtype=torch.long))


def test_activation_estimate_matches_documented_formula():
    cfg = tiny()  # fp32, no grouped-query attention: q = kv = dim
    d, h, tokens = cfg.dim, cfg.hidden_dim, 2 * cfg.seq_len
    per_layer = (6 * d + 5 * d + 4 * h + 2 + cfg.n_head) * 4  # documented in activation_footprint
    root = (3 * d + 1 + cfg.vocab_size) * 4 + 16
    assert estimate_activation_bytes(cfg, batch_size=2) == tokens * (cfg.n_layer * per_layer + root)


