"""Tensor parallelism applied from outside: `parallelize(model, comm, plan)` swaps a plain model's layers for their
Megatron versions, holding only this rank's shards, as torchtitan's `parallelize_module` does.

    plan = gpt_plan(model)                       # or llama_plan(model) for HuggingFace LlamaForCausalLM, or your own
    parallelize(model, TPComm(mesh), plan)       # angel_ptm.initialize does this when parallel.tp > 1

A plan maps module names (fnmatch patterns over `named_modules()`: "layers.*.attention.wq") to a style:

    colwise        nn.Linear -> ColumnParallelLinear (output features split)
    rowwise        nn.Linear -> RowParallelLinear (input features split, output summed over tp)
    vocab_embed    nn.Embedding -> VocabParallelEmbedding (output: sequence shards with sequence parallelism)
    vocab_embed_whole  the same, its output whole on every rank (all-reduced) in any case
    vocab_output   nn.Linear -> ColumnParallelLinear whose logits stay vocabulary-sharded (vocab-parallel loss)
    enter          a module whose input enters the region (a pre-hook: copy_to, or with sequence parallelism the
                   gather of the sequence shards): attention and feed-forward blocks, the output head
    seq_scatter    a module whose input is whole and becomes sequence shards (sequence parallelism only): the first
                   decoder layer of a model whose embedding output must stay whole (HuggingFace computes positions
                   from its length)
    norm           a norm whose input is sequence shards (sequence parallelism only): its weight's gradient is
                   all-reduced over tp
    seq_sharded    a module whose forward runs on sequence shards under sequence parallelism (decoder layers, an
                   embedding dropout after a sharded embedding): its dropout draws this tp rank's own masks (the
                   outermost module a pattern matches; nothing without sequence parallelism)

Random numbers (rng.py): where the model has dropout, an `enter` module's forward and a `seq_sharded` one's draw
from this tp rank's own stream, and the row-parallel exit without sequence parallelism returns to the stream every
tp rank shares (the replicated activations get the same mask everywhere), as Megatron's model-parallel RNG does;
recomputation draws the same masks again. `Plan.random` (default: `rng.has_dropout(model)`) turns the scopes on or
off.

and `divide` names integer attributes that count heads (divided by tp on the modules that hold them). Every pattern
must match a module and every dimension it splits must divide by tp, else a TensorParallelError names them.
The shards are sliced from the full initialization, so a tp run starts from exactly the 1-rank weights (ranks that
built the model with different random states first take tp rank 0's full values); a meta-device model keeps meta
shards, and materialization initializes each full tensor and keeps this rank's slice.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from angel_ptm.errors import TensorParallelError
from angel_ptm.parallel.collectives import FAKE_TRACE
from angel_ptm.parallel.tensor.comm import TPComm, copy_to, scatter_seq
from angel_ptm.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                              anchored_entry)
from angel_ptm.parallel.tensor.rng import has_dropout, sync_random_state

STYLES = ("colwise", "rowwise", "vocab_embed", "vocab_embed_whole", "vocab_output", "enter", "seq_scatter", "norm",
          "seq_sharded")


@dataclass(frozen=True)
class Plan:
    styles: dict[str, tuple[str, ...]]  # pattern -> styles applied to each module it matches, in order
    divide: dict[str, tuple[str, ...]] = field(default_factory=dict)  # pattern -> head-count attributes
    random: bool | None = None  # dropout's per-rank streams (rng.py); None: where the model has dropout
    config_divide: tuple[str, ...] = ()  # `model.config` head counts tp must divide (HuggingFace), checked only


def gpt_plan(model: nn.Module) -> Plan:
    """angel_ptm.models.GPT: q, k, v and the SwiGLU's w1, w3 column-wise; o and w2 row-wise; the vocabulary split
    in the embedding and the (tied or not) output head; GQA's kv heads split like the query heads."""
    return Plan(
        styles={"tok_embeddings": ("vocab_embed",),
                "layers.*.attention": ("enter",), "layers.*.feed_forward": ("enter",),
                "layers.*.attention.w[qkv]": ("colwise",), "layers.*.attention.wo": ("rowwise",),
                "layers.*.feed_forward.w[13]": ("colwise",), "layers.*.feed_forward.w2": ("rowwise",),
                "layers.*.attention_norm": ("norm",), "layers.*.ffn_norm": ("norm",), "norm": ("norm",),
                "output": ("enter", "vocab_output"), "layers.*": ("seq_sharded",), "drop": ("seq_sharded",)},
        divide={"layers.*.attention": ("n_head", "n_kv_head")})


def llama_plan(model: nn.Module) -> Plan:
    """HuggingFace LlamaForCausalLM (and models laid out like it: Mistral, Qwen2): the same split; the embedding's
    output stays whole (the model derives positions and the causal mask from its length) and the first decoder
    layer scatters it into sequence shards when sequence parallelism is on."""
    return Plan(
        styles={"model.embed_tokens": ("vocab_embed_whole",),
                "model.layers.0": ("seq_scatter",),
                "model.layers.*.self_attn": ("enter",), "model.layers.*.mlp": ("enter",),
                "model.layers.*.self_attn.[qkv]_proj": ("colwise",), "model.layers.*.self_attn.o_proj": ("rowwise",),
                "model.layers.*.mlp.gate_proj": ("colwise",), "model.layers.*.mlp.up_proj": ("colwise",),
                "model.layers.*.mlp.down_proj": ("rowwise",),
                "model.layers.*.input_layernorm": ("norm",), "model.layers.*.post_attention_layernorm": ("norm",),
                "model.norm": ("norm",), "lm_head": ("enter", "vocab_output"),
                "model.layers.*": ("seq_sharded",)},
        config_divide=("num_attention_heads", "num_key_value_heads"))


def plan_for(model: nn.Module) -> Plan:
    """The built-in plan for `model`'s type, or a TensorParallelError naming it."""
    from angel_ptm.models.gpt import GPT

    if isinstance(model, GPT):
        if model.cfg.moe is not None:
            raise TensorParallelError("parallel.tp: tensor parallelism of MoE layers (model.moe) is not supported; "
                                      "split the experts with expert parallelism instead")
        return gpt_plan(model)
    names = {name for name, _ in model.named_modules()}
    if {"model.embed_tokens", "lm_head", "model.norm"} <= names and any(".self_attn.q_proj" in n for n in names):
        return llama_plan(model)
    raise TensorParallelError(f"parallel.tp: no built-in tensor-parallel plan for {type(model).__name__}; call "
                              f"angel_ptm.parallel.tensor.parallelize(model, comm, Plan(...)) before initialize")


def is_parallelized(model: nn.Module) -> int:
    """The tp degree `model` was parallelized for (1: not)."""
    return getattr(model, "_angel_tp", None).size if getattr(model, "_angel_tp", None) is not None else 1


def tp_comm_of(model: nn.Module) -> TPComm | None:
    return getattr(model, "_angel_tp", None)


def shards_of(model: nn.Module) -> dict[str, object]:
    """Parameter name -> its Shard, for every parameter that is a tensor-parallel shard (tied names included)."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for key, shard in getattr(module, "tp_shards", {}).items():
            out[f"{prefix}.{key}" if prefix else key] = shard
    return out


def parallelize(model: nn.Module, comm: TPComm, plan: Plan) -> nn.Module:
    """Apply `plan` to `model` in place (see the module docstring); returns the model."""
    if tp_comm_of(model) is not None:
        raise TensorParallelError(f"{type(model).__name__} is tensor-parallel already (tp {is_parallelized(model)})")
    modules = dict(model.named_modules())
    matches = {pattern: [n for n in modules if fnmatch.fnmatchcase(n, pattern)] for pattern in plan.styles}
    matches_divide = {pattern: [n for n in modules if fnmatch.fnmatchcase(n, pattern)] for pattern in plan.divide}
    for pattern, found in {**matches, **matches_divide}.items():
        if not found:
            raise TensorParallelError(f"tensor-parallel plan: '{pattern}' names no module of "
                                      f"{type(model).__name__} (its modules include {sorted(modules)[:8]})")
    for pattern, attrs in plan.divide.items():
        for name in matches_divide[pattern]:
            for attr in attrs:
                value = getattr(modules[name], attr, None)
                if not isinstance(value, int):
                    raise TensorParallelError(f"tensor-parallel plan: {name}.{attr} is not an integer ({value!r})")
                if value % comm.size:
                    raise TensorParallelError(f"{name}.{attr} ({value}) does not divide over parallel.tp "
                                              f"{comm.size}")
    config = getattr(model, "config", None)
    for attr in plan.config_divide:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % comm.size:
            raise TensorParallelError(f"{type(model).__name__}: config.{attr} ({value}) does not divide over "
                                      f"parallel.tp {comm.size}")
    for pattern, styles in plan.styles.items():  # every split dimension checked before any communication
        for name in matches[pattern]:
            for style in styles:
                _check_divisible(modules[name], name, style, comm.size)
    random = has_dropout(model) if plan.random is None else plan.random
    if comm.collectives is not None:  # (a planning comm, for the estimate, has none: shapes only)
        _same_full_values(model, comm)
        if random:
            sync_random_state(comm)
    shared: dict = {}
    for pattern, styles in plan.styles.items():
        for name in matches[pattern]:
            for style in styles:
                if style == "seq_sharded" and any(fnmatch.fnmatchcase(name[:i], pattern)
                                                  for i, c in enumerate(name) if c == "."):
                    continue  # inside a module the pattern matched: that one's scope covers it
                _apply(model, name, style, comm, shared, random)
    for pattern, attrs in plan.divide.items():
        for name in matches_divide[pattern]:
            for attr in attrs:
                setattr(modules[name], attr, getattr(modules[name], attr) // comm.size)
    model._angel_tp = comm
    return model


def _apply(model: nn.Module, name: str, style: str, comm: TPComm, shared: dict, random: bool = False) -> None:
    module = model.get_submodule(name)
    parent_name, _, leaf = name.rpartition(".")
    replace = None
    if style in ("colwise", "rowwise", "vocab_output") and \
            isinstance(model.get_submodule(parent_name) if parent_name else model, nn.MultiheadAttention):
        raise TensorParallelError(f"tensor-parallel plan: {name} is an nn.MultiheadAttention's projection, whose "
                                  f"weight the attention reads itself (F.multi_head_attention_forward), never "
                                  f"calling it: style '{style}' cannot split it; leave it out of the plan")
    if style in ("colwise", "vocab_output"):
        _expect(module, nn.Linear, name, style)
        replace = ColumnParallelLinear.from_linear(module, comm, shared, name, vocab_output=style == "vocab_output")
    elif style == "rowwise":
        _expect(module, nn.Linear, name, style)
        replace = RowParallelLinear.from_linear(module, comm, shared, name)
    elif style in ("vocab_embed", "vocab_embed_whole"):
        _expect(module, nn.Embedding, name, style)
        replace = VocabParallelEmbedding.from_embedding(module, comm, shared, name,
                                                        whole=style == "vocab_embed_whole")
    elif style == "enter":
        _anchor_entry(module, comm, name)
        if random:
            comm.random.scope(module)
    elif style == "seq_sharded":
        if random and comm.sequence_parallel:
            comm.random.scope(module)
    elif style == "seq_scatter":
        if comm.sequence_parallel:
            module.register_forward_pre_hook(_first_input(lambda x: scatter_seq(x, comm)), with_kwargs=True)
    elif style == "norm":
        if comm.sequence_parallel:
            _reduce_param_grads(module, comm)
    else:
        raise TensorParallelError(f"tensor-parallel plan: style '{style}' for {name}: expected one of {STYLES}")
    if replace is not None:
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, replace)


_SPLIT = {"colwise": (nn.Linear, "out_features"), "vocab_output": (nn.Linear, "out_features"),
          "rowwise": (nn.Linear, "in_features"), "vocab_embed": (nn.Embedding, "num_embeddings"),
          "vocab_embed_whole": (nn.Embedding, "num_embeddings")}


def _check_divisible(module: nn.Module, name: str, style: str, size: int) -> None:
    if style not in _SPLIT:
        if style not in STYLES:
            raise TensorParallelError(f"tensor-parallel plan: style '{style}' for {name}: expected one of {STYLES}")
        return
    cls, attr = _SPLIT[style]
    _expect(module, cls, name, style)
    value = getattr(module, attr)
    what = {"out_features": "output features (heads x head dim, or the feed-forward hidden size)",
            "in_features": "input features", "num_embeddings": "vocabulary"}[attr]
    if value % size:
        raise TensorParallelError(f"{name}.{attr} ({value}, its {what}) does not divide over parallel.tp {size}")


def _expect(module: nn.Module, cls: type, name: str, style: str) -> None:
    if not isinstance(module, cls) or isinstance(module, (ColumnParallelLinear, RowParallelLinear,
                                                          VocabParallelEmbedding)):
        raise TensorParallelError(f"tensor-parallel plan: {name} is a {type(module).__name__}; style '{style}' "
                                  f"takes an nn.{cls.__name__}")
    if type(module).forward is not cls.forward:  # (Gemma's scaled embedding): its parallel version would drop it
        raise TensorParallelError(f"tensor-parallel plan: {name} is a {type(module).__name__}, an nn.{cls.__name__} "
                                  f"with a forward of its own, which style '{style}' would replace; leave it out "
                                  f"of the plan or give it a parallel version")


def _first_input(transform):
    """A forward pre-hook that transforms the module's first input (positional, else `hidden_states`)."""

    def hook(module, args, kwargs):
        if args:
            return (transform(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": transform(kwargs["hidden_states"])}
        raise TensorParallelError(f"tensor parallelism: {type(module).__name__} was called without a positional "
                                  f"input or hidden_states=; the plan cannot find the input to split")

    return hook


def _anchor_entry(module: nn.Module, comm: TPComm, name: str = "") -> None:
    """`module`'s input enters the region (enter_region) through an anchor for the column-parallel linears in it,
    whose weight gradients are then computed while the input gradient's collective runs (layers.WeightGradStash)."""
    weights: list = []  # found at the first forward: a later style may still replace the module (vocab_output)
    found = []  # (whether that first forward has looked: a region may hold no column-parallel linear)

    def enter(mod, args, kwargs):
        if not found:
            found.append(True)
            weights.extend(m.weight for m in mod.modules() if isinstance(m, ColumnParallelLinear))
            for inner in mod.modules():  # a whole parameter used inside on this rank's share (Qwen3's per-head
                # q/k norms): its gradient is a partial sum, all-reduced over tp -- up to the row-parallel exit,
                # after which the activations are whole again (BERT's output LayerNorm): its gradient too
                if isinstance(inner, RowParallelLinear):
                    inner.register_forward_hook(_exit_region(comm))
                elif not isinstance(inner, PARALLEL) and any(p.requires_grad for p in inner._parameters.values()
                                                             if p is not None):
                    _reduce_param_grads(inner, comm, in_region=True)
        comm.stashes.append(None)  # (first: the forward hook pops one whatever happens next)
        comm.regions.append(True)
        entered = []

        def anchored(x):
            x, comm.stashes[-1] = anchored_entry(x, comm, weights)
            entered.append(x)
            return x
        out = _first_input(anchored)(mod, args, kwargs)
        if not watched and comm.size > 1 and not getattr(FAKE_TRACE, "on", False) and entered:
            watched.append(_InputAfterExit(comm, entered[0]))  # the first real forward: checked once
            watched[-1].__enter__()
        return out

    def leave(*_):
        if comm.stashes:
            comm.stashes.pop()
        if comm.regions:
            comm.regions.pop()
        if watched and watched[-1].active:
            watched[-1].__exit__(None, None, None)
            watched[-1].active = False
            if watched[-1].used:
                raise TensorParallelError(
                    f"tensor-parallel plan: {name or type(module).__name__} ('enter') uses its input again after its "
                    f"row-parallel exit (a residual inside it): that input's gradient would be summed over the tp "
                    f"ranks; put 'enter' on the module holding only the split part (BERT's attention.self, not "
                    f"attention)")

    watched: list = []

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, always_call=True)


PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


class _InputAfterExit(TorchDispatchMode):
    """Watches an `enter` module's first forward for an op that reads its entered input after the row-parallel
    exit (the split part is over: the input is used on whole activations, whose gradient the entry all-reduces)."""

    def __init__(self, comm: TPComm, entered: torch.Tensor):
        super().__init__()
        self.comm, self.key = comm, StorageWeakRef(entered.untyped_storage()).cdata
        self.used, self.active = False, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.used and self.comm.regions and not self.comm.regions[-1]:
            self.used = any(isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()).cdata == self.key
                            for t in tree_leaves((args, kwargs)))
        return func(*args, **(kwargs or {}))


def _exit_region(comm: TPComm):
    """A row-parallel linear's forward hook: the `enter` module it runs in has left its split part."""
    def hook(*_):
        if comm.regions:
            comm.regions[-1] = False
    return hook


def _reduce_param_grads(module: nn.Module, comm: TPComm, in_region: bool = False) -> None:
    """While `module` runs, its own parameters pass through copy_to: identity forward, gradient all-reduced over tp
    (each rank saw only its sequence shard, or its share of the heads). Once per module. `in_region`: only where
    it runs in an `enter` module before that module's row-parallel exit."""
    if getattr(module, "_angel_tp_reduced", False):
        return
    module._angel_tp_reduced = True
    forward = module.forward

    def sequence_parallel_forward(*args, **kwargs):
        if in_region and not (comm.regions and comm.regions[-1]):  # on whole activations: a whole gradient
            return forward(*args, **kwargs)
        own = {k: p for k, p in module._parameters.items() if p is not None and p.requires_grad}
        try:
            for key, param in own.items():
                module._parameters[key] = copy_to(param, comm)
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(own)

    module.forward = sequence_parallel_forward


def _same_full_values(model: nn.Module, comm: TPComm) -> None:
    """Every tp rank slices the same full tensors: tp rank 0's values (a meta model: its random state instead)."""
    tensors = list(dict.fromkeys(list(model.parameters()) + list(model.buffers())))
    if any(t.is_meta for t in tensors):
        state = comm.collectives.broadcast_object(torch.get_rng_state(), 0, "tp rank 0's random state")
        torch.set_rng_state(state)
    with torch.no_grad():
        for tensor in tensors:
            if not tensor.is_meta:
                comm.collectives.broadcast(tensor.data, 0, "tp initial full values")
