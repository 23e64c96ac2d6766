// Fused quantized matrix-vector products for decoding on CPU (hardy.compress.kernels).
//
// int8 weights (codes with an fp16 scale per (row, group), docs/quantization.md) and int4 weights
// (GGUF Q4 order, fp16 scale/min per (row, group) on disk) are re-laid at load in tiles of 8
// interleaved rows (q4_job, q8_job; hardy.compress.kernels.tile_codes).
// Activations are quantized on the fly to int8 per block of 32 (scale max|x|/127), as llama.cpp
// does on AVX2, so the inner products run as 8-bit integer multiply-adds. With AVX2 the block dot
// product is maddubs + madd (32 multiply-adds in two instructions), with AVX-512 VNNI one dpbusd;
// elsewhere a scalar loop.
#include "qgemv.h"
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
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
      int8_t* q = xq + t * K + b * QK;
      int32_t sum = 0;
#ifdef HARDY_AVX2  // the same arithmetic 8 lanes at a time (round to nearest even, like nearbyint)
      __m256 f[4], m = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.f);
      for (int j = 0; j < 4; ++j) {
        f[j] = _mm256_loadu_ps(v + 8 * j);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, f[j]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      __m256i n[4];
      for (int j = 0; j < 4; ++j)
        n[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(f[j], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
      s = _mm_hadd_epi32(s, s);
      sum = _mm_cvtsi128_si32(_mm_hadd_epi32(s, s));
      // packs work within 128-bit lanes: the permute puts the 32 bytes back in order
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
      float amax = 0.f;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      for (int i = 0; i < QK; ++i) {
        q[i] = (int8_t)std::nearbyint(v[i] * id);
        sum += q[i];
      }
#endif
      dx[t * nb + b] = d;
      // the sum of the *quantized* block, so that an asymmetric grid's offset meets the same x
      // as its codes do: the product is then exactly dequantized w · dequantized x (llama.cpp's q8_1)
      xs[t * nb + b] = d * (float)sum;
    }
  }
}

// The activations of one call, quantized: int8 codes, per-block scales and per-block sums (plain
// vectors: decode makes ~120 of these per token, and tensors cost more to create).
struct QuantizedInput {
  int64_t T, K;
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;
  explicit QuantizedInput(const at::Tensor& x)
      : T(x.size(0)), K(x.size(1)), codes(T * K), scales(T * K / QK), sums(T * K / QK) {
    quantize_rows(x.data_ptr<float>(), T, K, codes.data(), scales.data(), sums.data());
  }
};

#ifdef HARDY_AVX2
// 32 products of unsigned bytes u and signed bytes s, summed in 8 int32 lanes: one VNNI instruction
// where the CPU has it, else maddubs (pairs to int16; u, |s| <= 127 cannot saturate) + madd.
inline __m256i dot_block(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {  // acc + dot_block(u, s)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, dot_block(u, s));
#endif
}
#endif

// The portable build's product of one row: Σ_g scale(g) · Σ_{b in g} dx[b] · dot(b), where dot(b)
// is the integer dot product of block b and dx[b] its activation scale.
template <typename Dot, typename Scale>
inline float scalar_groups(int64_t G, int64_t nb, int64_t bpg, const float* dx, Dot dot, Scale scale) {
  float acc = 0.f;
  for (int64_t g = 0, b0 = 0; g < G; ++g, b0 += bpg) {
    float part = 0.f;
    for (int64_t b = b0; b < std::min(nb, b0 + bpg); ++b) part += dx[b] * (float)dot(b);
    acc += scale(g) * part;
  }
  return acc;
}

// A Job computes a range of one matrix's tiles of 8 rows; the closure owns copies of everything it
// reads besides the tensors' storage, so a job can outlive the call that made it.
struct Job {
  std::function<void(int64_t, int64_t)> run;
  int64_t tiles;
};

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

// int4 weights in the kernel's tiled layout (hardy.compress.kernels.tile_codes): rows in tiles of 8,
// each tile's block of 32 columns as 128 bytes where bytes [32c + 4r, 32c + 4r + 4) are bytes
// [4c, 4c + 4) of row r's GGUF Q4 block (low nibbles: codes 4c..4c+3, high: 16+4c..16+4c+3); scales
// and mins as [tiles, groups, 8]. One 256-bit load then holds four codes of each of 8 rows, so the
// byte multiply-add against the same four activations broadcast leaves row r's dot product in lane
// r: no horizontal sums, and the scales of 8 rows apply in one vector product (llama.cpp repacks
// Q4_0 this way; SmolLM2 int4 decode 133 -> 184 tokens/s from this alone, BENCHMARKS.md).
// Each block also prefetches the weights PF_BYTES ahead (16 KB measured best of 4-64 KB).
// HasMin: the asymmetric grid (code · scale + min, Q4_1); without, the symmetric one ((code − 8) · scale,
// Q4_0), whose offset term −8 · scale · Σx needs no bytes beyond the scales: 18 instead of 20 per 32.
constexpr int64_t PF_BYTES = 16384;

// The tiles' own prefetch runs PF_BYTES ahead: a job starts the first PF_BYTES of its range itself.
inline void prefetch_start(const void* first, int64_t bytes) {
#ifdef HARDY_AVX2
  const char* p = static_cast<const char*>(first);
  for (int64_t off = 0, n = std::min<int64_t>(PF_BYTES, bytes); off < n; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
#endif
}
template <bool HasMin>
inline void q4_tile8(const uint8_t* W, const uint16_t* S, const uint16_t* M, const int8_t* xq, const float* dx,
                     const float* xg, int64_t nb, int64_t G, int64_t bpg, float* y, int64_t valid) {
  float out[8];
#ifdef HARDY_AVX2
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  for (int64_t g = 0, b0 = 0; g < G; ++g, b0 += bpg) {
    const int64_t b1 = std::min(nb, b0 + bpg);
    __m256 part = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* w = W + b * 128;
      _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES + 64), _MM_HINT_T0);
      const int8_t* x = xq + b * QK;
      __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        int32_t lo4, hi4;
        std::memcpy(&lo4, x + 4 * c, 4);
        std::memcpy(&hi4, x + 16 + 4 * c, 4);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
        d0 = dot_acc(d0, _mm256_and_si256(v, low), _mm256_set1_epi32(lo4));
        d1 = dot_acc(d1, _mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_set1_epi32(hi4));
      }
      part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1)), _mm256_set1_ps(dx[b]), part);
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 8 * g)));
    if constexpr (HasMin) {
      acc = _mm256_fmadd_ps(part, scale, acc);
      acc_min = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(M + 8 * g))),
                                _mm256_set1_ps(xg[g]), acc_min);
    } else {
      acc = _mm256_fmadd_ps(_mm256_sub_ps(part, _mm256_set1_ps(8.f * xg[g])), scale, acc);
    }
  }
  _mm256_storeu_ps(out, _mm256_add_ps(acc, acc_min));
#else
  for (int r = 0; r < 8; ++r) {
    auto dot = [&](int64_t b) {
      int32_t sum = 0;
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = W[b * 128 + 32 * c + 4 * r + i];
          sum += (byte & 0x0f) * xq[b * QK + 4 * c + i] + (byte >> 4) * xq[b * QK + 16 + 4 * c + i];
        }
      return sum;
    };
    out[r] = scalar_groups(G, nb, bpg, dx, dot, [&](int64_t g) { return half_to_float(S[8 * g + r]); });
    for (int64_t g = 0; g < G; ++g)
      out[r] += HasMin ? half_to_float(M[8 * g + r]) * xg[g] : -8.f * half_to_float(S[8 * g + r]) * xg[g];
  }
#endif
  std::memcpy(y, out, valid * sizeof(float));
}

Job q4_job(const QuantizedInput& in, const at::Tensor& tiled, const at::Tensor& scales, const at::Tensor& mins,
           int64_t group, int64_t N, float* Y) {
  const int64_t T = in.T, K = in.K, nb = K / QK;
  TORCH_CHECK(tiled.dtype() == at::kByte && tiled.is_contiguous() && tiled.size(1) * 2 == K && K % QK == 0 &&
              tiled.size(0) % 8 == 0 && N <= tiled.size(0) && tiled.size(0) < N + 8,
              "int4 weights: contiguous uint8 [rows rounded up to 8, K/2] in the tiled layout");
  const int64_t tiles = tiled.size(0) / 8, G = (K + group - 1) / group, bpg = group / QK;
  TORCH_CHECK(group % QK == 0 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.dim() == 3 && scales.size(0) == tiles && scales.size(1) == G && scales.size(2) == 8 &&
              (mins.numel() == 0 || (mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf &&
                                     mins.is_contiguous())),
              "int4 scales and mins: contiguous fp16 [tiles, groups, 8] (mins empty on the symmetric grid)");
  const uint8_t* W = tiled.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const bool has_min = mins.numel() > 0;
  const uint16_t* M = has_min ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  // Σ_g min_g · Σ_{k in g} x_k: the grid's offset needs only each group's activation sum.
  auto xg = std::make_shared<std::vector<float>>(T * G, 0.f);
  const float* XS = in.sums.data();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) (*xg)[t * G + b / bpg] += XS[t * nb + b];
  const int8_t* XQ = in.codes.data();
  const float* DX = in.scales.data();
  const auto tile = has_min ? q4_tile8<true> : q4_tile8<false>;  // the grid, chosen once per matrix
  auto run = [=](int64_t begin, int64_t end) {
    prefetch_start(W + begin * 4 * K, (end - begin) * 4 * K);
    for (int64_t i = begin; i < end; ++i)
      for (int64_t t = 0; t < T; ++t) {
        tile(W + i * 4 * K, S + i * G * 8, has_min ? M + i * G * 8 : nullptr, XQ + t * K, DX + t * nb,
             xg->data() + t * G, nb, G, bpg, Y + t * N + i * 8, std::min<int64_t>(8, N - i * 8));
      }
  };
  return Job{run, tiles};
}

// int8 weights (symmetric codes, an fp16 scale per (row, group)) in the same tiled layout as int4
// (hardy.compress.kernels.tile_codes): rows in tiles of 8, each tile's block of 32 columns as 256
// bytes where bytes [32c + 4r, 32c + 4r + 4) are row r's codes 4c..4c+3, scales [tiles, groups, 8].
// One 256-bit load holds four codes of each of 8 rows against four activations broadcast, so row r's
// dot product builds in lane r: no horizontal sum per row, the 8 rows' scales in one vector product.
// A row at a time (a horizontal sum and a scalar scale per row and block) streamed at under half
// int4's bytes per second, compute-bound (BENCHMARKS.md). The byte multiply-add takes one unsigned
// operand: |x| times w·sign(x).
inline void q8_tile8(const int8_t* W, const uint16_t* S, const int8_t* xq, const float* dx, int64_t nb,
                     int64_t G, int64_t bpg, float* y, int64_t valid) {
  float out[8];
#ifdef HARDY_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0, b0 = 0; g < G; ++g, b0 += bpg) {
    const int64_t b1 = std::min(nb, b0 + bpg);
    __m256 part = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* w = W + b * 256;
      for (int line = 0; line < 4; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES + 64 * line), _MM_HINT_T0);
      const int8_t* x = xq + b * QK;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      alignas(32) int8_t ax[QK];  // |x| once per block; each chunk then broadcasts 4 bytes of x and of |x|
      _mm256_store_si256(reinterpret_cast<__m256i*>(ax), _mm256_sign_epi8(xv, xv));
      __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
      for (int c = 0; c < 8; c += 2) {
        int32_t x0, x1, a0, a1;
        std::memcpy(&x0, x + 4 * c, 4);
        std::memcpy(&x1, x + 4 * c + 4, 4);
        std::memcpy(&a0, ax + 4 * c, 4);
        std::memcpy(&a1, ax + 4 * c + 4, 4);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c + 32));
        d0 = dot_acc(d0, _mm256_set1_epi32(a0), _mm256_sign_epi8(v0, _mm256_set1_epi32(x0)));
        d1 = dot_acc(d1, _mm256_set1_epi32(a1), _mm256_sign_epi8(v1, _mm256_set1_epi32(x1)));
      }
      part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1)), _mm256_set1_ps(dx[b]), part);
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 8 * g)));
    acc = _mm256_fmadd_ps(part, scale, acc);
  }
  _mm256_storeu_ps(out, acc);
#else
  for (int r = 0; r < 8; ++r) {
    auto dot = [&](int64_t b) {
      int32_t sum = 0;
      for (int c = 0; c < 8; ++c)
        for (int i = 0; i < 4; ++i) sum += (int32_t)W[b * 256 + 32 * c + 4 * r + i] * xq[b * QK + 4 * c + i];
      return sum;
    };
    out[r] = scalar_groups(G, nb, bpg, dx, dot, [&](int64_t g) { return half_to_float(S[8 * g + r]); });
  }
#endif
  std::memcpy(y, out, valid * sizeof(float));
}

Job q8_job(const QuantizedInput& in, const at::Tensor& tiled, const at::Tensor& scales, int64_t group, int64_t N,
           float* Y) {
  const int64_t T = in.T, K = in.K, nb = K / QK;
  TORCH_CHECK(tiled.dtype() == at::kChar && tiled.is_contiguous() && tiled.size(1) == K && K % QK == 0 &&
              tiled.size(0) % 8 == 0 && N <= tiled.size(0) && tiled.size(0) < N + 8,
              "int8 weights: contiguous int8 [rows rounded up to 8, K] in the tiled layout");
  const int64_t tiles = tiled.size(0) / 8, G = (K + group - 1) / group, bpg = group / QK;
  TORCH_CHECK(group % QK == 0 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.dim() == 3 && scales.size(0) == tiles && scales.size(1) == G && scales.size(2) == 8,
              "int8 scales: contiguous fp16 [tiles, groups, 8]");
  const int8_t* W = tiled.data_ptr<int8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const int8_t* XQ = in.codes.data();
  const float* DX = in.scales.data();
  auto run = [=](int64_t begin, int64_t end) {
    prefetch_start(W + begin * 8 * K, (end - begin) * 8 * K);
    for (int64_t i = begin; i < end; ++i)
      for (int64_t t = 0; t < T; ++t)
        q8_tile8(W + i * 8 * K, S + i * G * 8, XQ + t * K, DX + t * nb, nb, G, bpg, Y + t * N + i * 8,
                 std::min<int64_t>(8, N - i * 8));
  };
  return Job{run, tiles};
}

at::Tensor flat_rows(const at::Tensor& x_in) {
  const auto x = x_in.reshape({-1, x_in.size(-1)});
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [..., K]");
  return x;
}

at::Tensor shaped(const at::Tensor& y, const at::Tensor& x_in) {
  auto shape = x_in.sizes().vec();
  shape.back() = y.size(1);
  return y.view(shape);
}

}  // namespace

// Several matrices applied to the same x [T, K]: x is quantized once and all rows share one
// parallel region. w holds (qweight, scales, mins) per matrix (mins empty for int8), dims
// (group, rows) per matrix.
void check_on_cpu(const std::vector<at::Tensor>& tensors, const char* what) {
  for (const auto& t : tensors)
    TORCH_CHECK(!t.defined() || t.device().is_cpu(), "hardy's quantized kernels run on the CPU, but ", what,
                " has a tensor on ", t.device().str(), ": keep quantized models on the CPU (--device cpu)");
}

std::vector<at::Tensor> qgemv_many(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                   const std::vector<int64_t>& dims) {
  TORCH_CHECK(w.size() == 3 * (dims.size() / 2) && dims.size() % 2 == 0, "three tensors and two sizes per matrix");
  check_on_cpu({x}, "the input");
  check_on_cpu(w, "a quantized matrix");
  const QuantizedInput in(flat_rows(x));
  std::vector<at::Tensor> outs;
  std::vector<Job> jobs;
  for (size_t i = 0; i < dims.size() / 2; ++i) {
    const auto& qw = w[3 * i];
    const int64_t group = dims[2 * i], rows = dims[2 * i + 1];
    outs.push_back(at::empty({in.T, rows}, at::kFloat));
    float* Y = outs.back().data_ptr<float>();
    if (qw.scalar_type() == at::kByte) {
      jobs.push_back(q4_job(in, qw, w[3 * i + 1], w[3 * i + 2], group, rows, Y));
    } else {
      jobs.push_back(q8_job(in, qw, w[3 * i + 1], group, rows, Y));
    }
  }
  run_jobs(jobs);
  return outs;
}

// One matrix: y[t, o] = sum_k x[t, k] * w[o, k] for o < rows, x of any leading shape [..., K];
// int4: w = code * scale + min (tiled layout, q4_job), int8: w = code * scale (mins empty).
at::Tensor qgemv(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group,
                 int64_t rows) {
  return shaped(qgemv_many(x, {qweight, scales, mins}, {group, rows})[0], x);
}

// Row r of a tiled int8 or int4 matrix as float: code * scale (+ min), or (code - 8) * scale on the
// symmetric int4 grid (M null), as QuantTensor does. The group width is a multiple of 32, so the 32
// values of a block share one scale (and min).
static void dequant_row(const uint8_t* W4, const int8_t* W8, const uint16_t* S, const uint16_t* M, int64_t K, int64_t G,
                 int64_t group, int64_t r, float* y) {
  const int64_t nb = K / QK;
  if (W4) {
    const uint8_t* w = W4 + (r / 8) * 4 * K;
    const int64_t lane = r % 8, base = (r / 8) * G * 8 + lane;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = b * QK / group;
      const float s = half_to_float(S[base + g * 8]), m = M ? half_to_float(M[base + g * 8]) : 0.f;
      const float off = M ? 0.f : 8.f;
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 4; ++j) {
          const uint8_t byte = w[b * 128 + 32 * c + 4 * lane + j];
          y[b * QK + 4 * c + j] = ((float)(byte & 0x0f) - off) * s + m;
          y[b * QK + 16 + 4 * c + j] = ((float)(byte >> 4) - off) * s + m;
        }
    }
  } else {
    const int8_t* w = W8 + (r / 8) * 8 * K + 4 * (r % 8);
    const int64_t base = (r / 8) * G * 8 + r % 8;
    for (int64_t b = 0; b < nb; ++b) {
      const float s = half_to_float(S[base + (b * QK / group) * 8]);
      for (int64_t k = 0; k < QK; ++k) y[b * QK + k] = (float)w[b * 256 + 32 * (k / 4) + k % 4] * s;
    }
  }
}

// Some rows of a quantized matrix, dequantized to float [n, K]: embedding lookups (the tied table
// is the LM head's, so it arrives in the tiled layout). code * scale (+ min), as QuantTensor does.
at::Tensor dequant_rows(at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group,
                        at::Tensor rows) {
  check_on_cpu({qweight, scales, mins, rows}, "an embedding lookup");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && qweight.is_contiguous() &&
              scales.scalar_type() == at::kHalf && scales.is_contiguous(), "int64 row ids, contiguous tables");
  const bool int4 = qweight.scalar_type() == at::kByte;
  const int64_t K = int4 ? qweight.size(1) * 2 : qweight.size(1), n = rows.size(0);
  const int64_t G = scales.size(1), N = qweight.size(0);
  TORCH_CHECK(K % QK == 0 && group % QK == 0 && scales.dim() == 3 &&
              (mins.numel() == 0 || (int4 && mins.sizes() == scales.sizes())),
              "dequant_rows: tiled int8 or int4");
  auto out = at::empty({n, K}, at::kFloat);
  const int64_t* R = rows.data_ptr<int64_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* M = int4 && mins.numel() ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  const uint8_t* W4 = int4 ? qweight.data_ptr<uint8_t>() : nullptr;
  const int8_t* W8 = int4 ? nullptr : qweight.data_ptr<int8_t>();
  float* Y = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(R[i] >= 0 && R[i] < N, "row id out of range");
    dequant_row(W4, W8, S, M, K, G, group, R[i], Y + i * K);
  }
  return out;
}

// Rows [begin, begin + out.size(0)) of a tiled int8 or int4 matrix, dequantized into `out` (fp32 or
// bf16, contiguous [rows, K]) in one pass: prefill multiplies many tokens by a slab of the weights
// at a time, so neither the whole float matrix nor the unpacked codes are ever materialized.
void dequant_range(at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group, int64_t begin,
                   at::Tensor out) {
  check_on_cpu({qweight, scales, mins, out}, "a prefill dequantization");
  const bool int4 = qweight.scalar_type() == at::kByte, bf16 = out.scalar_type() == at::kBFloat16;
  const int64_t K = int4 ? qweight.size(1) * 2 : qweight.size(1), n = out.size(0);
  const int64_t G = scales.size(1), N = qweight.size(0);  // rows padded to whole tiles
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
              out.is_contiguous() && out.dim() == 2 && out.size(1) == K && (bf16 || out.scalar_type() == at::kFloat) &&
              begin >= 0 && begin + n <= N && K % QK == 0 && group % QK == 0 && scales.dim() == 3 &&
              (mins.numel() == 0 || (int4 && mins.sizes() == scales.sizes())),
              "dequant_range: tiled int8 or int4, rows in range, a contiguous fp32/bf16 [rows, K] output");
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* M = int4 && mins.numel() ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  const uint8_t* W4 = int4 ? qweight.data_ptr<uint8_t>() : nullptr;
  const int8_t* W8 = int4 ? nullptr : qweight.data_ptr<int8_t>();
  float* F = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* B = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(bf16 ? K : 0);
    for (int64_t i = lo; i < hi; ++i) {
      float* y = bf16 ? row.data() : F + i * K;
      dequant_row(W4, W8, S, M, K, G, group, begin + i, y);
      if (bf16)
        for (int64_t k = 0; k < K; ++k) B[i * K + k] = at::BFloat16(y[k]);  // round to nearest even
    }
  });
}

// The GGUF converters' shared pieces: their input is [source rows, blocks x bytes] on the CPU and every
// output row names a source row that exists (a tensor-parallel rank converts only its rows: fewer
// output rows than source rows); one row's bytes of a 32-value block (hardy's stored order: 16 for
// int4, 32 for int8) go to their places in the tile's 128 or 256, 4 bytes per 32-byte chunk.
// Returns the number of output rows.
static int64_t check_gguf_input(const at::Tensor& blocks, const at::Tensor& order, int64_t block_bytes,
                                const char* what) {
  check_on_cpu({blocks, order}, "a GGUF conversion");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) % block_bytes == 0 && order.scalar_type() == at::kLong && order.dim() == 1,
              what, ": contiguous uint8 [rows, blocks x ", block_bytes,
              " bytes] and one int64 source row per output row");
  const int64_t* ord = order.data_ptr<int64_t>();
  for (int64_t i = 0, n = order.numel(); i < n; ++i)
    TORCH_CHECK(ord[i] >= 0 && ord[i] < blocks.size(0), "source row out of range");
  return order.numel();
}

template <int Chunks = 4>
static inline void put_tiled(uint8_t* tile_block, int64_t lane, const uint8_t* bytes) {
  for (int c = 0; c < Chunks; ++c) std::memcpy(tile_block + 32 * c + 4 * lane, bytes + 4 * c, 4);
}

// GGUF Q4_0 / Q4_1 blocks (fp16 d [, fp16 m], 16 bytes of nibbles; `blocks` [rows, row bytes]) straight
// into the kernel's tiled int4 layout (tile_codes of hardy's stored layout, which is Q4_1's), output row
// i taken from source row order[i] (the q/k unpermutation) — one pass over the file's bytes instead
// of unpacking, re-laying and tiling in several. Q4_0 keeps its grid ((q - 8)·d: no mins, mins empty).
std::vector<at::Tensor> q4_gguf_to_tiled(at::Tensor blocks, bool has_min, at::Tensor order) {
  const int64_t B = has_min ? 20 : 18, rows = check_gguf_input(blocks, order, B, "q4_gguf_to_tiled");
  const int64_t nb = blocks.size(1) / B, K = nb * QK, tiles = (rows + 7) / 8;
  auto q = at::empty({tiles * 8, K / 2}, at::kByte);
  auto scales = at::empty({tiles, nb, 8}, at::kHalf);
  auto mins = has_min ? at::empty({tiles, nb, 8}, at::kHalf) : at::empty({0}, at::kHalf);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* Q = q.data_ptr<uint8_t>();
  uint16_t* S = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  uint16_t* M = has_min ? reinterpret_cast<uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  // tile by tile, so every write is sequential: block b of the tile gathers its 8 rows' bytes
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t tile = lo; tile < hi; ++tile) {
      const uint8_t* row[8];
      const int64_t valid = std::min<int64_t>(8, rows - tile * 8);
      for (int64_t lane = 0; lane < 8; ++lane) row[lane] = lane < valid ? src + ord[tile * 8 + lane] * nb * B : nullptr;
      uint8_t* out = Q + tile * 4 * K;
      for (int64_t b = 0; b < nb; ++b, out += 128) {
        uint16_t* s = S + (tile * nb + b) * 8;
        uint16_t* m = has_min ? M + (tile * nb + b) * 8 : nullptr;
        for (int64_t lane = 0; lane < 8; ++lane) {
          if (!row[lane]) {  // padding rows of the last tile: zero weights, scales and mins
            for (int c = 0; c < 4; ++c) std::memset(out + 32 * c + 4 * lane, 0, 4);
            s[lane] = 0;
            if (m) m[lane] = 0;
            continue;
          }
          const uint8_t* blk = row[lane] + b * B;
          std::memcpy(s + lane, blk, 2);
          if (has_min) std::memcpy(m + lane, blk + 2, 2);
          put_tiled(out, lane, blk + (has_min ? 4 : 2));
        }
      }
    }
  });
  return {q, scales, mins};
}

// GGUF Q8_0 blocks (fp16 d, 32 int8) straight into the kernel's tiled int8 layout: codes [rows rounded
// up to 8, K], fp16 scales [tiles, K/32, 8], output row i from source row order[i]; padding rows zero.
std::vector<at::Tensor> q8_gguf_to_tiled(at::Tensor blocks, at::Tensor order) {
  const int64_t rows = check_gguf_input(blocks, order, 34, "q8_gguf_to_tiled");
  const int64_t nb = blocks.size(1) / 34, K = nb * QK, tiles = (rows + 7) / 8;
  auto codes = at::zeros({tiles * 8, K}, at::kChar);
  auto scales = at::zeros({tiles, nb, 8}, at::kHalf);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* C = reinterpret_cast<uint8_t*>(codes.data_ptr<int8_t>());
  uint16_t* S = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {  // tile by tile: sequential writes
    for (int64_t tile = lo; tile < hi; ++tile)
      for (int64_t lane = 0; lane < std::min<int64_t>(8, rows - tile * 8); ++lane) {
        const uint8_t* row = src + ord[tile * 8 + lane] * nb * 34;
        for (int64_t b = 0; b < nb; ++b) {
          std::memcpy(S + (tile * nb + b) * 8 + lane, row + b * 34, 2);
          put_tiled<8>(C + tile * 8 * K + b * 256, lane, row + b * 34 + 2);
        }
      }
  });
  return {codes, scales};
}

// GGUF Q6_K super-blocks (ql[128], qh[64], int8 scales[16], fp16 d; 256 values each) into hardy's
// int8 g32 in the kernel's tiled layout: values d·sc·(q − 32) as llama.cpp's dequantize_row_q6_K computes them (fp32), then
// round-to-nearest on the symmetric int8 grid per 32 values with rtn's arithmetic (scale =
// fp16(max|v| / 127), code = round-half-even(v / scale)), so the result equals the Python path.
std::vector<at::Tensor> q6k_to_tiled(at::Tensor blocks) {
  check_on_cpu({blocks}, "a GGUF conversion");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) % 210 == 0, "q6k_to_tiled: contiguous uint8 [rows, super-blocks x 210]");
  const int64_t rows = blocks.size(0), nb = blocks.size(1) / 210, K = nb * 256, G = K / QK;
  auto codes = at::zeros({(rows + 7) / 8 * 8, K}, at::kChar);
  auto scales = at::zeros({(rows + 7) / 8, G, 8}, at::kHalf);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* C = reinterpret_cast<uint8_t*>(codes.data_ptr<int8_t>());
  at::Half* S = scales.data_ptr<at::Half>();
  at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
    float y[256];
    for (int64_t r = lo; r < hi; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = src + (r * nb + b) * 210;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        uint16_t dh;
        std::memcpy(&dh, blk + 208, 2);
        const float d = half_to_float(dh);
        for (int n = 0; n < 2; ++n) {  // two halves of 128 values
          float* out = y + 128 * n;
          const uint8_t* l = ql + 64 * n;
          const uint8_t* h = qh + 32 * n;
          const int8_t* s = sc + 8 * n;
          for (int i = 0; i < 32; ++i) {
            const int is = i / 16;
            const int q1 = (int)((l[i] & 0xF) | (((h[i] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((l[i + 32] & 0xF) | (((h[i] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((l[i] >> 4) | (((h[i] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4)) - 32;
            out[i] = d * s[is + 0] * q1;
            out[i + 32] = d * s[is + 2] * q2;
            out[i + 64] = d * s[is + 4] * q3;
            out[i + 96] = d * s[is + 6] * q4;
          }
        }
        for (int g = 0; g < 256 / QK; ++g) {
          const float* v = y + g * QK;
          float amax = 0.f;
          for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
          const at::Half sh = at::Half(amax / 127.f);
          float scale = (float)sh;
          if (scale == 0.f) scale = 1.f;
          S[((r / 8) * G + b * 8 + g) * 8 + r % 8] = at::Half(scale);
          int8_t c[QK];
          for (int i = 0; i < QK; ++i)
            c[i] = (int8_t)std::min(127.f, std::max(-127.f, std::nearbyint(v[i] / scale)));
          put_tiled<8>(C + (r / 8) * 8 * K + (b * 8 + g) * 256, r % 8, reinterpret_cast<const uint8_t*>(c));
        }
      }
    }
  });
  return {codes, scales};
}

// GGUF Q4_K super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales/mins, 128 bytes of
// nibbles; 256 values) into the tiled int4 g32 layout, output row i from source row order[i]: the
// codes unchanged (re-paired into hardy's nibble order), each sub-block's scale d·sc and min
// −dmin·m computed in fp32 as llama.cpp does and rounded to fp16 (as the numpy path rounds them).
std::vector<at::Tensor> q4k_to_tiled(at::Tensor blocks, at::Tensor order) {
  const int64_t rows = check_gguf_input(blocks, order, 144, "q4k_to_tiled");
  const int64_t nsb = blocks.size(1) / 144, nb = nsb * 8, K = nb * QK, tiles = (rows + 7) / 8;
  auto q = at::zeros({tiles * 8, K / 2}, at::kByte);
  auto scales = at::zeros({tiles, nb, 8}, at::kHalf);
  auto mins = at::zeros({tiles, nb, 8}, at::kHalf);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* Q = q.data_ptr<uint8_t>();
  at::Half* S = scales.data_ptr<at::Half>();
  at::Half* M = mins.data_ptr<at::Half>();
  at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t tile = i / 8, lane = i % 8;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* blk = src + (ord[i] * nsb + sb) * 144;
        uint16_t dh, mh;
        std::memcpy(&dh, blk, 2);
        std::memcpy(&mh, blk + 2, 2);
        const float d = half_to_float(dh), dmin = half_to_float(mh);
        const uint8_t* sc = blk + 4;
        const uint8_t* qs = blk + 16;
        for (int j = 0; j < 8; ++j) {
          int scale, mn;
          if (j < 4) {
            scale = sc[j] & 63;
            mn = sc[j + 4] & 63;
          } else {
            scale = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
            mn = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
          }
          const int64_t g = sb * 8 + j;
          S[(tile * nb + g) * 8 + lane] = at::Half(d * (float)scale);
          M[(tile * nb + g) * 8 + lane] = at::Half(-(dmin * (float)mn));
          const uint8_t* chunk = qs + 32 * (j / 2);
          uint8_t stored[16];
          for (int b = 0; b < 16; ++b)
            stored[b] = (j % 2 == 0) ? (uint8_t)((chunk[b] & 0x0F) | ((chunk[b + 16] & 0x0F) << 4))
                                     : (uint8_t)((chunk[b] >> 4) | (chunk[b + 16] & 0xF0));
          put_tiled(Q + tile * 4 * K + g * 128, lane, stored);
        }
      }
    }
  });
  return {q, scales, mins};
}

bool built_with_avx2() {
#ifdef HARDY_AVX2
  return true;
#else
  return false;
#endif
}

bool built_with_vnni() {
#if defined(HARDY_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return true;
#else
  return false;
#endif
}
