// The paged KV cache as the fused decode stack reads and writes it (hardy.infer.kv): blocks of BLOCK
// positions of every layer's K and V, [block, layer, k/v, kv head, position in block, head size], in
// fp32, bf16 or fp16. Conversions round to nearest even, as torch's own .to(dtype) does, so the
// fused path writes the same bits as the model's attention modules.
#pragma once
#include "qgemv.h"
#include <cmath>
#include <cstring>

enum class KVType { F32 = 0, BF16 = 1, F16 = 2 };

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline uint16_t float_to_half(float f) {
#ifdef HARDY_AVX2
  return _cvtss_sh(f, 0);  // 0: round to nearest even
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (x >> 16) & 0x8000;
  const uint32_t absx = x & 0x7fffffff;
  if (absx > 0x7f800000) return sign | 0x7e00;   // NaN
  if (absx >= 0x477ff000) return sign | 0x7c00;  // rounds past 65504: infinity
  if (absx < 0x38800000) {                       // below 2^-14: a subnormal half (or zero)
    float a;
    std::memcpy(&a, &absx, 4);
    return sign | uint16_t(std::nearbyint(a * 16777216.0f));  // a / 2^-24, exact, rounded to even
  }
  uint32_t half = ((absx >> 23) - 112) << 10 | ((absx & 0x7fffff) >> 13);
  const uint32_t rest = absx & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;
  return sign | uint16_t(half);
#endif
}

template <KVType T> inline float kv_load(const void* p, int64_t i);
template <> inline float kv_load<KVType::F32>(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
template <> inline float kv_load<KVType::BF16>(const void* p, int64_t i) {
  return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}
template <> inline float kv_load<KVType::F16>(const void* p, int64_t i) {
  return half_to_float(static_cast<const uint16_t*>(p)[i]);
}

inline void kv_store(KVType t, void* dst, const float* src, int64_t n) {
  if (t == KVType::F32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (t == KVType::BF16) {
    for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = float_to_bf16(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = float_to_half(src[i]);
  }
}

#ifdef HARDY_AVX2
template <KVType T> inline __m256 kv_load8(const void* p, int64_t i);
template <> inline __m256 kv_load8<KVType::F32>(const void* p, int64_t i) {
  return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}
template <> inline __m256 kv_load8<KVType::BF16>(const void* p, int64_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <> inline __m256 kv_load8<KVType::F16>(const void* p, int64_t i) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
}

inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

// q · k over n values, k in the cache's type. Written out: without -ffast-math the compiler keeps a
// plain float sum in order (serial); attention spends most of its time here.
template <KVType T> inline float kv_dot(const float* q, const void* k, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef HARDY_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load8<T>(k, i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), kv_load8<T>(k, i + 8), s1);
  }
  sum = hsum(_mm256_add_ps(s0, s1));
#else
  float p[4] = {0.f, 0.f, 0.f, 0.f};
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) p[j] += q[i + j] * kv_load<T>(k, i + j);
  sum = (p[0] + p[1]) + (p[2] + p[3]);
#endif
  for (; i < n; ++i) sum += q[i] * kv_load<T>(k, i);
  return sum;
}

// out += p * v over n values, v in the cache's type.
template <KVType T> inline void kv_axpy(float* out, float p, const void* v, int64_t n) {
  int64_t i = 0;
#ifdef HARDY_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, kv_load8<T>(v, i), _mm256_loadu_ps(out + i)));
#endif
  for (; i < n; ++i) out[i] += p * kv_load<T>(v, i);
}
