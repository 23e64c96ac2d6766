// All transformer blocks for decoding (one new token per row) in a single call (DecodeStack): per
// block RMSNorm, the seven quantized products (qgemv.cpp), rotary embedding, the KV-cache write,
// causal attention over each row's own cached positions, SwiGLU and both residuals. The same
// arithmetic as the module path (hardy.model.transformer with QuantLinear layers) without ~25
// Python-level operator calls per block, which at SmolLM2's size cost more than the weights' own
// reading (docs/quantization.md).
//
// The whole stack runs in one OpenMP parallel region: the products and attention are split between
// the threads, the few small sequential steps (norms, rotary, quantizing an input) run on thread 0,
// and barriers separate the phases. A fork/join per product plus a tensor allocation and an ATen
// call per elementwise step left the second core idle for about half of a SmolLM2 step
// (BENCHMARKS.md); nothing inside the region allocates or can throw: every check is made before it.
#include "qgemv.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// a · b over n floats. Written out because the compiler keeps a plain float sum in order (serial)
// without -ffast-math; attention spends most of its time here.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef HARDY_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  const __m256 v = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
  float p[4] = {0.f, 0.f, 0.f, 0.f};
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) p[j] += a[i + j] * b[i + j];
  sum = (p[0] + p[1]) + (p[2] + p[3]);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y = x / sqrt(mean(x^2) + eps) * w, rows of [B, D]
void rms_norm(const float* X, const float* W, int64_t B, int64_t D, float eps, float* Y) {
  for (int64_t b = 0; b < B; ++b) {
    const float r = 1.f / std::sqrt(dot(X + b * D, X + b * D, D) / D + eps);
    for (int64_t i = 0; i < D; ++i) Y[b * D + i] = X[b * D + i] * r * W[i];
  }
}

// Rotate-half rotary embedding in place on [B, heads * hd] at each row's position.
void rope(float* T, int64_t B, int64_t heads, int64_t hd, const int64_t* pos, const float* cos, const float* sin) {
  const int64_t half = hd / 2;
  for (int64_t b = 0; b < B; ++b) {
    const float* c = cos + pos[b] * hd;
    const float* s = sin + pos[b] * hd;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = T + b * heads * hd + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], z = v[i + half];
        v[i] = a * c[i] - z * s[i];
        v[i + half] = z * c[i + half] + a * s[i + half];
      }
    }
  }
}

inline void barrier() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

// The sizes of one call and the buffers every phase reads and writes (allocated before the region).
struct Step {
  int64_t B, D, hd, S;
  const int64_t* pos;
  const float *cos, *sin;
  float eps;
  float *x, *h, *q, *k, *v, *attn, *gate, *up, *proj;
  int8_t* codes;
  float *block_scales, *block_sums;
  float* xg;     // per thread: [B, most groups of any matrix]
  int64_t xg_stride;
  float* probs;  // per thread: [S]
  const float* const* norms;  // per block: attention and FFN norm weights
};

// This thread's share of the products of `count` matrices (the same input, quantized in the Step's
// codes): the threads split the matrices' bytes evenly, a tile going to the thread its first byte falls in.
void products(const Step& s, const QMatrix* M, int count, float* const* outs, int tid, int n) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) total += M[i].tiles * M[i].tile_bytes();
  const int64_t lo = total * tid / n, hi = total * (tid + 1) / n;
  float* xg = s.xg + tid * s.xg_stride;
  for (int64_t i = 0, offset = 0; i < count; offset += M[i].tiles * M[i].tile_bytes(), ++i) {
    const int64_t tb = M[i].tile_bytes();
    auto first_tile_at = [&](int64_t byte) {
      return std::min(M[i].tiles, std::max<int64_t>(0, (byte - offset + tb - 1) / tb));
    };
    const int64_t begin = first_tile_at(lo), end = first_tile_at(hi);
    if (begin >= end) continue;
    if (M[i].w4) group_sums(M[i], s.B, s.block_sums, xg);
    matrix_tiles(M[i], begin, end, s.B, s.codes, s.block_scales, xg, outs[i]);
  }
}

// Row b, head hh attends to its cached positions 0 .. pos[b]: for the pairs (b, hh) of this thread.
void attention(const Step& s, const float* KC, const float* VC, int64_t H, int64_t KVH, int tid, int n) {
  const int64_t hd = s.hd, S = s.S, pairs = s.B * H, group_heads = H / KVH;
  const float scale = 1.f / std::sqrt((float)hd);
  float* p = s.probs + tid * S;
  for (int64_t i = pairs * tid / n; i < pairs * (tid + 1) / n; ++i) {
    const int64_t b = i / H, hh = i % H, g = hh / group_heads, len = s.pos[b] + 1;
    const float* qv = s.q + (b * H + hh) * hd;
    const float* keys = KC + (b * KVH + g) * S * hd;
    const float* vals = VC + (b * KVH + g) * S * hd;
    float mx = -INFINITY;
    for (int64_t t = 0; t < len; ++t) {
      p[t] = dot(qv, keys + t * hd, hd) * scale;
      mx = std::max(mx, p[t]);
    }
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) { p[t] = std::exp(p[t] - mx); total += p[t]; }
    float* out = s.attn + (b * H + hh) * hd;
    for (int64_t j = 0; j < hd; ++j) out[j] = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      const float pt = p[t] / total;
      for (int64_t j = 0; j < hd; ++j) out[j] += pt * vals[t * hd + j];
    }
  }
}

// gate = silu(gate) * up and its quantization, on this thread's whole blocks of 32 of [B, F].
void swiglu_quantized(const Step& s, int64_t F, int tid, int n) {
  const int64_t blocks = s.B * F / QK, b0 = blocks * tid / n, b1 = blocks * (tid + 1) / n;
  for (int64_t i = b0 * QK; i < b1 * QK; ++i) {
    const float g = s.gate[i];
    s.gate[i] = g / (1.f + std::exp(-g)) * s.up[i];
  }
  if (b1 > b0)
    quantize_rows(s.gate + b0 * QK, 1, (b1 - b0) * QK, s.codes + b0 * QK, s.block_scales + b0, s.block_sums + b0);
}

void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// One thread's part of every block; the barriers order the phases.
void run_blocks(const DecodeStack& st, const Step& s, float* const* kcs, float* const* vcs, const int64_t* kv_heads,
                int tid, int n) {
  const int64_t B = s.B, D = s.D, L = st.norms.size() / 2;
  for (int64_t l = 0; l < L; ++l) {
    const QMatrix* M = st.mats.data() + 7 * l;
    const int64_t H = M[0].rows / s.hd, KVH = kv_heads[l], F = M[4].rows;
    if (tid == 0) {
      if (l > 0) add_into(s.x, s.proj, B * D);  // the previous block's FFN residual
      rms_norm(s.x, s.norms[2 * l], B, D, s.eps, s.h);
      quantize_rows(s.h, B, D, s.codes, s.block_scales, s.block_sums);
    }
    barrier();
    float* qkv[3] = {s.q, s.k, s.v};
    products(s, M, 3, qkv, tid, n);
    barrier();
    if (tid == 0) {
      rope(s.q, B, H, s.hd, s.pos, s.cos, s.sin);
      rope(s.k, B, KVH, s.hd, s.pos, s.cos, s.sin);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < KVH; ++g) {
          const int64_t at = ((b * KVH + g) * s.S + s.pos[b]) * s.hd;
          std::memcpy(kcs[l] + at, s.k + (b * KVH + g) * s.hd, s.hd * sizeof(float));
          std::memcpy(vcs[l] + at, s.v + (b * KVH + g) * s.hd, s.hd * sizeof(float));
        }
    }
    barrier();
    attention(s, kcs[l], vcs[l], H, KVH, tid, n);
    barrier();
    if (tid == 0) quantize_rows(s.attn, B, M[3].K, s.codes, s.block_scales, s.block_sums);
    barrier();
    products(s, M + 3, 1, &s.proj, tid, n);
    barrier();
    if (tid == 0) {
      add_into(s.x, s.proj, B * D);
      rms_norm(s.x, s.norms[2 * l + 1], B, D, s.eps, s.h);
      quantize_rows(s.h, B, D, s.codes, s.block_scales, s.block_sums);
    }
    barrier();
    float* gate_up[2] = {s.gate, s.up};
    products(s, M + 4, 2, gate_up, tid, n);
    barrier();
    swiglu_quantized(s, F, tid, n);
    barrier();
    products(s, M + 6, 1, &s.proj, tid, n);
    barrier();
  }
  if (tid == 0 && L > 0) add_into(s.x, s.proj, B * D);
}

}  // namespace

DecodeStack::DecodeStack(std::vector<at::Tensor> norms_, std::vector<at::Tensor> w_, std::vector<int64_t> dims_,
                         double eps_, int64_t head_dim_)
    : norms(std::move(norms_)), w(std::move(w_)), dims(std::move(dims_)), eps(eps_), head_dim(head_dim_) {
  const size_t L = norms.size() / 2;
  TORCH_CHECK(norms.size() == 2 * L && w.size() == 21 * L && dims.size() == 14 * L,
              "per block: two norms and seven quantized linears");
  check_on_cpu(norms, "a block's norm");
  check_on_cpu(w, "a block's quantized matrix");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "an even head size");
  for (size_t i = 0; i < 7 * L; ++i) mats.push_back(quantized_matrix(w[3 * i], w[3 * i + 1], w[3 * i + 2], dims[2 * i], dims[2 * i + 1]));
  for (size_t l = 0; l < L; ++l) {
    const QMatrix* M = mats.data() + 7 * l;
    const int64_t D = M[0].K;
    for (int j = 0; j < 2; ++j)
      TORCH_CHECK(norms[2 * l + j].scalar_type() == at::kFloat && norms[2 * l + j].is_contiguous() &&
                  norms[2 * l + j].numel() == D, "a block's norm: contiguous float32 of the model width");
    TORCH_CHECK(M[1].K == D && M[2].K == D && M[0].rows % head_dim == 0 && M[1].rows % head_dim == 0 &&
                M[1].rows == M[2].rows && M[3].K == M[0].rows && M[3].rows == D && M[4].K == D && M[5].K == D &&
                M[4].rows == M[5].rows && M[4].rows % QK == 0 && M[6].K == M[4].rows && M[6].rows == D &&
                (l == 0 || D == mats[0].K), "a block's seven matrices do not fit together (q, k, v, o, gate, up, down)");
  }
}

at::Tensor DecodeStack::operator()(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                 std::vector<at::Tensor> kcs, std::vector<at::Tensor> vcs) const {
  check_on_cpu({x, positions, cos, sin}, "the decode step's input");
  check_on_cpu(kcs, "a K cache");
  check_on_cpu(vcs, "a V cache");
  const size_t L = norms.size() / 2;
  TORCH_CHECK(kcs.size() == L && vcs.size() == L, "a K and a V cache per block");
  if (L == 0) return x;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == mats[0].K,
              "x: contiguous float32 [B, model width]");
  const int64_t B = x.size(0), D = x.size(1), hd = head_dim;
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == B &&
              positions.is_contiguous(), "one int64 position per row");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == hd,
              "rotary tables: contiguous float32 [positions, head size]");
  const int64_t S = kcs[0].dim() == 4 ? kcs[0].size(2) : 0;
  std::vector<float*> kp(L), vp(L);
  std::vector<int64_t> kv_heads(L);
  int64_t widest = D, groups = 1, kv_max = 0;
  for (size_t l = 0; l < L; ++l) {
    const auto &kc = kcs[l], &vc = vcs[l];
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat &&
                vc.scalar_type() == at::kFloat && kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(2) == S &&
                kc.size(3) == hd && B <= kc.size(0), "float32 KV caches [rows >= B, kv heads, positions, head size]");
    kv_heads[l] = kc.size(1);
    const QMatrix* M = mats.data() + 7 * l;
    TORCH_CHECK(M[1].rows == kv_heads[l] * hd && (M[0].rows / hd) % kv_heads[l] == 0,
                "head counts do not match the cache");
    kp[l] = kc.data_ptr<float>();
    vp[l] = vc.data_ptr<float>();
    widest = std::max({widest, M[0].rows, M[4].rows});
    kv_max = std::max(kv_max, M[1].rows);
    for (int j = 0; j < 7; ++j) groups = std::max(groups, M[j].groups);
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < S && pos[b] < cos.size(0), "position outside the cache");

  const int threads = std::max(1, at::get_num_threads());
  auto out = x.clone();  // the residual stream, updated in place
  const int64_t q_max = widest;
  std::vector<float> floats(B * (2 * D + 4 * widest + 2 * kv_max + 2 * widest / QK) +
                            threads * (B * groups + S));
  std::vector<int8_t> codes(B * widest);
  Step s{B, D, hd, S, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), (float)eps};
  float* f = floats.data();
  auto take = [&](int64_t n) { float* p = f; f += n; return p; };
  s.x = out.data_ptr<float>();
  s.h = take(B * D);
  s.proj = take(B * D);
  s.q = take(B * q_max);
  s.attn = take(B * q_max);
  s.gate = take(B * widest);
  s.up = take(B * widest);
  s.k = take(B * kv_max);
  s.v = take(B * kv_max);
  s.block_scales = take(B * widest / QK);
  s.block_sums = take(B * widest / QK);
  s.xg_stride = B * groups;
  s.xg = take(threads * s.xg_stride);
  s.probs = take(threads * S);
  s.codes = codes.data();
  std::vector<const float*> norm_weights;
  for (const auto& t : norms) norm_weights.push_back(t.data_ptr<float>());
  s.norms = norm_weights.data();
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
  run_blocks(*this, s, kp.data(), vp.data(), kv_heads.data(), omp_get_thread_num(), omp_get_num_threads());
#else
  run_blocks(*this, s, kp.data(), vp.data(), kv_heads.data(), 0, 1);
#endif
  return out;
}
