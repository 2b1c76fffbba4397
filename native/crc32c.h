// CRC32C (Castagnoli): SSE4.2 instruction when the CPU has it (checked at run time), slicing-by-8 otherwise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace angel {

// Page checksums are computed over fixed 256 KiB blocks: parallel workers each checksum their part, and one
// worker checksums four blocks at once (independent CRC chains keep the crc32 unit busy).
constexpr size_t kChecksumBlock = size_t(256) << 10;

uint32_t crc32c(const uint8_t* data, size_t n);
// The CRC32C of (the bytes whose CRC32C is `crc`) followed by data[0, n): crc32c_extend(0, d, n) == crc32c(d, n).
uint32_t crc32c_extend(uint32_t crc, const uint8_t* data, size_t n);
// CRC32C of each kChecksumBlock-sized block of data[0, n) into out[0, ceil(n / block)).
void crc32c_blocks(const uint8_t* data, size_t n, uint32_t* out);
// One block: its CRC. Several: the CRC of the little-endian array of block CRCs.
uint32_t combine_block_crcs(const std::vector<uint32_t>& block_crcs);
uint32_t page_checksum(const uint8_t* data, size_t n);
const char* crc32c_impl_name();

}  // namespace angel
