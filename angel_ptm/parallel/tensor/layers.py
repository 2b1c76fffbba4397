"""Megatron 1-D tensor-parallel layers: plain local-shard parameters, the communication in autograd functions.

    ColumnParallelLinear   weight [out/tp, in] (and bias [out/tp]): output features split; its input enters the
                           region where the plan says (a module-level hook, so q, k and v share one gather)
    RowParallelLinear      weight [out, in/tp]: input features split; the partial outputs leave the region
                           (all-reduce, or reduce-scatter to sequence shards); the bias (whole) added after
    VocabParallelEmbedding weight [vocab/tp, dim]: ids outside this rank's range look up zeros; the sum over ranks
                           (all-reduce, or reduce-scatter to sequence shards) is the embedding
    vocab-sharded logits   a column-parallel output head without a gather: its output is a `VocabShardedLogits`,
                           whose `F.cross_entropy` is the vocabulary-parallel one (max and sum all-reduced over tp)

The classes subclass torch's, so a model's init rule (`isinstance(m, nn.Linear)`), `reset_parameters()` and the
meta-device materialization see the layers they were written for. Each records which of its parameters are shards
(`tp_shards`: the dimension, this rank's slice, the full shape): materialization initializes the full tensor and
keeps the slice, the gradient norm counts replicated tensors once, and checkpoints name the full tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from angel_ptm.errors import TensorParallelError
from angel_ptm.parallel.collectives import FAKE_TRACE
from angel_ptm.parallel.tensor.comm import TPComm, copy_to, enter_region, leave_region, reduce_from


@dataclass(frozen=True)
class Shard:
    """A parameter that holds slice `rank` of `size` equal slices of a full tensor along `dim`."""

    dim: int
    rank: int
    size: int
    full_shape: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.rank * self.full_shape[self.dim] // self.size

    @property
    def length(self) -> int:
        return self.full_shape[self.dim] // self.size

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        return full.narrow(self.dim, self.start, self.length)


def shard_parameter(param: nn.Parameter, dim: int, comm: TPComm, what: str) -> tuple[nn.Parameter, Shard]:
    """A new parameter holding this rank's slice of `param` (copied: the full one can go), and its Shard."""
    full = tuple(param.shape)
    if full[dim] % comm.size:
        raise TensorParallelError(f"{what}: dimension {dim} ({full[dim]}) does not divide over parallel.tp "
                                  f"{comm.size}")
    shard = Shard(dim, comm.rank, comm.size, full)
    with torch.no_grad():
        local = shard.take(param.detach())
        local = local.clone() if not local.is_meta else torch.empty(local.shape, dtype=local.dtype, device="meta")
    return nn.Parameter(local, requires_grad=param.requires_grad), shard


def shared_shard(shared: dict, param: nn.Parameter, dim: int, comm: TPComm, what: str) -> tuple[nn.Parameter, Shard]:
    """`param`'s shard along `dim`, made once per parameter (`shared`: id -> shard, across the plan, so a tied
    weight split by two layers stays one parameter)."""
    if id(param) not in shared:
        shared[id(param)] = shard_parameter(param, dim, comm, what)
    return shared[id(param)]


def _move_into(new: nn.Module, old: nn.Module) -> None:
    """`new` takes `old`'s hooks and training flag (it replaces `old` in its parent)."""
    new.train(old.training)
    for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_backward_hooks"):
        if hasattr(old, attr):
            getattr(new, attr).update(getattr(old, attr))


class WeightGradStash:
    """Megatron's overlap of a region's input-gradient collective with its weight gradients, for one forward of a
    module the plan marks `enter` (its input enters the region once, however many column-parallel linears read it).

    Forward: the input passes an anchor (`_Anchor`, holding the column-parallel weights as inputs) before it enters
    the region; each of those linears (`_DeferredLinear`) computes its output as F.linear does. Backward, in the
    order autograd runs it: each linear returns its input gradient and keeps (output gradient, input) here instead
    of computing its weight gradient; the region's entry starts the all-reduce (or, with sequence parallelism, the
    reduce-scatter) of the summed input gradient without waiting; the anchor, the next node back, computes every
    kept weight gradient (the same products autograd's linear makes) while that collective runs, then waits for it.
    A linear whose backward comes after the anchor's (its input did not come through the region) computes its own."""

    __slots__ = ("comm", "weights", "entries", "pending", "anchored")

    def __init__(self, comm: TPComm, weights: list[nn.Parameter]):
        self.comm = comm
        self.weights = {id(w): i for i, w in enumerate(weights)}
        self.entries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # weight index -> (grad output, input)
        self.pending = None  # the input gradient's collective in flight
        self.anchored = False  # the anchor's backward ran

    def linear(self, x: torch.Tensor, weight: nn.Parameter, bias) -> torch.Tensor:
        index = self.weights.get(id(weight))
        if index is None or not torch.is_grad_enabled() or not weight.requires_grad:
            return F.linear(x, weight, bias)
        return _DeferredLinear.apply(x, weight, bias, self, index)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The weight gradient nn.Linear's backward makes: grad_output^T @ input over every leading dimension."""
    return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stash, index):
        ctx.save_for_backward(x, weight)
        ctx.stash, ctx.index, ctx.has_bias = stash, index, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.stash.anchored:  # nothing left to overlap with: as F.linear's backward
            return grad_x, _weight_grad(grad, x), grad_b, None, None
        ctx.stash.entries[ctx.index] = (grad, x)
        return grad_x, None, grad_b, None, None


class _Anchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stash, *weights):
        ctx.stash, ctx.n = stash, len(weights)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        stash = ctx.stash
        stash.anchored = True
        grads = [None] * ctx.n
        for index, (grad_out, x) in stash.entries.items():
            grads[index] = _weight_grad(grad_out, x)
        if stash.pending is not None:  # the input gradient, reduced in place (or its reduce-scatter's output)
            stash.comm.overlapped += bool(stash.entries)  # weight gradients computed while it ran
            pending, stash.pending = stash.pending, None
            pending.wait()
        stash.entries.clear()
        return (grad, None, *grads)


ANCHORED_ENTRY = True  # Megatron's overlap (WeightGradStash); False: every tp collective blocks (tools/bench/tp)


def anchored_entry(x: torch.Tensor, comm: TPComm, weights: list[nn.Parameter]) -> tuple[torch.Tensor, object]:
    """`x` entering the region through an anchor for `weights` (see WeightGradStash); the stash the module's
    column-parallel linears use while it runs (None where nothing can overlap: tp 1, no gradients, a trace)."""
    if (comm.size == 1 or not weights or not torch.is_grad_enabled() or getattr(FAKE_TRACE, "on", False)
            or not ANCHORED_ENTRY):
        return enter_region(x, comm), None
    stash = WeightGradStash(comm, weights)
    return enter_region(_Anchor.apply(x, stash, *weights), comm, stash), stash


class ColumnParallelLinear(nn.Linear):
    """Output features split over tp. `vocab_output`: the model's output head over a vocabulary, whose logits
    stay sharded (`VocabShardedLogits`) for the vocabulary-parallel cross-entropy."""

    def __init__(self, *args, **kwargs):
        raise TypeError("build one with ColumnParallelLinear.from_linear(linear, comm, shared)")

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: TPComm, shared: dict, name: str,
                    vocab_output: bool = False) -> "ColumnParallelLinear":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features // comm.size
        self.comm, self.vocab_output = comm, vocab_output
        self.full_out_features = linear.out_features
        self.tp_shards = {}
        for key in ("weight", "bias"):
            param = getattr(linear, key)
            if param is None:
                self.register_parameter(key, None)
                continue
            local, shard = shared_shard(shared, param, 0, comm, f"{name}.{key} (out_features)")
            setattr(self, key, local)
            self.tp_shards[key] = shard
        _move_into(self, linear)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash = self.comm.stashes[-1] if getattr(self.comm, "stashes", None) else None
        y = stash.linear(x, self.weight, self.bias) if stash is not None else F.linear(x, self.weight, self.bias)
        if self.vocab_output and self.comm.size > 1:
            return VocabShardedLogits.wrap(y, self.comm, self.tp_shards["weight"].start, self.full_out_features)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.comm.size} (column)"


class RowParallelLinear(nn.Linear):
    """Input features split over tp; the output is the sum over ranks (leaves the region), plus the whole bias."""

    def __init__(self, *args, **kwargs):
        raise TypeError("build one with RowParallelLinear.from_linear(linear, comm, shared)")

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: TPComm, shared: dict, name: str) -> "RowParallelLinear":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features // comm.size, linear.out_features
        self.comm = comm
        self.tp_shards = {}
        weight = linear.weight
        local, shard = shared_shard(shared, weight, 1, comm, f"{name}.weight (in_features)")
        self.weight = local
        self.tp_shards["weight"] = shard
        self.bias = linear.bias  # whole on every rank (its gradient is the same everywhere)
        _move_into(self, linear)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(F.linear(x, self.weight), self.comm)
        if self.bias is None:
            return y
        # with sequence parallelism the output is this rank's sequence shard: the bias's gradient is a partial sum
        return y + (copy_to(self.bias, self.comm) if self.comm.sequence_parallel else self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.comm.size} (row)"


class VocabParallelEmbedding(nn.Embedding):
    """The vocabulary split over tp: rank r holds rows [r*V/tp, (r+1)*V/tp)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("build one with VocabParallelEmbedding.from_embedding(embedding, comm, shared)")

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, comm: TPComm, shared: dict, name: str,
                       whole: bool = False) -> "VocabParallelEmbedding":
        """`whole`: the output stays whole on every rank (all-reduced) even with sequence parallelism."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            raise TensorParallelError(f"{name}: a vocabulary-parallel embedding with max_norm, sparse gradients or "
                                      f"scale_grad_by_freq is not supported")
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = emb.padding_idx, None, emb.norm_type
        self.scale_grad_by_freq, self.sparse = emb.scale_grad_by_freq, False
        self.comm, self.whole = comm, whole
        local, shard = shared_shard(shared, emb.weight, 0, comm, f"{name}.weight (vocabulary)")
        self.weight = local
        self.tp_shards = {"weight": shard}
        self.vocab_start, self.vocab_end = shard.start, shard.start + shard.length
        _move_into(self, emb)
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        out = F.embedding(local, self.weight, pad, None, self.norm_type, self.scale_grad_by_freq, False)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from(out, self.comm) if self.whole else leave_region(out, self.comm)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp={self.comm.size} (vocabulary rows {self.vocab_start}:{self.vocab_end})"


# ---------------------------------------------------------------------------------------------------- the loss
_PASS_THROUGH = {"float", "double", "half", "bfloat16", "to", "type", "contiguous", "clone", "detach", "size", "dim",
                 "__get__", "requires_grad_", "retain_grad", "__repr__", "__format__", "numel", "is_contiguous",
                 "stride", "element_size", "data_ptr", "backward"}
_RESHAPES = {"view", "reshape"}


class VocabShardedLogits(torch.Tensor):
    """Logits of this rank's share of the vocabulary (columns vocab_start .. vocab_start + local size of
    `full_vocab`), as a column-parallel output head leaves them. Casts, reshapes (a last dimension given as the full
    vocabulary means this rank's share) and `F.cross_entropy` work: the loss is the vocabulary-parallel
    cross-entropy, equal on every tp rank. Anything else would compute on 1/tp of the vocabulary and raises a
    TensorParallelError; `gather_logits(logits)` gives the whole logits (tp times the memory)."""

    @staticmethod
    def wrap(local: torch.Tensor, comm: TPComm, vocab_start: int, full_vocab: int) -> "VocabShardedLogits":
        if getattr(FAKE_TRACE, "on", False):  # a fake tensor (the activation trace's) keeps its own class
            out = _fake_sharded(local)
        else:
            out = local.as_subclass(VocabShardedLogits)
        out._tp = (comm, vocab_start, full_vocab)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sharded = next(a for a in list(args) + list(kwargs.values()) if _is_sharded(a))
        comm, start, full_vocab = sharded._tp
        name = getattr(func, "__name__", str(func))
        if func is F.cross_entropy:
            return _cross_entropy(comm, start, *args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            local, rows = sharded.shape[-1], sharded.numel() // max(1, sharded.shape[-1])
        if name in _RESHAPES:  # a last dimension of the full vocabulary means this rank's share of it
            shape = args[1:]
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            if shape and shape[-1] == full_vocab:
                shape = tuple(shape[:-1]) + (local,)
            args = (args[0], *shape)
        if name in _RESHAPES or name in _PASS_THROUGH:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
                if not isinstance(out, torch.Tensor):
                    return out
                keeps = (out.dim() > 0 and out.shape[-1] == local and out.dtype.is_floating_point
                         and out.numel() == rows * local)
            if keeps:
                return VocabShardedLogits.wrap(_plain(out), comm, start, full_vocab)
        raise TensorParallelError(
            f"tensor parallelism: {name} on logits sharded over the vocabulary would compute on this rank's "
            f"{local} of {full_vocab} columns only; compute the loss with F.cross_entropy, or take "
            f"angel_ptm.parallel.tensor.gather_logits(logits) first")


_FAKE_CLASSES: dict = {}  # a fake tensor class -> its vocabulary-sharded subclass


def _fake_sharded(local: torch.Tensor) -> torch.Tensor:
    """A fake tensor as vocabulary-sharded logits: the same object, its class a subclass of its own with
    VocabShardedLogits' __torch_function__ (a fake tensor's state lives on the object, which `as_subclass` would
    leave behind), so a traced forward computes the vocabulary-parallel loss on one rank's share."""
    cls = type(local)
    if cls not in _FAKE_CLASSES:
        _FAKE_CLASSES[cls] = type(f"VocabSharded{cls.__name__}", (cls,),
                                  {"__torch_function__": VocabShardedLogits.__dict__["__torch_function__"]})
    local.__class__ = _FAKE_CLASSES[cls]
    return local


def _is_sharded(value) -> bool:
    return isinstance(value, VocabShardedLogits) or type(value) in _FAKE_CLASSES.values()


def _plain(logits: torch.Tensor) -> torch.Tensor:
    """The local logits as a plain tensor (a fake one in a trace: a view, no new storage)."""
    if type(logits) in _FAKE_CLASSES.values():
        with torch._C.DisableTorchFunctionSubclass():
            return logits.view_as(logits)
    return logits.as_subclass(torch.Tensor)


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """The whole logits from vocabulary-sharded ones (an all-gather over tp; the gradient flows back to the
    shards); any other tensor as it is."""
    if not _is_sharded(logits):
        return logits
    comm = logits._tp[0]
    local = _plain(logits)
    return _GatherVocab.apply(local, comm)


class _GatherVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather(x, -1, "gather logits")

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.size, dim=-1)[ctx.comm.rank].contiguous(), None


def _cross_entropy(comm: TPComm, vocab_start: int, logits, target, weight=None, size_average=None,
                   ignore_index: int = -100, reduce=None, reduction: str = "mean", label_smoothing: float = 0.0):
    """F.cross_entropy over vocabulary-sharded logits [N, V/tp] and class indices [N] (ignore_index, reductions
    none / sum / mean as torch's): equal on every tp rank."""
    if weight is not None or size_average is not None or reduce is not None or label_smoothing:
        raise TensorParallelError("tensor parallelism: the vocabulary-parallel cross-entropy takes no class weights, "
                                  "size_average/reduce or label_smoothing")
    if target.is_floating_point():
        raise TensorParallelError("tensor parallelism: the vocabulary-parallel cross-entropy takes class indices, "
                                  "not probabilities")
    local = _plain(logits)
    if local.dim() != 2:
        raise TensorParallelError(f"tensor parallelism: cross_entropy over sharded logits of shape "
                                  f"{tuple(local.shape)}: flatten them to [tokens, vocabulary] first")
    losses = _VocabParallelCrossEntropy.apply(local, target, comm, vocab_start)
    keep = target != ignore_index
    losses = losses * keep
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / keep.sum()
    raise TensorParallelError(f"tensor parallelism: cross_entropy reduction {reduction!r}: expected none, sum or mean")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses from vocabulary-sharded logits [N, V/tp]: log(sum over tp of exp(x - max)) minus the
    target's shifted logit (on the rank whose share holds it, summed over tp). Saves only the local softmax (as
    Megatron's does), so a rank keeps V/tp floats per token; the gradient is softmax minus the target's one-hot."""

    @staticmethod
    def forward(ctx, logits, target, comm, vocab_start):
        n_local = logits.shape[-1]
        x = logits.float()
        peak = comm.all_reduce_max(x.max(dim=-1).values.clone(), "cross_entropy max")
        shifted = x - peak.unsqueeze(-1)
        index = target - vocab_start
        mine = (index >= 0) & (index < n_local)
        index = index.clamp(0, n_local - 1)
        rows = torch.arange(shifted.shape[0], device=shifted.device)
        picked = comm.all_reduce(shifted[rows, index] * mine, "cross_entropy target logit")
        softmax = shifted.exp_()
        sum_exp = comm.all_reduce(softmax.sum(dim=-1), "cross_entropy sum")
        softmax.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine)
        ctx.logits_dtype = logits.dtype
        return torch.log(sum_exp) - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine = ctx.saved_tensors
        out = softmax.clone()
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, index] -= mine.to(out.dtype)
        out.mul_(grad.unsqueeze(-1))
        return out.to(ctx.logits_dtype), None, None, None
