// Fused quantized matrix-vector products for decoding on CPU (hardy.compress.kernels).
//
// int8 weights (codes with an fp16 scale per (row, group), docs/quantization.md) and int4 weights
// (GGUF Q4 order, fp16 scale/min per (row, group) on disk) are re-laid at load in tiles of 8
// interleaved rows (matrix_tiles; hardy.compress.kernels.tile_codes).
// Activations are quantized on the fly to int8 per block of 32 (scale max|x|/127), as llama.cpp
// does on AVX2, so the inner products run as 8-bit integer multiply-adds. With AVX2 the block dot
// product is maddubs + madd (32 multiply-adds in two instructions), with AVX-512 VNNI one dpbusd;
// elsewhere a scalar loop.
#include "qgemv.h"
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

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

namespace {

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
// The 5-bit grid's fifth bits are laid out for the tile loop (hardy.formats.quantized.tile_codes): per
// tile and block, byte 4r + i holds in bit 2c + h the fifth bit of row r's code 16h + 4c + i, the code
// that byte meets in chunk c's low (h = 0) or high (h = 1) nibble. One shift and one mask then give
// a chunk's 32 fifth bits as 0 or 16 in place, instead of spreading bits of each row to bytes.
#ifdef HARDY_AVX2
template <int P>
inline __m256i fifth_bits(__m256i h) {  // bit P of every byte, as 16 or 0
  const __m256i sixteen = _mm256_set1_epi8(16);
  if constexpr (P < 4) return _mm256_and_si256(_mm256_slli_epi16(h, 4 - P), sixteen);
  else if constexpr (P > 4) return _mm256_and_si256(_mm256_srli_epi16(h, P - 4), sixteen);
  else return _mm256_and_si256(h, sixteen);
}
#endif

inline int fifth_bit(uint32_t lane, int code) {  // row's fifth bit of `code` from its 32-bit lane
  const int half = code / 16, c = (code % 16) / 4, i = code % 4;
  return (lane >> (8 * i + 2 * c + half)) & 1;
}

// A K-quant group's scale d·sc and min −dmin·m for one lane (SK: the tile's sc/m bytes, D: its d/dmin).
inline float k_scale(const uint8_t* SK, const uint16_t* D, int64_t g, int r) {
  return half_to_float(D[16 * (g / K_GROUPS) + r]) * (float)SK[16 * g + r];
}
inline float k_min(const uint8_t* SK, const uint16_t* D, int64_t g, int r) {
  return -(half_to_float(D[16 * (g / K_GROUPS) + 8 + r]) * (float)SK[16 * g + 8 + r]);
}

// The int4 tile; Bits5: with each code's fifth bit from H (the 5-bit grid, (code − 16) · scale);
// KQuant: the K-quant form (qgemv.h), S unused, SK its sc/m bytes and M its d/dmin.
template <bool HasMin, bool Bits5 = false, bool KQuant = false>
inline void q4_tile8(const uint8_t* W, const uint16_t* S, const uint16_t* M, const int8_t* xq, const float* dx,
                     const float* xg, int64_t nb, int64_t G, int64_t bpg, float* y, int64_t valid,
                     const uint32_t* H = nullptr, const uint8_t* SK = nullptr) {
  float out[8];
  const float offset = Bits5 ? 16.f : 8.f;
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
      __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256(), high;
      if constexpr (Bits5) {
        high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(H + 8 * b));
        _mm_prefetch(reinterpret_cast<const char*>(H + 8 * b) + PF_BYTES / 4, _MM_HINT_T0);
      }
      auto chunk = [&](int c, __m256i top0, __m256i top1) {
        int32_t lo4, hi4;
        std::memcpy(&lo4, x + 4 * c, 4);
        std::memcpy(&hi4, x + 16 + 4 * c, 4);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
        d0 = dot_acc(d0, _mm256_or_si256(_mm256_and_si256(v, low), top0), _mm256_set1_epi32(lo4));
        d1 = dot_acc(d1, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), top1), _mm256_set1_epi32(hi4));
      };
      if constexpr (Bits5) {
        chunk(0, fifth_bits<0>(high), fifth_bits<1>(high));
        chunk(1, fifth_bits<2>(high), fifth_bits<3>(high));
        chunk(2, fifth_bits<4>(high), fifth_bits<5>(high));
        chunk(3, fifth_bits<6>(high), fifth_bits<7>(high));
      } else {
        const __m256i zero = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) chunk(c, zero, zero);
      }
      part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1)), _mm256_set1_ps(dx[b]), part);
    }
    if constexpr (KQuant) {  // d·sc and dmin·m: products of an fp16 and a 6-bit integer, exact in fp32
      const uint16_t* D = M + 16 * (g / K_GROUPS);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(SK + 16 * g))));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(SK + 16 * g + 8))));
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(D)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(D + 8)));
      acc = _mm256_fmadd_ps(part, _mm256_mul_ps(d, sc), acc);
      acc_min = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, mn), _mm256_set1_ps(xg[g]), acc_min);
      continue;
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 8 * g)));
    if constexpr (HasMin) {
      acc = _mm256_fmadd_ps(part, scale, acc);
      acc_min = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(M + 8 * g))),
                                _mm256_set1_ps(xg[g]), acc_min);
    } else {
      acc = _mm256_fmadd_ps(_mm256_sub_ps(part, _mm256_set1_ps(offset * xg[g])), scale, acc);
    }
  }
  _mm256_storeu_ps(out, _mm256_add_ps(acc, acc_min));
#else
  for (int r = 0; r < 8; ++r) {
    auto dot = [&](int64_t b) {
      int32_t sum = 0;
      const uint32_t h = Bits5 ? H[8 * b + r] : 0;
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = W[b * 128 + 32 * c + 4 * r + i];
          const int32_t lo = (byte & 0x0f) | (Bits5 ? fifth_bit(h, 4 * c + i) << 4 : 0);
          const int32_t hi = (byte >> 4) | (Bits5 ? fifth_bit(h, 16 + 4 * c + i) << 4 : 0);
          sum += lo * xq[b * QK + 4 * c + i] + hi * xq[b * QK + 16 + 4 * c + i];
        }
      return sum;
    };
    if constexpr (KQuant) {
      out[r] = scalar_groups(G, nb, bpg, dx, dot, [&](int64_t g) { return k_scale(SK, M, g, r); });
      for (int64_t g = 0; g < G; ++g) out[r] += k_min(SK, M, g, r) * xg[g];
      continue;
    }
    out[r] = scalar_groups(G, nb, bpg, dx, dot, [&](int64_t g) { return half_to_float(S[8 * g + r]); });
    for (int64_t g = 0; g < G; ++g)
      out[r] += HasMin ? half_to_float(M[8 * g + r]) * xg[g] : -offset * half_to_float(S[8 * g + r]) * xg[g];
  }
#endif
  std::memcpy(y, out, valid * sizeof(float));
}

// The 6-bit K-quant tile (qgemv.h): per block, the low nibbles' products with x as int4's, the fifth and
// sixth bits added in place (16 and 32), each half block's sum (codes 0-15 in the low nibbles, 16-31 in
// the high ones) less 32 · that half's Σx, times d·sc of the half.
inline int six_bit_code(const uint8_t* W, const uint32_t* H5, const uint32_t* H6, int64_t b, int r, int j) {
  const uint8_t byte = W[b * 128 + 32 * ((j % 16) / 4) + 4 * r + j % 4];
  const int low = j < 16 ? (byte & 0x0f) : (byte >> 4);
  return low | fifth_bit(H5[8 * b + r], j) << 4 | fifth_bit(H6[8 * b + r], j) << 5;
}

// HS: 32 · Σx of each half block of this row of x [blocks, 2] (half_sums), the codes' offset term.
inline void half_sums(const int8_t* xq, int64_t nb, int32_t* hs) {
  for (int64_t b = 0; b < nb; ++b)
    for (int h = 0; h < 2; ++h) {
      int32_t s = 0;
      for (int j = 0; j < 16; ++j) s += xq[b * QK + 16 * h + j];
      hs[2 * b + h] = 32 * s;
    }
}

inline void q6_tile8(const uint8_t* W, const int8_t* SC, const uint32_t* H5, const uint32_t* H6, const float* D,
                     const int8_t* xq, const float* dx, const int32_t* HS, int64_t nb, float* y, int64_t valid) {
  float out[8];
#ifdef HARDY_AVX2
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = W + b * 128;
    _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES + 64), _MM_HINT_T0);
    const int8_t* x = xq + b * QK;
    const __m256i h5 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(H5 + 8 * b));
    const __m256i h6 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(H6 + 8 * b));
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
    auto chunk = [&](int c, __m256i top0, __m256i top1) {
      int32_t lo4, hi4;
      std::memcpy(&lo4, x + 4 * c, 4);
      std::memcpy(&hi4, x + 16 + 4 * c, 4);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
      d0 = dot_acc(d0, _mm256_or_si256(_mm256_and_si256(v, low), top0), _mm256_set1_epi32(lo4));
      d1 = dot_acc(d1, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), top1), _mm256_set1_epi32(hi4));
    };
    auto top = [&](auto five, auto six) { return _mm256_or_si256(five, _mm256_add_epi8(six, six)); };
    chunk(0, top(fifth_bits<0>(h5), fifth_bits<0>(h6)), top(fifth_bits<1>(h5), fifth_bits<1>(h6)));
    chunk(1, top(fifth_bits<2>(h5), fifth_bits<2>(h6)), top(fifth_bits<3>(h5), fifth_bits<3>(h6)));
    chunk(2, top(fifth_bits<4>(h5), fifth_bits<4>(h6)), top(fifth_bits<5>(h5), fifth_bits<5>(h6)));
    chunk(3, top(fifth_bits<6>(h5), fifth_bits<6>(h6)), top(fifth_bits<7>(h5), fifth_bits<7>(h6)));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(d0, _mm256_set1_epi32(HS[2 * b])));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(d1, _mm256_set1_epi32(HS[2 * b + 1])));
    const __m256 d = _mm256_loadu_ps(D + 8 * (b / K_GROUPS));
    const __m256 s_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(SC + 16 * b)))));
    const __m256 s_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(SC + 16 * b + 8)))));
    acc = _mm256_fmadd_ps(_mm256_fmadd_ps(lo, s_lo, _mm256_mul_ps(hi, s_hi)), _mm256_set1_ps(dx[b]), acc);
  }
  _mm256_storeu_ps(out, acc);
#else
  for (int r = 0; r < 8; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = D[8 * (b / K_GROUPS) + r];
      float part = 0.f;
      for (int h = 0; h < 2; ++h) {
        int32_t dot = 0;
        for (int j = 16 * h; j < 16 * h + 16; ++j) dot += six_bit_code(W, H5, H6, b, r, j) * xq[b * QK + j];
        part += (float)(dot - HS[2 * b + h]) * (d * (float)SC[16 * b + 8 * h + r]);
      }
      acc += dx[b] * part;
    }
    out[r] = acc;
  }
#endif
  std::memcpy(y, out, valid * sizeof(float));
}

// Row r of a 6-bit K-quant matrix as float: (code − 32) · (d·sc), as llama.cpp's dequantize_row_q6_K.
static void dequant_row6(const QMatrix& m, int64_t r, float* y) {
  const int64_t nb = m.K / QK, tile = r / 8;
  const int lane = r % 8;
  const uint8_t* W = m.w4 + tile * 4 * m.K;
  const uint32_t* H5 = m.high + tile * (2 * nb + nb / K_GROUPS) * 8;
  const uint32_t* H6 = H5 + nb * 8;
  const float* D = reinterpret_cast<const float*>(H5 + 2 * nb * 8);
  const int8_t* SC = m.k6scales + tile * 2 * nb * 8;
  for (int64_t b = 0; b < nb; ++b)
    for (int j = 0; j < QK; ++j) {
      const float scale = D[8 * (b / K_GROUPS) + lane] * (float)SC[16 * b + 8 * (j / 16) + lane];
      y[b * QK + j] = (float)(six_bit_code(W, H5, H6, b, lane, j) - 32) * scale;
    }
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

// One matrix's tiles against the activations of one call; the job owns its group sums.
Job matrix_job(const QuantizedInput& in, const QMatrix& m, float* Y) {
  auto xg = std::make_shared<std::vector<float>>(m.w4 ? in.T * m.groups : 0);
  if (m.w4) group_sums(m, in.T, in.sums.data(), xg->data());
  const int8_t* XQ = in.codes.data();
  const float* DX = in.scales.data();
  const int64_t T = in.T;
  return Job{[=](int64_t begin, int64_t end) { matrix_tiles(m, begin, end, T, XQ, DX, xg->data(), Y); }, m.tiles};
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

QMatrix quantized_matrix(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t group,
                         int64_t rows) {
  const bool int4 = qweight.scalar_type() == at::kByte;
  QMatrix m;
  m.K = int4 ? qweight.size(1) * 2 : qweight.size(1);
  m.rows = rows;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && m.K % QK == 0 && qweight.size(0) % 8 == 0 &&
              rows <= qweight.size(0) && qweight.size(0) < rows + 8 && (int4 || qweight.scalar_type() == at::kChar),
              "quantized weights: contiguous uint8 (int4) or int8 [rows rounded up to 8, K/2 or K] in the tiled layout");
  if (int4 && scales.scalar_type() == at::kChar) {  // the 6-bit K-quant form (qgemv.h)
    m.tiles = qweight.size(0) / 8;
    m.groups = m.K / QK;  // per block (its two halves' scales); group_sums is not used by this form
    m.blocks_per_group = 1;
    const int64_t nb = m.K / QK;
    TORCH_CHECK(group == 16 && nb % K_GROUPS == 0 && scales.is_contiguous() && scales.dim() == 3 &&
                scales.size(0) == m.tiles && scales.size(1) == 2 * nb && scales.size(2) == 8 &&
                mins.scalar_type() == at::kInt && mins.is_contiguous() && mins.dim() == 3 && mins.size(0) == m.tiles &&
                mins.size(1) == 2 * nb + nb / K_GROUPS && mins.size(2) == 8,
                "6-bit K-quant form: group 16, whole super-blocks of 256, int8 scales [tiles, 2 x blocks, 8] and "
                "int32 bit planes and d [tiles, 2 x blocks + super-blocks, 8]");
    m.w4 = qweight.data_ptr<uint8_t>();
    m.k6scales = scales.data_ptr<int8_t>();
    m.high = reinterpret_cast<const uint32_t*>(mins.data_ptr<int32_t>());
    return m;
  }
  TORCH_CHECK(group > 0 && group % QK == 0, "a group width that is a multiple of 32, not ", group);
  m.tiles = qweight.size(0) / 8;
  m.groups = (m.K + group - 1) / group;
  m.blocks_per_group = group / QK;
  if (int4 && scales.scalar_type() == at::kByte) {  // the K-quant form (qgemv.h)
    TORCH_CHECK(group == QK && m.groups % K_GROUPS == 0 && scales.is_contiguous() && scales.dim() == 3 &&
                scales.size(0) == m.tiles && scales.size(1) == 2 * m.groups && scales.size(2) == 8 &&
                mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.dim() == 3 &&
                mins.size(0) == m.tiles && mins.size(1) == 2 * m.groups / K_GROUPS && mins.size(2) == 8,
                "K-quant form: group 32, whole super-blocks of 256, uint8 sc/m [tiles, 2 x groups, 8] and fp16 "
                "d/dmin [tiles, 2 x super-blocks, 8]");
    m.w4 = qweight.data_ptr<uint8_t>();
    m.kscales = scales.data_ptr<uint8_t>();
    m.supers = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
    return m;
  }
  const bool bits5 = int4 && mins.numel() && mins.scalar_type() == at::kInt;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.dim() == 3 && scales.size(0) == m.tiles && scales.size(1) == m.groups && scales.size(2) == 8 &&
              (mins.numel() == 0 || (int4 && mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf &&
                                     mins.is_contiguous()) ||
               (bits5 && mins.is_contiguous() && mins.dim() == 3 && mins.size(0) == m.tiles &&
                mins.size(1) == m.K / QK && mins.size(2) == 8)),
              "quantized scales and mins: contiguous fp16 [tiles, groups, 8] (mins only on the asymmetric int4 grid; "
              "the 5-bit grid's fifth bits: int32 [tiles, blocks, 8])");
  m.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  if (int4) {
    m.w4 = qweight.data_ptr<uint8_t>();
    if (bits5) m.high = reinterpret_cast<const uint32_t*>(mins.data_ptr<int32_t>());
    else if (mins.numel()) m.mins = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  } else {
    m.w8 = qweight.data_ptr<int8_t>();
  }
  return m;
}

// Σ_g min_g · Σ_{k in g} x_k: the grid's offset needs only each group's activation sum.
void group_sums(const QMatrix& m, int64_t T, const float* block_sums, float* xg) {
  const int64_t nb = m.K / QK, G = m.groups, bpg = m.blocks_per_group;
  std::fill(xg, xg + T * G, 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) xg[t * G + b / bpg] += block_sums[t * nb + b];
}

void matrix_tiles(const QMatrix& m, int64_t begin, int64_t end, int64_t T, const int8_t* XQ, const float* DX,
                  const float* xg, float* Y) {
  if (begin >= end) return;
  const int64_t K = m.K, nb = K / QK, G = m.groups, bpg = m.blocks_per_group, N = m.rows;
  const uint16_t* S = m.scales;
  if (m.w4) {
    const uint8_t* W = m.w4;
    prefetch_start(W + begin * 4 * K, (end - begin) * 4 * K);
    // the grid, chosen once per matrix
    if (m.k6scales) {  // per tile: the planes and d [2 x blocks + super-blocks, 8], the scales [2 x blocks, 8]
      const int64_t aux = (2 * nb + nb / K_GROUPS) * 8;
      std::vector<int32_t> hs(T * 2 * nb);  // once per call, not per tile
      for (int64_t t = 0; t < T; ++t) half_sums(XQ + t * K, nb, hs.data() + t * 2 * nb);
      for (int64_t i = begin; i < end; ++i) {
        const uint32_t* H5 = m.high + i * aux;
        for (int64_t t = 0; t < T; ++t)
          q6_tile8(W + i * 4 * K, m.k6scales + i * 2 * nb * 8, H5, H5 + nb * 8, reinterpret_cast<const float*>(H5 + 2 * nb * 8),
                   XQ + t * K, DX + t * nb, hs.data() + t * 2 * nb, nb, Y + t * N + i * 8, std::min<int64_t>(8, N - i * 8));
      }
      return;
    }
    if (m.kscales) {  // per tile: 16 bytes of sc/m per group, 16 halves of d/dmin per super-block
      for (int64_t i = begin; i < end; ++i)
        for (int64_t t = 0; t < T; ++t)
          q4_tile8<true, false, true>(W + i * 4 * K, nullptr, m.supers + i * (G / K_GROUPS) * 16, XQ + t * K,
                                      DX + t * nb, xg + t * G, nb, G, bpg, Y + t * N + i * 8,
                                      std::min<int64_t>(8, N - i * 8), nullptr, m.kscales + i * G * 16);
      return;
    }
    const auto tile = m.high ? q4_tile8<false, true> : m.mins ? q4_tile8<true> : q4_tile8<false>;
    if (m.high) prefetch_start(m.high + begin * nb * 8, (end - begin) * K);
    for (int64_t i = begin; i < end; ++i)
      for (int64_t t = 0; t < T; ++t)
        tile(W + i * 4 * K, S + i * G * 8, m.mins ? m.mins + i * G * 8 : nullptr, XQ + t * K, DX + t * nb,
             xg + t * G, nb, G, bpg, Y + t * N + i * 8, std::min<int64_t>(8, N - i * 8),
             m.high ? m.high + i * nb * 8 : nullptr, nullptr);
  } else {
    const int8_t* W = m.w8;
    prefetch_start(W + begin * 8 * K, (end - begin) * 8 * K);
    for (int64_t i = begin; i < end; ++i)
      for (int64_t t = 0; t < T; ++t)
        q8_tile8(W + i * 8 * K, S + i * G * 8, XQ + t * K, DX + t * nb, nb, G, bpg, Y + t * N + i * 8,
                 std::min<int64_t>(8, N - i * 8));
  }
}

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
    const QMatrix m = quantized_matrix(qw, w[3 * i + 1], w[3 * i + 2], group, rows);
    TORCH_CHECK(m.K == in.K, "a quantized matrix of ", m.K, " columns applied to ", in.K, " inputs");
    jobs.push_back(matrix_job(in, m, Y));
  }
  run_jobs(jobs);
  return outs;
}

// One matrix: y[t, o] = sum_k x[t, k] * w[o, k] for o < rows, x of any leading shape [..., K];
// int4: w = code * scale + min (tiled layout, matrix_tiles), int8: w = code * scale (mins empty).
at::Tensor qgemv(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group,
                 int64_t rows) {
  return shaped(qgemv_many(x, {qweight, scales, mins}, {group, rows})[0], x);
}

// Row r of a tiled int8 or int4 matrix as float: code * scale (+ min), or (code - 8) * scale on the
// symmetric int4 grid (M null), as QuantTensor does. The group width is a multiple of 32, so the 32
// values of a block share one scale (and min).
// SK: the K-quant form's sc/m bytes (then M holds its d/dmin and S is unused).
static void dequant_row(const uint8_t* W4, const int8_t* W8, const uint16_t* S, const uint16_t* M, int64_t K, int64_t G,
                 int64_t group, int64_t r, float* y, const uint32_t* H = nullptr, const uint8_t* SK = nullptr) {
  const int64_t nb = K / QK;
  if (W4) {
    const uint8_t* w = W4 + (r / 8) * 4 * K;
    const int64_t lane = r % 8, base = (r / 8) * G * 8 + lane;
    const uint8_t* sk = SK ? SK + (r / 8) * G * 16 : nullptr;
    const uint16_t* dk = SK ? M + (r / 8) * (G / K_GROUPS) * 16 : nullptr;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = b * QK / group;
      const float s = SK ? k_scale(sk, dk, g, lane) : half_to_float(S[base + g * 8]);
      const float m = SK ? k_min(sk, dk, g, lane) : M ? half_to_float(M[base + g * 8]) : 0.f;
      const float off = M ? 0.f : H ? 16.f : 8.f;
      const uint32_t h = H ? H[(r / 8) * nb * 8 + b * 8 + lane] : 0;
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 4; ++j) {
          const uint8_t byte = w[b * 128 + 32 * c + 4 * lane + j];
          const int lo = (byte & 0x0f) | (H ? fifth_bit(h, 4 * c + j) << 4 : 0);
          const int hi = (byte >> 4) | (H ? fifth_bit(h, 16 + 4 * c + j) << 4 : 0);
          y[b * QK + 4 * c + j] = ((float)lo - off) * s + m;
          y[b * QK + 16 + 4 * c + j] = ((float)hi - off) * s + m;
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
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && qweight.is_contiguous() && scales.is_contiguous(),
              "int64 row ids, contiguous tables");
  const bool int4 = qweight.scalar_type() == at::kByte;
  const int64_t K = int4 ? qweight.size(1) * 2 : qweight.size(1), n = rows.size(0), N = qweight.size(0);
  const QMatrix q = quantized_matrix(qweight, scales, mins, group, N);  // checks every form's layout
  const int64_t G = q.groups;
  const bool bits5 = q.high != nullptr && !q.k6scales;
  auto out = at::empty({n, K}, at::kFloat);
  const int64_t* R = rows.data_ptr<int64_t>();
  const uint16_t* S = q.scales;
  const uint16_t* M = q.kscales ? q.supers : q.mins;
  const uint32_t* H = bits5 ? reinterpret_cast<const uint32_t*>(mins.data_ptr<int32_t>()) : nullptr;
  const uint8_t* W4 = int4 ? qweight.data_ptr<uint8_t>() : nullptr;
  const int8_t* W8 = int4 ? nullptr : qweight.data_ptr<int8_t>();
  float* Y = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(R[i] >= 0 && R[i] < N, "row id out of range");
    if (q.k6scales) dequant_row6(q, R[i], Y + i * K);
    else dequant_row(W4, W8, S, M, K, G, group, R[i], Y + i * K, H, q.kscales);
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
  const int64_t N = qweight.size(0);  // rows padded to whole tiles
  TORCH_CHECK(qweight.is_contiguous() && out.is_contiguous() && out.dim() == 2 && out.size(1) == K &&
              (bf16 || out.scalar_type() == at::kFloat) && begin >= 0 && begin + n <= N,
              "dequant_range: rows in range, a contiguous fp32/bf16 [rows, K] output");
  const QMatrix q = quantized_matrix(qweight, scales, mins, group, N);  // checks every form's layout
  const int64_t G = q.groups;
  const uint16_t* S = q.scales;
  const uint16_t* M = q.kscales ? q.supers : q.mins;
  const uint32_t* H = q.high;
  const uint8_t* SK = q.kscales;
  const uint8_t* W4 = int4 ? qweight.data_ptr<uint8_t>() : nullptr;
  const int8_t* W8 = int4 ? nullptr : qweight.data_ptr<int8_t>();
  float* F = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* B = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(bf16 ? K : 0);
    for (int64_t i = lo; i < hi; ++i) {
      float* y = bf16 ? row.data() : F + i * K;
      if (q.k6scales) dequant_row6(q, begin + i, y);
      else dequant_row(W4, W8, S, M, K, G, group, begin + i, y, H, SK);
      if (bf16)
        for (int64_t k = 0; k < K; ++k) B[i * K + k] = at::BFloat16(y[k]);  // round to nearest even
    }
  });
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
