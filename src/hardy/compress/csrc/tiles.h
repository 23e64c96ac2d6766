// The per-tile products of the tiled layouts (qgemv.cpp's matrix_tiles and dequant_rows use them): the
// int4 grids (Q4_0/Q4_1, the 5-bit grid, the K-quant forms of Q4_K and Q5_K), the 6-bit K-quant form of Q6_K, and
// int8. Included by qgemv.cpp alone: internal to it, as its own anonymous namespace is.
#pragma once
#include "qgemv.h"
#include <algorithm>
#include <cstring>

namespace {
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
// Bits From.. of every byte moved to bit 4 and kept where `mask` has bits: fifth_bits<P> (bit P, as 16
// or 0) and two_bits<C> (bits 2C and 2C + 1, as 0, 16, 32 or 48). The shift runs in 16-bit lanes; the
// bits it carries across a byte boundary land outside the mask.
template <int From>
inline __m256i at_bit_4(__m256i v, __m256i mask) {
  if constexpr (From < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - From), mask);
  else if constexpr (From > 4) return _mm256_and_si256(_mm256_srli_epi16(v, From - 4), mask);
  else return _mm256_and_si256(v, mask);
}
template <int P>
inline __m256i fifth_bits(__m256i h) { return at_bit_4<P>(h, _mm256_set1_epi8(0x10)); }
template <int C>
inline __m256i two_bits(__m256i v) { return at_bit_4<2 * C>(v, _mm256_set1_epi8(0x30)); }
#endif

#ifdef HARDY_AVX2
// Chunk c of a block of 8 rows (codes 4c..4c+3 in the low nibbles, 16+4c..16+4c+3 in the high ones)
// against its activations, with the codes' upper bits `top0`/`top1` (0, 16, 32 or 48 per byte) added:
// the low nibbles' products into d0, the high ones' into d1.
inline void nibble_chunk(const uint8_t* w, const int8_t* x, int c, __m256i top0, __m256i top1, __m256i& d0,
                         __m256i& d1) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  int32_t lo4, hi4;
  std::memcpy(&lo4, x + 4 * c, 4);
  std::memcpy(&hi4, x + 16 + 4 * c, 4);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
  d0 = dot_acc(d0, _mm256_or_si256(_mm256_and_si256(v, low), top0), _mm256_set1_epi32(lo4));
  d1 = dot_acc(d1, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), top1), _mm256_set1_epi32(hi4));
}
#endif

inline int fifth_bit(uint32_t lane, int code) {  // row's fifth bit of `code` from its 32-bit lane
  return (lane >> fifth_bit_at(code)) & 1;
}

// A K-quant group's scale d·sc and min −dmin·m for one lane (SK: the tile's sc/m bytes, D: its d/dmin).
inline float k_scale(const uint8_t* SK, const uint16_t* D, int64_t g, int r) {
  return half_to_float(D[16 * (g / K_GROUPS) + r]) * (float)SK[16 * g + r];
}
inline float k_min(const uint8_t* SK, const uint16_t* D, int64_t g, int r) {
  return -(half_to_float(D[16 * (g / K_GROUPS) + 8 + r]) * (float)SK[16 * g + 8 + r]);
}

// The int4 tile; Bits5: with each code's fifth bit from H (the 5-bit grid, (code − 16) · scale);
// KQuant: the K-quant form (qgemv.h), S unused, SK its sc/m bytes and M its d/dmin (with Bits5: Q5_K's).
template <bool HasMin, bool Bits5 = false, bool KQuant = false>
inline void q4_tile8(const uint8_t* W, const uint16_t* S, const uint16_t* M, const int8_t* xq, const float* dx,
                     const float* xg, int64_t nb, int64_t G, int64_t bpg, float* y, int64_t valid,
                     const uint32_t* H = nullptr, const uint8_t* SK = nullptr) {
  float out[8];
  const float offset = Bits5 ? 16.f : 8.f;
#ifdef HARDY_AVX2
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
      auto chunk = [&](int c, __m256i top0, __m256i top1) { nibble_chunk(w, x, c, top0, top1, d0, d1); };
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

// R activation rows against one tile of the plain int4 grid (Q4_0's, or with mins Q4_1's and hardy's):
// each block's nibbles are unpacked once for all R rows, not once per row, so the rows a batched step
// adds (other streams, speculative guesses, prompt chunks riding along) cost their dot products only.
// Each row's operations are q4_tile8's in the same order: the same bits as R calls of it.
template <bool HasMin, int R>
inline void q4_tile8_rows(const uint8_t* W, const uint16_t* S, const uint16_t* M, const int8_t* xq, int64_t K,
                          const float* dx, const float* xg, int64_t nb, int64_t G, int64_t bpg, float* y, int64_t N,
                          int64_t valid) {
#ifdef HARDY_AVX2
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[R], acc_min[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm256_setzero_ps();
  for (int64_t g = 0, b0 = 0; g < G; ++g, b0 += bpg) {
    const int64_t b1 = std::min(nb, b0 + bpg);
    __m256 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* w = W + b * 128;
      _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES + 64), _MM_HINT_T0);
      __m256i lo[4], hi[4];
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
        lo[c] = _mm256_and_si256(v, low);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq + r * K + b * QK;
        __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          int32_t lo4, hi4;
          std::memcpy(&lo4, x + 4 * c, 4);
          std::memcpy(&hi4, x + 16 + 4 * c, 4);
          d0 = dot_acc(d0, lo[c], _mm256_set1_epi32(lo4));
          d1 = dot_acc(d1, hi[c], _mm256_set1_epi32(hi4));
        }
        part[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1)), _mm256_set1_ps(dx[r * nb + b]), part[r]);
      }
    }
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + 8 * g)));
    for (int r = 0; r < R; ++r) {
      if constexpr (HasMin) {
        acc[r] = _mm256_fmadd_ps(part[r], scale, acc[r]);
        acc_min[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(M + 8 * g))),
                                     _mm256_set1_ps(xg[r * G + g]), acc_min[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_sub_ps(part[r], _mm256_set1_ps(8.f * xg[r * G + g])), scale, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(acc[r], acc_min[r]));
    std::memcpy(y + r * N, out, valid * sizeof(float));
  }
#else
  for (int r = 0; r < R; ++r)
    q4_tile8<HasMin>(W, S, M, xq + r * K, dx + r * nb, xg + r * G, nb, G, bpg, y + r * N, valid);
#endif
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
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = W + b * 128;
    _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + PF_BYTES + 64), _MM_HINT_T0);
    const int8_t* x = xq + b * QK;
    const __m256i h5 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(H5 + 8 * b));
    const __m256i h6 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(H6 + 8 * b));
    _mm_prefetch(reinterpret_cast<const char*>(H5 + 8 * b) + PF_BYTES / 4, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(H6 + 8 * b) + PF_BYTES / 4, _MM_HINT_T0);
    if (b % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(SC + 16 * b) + PF_BYTES / 8, _MM_HINT_T0);
    // the planes merged once per block (8 operations instead of 32 over the chunks): bits 2c and 2c + 1
    // of `low` are the fifth and sixth bits of chunk c's low-nibble code, of `high` its high-nibble code's
    const __m256i m55 = _mm256_set1_epi8(0x55), mAA = _mm256_set1_epi8((char)0xAA);
    const __m256i low = _mm256_or_si256(_mm256_and_si256(h5, m55), _mm256_slli_epi16(_mm256_and_si256(h6, m55), 1));
    const __m256i high = _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(h5, mAA), 1), _mm256_and_si256(h6, mAA));
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
    auto chunk = [&](int c, __m256i top0, __m256i top1) { nibble_chunk(w, x, c, top0, top1, d0, d1); };
    chunk(0, two_bits<0>(low), two_bits<0>(high));
    chunk(1, two_bits<1>(low), two_bits<1>(high));
    chunk(2, two_bits<2>(low), two_bits<2>(high));
    chunk(3, two_bits<3>(low), two_bits<3>(high));
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

}  // namespace
