"""Config rules across sections: a combination that cannot work is a ConfigValueError; a key that has no effect
with the rest of the job is said once, in a warning (never silently ignored)."""

from __future__ import annotations

import logging

from angel_ptm.errors import ConfigValueError

log = logging.getLogger("angel_ptm")
_warned: set[str] = set()


def check_combinations(config) -> None:
    if config.parallel.moe_rebalance_every and config.optimizer.staleness:
        raise ConfigValueError("parallel.moe_rebalance_every: needs optimizer.staleness 0 (experts cannot move "
                               "while their delayed update is pending), got staleness 1")
    if config.parallel.osdp and config.optimizer.staleness:
        raise ConfigValueError("parallel.osdp: true needs optimizer.staleness 0 (a replicated group is refreshed when "
                               "the step ends; staleness 1 publishes the update during the next step)")
    if config.parallel.sequence_parallel and config.model.seq_len % config.parallel.tp:
        raise ConfigValueError(f"parallel.sequence_parallel: model.seq_len {config.model.seq_len} does not divide "
                               f"over tp {config.parallel.tp} (each tp rank holds an equal share of the sequence); use "
                               f"a multiple of {config.parallel.tp}")
    # Keys that act only with another setting: said at once, not silently ignored
    if _set(config.activations, "offload_min_bytes") and config.activations.offload == "none":
        warn_once(f"activations.offload_min_bytes {config.activations.offload_min_bytes} has no effect: "
                   f"activations.offload is none")
    if config.memory.lookahead and config.memory.scheduler != "planned":
        warn_once(f"memory.lookahead {config.memory.lookahead} has no effect: it bounds the planned scheduler's "
                   f"prefetches (this job: memory.scheduler {config.memory.scheduler})")
    if not config.optimizer.overlap_updates and (config.trainer.grad_clip or config.memory.scheduler != "planned"):
        warn_once("optimizer.overlap_updates false has no effect: updates overlap backward only under "
                   "memory.scheduler planned with no clipping (this job: "
                   f"scheduler {config.memory.scheduler}, grad_clip {config.trainer.grad_clip})")
    if config.optimizer.loss_scale != "dynamic" and config.trainer.dtype != "float16":
        warn_once(f"optimizer.loss_scale {config.optimizer.loss_scale} has no effect: loss scaling is for "
                   f"trainer.dtype float16 only (this job: {config.trainer.dtype})")
    if config.trainer.dtype != "float16" or config.optimizer.loss_scale != "dynamic":
        for key in ("loss_scale_initial", "loss_scale_growth", "loss_scale_backoff", "loss_scale_growth_interval"):
            if _set(config.optimizer, key):
                warn_once(f"optimizer.{key} {getattr(config.optimizer, key):g} has no effect: it drives the dynamic "
                           f"loss scale of trainer.dtype float16 (this job: {config.trainer.dtype}, "
                           f"optimizer.loss_scale {config.optimizer.loss_scale})")
    if not config.parallel.moe_rebalance_every:
        for key in ("moe_rebalance_threshold", "moe_rebalance_ema"):
            if _set(config.parallel, key):
                warn_once(f"parallel.{key} {getattr(config.parallel, key):g} has no effect: it drives the experts' "
                           f"rebalancing, which is off (parallel.moe_rebalance_every 0)")
    if config.data.token_dtype != "uint16" and config.data.kind != "tokens":
        warn_once(f"data.token_dtype {config.data.token_dtype} has no effect: it is the element type of a "
                   f"data.kind tokens file (this job reads {config.data.kind})")


def engine_config_for_trainer(config):
    """The config the trainer gives its engine: a key that acts only through the trainer's loop and has nothing to
    act on is said once and left out of the engine's (its estimate reserves nothing for it)."""
    import dataclasses

    if config.checkpoint.async_save and not config.checkpoint.every:
        warn_once("checkpoint.async_save has no effect: checkpoint.every is 0, so the trainer writes no checkpoint "
                   "beside training (a signal's save is waited for)")
        return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, async_save=False))
    return config


# Keys only `angel-ptm train` acts on: its model, data, evaluation, logging, seeding, run directory and checkpoint
# rotation. `angel_ptm.initialize` (the engine in a user's own loop) uses every other key, and of these sections
# data.batch_size (our GPT's activation estimate), trainer.steps (the lr schedule), run.dir (the default page
# directory) and checkpoint.every / async_save / async_max_gbps (the pace and room of a save beside training).
TRAINER_ONLY = {"model": None, "data": ("kind", "path", "token_dtype", "val_fraction", "seed"),
                "trainer": ("eval_every", "eval_steps", "log_every", "seed"), "run": ("name", "resume"),
                "checkpoint": ("keep", "dir", "on_signal")}


def warn_trainer_only(config) -> list[str]:
    """Said once, in a warning, for a script's `angel_ptm.initialize`: the keys set (away from their defaults) that
    only the trainer's loop acts on, so they change nothing here. Returns them."""
    import dataclasses

    from angel_ptm.config.schema import section_classes

    classes, unused = section_classes(), []
    for section, names in TRAINER_ONLY.items():
        given, default = getattr(config, section), classes[section]()
        for f in dataclasses.fields(given):
            if (names is None or f.name in names) and getattr(given, f.name) != getattr(default, f.name):
                unused.append(f"{section}.{f.name}")
    if unused:
        warn_once(f"angel_ptm.initialize does not use {', '.join(unused)}: only `angel-ptm train`'s loop acts on "
                   f"them (its model, data, evaluation, logging, seeding, run and checkpoint rotation); set here "
                   f"they change nothing")
    return unused


def _set(section, key: str) -> bool:
    """Whether the job sets `key` of `section` to other than the schema's default."""
    return getattr(section, key) != getattr(type(section)(), key)


def warn_once(message: str) -> None:
    """A config's warning, once per process (a Config is rebuilt by dataclasses.replace as a job is set up)."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)
