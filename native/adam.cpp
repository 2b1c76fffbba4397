// Fused CPU Adam / AdamW: one pass over fp32 master params, fp32 exp_avg and exp_avg_sq and the gradient (fp32, bf16
// or fp16), writing an optional bf16/fp16 copy of the updated params in the same pass.
//
// The arithmetic is torch.optim.AdamW's single-tensor path, op for op and rounded where torch rounds (every torch op
// writes an fp32 tensor; its scalars are doubles rounded to float; its lerp and addcmul kernels use FMAs). The
// moments come out bit-identical to torch's; the params within an ulp, because torch's CPU sqrt is MKL's, which is
// not correctly rounded, and ours is IEEE. Every variant (AVX-512, AVX2, scalar) does the same correctly rounded
// operations in the same order, so the variants agree with each other exactly; the scalar code also serves the
// vector variants' tails. The variant is picked at run time, so the binary runs on any x86-64.
//
// The update is memory bound (28 bytes per parameter for fp32 master + bf16 gradient + bf16 copy), so what matters
// is that every thread streams long contiguous runs of every buffer, that the write-only copy does not cost a read
// of each line, and that no thread is created per call: the kernel runs once per page (1-64 MiB), many times a
// step. A persistent pool of `threads - 1` workers plus the calling thread (without the GIL) split each call.
// No torch headers: buffers are raw addresses and sizes.
#include <pybind11/pybind11.h>

#include "convert.h"
#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace py = pybind11;

// Every product and sum below must be rounded to fp32 where torch's separate ops round it: a compiler that fuses
// `a * b + c` into one FMA (GCC does by default, even on intrinsics) changes the last bit. The FMAs torch itself
// does (lerp's fmadd, addcmul's contracted multiply-add, add's alpha) are written out explicitly.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace angel {
namespace adam {

using namespace convert;  // bf16_to_f32, f32_to_bf16, f16_to_f32, f32_to_f16

enum class DType : int { None = 0, F32 = 1, BF16 = 2, F16 = 3 };
enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// The scalars of one step, rounded to float exactly where torch rounds its Scalar arguments.
struct Consts {
    float grad_scale;
    float decay;        // AdamW: param.mul_(1 - lr * wd)
    float l2;           // Adam: grad.add(param, alpha=wd)
    float lerp_coeff;   // exp_avg.lerp_(grad, 1 - beta1) == fma(coeff, grad - exp_avg, base)
    bool lerp_small;    // base is exp_avg when the weight is < 0.5 (torch's is_lerp_weight_small), else grad
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;     // sqrt(1 - beta2^t), by pow(x, 0.5) as torch computes it
    float eps;
    float neg_step;     // -lr / (1 - beta1^t)
    bool adamw;
    bool apply_decay;   // weight_decay != 0 (torch skips the op entirely otherwise)
};

struct Buffers {
    float* param;
    const void* grad;
    float* exp_avg;
    float* exp_avg_sq;
    void* out;
    DType grad_dtype;
    DType out_dtype;
    bool stream_out;  // write `out` with non-temporal stores (it is only written, and too big to stay in cache)
};

// ----------------------------------------------------------------------------------------------- scalar update ---
// One element, the reference for every variant. std::fma is what torch's vectorized lerp does (vec::fmadd).
template <DType G>
static inline float load_grad(const void* grad, size_t i) {
    if constexpr (G == DType::BF16) return bf16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    if constexpr (G == DType::F16) return f16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    return static_cast<const float*>(grad)[i];
}

template <DType G, DType O>
static inline void update_one(const Buffers& b, const Consts& c, size_t i) {
    float g = load_grad<G>(b.grad, i) * c.grad_scale;
    float p = b.param[i];
    if (c.apply_decay) {
        if (c.adamw)
            p = p * c.decay;
        else
            g = std::fma(p, c.l2, g);  // torch's add(alpha=): vec::fmadd(other, alpha, self)
    }
    float m = b.exp_avg[i];
    m = std::fma(c.lerp_coeff, g - m, c.lerp_small ? m : g);
    float v = b.exp_avg_sq[i] * c.beta2;
    v = std::fma(c.one_minus_beta2 * g, g, v);  // torch's addcmul kernel is compiled to this FMA
    float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    float upd = c.neg_step * m;
    p = p + upd / denom;
    b.param[i] = p;
    b.exp_avg[i] = m;
    b.exp_avg_sq[i] = v;
    if constexpr (O == DType::BF16) static_cast<uint16_t*>(b.out)[i] = f32_to_bf16(p);
    if constexpr (O == DType::F16) static_cast<uint16_t*>(b.out)[i] = f32_to_f16(p);
}

template <DType G, DType O>
static void update_scalar(const Buffers& b, const Consts& c, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) update_one<G, O>(b, c, i);
}

// ------------------------------------------------------------------------------------------------------- AVX2 ---
#if defined(__x86_64__) || defined(__i386__)
#define ANGEL_HAVE_X86 1
#define ANGEL_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ANGEL_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define ANGEL_INLINE inline __attribute__((always_inline))

// Prefetch distance in bytes ahead of the fp32 streams; the hardware prefetcher does most of the work, this keeps
// five concurrent streams from stalling at 4 KiB page boundaries.
static constexpr size_t kPrefetchBytes = 1024;

template <DType G>
ANGEL_AVX2 ANGEL_INLINE __m256 avx2_load_grad(const void* grad, size_t i) {
    if constexpr (G == DType::F32) {
        return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
    } else if constexpr (G == DType::BF16) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
        return _mm256_cvtph_ps(h);
    }
}

ANGEL_AVX2 ANGEL_INLINE __m128i avx2_to_bf16(__m256 x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x0040));
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    // Values are <= 0xFFFF, so the saturating pack is a plain narrowing; it packs within 128-bit lanes.
    __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <DType G, DType O>
ANGEL_AVX2 static void update_avx2(const Buffers& b, const Consts& c, size_t begin, size_t end) {
    const __m256 grad_scale = _mm256_set1_ps(c.grad_scale), decay = _mm256_set1_ps(c.decay);
    const __m256 l2 = _mm256_set1_ps(c.l2), lerp_coeff = _mm256_set1_ps(c.lerp_coeff);
    const __m256 beta2 = _mm256_set1_ps(c.beta2), one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
    const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
    const __m256 neg_step = _mm256_set1_ps(c.neg_step);
    const bool decoupled = c.apply_decay && c.adamw, coupled = c.apply_decay && !c.adamw, small = c.lerp_small;
    float* __restrict param = b.param;
    float* __restrict exp_avg = b.exp_avg;
    float* __restrict exp_avg_sq = b.exp_avg_sq;
    constexpr size_t kPf = kPrefetchBytes / sizeof(float);
    size_t i = begin;
    bool stream = O != DType::None && b.stream_out;
    if (stream) {  // scalar steps up to a 16-byte boundary of `out`, where streaming stores can start
        for (; i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.out) + i) & 15u); ++i)
            update_one<G, O>(b, c, i);
    }
    for (; i + 8 <= end; i += 8) {
        _mm_prefetch(reinterpret_cast<const char*>(param + i + kPf), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(exp_avg + i + kPf), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(exp_avg_sq + i + kPf), _MM_HINT_T0);
        __m256 g = _mm256_mul_ps(avx2_load_grad<G>(b.grad, i), grad_scale);
        __m256 p = _mm256_loadu_ps(param + i);
        if (decoupled) p = _mm256_mul_ps(p, decay);
        if (coupled) g = _mm256_fmadd_ps(p, l2, g);
        __m256 m = _mm256_loadu_ps(exp_avg + i);
        m = _mm256_fmadd_ps(lerp_coeff, _mm256_sub_ps(g, m), small ? m : g);
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(exp_avg_sq + i), beta2);
        v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, v);
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
        _mm256_storeu_ps(param + i, p);
        _mm256_storeu_ps(exp_avg + i, m);
        _mm256_storeu_ps(exp_avg_sq + i, v);
        if constexpr (O != DType::None) {
            __m128i low = O == DType::BF16 ? avx2_to_bf16(p)
                                           : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.out) + i);
            if (stream)
                _mm_stream_si128(dst, low);
            else
                _mm_storeu_si128(dst, low);
        }
    }
    if (stream) _mm_sfence();  // streaming stores are weakly ordered: drain them before the call reports done
    for (; i < end; ++i) update_one<G, O>(b, c, i);
}

// ----------------------------------------------------------------------------------------------------- AVX-512 ---
template <DType G>
ANGEL_AVX512 ANGEL_INLINE __m512 avx512_load_grad(const void* grad, size_t i) {
    if constexpr (G == DType::F32) {
        return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
    } else if constexpr (G == DType::BF16) {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
        return _mm512_cvtph_ps(h);
    }
}

ANGEL_AVX512 ANGEL_INLINE __m256i avx512_to_bf16(__m512 x) {
    __m512i b = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x0040));
    __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
}

template <DType G, DType O>
ANGEL_AVX512 static void update_avx512(const Buffers& b, const Consts& c, size_t begin, size_t end) {
    const __m512 grad_scale = _mm512_set1_ps(c.grad_scale), decay = _mm512_set1_ps(c.decay);
    const __m512 l2 = _mm512_set1_ps(c.l2), lerp_coeff = _mm512_set1_ps(c.lerp_coeff);
    const __m512 beta2 = _mm512_set1_ps(c.beta2), one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
    const __m512 bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt), eps = _mm512_set1_ps(c.eps);
    const __m512 neg_step = _mm512_set1_ps(c.neg_step);
    const bool decoupled = c.apply_decay && c.adamw, coupled = c.apply_decay && !c.adamw, small = c.lerp_small;
    float* __restrict param = b.param;
    float* __restrict exp_avg = b.exp_avg;
    float* __restrict exp_avg_sq = b.exp_avg_sq;
    constexpr size_t kPf = kPrefetchBytes / sizeof(float);
    size_t i = begin;
    bool stream = O != DType::None && b.stream_out;
    if (stream) {  // scalar steps up to a 32-byte boundary of `out`, where streaming stores can start
        for (; i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.out) + i) & 31u); ++i)
            update_one<G, O>(b, c, i);
    }
    for (; i + 16 <= end; i += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(param + i + kPf), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(exp_avg + i + kPf), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(exp_avg_sq + i + kPf), _MM_HINT_T0);
        __m512 g = _mm512_mul_ps(avx512_load_grad<G>(b.grad, i), grad_scale);
        __m512 p = _mm512_loadu_ps(param + i);
        if (decoupled) p = _mm512_mul_ps(p, decay);
        if (coupled) g = _mm512_fmadd_ps(p, l2, g);
        __m512 m = _mm512_loadu_ps(exp_avg + i);
        m = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(g, m), small ? m : g);
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(exp_avg_sq + i), beta2);
        v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, v);
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2_sqrt), eps);
        p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step, m), denom));
        _mm512_storeu_ps(param + i, p);
        _mm512_storeu_ps(exp_avg + i, m);
        _mm512_storeu_ps(exp_avg_sq + i, v);
        if constexpr (O != DType::None) {
            __m256i low = O == DType::BF16 ? avx512_to_bf16(p)
                                           : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.out) + i);
            if (stream)
                _mm256_stream_si256(dst, low);
            else
                _mm256_storeu_si256(dst, low);
        }
    }
    if (stream) _mm_sfence();  // streaming stores are weakly ordered: drain them before the call reports done
    for (; i < end; ++i) update_one<G, O>(b, c, i);
}

// The benchmark's memory roofline: an in-place multiply streamed exactly as the update streams its buffers.
ANGEL_AVX512 static void scale_avx512(float* x, float factor, size_t begin, size_t end) {
    const __m512 f = _mm512_set1_ps(factor);
    size_t i = begin;
    for (; i + 16 <= end; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), f));
    for (; i < end; ++i) x[i] *= factor;
}
ANGEL_AVX2 static void scale_avx2(float* x, float factor, size_t begin, size_t end) {
    const __m256 f = _mm256_set1_ps(factor);
    size_t i = begin;
    for (; i + 8 <= end; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), f));
    for (; i < end; ++i) x[i] *= factor;
}
#endif  // x86

static void scale_scalar(float* x, float factor, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) x[i] *= factor;
}

// ------------------------------------------------------------------------------------------------ ISA dispatch ---
using Kernel = void (*)(const Buffers&, const Consts&, size_t, size_t);

template <DType G, DType O>
static Kernel kernel_for(Isa isa) {
#ifdef ANGEL_HAVE_X86
    if (isa == Isa::Avx512) return &update_avx512<G, O>;
    if (isa == Isa::Avx2) return &update_avx2<G, O>;
#endif
    (void)isa;
    return &update_scalar<G, O>;
}

template <DType G>
static Kernel kernel_for(Isa isa, DType out) {
    switch (out) {
        case DType::BF16: return kernel_for<G, DType::BF16>(isa);
        case DType::F16: return kernel_for<G, DType::F16>(isa);
        default: return kernel_for<G, DType::None>(isa);
    }
}

static Kernel pick_kernel(Isa isa, DType grad, DType out) {
    switch (grad) {
        case DType::BF16: return kernel_for<DType::BF16>(isa, out);
        case DType::F16: return kernel_for<DType::F16>(isa, out);
        default: return kernel_for<DType::F32>(isa, out);
    }
}

static bool isa_supported(Isa isa) {
    if (isa == Isa::Scalar) return true;
#ifdef ANGEL_HAVE_X86
    __builtin_cpu_init();
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == Isa::Avx2) return avx2;
    if (isa == Isa::Avx512) return avx2 && __builtin_cpu_supports("avx512f");
#endif
    return false;
}

static Isa best_isa() {
    static const Isa best = isa_supported(Isa::Avx512) ? Isa::Avx512
                            : isa_supported(Isa::Avx2) ? Isa::Avx2
                                                       : Isa::Scalar;
    return best;
}

static const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::Avx512: return "avx512";
        case Isa::Avx2: return "avx2";
        default: return "scalar";
    }
}

static Isa parse_isa(const std::string& name) {
    Isa isa;
    if (name == "auto") return best_isa();
    if (name == "avx512")
        isa = Isa::Avx512;
    else if (name == "avx2")
        isa = Isa::Avx2;
    else if (name == "scalar")
        isa = Isa::Scalar;
    else
        throw std::invalid_argument("isa must be auto, avx512, avx2 or scalar, got '" + name + "'");
    if (!isa_supported(isa)) throw std::invalid_argument(std::string("this CPU does not support isa '") + name + "'");
    return isa;
}

static DType parse_dtype(const std::string& name, bool allow_none, const char* what) {
    if (name == "float32") return DType::F32;
    if (name == "bfloat16") return DType::BF16;
    if (name == "float16") return DType::F16;
    if (allow_none && (name.empty() || name == "none")) return DType::None;
    throw std::invalid_argument(std::string(what) + " must be float32, bfloat16 or float16, got '" + name + "'");
}


// From this size of `out` on, it is written with streaming stores: it is not read by the update, so a normal store
// would first read every line of it from memory (and then evict the states the next call may want).
static constexpr size_t kStreamOutBytes = 1 << 20;

using parallel::parallel_ranges;

static void step(Buffers b, const Consts& c, size_t n, Isa isa) {
    Kernel kernel = pick_kernel(isa, b.grad_dtype, b.out_dtype);
    b.stream_out = b.out_dtype != DType::None && n * 2 >= kStreamOutBytes;
    parallel_ranges(n, [&](size_t begin, size_t end) { kernel(b, c, begin, end); });
}

static void scale(float* x, size_t n, float factor, Isa isa) {
    void (*kernel)(float*, float, size_t, size_t) = &scale_scalar;
#ifdef ANGEL_HAVE_X86
    if (isa == Isa::Avx512) kernel = &scale_avx512;
    if (isa == Isa::Avx2) kernel = &scale_avx2;
#endif
    parallel_ranges(n, [&](size_t begin, size_t end) { kernel(x, factor, begin, end); });
}

static Consts make_consts(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                          double grad_scale, bool adamw) {
    // Exactly torch's scalar arithmetic (Python floats are doubles), then the float rounding of a Scalar argument.
    Consts c;
    double t = static_cast<double>(step);
    double bias_correction1 = 1.0 - std::pow(beta1, t);
    double bias_correction2 = 1.0 - std::pow(beta2, t);
    double step_size = lr / bias_correction1;
    c.grad_scale = static_cast<float>(grad_scale);
    c.adamw = adamw;
    c.apply_decay = weight_decay != 0.0;
    c.decay = static_cast<float>(1.0 - lr * weight_decay);
    c.l2 = static_cast<float>(weight_decay);
    float w = static_cast<float>(1.0 - beta1);
    c.lerp_small = std::fabs(w) < 0.5f;
    c.lerp_coeff = c.lerp_small ? w : w - 1.0f;
    c.beta2 = static_cast<float>(beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    c.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
    c.eps = static_cast<float>(eps);
    c.neg_step = static_cast<float>(-step_size);
    return c;
}

}  // namespace adam
}  // namespace angel

void register_adam(py::module_& m) {
    namespace A = angel::adam;
    m.def(
        "adam_step",
        [](uintptr_t param, uintptr_t grad, const std::string& grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
           uintptr_t out, const std::string& out_dtype, size_t n, double lr, double beta1, double beta2, double eps,
           double weight_decay, int64_t step, double grad_scale, bool adamw, const std::string& isa) {
            A::Buffers b{};
            b.param = reinterpret_cast<float*>(param);
            b.grad = reinterpret_cast<const void*>(grad);
            b.exp_avg = reinterpret_cast<float*>(exp_avg);
            b.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq);
            b.out = reinterpret_cast<void*>(out);
            b.grad_dtype = A::parse_dtype(grad_dtype, false, "grad_dtype");
            b.out_dtype = out == 0 ? A::DType::None : A::parse_dtype(out_dtype, false, "out_dtype");
            if (b.out_dtype == A::DType::F32) throw std::invalid_argument("out_dtype must be bfloat16 or float16");
            if (n > 0 && (param == 0 || grad == 0 || exp_avg == 0 || exp_avg_sq == 0))
                throw std::invalid_argument("adam_step: null buffer address");
            if (step < 1) throw std::invalid_argument("adam_step: step must be >= 1, got " + std::to_string(step));
            A::Isa chosen = A::parse_isa(isa);
            A::Consts c = A::make_consts(lr, beta1, beta2, eps, weight_decay, step, grad_scale, adamw);
            py::gil_scoped_release no_gil;
            A::step(b, c, n, chosen);
        },
        py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("out"), py::arg("out_dtype"), py::arg("n"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("grad_scale") = 1.0,
        py::arg("adamw") = true, py::arg("isa") = "auto",
        "One fused Adam(W) step over n fp32 params in place (torch.optim.AdamW arithmetic), the GIL released.");
    m.def("adam_isa", [] { return std::string(A::isa_name(A::best_isa())); },
          "The instruction set adam_step uses with isa='auto' on this CPU.");
    m.def("adam_isa_supported", [](const std::string& isa) {
        if (isa == "auto" || isa == "scalar") return true;
        if (isa == "avx2") return A::isa_supported(A::Isa::Avx2);
        if (isa == "avx512") return A::isa_supported(A::Isa::Avx512);
        return false;
    });
    m.def("adam_set_threads", &angel::parallel::set_threads, py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
          "Threads (the caller included) that split each adam_step; the pool is rebuilt on the next call.");
    m.def("adam_threads", &angel::parallel::get_threads);
    m.def("adam_pool_stats", [] {
        py::dict d;
        d["parts_posted"] = angel::parallel::g_parts_posted.load();
        d["parts_taken_back"] = angel::parallel::g_parts_taken_back.load();
        return d;
    }, "Parts of split calls posted to the pool's workers, and those the caller ran itself because no worker had "
       "started them (cumulative, this process).");
    m.def(
        "stream_scale",
        [](uintptr_t x, size_t n, double factor, const std::string& isa) {
            A::Isa chosen = A::parse_isa(isa);
            py::gil_scoped_release no_gil;
            A::scale(reinterpret_cast<float*>(x), n, static_cast<float>(factor), chosen);
        },
        py::arg("x"), py::arg("n"), py::arg("factor"), py::arg("isa") = "auto",
        "x[:n] *= factor in place on the adam thread pool: the streaming-bandwidth reference of tools/bench/adam.");
}
