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

#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

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

// ------------------------------------------------------------------------------------------------ conversions ---
static inline uint32_t f32_bits(float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
}
static inline float bits_f32(uint32_t b) {
    float x;
    std::memcpy(&x, &b, 4);
    return x;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even on the bit pattern; a NaN keeps its sign and top payload and is forced quiet, so it can
// never round into an infinity.
static inline uint16_t f32_to_bf16(float x) {
    uint32_t b = f32_bits(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x0040u);
    return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
        float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;
        return bits_f32(f32_bits(mag) | sign);
    }
    if (exp == 31) return bits_f32(sign | 0x7F800000u | (mant << 13));
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// IEEE round to nearest even, as F16C's vcvtps2ph: overflow to infinity, gradual underflow, NaN kept quiet.
static inline uint16_t f32_to_f16(float x) {
    uint32_t b = f32_bits(x);
    uint32_t sign = (b >> 16) & 0x8000u;
    uint32_t mag = b & 0x7FFFFFFFu;
    if (mag >= 0x7F800000u)  // inf or NaN
        return static_cast<uint16_t>(sign | (mag > 0x7F800000u ? 0x7E00u | ((mag >> 13) & 0x3FFu) : 0x7C00u));
    if (mag >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds up to infinity
    if (mag < 0x38800000u) {                                             // below 2^-14: subnormal half or zero
        if (mag < 0x33000000u) return static_cast<uint16_t>(sign);       // below 2^-25 (2^-25 itself ties to 0)
        uint32_t e = mag >> 23;                                          // 102 .. 112
        uint32_t m = (mag & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126u - e;                                       // 14 .. 24
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) ++r;  // may carry into the smallest normal: still correct
        return static_cast<uint16_t>(sign | r);
    }
    uint32_t r = mag - 0x38000000u;  // rebias the exponent from 127 to 15
    r = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
    return static_cast<uint16_t>(sign | r);
}

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

// ------------------------------------------------------------------------------------------------- thread pool ---
// A job is a function of the part index; the caller runs part 0 and workers the others. One job runs at a time
// (callers from several Python threads queue on `submit_mutex_`). The optimizer calls once per page, back to back,
// so a worker that finishes a part spins for a short while (kIdleSpin) watching for the next job before it sleeps
// on the condition variable: a futex wake-up costs tens of microseconds in a VM, a sizeable part of a 1 MiB page.
static inline void cpu_relax() {
#ifdef ANGEL_HAVE_X86
    _mm_pause();
#endif
}

class Pool {
  public:
    static constexpr std::chrono::microseconds kIdleSpin{200};

    explicit Pool(int threads) : tickets_(static_cast<size_t>(std::max(threads, 1))) {
        for (int k = 1; k < threads; ++k) workers_.emplace_back([this, k] { worker_loop(k); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_.store(true);
        }
        wake_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int threads() const { return static_cast<int>(workers_.size()) + 1; }

    void run(int parts, const std::function<void(int)>& job) {
        std::lock_guard<std::mutex> serial(submit_mutex_);
        parts = std::min(parts, threads());
        if (parts <= 1) {
            job(0);
            return;
        }
        // Worker k runs part k when its own ticket moves. A worker left out of this job sees nothing, so it cannot
        // pick up a later job's state half-written; job_ is not touched again before every part has reported.
        job_ = &job;
        pending_.store(parts - 1, std::memory_order_relaxed);
        bool sleepers;
        {
            std::lock_guard<std::mutex> lock(mutex_);  // orders the tickets against a worker going to sleep
            for (int k = 1; k < parts; ++k) tickets_[k].value.fetch_add(1, std::memory_order_release);
            sleepers = sleepers_ > 0;
        }
        if (sleepers) wake_.notify_all();
        job(0);
        // The workers' parts take as long as ours: a short spin catches most finishes without a sleep/wake round.
        for (int spin = 0; spin < 4000 && pending_.load(std::memory_order_acquire) != 0; ++spin) cpu_relax();
        if (pending_.load(std::memory_order_acquire) != 0) {
            std::unique_lock<std::mutex> lock(mutex_);
            done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
        }
    }

  private:
    struct alignas(64) Ticket {  // one cache line each: workers poll their own
        std::atomic<uint64_t> value{0};
    };

    // Waits until worker `index`'s ticket differs from `seen` (or shutdown): spinning first, then asleep.
    uint64_t next_ticket(int index, uint64_t seen) {
        std::atomic<uint64_t>& ticket = tickets_[index].value;
        auto deadline = std::chrono::steady_clock::now() + kIdleSpin;
        for (int spin = 0;; ++spin) {
            uint64_t now = ticket.load(std::memory_order_acquire);
            if (now != seen || stopping_.load(std::memory_order_relaxed)) return now;
            if ((spin & 63) == 63 && std::chrono::steady_clock::now() > deadline) break;
            cpu_relax();
        }
        std::unique_lock<std::mutex> lock(mutex_);
        ++sleepers_;
        wake_.wait(lock, [&] { return stopping_.load() || ticket.load(std::memory_order_acquire) != seen; });
        --sleepers_;
        return ticket.load(std::memory_order_acquire);
    }

    void worker_loop(int index) {
        uint64_t seen = 0;
        for (;;) {
            seen = next_ticket(index, seen);
            if (stopping_.load()) return;
            (*job_)(index);
            if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lock(mutex_);  // pairs with the caller's predicate check
                done_.notify_one();
            }
        }
    }

    std::vector<std::thread> workers_;
    std::vector<Ticket> tickets_;
    std::mutex submit_mutex_;
    std::mutex mutex_;
    std::condition_variable wake_, done_;
    const std::function<void(int)>* job_ = nullptr;  // written before the tickets move, read after
    std::atomic<int> pending_{0};
    std::atomic<bool> stopping_{false};
    int sleepers_ = 0;  // guarded by mutex_
};

static int default_threads() {
    unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int>(n);
}

static std::mutex g_pool_mutex;
static std::shared_ptr<Pool> g_pool;
static pid_t g_pool_pid = 0;
static int g_threads = 0;  // 0: not chosen yet, default_threads() on first use

// A forked child (a DataLoader worker, say) inherits the pool object but none of its threads: it must neither wait
// for them nor join them, so the inherited pool is abandoned (leaked) and the child builds its own.
static void drop_inherited_pool() {
    if (g_pool && g_pool_pid != getpid()) new std::shared_ptr<Pool>(std::move(g_pool));
}

static std::shared_ptr<Pool> pool() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    drop_inherited_pool();
    if (!g_pool) {
        if (g_threads == 0) g_threads = default_threads();
        g_pool = std::make_shared<Pool>(g_threads);
        g_pool_pid = getpid();
    }
    return g_pool;
}

static void set_threads(int threads) {
    if (threads < 1) throw std::invalid_argument("adam threads must be >= 1, got " + std::to_string(threads));
    std::shared_ptr<Pool> old;
    {
        std::lock_guard<std::mutex> lock(g_pool_mutex);
        drop_inherited_pool();
        if (threads == g_threads && g_pool) return;
        g_threads = threads;
        old = std::move(g_pool);  // a call in flight keeps its pool alive until it returns
    }
}

static int get_threads() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    return g_threads == 0 ? default_threads() : g_threads;
}

// Below this many elements a call runs on the calling thread alone: waking workers costs more than it saves.
static constexpr size_t kMinParallel = 1 << 15;
// From this size of `out` on, it is written with streaming stores: it is not read by the update, so a normal store
// would first read every line of it from memory (and then evict the states the next call may want).
static constexpr size_t kStreamOutBytes = 1 << 20;
// Split points are multiples of this many elements, so every thread's range starts on a cache line of every buffer.
static constexpr size_t kSplitAlign = 64;
// Work is handed out in chunks of about n / (threads * kChunksPerThread) elements, never below kMinChunk (a 64 KiB
// run of each fp32 buffer).
static constexpr size_t kMinChunk = 1 << 14;
static constexpr size_t kChunksPerThread = 4;

// Runs body(begin, end) over [0, n) on the pool. The range is cut into contiguous chunks (a few per thread, each
// long enough for the hardware prefetchers to stream every buffer) that the threads claim in order: on a dedicated
// machine that is a static split, and when another process takes a core for a while, the other threads take over
// its chunks instead of waiting for it.
template <class Body>
static void parallel_ranges(size_t n, const Body& body) {
    if (n == 0) return;
    std::shared_ptr<Pool> p = pool();
    int threads = n < kMinParallel ? 1 : p->threads();
    if (threads == 1) {
        body(0, n);
        return;
    }
    size_t chunk = std::max(kMinChunk, n / (static_cast<size_t>(threads) * kChunksPerThread));
    chunk = (chunk + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
    size_t chunks = (n + chunk - 1) / chunk;
    std::atomic<size_t> next{0};
    std::function<void(int)> job = [&](int) {
        for (size_t k = next.fetch_add(1, std::memory_order_relaxed); k < chunks;
             k = next.fetch_add(1, std::memory_order_relaxed)) {
            body(k * chunk, std::min(n, (k + 1) * chunk));
        }
    };
    p->run(static_cast<int>(std::min<size_t>(chunks, static_cast<size_t>(threads))), job);
}

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
    m.def("adam_set_threads", &A::set_threads, py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
          "Threads (the caller included) that split each adam_step; the pool is rebuilt on the next call.");
    m.def("adam_threads", &A::get_threads);
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
