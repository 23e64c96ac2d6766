// Prefill's dequantization a tile of 8 rows at a time, vectorized (qgemv.cpp's dequant_range): every
// tiled form (the int4 grids Q4_0/Q4_1, the 5-bit grid Q5_0, the K-quant forms of Q4_K, Q5_K and Q6_K,
// int8 Q8_0) written as fp32 or bf16 rows. Every value equals dequant_row's: code · scale + offset is
// one fused multiply-add, whose exact value is (code − offset) · scale (or code · scale + min) and is
// rounded once, as dequant_row rounds it; bf16 is that float rounded to nearest even as
// c10::BFloat16 rounds it. Included by qgemv.cpp alone.
#pragma once
#include "qgemv.h"
#include <algorithm>
#include <cstring>

namespace {
#ifdef HARDY_AVX2
// 8 floats to bf16 (round to nearest even), stored as 16 bytes. A NaN stays a NaN: the values are
// products with scales widened from fp16, whose NaNs are quiet with a zero low half, so the rounding
// bias never carries a NaN into an infinity.
inline void store_bf16(uint16_t* y, __m256 f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)));
  const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // qwords 0 and 2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_castsi256_si128(packed));
}

template <bool Bf16>
inline void store8(void* out, int64_t at, __m256 f) {
  if constexpr (Bf16) store_bf16(static_cast<uint16_t*>(out) + at, f);
  else _mm256_storeu_ps(static_cast<float*>(out) + at, f);
}

// Four 32-byte chunks of a tile's block (dword r of chunk c: row r's bytes 4c..4c+3) to rows: the
// result u[j] holds row j's 16 bytes in its low lane and row j + 4's in its high lane.
inline void rows_of_chunks(const uint8_t* w, __m256i u[4]) {
  const __m256i* p = reinterpret_cast<const __m256i*>(w);
  const __m256i v0 = _mm256_loadu_si256(p), v1 = _mm256_loadu_si256(p + 1);
  const __m256i v2 = _mm256_loadu_si256(p + 2), v3 = _mm256_loadu_si256(p + 3);
  const __m256i t0 = _mm256_unpacklo_epi32(v0, v1), t1 = _mm256_unpackhi_epi32(v0, v1);
  const __m256i t2 = _mm256_unpacklo_epi32(v2, v3), t3 = _mm256_unpackhi_epi32(v2, v3);
  u[0] = _mm256_unpacklo_epi64(t0, t2);
  u[1] = _mm256_unpackhi_epi64(t0, t2);
  u[2] = _mm256_unpacklo_epi64(t1, t3);
  u[3] = _mm256_unpackhi_epi64(t1, t3);
}

inline __m128i lane_of(__m256i v, int high) {
  return high ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
}

// 16 codes (bytes, unsigned or signed) as code · s + m into out[at, at + 16).
template <bool Bf16, bool Signed>
inline void codes16(__m128i q, __m256 s, __m256 m, void* out, int64_t at) {
  const __m128i q8 = _mm_srli_si128(q, 8);
  const __m256i a = Signed ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
  const __m256i b = Signed ? _mm256_cvtepi8_epi32(q8) : _mm256_cvtepu8_epi32(q8);
  store8<Bf16>(out, at, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), s, m));
  store8<Bf16>(out, at + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), s, m));
}

// Bit `2c + Half` of byte i of a row's 32-bit word of fifth (or sixth) bits, as 0 or 1 in byte 4c + i:
// the bit of the code that byte's low (Half 0) or high (Half 1) nibble holds (qgemv.h, fifth_bit_at).
template <int Half>
inline __m128i plane_bits(uint32_t word) {
  const __m128i shift = Half ? _mm_setr_epi32(1, 3, 5, 7) : _mm_setr_epi32(0, 2, 4, 6);
  return _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)word), shift), _mm_set1_epi8(1));
}

// Rows [lo, hi) (< 8) of int4 tile `tile` into out (row lo at out, rows `ld` elements apart): per
// block, scale and offset of each row, then its 16 bytes' low nibbles (codes 0-15) and high ones
// (16-31), with the fifth bits of the 5-bit forms (Q5_0, Q5_K) added in place.
template <bool Bf16>
void int4_tile_rows(const QMatrix& q, int64_t tile, int lo, int hi, void* out, int64_t ld) {
  const int64_t K = q.K, nb = K / QK, G = q.groups;
  const uint8_t* W = q.w4 + tile * 4 * K;
  const uint32_t* H = q.high_of(tile);
  const float offset = q.high ? -16.f : -8.f;  // the symmetric grids' (code − 8) and (code − 16)
  const __m256i low = _mm256_set1_epi8(0x0f);
  alignas(32) float s[8], m[8];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / q.blocks_per_group;
    if (b % q.blocks_per_group == 0) {  // this group's 8 scales and offsets
      __m256 sv, mv;
      if (q.kscales) {  // d·sc and −dmin·m
        const uint8_t* SK = q.kscales + tile * G * 16 + 16 * g;
        const uint16_t* D = q.supers_of(tile) + 16 * (g / K_GROUPS);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(SK))));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(SK + 8))));
        sv = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(D))), sc);
        mv = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(D + 8))), mn),
                           _mm256_set1_ps(-0.f));  // negated as k_min negates
      } else {
        const int64_t at = tile * G * 8 + g * 8;
        sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.scales + at)));
        mv = q.mins ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.mins + at)))
                    : _mm256_mul_ps(sv, _mm256_set1_ps(offset));
      }
      _mm256_store_ps(s, sv);
      _mm256_store_ps(m, mv);
    }
    __m256i u[4];
    rows_of_chunks(W + b * 128, u);
    for (int r = lo; r < hi; ++r) {
      const __m128i bytes = lane_of(u[r % 4], r / 4);
      const __m256 sr = _mm256_set1_ps(s[r]), mr = _mm256_set1_ps(m[r]);
      const int64_t at = (r - lo) * ld + b * QK;
      __m128i first = _mm_and_si128(bytes, _mm256_castsi256_si128(low));
      __m128i second = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm256_castsi256_si128(low));
      if (H) {
        first = _mm_or_si128(first, _mm_slli_epi16(plane_bits<0>(H[8 * b + r]), 4));
        second = _mm_or_si128(second, _mm_slli_epi16(plane_bits<1>(H[8 * b + r]), 4));
      }
      codes16<Bf16, false>(first, sr, mr, out, at);
      codes16<Bf16, false>(second, sr, mr, out, at + 16);
    }
  }
}

// The 6-bit K-quant form: the int4 layout's nibbles with the fifth and sixth bits added, (code − 32) ·
// (d·sc) with one sc per half block (codes 0-15, 16-31), as dequant_row6.
template <bool Bf16>
void int6_tile_rows(const QMatrix& q, int64_t tile, int lo, int hi, void* out, int64_t ld) {
  const int64_t K = q.K, nb = K / QK;
  const uint8_t* W = q.w4 + tile * 4 * K;
  const uint32_t* H5 = q.high + tile * (2 * nb + nb / K_GROUPS) * 8;
  const uint32_t* H6 = H5 + nb * 8;
  const float* D = reinterpret_cast<const float*>(H5 + 2 * nb * 8);
  const int8_t* SC = q.k6scales + tile * 2 * nb * 8;
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i u[4];
    rows_of_chunks(W + b * 128, u);
    for (int r = lo; r < hi; ++r) {
      const __m128i bytes = lane_of(u[r % 4], r / 4);
      const uint32_t h5 = H5[8 * b + r], h6 = H6[8 * b + r];
      const __m128i first = _mm_or_si128(_mm_and_si128(bytes, low),
          _mm_or_si128(_mm_slli_epi16(plane_bits<0>(h5), 4), _mm_slli_epi16(plane_bits<0>(h6), 5)));
      const __m128i second = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), low),
          _mm_or_si128(_mm_slli_epi16(plane_bits<1>(h5), 4), _mm_slli_epi16(plane_bits<1>(h6), 5)));
      const float d = D[8 * (b / K_GROUPS) + r];
      const float s0 = d * (float)SC[16 * b + r], s1 = d * (float)SC[16 * b + 8 + r];
      const int64_t at = (r - lo) * ld + b * QK;
      codes16<Bf16, false>(first, _mm256_set1_ps(s0), _mm256_set1_ps(-32.f * s0), out, at);
      codes16<Bf16, false>(second, _mm256_set1_ps(s1), _mm256_set1_ps(-32.f * s1), out, at + 16);
    }
  }
}

// The same for int8 tiles: a block is 8 chunks, codes 0-15 in chunks 0-3 and 16-31 in chunks 4-7.
template <bool Bf16>
void int8_tile_rows(const QMatrix& q, int64_t tile, int lo, int hi, void* out, int64_t ld) {
  const int64_t K = q.K, nb = K / QK, G = q.groups;
  const uint8_t* W = reinterpret_cast<const uint8_t*>(q.w8) + tile * 8 * K;
  alignas(32) float s[8];
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / q.blocks_per_group;
    if (b % q.blocks_per_group == 0)
      _mm256_store_ps(s, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.scales + tile * G * 8 + g * 8))));
    __m256i first[4], second[4];
    rows_of_chunks(W + b * 256, first);
    rows_of_chunks(W + b * 256 + 128, second);
    for (int r = lo; r < hi; ++r) {
      const __m256 sr = _mm256_set1_ps(s[r]);
      const int64_t at = (r - lo) * ld + b * QK;
      codes16<Bf16, true>(lane_of(first[r % 4], r / 4), sr, zero, out, at);
      codes16<Bf16, true>(lane_of(second[r % 4], r / 4), sr, zero, out, at + 16);
    }
  }
}
#endif

// Whether tile_rows runs here: every tiled form, where the build has AVX2.
inline bool has_vector_dequant() {
#ifdef HARDY_AVX2
  return true;
#else
  return false;
#endif
}

// Rows [begin, begin + n) of q (where has_vector_dequant()) into out [n, K] (fp32, or bf16 as uint16 bits),
// for one tile's share of them: callers split the tiles rows [begin, begin + n) touch among threads.
inline void tile_rows(const QMatrix& q, int64_t begin, int64_t n, int64_t tile, void* out, bool bf16) {
#ifdef HARDY_AVX2
  const int64_t first = std::max(begin, tile * 8), last = std::min(begin + n, tile * 8 + 8);
  if (first >= last) return;
  const int lo = (int)(first - tile * 8), hi = (int)(last - tile * 8);
  const int64_t offset = (first - begin) * q.K;
  void* at = bf16 ? static_cast<void*>(static_cast<uint16_t*>(out) + offset) : static_cast<void*>(static_cast<float*>(out) + offset);
  if (q.k6scales) bf16 ? int6_tile_rows<true>(q, tile, lo, hi, at, q.K) : int6_tile_rows<false>(q, tile, lo, hi, at, q.K);
  else if (q.w4) bf16 ? int4_tile_rows<true>(q, tile, lo, hi, at, q.K) : int4_tile_rows<false>(q, tile, lo, hi, at, q.K);
  else bf16 ? int8_tile_rows<true>(q, tile, lo, hi, at, q.K) : int8_tile_rows<false>(q, tile, lo, hi, at, q.K);
#else
  (void)q, (void)begin, (void)n, (void)tile, (void)out, (void)bf16;
#endif
}
}  // namespace
