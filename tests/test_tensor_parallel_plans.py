"""Tensor parallelism without a process group: plans and dimensions that do not split are typed errors naming the
module and the size; ops on vocabulary-sharded logits other than the loss are refused; the mesh's groups at 8 and
16 ranks; the tp settings' checks; the estimate of a tp job (one rank's shards, split on the meta device)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import ConfigValueError, DistributedError, TensorParallelError
from angel_ptm.models import GPT, GPTConfig
from angel_ptm.parallel.mesh import Mesh, mesh_groups
from angel_ptm.parallel.tensor import Plan, TPComm, gpt_plan, parallelize, plan_for
from angel_ptm.parallel.tensor.layers import VocabShardedLogits

from dist_jobs import CASES


def fake_comm(size=2, rank=0, sequence_parallel=False):
    return types.SimpleNamespace(size=size, rank=rank, sequence_parallel=sequence_parallel, collectives=None)


@pytest.mark.parametrize("field,cfg,message", [
    ("heads", dict(n_head=3, dim=48, n_kv_head=3), "n_head (3) does not divide"),
    ("kv heads", dict(n_head=4, dim=32, n_kv_head=1), "n_kv_head (1) does not divide"),
    ("ffn", dict(n_head=2, dim=32, ffn_hidden=33), "out_features (33"),
    ("vocab", dict(n_head=2, dim=32, vocab_size=63), "num_embeddings (63, its vocabulary)"),
])
def test_a_dimension_tp_does_not_divide_is_a_typed_error_naming_it(field, cfg, message):
    model = GPT(GPTConfig(**{"vocab_size": 64, "seq_len": 16, "n_layer": 1, **cfg}))
    with pytest.raises(TensorParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallelize(model, fake_comm(), gpt_plan(model))


def test_a_plan_naming_a_module_the_model_lacks_is_a_typed_error():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(TensorParallelError, match="'attention' names no module of Sequential"):
        parallelize(model, fake_comm(), Plan(styles={"0": ("colwise",), "attention": ("enter",)}))
    with pytest.raises(TensorParallelError, match="no built-in tensor-parallel plan for Sequential"):
        plan_for(model)
    with pytest.raises(TensorParallelError, match="1 is a ReLU; style 'colwise' takes an nn.Linear"):
        parallelize(model, fake_comm(), Plan(styles={"1": ("colwise",)}))
    # nn.MultiheadAttention reads its out_proj's weight itself: the split would fail at the first forward
    encoder = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))
    with pytest.raises(TensorParallelError, match="0.self_attn.out_proj is an nn.MultiheadAttention's projection"):
        parallelize(encoder, fake_comm(), Plan(styles={"0.self_attn.out_proj": ("rowwise",)}))


def test_ops_on_vocabulary_sharded_logits_other_than_the_loss_are_refused():
    comm = TPComm(Mesh())  # a tp group of one: the same code path, no collectives
    logits = VocabShardedLogits.wrap(torch.randn(2, 3, 8, requires_grad=True), comm, 0, 16)
    flat = logits.float().view(-1, 16)  # the full vocabulary means this rank's share
    assert isinstance(flat, VocabShardedLogits) and flat.shape == (6, 8)
    with pytest.raises(TensorParallelError, match="argmax on logits sharded over the vocabulary"):
        logits.argmax(-1)
    with pytest.raises(TensorParallelError, match="softmax"):
        torch.softmax(logits, -1)
    target = torch.randint(0, 8, (6,))
    loss = torch.nn.functional.cross_entropy(flat, target)  # one rank: the ordinary loss
    expected = torch.nn.functional.cross_entropy(flat.as_subclass(torch.Tensor), target)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    ignored = torch.nn.functional.cross_entropy(flat, torch.where(target > 3, -100, target), reduction="sum")
    kept = target <= 3
    assert ignored.item() == pytest.approx(torch.nn.functional.cross_entropy(
        flat.as_subclass(torch.Tensor)[kept], target[kept], reduction="sum").item(), rel=1e-6)


def test_the_mesh_lays_tp_groups_on_consecutive_ranks_and_dp_groups_across_them():
    """The groups at 8 and 16 ranks (no process group: the enumeration every rank creates)."""
    assert mesh_groups("tp", 4, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh_groups("dp", 4, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for dp, tp in ((2, 8), (8, 2), (4, 4)):
        tps, dps = mesh_groups("tp", dp, tp), mesh_groups("dp", dp, tp)
        assert sorted(r for g in tps for r in g) == list(range(dp * tp)) == sorted(r for g in dps for r in g)
        assert all(len(set(t) & set(d)) == 1 for t in tps for d in dps)  # a rank is one (dp, tp) cell


def test_tp_settings_are_checked(tmp_path):
    from angel_ptm.config import load_config

    with pytest.raises(ConfigValueError, match="parallel.sequence_parallel: must be false unless tp > 1"):
        load_config({"parallel": {"sequence_parallel": True}})
    with pytest.raises(ConfigValueError, match="parallel.tp: must be >= 1"):
        load_config({"parallel": {"tp": 0}})
    with pytest.raises(DistributedError, match="parallel.tp: 2 does not divide the world size 1"):
        angel_ptm.initialize(CASES["gpt"][0](), {"parallel": {"tp": 2}, "memory": {"disk_dir": str(tmp_path)}})


def test_a_model_split_for_another_tp_is_refused(tmp_path):
    model = CASES["gpt"][0]()
    model._angel_tp = fake_comm()
    with pytest.raises(TensorParallelError, match="parallel.tp is 1 but the model was parallelized for tp 2"):
        angel_ptm.initialize(model, {"memory": {"disk_dir": str(tmp_path)}})


def test_the_estimate_of_a_tp_job_counts_one_ranks_shards():
    """`angel-ptm estimate` with parallel.tp: the config's model split on the meta device by the same plan the
    engine applies, so the states per rank are those of one rank's shards (no process group needed)."""
    from angel_ptm.estimate import estimate_job

    model = {"name": "gpt", "dim": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "seq_len": 32}
    whole = estimate_job({"model": model})
    split = estimate_job({"model": model, "parallel": {"tp": 2, "sequence_parallel": True}})
    norms = 64 * (2 * 2 + 1)
    assert split.params == (whole.params - norms) // 2 + norms
    with pytest.raises(TensorParallelError, match="n_head .4. does not divide over parallel.tp 8"):
        estimate_job({"model": model, "parallel": {"tp": 8}})
