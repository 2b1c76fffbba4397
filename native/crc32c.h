// CRC32C (Castagnoli): SSE4.2 instruction when the CPU has it (checked at run time), slicing-by-8 otherwise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace angel {

// Page checksums are computed over fixed 1 MiB blocks so that parallel workers can each checksum their part.
constexpr size_t kChecksumBlock = size_t(1) << 20;

uint32_t crc32c(const uint8_t* data, size_t n);
// One block: its CRC. Several: the CRC of the little-endian array of block CRCs.
uint32_t combine_block_crcs(const std::vector<uint32_t>& block_crcs);
uint32_t page_checksum(const uint8_t* data, size_t n);
const char* crc32c_impl_name();

}  // namespace angel
