// The angel_ptm._native extension: one module, each subsystem registers its own bindings.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_aio(py::module_& m);
void register_checksums(py::module_& m);
void register_adam(py::module_& m);

PYBIND11_MODULE(_native, m) {
    m.doc() = "angel-ptm native kernels: asynchronous SSD engine with CRC32C checksums";
    register_aio(m);
    register_checksums(m);
    register_adam(m);
}
