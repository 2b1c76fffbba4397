"""2-rank jobs whose save fails on one rank (tests/test_distributed_launch.py spawns them): a rank that dies while
saving, and one whose save raises (a checksum error, an interrupt)."""

from __future__ import annotations

import os
import time

import angel_ptm

from dist_jobs import CASES, config_of, micro_batches


def die_while_saving(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """Rank 1 dies (os._exit) after writing its first checkpoint item; the others must raise a typed error, and
    no checkpoint directory may count as complete."""
    from angel_ptm.checkpoint import storage

    build, _, loss_fn = CASES[spec["model"]]
    engine = angel_ptm.initialize(build(), config_of(spec, world, os.path.join(tmp, "die-saving")))
    batch = micro_batches(spec["model"], world)[rank]
    engine.backward(loss_fn(engine, *batch))
    engine.step()
    if rank == 1:
        storage.FAULT = lambda point: os._exit(3) if point == "item-written" else None
    t0 = time.perf_counter()
    try:
        engine.save_checkpoint(os.path.join(tmp, "ckpt-dead-peer"), background=spec.get("background", False))
        engine.wait_for_checkpoint()
    finally:
        seconds = time.perf_counter() - t0
    return {"seconds": seconds}


def fail_while_saving(rank: int, world: int, spec: dict, tmp: str) -> dict:
    """Rank 1's save fails after its first item, twice: a ChecksumError (a disk page read back wrong), then a
    Terminated (a second SIGTERM during a signal's save). Each reaches every rank through the save's own result
    gather, as the same error, at once: the first as a CheckpointError naming rank 1 (the ranks then train on and
    save again), the second as the interrupt itself. Per rank: what each save raised, its seconds, and the
    losses."""
    from angel_ptm.checkpoint import storage
    from angel_ptm.errors import ChecksumError, Terminated

    build, _, loss_fn = CASES[spec["model"]]
    engine = angel_ptm.initialize(build(), config_of(spec, world, os.path.join(tmp, "fail-saving")))
    batches = micro_batches(spec["model"], 2 * world)
    out: dict = {"raised": [], "seconds": [], "losses": []}

    def step(i: int) -> None:
        loss = loss_fn(engine, *batches[i * world + rank])
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())

    def save(name: str, error: BaseException | None) -> None:
        fired = []

        def fault(point: str) -> None:
            if point == "item-written" and rank == 1 and error is not None and not fired:
                fired.append(point)
                raise error
        storage.FAULT = fault
        t0 = time.perf_counter()
        try:
            engine.save_checkpoint(os.path.join(tmp, name))
            out["raised"].append(None)
        except BaseException as exc:  # noqa: BLE001 - reported
            out["raised"].append([type(exc).__name__, str(exc)])
        finally:
            storage.FAULT = None
            out["seconds"].append(time.perf_counter() - t0)

    step(0)
    save("ckpt-checksum", ChecksumError("exp_avg page 3", "slot 7", 1, 2))
    step(1)
    save("ckpt-after", None)
    save("ckpt-interrupted", Terminated(15))
    out["complete"] = sorted(p for p in os.listdir(tmp) if p.startswith("ckpt-"))
    engine.close()  # the save's collectives all matched: closing reads the weights with them
    return out
