// The fused quantized products (qgemv.cpp) and the fused decode layer (decode_layer.cpp), bound to
// Python in bindings.cpp. Only ATen's core tensor header here, not <torch/extension.h>: that one is
// ~80% of a file's compile time (measured: 42 of 51 s), and only the bindings need pybind.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <vector>

// These kernels read host memory through data pointers: a tensor elsewhere (CUDA, meta) is refused
// with one message instead of being read as if it were host memory.
void check_on_cpu(const std::vector<at::Tensor>& tensors, const char* what);

at::Tensor qgemv(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group, int64_t rows);
at::Tensor dequant_rows(at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group, at::Tensor rows);
void dequant_range(at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group, int64_t begin,
                   at::Tensor out);
std::vector<at::Tensor> q4_gguf_to_tiled(at::Tensor blocks, bool has_min, at::Tensor order);
std::vector<at::Tensor> q8_gguf_to_tiled(at::Tensor blocks, at::Tensor order);
std::vector<at::Tensor> q6k_to_tiled(at::Tensor blocks);
std::vector<at::Tensor> q4k_to_tiled(at::Tensor blocks, at::Tensor order);
// The vector ISA this build's products use (the build flags decide: hardy.compress.kernels._isa).
bool built_with_avx2();
bool built_with_vnni();

std::vector<at::Tensor> qgemv_many(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                   const std::vector<int64_t>& dims);
// All transformer blocks of a model for one new token per row (decode_layer.cpp): built once with
// the blocks' weights, so a decode step passes only the activations and the KV caches.
struct DecodeStack {
  DecodeStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> w, std::vector<int64_t> dims, double eps,
              int64_t head_dim);
  at::Tensor operator()(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                        std::vector<at::Tensor> kcs, std::vector<at::Tensor> vcs) const;
  std::vector<at::Tensor> norms, w;  // per block: attention and FFN norm; 7 x (qweight, scales, mins)
  std::vector<int64_t> dims;         // per block: 7 x (group, rows)
  double eps;
  int64_t head_dim;
};
