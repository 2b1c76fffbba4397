// Scalar fp32 <-> bf16 / fp16 conversions, bit-exact with the vector paths (round to nearest even, NaN kept quiet).
#pragma once

#include <cstdint>
#include <cstring>

namespace angel {
namespace convert {

inline uint32_t f32_bits(float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
}
inline float bits_f32(uint32_t b) {
    float x;
    std::memcpy(&x, &b, 4);
    return x;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even on the bit pattern; a NaN keeps its sign and top payload and is forced quiet, so it can
// never round into an infinity.
inline uint16_t f32_to_bf16(float x) {
    uint32_t b = f32_bits(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x0040u);
    return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

inline float f16_to_f32(uint16_t h) {
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
inline uint16_t f32_to_f16(float x) {
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

}  // namespace convert
}  // namespace angel
