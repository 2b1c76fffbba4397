"""What a model does besides its units' forward: activation checkpointing of its own (HuggingFace's
gradient_checkpointing_enable, torch.utils.checkpoint inside a unit, reentrant ones nested), methods other than
forward that use parameters under no_grad (encoder-decoder generate), forward hooks around the units', and units
chosen for blocks that are ModuleDicts or a user's MoE experts. Each behaves as in plain PyTorch or is refused
with a typed error that says what to do instead (torch's gradient and state APIs: test_torch_api_semantics.py)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import angel_ptm
from angel_ptm.errors import ActivationError, ConfigValueError, ParameterAccessError
from tests.test_any_model import config, torch_losses
from tests.test_engine_equivalence import assert_same_losses, run_steps

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ON_DISK = {"page_bytes": "8KiB", "device_budget": "160KiB", "host_budget": "160KiB"}


def memory(tmp_path, scheduler="planned", placement=None):
    return dict(placement or ON_DISK, disk_dir=str(tmp_path), scheduler=scheduler)


def tiny_llama(checkpointing=None):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    return model.train()


def token_batches(steps=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 96, (2, 12), generator=g),) for _ in range(steps)]


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


class CheckpointedBlock(nn.Module):
    """torch.utils.checkpoint around part of a unit's forward, on the unit's own parameters: its recomputation in
    backward runs no unit hook."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(32, 32) * 0.2)
        self.w2 = nn.Parameter(torch.randn(32, 32) * 0.2)

    def part(self, h):
        return torch.nn.functional.linear(torch.nn.functional.linear(h, self.w1).tanh(), self.w2)

    def forward(self, x):
        return x + checkpoint(self.part, x, use_reentrant=False)


class InnerCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(CheckpointedBlock() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


class DictLayers(nn.Module):
    """Blocks that are ModuleDicts: never called themselves, so their parts are the units."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.ModuleDict({"a": nn.Linear(32, 32), "b": nn.Linear(32, 32)})
                                    for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer["b"](layer["a"](x).tanh())
        return x.pow(2).mean()


@pytest.mark.parametrize("scheduler", ["planned", "on_demand"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_huggingface_gradient_checkpointing_trains_like_torch(reentrant, scheduler, tmp_path):
    expected, opt = torch_losses(tiny_llama(reentrant), token_batches(), lm_loss)
    model = tiny_llama(reentrant)
    engine = angel_ptm.initialize(model, config(memory(tmp_path, scheduler)))
    try:
        actual = run_steps(engine, token_batches(), lm_loss)
        reference = dict(zip([n for n, _ in model.named_parameters()], opt.param_groups[0]["params"]))
        state = engine.state_dict()
    finally:
        engine.close()
    assert_same_losses(expected, actual, rel=1e-5)
    for name, param in reference.items():
        torch.testing.assert_close(state[name], param.detach(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("model", [InnerCheckpoint, DictLayers])
def test_checkpoint_inside_a_unit_and_blocks_that_are_module_dicts_train_like_torch(model, tmp_path):
    def batches():
        g = torch.Generator().manual_seed(2)
        return [(torch.randn(4, 32, generator=g),) for _ in range(4)]

    loss = lambda model, x: model(x)  # noqa: E731
    expected, _ = torch_losses(model(), batches(), loss)
    engine = angel_ptm.initialize(model(), config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        if model is DictLayers:
            assert [u.name for u in engine.units][1:] == [f"layers.{i}.{p}" for i in range(3) for p in "ab"]
        assert_same_losses(expected, run_steps(engine, batches(), loss))
    finally:
        engine.close()


def test_a_container_named_as_a_unit_is_refused(tmp_path):
    with pytest.raises(ConfigValueError, match="units: ModuleDict modules are never called"):
        angel_ptm.initialize(DictLayers(), config(memory(tmp_path)), units=[nn.ModuleDict])


def test_encoder_decoder_generate_runs_the_encoder_by_itself_and_equals_the_plain_model(tmp_path):
    def t5():
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)).eval()

    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = t5().generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    model = t5()
    engine = angel_ptm.initialize(model, config(memory(tmp_path, "on_demand")))
    try:
        with torch.no_grad():
            assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False), expected)
        with pytest.raises(ParameterAccessError, match="'shared.weight' used outside"):
            model.get_encoder()(input_ids=ids)  # with gradients on, the use would need a gradient page
    finally:
        engine.close()


def test_a_unit_whose_recomputation_does_not_replay_its_forward_is_a_typed_error(tmp_path):
    """HuggingFace T5's decoder blocks depend on state their first run changed: torch's checkpoint refuses the
    recomputation, and the engine says so with what to use instead."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        dropout_rate=0.0))
    job = dict(config(memory(tmp_path)), activations={"checkpoint": "full"})
    engine = angel_ptm.initialize(model, job)
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    try:
        loss = engine(input_ids=ids, labels=ids[:, :6].contiguous()).loss
        with pytest.raises(ActivationError, match="did not replay its forward.*gradient_checkpointing_enable"):
            engine.backward(loss)
    finally:
        engine.close()


def reads_weight_before(linear):
    linear.register_forward_pre_hook(lambda module, args: (args[0] * module.weight.abs().mean(),))
    return linear


def reads_weight_after(linear):
    linear.register_forward_hook(lambda module, args, out: out * module.weight.norm())
    return linear


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("hooked", ["weight_norm", "spectral_norm", "pre_hook", "post_hook_after_initialize"])
def test_forward_hooks_that_read_weights_see_them_bound_in_any_order(hooked, tmp_path):
    wrap = {"weight_norm": torch.nn.utils.weight_norm, "spectral_norm": torch.nn.utils.spectral_norm,
            "pre_hook": reads_weight_before}.get(hooked, lambda linear: linear)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*(wrap(nn.Linear(32, 32)) for _ in range(2)))

    def batches():
        g = torch.Generator().manual_seed(4)
        return [(torch.randn(8, 32, generator=g),) for _ in range(3)]

    loss = lambda model, x: (model(x) - x).pow(2).mean()  # noqa: E731
    plain = build()
    if hooked == "post_hook_after_initialize":
        reads_weight_after(plain[0])
    expected, _ = torch_losses(plain, batches(), loss)
    model = build()
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"})),
                                  units=[nn.Linear])
    if hooked == "post_hook_after_initialize":
        reads_weight_after(model[0])
    try:
        assert_same_losses(expected, run_steps(engine, batches(), loss))
    finally:
        engine.close()


class UserExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.w2(self.w1(x).relu())


class UserMoE(nn.Module):
    """An MoE layer not ours (a `gate` and an `experts` list), at the top of the model: no block list around it."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(UserExpert() for _ in range(4))

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        return x + sum(expert(x) * (choice == i).unsqueeze(-1) for i, expert in enumerate(self.experts))


def test_experts_kept_out_of_units_by_default_stay_in_the_unit_around_them():
    from angel_ptm.units import find_units

    model = nn.Sequential(nn.Linear(8, 8), UserMoE())
    apart = [u.name for u in find_units(model, None, experts=True)]
    assert apart == ["<root>"] + [f"1.experts.{i}" for i in range(4)]
    # ZeRO-3 over ranks that route differently (experts_as_units false): no expert is chosen, none refused
    assert [u.name for u in find_units(model, None, experts=False)] == ["<root>"]


class ReentrantReuse(nn.Module):
    """A root parameter used once outside and once inside a reentrant checkpoint: its gradient arrives in two
    accumulations (the checkpoint's own backward, then the outer one), so neither is final before the end."""

    def __init__(self, nested=False):
        super().__init__()
        torch.manual_seed(0)
        self.nested = nested
        self.inp = nn.Linear(32, 32)
        self.layers = nn.ModuleList(nn.ModuleDict({"a": nn.Linear(32, 32), "b": nn.Linear(32, 32)})
                                    for _ in range(2))

    def inner(self, layer, h):
        return layer["b"](checkpoint(layer["a"], h, use_reentrant=True).tanh())

    def forward(self, x):
        x = self.inp(x)
        x = checkpoint(self.inp, x, use_reentrant=True)
        for layer in self.layers:
            x = checkpoint(self.inner, layer, x, use_reentrant=False) if self.nested else layer["b"](layer["a"](x))
        return x.pow(2).mean()


class NestedBlock(nn.Module):
    """A reentrant checkpoint inside another checkpoint, inside a unit: the inner forward runs under no_grad
    during the outer one's recomputation in backward."""

    def __init__(self, outer_reentrant):
        super().__init__()
        self.a, self.outer_reentrant = nn.Linear(32, 32), outer_reentrant

    def inner(self, h):
        return self.a(h).tanh()

    def outer(self, h):
        return checkpoint(self.inner, h, use_reentrant=True) * 2

    def forward(self, x):
        return x + checkpoint(self.outer, x, use_reentrant=self.outer_reentrant)


class NestedCheckpoints(nn.Module):
    def __init__(self, outer_reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 32)
        self.layers = nn.ModuleList(NestedBlock(outer_reentrant) for _ in range(2))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


class ReentrantAroundUnits(nn.Module):
    """Each unit under a reentrant checkpoint: its recomputation runs the unit's hooks, and its own backward reads
    the parameters autograd saved after that recomputed forward is over."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))
                                    for _ in range(2))

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=True)
        return h.pow(2).mean()


MODELS_WITH_REENTRANT = {"around_units": ReentrantAroundUnits,
                         "reuse": lambda: ReentrantReuse(), "reuse_nested": lambda: ReentrantReuse(True),
                         "nested_in_unit": lambda: NestedCheckpoints(False),
                         "nested_reentrant_in_unit": lambda: NestedCheckpoints(True)}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(MODELS_WITH_REENTRANT))
def test_reentrant_checkpoints_train_like_torch_under_eager_updates(case, tmp_path):
    def batches():
        g = torch.Generator().manual_seed(2)
        return [(torch.randn(6, 32, generator=g),) for _ in range(4)]

    loss = lambda model, x: model(x)  # noqa: E731
    build = MODELS_WITH_REENTRANT[case]
    expected, _ = torch_losses(build(), batches(), loss)
    engine = angel_ptm.initialize(build(), config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        assert_same_losses(expected, run_steps(engine, batches(), loss))
    finally:
        engine.close()


class FreshNode:
    """A graph node whose `next_functions` makes new Python objects for its inputs at every call, as torch 2.11's
    autograd does: a walk that remembers only ids sees a dropped node's id reused by the next one."""

    def __init__(self, chain):
        self.chain = chain

    @property
    def next_functions(self):
        if not self.chain:
            return ()
        name, rest = self.chain[0], self.chain[1:]
        return ((type(name, (FreshNode,), {})(rest), 0),)


def test_a_reentrant_checkpoint_deep_in_a_graph_of_fresh_node_objects_is_found():
    from angel_ptm.step import runs_nested_backward

    names = ["MeanBackward0", "PowBackward0"] + ["AddmmBackward0", "TBackward0"] * 20
    loss = types.SimpleNamespace(grad_fn=FreshNode(names + ["CheckpointFunctionBackward", "AddmmBackward0"]))
    assert runs_nested_backward(loss)
    assert not runs_nested_backward(types.SimpleNamespace(grad_fn=FreshNode(names)))
