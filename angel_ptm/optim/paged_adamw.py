"""AdamW over pages: page i of param, grad, exp_avg and exp_avg_sq are updated together, one page group at a time.

The arithmetic is torch.optim.AdamW's single-tensor path, op for op, so results match it; padding between tensors
is zero in every kind and stays zero. Gradients must be settled first (ParamBinder.settle_grads: which tensors got
none; their regions are skipped, and a page none of whose tensors got one is left alone); the step
leaves them as they are: the binder overwrites them with the next step's first gradient. The pages are acquired on
`update_tier` (the device when a group fits there, else the host), so an update needs four slots (one group), or
a few groups' worth where the tier has room to spare (`batches`).

Mixed precision (a "master" kind in `pages`): the update reads the fp32 master, the bf16/fp16 gradient and the fp32
moments, and writes master, moments and the bf16/fp16 parameter copy in one pass (five slots per update).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from angel_ptm.memory import Page, PageLayout, Tier
from angel_ptm.optim.fused_adam import fused_adamw_trusted_


class PagedAdamW:
    def __init__(self, access, layout: PageLayout, pages: dict[str, list[Page]], lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, update_tier: Tier,
                 fused: bool = True, write_params: bool = True, updates: Callable[[int], bool] | None = None,
                 no_decay: frozenset[str] = frozenset()):
        # `access`: acquire/release/discard of pages, the scheduler's (which records the step's accesses) or a
        # PageManager's
        self.access, self.layout, self.pages = access, layout, pages
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.no_decay = frozenset(no_decay)  # tensor names updated with weight decay 0 (optimizer.no_decay)
        self.step_lr = lr  # the learning rate of the open step (taken when it opens: a delayed update keeps its own)
        self.update_tier = update_tier
        self.step_count = 0
        self.page_dtypes = layout.page_dtypes
        self._scratch_buffers: dict = {}
        # (offset, numel) of every tensor segment on each page, computed once: the norm runs every step.
        self._slots_on_page: list[list[tuple[str, int, int]]] = [[] for _ in range(layout.n_pages)]
        for slot in layout.slots:
            for seg in slot.segments:
                self._slots_on_page[seg.page].append((slot.name, seg.offset, seg.numel))
        self.slot_names_on_page = [[name for name, _, _ in slots] for slots in self._slots_on_page]
        # The page groups this rank updates (data parallelism: ZeRO's owned groups; all of them on one rank).
        self.local_indices = [i for i in range(layout.trainable_pages) if updates is None or updates(i)]
        self._in_step = False
        self._updated: set[int] = set()
        self._stepped: set[str] = set()
        self.failed_group: int | None = None  # a page group whose update raised part-way (the step is torn)
        self.slot_steps = {slot.name: 0 for slot in layout.slots}  # steps each tensor took (torch's state["step"])
        self._trainable = {slot.name for slot in layout.slots if not layout.frozen(slot)}
        self._step_without: frozenset[str] | None = None
        self.grad_scale = 1.0  # applied to every gradient this step (clipping), reset when the step closes
        self.use_fused = fused  # CPU-resident groups: the fused native Adam (angel_ptm.optim.fused_adam)
        self.mixed = "master" in pages  # fp32 master pages next to the param pages the model computes with
        # write_params False (optimizer.staleness 1): the update writes only the master; the engine copies it into
        # the param pages later, once the step that still computes with the old parameters is done with them.
        if not write_params and not self.mixed:
            raise ValueError("write_params=False needs master pages: the parameters are the master otherwise")
        self.write_params = write_params
        self.group_kinds = (("param",) if write_params else ()) + ("grad", "exp_avg", "exp_avg_sq") + \
            (("master",) if self.mixed else ())
        # `batches`: up to batch_groups page groups of one unit (batch_key[index]) updated by one access, fewer
        # accesses to schedule; 1 unless the update tier has room to spare (memory.placement.update_batch_groups)
        self.batch_groups, self.batch_key = 1, [None] * layout.n_pages

    def _scratch(self, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        key = (like.device, like.dtype, slot)
        buffer = self._scratch_buffers.get(key)
        if buffer is None or buffer.numel() < like.numel():
            buffer = self._scratch_buffers[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buffer[: like.numel()]

    def grad_squares(self, without_grad: frozenset[str] | set[str] = frozenset()) -> dict[int, float]:
        """Per updated page, the sum of squares of its gradients (per tensor segment, as clip_grad_norm_ takes norms
        per tensor); tensors in `without_grad` have none (torch's .grad None), and a page only they use is not read."""
        per_page: list[tuple[int, torch.Tensor]] = []
        for index in self.local_indices:
            segments = [(offset, numel) for name, offset, numel in self._slots_on_page[index]
                        if name not in without_grad]
            if not segments:
                continue
            grad_page = self.pages["grad"][index]
            self.access.acquire([grad_page], self.update_tier, label="opt:norm")
            view = grad_page.view(self.page_dtypes[index])
            wide = torch.float32 if view.dtype.itemsize < 4 else None  # bf16/fp16 gradients: norms in fp32
            norms = torch.stack([torch.linalg.vector_norm(view[offset : offset + numel], 2.0, dtype=wide)
                                 for offset, numel in segments])
            per_page.append((index, norms.to(torch.float64).square().sum()))
            self.access.release([grad_page])
        if not per_page:
            return {}
        values = torch.stack([value.cpu() for _, value in per_page]).tolist()  # one sync for every page
        return {index: value for (index, _), value in zip(per_page, values)}

    def grad_norm(self, without_grad: frozenset[str] | set[str] = frozenset(),
                  combine: Callable[[dict[int, float]], float] | None = None) -> float:
        """The global L2 norm of all gradients: pages' sums of squares added exactly (math.fsum), so the total does
        not depend on the order, nor on which data-parallel rank summed which page (`combine`: the ranks' sum)."""
        squares = self.grad_squares(without_grad)
        if combine is not None:
            return combine(squares)
        return math.sqrt(math.fsum(squares.values()))

    def scale_grads(self, factor: float) -> None:
        """Scale this step's gradients by `factor` (gradient clipping). Folded into the update, which reads the
        gradient anyway: no extra pass over the gradient pages."""
        self.grad_scale *= factor

    def step(self, order: list[int] | None = None, without_grad: frozenset[str] | set[str] = frozenset()) -> None:
        """Finish the optimizer step: update every page group not updated yet this step, then close the step.

        `order`: page indices in the order to update them (the scheduler's: the order gradients became final),
        each index once; default: layout order. `without_grad`: tensors that got no gradient this step (a branch
        not taken, an expert not routed): as torch.optim.AdamW does for a parameter whose .grad is None, they are
        left alone, and each tensor counts its own steps for the bias corrections."""
        indices = self.local_indices if order is None else order  # frozen tensors' pages: no gradient, no update
        if order is not None and sorted(order) != self.local_indices:
            raise ValueError(f"order must list each of the {len(self.local_indices)} page groups this rank updates once")
        self.begin_step(without_grad)
        for batch in self.batches([index for index in indices if index not in self._updated]):
            self.update_groups(batch, without_grad)
        self.end_step()

    def batches(self, indices: list[int]) -> list[list[int]]:
        """`indices` in runs updated by one access each: consecutive ones of the same unit (`batch_key`), at most
        `batch_groups` long (a run never mixes units: an expert not routed leaves the others' accesses alike)."""
        runs: list[list[int]] = []
        for index in indices:
            run = runs[-1] if runs else None
            if run is not None and len(run) < self.batch_groups and self.batch_key[index] == self.batch_key[run[-1]]:
                run.append(index)
            else:
                runs.append([index])
        return runs

    def end_step(self) -> None:
        """Close the open step (every page group of it updated, or deliberately left as it is). Tensors that had a
        gradient but live on page groups another rank updates (data parallelism) count their step here, so every
        rank keeps the same per-tensor step counts (the optimizer state dict's `step`)."""
        if self._in_step and self._step_without is not None:
            for name in self.slot_steps:
                if name not in self._step_without and name not in self._stepped and name in self._trainable:
                    self._stepped.add(name)
                    self.slot_steps[name] += 1
        self._in_step = False
        self.grad_scale = 1.0

    def skip_step(self) -> None:
        """Close this step without updating anything (fp16 gradients overflowed): parameters, master weights,
        moments and step counts stay as they are."""
        if self.updated_this_step:
            raise ValueError(f"optimizer step {self.step_count}: {len(self._updated)} page groups were already "
                             "updated; the step cannot be skipped")
        if self._in_step:  # opened but nothing updated: give the step number back
            self._in_step = False
            self.step_count -= 1
        self.grad_scale = 1.0

    def begin_step(self, without_grad: frozenset[str] | set[str] | None = None) -> None:
        """Open an optimizer step (idempotent until `step` closes it); groups may then be updated one by one.
        `without_grad`, when known: the tensors without a gradient this step (the others count a step each when
        it closes, wherever they are updated)."""
        if self._in_step:  # opened by an update during backward: the set is known now
            if self._step_without is None and without_grad is not None:
                self._step_without = frozenset(without_grad)
        else:
            self._step_without = None if without_grad is None else frozenset(without_grad)
            self._in_step = True
            self.step_count += 1
            self.step_lr = self.lr
            self._updated: set[int] = set()
            self._stepped: set[str] = set()

    @property
    def updated_this_step(self) -> int:
        return len(self._updated) if self._in_step else 0

    def update_group(self, index: int, without_grad: frozenset[str] | set[str] = frozenset()) -> None:
        """Update page group `index` (param, grad, exp_avg, exp_avg_sq of page `index`) for the open step. The
        scheduler calls this as soon as every gradient on the page is final, so updates overlap backward."""
        self.update_groups([index], without_grad)

    def update_groups(self, indices: list[int], without_grad: frozenset[str] | set[str] = frozenset()) -> None:
        """Update page groups `indices` with one access of all their pages (`batches`: one unit's, a few)."""
        self.begin_step()
        for index in indices:
            if index in self._updated:
                raise ValueError(f"page group {index} was already updated in optimizer step {self.step_count}")
        self._updated.update(indices)
        try:
            self._update_groups(indices, without_grad)
        except BaseException:
            self.failed_group = indices[0]  # step counts, moments and weights of these groups may be half-written
            raise

    def _update_groups(self, indices: list[int], without_grad: frozenset[str] | set[str]) -> None:
        # no gradient reached a page: nothing to update, and its grad page stays dead
        indices = [i for i in indices if not all(name in without_grad for name, _, _ in self._slots_on_page[i])]
        if not indices:
            return
        for index in indices:
            for name, _, _ in self._slots_on_page[index]:  # a tensor spanning pages counts its step once
                if name not in without_grad and name not in self._stepped:
                    self._stepped.add(name)
                    self.slot_steps[name] += 1
        groups = [{kind: self.pages[kind][index] for kind in self.group_kinds} for index in indices]
        self.access.acquire([page for group in groups for page in group.values()], self.update_tier,
                            label="opt:update")
        for index, group in zip(indices, groups):
            self._update_pages(index, group, without_grad)
        self.access.release([page for group in groups for kind, page in group.items() if kind != "grad"],
                            dirty=True)
        grads = [group["grad"] for group in groups]
        self.access.release(grads)
        self.access.discard(grads)  # the gradients are applied: their pages are dead until the next backward

    def _update_pages(self, index: int, group: dict, without_grad: frozenset[str] | set[str]) -> None:
        slots = self._slots_on_page[index]
        dtype = self.page_dtypes[index]
        if dtype.is_floating_point:
            page_numel, state_dtype = self.layout.page_numel(index), self.layout.state_dtype(index)
            grad = group["grad"].view(dtype)[:page_numel]  # bf16/fp16 pages: their first half
            exp_avg, exp_avg_sq = group["exp_avg"].view(state_dtype), group["exp_avg_sq"].view(state_dtype)
            param = group["param"].view(dtype)[:page_numel] if self.write_params else None
            master, copy = (group["master"].view(state_dtype), param) if self.mixed else (param, None)
            # (step count, weight decay) of each tensor on the page: one pair for all of them, the page at once
            terms = {(self.slot_steps[name], self._decay(name)) for name, _, _ in slots}
            if len(terms) == 1 and not any(name in without_grad for name, _, _ in slots):
                step, decay = terms.pop()
                self._update(master, grad, exp_avg, exp_avg_sq, step, copy, decay)
            else:
                for name, offset, numel in slots:
                    if name not in without_grad:
                        part = slice(offset, offset + numel)
                        self._update(master[part], grad[part], exp_avg[part], exp_avg_sq[part],
                                     self.slot_steps[name], None if copy is None else copy[part], self._decay(name))

    def _decay(self, name: str) -> float:
        """Tensor `name`'s weight decay: 0 for optimizer.no_decay's, the group's otherwise."""
        return 0.0 if name in self.no_decay else self.weight_decay

    def _update(self, param, grad, exp_avg, exp_avg_sq, step: int, copy: torch.Tensor | None,
                weight_decay: float) -> None:
        """One AdamW step of `param` (fp32: the master weights under mixed precision); `copy`: a bf16/fp16 tensor
        that receives the updated values (the compute parameters)."""
        beta1, beta2 = self.betas
        if self.use_fused and param.device.type == "cpu" and param.dtype == torch.float32:
            # One pass over master, gradient and both moments in the native kernel (clip coefficient and loss-scale
            # unscaling folded in), writing the compute copy in the same pass.
            fused_adamw_trusted_(param, grad, exp_avg, exp_avg_sq, lr=self.step_lr, beta1=beta1, beta2=beta2,
                                 eps=self.eps, weight_decay=weight_decay, step=step, grad_scale=self.grad_scale,
                                 out=copy)
            return
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        step_size = self.step_lr / bias_correction1
        if grad.dtype != param.dtype:  # a bf16/fp16 gradient of an fp32 master: widened first, then scaled
            grad = self._scratch(param, slot=1).copy_(grad)
            if self.grad_scale != 1.0:
                grad.mul_(self.grad_scale)
        elif self.grad_scale != 1.0:  # as clip_grad_norm_ does: the gradient times the coefficient, then AdamW
            grad = torch.mul(grad, self.grad_scale, out=self._scratch(grad, slot=1))
        if weight_decay != 0:
            param.mul_(1 - self.step_lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = self._scratch(param)  # reused: a fresh page-sized temporary costs page faults every step
        torch.sqrt(exp_avg_sq, out=denom).div_(bias_correction2_sqrt).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        if copy is not None:
            copy.copy_(param)
