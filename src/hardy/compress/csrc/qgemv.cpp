// Fused quantized matrix-vector products for decoding on CPU (hardy.compress.kernels).
//
// Weights stay as stored by hardy compress (docs/quantization.md): 4-bit codes packed in GGUF Q4
// order with fp16 scale/min per (row, group), or int8 codes with an fp16 scale per (row, group).
// Activations are quantized on the fly to int8 per block of 32 (scale max|x|/127), as llama.cpp
// does on AVX2, so the inner products run as 8-bit integer multiply-adds. With AVX2 the block dot
// product is maddubs + madd (32 multiply-adds in two instructions); elsewhere a scalar loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define HARDY_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;

inline float half_to_float(uint16_t h) {
#ifdef HARDY_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) { bits = sign; }
    else {  // subnormal
      int e = -1; uint32_t m = mant;
      do { e++; m <<= 1; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) { bits = sign | 0x7f800000u | (mant << 13); }
  else { bits = sign | ((exp + 127 - 15) << 23) | (mant << 13); }
  float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

// x [T, K] float -> int8 codes [T, K], per-block scale [T, K/32], per-block float sum [T, K/32]
void quantize_rows(const float* x, int64_t T, int64_t K, int8_t* xq, float* dx, float* xs) {
  const int64_t nb = K / QK;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + t * K + b * QK;
      float amax = 0.f, sum = 0.f;
      for (int i = 0; i < QK; ++i) { amax = std::max(amax, std::fabs(v[i])); sum += v[i]; }
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      for (int i = 0; i < QK; ++i) xq[t * K + b * QK + i] = (int8_t)std::nearbyint(v[i] * id);
      dx[t * nb + b] = d;
      xs[t * nb + b] = sum;
    }
  }
}

// The activations of one call, quantized: int8 codes, per-block scales and per-block float sums.
struct QuantizedInput {
  torch::Tensor codes, scales, sums;
  explicit QuantizedInput(const torch::Tensor& x) {
    const int64_t T = x.size(0), K = x.size(1);
    codes = torch::empty({T, K}, torch::kInt8);
    scales = torch::empty({T, K / QK}, torch::kFloat32);
    sums = torch::empty({T, K / QK}, torch::kFloat32);
    quantize_rows(x.data_ptr<float>(), T, K, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), sums.data_ptr<float>());
  }
};

void check_input(const torch::Tensor& x, const torch::Tensor& scales, int64_t rows_k, int64_t group) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [..., K]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16, "fp16 scales");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % QK == 0 && rows_k == K && group % QK == 0 && scales.size(1) == (K + group - 1) / group,
              "shape mismatch");
}

#ifdef HARDY_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace

// y[t, o] = sum_k x[t, k] * (code[o, k] * scale[o, g] + min[o, g]),  g = k / group
torch::Tensor q4_gemv(torch::Tensor x_in, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t group) {
  // any leading shape: [..., K] -> [..., N], computed as [T, K] rows
  const auto x = x_in.reshape({-1, x_in.size(-1)});
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous(), "packed: contiguous uint8 [N, K/2]");
  TORCH_CHECK(mins.scalar_type() == torch::kFloat16 && mins.sizes() == scales.sizes(), "fp16 mins like scales");
  check_input(x, scales, packed.size(1) * 2, group);
  const int64_t T = x.size(0), K = x.size(1), N = packed.size(0), G = scales.size(1);
  const QuantizedInput in(x);
  auto y = torch::empty({T, N}, torch::kFloat32);
  const uint8_t* W = packed.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* M = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const int8_t* XQ = in.codes.data_ptr<int8_t>();
  const float* DX = in.scales.data_ptr<float>();
  const float* XS = in.sums.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t nb = K / QK, bpg = group / QK;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* w = W + o * (K / 2);
      for (int64_t t = 0; t < T; ++t) {
        float min_acc = 0.f;
#ifdef HARDY_AVX2
        __m256 acc = _mm256_setzero_ps();
        const __m256i mask = _mm256_set1_epi8(0x0f);
        const __m256i eight = _mm256_set1_epi8(8);
        const __m256i ones = _mm256_set1_epi16(1);
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t g = b / bpg;
          const float ws = half_to_float(S[o * G + g]);
          const float d = ws * DX[t * nb + b];
          // codes centred on 8: the rounding errors of x then meet weights of mean ~0, not ~7.5
          min_acc += (half_to_float(M[o * G + g]) + 8.f * ws) * XS[t * nb + b];
          const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
          const __m256i q = _mm256_sub_epi8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), mask), eight);
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(XQ + t * K + b * QK));
          const __m256i dot = _mm256_madd_epi16(
              _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(q, xv)), ones);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d), acc);
        }
        Y[t * N + o] = hsum8(acc) + min_acc;
#else
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t g = b / bpg;
          int32_t dot = 0;
          for (int i = 0; i < 16; ++i) {
            const uint8_t byte = w[b * 16 + i];
            dot += ((int32_t)(byte & 0x0f) - 8) * XQ[t * K + b * QK + i]
                 + ((int32_t)(byte >> 4) - 8) * XQ[t * K + b * QK + 16 + i];
          }
          const float ws = half_to_float(S[o * G + g]);
          acc += ws * DX[t * nb + b] * (float)dot;
          min_acc += (half_to_float(M[o * G + g]) + 8.f * ws) * XS[t * nb + b];
        }
        Y[t * N + o] = acc + min_acc;
#endif
      }
    }
  });
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// y[t, o] = sum_k x[t, k] * code[o, k] * scale[o, g]  (int8 symmetric; group 0 = per row)
torch::Tensor q8_gemv(torch::Tensor x_in, torch::Tensor codes, torch::Tensor scales, int64_t group) {
  const auto x = x_in.reshape({-1, x_in.size(-1)});
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.is_contiguous(), "codes: contiguous int8 [N, K]");
  check_input(x, scales, codes.size(1), group);
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0), G = scales.size(1);
  const QuantizedInput in(x);
  auto y = torch::empty({T, N}, torch::kFloat32);
  const int8_t* W = codes.data_ptr<int8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const int8_t* XQ = in.codes.data_ptr<int8_t>();
  const float* DX = in.scales.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t nb = K / QK, bpg = group / QK;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const int8_t* w = W + o * K;
      for (int64_t t = 0; t < T; ++t) {
#ifdef HARDY_AVX2
        __m256 acc = _mm256_setzero_ps();
        const __m256i ones = _mm256_set1_epi16(1);
        for (int64_t b = 0; b < nb; ++b) {
          const float d = half_to_float(S[o * G + b / bpg]) * DX[t * nb + b];
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * QK));
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(XQ + t * K + b * QK));
          // maddubs needs an unsigned operand: |x| times w carrying x's sign
          const __m256i dot = _mm256_madd_epi16(
              _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv)), ones);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d), acc);
        }
        Y[t * N + o] = hsum8(acc);
#else
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          int32_t dot = 0;
          for (int i = 0; i < QK; ++i) dot += (int32_t)w[b * QK + i] * XQ[t * K + b * QK + i];
          acc += half_to_float(S[o * G + b / bpg]) * DX[t * nb + b] * (float)dot;
        }
        Y[t * N + o] = acc;
#endif
      }
    }
  });
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_gemv", &q4_gemv, "int4 group-wise weights x int8-quantized activations");
  m.def("q8_gemv", &q8_gemv, "int8 weights x int8-quantized activations");
  m.def("has_avx2", []() {
#ifdef HARDY_AVX2
    return true;
#else
    return false;
#endif
  });
}
