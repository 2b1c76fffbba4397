"""Ctrl-C (SIGINT) inside an engine call (angel_ptm/interrupts.py): raised as KeyboardInterrupt once the call has
finished, so training goes on exactly; a second one in the same call stops it at once and fails the engine; a
handler of the caller's is left alone."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import angel_ptm
from angel_ptm.binding import ParamBinder
from angel_ptm.errors import EngineFailedError
from angel_ptm.memory.manager import PageManager
from angel_ptm.models import GPT, GPTConfig

from test_checkpoint import assert_bitwise, final_states

STEPS = 4


def build():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, dim=64))


def config(tmp_path, name):  # 8 KiB pages on all three tiers: every call pins and moves pages
    return {"memory": {"page_bytes": 8 << 10, "device_budget": 640 << 10, "host_budget": 640 << 10,
                       "disk_dir": str(tmp_path / name)},
            "trainer": {"device": "cpu"}}


DATA = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]


class Interrupter:
    """SIGINT(s) to this process at the `at`-th PageManager.acquire of a given call of a given step (`plan`: step
    -> (call, at)), so the handler runs inside the engine's own bookkeeping: pins, moves, bindings."""

    def __init__(self, monkeypatch, plan: dict, times: int = 1):
        self.plan, self.times, self.step, self.call, self.count, self.fired = plan, times, 0, "", 0, set()
        real = PageManager.acquire

        def acquire(manager, *args, **kwargs):
            self.count += 1
            call, at = self.plan.get(self.step, ("", 0))
            if (call, at) == (self.call, self.count) and self.step not in self.fired:
                self.fired.add(self.step)
                for _ in range(self.times):
                    os.kill(os.getpid(), signal.SIGINT)
            return real(manager, *args, **kwargs)

        monkeypatch.setattr(PageManager, "acquire", acquire)

    def entering(self, step: int, call: str) -> None:
        self.step, self.call, self.count = step, call, 0


def train(engine, interrupter: Interrupter | None = None) -> list[str]:
    """Every step once, whatever interrupts come: a KeyboardInterrupt out of a call means the call finished (the
    forward's output is lost: it runs again; a backward's step is taken; a step is done)."""
    enter = interrupter.entering if interrupter is not None else (lambda step, call: None)
    i, interrupted = 0, []
    while i < len(DATA):
        call = "forward"
        try:
            enter(i, call)
            loss = engine(DATA[i], DATA[i])
            call = "backward"
            enter(i, call)
            engine.backward(loss)
            call = "step"
            enter(i, call)
            engine.step()
            i += 1
        except KeyboardInterrupt:
            interrupted.append(call)
            if call == "backward":
                engine.step()
            if call != "forward":
                i += 1
    return interrupted


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    engine = angel_ptm.initialize(build(), config(tmp_path_factory.mktemp("ref"), "pages"))
    try:
        assert train(engine) == []
        return final_states(engine)
    finally:
        engine.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_an_interrupt_inside_an_engine_call_is_raised_when_it_returns_and_training_goes_on_exactly(
        tmp_path, monkeypatch, reference):
    """SIGINTs at acquires spread over forward, backward and step (each call's pins, moves and bindings were cut
    half-way before: a raw "page is pinned" or "no readable buffer" error, or a failed engine): each surfaces
    as a KeyboardInterrupt after its call, and the run ends with the uninterrupted run's parameters and moments,
    bit for bit."""
    want = reference
    engine = angel_ptm.initialize(build(), config(tmp_path, "run"))
    interrupter = Interrupter(monkeypatch, {0: ("forward", 3), 1: ("backward", 12), 2: ("step", 2),
                                            3: ("backward", 1)})
    try:
        interrupted = train(engine, interrupter)
        assert interrupted == ["forward", "backward", "step", "backward"]
        assert_bitwise(want, final_states(engine))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        engine.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_second_interrupt_in_the_same_call_stops_it_at_once_and_the_engine_refuses_to_go_on(tmp_path, monkeypatch):
    engine = angel_ptm.initialize(build(), config(tmp_path, "pages"))
    interrupter = Interrupter(monkeypatch, {0: ("backward", 5)}, times=2)
    try:
        loss = engine(DATA[0], DATA[0])
        interrupter.entering(0, "backward")
        with pytest.raises(KeyboardInterrupt):
            engine.backward(loss)
        with pytest.raises(EngineFailedError, match="interrupted twice inside engine.backward"):
            engine(DATA[1], DATA[1])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        engine.close()  # (a failed engine still closes)


def test_a_sigint_handler_of_the_callers_and_a_call_from_another_thread_are_left_alone(tmp_path, monkeypatch):
    seen = []
    engine = angel_ptm.initialize(build(), config(tmp_path, "pages"))
    engine.model.layers[0].register_forward_hook(lambda *a: seen.append(signal.getsignal(signal.SIGINT)))
    mine = signal.signal(signal.SIGINT, lambda *a: None) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        engine.backward(engine(DATA[0], DATA[0]))
        engine.step()
        if mine is not None:
            assert seen[-1] is signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        worker = threading.Thread(target=lambda: engine.backward(engine(DATA[1], DATA[1])) or engine.step())
        worker.start()
        worker.join()
        assert len(seen) == 2
    finally:
        if mine is not None:
            signal.signal(signal.SIGINT, mine)
        engine.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_interrupts_inside_close_wait_for_it_and_the_model_keeps_its_trained_weights(tmp_path, monkeypatch):
    """close() puts the trained weights back into the model: Ctrl-C twice while it does (pressed during a
    `finally: engine.close()`) left half the parameters unbound and lost the weights; now it finishes first."""
    engine = angel_ptm.initialize(build(), config(tmp_path, "pages"))
    engine.backward(engine(DATA[0], DATA[0]))
    engine.step()
    want = {k: v.clone() for k, v in engine.state_dict().items()}
    detach = ParamBinder.detach

    def interrupted_detach(binder, values):  # Ctrl-C twice as the weights go back into the model
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return detach(binder, values)

    monkeypatch.setattr(ParamBinder, "detach", interrupted_detach)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    assert engine._closed and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    got = engine.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not any((tmp_path / "pages").rglob("*.slots"))  # the page files went too


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_an_interrupt_in_a_call_that_raises_is_not_lost_the_error_is_its_cause(tmp_path):
    engine = angel_ptm.initialize(build(), config(tmp_path, "pages"))

    def boom(*_):
        os.kill(os.getpid(), signal.SIGINT)
        raise ValueError("the model's own error")

    handle = engine.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            engine(DATA[0], DATA[0])
        assert isinstance(raised.value.__cause__, ValueError)
        handle.remove()
        engine.backward(engine(DATA[0], DATA[0]))  # the engine goes on
        engine.step()
    finally:
        engine.close()


def test_close_from_another_thread_while_a_call_runs_is_refused(tmp_path):
    """It closed the page files under the call's transfers (EBADF) or unbound its parameters mid-forward."""
    from angel_ptm.errors import EngineBusyError

    engine = angel_ptm.initialize(build(), config(tmp_path, "pages"))
    inside, go = threading.Event(), threading.Event()
    handle = engine.model.layers[1].register_forward_pre_hook(lambda *_: (inside.set(), go.wait(30)) and None)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(engine(DATA[0], DATA[0])))
    worker.start()
    try:
        assert inside.wait(30)
        with pytest.raises(EngineBusyError, match="engine.close: another thread is inside"):
            engine.close()
    finally:
        go.set()
        worker.join()
        handle.remove()
        engine.close()
    assert engine._closed and len(outcome) == 1  # the forward finished


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_wait_for_a_background_save_cut_short_by_ctrl_c_leaves_it_for_close_to_wait_for(tmp_path, monkeypatch):
    """The engine forgot the save before waiting: after a Ctrl-C there, close() no longer waited for it and closed
    the page files under its reads."""
    import time

    from angel_ptm.checkpoint import storage

    put = storage.Pipeline.put
    monkeypatch.setattr(storage.Pipeline, "put", lambda pipeline, job: time.sleep(0.02) or put(pipeline, job))
    engine = angel_ptm.initialize(build(), config(tmp_path, "pages"))
    engine.backward(engine(DATA[0], DATA[0]))
    engine.step()
    pending = engine.save_checkpoint(tmp_path / "ckpt", background=True)
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.wait_for_checkpoint()  # (the save's items at 20 ms each: seconds)
        assert engine.pending_checkpoint is pending and not pending.done()
    finally:
        timer.join()
        engine.close()
    assert pending.done() and (tmp_path / "ckpt" / ".metadata").is_file()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_the_trainers_stop_signals_wait_for_the_engine_call_under_way(tmp_path, monkeypatch, reference):
    """`angel-ptm train` keeps its own SIGINT/SIGTERM handler (StopSignals): a signal it raised half-way through an
    engine call tore the engine, whose close() then ended the run with a misleading error (exit 2, "parameter ...
    used outside the forward of its paging unit") instead of exit 130. It now waits for the call, as ours does:
    here SIGTERM in a backward's bookkeeping, then the step, and the run ends as the uninterrupted one."""
    from angel_ptm.errors import Terminated
    from angel_ptm.trainer import StopSignals

    engine = angel_ptm.initialize(build(), config(tmp_path, "pages"))
    signals, term = StopSignals(), signal.getsignal(signal.SIGTERM)
    acquire, count = PageManager.acquire, [0]

    def acquire_then_signal(manager, *args, **kwargs):
        count[0] += 1
        if count[0] == 8:
            signals._on_signal(signal.SIGTERM, None)  # (as the handler runs: between two bytecodes of the engine)
        return acquire(manager, *args, **kwargs)

    try:
        loss = engine(DATA[0], DATA[0])
        monkeypatch.setattr(PageManager, "acquire", acquire_then_signal)
        with pytest.raises(Terminated):
            engine.backward(loss)
        monkeypatch.undo()
        engine.step()
        for x in DATA[1:]:
            engine.backward(engine(x, x))
            engine.step()
        assert_bitwise(reference, final_states(engine))
    finally:
        signal.signal(signal.SIGTERM, term)
        engine.close()
