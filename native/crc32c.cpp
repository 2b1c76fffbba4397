#include "crc32c.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define ANGEL_X86 1
#endif

namespace angel {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
    uint32_t t[8][256];
    Tables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; ++i)
            for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
};
const Tables& tables() {
    static const Tables instance;
    return instance;
}

uint32_t crc32c_soft(uint32_t crc, const uint8_t* p, size_t n) {
    const auto& t = tables().t;
    while (n >= 8) {
        uint64_t word;
        std::memcpy(&word, p, 8);
        word ^= crc;
        crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^
              t[4][(word >> 24) & 0xFF] ^ t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
              t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#ifdef ANGEL_X86
// The register after `len` zero bytes, as a linear map of the register before (CRC is linear over GF(2)):
// one 32-bit XOR of four table lookups. It joins independent chains: the register after A then B is
// shift_len(B)(register after A) ^ (register of B started from 0).
struct ZeroShift {
    uint32_t t[4][256];
};

__attribute__((target("sse4.2"))) ZeroShift make_zero_shift(size_t len) {  // len: a multiple of 8
    uint32_t basis[32];
    for (int i = 0; i < 32; ++i) {
        uint64_t c = uint64_t{1} << i;
        for (size_t k = 0; k < len / 8; ++k) c = _mm_crc32_u64(c, 0);
        basis[i] = static_cast<uint32_t>(c);
    }
    ZeroShift shift;
    for (int k = 0; k < 4; ++k)
        for (uint32_t b = 0; b < 256; ++b) {
            uint32_t v = 0;
            for (int j = 0; j < 8; ++j)
                if ((b >> j) & 1u) v ^= basis[8 * k + j];
            shift.t[k][b] = v;
        }
    return shift;
}

inline uint32_t apply(const ZeroShift& s, uint32_t c) {
    return s.t[0][c & 0xFF] ^ s.t[1][(c >> 8) & 0xFF] ^ s.t[2][(c >> 16) & 0xFF] ^ s.t[3][c >> 24];
}

constexpr size_t kLongRun = 32768;  // bytes per chain in one round of three chains (then 256: kShortRun)
constexpr size_t kShortRun = 256;

// `n_rounds` rounds of three chains over consecutive runs of `run` bytes each, joined after each round.
__attribute__((target("sse4.2"))) uint64_t crc32c_x3(uint64_t c0, const uint8_t*& p, size_t& n, size_t run,
                                                      const ZeroShift& shift) {
    while (n >= 3 * run) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < run; i += 8) {
            uint64_t w0, w1, w2;
            std::memcpy(&w0, p + i, 8);
            std::memcpy(&w1, p + run + i, 8);
            std::memcpy(&w2, p + 2 * run + i, 8);
            c0 = _mm_crc32_u64(c0, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
        c0 = apply(shift, apply(shift, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1)) ^
             static_cast<uint32_t>(c2);
        p += 3 * run;
        n -= 3 * run;
    }
    return c0;
}

// One stream, three chains at once: the crc32 instruction has a latency of 3 cycles but a throughput of 1.
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t crc, const uint8_t* p, size_t n) {
    static const ZeroShift long_shift = make_zero_shift(kLongRun), short_shift = make_zero_shift(kShortRun);
    uint64_t c = crc;
    c = crc32c_x3(c, p, n, kLongRun, long_shift);
    c = crc32c_x3(c, p, n, kShortRun, short_shift);
    while (n >= 8) {
        uint64_t word;
        std::memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = static_cast<uint32_t>(c);
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}
// Four independent blocks at once: the crc32 instruction has a latency of 3 cycles but a throughput of 1, so
// interleaving independent chains roughly triples the speed of one chain.
__attribute__((target("sse4.2"))) void crc32c_hw_x4(const uint8_t* const p[4], size_t n, uint32_t out[4]) {
    uint64_t c0 = ~0u, c1 = ~0u, c2 = ~0u, c3 = ~0u;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w0, w1, w2, w3;
        std::memcpy(&w0, p[0] + i, 8);
        std::memcpy(&w1, p[1] + i, 8);
        std::memcpy(&w2, p[2] + i, 8);
        std::memcpy(&w3, p[3] + i, 8);
        c0 = _mm_crc32_u64(c0, w0);
        c1 = _mm_crc32_u64(c1, w1);
        c2 = _mm_crc32_u64(c2, w2);
        c3 = _mm_crc32_u64(c3, w3);
    }
    uint64_t c[4] = {c0, c1, c2, c3};
    for (int k = 0; k < 4; ++k) {
        uint32_t c32 = static_cast<uint32_t>(c[k]);
        for (size_t j = i; j < n; ++j) c32 = _mm_crc32_u8(c32, p[k][j]);
        out[k] = ~c32;
    }
}
bool has_sse42() {
    static const bool yes = __builtin_cpu_supports("sse4.2");
    return yes;
}
#endif

}  // namespace

uint32_t crc32c_extend(uint32_t crc, const uint8_t* data, size_t n) {
#ifdef ANGEL_X86
    if (has_sse42()) return ~crc32c_hw(~crc, data, n);
#endif
    return ~crc32c_soft(~crc, data, n);
}

uint32_t crc32c(const uint8_t* data, size_t n) { return crc32c_extend(0, data, n); }

void crc32c_blocks(const uint8_t* data, size_t n, uint32_t* out) {
    size_t n_blocks = (n + kChecksumBlock - 1) / kChecksumBlock;
    size_t b = 0;
#ifdef ANGEL_X86
    if (has_sse42()) {
        // Groups of four whole blocks go through the interleaved kernel; the tail one by one.
        for (; b + 4 <= n_blocks && (b + 4) * kChecksumBlock <= n; b += 4) {
            const uint8_t* p[4] = {data + b * kChecksumBlock, data + (b + 1) * kChecksumBlock,
                                   data + (b + 2) * kChecksumBlock, data + (b + 3) * kChecksumBlock};
            crc32c_hw_x4(p, kChecksumBlock, out + b);
        }
    }
#endif
    for (; b < n_blocks; ++b) {
        size_t start = b * kChecksumBlock;
        out[b] = crc32c(data + start, std::min(kChecksumBlock, n - start));
    }
}

uint32_t combine_block_crcs(const std::vector<uint32_t>& block_crcs) {
    if (block_crcs.empty()) return crc32c(nullptr, 0);
    if (block_crcs.size() == 1) return block_crcs[0];
    std::vector<uint8_t> bytes(block_crcs.size() * 4);
    for (size_t i = 0; i < block_crcs.size(); ++i)
        for (int b = 0; b < 4; ++b) bytes[4 * i + b] = static_cast<uint8_t>(block_crcs[i] >> (8 * b));
    return crc32c(bytes.data(), bytes.size());
}

uint32_t page_checksum(const uint8_t* data, size_t n) {
    std::vector<uint32_t> blocks((n + kChecksumBlock - 1) / kChecksumBlock);
    crc32c_blocks(data, n, blocks.data());
    return combine_block_crcs(blocks);
}

const char* crc32c_impl_name() {
#ifdef ANGEL_X86
    if (has_sse42()) return "crc32c-sse4.2";
#endif
    return "crc32c-slicing-by-8";
}

}  // namespace angel
