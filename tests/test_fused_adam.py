"""The fused CPU Adam(W) kernel against torch.optim.AdamW / Adam, for every gradient dtype and ISA variant.

Tolerance: the fp32 master params are compared with rtol=1e-6 and atol=1e-6 * lr. They are not bit-identical to
torch because torch's `Tensor.sqrt` on CPU goes through MKL's vector sqrt, which is not correctly rounded (it is an
ulp off for ~20% of inputs) while the kernel's sqrt is IEEE; a 1-ulp denominator moves a parameter by at most an ulp.
exp_avg and exp_avg_sq of AdamW do not depend on the params, so they are compared exactly; so are the ISA variants
with each other (they do the same correctly rounded operations in the same order) and the bf16/fp16 copy with
`master.to(dtype)`.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os

import pytest
import torch

from angel_ptm.errors import KernelInputError
from angel_ptm.optim import fused_adam
from angel_ptm.optim.fused_adam import fused_adam_, fused_adamw_, kernel_info, supported_isas

ISAS = supported_isas()
needs_native = pytest.mark.skipif(not fused_adam.native_available(), reason=fused_adam.NATIVE_ADAM_ERROR or "")
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def make_problem(n: int, grad_dtype: torch.dtype, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 0.1).to(grad_dtype) for _ in range(steps)]
    return param, grads


def run_torch(param0, grads, *, adamw=True, weight_decay=0.0, grad_scale=1.0, lr=1e-3):
    ref = param0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], weight_decay=weight_decay)
    for grad in grads:
        ref.grad = grad.to(torch.float32) * grad_scale
        opt.step()
    state = opt.state[ref]
    return ref.detach(), state["exp_avg"], state["exp_avg_sq"]


def run_fused(param0, grads, *, out_dtype=None, **kwargs):
    param = param0.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    out = None if out_dtype is None else torch.empty(param.shape, dtype=out_dtype)
    params = dict(HYPER, weight_decay=0.0)
    params.update(kwargs)
    for step, grad in enumerate(grads, start=1):
        fused_adamw_(param, grad, exp_avg, exp_avg_sq, step=step, out=out, **params)
    return param, exp_avg, exp_avg_sq, out


def assert_params_close(actual, expected, lr=1e-3):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * lr)


# --- the native kernel against torch --------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch_over_steps(isa, grad_dtype, weight_decay):
    n = 4099 if isa == "scalar" else 40_009  # not a multiple of any vector width; above the parallel threshold
    param0, grads = make_problem(n, grad_dtype, steps=4)
    param, exp_avg, exp_avg_sq, _ = run_fused(param0, grads, weight_decay=weight_decay, isa=isa)
    ref, ref_avg, ref_avg_sq = run_torch(param0, grads, weight_decay=weight_decay)
    assert_params_close(param, ref)
    assert torch.equal(exp_avg, ref_avg)
    assert torch.equal(exp_avg_sq, ref_avg_sq)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 7, 15, 17, 33, 1000])
def test_small_sizes_match_torch(isa, n):
    param0, grads = make_problem(n, torch.bfloat16, steps=3, seed=n)
    param, exp_avg, exp_avg_sq, _ = run_fused(param0, grads, weight_decay=0.01, isa=isa)
    ref, ref_avg, ref_avg_sq = run_torch(param0, grads, weight_decay=0.01)
    assert_params_close(param, ref)
    assert torch.equal(exp_avg, ref_avg) and torch.equal(exp_avg_sq, ref_avg_sq)


@needs_native
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_every_isa_gives_identical_bits(grad_dtype, out_dtype):
    param0, grads = make_problem(70_001, grad_dtype, steps=3, seed=3)
    results = [run_fused(param0, grads, weight_decay=0.1, isa=isa, out_dtype=out_dtype) for isa in ISAS]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@needs_native
def test_one_million_and_three_elements_match_torch():
    param0, grads = make_problem(1_000_003, torch.bfloat16, steps=2, seed=5)
    param, exp_avg, exp_avg_sq, out = run_fused(param0, grads, weight_decay=0.1, out_dtype=torch.bfloat16)
    ref, ref_avg, ref_avg_sq = run_torch(param0, grads, weight_decay=0.1)
    assert_params_close(param, ref)
    assert torch.equal(exp_avg, ref_avg) and torch.equal(exp_avg_sq, ref_avg_sq)
    assert torch.equal(out, param.to(torch.bfloat16))


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=dtype_id)
def test_grad_scale_is_the_same_as_scaling_the_gradient(isa, grad_dtype):
    param0, grads = make_problem(10_007, grad_dtype, steps=3, seed=7)
    scale = 0.37  # e.g. 1 / loss_scale * clip_coef
    param, exp_avg, exp_avg_sq, _ = run_fused(param0, grads, weight_decay=0.1, grad_scale=scale, isa=isa)
    ref, ref_avg, ref_avg_sq = run_torch(param0, grads, weight_decay=0.1, grad_scale=scale)
    assert_params_close(param, ref)
    assert torch.equal(exp_avg, ref_avg) and torch.equal(exp_avg_sq, ref_avg_sq)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=dtype_id)
def test_adam_mode_matches_torch_adam(isa, grad_dtype):
    param0, grads = make_problem(10_007, grad_dtype, steps=4, seed=11)
    param, _, _, _ = run_fused(param0, grads, weight_decay=0.1, adamw=False, isa=isa)
    ref, _, _ = run_torch(param0, grads, adamw=False, weight_decay=0.1)
    # L2 decay feeds the params into the moments, so the moments inherit the params' 1-ulp sqrt differences.
    assert_params_close(param, ref)


def test_fused_adam_is_adamw_with_adamw_false():
    param0, grads = make_problem(1001, torch.bfloat16, steps=1, seed=53)
    expected = run_fused(param0, grads, weight_decay=0.1, adamw=False)
    param, exp_avg, exp_avg_sq = param0.clone(), torch.zeros(1001), torch.zeros(1001)
    fused_adam_(param, grads[0], exp_avg, exp_avg_sq, step=1, weight_decay=0.1, **HYPER)
    assert torch.equal(param, expected[0])
    assert torch.equal(exp_avg, expected[1]) and torch.equal(exp_avg_sq, expected[2])


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_adam_mode_first_step_moments_are_exact(isa):
    param0, grads = make_problem(10_007, torch.float32, steps=1, seed=13)
    _, exp_avg, exp_avg_sq, _ = run_fused(param0, grads, weight_decay=0.1, adamw=False, isa=isa)
    _, ref_avg, ref_avg_sq = run_torch(param0, grads, adamw=False, weight_decay=0.1)
    assert torch.equal(exp_avg, ref_avg) and torch.equal(exp_avg_sq, ref_avg_sq)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_low_precision_copy_equals_master_cast(isa, out_dtype):
    param0, grads = make_problem(20_011, torch.bfloat16, steps=2, seed=17)
    param, _, _, out = run_fused(param0, grads, weight_decay=0.1, isa=isa, out_dtype=out_dtype)
    assert torch.equal(out, param.to(out_dtype))


@functools.lru_cache(maxsize=1)
def special_floats() -> torch.Tensor:
    """(Read-only.) Random bit patterns over the whole fp32 range plus every rounding edge of bf16 and fp16."""
    gen = torch.Generator().manual_seed(19)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    edges = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65519.99, 65520.0, 65536.0, 1e-45,
             2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-14, 2.0**-14 * (1 - 2**-11), 6.1e-5, 3.4028235e38,
             1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-9, 1.0 + 2**-12]
    edges = torch.tensor(edges + [-e for e in edges], dtype=torch.float32)
    patterns = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16)
    halves = patterns.view(torch.float16).to(torch.float32)
    positive = halves[torch.isfinite(halves) & (halves >= 0)].double().sort().values
    half_ties = ((positive[1:] + positive[:-1]) / 2).float()  # exact in fp32: round-to-even decides each one
    bf16_ties = (patterns.to(torch.int32) << 16) + 0x8000  # exactly between two bf16 neighbours
    candidates = [bits.view(torch.float32), edges, halves, half_ties, -half_ties, bf16_ties.view(torch.float32),
                  (bf16_ties + 1).view(torch.float32), (bf16_ties - 1).view(torch.float32)]
    candidates += [c.nextafter(torch.full_like(c, float("inf"))) for c in (halves, half_ties)]
    return torch.cat(candidates)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_copy_rounds_like_torch_on_every_special_value(isa, out_dtype):
    values = special_floats()
    param = values.clone()
    zeros = torch.zeros_like(param)
    out = torch.empty(param.shape, dtype=out_dtype)
    # lr = 0 and a zero gradient leave every param (inf and -0 included) as it is, so the copy is a pure cast;
    # a signalling NaN comes out quiet, as from any arithmetic.
    fused_adamw_(param, zeros, zeros.clone(), zeros.clone(), lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.0, step=1, out=out, isa=isa)
    nan = torch.isnan(values)
    assert torch.equal(param[~nan].view(torch.int32), values[~nan].view(torch.int32))
    assert torch.isnan(param[nan]).all() and torch.isnan(out[nan]).all()
    expected = values.to(out_dtype)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_low_precision_gradients_are_read_exactly(isa, grad_dtype):
    # With beta1 = 0 the first step's exp_avg is the gradient itself, so it shows the upcast bit for bit.
    values = special_floats()
    grad = values.to(grad_dtype)
    grad[~torch.isfinite(grad)] = 0  # lerp with weight 1 turns inf into NaN (in torch too); NaN != NaN
    param, exp_avg, exp_avg_sq = torch.zeros(grad.shape), torch.zeros(grad.shape), torch.zeros(grad.shape)
    fused_adamw_(param, grad, exp_avg, exp_avg_sq, lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 step=1, isa=isa)
    assert torch.equal(exp_avg, grad.to(torch.float32))


@needs_native
@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "scalar"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_unaligned_views_large_enough_for_streaming_stores(isa, out_dtype):
    # Offsets of 1-3 elements put every buffer off its vector alignment; 600k elements make the copy big enough
    # (>= 1 MiB) to be written with streaming stores, which need the kernel to align `out` first.
    n = 600_001
    param0, grads = make_problem(n, torch.bfloat16, steps=1, seed=43)
    param = torch.empty(n + 1)[1:].copy_(param0)
    grad = torch.empty(n + 3, dtype=torch.bfloat16)[3:].copy_(grads[0])
    exp_avg, exp_avg_sq = torch.zeros(n + 2)[2:], torch.zeros(n + 3)[3:]
    out = torch.empty(n + 1, dtype=out_dtype)[1:]
    fused_adamw_(param, grad, exp_avg, exp_avg_sq, step=1, out=out, isa=isa, weight_decay=0.1, **HYPER)
    ref, ref_avg, ref_avg_sq = run_torch(param0, grads, weight_decay=0.1)
    assert_params_close(param, ref)
    assert torch.equal(exp_avg, ref_avg) and torch.equal(exp_avg_sq, ref_avg_sq)
    assert torch.equal(out, param.to(out_dtype))


@needs_native
def test_auto_isa_is_the_best_supported():
    info = kernel_info()
    assert info["implementation"] == "native"
    assert info["isa"] == ISAS[0]
    assert info["threads"] >= 1


@needs_native
def test_thread_count_does_not_change_the_result():
    param0, grads = make_problem(300_007, torch.bfloat16, steps=2, seed=23)
    before = fused_adam.get_threads()
    try:
        results = []
        for threads in (1, 3):
            fused_adam.set_threads(threads)
            assert fused_adam.get_threads() == threads
            results.append(run_fused(param0, grads, weight_decay=0.1, out_dtype=torch.bfloat16))
    finally:
        fused_adam.set_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_native
def test_many_back_to_back_calls_with_fewer_chunks_than_threads():
    # 4 threads on 40k elements make 3 chunks, so one worker sits out each call; it must not run a later call's part.
    param0, grads = make_problem(40_000, torch.bfloat16, steps=1, seed=59)
    before = fused_adam.get_threads()
    try:
        fused_adam.set_threads(1)
        expected = run_fused(param0, grads * 50, weight_decay=0.1)
        fused_adam.set_threads(4)
        actual = run_fused(param0, grads * 50, weight_decay=0.1)
    finally:
        fused_adam.set_threads(before)
    for a, b in zip(expected[:3], actual[:3]):
        assert torch.equal(a, b)


_ONE_CORE_CHILD = """
import os, sys, torch
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
from angel_ptm.optim import fused_adam
gen = torch.Generator().manual_seed(61)
param0 = torch.randn(200_000, generator=gen)
grads = [torch.randn(200_000, generator=gen) * 0.1 for _ in range(120)]
def run():
    param, exp_avg, exp_avg_sq = param0.clone(), torch.zeros_like(param0), torch.zeros_like(param0)
    for step, grad in enumerate(grads, start=1):
        fused_adam.fused_adamw_(param, grad, exp_avg, exp_avg_sq, step=step, lr=1e-3, beta1=0.9, beta2=0.999,
                                eps=1e-8, weight_decay=0.1)
    return param, exp_avg, exp_avg_sq
fused_adam.set_threads(1)
expected = run()
fused_adam.set_threads(4)
before = fused_adam.pool_stats()
actual = run()
after = fused_adam.pool_stats()
same = all(torch.equal(a, b) for a, b in zip(expected, actual))
print(same, after["parts_posted"] - before["parts_posted"], after["parts_taken_back"] - before["parts_taken_back"])
"""


@needs_native
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_the_caller_takes_back_parts_no_worker_started():
    # One core for four threads: a worker rarely runs while the caller does, so the caller must do the parts no
    # worker has claimed instead of waiting for a core to come free for them (it used to wait, each call).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ONE_CORE_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    same, posted, taken_back = out.stdout.split()
    assert same == "True"
    assert int(posted) == 120 * 3
    assert int(taken_back) > 0


@needs_native
def test_a_forked_child_gets_its_own_thread_pool():
    # The parent's pool exists (earlier calls); the child inherits it without its threads and must not wait on them.
    # The child runs nothing but the kernel and numpy: torch's own OpenMP pool does not survive a fork either.
    param0, grads = make_problem(200_003, torch.bfloat16, steps=1, seed=47)
    expected = run_fused(param0, grads)[0]
    param, exp_avg, exp_avg_sq = param0.clone(), torch.zeros_like(param0), torch.zeros_like(param0)
    child = multiprocessing.get_context("fork").Process(
        target=_update_in_child, args=(param, grads[0], exp_avg, exp_avg_sq, expected.numpy().tobytes()))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in the fused Adam kernel")
    assert child.exitcode == 0


def _update_in_child(param, grad, exp_avg, exp_avg_sq, expected: bytes):
    fused_adamw_(param, grad, exp_avg, exp_avg_sq, step=1, weight_decay=0.0, **HYPER)
    os._exit(0 if param.numpy().tobytes() == expected else 1)


@needs_native
def test_empty_tensors_are_a_no_op():
    empty = torch.empty(0)
    fused_adamw_(empty, empty, empty.clone(), empty.clone(), step=1, weight_decay=0.0, **HYPER)


@needs_native
def test_multidimensional_contiguous_tensors_are_flattened():
    param0, grads = make_problem(6 * 501, torch.float32, steps=2, seed=29)
    param, exp_avg, exp_avg_sq, _ = run_fused(param0.view(6, 501), [g.view(6, 501) for g in grads])
    ref, _, _ = run_torch(param0, grads)
    assert_params_close(param.view(-1), ref)


# --- the torch fallback ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("adamw", [True, False])
def test_fallback_matches_torch_exactly(grad_dtype, adamw):
    param0, grads = make_problem(1003, grad_dtype, steps=3, seed=31)
    param, exp_avg, exp_avg_sq, out = run_fused(param0, grads, weight_decay=0.1, grad_scale=0.5, adamw=adamw,
                                                backend="torch", out_dtype=torch.float16)
    ref, ref_avg, ref_avg_sq = run_torch(param0, grads, adamw=adamw, weight_decay=0.1, grad_scale=0.5)
    assert torch.equal(param, ref)
    assert torch.equal(exp_avg, ref_avg) and torch.equal(exp_avg_sq, ref_avg_sq)
    assert torch.equal(out, param.to(torch.float16))


@needs_native
def test_fallback_and_native_agree():
    param0, grads = make_problem(5003, torch.bfloat16, steps=3, seed=37)
    native = run_fused(param0, grads, weight_decay=0.1, backend="native")
    fallback = run_fused(param0, grads, weight_decay=0.1, backend="torch")
    assert_params_close(native[0], fallback[0])
    assert torch.equal(native[1], fallback[1]) and torch.equal(native[2], fallback[2])


def test_missing_kernel_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(fused_adam, "NATIVE_ADAM_ERROR", "native extension missing (test)")
    monkeypatch.setattr(fused_adam, "_announced", set())
    param0, grads = make_problem(101, torch.float32, steps=2, seed=41)
    with caplog.at_level(logging.WARNING, logger="angel_ptm.optim"):
        param, _, _, _ = run_fused(param0, grads)
    assert any("pure-torch fallback" in r.message and "native extension missing (test)" in r.message
               for r in caplog.records)
    assert kernel_info() == {"implementation": "torch", "isa": "torch", "threads": torch.get_num_threads(),
                             "reason": "native extension missing (test)"}
    ref, _, _ = run_torch(param0, grads)
    assert torch.equal(param, ref)


def test_native_backend_without_the_kernel_is_an_error(monkeypatch):
    monkeypatch.setattr(fused_adam, "NATIVE_ADAM_ERROR", "native extension missing (test)")
    param = torch.zeros(4)
    with pytest.raises(KernelInputError, match="backend 'native' is not available: native extension missing"):
        fused_adamw_(param, param.clone(), param.clone(), param.clone(), step=1, weight_decay=0.0,
                     backend="native", **HYPER)


# --- bad input ------------------------------------------------------------------------------------------------
def call(param=None, grad=None, exp_avg=None, exp_avg_sq=None, **overrides):
    n = 16
    args = dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))
    args.update({k: v for k, v in dict(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq).items()
                 if v is not None})
    kwargs = dict(HYPER, weight_decay=0.0, step=1)
    kwargs.update(overrides)
    fused_adamw_(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(param=torch.zeros(16, dtype=torch.float64)), "param must be float32, got float64"),
    (dict(grad=torch.zeros(16, dtype=torch.int32)), "grad must be float32, bfloat16, float16, got int32"),
    (dict(exp_avg=torch.zeros(16, dtype=torch.bfloat16)), "exp_avg must be float32, got bfloat16"),
    (dict(grad=torch.zeros(15)), "grad has 15 elements, param has 16"),
    (dict(exp_avg_sq=torch.zeros(17)), "exp_avg_sq has 17 elements, param has 16"),
    (dict(grad=torch.zeros(32)[::2]), "grad must be contiguous"),
    (dict(out=torch.zeros(16)), "out must be bfloat16, float16, got float32"),
    (dict(out=torch.zeros(8, dtype=torch.bfloat16)), "out has 8 elements, param has 16"),
    (dict(grad=[0.0] * 16), "grad must be a torch.Tensor, got list"),
    (dict(step=0), "step must be an integer >= 1"),
    (dict(step=1.0), "step must be an integer >= 1"),
    (dict(lr=-1.0), r"lr must be in \[0.0, inf\], got -1.0"),
    (dict(beta1=1.0), r"beta1 must be in \[0.0, 1.0\), got 1.0"),
    (dict(beta2=float("nan")), "beta2 must be a finite number"),
    (dict(eps=-1e-8), "eps must be in"),
    (dict(grad_scale=float("inf")), "grad_scale must be a finite number"),
    (dict(isa="sse2"), "isa must be one of auto, avx512, avx2, scalar, got 'sse2'"),
    (dict(backend="gpu"), "backend must be one of auto, native, torch, got 'gpu'"),
])
def test_bad_input_is_a_one_line_typed_error(kwargs, message):
    with pytest.raises(KernelInputError, match=message) as info:
        call(**kwargs)
    assert "\n" not in str(info.value)


def test_shared_buffers_are_rejected():
    param = torch.zeros(16)
    with pytest.raises(KernelInputError, match="three different buffers"):
        call(param=param, exp_avg=param)


def test_device_other_than_cpu_is_rejected():
    meta = torch.zeros(16, device="meta")
    with pytest.raises(KernelInputError, match="param must be on the CPU, got device meta"):
        call(param=meta)


@needs_native
def test_isa_this_cpu_lacks_is_an_error():
    missing = [isa for isa in ("avx512", "avx2") if isa not in ISAS]
    if not missing:
        pytest.skip("this CPU supports every variant")
    with pytest.raises(KernelInputError, match=f"does not support isa '{missing[0]}'"):
        call(isa=missing[0])


def test_thread_count_must_be_positive():
    with pytest.raises(KernelInputError, match="threads must be an integer >= 1, got 0"):
        fused_adam.set_threads(0)
