"""Fused CPU Adam/AdamW over flat fp32 master tensors: the native kernel (angel_ptm._native) when it is built, a
pure-torch fallback otherwise.

One call updates `param`, `exp_avg` and `exp_avg_sq` in place from `grad` (fp32, bf16 or fp16) scaled by
`grad_scale` (the caller folds loss-scale unscaling and gradient clipping into it), and optionally writes the updated
params as bf16/fp16 into `out` in the same pass. The arithmetic is torch.optim.AdamW's single-tensor path (Adam's
with `adamw=False`), op for op: the fallback matches torch bit for bit; the native kernel's moments do too, and its
params are within an ulp (torch's CPU `sqrt` is MKL's, which is not correctly rounded; the kernel's is IEEE). The
native kernel splits each call over a persistent thread pool and releases the GIL; `set_threads` sizes the pool.
"""

from __future__ import annotations

import logging
import math

import torch

from angel_ptm.errors import KernelInputError

log = logging.getLogger("angel_ptm.optim")

try:
    from angel_ptm import _native

    NATIVE_IMPORT_ERROR: str | None = None
except ImportError as exc:  # the extension was not built: the fallback still works, slower
    _native = None
    NATIVE_IMPORT_ERROR = str(exc)

NATIVE_ADAM_ERROR: str | None
if _native is not None and not hasattr(_native, "adam_step"):  # an extension built before the kernel existed
    NATIVE_ADAM_ERROR = "angel_ptm._native has no adam_step (rebuild it: pip install -e . --no-build-isolation)"
elif _native is None:
    NATIVE_ADAM_ERROR = f"native extension missing ({NATIVE_IMPORT_ERROR})"
else:
    NATIVE_ADAM_ERROR = None

GRAD_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
ISAS = ("auto", "avx512", "avx2", "scalar")
BACKENDS = ("auto", "native", "torch")

_announced: set[str] = set()


def native_available() -> bool:
    return NATIVE_ADAM_ERROR is None


def _announce_fallback(reason: str) -> None:
    if reason not in _announced:
        _announced.add(reason)
        log.warning("angel-ptm Adam: using the pure-torch fallback (several times slower, extra memory): %s", reason)


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise KernelInputError(f"fused Adam backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "native" and NATIVE_ADAM_ERROR is not None:
        raise KernelInputError(f"fused Adam backend 'native' is not available: {NATIVE_ADAM_ERROR}")
    if backend == "torch":
        return "torch"
    if NATIVE_ADAM_ERROR is not None:
        _announce_fallback(NATIVE_ADAM_ERROR)
        return "torch"
    return "native"


def supported_isas() -> list[str]:
    """The native variants this CPU can run, best first (empty without the extension)."""
    if NATIVE_ADAM_ERROR is not None:
        return []
    return [isa for isa in ("avx512", "avx2", "scalar") if _native.adam_isa_supported(isa)]


def set_threads(threads: int) -> None:
    """Threads (the calling one included) that split each native call; the pool is rebuilt on the next call."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise KernelInputError(f"fused Adam threads must be an integer >= 1, got {threads!r}")
    if NATIVE_ADAM_ERROR is None:
        _native.adam_set_threads(threads)


def get_threads() -> int:
    return _native.adam_threads() if NATIVE_ADAM_ERROR is None else torch.get_num_threads()


def pool_stats() -> dict:
    """The native pool's parts posted to its workers and the parts the calling thread took back because no worker
    had started them (its other cores were busy), cumulative in this process; zeros without the extension."""
    if NATIVE_ADAM_ERROR is None:
        return dict(_native.adam_pool_stats())
    return {"parts_posted": 0, "parts_taken_back": 0}


def kernel_info() -> dict:
    """Which implementation backend="auto" uses, its instruction set and threads, and why if it is the fallback."""
    if NATIVE_ADAM_ERROR is None:
        return {"implementation": "native", "isa": _native.adam_isa(), "threads": _native.adam_threads(),
                "supported_isas": supported_isas()}
    return {"implementation": "torch", "isa": "torch", "threads": torch.get_num_threads(), "reason": NATIVE_ADAM_ERROR}


def _check_tensor(name: str, tensor, dtypes, numel: int | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise KernelInputError(f"fused Adam: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise KernelInputError(f"fused Adam: {name} must be on the CPU, got device {tensor.device}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise KernelInputError(f"fused Adam: {name} must be {allowed}, got {str(tensor.dtype).replace('torch.', '')}")
    if not tensor.is_contiguous():
        raise KernelInputError(f"fused Adam: {name} must be contiguous (shape {tuple(tensor.shape)}, "
                               f"stride {tuple(tensor.stride())})")
    if numel is not None and tensor.numel() != numel:
        raise KernelInputError(f"fused Adam: {name} has {tensor.numel()} elements, param has {numel}")


def _check_scalar(name: str, value, low: float, high: float, low_open: bool = False, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise KernelInputError(f"fused Adam: {name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise KernelInputError(f"fused Adam: {name} must be in {lo}{low}, {high}{hi}, got {value}")
    return float(value)


def _validate(param, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay, step, grad_scale, isa):
    _check_tensor("param", param, (torch.float32,), None)
    n = param.numel()
    _check_tensor("grad", grad, tuple(GRAD_DTYPES), n)
    _check_tensor("exp_avg", exp_avg, (torch.float32,), n)
    _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if out is not None:
        _check_tensor("out", out, tuple(OUT_DTYPES), n)
    if n:
        addresses = {"param": param.data_ptr(), "exp_avg": exp_avg.data_ptr(), "exp_avg_sq": exp_avg_sq.data_ptr()}
        if len(set(addresses.values())) != 3:
            raise KernelInputError("fused Adam: param, exp_avg and exp_avg_sq must be three different buffers")
    inf = float("inf")
    _check_scalar("lr", lr, 0.0, inf)
    _check_scalar("beta1", beta1, 0.0, 1.0, high_open=True)
    _check_scalar("beta2", beta2, 0.0, 1.0, high_open=True)
    _check_scalar("eps", eps, 0.0, inf)
    _check_scalar("weight_decay", weight_decay, -inf, inf)
    _check_scalar("grad_scale", grad_scale, -inf, inf)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise KernelInputError(f"fused Adam: step must be an integer >= 1 (the step being taken), got {step!r}")
    if isa not in ISAS:
        raise KernelInputError(f"fused Adam: isa must be one of {', '.join(ISAS)}, got {isa!r}")


def fused_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 grad_scale: float = 1.0, out: torch.Tensor | None = None, adamw: bool = True, isa: str = "auto",
                 backend: str = "auto") -> None:
    """One Adam(W) step in place over contiguous CPU tensors of equal numel.

    param, exp_avg, exp_avg_sq: fp32. grad: fp32, bf16 or fp16, read as `grad * grad_scale`. out: None or a bf16/fp16
    tensor that receives the updated params. step: the step being taken (1 for the first). adamw=False is Adam with
    L2 weight decay added to the gradient. isa: the native variant ("auto" picks the best this CPU has). backend:
    "auto" (native if built, else the torch fallback, announced once by a warning), "native" or "torch".
    """
    _validate(param, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay, step, grad_scale, isa)
    fused_adamw_trusted_(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, step=step, grad_scale=grad_scale, out=out, adamw=adamw, isa=isa,
                         backend=backend)


def fused_adamw_trusted_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                         grad_scale=1.0, out=None, adamw=True, isa="auto", backend="auto") -> None:
    """fused_adamw_ for inputs its caller built to the rules `_validate` checks (the paged optimizer's page views:
    fp32, contiguous, on the CPU, of equal numel, distinct buffers): the same step without the checks, which cost
    about as much as the kernel itself on a 64 KiB page (4 us of 8)."""
    if _resolve_backend(backend) == "torch":
        _torch_adam_(param, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                     adamw)
        return
    if isa != "auto" and not _native.adam_isa_supported(isa):
        raise KernelInputError(f"fused Adam: this CPU does not support isa {isa!r} (supported: "
                               f"{', '.join(supported_isas())})")
    _native.adam_step(param.data_ptr(), grad.data_ptr(), GRAD_DTYPES[grad.dtype], exp_avg.data_ptr(),
                      exp_avg_sq.data_ptr(), 0 if out is None else out.data_ptr(),
                      "" if out is None else OUT_DTYPES[out.dtype], param.numel(), float(lr), float(beta1),
                      float(beta2), float(eps), float(weight_decay), int(step), float(grad_scale), bool(adamw), isa)


def fused_adam_(param, grad, exp_avg, exp_avg_sq, **kwargs) -> None:
    """Classic Adam (L2 weight decay folded into the gradient): fused_adamw_ with adamw=False."""
    fused_adamw_(param, grad, exp_avg, exp_avg_sq, adamw=False, **kwargs)


def _torch_adam_(param, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay, step, grad_scale, adamw):
    """torch.optim.AdamW's single-tensor arithmetic, op for op, on an fp32 copy of the scaled gradient."""
    if grad.dtype != torch.float32 or grad_scale != 1.0:
        grad = grad.to(torch.float32) * grad_scale
    if weight_decay != 0:
        if adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if out is not None:
        out.copy_(param)
