// The extension's Python module: pybind and torch's tensor casters are compiled here only, once.
#include "qgemv.h"
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qgemv", &qgemv, "int8 or int4 group-wise weights x int8-quantized activations");
  m.def("dequant_rows", &dequant_rows, "some rows of an int8 or tiled int4 matrix as float");
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, double, int64_t>(),
           "norms (2 per block), w (21 per block), dims (14 per block), eps, head_dim")
      .def("__call__", &DecodeStack::operator(), "x, positions, cos, sin, K caches, V caches -> x after every block");
  m.def("has_vnni", &built_with_vnni);
  m.def("has_avx2", &built_with_avx2);
}
