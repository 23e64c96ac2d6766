// Fused quantized matrix-vector products for decoding on CPU (hardy.compress.kernels).
//
// Weights stay as stored by hardy compress (docs/quantization.md): 4-bit codes packed in GGUF Q4
// order with fp16 scale/min per (row, group), or int8 codes with an fp16 scale per (row, group).
// Activations are quantized on the fly to int8 per block of 32 (scale max|x|/127), as llama.cpp
// does on AVX2, so the inner products run as 8-bit integer multiply-adds. With AVX2 the block dot
// product is maddubs + madd (32 multiply-adds in two instructions), with AVX-512 VNNI one dpbusd;
// elsewhere a scalar loop.
#include "qgemv.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
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

// x [T, K] float -> int8 codes [T, K], per-block scale [T, K/32], per-block sum of the quantized x [T, K/32]
void quantize_rows(const float* x, int64_t T, int64_t K, int8_t* xq, float* dx, float* xs) {
  const int64_t nb = K / QK;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + t * K + b * QK;
      float amax = 0.f;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < QK; ++i) {
        const int8_t q = (int8_t)std::nearbyint(v[i] * id);
        xq[t * K + b * QK + i] = q;
        sum += q;
      }
      dx[t * nb + b] = d;
      // the sum of the *quantized* block, so that an asymmetric grid's offset meets the same x
      // as its codes do: the product is then exactly dequantized w · dequantized x (llama.cpp's q8_1)
      xs[t * nb + b] = d * (float)sum;
    }
  }
}

// The activations of one call, quantized: int8 codes, per-block scales and per-block sums.
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

// 32 products of unsigned bytes u and signed bytes s, summed in 8 int32 lanes: one VNNI instruction
// where the CPU has it, else maddubs (pairs to int16; u, |s| <= 127 cannot saturate) + madd.
inline __m256i dot_block(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i unpack_q4(const uint8_t* w) {  // 16 bytes -> 32 codes in [0, 15] (GGUF Q4 order)
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), _mm256_set1_epi8(0x0f));
}
#endif

// The shared body of both products: rows in tiles of R (R accumulators share each activation
// load), groups outermost so no division runs in the inner loop; within a group the activation
// scale is applied per block and the weight scale once per group. `Codes` gives a block's 32 weight
// codes: unsigned 4-bit ones multiply x directly, signed 8-bit ones go through |x| and w·sign(x)
// (the byte multiply-add takes one unsigned operand). `min_terms` adds an asymmetric grid's offset.
template <int R, bool Signed, typename Codes>
inline void tile(int64_t o, int64_t t, int64_t K, int64_t N, int64_t G, int64_t bpg, const uint16_t* S,
                 const int8_t* XQ, const float* DX, Codes codes, float* Y, const float* min_terms) {
  const int64_t nb = K / QK;
#ifdef HARDY_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  if (bpg == 1) {  // groups of 32 (GGUF Q4_1 / Q8_0): one scale product per block, no partial sums
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(XQ + t * K + b * QK));
      const __m256i ax = Signed ? _mm256_sign_epi8(xv, xv) : xv;
      const float d = DX[t * nb + b];
      for (int r = 0; r < R; ++r) {
        const __m256i dot = Signed ? dot_block(ax, _mm256_sign_epi8(codes(o + r, b), xv)) : dot_block(codes(o + r, b), xv);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * half_to_float(S[(o + r) * G + b])), acc[r]);
      }
    }
  } else
  for (int64_t g = 0, b0 = 0; g < G; ++g, b0 += bpg) {
    const int64_t b1 = std::min(nb, b0 + bpg);
    __m256 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(XQ + t * K + b * QK));
      const __m256i ax = Signed ? _mm256_sign_epi8(xv, xv) : xv;
      const __m256 d = _mm256_set1_ps(DX[t * nb + b]);
      for (int r = 0; r < R; ++r) {
        const __m256i dot = Signed ? dot_block(ax, _mm256_sign_epi8(codes(o + r, b), xv)) : dot_block(codes(o + r, b), xv);
        part[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, part[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(part[r], _mm256_set1_ps(half_to_float(S[(o + r) * G + g])), acc[r]);
  }
  for (int r = 0; r < R; ++r) Y[t * N + o + r] = hsum8(acc[r]) + (min_terms ? min_terms[r] : 0.f);
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t g = 0, b0 = 0; g < G; ++g, b0 += bpg) {
      const int64_t b1 = std::min(nb, b0 + bpg);
      float part = 0.f;
      for (int64_t b = b0; b < b1; ++b) {
        int8_t w[QK];
        codes(o + r, b, w);
        int32_t dot = 0;
        for (int i = 0; i < QK; ++i) dot += (int32_t)w[i] * XQ[t * K + b * QK + i];
        part += DX[t * nb + b] * (float)dot;
      }
      acc += half_to_float(S[(o + r) * G + g]) * part;
    }
    Y[t * N + o + r] = acc + (min_terms ? min_terms[r] : 0.f);
  }
#endif
}

// Rows per tile, measured on SmolLM2 decode (2 threads, Zen 4): int8 is fastest one row at a time,
// int4 two rows at a time. A Job computes a range of one matrix's tiles; the closures own copies of
// everything they read besides the tensors' storage, so a job can outlive the call that made it.
struct Job {
  std::function<void(int64_t, int64_t)> run;
  int64_t tiles;
};

template <int TILE, bool Signed, typename Codes, typename MinTerm>
Job rows_job(int64_t T, int64_t K, int64_t N, int64_t G, int64_t bpg, const uint16_t* S, const QuantizedInput& in,
             Codes codes, MinTerm min_term, bool asymmetric, float* Y) {
  const int8_t* XQ = in.codes.data_ptr<int8_t>();
  const float* DX = in.scales.data_ptr<float>();
  auto run = [=](int64_t begin, int64_t end) {
    float mins[TILE];
    for (int64_t tile_i = begin; tile_i < end; ++tile_i) {
      const int64_t o = tile_i * TILE;
      for (int64_t t = 0; t < T; ++t) {
        if (o + TILE <= N) {
          if (asymmetric) for (int r = 0; r < TILE; ++r) mins[r] = min_term(o + r, t);
          tile<TILE, Signed>(o, t, K, N, G, bpg, S, XQ, DX, codes, Y, asymmetric ? mins : nullptr);
        } else {
          for (int64_t row = o; row < N; ++row) {
            if (asymmetric) mins[0] = min_term(row, t);
            tile<1, Signed>(row, t, K, N, G, bpg, S, XQ, DX, codes, Y, asymmetric ? mins : nullptr);
          }
        }
      }
    }
  };
  return Job{run, (N + TILE - 1) / TILE};
}

// All jobs' tiles in one parallel region: one fork/join for q, k and v (or gate and up) together.
void run_jobs(const std::vector<Job>& jobs) {
  int64_t total = 0;
  for (const auto& j : jobs) total += j.tiles;
  at::parallel_for(0, total, 8, [&](int64_t begin, int64_t end) {
    int64_t offset = 0;
    for (const auto& j : jobs) {
      const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + j.tiles);
      if (lo < hi) j.run(lo - offset, hi - offset);
      offset += j.tiles;
    }
  });
}

Job q4_job(const QuantizedInput& in, const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& mins,
           int64_t group, float* Y) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous(), "packed: contiguous uint8 [N, K/2]");
  TORCH_CHECK(mins.scalar_type() == torch::kFloat16 && mins.sizes() == scales.sizes(), "fp16 mins like scales");
  check_input(in.codes, scales, packed.size(1) * 2, group);
  const int64_t T = in.codes.size(0), K = in.codes.size(1), N = packed.size(0), G = scales.size(1);
  const uint8_t* W = packed.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* M = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const int64_t nb = K / QK, bpg = group / QK;
  // Σ_g min_g · Σ_{k in g} x_k: the grid's offset needs only each group's activation sum.
  auto xg = std::make_shared<std::vector<float>>(T * G, 0.f);
  const float* XS = in.sums.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) (*xg)[t * G + b / bpg] += XS[t * nb + b];
  auto min_term = [=](int64_t o, int64_t t) {
    const uint16_t* m = M + o * G;
    const float* x = xg->data() + t * G;
    float sum = 0.f;
    int64_t g = 0;
#ifdef HARDY_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; g + 8 <= G; g += 8)
      acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g))),
                            _mm256_loadu_ps(x + g), acc);
    sum = hsum8(acc);
#endif
    for (; g < G; ++g) sum += half_to_float(m[g]) * x[g];
    return sum;
  };
  const int64_t row_bytes = K / 2;
#ifdef HARDY_AVX2
  auto codes = [=](int64_t o, int64_t b) { return unpack_q4(W + o * row_bytes + b * 16); };
#else
  auto codes = [=](int64_t o, int64_t b, int8_t* out) {
    for (int i = 0; i < 16; ++i) {
      const uint8_t byte = W[o * row_bytes + b * 16 + i];
      out[i] = (int8_t)(byte & 0x0f);
      out[16 + i] = (int8_t)(byte >> 4);
    }
  };
#endif
  return rows_job<2, false>(T, K, N, G, bpg, S, in, codes, min_term, true, Y);
}

Job q8_job(const QuantizedInput& in, const torch::Tensor& codes_in, const torch::Tensor& scales, int64_t group,
           float* Y) {
  TORCH_CHECK(codes_in.dtype() == torch::kInt8 && codes_in.is_contiguous(), "codes: contiguous int8 [N, K]");
  check_input(in.codes, scales, codes_in.size(1), group);
  const int64_t T = in.codes.size(0), K = in.codes.size(1), N = codes_in.size(0), G = scales.size(1);
  const int8_t* W = codes_in.data_ptr<int8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
#ifdef HARDY_AVX2
  auto codes = [=](int64_t o, int64_t b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + o * K + b * QK));
  };
#else
  auto codes = [=](int64_t o, int64_t b, int8_t* out) { std::memcpy(out, W + o * K + b * QK, QK); };
#endif
  auto no_min = [](int64_t, int64_t) { return 0.f; };
  return rows_job<1, true>(T, K, N, G, group / QK, S, in, codes, no_min, false, Y);
}

torch::Tensor flat_rows(const torch::Tensor& x_in) {
  const auto x = x_in.reshape({-1, x_in.size(-1)});
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [..., K]");
  return x;
}

torch::Tensor shaped(const torch::Tensor& y, const torch::Tensor& x_in) {
  auto shape = x_in.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

}  // namespace

// y[t, o] = sum_k x[t, k] * (code[o, k] * scale[o, g] + min[o, g]),  g = k / group
torch::Tensor q4_gemv(torch::Tensor x_in, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, int64_t group) {
  const QuantizedInput in(flat_rows(x_in));  // any leading shape: [..., K] -> [..., N], as [T, K] rows
  auto y = torch::empty({in.codes.size(0), packed.size(0)}, torch::kFloat32);
  run_jobs({q4_job(in, packed, scales, mins, group, y.data_ptr<float>())});
  return shaped(y, x_in);
}

// y[t, o] = sum_k x[t, k] * code[o, k] * scale[o, g]  (int8 symmetric; group 0 = per row)
torch::Tensor q8_gemv(torch::Tensor x_in, torch::Tensor codes, torch::Tensor scales, int64_t group) {
  const QuantizedInput in(flat_rows(x_in));
  auto y = torch::empty({in.codes.size(0), codes.size(0)}, torch::kFloat32);
  run_jobs({q8_job(in, codes, scales, group, y.data_ptr<float>())});
  return shaped(y, x_in);
}

// Several matrices applied to the same x [T, K]: x is quantized once and all rows share one
// parallel region. w holds (qweight, scales, mins) per matrix (mins empty for int8).
std::vector<torch::Tensor> qgemv_many(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                                      const std::vector<int64_t>& groups) {
  const QuantizedInput in(flat_rows(x));
  std::vector<torch::Tensor> outs;
  std::vector<Job> jobs;
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& qw = w[3 * i];
    outs.push_back(torch::empty({in.codes.size(0), qw.size(0)}, torch::kFloat32));
    float* Y = outs.back().data_ptr<float>();
    jobs.push_back(qw.scalar_type() == torch::kUInt8 ? q4_job(in, qw, w[3 * i + 1], w[3 * i + 2], groups[i], Y)
                                                     : q8_job(in, qw, w[3 * i + 1], groups[i], Y));
  }
  run_jobs(jobs);
  return outs;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_gemv", &q4_gemv, "int4 group-wise weights x int8-quantized activations");
  m.def("q8_gemv", &q8_gemv, "int8 weights x int8-quantized activations");
  m.def("decode_layer", &decode_layer, "one transformer block for one new token per row (quantized linears)");
  m.def("has_vnni", []() {
#if defined(HARDY_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return true;
#else
    return false;
#endif
  });
  m.def("has_avx2", []() {
#ifdef HARDY_AVX2
    return true;
#else
    return false;
#endif
  });
}
