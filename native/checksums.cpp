// Python bindings of the checksums (crc32c.cpp): the page checksum the SSD engine computes, and a plain CRC-32C.
#include "crc32c.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

namespace py = pybind11;

// Calls below this many bytes of work keep the GIL (a CRC-32C of 1 MiB takes tens of microseconds): releasing it
// lets another Python thread take it, and this one then waits for it back, up to the interpreter's switch interval.
constexpr size_t kReleaseGilBytes = size_t{1} << 20;
// copy_crc32c copies this much, then checksums it while it is still in the cache (L2 holds it), and goes on.
constexpr size_t kCopyPiece = size_t{128} << 10;

namespace {

// A requested buffer's bytes and their count; `who` names the call and the argument in the error.
std::pair<uint8_t*, size_t> contiguous_bytes(const py::buffer_info& info, const char* who) {
    if (info.ndim != 1 || info.strides[0] != info.itemsize)
        throw py::value_error(std::string(who) + " must be a contiguous one-dimensional buffer");
    return {static_cast<uint8_t*>(info.ptr), static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize)};
}

uint32_t copy_crc(uint8_t* dst, const uint8_t* src, size_t n, uint32_t crc) {
    for (size_t at = 0; at < n; at += kCopyPiece) {
        size_t piece = std::min(kCopyPiece, n - at);
        std::memcpy(dst + at, src + at, piece);
        crc = angel::crc32c_extend(crc, dst + at, piece);
    }
    return crc;
}

}  // namespace

void register_checksums(py::module_& m) {
    m.def(
        "page_checksum",
        [](uintptr_t buf, size_t nbytes) {
            return angel::page_checksum(reinterpret_cast<const uint8_t*>(buf), nbytes);
        },
        py::arg("buffer"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
        "CRC32C page checksum over 1 MiB blocks (the same value the engine computes).");
    m.def(
        "crc32c",
        [](py::buffer data, uint32_t value) {
            py::buffer_info info = data.request();  // held (and the buffer with it) while the GIL is released
            auto [bytes, nbytes] = contiguous_bytes(info, "crc32c: the data");
            if (nbytes < kReleaseGilBytes) return angel::crc32c_extend(value, bytes, nbytes);  // tens of us
            py::gil_scoped_release release;
            return angel::crc32c_extend(value, bytes, nbytes);
        },
        py::arg("data"), py::arg("value") = 0,
        "CRC-32C (Castagnoli) of a buffer's bytes, continuing from `value` (as zlib.crc32 continues CRC-32).");
    m.def(
        "copy_crc32c",
        [](py::buffer dst, py::buffer src, uint32_t value) {
            py::buffer_info out = dst.request(true), in = src.request();  // held while the GIL is released
            auto [to, room] = contiguous_bytes(out, "copy_crc32c: the destination");
            auto [from, nbytes] = contiguous_bytes(in, "copy_crc32c: the source");
            if (nbytes != room)
                throw py::value_error("copy_crc32c: the source and the destination differ in size");
            if (nbytes < kReleaseGilBytes) return copy_crc(to, from, nbytes, value);
            py::gil_scoped_release release;
            return copy_crc(to, from, nbytes, value);
        },
        py::arg("dst"), py::arg("src"), py::arg("value") = 0,
        "Copy `src` into `dst` (as many bytes) and return the CRC-32C of those bytes continuing from `value`: one "
        "pass over memory instead of a copy and then a checksum.");
    m.attr("CHECKSUM_BLOCK") = angel::kChecksumBlock;
    m.def("crc32c_impl", &angel::crc32c_impl_name);
}
