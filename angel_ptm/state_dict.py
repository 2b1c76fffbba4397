"""State dicts in torch's own formats, read from and written to pages.

- `model_state_dict(engine)`: `model.state_dict()`'s keys with the real values — each parameter read from its pages
  wherever they are (a disk page is read into a scratch buffer; no page changes tier), buffers as the model holds
  them. Under mixed precision (or optimizer.staleness 1) a parameter's value is its fp32 master weight.
- `load_model_state_dict(engine, sd)`: the inverse, strict by default like `nn.Module.load_state_dict`.
- `optimizer_state_dict(engine)` / `load_optimizer_state_dict(engine, sd)`: `torch.optim.AdamW`'s format (`state`:
  per parameter index `step`, `exp_avg`, `exp_avg_sq`; `param_groups`: one group over `model.parameters()` in
  order), so a run can move from or to plain PyTorch. As with torch, a parameter that never received a gradient
  (frozen, or never used) has no state.
Under tensor parallelism every one of them holds whole tensors (gathered over the tp group; each rank writes its
slice), so a state dict moves between tp degrees and to plain PyTorch unchanged.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from collections import namedtuple
from collections.abc import Mapping

import torch
from torch import nn

from angel_ptm.errors import ParameterAccessError, StateDictError
from angel_ptm.model_checks import refuse_changed_parameters
from angel_ptm.expert_state import ExpertView

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])
MOMENTS = ("exp_avg", "exp_avg_sq")


def model_state_dict(engine) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with real parameter values (the binder's state-dict hooks read them from pages); under
    tensor parallelism each split parameter whole, gathered over the tp group (every tp rank must call)."""
    state = dict(engine.model.state_dict())
    shards = _shards(engine)
    if shards:
        names = {id(p): n for n, p in engine.model.named_parameters()}
        for key, param in _parameter_keys(engine.model).items():  # the same order on every rank
            name = names[id(param)]
            if key in state and name in shards:
                state[key] = _whole(engine, shards[name], state[key], f"state_dict {key}")
    view = ExpertView.of(engine)  # expert parallelism: every rank's experts, named as in the unsplit model
    if view is not None:
        values = view.gather({view.global_of[k]: v for k, v in state.items() if k in view.global_of},
                             "state_dict experts")
        state = {k: values[k] if k in values else state[k] for k in view.order(list(state))}
    return state


def _shards(engine) -> dict:
    """Parameter name -> its tensor-parallel Shard ({} without tensor parallelism)."""
    return engine.tp_shards if getattr(engine, "tp", None) is not None else {}


def _whole(engine, shard, local: torch.Tensor, what: str) -> torch.Tensor:
    return engine.tp.all_gather(local.contiguous(), shard.dim, what)


def _expected_shape(shards: dict, name: str, param: torch.Tensor) -> tuple:
    return tuple(shards[name].full_shape) if name in shards else tuple(param.shape)


def _local(shards: dict, name: str, value: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a whole tensor of parameter `name` (the tensor itself when it is not split)."""
    return shards[name].take(value) if name in shards else value


def _parameter_keys(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for leaf, buffer in module.named_buffers(recurse=False):
            if buffer is not None and leaf not in module._non_persistent_buffers_set:
                out[f"{module_name}.{leaf}" if module_name else leaf] = buffer
    return out


def _extra_states(model: nn.Module) -> dict[str, nn.Module]:
    """`<module>._extra_state` -> its module, for each module that overrides get_extra_state (torch's state dict
    holds what it returns; set_extra_state takes it back)."""
    return {f"{prefix}._extra_state" if prefix else "_extra_state": module
            for prefix, module in model.named_modules()
            if type(module).get_extra_state is not nn.Module.get_extra_state}


def _state_dict_order(model: nn.Module) -> list[str]:
    """model.state_dict()'s keys in its order (each module's parameters, then its buffers, then its children's),
    without reading a value."""
    return [f"{prefix}.{leaf}" if prefix else leaf for prefix, module in model.named_modules(remove_duplicate=False)
            for leaf in (*module._parameters, *module._buffers)]


def load_model_state_dict(engine, state_dict: dict, strict: bool = True) -> IncompatibleKeys:
    """Write `state_dict`'s parameters into their pages (all kinds that hold the weights) and its buffers into the
    model; missing or unexpected keys are a StateDictError when `strict`, a shape that differs always is."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"load_state_dict: expected a dict of tensors (model.state_dict()), got a "
                             f"{type(state_dict).__name__}")
    model = engine.model
    params, buffers, extra = _parameter_keys(model), _persistent_buffers(model), _extra_states(model)
    expected = set(params) | set(buffers) | set(extra)
    rank = {name: i for i, name in enumerate(_state_dict_order(model))}
    order = sorted([*params, *buffers], key=lambda name: rank.get(name, len(rank))) + list(extra)
    view = ExpertView.of(engine)  # expert parallelism: the unsplit model's names in, this rank's experts taken
    if view is not None:
        absent = [k for k in view.order(order) if k in view.every and k not in state_dict]  # alike on every rank
        state_dict = {view.local_of.get(k, k): v for k, v in state_dict.items()
                      if k in view.local_of or k not in view.every}
    missing = [key for key in order if key not in state_dict]  # in the model's order, as torch's
    if view is not None:
        missing = [key for key in missing if key not in view.global_of] + absent
    unexpected = [key for key in state_dict if key not in expected]
    if strict and (missing or unexpected):
        raise StateDictError(f"load_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                             f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    names = {id(p): n for n, p in model.named_parameters()}  # the layout's name of each distinct parameter
    shards = _shards(engine)  # tensor parallelism: whole tensors in, this rank's slices written
    for key, value in state_dict.items():
        target = params.get(key, buffers.get(key))
        if target is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise StateDictError(f"load_state_dict: '{key}' is a {type(value).__name__}, not a tensor")
        shape = _expected_shape(shards, names[id(target)], target) if key in params else tuple(target.shape)
        if tuple(value.shape) != shape:
            raise StateDictError(f"load_state_dict: '{key}' has shape {tuple(value.shape)}, the model's is {shape}"
                                 + (" (whole, split over parallel.tp)" if shape != tuple(target.shape) else ""))
    last: dict[str, str] = {}  # a parameter under several names (tied): the last of them, as torch's load keeps
    for key, param in params.items():
        if key in state_dict:
            last[names[id(param)]] = key
    for name, key in last.items():
        engine.write_parameter(name, _local(shards, name, state_dict[key].detach()))
    with torch.no_grad():
        for key, buffer in buffers.items():
            if key in state_dict:
                buffer.copy_(state_dict[key])
    for key, module in extra.items():
        if key in state_dict:
            module.set_extra_state(state_dict[key])
    engine.parameters_written()
    return IncompatibleKeys(missing, unexpected)


def _grouped(engine) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """`model.named_parameters()` as torch.optim.AdamW's param groups: one, or with optimizer.no_decay two (the
    decayed ones, then those with weight decay 0, each in model order), as a recipe builds them."""
    named, spared = list(engine.model.named_parameters()), engine.optimizer.no_decay
    if not spared:
        return [named]
    return [[(n, p) for n, p in named if n not in spared], [(n, p) for n, p in named if n in spared]]


def optimizer_state_dict(engine) -> dict:
    """The page-wise AdamW's state as `torch.optim.AdamW.state_dict()` would give it for `model.parameters()` (with
    optimizer.no_decay: for the two param groups of `_grouped`, their parameters numbered in that order)."""
    opt = engine.optimizer
    shards = _shards(engine)
    state, groups, index = {}, [], 0
    beta1, beta2 = opt.betas

    def entry(name: str) -> dict | None:
        steps = opt.slot_steps[name]  # (tp peers step the same tensors: one rank's count holds for all)
        if not steps:
            return None
        return {"step": torch.tensor(float(steps)), **{
            kind: (_whole(engine, shards[name], engine.state(kind, name), f"optimizer state {kind} {name}")
                   if name in shards else engine.state(kind, name)) for kind in MOMENTS}}

    view = ExpertView.of(engine)  # expert parallelism: numbered over the unsplit model's parameters
    others = {} if view is None else view.gather(
        {view.global_of[name]: entry(name) for name in view.global_of}, "optimizer_state_dict experts")
    for g, members in enumerate(_grouped(engine)):
        params = []
        names = [name for name, _ in members]
        for name in (names if view is None else view.order(names)):
            value = others[name] if name in others else entry(name)
            if value is not None:
                state[index] = value
            params.append(index)
            index += 1
        groups.append({"lr": opt.lr, "betas": (beta1, beta2), "eps": opt.eps,
                       "weight_decay": opt.weight_decay if g == 0 else 0.0,
                       "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                       "differentiable": False, "fused": None, "decoupled_weight_decay": True, "params": params})
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(engine, state_dict: dict) -> None:
    """Take a `torch.optim.AdamW.state_dict()` (one param group over `model.parameters()`, in order; with
    optimizer.no_decay the two groups of `_grouped`, the second's weight decay 0) into the pages: moments,
    per-parameter step counts and the first group's hyperparameters."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"load_optimizer_state_dict: expected a torch.optim.AdamW.state_dict() (a dict with "
                             f"'state' and 'param_groups'), got a {type(state_dict).__name__}")
    groups = state_dict.get("param_groups")
    grouped = _grouped(engine)
    if not isinstance(groups, list) or len(groups) != len(grouped):
        raise StateDictError(f"load_optimizer_state_dict: expected {len(grouped)} param group"
                             f"{'s (optimizer.no_decay: decayed, then not)' if len(grouped) > 1 else ''}, got "
                             f"{len(groups) if isinstance(groups, list) else groups!r}")
    view = ExpertView.of(engine)  # expert parallelism: numbered over the unsplit model's parameters
    if view is not None:  # (another rank's expert: None, its entry skipped)
        params_of = dict(engine.model.named_parameters())
        grouped = [[(view.local_of[n], params_of[view.local_of[n]]) if n in view.local_of else
                    (n, params_of[n]) if n not in view.every else (None, None)
                    for n in view.order([name for name, _ in members])] for members in grouped]
    for g, (group, members) in enumerate(zip(groups, grouped)):
        if len(group.get("params", ())) != len(members):
            raise StateDictError(f"load_optimizer_state_dict: param_groups[{g}] has {len(group.get('params', ()))} "
                                 f"parameters, the model's group {len(members)}")
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise StateDictError(f"load_optimizer_state_dict: param_groups[{g}].{flag} is true; the page-wise "
                                     f"AdamW has no {flag}")
        if g > 0 and float(group.get("weight_decay", 0.0)) != 0.0:
            raise StateDictError(f"load_optimizer_state_dict: param_groups[{g}].weight_decay is "
                                 f"{group['weight_decay']}; the optimizer.no_decay group's is 0")
    named = [(name, param, key) for group, members in zip(groups, grouped)
             for (name, param), key in zip(members, group["params"]) if name is not None]
    group = groups[0]
    opt = engine.optimizer
    shards = _shards(engine)
    # Every entry checked before anything is written: a refused state dict leaves the pages as they were
    writes, steps_of = [], {}
    for name, param, key in named:
        entry = state_dict.get("state", {}).get(key, {})
        if not isinstance(entry, dict):
            raise StateDictError(f"load_optimizer_state_dict: state[{key}] ('{name}') is a "
                                 f"{type(entry).__name__}, not a dict of step, exp_avg, exp_avg_sq")
        try:
            steps = int(float(entry["step"])) if "step" in entry else 0
        except (TypeError, ValueError):
            raise StateDictError(f"load_optimizer_state_dict: state[{key}].step ('{name}') is "
                                 f"{entry['step']!r}, not a number") from None
        if not param.requires_grad:  # frozen at initialize: no optimizer pages
            if steps:
                raise StateDictError(f"load_optimizer_state_dict: state[{key}] is for '{name}', "
                                     f"which is frozen (requires_grad=False) and has no optimizer state")
            continue
        shape = _expected_shape(shards, name, param)
        for kind in MOMENTS:
            value = entry.get(kind)
            if value is None:
                value = torch.zeros(shape, dtype=torch.float32)
            elif not isinstance(value, torch.Tensor):
                raise StateDictError(f"load_optimizer_state_dict: state[{key}].{kind} ('{name}') is a "
                                     f"{type(value).__name__}, not a tensor")
            elif tuple(value.shape) != shape:
                raise StateDictError(f"load_optimizer_state_dict: state[{key}].{kind} "
                                     f"('{name}') has shape {tuple(value.shape)}, the parameter's is {shape}")
            writes.append((kind, name, value))
        steps_of[name] = steps
    try:
        hyper = (float(group["lr"]), tuple(float(b) for b in group["betas"]), float(group["eps"]),
                 float(group["weight_decay"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise StateDictError(f"load_optimizer_state_dict: param_groups[0] lacks a number for lr, betas, eps or "
                             f"weight_decay ({type(exc).__name__}: {exc})") from None
    try:
        for kind, name, value in writes:
            engine.write_state(kind, name, _local(shards, name, value))
    except BaseException as exc:
        engine.failure.load_failed("(an optimizer state dict)", exc)  # some moments written, others not
        raise
    opt.slot_steps.update(steps_of)
    opt.step_count = max(opt.slot_steps.values(), default=0)
    opt.lr, opt.betas, opt.eps, opt.weight_decay = hyper


def exclusive(method):
    """The engine call runs in one thread at a time with the engine's others (Engine._one_thread: EngineBusyError
    while another thread is inside one): pages are pinned and moved by one thread, and a save must not see a
    step half-way (a save from a second thread beside the training thread wrote checkpoints with some tensors a
    step ahead of others, checksums and all)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._one_thread(method.__name__):
            return method(self, *args, **kwargs)

    return call


class StateAccess:
    """The engine's tensor-level and state-dict surface (mixed into Engine): copies of what the pages hold, in torch's
    formats, and writes into them. Reads of sharded kinds under data parallelism are collective (PageTensors)."""

    @exclusive
    def parameter(self, name: str) -> torch.Tensor:
        """A copy of parameter `name` as it is now (gathered from its pages), in the dtype the model computes with."""
        return self.state("param", name)

    @exclusive
    def master_parameter(self, name: str) -> torch.Tensor:
        """A copy of the weights the optimizer updates for `name`: the fp32 master under mixed precision."""
        self._settle_outside_writes()
        slot = self._slot_named(name)
        return self.tensors.read(self.tensors.weights_kind(slot), slot)

    @exclusive
    def state(self, kind: str, name: str) -> torch.Tensor:
        """A copy of tensor `name` in the pages of `kind` (param, grad, master, exp_avg, exp_avg_sq), on the CPU.
        Pages are read where they are (a disk page into a scratch buffer): no page changes tier."""
        self._settle_outside_writes()
        return self.tensors.read(kind, self._slot_named(name))

    def _slot_named(self, name: str):
        """The layout's slot of parameter `name` (any of a tied parameter's names, as model.named_parameters gives
        them), or a ParameterAccessError naming it and the nearest names."""
        try:
            return self.layout.slot(name)
        except KeyError:
            pass
        for alias, param in self.model.named_parameters(remove_duplicate=False):
            if alias == name and id(param) in self.binder.slots:
                return self.binder.slots[id(param)]
        names = [n for n, _ in self.model.named_parameters(remove_duplicate=False)]
        near = difflib.get_close_matches(str(name), names, n=3)
        raise ParameterAccessError(f"no parameter named {name!r} in the model"
                                   + (f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else
                                      f" ({len(names)} parameters, e.g. {names[0]!r})" if names else ""))

    def _busy_for_writes(self) -> str | None:
        """Why a parameter cannot be written outside its unit now (outside_writes.py), or None."""
        if self.driver.eager_done:  # (torch's write would come before the update, ours after some)
            return "pages were updated during this step's backward (write before engine.backward or after step())"
        return self.binder.writes_refused()

    def _weights_lag(self) -> bool:
        """optimizer.staleness 1: the weights the model computes with are a step behind the master's."""
        return not self._closed and self.delayed is not None and not self.delayed.idle

    def _write_outside(self, param: nn.Parameter, values: torch.Tensor, mask: torch.Tensor) -> None:
        """The elements of `values` where `mask` into `param`'s weight pages: a write the model made outside its
        unit's forward (outside_writes.py); under mixed precision the master's and, rounded, the compute copy's."""
        self.failure.check()
        self.flush()  # staleness 1: the pending update lands first, as under load_state_dict
        slot = self.binder.slots[id(param)]
        kind = self.tensors.weights_kind(slot)
        self.tensors.write_where(kind, slot, values, mask)
        if kind == "master":
            self.tensors.write_where("param", slot, values, mask)
        self.binder.weights_generation += 1

    def _settle_outside_writes(self) -> None:
        """Parameters written in place outside their units through views (outside_writes.py): into the pages."""
        if not self._closed and self.failure.reason is None:
            self.binder.outside_writes.settle()

    @exclusive
    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Write `value` into `name`'s weight pages (the master under mixed precision: then `parameters_written`)."""
        self._check_alive()
        slot = self._slot_named(name)
        self.tensors.write(self.tensors.weights_kind(slot), slot, value)

    @exclusive
    def write_state(self, kind: str, name: str, value: torch.Tensor) -> None:
        """Write `value` into tensor `name`'s pages of `kind` (exp_avg, exp_avg_sq, ...)."""
        self._check_alive()
        self.tensors.write(kind, self._slot_named(name), value)

    @exclusive
    def state_dict(self) -> dict[str, torch.Tensor]:
        """`model.state_dict()`'s keys with the real values, on the CPU (angel_ptm/state_dict.py)."""
        self._check_alive(reading=True)
        self._run_pending_update()
        return model_state_dict(self)

    def _run_pending_update(self) -> None:
        """staleness 1: the pending update runs now, as save_checkpoint runs it (its result does not depend on
        when it runs; the weights the model computes with change at the next step, as they would)."""
        delayed = self.delayed
        if not self._closed and delayed is not None and delayed.pending:
            with self.failure.step(self.optimizer, delayed):
                delayed.finish()

    @exclusive
    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Write a `model.state_dict()` into the pages (and the model's buffers); as `nn.Module.load_state_dict`."""
        self._check_alive()
        self.flush()  # staleness 1: no pending update may land on top of the loaded weights
        return load_model_state_dict(self, state_dict, strict)

    @exclusive
    def optimizer_state_dict(self) -> dict:
        """The AdamW state in `torch.optim.AdamW.state_dict()`'s format, for `model.parameters()` in order."""
        self._check_alive(reading=True)
        refuse_changed_parameters(self.model, self.binder.slots, lambda slot: False)
        self._run_pending_update()
        return optimizer_state_dict(self)

    @exclusive
    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Take a `torch.optim.AdamW.state_dict()` (moments, step counts, hyperparameters) into the pages."""
        self._check_alive()
        self.flush()
        load_optimizer_state_dict(self, state_dict)

    pending_checkpoint = None  # a save running beside training (save_checkpoint(..., background=True))

    @exclusive
    def save_checkpoint(self, path, extra=None, background: bool = False):
        """The whole training state into checkpoint directory `path` (DCP format, written as `path`.tmp and renamed
        when complete), on every rank, between steps; `extra`: any picklable object, returned by load_checkpoint
        (angel_ptm/checkpoint). Returns the path; with `background`, a PendingSave at once (its `wait()` returns
        the path): the pages' bytes are taken now and written while training goes on."""
        from angel_ptm.checkpoint import save_checkpoint

        return save_checkpoint(self, path, extra, background)

    def _finish_checkpoint(self) -> None:
        """close(): a save beside training reads the slot files, so it ends first; its error becomes a warning
        (close must go on; wait_for_checkpoint() raises it)."""
        try:
            self.wait_for_checkpoint()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"the checkpoint saved beside training failed: {exc}", stacklevel=3)

    def wait_for_checkpoint(self):
        """Wait for a save running beside training to complete (its path), raising its error unless the save's own
        `wait()` raised it already (the caller knows: a later save is not failed by it); None without one."""
        pending = self.pending_checkpoint
        if pending is None or (pending.done() and pending.reported):
            self.pending_checkpoint = None
            return None
        try:
            return pending.wait()
        finally:
            if pending.done():  # (a wait cut short by Ctrl-C leaves it pending: close() still waits for it)
                self.pending_checkpoint = None

    @exclusive
    def load_checkpoint(self, path):
        """The training state of checkpoint directory `path` (saved by any rank count, page size or placement) into
        the pages, on every rank; returns the `extra` it was saved with."""
        from angel_ptm.checkpoint import load_checkpoint

        return load_checkpoint(self, path)
