"""What the binder's saved-tensor hooks keep for autograd (binding.ParamBinder._pack): a parameter saved as the
page it lives in, or the gathered copy of one spanning pages, or an activation as itself (counted). None of them
holds the engine: a graph the model keeps without a backward holds them from C++, where no collector sees a cycle."""

from __future__ import annotations

import weakref

import torch

from angel_ptm.errors import ActivationError, ParameterAccessError
from angel_ptm.memory import Page, TensorSlot


def stale_graph() -> ParameterAccessError:
    """A parameter saved (as its page) by a forward that ran before the weights changed, read by its backward."""
    return ParameterAccessError(
        "backward through a graph whose forward ran before the weights changed (engine.step(), a load or a write "
        "since): the parameters it saved hold other values now (torch refuses it too: modified by an inplace "
        "operation); run the forward again")


def modified_in_place(saved_version: int, tensor: torch.Tensor) -> ActivationError:
    """The error autograd raises without saved-tensor hooks (which turn its own check off), typed."""
    return ActivationError(
        f"a tensor the forward saved for backward (shape {tuple(tensor.shape)}, {tensor.dtype}) was modified by an "
        f"in-place operation since (version {tensor._version}, saved at {saved_version}): backward would compute "
        f"with the new values, as torch refuses; write into a copy, or run the forward again")


class PackedPageTensor:
    """A saved tensor that lives in a page: enough to rebuild the same view after the page moved."""

    __slots__ = ("_page", "offset", "size", "stride", "dtype", "generation")

    def __init__(self, page: Page, offset: int, size, stride, dtype, generation: int = 0):
        # (weakly: a graph kept without a backward would keep the page, its manager and so the engine alive)
        self._page, self.offset, self.size, self.stride, self.dtype = weakref.ref(page), offset, size, stride, dtype
        self.generation = generation  # the weights' (ParamBinder.weights_generation) when saved

    @property
    def page(self) -> Page:
        return self._page()


class PackedGathered:
    """A saved tensor that lives in the gathered copy of a parameter spanning pages: gathered again when unpacked."""

    __slots__ = ("slot", "offset", "size", "stride", "generation")

    def __init__(self, slot: TensorSlot, offset: int, size, stride, generation: int = 0):
        self.slot, self.offset, self.size, self.stride, self.generation = slot, offset, size, stride, generation


class Saved:
    """A saved activation (not in a page), counted while autograd holds it: its storage once, however many
    tensors autograd saves that view it (a layer's input saved by each of three projections, a transposed view)."""

    __slots__ = ("tensor", "storage", "version")

    def __init__(self, tensor: torch.Tensor):
        # detached: a node's saved output holding its own grad_fn is a cycle in C++ that no collector sees, which a
        # node backward never runs (a forward without backward, a branch off the loss) would keep, graph and engine
        self.tensor, self.storage = tensor.detach(), tensor.untyped_storage().data_ptr()
        self.version = tensor._version  # (the detached tensor shares the version counter: a later in-place write
        # bumps it, and the unpack refuses it as autograd does without hooks)


class OpenGraphs:
    """The outputs of training forwards whose backward has not run yet, weakly: a graph the user still holds (a
    loss not yet backwarded) means the step is half done; one dropped unused is no step at all."""

    def __init__(self):
        self._outputs: list[weakref.ref] = []

    def add(self, output) -> None:
        if torch.is_grad_enabled():
            from torch.utils._pytree import tree_leaves

            self._outputs += [weakref.ref(t) for t in tree_leaves(output)
                              if isinstance(t, torch.Tensor) and t.requires_grad]

    def clear(self) -> None:
        self._outputs = []

    def alive(self) -> bool:
        self._outputs = [ref for ref in self._outputs if ref() is not None]
        return bool(self._outputs)
