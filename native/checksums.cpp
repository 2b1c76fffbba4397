// Python bindings of the checksums (crc32c.cpp): the page checksum the SSD engine computes, and a plain CRC-32C.
#include "crc32c.h"

#include <pybind11/pybind11.h>

namespace py = pybind11;

// Calls below this many bytes of work keep the GIL (a CRC-32C of 1 MiB takes tens of microseconds): releasing it
// lets another Python thread take it, and this one then waits for it back, up to the interpreter's switch interval.
constexpr size_t kReleaseGilBytes = size_t{1} << 20;

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
            if (info.ndim != 1 || info.strides[0] != info.itemsize)
                throw py::value_error("crc32c: a contiguous one-dimensional buffer is needed");
            const auto* bytes = static_cast<const uint8_t*>(info.ptr);
            size_t nbytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
            if (nbytes < kReleaseGilBytes) return angel::crc32c_extend(value, bytes, nbytes);  // tens of us
            py::gil_scoped_release release;
            return angel::crc32c_extend(value, bytes, nbytes);
        },
        py::arg("data"), py::arg("value") = 0,
        "CRC-32C (Castagnoli) of a buffer's bytes, continuing from `value` (as zlib.crc32 continues CRC-32).");
    m.attr("CHECKSUM_BLOCK") = angel::kChecksumBlock;
    m.def("crc32c_impl", &angel::crc32c_impl_name);
}
