"""Ctrl-C during an engine call: raised when the call returns, not in the middle of it.

A KeyboardInterrupt raised wherever the main thread happens to be (Python runs the SIGINT handler between any two
bytecodes) could land inside the engine's own bookkeeping: between pinning a page and releasing it, between a
page's two state changes, half-way through binding a unit. Training on after that met raw errors (`page grad:63
is pinned`, `page param:17 has no readable buffer in state TO_DISK`, a parameter "used outside its unit") or, worse,
none. So while the main thread is inside `engine(...)`, `backward`, `step` (or `zero_grad`, `clip_grad_norm`,
`flush`, which change pages too), a first SIGINT is noted, said once, and raised as KeyboardInterrupt when the call
has finished: the engine is then as sound as after any completed call (a forward's output is dropped; a backward's
gradients are in; a step is done). A second SIGINT in the same call raises at once, and the engine, which may then
be torn, refuses every later call but `close()` (EngineFailedError: resume from the last checkpoint). A call that
raised an error of its own meanwhile raises the KeyboardInterrupt with that error as its cause. `close()` defers
every SIGINT until it is done: the model gets its trained weights back whole.

Only the interpreter's own SIGINT handler is replaced, and only on the main thread. A handler of the caller's is
left as it is; it may ask for the same (`defer`), as `angel-ptm train`'s does for SIGINT and SIGTERM.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading

log = logging.getLogger("angel_ptm")

# The engine call the main thread is inside (the outermost): [engine, its name, strict, exceptions noted]
_CALL: list = []


def defer(exception: BaseException) -> bool:
    """For a signal handler: inside an engine call on the main thread, `exception` is noted and raised when the
    call returns (True). Outside one, or at a second signal in the same call (the engine, which may then be torn,
    fails for good), False: the handler raises it now."""
    if not _CALL or threading.current_thread() is not threading.main_thread():
        return False
    engine, name, strict, received = _CALL
    if received and not strict:  # the second: now, and what the call was doing may be left half-done
        engine.failure.fail(f"the engine was interrupted twice inside engine.{name} (step "
                            f"{engine.failure.steps_done + 1}): its pages may be torn, so it refuses to go on: "
                            f"resume from the last checkpoint")
        return False
    if not received:
        log.warning("angel_ptm: %s: raised when engine.%s returns%s", type(exception).__name__, name,
                    "" if strict else " (again to stop at once; the engine then refuses to go on)")
    received.append(exception)
    return True


def _on_sigint(signum, frame) -> None:
    if not defer(KeyboardInterrupt()):
        raise KeyboardInterrupt


def defers_interrupts(method=None, *, strict: bool = False):
    """Engine method decorator: a SIGINT while it runs is raised (KeyboardInterrupt) once it has returned, or
    chained to the error it raised. `strict` (close(): the trained weights go back into the model): every SIGINT
    waits for the end, a second one too."""
    if method is None:
        return lambda m: defers_interrupts(m, strict=strict)
    name = "forward" if method.__name__ == "__call__" else method.__name__

    @functools.wraps(method)
    def call(engine, *args, **kwargs):
        if _CALL or threading.current_thread() is not threading.main_thread():
            return method(engine, *args, **kwargs)  # (inside an outer call, which defers; or not the main thread)
        received: list[BaseException] = []
        _CALL[:] = [engine, name, strict, received]
        ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (a handler of the caller's: kept)
        if ours:
            signal.signal(signal.SIGINT, _on_sigint)
        try:
            result = method(engine, *args, **kwargs)
        except BaseException as exc:
            if received and not isinstance(exc, KeyboardInterrupt):  # (an error of the call's own: kept as cause)
                raise received[0] from exc
            raise
        finally:
            _CALL.clear()
            if ours:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise received[0]
        return result

    return call
