"""What a model does besides its units' forward: activation checkpointing of its own (HuggingFace's
gradient_checkpointing_enable, torch.utils.checkpoint inside a unit), methods other than forward that use
parameters under no_grad (encoder-decoder generate), and torch's own gradient, hook and parameter APIs. Each
behaves as in plain PyTorch or is refused with a typed error that says what to do instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import angel_ptm
from angel_ptm.errors import ConfigValueError, ParameterAccessError, StateDictError
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


def test_torch_gradient_apis_between_backward_and_step_raise_instead_of_seeing_nothing(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    job = config(memory(tmp_path, placement={"page_bytes": "4KiB"}), grad_accum=2)
    job["optimizer"] = dict(job["optimizer"], overlap_updates=False)  # zero_grad after a backward may drop it
    engine = angel_ptm.initialize(model, job)
    x = torch.randn(8, 16)
    try:
        model.zero_grad()  # before any backward: nothing is pending, as in torch
        assert all(p.grad is None for p in model.parameters())
        engine.backward(engine(x).pow(2).mean())
        with pytest.raises(ParameterAccessError, match=r"'0\.weight'\.grad read between engine\.backward and "
                                                       r"engine\.step.*engine\.clip_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with pytest.raises(ParameterAccessError, match="engine.zero_grad"):
            model.zero_grad()
        engine.backward(engine(x).pow(2).mean())  # a second micro-batch reads and frees .grad inside backward
        engine.zero_grad()
        assert model[0].weight.grad is None  # dropped: readable again
        engine.backward(engine(x).pow(2).mean())
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        assert all(p.grad is None for p in model.parameters())
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


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x):
        return (self.w * x).abs().sum()


@pytest.mark.parametrize("case", ["complex", "max_norm", "compiled", "compile_method", "compiled_after"])
def test_models_the_pages_cannot_keep_are_refused_with_what_to_do(case, tmp_path):
    torch.manual_seed(0)
    model = {"complex": Complex(), "max_norm": nn.Sequential(nn.Embedding(10, 4, max_norm=1.0))}.get(
        case, nn.Sequential(nn.Linear(4, 4)))
    message = {"complex": r"parameter 'w' is complex .*torch\.view_as_real",
               "max_norm": r"0: Embedding\(max_norm=1\) rewrites its weight in place"}.get(
        case, r"compiled as a whole .*compile modules inside its units")
    if case == "compiled":
        model = torch.compile(model)
    elif case == "compile_method":
        model.compile()
    with pytest.raises(ConfigValueError, match=message):
        engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
        try:
            model.compile()  # compiled_after: refused at the next call, before Dynamo traces the hooks
            engine(torch.randn(2, 4))
        finally:
            engine.close()


def test_set_lr_takes_what_torch_optimizers_take_and_refuses_the_rest_leaving_the_engine_usable(tmp_path):
    torch.manual_seed(0)
    engine = angel_ptm.initialize(nn.Linear(4, 4), config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        for bad in (-1.0, float("nan"), float("inf"), "0.1", None, True):
            with pytest.raises(ConfigValueError, match="set_lr: the learning rate must be a number >= 0"):
                engine.set_lr(bad)
        engine.set_lr(torch.tensor(1e-3))
        assert engine.lr == pytest.approx(1e-3) and isinstance(engine.lr, float)
        engine.set_lr(0)
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()  # usable: nothing failed
    finally:
        engine.close()


def test_clipping_twice_in_a_step_equals_torch_and_lr_and_eps_zero_are_taken(tmp_path):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    plain = build()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    plain(x).pow(2).mean().backward()
    expected = [float(torch.nn.utils.clip_grad_norm_(plain.parameters(), c)) for c in (0.5, 0.2)]
    opt.step()
    model = build()
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"}), grad_clip=1.0))
    try:
        engine.backward(engine(x).pow(2).mean())
        norms = [engine.clip_grad_norm(c) for c in (0.5, 0.2)]  # the second: the norm after the first clip
        engine.step()
        state = engine.state_dict()
    finally:
        engine.close()
    assert norms == pytest.approx(expected, rel=1e-6) and expected[1] < 0.5
    for name, param in plain.named_parameters():
        torch.testing.assert_close(state[name], param.detach(), rtol=1e-6, atol=1e-7)
    job = config(memory(tmp_path, placement={"page_bytes": "4KiB"}))
    job["optimizer"] = dict(job["optimizer"], lr=0.0, eps=0.0)  # as torch.optim.AdamW takes them
    angel_ptm.initialize(build(), job).close()
    with pytest.raises(ConfigValueError, match=r"optimizer\.eps: must be >= 0 and finite, got -1"):
        angel_ptm.initialize(build(), dict(job, optimizer=dict(job["optimizer"], eps=-1.0)))


def test_model_load_state_dict_while_managed_writes_the_pages_and_training_goes_on_like_torch(tmp_path):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))

    torch.manual_seed(7)
    pretrained = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in build().state_dict().items()}
    pretrained["1.running_var"] = pretrained["1.running_var"].abs()
    plain = build()
    plain.load_state_dict(pretrained)

    def batches():
        g = torch.Generator().manual_seed(6)
        return [(torch.randn(8, 8, generator=g),) for _ in range(3)]

    loss = lambda model, x: model(x).pow(2).mean()  # noqa: E731
    expected, _ = torch_losses(plain, batches(), loss)
    model = build()
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        with pytest.raises(StateDictError):
            model.load_state_dict({"0.weight": pretrained["0.weight"]})  # strict: missing keys, nothing written
        with pytest.raises(RuntimeError):  # what torch raises: `except RuntimeError:` fallbacks keep working
            model.load_state_dict({"0.weight": pretrained["0.weight"]})
        partial = {"3.bias": pretrained["3.bias"], "1.num_batches_tracked": torch.tensor(0), "extra": torch.zeros(1)}
        ours, torchs = model.load_state_dict(partial, strict=False), build().load_state_dict(partial, strict=False)
        assert ours.missing_keys == torchs.missing_keys and ours.unexpected_keys == torchs.unexpected_keys
        result = model.load_state_dict(pretrained)
        assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
        with pytest.raises(ConfigValueError, match="assign=True"):
            model.load_state_dict(pretrained, assign=True)
        assert_same_losses(expected, run_steps(engine, batches(), loss))
    finally:
        engine.close()
    assert "load_state_dict" not in model.__dict__  # torch's own again


@pytest.mark.parametrize("optimizer", [{}, {"staleness": 1}, {"overlap_updates": False}])
def test_more_backwards_than_grad_accum_are_refused_where_the_last_one_already_acted(optimizer, tmp_path):
    torch.manual_seed(0)
    job = config(memory(tmp_path, placement={"page_bytes": "4KiB"}))
    job["optimizer"] = dict(job["optimizer"], **optimizer)
    engine = angel_ptm.initialize(nn.Linear(4, 4), job)
    try:
        engine.backward(engine(torch.randn(2, 4)).sum())
        if optimizer.get("overlap_updates") is False:  # nothing acted during backward: they add up, as in torch
            engine.backward(engine(torch.randn(2, 4)).sum())
            engine.step()
        else:
            with pytest.raises(ConfigValueError, match=r"backward called 2 times before step\(\), but "
                                                       r"trainer\.grad_accum is 1, .*already applied"):
                engine.backward(engine(torch.randn(2, 4)).sum())
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


MODELS_WITH_REENTRANT = {"reuse": lambda: ReentrantReuse(), "reuse_nested": lambda: ReentrantReuse(True),
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


class Interrupting(nn.Module):
    """A forward hook that raises KeyboardInterrupt (Ctrl-C) inside a unit, and a gradient hook that raises in
    backward, once each, when armed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.armed = None
        self.layers[1].register_forward_hook(self._forward_hook)
        self.layers[2].weight.register_hook(self._grad_hook)

    def _forward_hook(self, module, args, out):
        if self.armed == "forward":
            self.armed = None
            raise KeyboardInterrupt

    def _grad_hook(self, grad):
        if self.armed == "backward":
            self.armed = None
            raise RuntimeError("a user hook failed")

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).tanh()
        return x.pow(2).mean()


def test_an_interrupted_forward_or_backward_can_be_dropped_and_training_goes_on_like_torch(tmp_path):
    """Ctrl-C in a unit's forward skipped torch's always-call hooks, leaving its pages pinned; an error in backward
    left a .grad the next backward added to (engine.zero_grad() did not drop it)."""
    def batches():
        g = torch.Generator().manual_seed(3)
        return [(torch.randn(4, 16, generator=g),) for _ in range(4)]

    loss = lambda model, x: model(x)  # noqa: E731
    expected, _ = torch_losses(Interrupting(), batches(), loss)
    model = Interrupting()
    job = config(memory(tmp_path, "on_demand", placement={"page_bytes": "4KiB"}))
    engine = angel_ptm.initialize(model, job)
    x = torch.randn(4, 16)
    try:
        for where, error in (("forward", KeyboardInterrupt), ("backward", RuntimeError)):
            model.armed = where
            with pytest.raises(error):
                engine.backward(engine(x))
            engine.zero_grad()
            assert not engine.manager.pinned_ids  # nothing left pinned
        assert_same_losses(expected, run_steps(engine, batches(), loss))
    finally:
        engine.close()


def test_a_post_accumulate_grad_hook_added_after_initialize_sees_the_gradient_as_in_torch(tmp_path):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))

    def watch(model, seen):
        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(lambda p, name=name: seen.__setitem__(name, p.grad.clone()))

    x = torch.randn(4, 8)
    plain, expected = build(), {}
    watch(plain, expected)
    plain(x).pow(2).mean().backward()
    model, seen = build(), {}
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        watch(model, seen)  # after the engine's own hook: it still runs last, when it takes .grad into the pages
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    finally:
        engine.close()
    assert set(seen) == set(expected)
    for name in expected:
        torch.testing.assert_close(seen[name], expected[name])


def test_a_second_thread_entering_a_busy_engine_gets_engine_busy_and_nothing_is_left_pinned(tmp_path):
    import threading

    from angel_ptm.errors import EngineBusyError

    inside, release = threading.Event(), threading.Event()

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            x = self.layers[0](x)
            if threading.current_thread() is not threading.main_thread():
                inside.set()
                release.wait(10)  # the other thread calls in while this forward is under way
            return self.layers[1](x).sum()

    model = Slow()
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    results = []
    worker = threading.Thread(target=lambda: results.append(engine(torch.randn(2, 8))))
    try:
        worker.start()
        assert inside.wait(10)
        with pytest.raises(EngineBusyError, match="another thread is inside"):
            engine(torch.randn(2, 8))
        release.set()
        worker.join(10)
        engine.backward(results[0])  # one call after another, from either thread, is fine
        engine.step()
        assert not engine.manager.pinned_ids
    finally:
        release.set()
        engine.close()
