"""What the engine refuses in a model at `initialize`, each a ConfigValueError naming the parameter or module and
what to do instead: anything but an nn.Module, a model an engine already manages, modules that give sparse gradients, complex parameters,
a model compiled as a whole, and embeddings that rewrite their weight in forward (max_norm)."""

from __future__ import annotations

from torch import nn

from angel_ptm.errors import ConfigValueError


def refuse_unsupported(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigValueError(f"initialize: the model must be a torch.nn.Module (its parameters are paged), got a "
                               f"{type(model).__name__}")
    refuse_managed(model)
    refuse_lazy(model)
    refuse_sparse_gradients(model)
    refuse_complex(model)
    refuse_compiled(model)
    refuse_renormed_embeddings(model)


def refuse_managed(model: nn.Module) -> None:
    """A ConfigValueError when an engine already manages `model` (its parameters carry that engine's labels until
    it closes): two engines would page the same parameters."""
    for name, param in model.named_parameters():
        if "_angel_name" in param.__dict__:
            raise ConfigValueError(f"initialize: parameter '{name}' is managed by an engine already (one not "
                                   f"closed, or one that failed and left it without values): close that engine "
                                   f"first, or build a new model")


def refuse_lazy(model: nn.Module) -> None:
    """A ConfigValueError naming the first parameter a lazy module (nn.LazyLinear, ...) has not materialized yet:
    its shape, so its pages, are known only after a forward."""
    for name, param in model.named_parameters():
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise ConfigValueError(f"initialize: parameter '{name}' is not materialized yet (a lazy module): run "
                                   f"one forward of the model on an example batch before initialize")


def refuse_sparse_gradients(model: nn.Module) -> None:
    """A ConfigValueError naming the first module that would give its parameters sparse gradients (nn.Embedding or
    nn.EmbeddingBag with sparse=True): gradient pages are dense, and AdamW (torch's too) takes dense gradients."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ConfigValueError(f"{name or '<root>'}: {type(module).__name__}(sparse=True) gives sparse gradients, "
                                   f"which paged AdamW does not take (nor does torch.optim.AdamW): build it with "
                                   f"sparse=False")


def refuse_complex(model: nn.Module) -> None:
    """Pages hold real numbers: paged AdamW updates floating-point tensors (a complex one would be left as it was)."""
    for name, param in model.named_parameters():
        if param.is_complex():
            raise ConfigValueError(f"parameter '{name}' is complex ({param.dtype}): the engine's pages and AdamW take "
                                   f"real floating-point tensors; keep it as a real tensor of twice the size "
                                   f"(torch.view_as_real) and view it as complex in forward (torch.view_as_complex)")


def refuse_compiled(model: nn.Module) -> None:
    """torch.compile of the whole model traces through the engine's unit hooks, which bind parameters to pages
    (Dynamo cannot follow them): compile the modules inside the units instead."""
    compiled = type(model).__name__ == "OptimizedModule" or getattr(model, "_compiled_call_impl", None) is not None
    if compiled:
        raise ConfigValueError("initialize: the model is compiled as a whole (torch.compile(model) or "
                               "model.compile()): the engine binds each unit's parameters to pages in hooks that "
                               "Dynamo cannot trace; initialize the plain model and compile modules inside its "
                               "units (block.mlp.compile()), which works")


def refuse_renormed_embeddings(model: nn.Module) -> None:
    """nn.Embedding / nn.EmbeddingBag with max_norm renormalize the looked-up rows of their weight in place during
    forward: a write to a parameter outside the optimizer, which pages do not keep (a weight spanning pages is bound
    to a gathered copy, and forward reads pages it does not write back)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise ConfigValueError(f"{name or '<root>'}: {type(module).__name__}(max_norm={module.max_norm:g}) "
                                   f"rewrites its weight in place during forward, which the engine's pages do not "
                                   f"keep: build it without max_norm (or renormalize the looked-up rows out of place "
                                   f"in your forward)")


def refuse_changed_parameters(model: nn.Module, slots: dict, frozen) -> None:
    """A ConfigValueError naming the first parameter the model gained, replaced or unfroze since initialize:
    the engine made pages for the parameters it was given, gradient and optimizer pages for those that required
    grad then. (Such a parameter trained silently never, or made close() fail part-way with the trained weights
    lost.) `slots`: id(parameter) -> its slot; `frozen(slot)`: whether it has no gradient pages."""
    for name, param in model.named_parameters():
        slot = slots.get(id(param))
        if slot is None:
            raise ConfigValueError(
                f"parameter '{name}' was added or replaced after angel_ptm.initialize (a lazy module's first "
                f"forward, an assignment): the engine pages the parameters it was given; build the model whole "
                f"first (run one forward for lazy modules), or close the engine and initialize again")
        if param.requires_grad and frozen(slot):
            raise ConfigValueError(
                f"parameter '{name}' was frozen at angel_ptm.initialize (requires_grad False) and requires grad "
                f"now: the engine made no gradient or optimizer pages for it; set requires_grad before "
                f"initialize (gradual unfreezing: close the engine and initialize again at each change)")
