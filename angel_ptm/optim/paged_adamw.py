"""AdamW over pages: page i of param, grad, exp_avg and exp_avg_sq are updated together, one page group at a time.

The arithmetic is torch.optim.AdamW's single-tensor path, op for op, so results match it; padding between tensors
is zero in every kind and stays zero. Gradients must be settled first (ParamBinder.settle_grads); the step
leaves them as they are: the binder overwrites them with the next step's first gradient. The pages are acquired on `update_tier` (the device when four pages fit there,
else the host), so an update never needs more than four slots.
"""

from __future__ import annotations


import torch

from angel_ptm.memory import Page, PageLayout, PageManager, Tier
from angel_ptm.optim.fused_adam import fused_adamw_


class PagedAdamW:
    def __init__(self, manager: PageManager, layout: PageLayout, pages: dict[str, list[Page]], lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, update_tier: Tier,
                 fused: bool = True):
        self.manager, self.layout, self.pages = manager, layout, pages
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.update_tier = update_tier
        self.step_count = 0
        self.page_dtypes = layout.page_dtypes
        self._scratch_buffers: dict = {}
        # (offset, numel) of every tensor segment on each page, computed once: the norm runs every step.
        self._segments_on_page: list[list[tuple[int, int]]] = [[] for _ in range(layout.n_pages)]
        self._slots_on_page: list[list[tuple[str, int, int]]] = [[] for _ in range(layout.n_pages)]
        for slot in layout.slots:
            for seg in slot.segments:
                self._segments_on_page[seg.page].append((seg.offset, seg.numel))
                self._slots_on_page[seg.page].append((slot.name, seg.offset, seg.numel))
        self.slot_names_on_page = [[name for name, _, _ in slots] for slots in self._slots_on_page]
        self._in_step = False
        self._updated: set[int] = set()
        self._stepped: set[str] = set()
        self.slot_steps = {slot.name: 0 for slot in layout.slots}
        self.grad_scale = 1.0  # applied to every gradient this step (clipping), reset when the step closes
        self.use_fused = fused  # CPU-resident groups: the fused native Adam (angel_ptm.optim.fused_adam)  # steps each tensor took (torch's state["step"])

    def _scratch(self, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        key = (like.device, like.dtype, slot)
        buffer = self._scratch_buffers.get(key)
        if buffer is None or buffer.numel() < like.numel():
            buffer = self._scratch_buffers[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return buffer[: like.numel()]

    def grad_norm(self) -> float:
        """The global L2 norm of all gradients, computed per tensor then combined (as clip_grad_norm_ does)."""
        norms = []
        for index, grad_page in enumerate(self.pages["grad"]):
            self.manager.acquire([grad_page], self.update_tier, label="opt:norm")
            view = grad_page.view(self.page_dtypes[index])
            for offset, numel in self._segments_on_page[index]:
                norms.append(torch.linalg.vector_norm(view[offset : offset + numel], 2.0))
            self.manager.release([grad_page])
        if not norms:
            return 0.0
        # A tensor that spans pages contributes one norm per segment; sqrt(sum of squares) is the same total.
        return float(torch.linalg.vector_norm(torch.stack([n.to(torch.float32).cpu() for n in norms]), 2.0))

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
        indices = range(self.layout.n_pages) if order is None else order
        if order is not None and sorted(order) != list(range(self.layout.n_pages)):
            raise ValueError(f"order must list each of the {self.layout.n_pages} page indices once")
        self.begin_step()
        for index in indices:
            if index not in self._updated:
                self.update_group(index, without_grad)
        self._in_step = False
        self.grad_scale = 1.0

    def begin_step(self) -> None:
        """Open an optimizer step (idempotent until `step` closes it); groups may then be updated one by one."""
        if not self._in_step:
            self._in_step = True
            self.step_count += 1
            self._updated: set[int] = set()
            self._stepped: set[str] = set()

    @property
    def updated_this_step(self) -> int:
        return len(self._updated) if self._in_step else 0

    def update_group(self, index: int, without_grad: frozenset[str] | set[str] = frozenset()) -> None:
        """Update page group `index` (param, grad, exp_avg, exp_avg_sq of page `index`) for the open step. The
        scheduler calls this as soon as every gradient on the page is final, so updates overlap backward."""
        self.begin_step()
        if index in self._updated:
            raise ValueError(f"page group {index} was already updated in optimizer step {self.step_count}")
        self._updated.add(index)
        slots = self._slots_on_page[index]
        for name, _, _ in slots:  # a tensor spanning pages counts its step once
            if name not in without_grad and name not in self._stepped:
                self._stepped.add(name)
                self.slot_steps[name] += 1
        group = [self.pages[kind][index] for kind in ("param", "grad", "exp_avg", "exp_avg_sq")]
        self.manager.acquire(group, self.update_tier, label="opt:update")
        dtype = self.page_dtypes[index]
        if dtype.is_floating_point:
            param, grad, exp_avg, exp_avg_sq = (p.view(dtype) for p in group)
            steps = {self.slot_steps[name] for name, _, _ in slots}
            if len(steps) == 1 and not any(name in without_grad for name, _, _ in slots):
                self._update(param, grad, exp_avg, exp_avg_sq, steps.pop())  # the whole page at once
            else:
                for name, offset, numel in slots:
                    if name not in without_grad:
                        part = slice(offset, offset + numel)
                        self._update(param[part], grad[part], exp_avg[part], exp_avg_sq[part],
                                     self.slot_steps[name])
        self.manager.release(group[:1] + group[2:], dirty=True)
        self.manager.release(group[1:2])
        self.manager.discard(group[1:2])  # the gradient is applied: its page is dead until the next backward

    def _update(self, param, grad, exp_avg, exp_avg_sq, step: int) -> None:
        beta1, beta2 = self.betas
        if self.use_fused and param.device.type == "cpu" and param.dtype == torch.float32:
            # One pass over master, gradient and both moments in the native kernel (clip coefficient folded in).
            fused_adamw_(param, grad, exp_avg, exp_avg_sq, lr=self.lr, beta1=beta1, beta2=beta2, eps=self.eps,
                         weight_decay=self.weight_decay, step=step, grad_scale=self.grad_scale)
            return
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        step_size = self.lr / bias_correction1
        if self.grad_scale != 1.0:  # as clip_grad_norm_ does: the gradient times the coefficient, then AdamW
            grad = torch.mul(grad, self.grad_scale, out=self._scratch(grad, slot=1))
        if self.weight_decay != 0:
            param.mul_(1 - self.lr * self.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = self._scratch(param)  # reused: a fresh page-sized temporary costs page faults every step
        torch.sqrt(exp_avg_sq, out=denom).div_(bias_correction2_sqrt).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
