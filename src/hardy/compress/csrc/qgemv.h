// The fused quantized products (qgemv.cpp), shared with the fused decode layer (decode_layer.cpp).
#pragma once
#include <torch/extension.h>

torch::Tensor q4_gemv(torch::Tensor x_in, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t group);
torch::Tensor q8_gemv(torch::Tensor x_in, torch::Tensor codes, torch::Tensor scales, int64_t group);
std::vector<torch::Tensor> qgemv_many(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                                      const std::vector<int64_t>& groups);
torch::Tensor decode_layer(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor attn_norm, torch::Tensor ffn_norm, double eps, std::vector<torch::Tensor> w,
                           std::vector<int64_t> groups, torch::Tensor kc, torch::Tensor vc, int64_t head_dim);
