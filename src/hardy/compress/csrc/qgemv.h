// The fused quantized products (qgemv.cpp), shared with the fused decode layer (decode_layer.cpp).
#pragma once
#include <torch/extension.h>

std::vector<torch::Tensor> qgemv_many(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                                      const std::vector<int64_t>& dims);
// All transformer blocks of a model for one new token per row (decode_layer.cpp): built once with
// the blocks' weights, so a decode step passes only the activations and the KV caches.
struct DecodeStack {
  DecodeStack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> w, std::vector<int64_t> dims, double eps,
              int64_t head_dim);
  torch::Tensor operator()(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                           std::vector<torch::Tensor> kcs, std::vector<torch::Tensor> vcs) const;
  std::vector<torch::Tensor> norms, w;  // per block: attention and FFN norm; 7 x (qweight, scales, mins)
  std::vector<int64_t> dims;            // per block: 7 x (group, rows)
  double eps;
  int64_t head_dim;
};
