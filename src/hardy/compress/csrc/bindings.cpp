// The extension's Python module: pybind and torch's tensor casters are compiled here only, once.
#include "qgemv.h"
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <cstdint>
#include <string>

#ifndef HARDY_SOURCES_DIGEST
#define HARDY_SOURCES_DIGEST 0ULL  // a build that did not state it matches no sources
#endif

namespace py = pybind11;
// The long calls drop the GIL: the serving engine runs them on its own thread, and while one held it the
// HTTP threads could only stream tokens between steps (a client's gap grew with the step's length).
using nogil = py::call_guard<py::gil_scoped_release>;

// module_local: the install builds one module per ISA and a stale one may be imported before a fresh
// compile, so two modules binding these classes can live in one process
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qgemv", &qgemv, "int8 or int4 group-wise weights x int8-quantized activations", nogil());
  m.def("dequant_rows", &dequant_rows, "some rows of a tiled int8 or int4 matrix as float", nogil());
  m.def("dequant_range", &dequant_range, "consecutive rows of a tiled int8 or int4 matrix into an fp32/bf16 slab",
        nogil());
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>, double,
                    int64_t, bool, double, double>(),
           "norms (4 per block, post norms may be empty), w (3 per matrix: q, k, v, o, then gate, up, down of the "
           "MLP or of each expert), dims (2 per matrix), extras (q/k/v biases, q/k norms per block, empty where "
           "absent), windows, local rotary (per block), routers (per block, empty: dense), moe (3 per block: "
           "experts, top k, renormalize), eps, head_dim, gelu, query scale, softcap")
      .def("__call__", &DecodeStack::operator(),
           "x, positions, cos, sin, local cos, local sin, KV pool, block table -> x after every block", nogil());
  py::class_<MoEExperts>(m, "MoEExperts", py::module_local())
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, bool>(),
           "w (9 per expert: gate, up, down as qweight, scales, mins), dims (6 per expert), gelu")
      .def("__call__", &MoEExperts::operator(), "x [T, dim], experts [T, k] int64, weights [T, k] -> [T, dim]",
           nogil());
  m.def("q4_gguf_to_tiled", &q4_gguf_to_tiled, "GGUF Q4_0/Q4_1 blocks -> tiled int4 (qweight, scales, mins)");
  m.def("q8_gguf_to_tiled", &q8_gguf_to_tiled, "GGUF Q8_0 blocks -> tiled int8 codes and fp16 scales");
  m.def("q6k_to_tiled", &q6k_to_tiled, "GGUF Q6_K blocks -> the tiled 6-bit K-quant form (nibbles, int8 scales, bit planes and d)");
  m.def("q4k_to_tiled", &q4k_to_tiled, "GGUF Q4_K blocks -> the tiled K-quant form (qweight, sc/m bytes, d/dmin)");
  m.def("q5k_to_tiled", &q5k_to_tiled, "GGUF Q5_K blocks -> the tiled 5-bit K-quant form (qweight, sc/m bytes, fifth bits and d/dmin)");
  m.def("has_vnni", &built_with_vnni);
  m.def("has_avx2", &built_with_avx2);
  // what the loader checks before using a module the install built: torch's C++ ABI is per version
  m.def("built_for_torch", [] {
    return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
           std::to_string(TORCH_VERSION_PATCH);
  });
  m.def("sources_digest", [] { return static_cast<uint64_t>(HARDY_SOURCES_DIGEST); });
}
