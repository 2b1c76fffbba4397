"""torch's own APIs on a model the engine manages: gradients (`.grad`, hooks, clipping, zero_grad), state dicts,
the learning rate, interrupted calls, threads, and the models the pages cannot keep. Each behaves as in plain
PyTorch or is refused with a typed error that says what to do instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import angel_ptm
from angel_ptm.errors import ConfigValueError, ParameterAccessError, StateDictError
from tests.test_any_model import config, torch_losses
from tests.test_engine_equivalence import assert_same_losses, run_steps
from tests.test_model_entry_points import memory


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


class ClampsInForward(nn.Module):
    """Rewrites a weight in place inside forward (weight clipping under torch.no_grad(), as WGAN critics do)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.clamp_(-0.1, 0.1)
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def test_a_forward_that_writes_a_parameter_in_place_is_refused_naming_it(tmp_path):
    """The engine acquires a unit's parameter pages for reading in forward, so a write there would be dropped (the
    losses drifted from torch's from the second step): the version counter of every parameter bound for a unit is
    compared when the unit ends, and a change is a ParameterAccessError naming the unit and the parameter."""
    torch.manual_seed(0)
    engine = angel_ptm.initialize(ClampsInForward(), config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        with pytest.raises(ParameterAccessError, match=r"unit '<root>': its forward wrote parameter\(s\) a\.weight "
                                                       r"in place"):
            engine(torch.randn(4, 8))
    finally:
        engine.close()


@pytest.mark.parametrize("copy_of", ["torch.save", "deepcopy"])
def test_pickling_or_deep_copying_a_managed_model_is_refused_saying_what_to_do(copy_of, tmp_path):
    """torch.save(model) and copy.deepcopy(model) reached the engine's hooks (local functions: pickle's
    AttributeError) or a parameter's guard class (a TypeError); both are a ParameterAccessError naming the way to
    save or copy, and the engine trains on unharmed, as the state dict it points to shows."""
    import copy
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    engine = angel_ptm.initialize(model, config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        engine.backward(engine(torch.randn(3, 8)).sum())
        engine.step()
        attempt = (lambda: torch.save(model, io.BytesIO())) if copy_of == "torch.save" else (
            lambda: copy.deepcopy(model))
        with pytest.raises(ParameterAccessError, match=r"not pickled or deep-copied.*engine\.state_dict\(\)"):
            attempt()
        plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        plain.load_state_dict(engine.state_dict())
        x = torch.randn(5, 8)
        with torch.no_grad():
            torch.testing.assert_close(plain(x), engine(x), rtol=0, atol=0)
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
        # Every call that touches pages: a checkpoint taken from a second thread saw a step half-way (torn)
        for call in (lambda: engine.save_checkpoint(tmp_path / "ck"), lambda: engine.parameter("layers.0.weight"),
                     engine.state_dict, engine.optimizer_state_dict, engine.zero_grad, engine.flush,
                     lambda: engine.clip_grad_norm(1.0), lambda: engine.load_checkpoint(tmp_path / "ck")):
            with pytest.raises(EngineBusyError, match="another thread is inside"):
                call()
        assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.tmp").exists()
        release.set()
        worker.join(10)
        engine.backward(results[0])  # one call after another, from either thread, is fine
        engine.step()
        assert not engine.manager.pinned_ids
    finally:
        release.set()
        engine.close()


def test_a_refused_optimizer_state_dict_writes_nothing(tmp_path):
    """A torch AdamW state dict whose last entry is wrong (shape, type) is refused before any moment or step count
    is written: the engine trains on exactly as if it had not been offered."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    reference = angel_ptm.initialize(build(), config(memory(tmp_path / "a")))
    engine = angel_ptm.initialize(build(), config(memory(tmp_path / "b")))
    try:
        for e in (reference, engine):
            e.backward(e(xs[0]).square().mean())
            e.step()
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        model(xs[1]).square().mean().backward()
        opt.step()
        bad = opt.state_dict()
        bad["state"][3] = dict(bad["state"][3], exp_avg=torch.zeros(7))
        with pytest.raises(StateDictError, match=r"state\[3\].exp_avg \('2.bias'\) has shape \(7,\)"):
            engine.load_optimizer_state_dict(bad)
        bad["state"][3] = dict(bad["state"][3], exp_avg="zeros")
        with pytest.raises(StateDictError, match=r"state\[3\].exp_avg \('2.bias'\) is a str, not a tensor"):
            engine.load_optimizer_state_dict(bad)
        assert engine.optimizer_state_dict()["state"][0]["step"] == 1
        losses = [[e(x).square().mean() for e in (reference, engine)] for x in xs[2:3]][0]
        for e, loss in zip((reference, engine), losses):
            e.backward(loss)
            e.step()
        assert torch.equal(reference.parameter("0.weight"), engine.parameter("0.weight"))
    finally:
        reference.close()
        engine.close()


def test_a_modules_extra_state_round_trips_through_the_engines_state_dict(tmp_path):
    """A module with get_extra_state / set_extra_state: its `_extra_state` is in the engine's state dict, as in
    torch's, and loading that state dict back sets it (it used to be an unexpected key); a value that is no tensor
    where a parameter goes is a StateDictError naming it."""
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.seen = nn.Linear(4, 4), 0

        def forward(self, x):
            self.seen += 1
            return self.lin(x)

        def get_extra_state(self):
            return {"seen": self.seen}

        def set_extra_state(self, state):
            self.seen = state["seen"]

    model = Counted()
    engine = angel_ptm.initialize(model, config(memory(tmp_path)))
    try:
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        state = engine.state_dict()
        assert state["_extra_state"] == {"seen": 1} and list(state) == list(Counted().state_dict())
        model.seen = 7
        engine.load_state_dict(state)
        assert model.seen == 1
        with pytest.raises(StateDictError, match="'lin.weight' is a list, not a tensor"):
            engine.load_state_dict(dict(state, **{"lin.weight": [1.0]}))
    finally:
        engine.close()


def test_a_backward_the_engine_does_not_run_through_its_frozen_model_leaves_no_page_pinned(tmp_path):
    """A frozen network kept by an engine (a GAN's discriminator during the generator's step, a frozen loss network)
    whose graph another engine's backward, or torch's own, runs through to reach the input: its pages were pinned
    when backward read them and nothing released them (no end of the engine's backward came), so close() failed
    under ZeRO-3 ('page is pinned 2 times'). The input's gradient is torch's, and nothing stays pinned."""
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    plain = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    plain.load_state_dict(frozen.state_dict())
    engine = angel_ptm.initialize(frozen, config(memory(tmp_path, placement={"page_bytes": "4KiB"})))
    try:
        for p in list(frozen.parameters()) + list(plain.parameters()):
            p.requires_grad_(False)
        x = torch.randn(4, 8, requires_grad=True)
        engine(x).sum().backward()
        x_plain = x.detach().clone().requires_grad_(True)
        plain(x_plain).sum().backward()
        torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-6, atol=1e-7)
        assert not engine.manager.pinned_ids
    finally:
        engine.close()
