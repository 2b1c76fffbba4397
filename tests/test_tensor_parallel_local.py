"""Tensor parallelism's one-process logic: collectives in a fake-tensor trace give shapes only; dropout
(angel_ptm/parallel/tensor/rng.py): a split scope draws this tp rank's own numbers and keeps the shared stream in
step, recomputation redraws the same masks, dropout is found in modules and in rate attributes, and a model without
dropout gets no scopes (its random stream is a 1-rank run's). The 2-rank behaviour (shared masks on replicated
activations, own masks on sequence shards, recomputation and offload bitwise) is tested in test_tensor_parallel.py's
ranks. What the built-in Llama plan cannot split right (head counts tp does not divide, a module with a forward of its
own, scale_grad_by_freq) is a typed error before any communication."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from angel_ptm.errors import TensorParallelError

from angel_ptm.models import GPT, GPTConfig
from angel_ptm.parallel.tensor import TPComm, parallelize, plan_for

def _draws(rank, replicated_inside: bool):
    """One tp rank's draws: before a split scope, inside it, after the activations turn replicated inside it (or
    nothing), and after it."""
    from angel_ptm.parallel.tensor.rng import ShardedRandom

    rng = ShardedRandom(rank, 2)
    torch.manual_seed(3)
    before = torch.rand(4)
    rng.fork()
    inside = torch.rand(4)
    after_exit = None
    if replicated_inside:
        rng.replicated()
        after_exit = torch.rand(4)
    rng.join()
    return before, inside, after_exit, torch.rand(4)


@pytest.mark.parametrize("replicated_inside", [False, True])
def test_a_split_scope_draws_per_rank_and_leaves_the_shared_stream_in_step(replicated_inside):
    """Inside a scope each tp rank draws its own numbers; outside it, and after a row-parallel exit inside it (a
    dropout after the exit, as GPT-2's attention has), every rank draws the same ones, and the shared stream goes
    on as if the scope had drawn one number."""
    zero, one = _draws(0, replicated_inside), _draws(1, replicated_inside)
    assert torch.equal(zero[0], one[0]) and not torch.equal(zero[1], one[1])
    if replicated_inside:
        assert torch.equal(zero[2], one[2])
    assert torch.equal(zero[3], one[3])
    torch.manual_seed(3)
    torch.rand(4)
    torch.empty((), dtype=torch.int64).random_(0, 1 << 62)  # the scope's one draw
    expected = torch.rand(4)
    assert torch.equal(zero[2] if replicated_inside else zero[3], expected)


def test_recomputation_draws_the_masks_the_forward_drew():
    """A scoped dropout module under torch's checkpoint (which restores the generator where the unit began): the
    recomputed masks are the forward's, so the gradients equal those without recomputation."""
    from torch.utils.checkpoint import checkpoint

    from angel_ptm.parallel.tensor.rng import ShardedRandom

    def grads(recompute):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5))
        ShardedRandom(1, 2).scope(block[1])
        ShardedRandom(1, 2).scope(block[3])
        x = torch.randn(4, 8, requires_grad=True)
        y = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        y.sum().backward()
        return [x.grad] + [p.grad for p in block.parameters()]

    for a, b in zip(grads(False), grads(True)):
        assert torch.equal(a, b)


def test_dropout_is_found_in_modules_and_in_rate_attributes():
    from angel_ptm.parallel.tensor.rng import ShardedRandom, has_dropout
    from angel_ptm.parallel.collectives import FAKE_TRACE

    class HFStyle(nn.Module):  # HuggingFace attention keeps its rate and calls the functional dropout
        def __init__(self, rate):
            super().__init__()
            self.attention_dropout, self.is_causal = rate, True

    assert has_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert not has_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))
    assert has_dropout(HFStyle(0.1)) and not has_dropout(HFStyle(0.0))
    assert not has_dropout(GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, dim=8)))
    assert has_dropout(GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, dim=8, dropout=0.1)))
    rng = ShardedRandom(1, 2)
    state = torch.get_rng_state()
    FAKE_TRACE.on = True
    try:
        rng.fork()  # a fake-tensor trace draws nothing
        rng.join()
    finally:
        FAKE_TRACE.on = False
    assert torch.equal(state, torch.get_rng_state()) and rng.forks == 0


def test_a_gpt_without_dropout_gets_no_random_scopes_and_keeps_the_generator():
    """No dropout: tensor parallelism draws nothing from the generator (a 1-rank run's sequence is kept)."""
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, dim=8))
    comm = TPComm.planning(2, sequence_parallel=True)
    parallelize(model, comm, plan_for(model))
    assert not comm.random.scoped
    with_dropout = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, dim=8, dropout=0.1))
    comm = TPComm.planning(2, sequence_parallel=True)
    parallelize(with_dropout, comm, plan_for(with_dropout))
    names = {id(m): n for n, m in with_dropout.named_modules()}
    scoped = {names.get(id(m), "(replaced: the output head)") for m in comm.random.scoped}
    assert scoped == {"drop", "layers.0", "layers.0.attention", "layers.0.feed_forward",
                      "(replaced: the output head)"}, scoped


def test_tp_collectives_give_their_shapes_in_a_fake_tensor_trace():
    """Traced on fake tensors (activations/footprint.py), a tp rank's collectives return what they would in shape
    -- new storage where the collective makes one -- and never reach a process group (a planning comm has none)."""
    from angel_ptm.parallel.collectives import FAKE_TRACE
    from angel_ptm.parallel.tensor import TPComm

    comm = TPComm.planning(2, sequence_parallel=True)
    x = torch.randn(2, 8, 4)
    FAKE_TRACE.on = True
    try:
        assert comm.all_reduce(x, "t") is x
        assert comm.all_gather(x, 1, "t").shape == (2, 16, 4)
        scattered = comm.reduce_scatter(x, 1, "t")
        assert scattered.shape == (2, 4, 4) and scattered.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    finally:
        FAKE_TRACE.on = False
    with pytest.raises(TensorParallelError):
        comm.all_reduce(x, "t")


def test_what_the_llama_plan_cannot_split_right_is_a_typed_error_at_start():
    """Head counts tp does not divide (the split would go through the middle of a head), a module with a forward of
    its own that the parallel version would drop (Gemma's scaled embedding), scale_grad_by_freq (a shard would
    count the other ranks' tokens)."""
    transformers = pytest.importorskip("transformers")

    def llama(**cfg):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
            "vocab_size": 64, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, **cfg}))

    for cfg, message in ((dict(num_attention_heads=3, num_key_value_heads=3), "num_attention_heads \\(3\\)"),
                         (dict(num_key_value_heads=1), "num_key_value_heads \\(1\\)")):
        model = llama(**cfg)
        with pytest.raises(TensorParallelError, match=message):
            parallelize(model, TPComm.planning(2), plan_for(model))

    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = llama()
    model.model.embed_tokens = Scaled(64, 48)
    with pytest.raises(TensorParallelError, match="embed_tokens is a Scaled, an nn.Embedding with a forward of its"):
        parallelize(model, TPComm.planning(2), plan_for(model))
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, dim=32))
    gpt.tok_embeddings.scale_grad_by_freq = True
    with pytest.raises(TensorParallelError, match="scale_grad_by_freq"):
        parallelize(gpt, TPComm.planning(2), plan_for(gpt))
