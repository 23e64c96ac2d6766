// Decode attention in tiles (flash-decoding style) for the fused stack: the query heads that share a KV
// head are served together, so each cached key and value is read from memory and converted to float once
// per step, not once per query head; scores come 8 positions at a time (one horizontal reduction per 8,
// not per position), softmax weights from a vectorized exp, and values are accumulated with the weights
// of up to four heads per load. A long context is cut into chunks of positions whose partial results
// (max, sum, weighted values) are merged afterwards, so the threads share one row's attention; the chunks
// depend only on the positions, never on the thread count, so any number of threads gives the same bits.
#pragma once
#include "kv.h"
#include <algorithm>

// Positions per chunk (a multiple of the cache block): long enough that the merge is cheap, short enough
// that one row's 8k context splits into 64 units for the threads.
constexpr int64_t ATTN_CHUNK = 128;

// The cache lines of the tile read after the current one, asked for a line at a time while the current
// one is read: tiles are blocks scattered over the pool (a 64-wide bf16 head's block is one 4 KB page),
// so the hardware prefetcher starts over at each, and asking for a whole tile at once stalls on the
// core's few outstanding misses. Reading one tile while the next arrives keeps both going.
struct Ahead {
  const char *p = nullptr, *end = nullptr;
  void line() {
    if (p < end) __builtin_prefetch(p, 0, 3);
    p += 64;
  }
  void rest() {
    while (p < end) line();
  }
};

template <KVType T> constexpr int64_t kv_bytes() { return T == KVType::F32 ? 4 : 2; }

// `count` cached values as float: the cache itself where it is float32, else converted into `buf`.
template <KVType T> inline const float* kv_floats(const void* src, int64_t count, float* buf, Ahead& ahead) {
  if (T == KVType::F32) {
    ahead.rest();
    return static_cast<const float*>(src);
  }
  int64_t i = 0;
#ifdef HARDY_AVX2
  for (; i + 8 <= count; i += 8) {
    if (i % 32 == 0) ahead.line();  // 32 two-byte values: one line read, one asked for
    _mm256_storeu_ps(buf + i, kv_load8<T>(src, i));
  }
#endif
  for (; i < count; ++i) buf[i] = kv_load<T>(src, i);
  ahead.rest();
  return buf;
}

#ifdef HARDY_AVX2
// The sums of eight vectors' lanes, as one vector [sum a0, ..., sum a7].
inline __m256 lane_sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 s03 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 s47 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20), _mm256_permute2f128_ps(s03, s47, 0x31));
}

// e^x in each lane (Cephes' expf: 2^n times a degree-6 polynomial on |r| <= ln2 / 2; within 2 ulp).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: r exact
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// out[t] = q . k[t] for nt keys of hd floats each (rows of k hd apart).
inline void key_scores(const float* q, const float* k, int64_t nt, int64_t hd, float* out) {
  int64_t t = 0;
#ifdef HARDY_AVX2
  const int64_t whole = hd / 8 * 8;
  for (; t + 8 <= nt; t += 8) {
    const float* kt = k + t * hd;
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < whole; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt + j * hd + d), a[j]);
    }
    _mm256_storeu_ps(out + t, lane_sums8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
    for (int64_t d = whole; d < hd; ++d)
      for (int j = 0; j < 8; ++j) out[t + j] += q[d] * kt[j * hd + d];
  }
#endif
  for (; t < nt; ++t) out[t] = kv_dot<KVType::F32>(q, k + t * hd, hd);
}

// p[i] = e^(p[i] - mx) for n values; returns their sum (in a fixed order).
inline float exp_shifted(float* p, int64_t n, float mx) {
  int64_t i = 0;
  float total = 0.f;
#ifdef HARDY_AVX2
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), m));
    _mm256_storeu_ps(p + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = hsum(sum);
#endif
  for (; i < n; ++i) total += (p[i] = std::exp(p[i] - mx));
  return total;
}

// acc[h] += sum over t of p[h][t] v[t] for NH heads (weights `stride` apart), nt cached values of hd each
// (converted in registers: each is read once for all NH heads).
template <KVType T, int NH>
inline void weighted_values(const float* p, int64_t stride, const void* v, int64_t nt, int64_t hd, float* acc,
                            Ahead& ahead) {
  int64_t d = 0;
#ifdef HARDY_AVX2
  for (; d + 16 <= hd; d += 16) {
    __m256 a[NH][2];
    for (int h = 0; h < NH; ++h)
      for (int j = 0; j < 2; ++j) a[h][j] = _mm256_loadu_ps(acc + h * hd + d + 8 * j);
    for (int64_t t = 0; t < nt; ++t) {
      if (kv_bytes<T>() == 4 || t % 2 == 0) ahead.line();  // 16 values a step: lines at the rate they are read
      const __m256 v0 = kv_load8<T>(v, t * hd + d), v1 = kv_load8<T>(v, t * hd + d + 8);
      for (int h = 0; h < NH; ++h) {
        const __m256 w = _mm256_broadcast_ss(p + h * stride + t);
        a[h][0] = _mm256_fmadd_ps(w, v0, a[h][0]);
        a[h][1] = _mm256_fmadd_ps(w, v1, a[h][1]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int j = 0; j < 2; ++j) _mm256_storeu_ps(acc + h * hd + d + 8 * j, a[h][j]);
  }
#endif
  for (; d < hd; ++d)
    for (int h = 0; h < NH; ++h) {
      float a = acc[h * hd + d];
      for (int64_t t = 0; t < nt; ++t) a += p[h * stride + t] * kv_load<T>(v, t * hd + d);
      acc[h * hd + d] = a;
    }
  ahead.rest();
}

template <KVType T>
inline void weighted_values_any(const float* p, int64_t stride, const void* v, int64_t nt, int64_t hd,
                                int64_t heads, float* acc, Ahead& ahead) {
  int64_t h = 0;
  for (; h + 4 <= heads; h += 4) weighted_values<T, 4>(p + h * stride, stride, v, nt, hd, acc + h * hd, ahead);
  switch (heads - h) {
    case 3: weighted_values<T, 3>(p + h * stride, stride, v, nt, hd, acc + h * hd, ahead); break;
    case 2: weighted_values<T, 2>(p + h * stride, stride, v, nt, hd, acc + h * hd, ahead); break;
    case 1: weighted_values<T, 1>(p + h * stride, stride, v, nt, hd, acc + h * hd, ahead); break;
    default: break;
  }
}

// The largest of n scores after scaling them in place (and capping them where softcap > 0).
inline float scaled_max(float* p, int64_t n, float scale, float softcap) {
  int64_t i = 0;
  float m = -INFINITY;
#ifdef HARDY_AVX2
  if (softcap <= 0.f) {
    const __m256 sv = _mm256_set1_ps(scale);
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + i), sv);
      _mm256_storeu_ps(p + i, x);
      mv = _mm256_max_ps(mv, x);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (const float x : lanes) m = std::max(m, x);
  }
#endif
  for (; i < n; ++i) {
    float score = p[i] * scale;
    if (softcap > 0.f) score = softcap * std::tanh(score / softcap);
    p[i] = score;
    m = std::max(m, score);
  }
  return m;
}

// One chunk's attention for the `heads` query heads of one KV head, positions [t0, t1) of one row.
// `kv_at_t(t, kv)`: position t's cached key (kv = 0) or value (1), contiguous up to the end of its block
// of `block` positions. Scores are scaled and (softcap > 0) capped. Leaves the unnormalized weighted
// values in acc [heads, hd], each head's largest score in mx[h] and its sum of weights in total[h].
// Tiles are read keys first, then values, then (positions [t1, next_end)) the next chunk's first keys,
// each asked for while the one before it is read. Scratch: kbuf [block, hd]; p [heads, ATTN_CHUNK].
template <KVType T, class At>
void attend_chunk(const float* q, int64_t heads, int64_t hd, int64_t t0, int64_t t1, int64_t block, At kv_at_t,
                  float scale, float softcap, float* kbuf, float* p, float* acc, float* mx, float* total,
                  int64_t next_end) {
  const int64_t n = t1 - t0;
  auto tile_end = [&](int64_t t, int64_t limit) { return std::min(limit, (t / block + 1) * block); };
  auto ahead_of = [&](int64_t t, int kv, int64_t limit) {  // the tile starting at position t
    Ahead a;
    if (t < limit) {
      a.p = static_cast<const char*>(kv_at_t(t, kv));
      a.end = a.p + (tile_end(t, limit) - t) * hd * kv_bytes<T>();
    }
    return a;
  };
  for (int64_t t = t0; t < t1;) {
    const int64_t end = tile_end(t, t1);
    Ahead next = end < t1 ? ahead_of(end, 0, t1) : ahead_of(t0, 1, t1);
    const float* k = kv_floats<T>(kv_at_t(t, 0), (end - t) * hd, kbuf, next);
    for (int64_t h = 0; h < heads; ++h) key_scores(q + h * hd, k, end - t, hd, p + h * ATTN_CHUNK + (t - t0));
    t = end;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* ph = p + h * ATTN_CHUNK;
    mx[h] = scaled_max(ph, n, scale, softcap);
    total[h] = exp_shifted(ph, n, mx[h]);
  }
  std::fill(acc, acc + heads * hd, 0.f);
  for (int64_t t = t0; t < t1;) {
    const int64_t end = tile_end(t, t1);
    Ahead next = end < t1 ? ahead_of(end, 1, t1) : ahead_of(t1, 0, next_end);
    weighted_values_any<T>(p + (t - t0), ATTN_CHUNK, kv_at_t(t, 1), end - t, hd, heads, acc, next);
    t = end;
  }
}

// A head's output from its chunks' partial results (in chunk order): acc [chunks] of hd values, their
// largest scores and sums, `chunk_stride` floats apart.
inline void merge_chunks(const float* acc, const float* mx, const float* total, int64_t chunks, int64_t chunk_stride,
                         int64_t hd, float* out) {
  float m = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, mx[c * chunk_stride]);
  float sum = 0.f;
  std::fill(out, out + hd, 0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    const float w = std::exp(mx[c * chunk_stride] - m);
    sum += w * total[c * chunk_stride];
    kv_axpy<KVType::F32>(out, w, acc + c * chunk_stride, hd);
  }
  const float r = 1.f / sum;
  for (int64_t j = 0; j < hd; ++j) out[j] *= r;
}
