// All transformer blocks for decoding (one new token per row) in a single call (DecodeStack): per
// block RMSNorm, the seven quantized products (qgemv.cpp), rotary embedding, the KV-cache write,
// causal attention over each row's own cached positions, SwiGLU and both residuals. The same
// arithmetic as the module path (hardy.model.llama with QuantLinear layers) without ~25
// Python-level operator calls per block, which at SmolLM2's size cost more than the weights' own
// reading (docs/quantization.md).
#include "qgemv.h"
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <cstring>
#include <cmath>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// a · b over n floats. Written out because the compiler keeps a plain float sum in order (serial)
// without -ffast-math; attention spends most of its time here.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
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
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t B = x.size(0), D = x.size(1);
  auto y = at::empty_like(x);
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float r = 1.f / std::sqrt(dot(X + b * D, X + b * D, D) / D + (float)eps);
    for (int64_t i = 0; i < D; ++i) Y[b * D + i] = X[b * D + i] * r * W[i];
  }
  return y;
}

// Rotate-half rotary embedding in place on [B, heads * hd] at each row's position.
void rope(at::Tensor& t, int64_t heads, int64_t hd, const int64_t* pos, const float* cos, const float* sin) {
  const int64_t B = t.size(0), half = hd / 2;
  float* T = t.data_ptr<float>();
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

// The linears `first .. first+count-1` of the block applied to the same x (one quantization of x);
// w and dims point at the block's 21 tensors and 14 sizes.
std::vector<at::Tensor> linears(const at::Tensor* w, const int64_t* dims, int first, int count,
                                const at::Tensor& x) {
  return qgemv_many(x, std::vector<at::Tensor>(w + 3 * first, w + 3 * (first + count)),
                    std::vector<int64_t>(dims + 2 * first, dims + 2 * (first + count)));
}

at::Tensor block(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& attn_norm, const at::Tensor& ffn_norm, double eps,
                 const at::Tensor* w, const int64_t* dims, const at::Tensor& kc, const at::Tensor& vc,
                 int64_t head_dim) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat, "float32 KV cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.size(0) == x.size(0), "one position per row");
  const int64_t B = x.size(0), hd = head_dim, S = kc.size(2), KVH = kc.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(pos[b] >= 0 && pos[b] < S && pos[b] < cos.size(0), "position outside the cache");
  TORCH_CHECK(B <= kc.size(0), "more rows than the cache holds");

  auto h = rms_norm(x, attn_norm, eps);
  auto qkv = linears(w, dims, 0, 3, h);
  auto &q = qkv[0], &k = qkv[1], &v = qkv[2];
  const int64_t H = q.size(1) / hd, group_heads = H / KVH;
  TORCH_CHECK(k.size(1) == KVH * hd && H % KVH == 0, "head counts do not match the cache");
  rope(q, H, hd, pos, cos.data_ptr<float>(), sin.data_ptr<float>());
  rope(k, KVH, hd, pos, cos.data_ptr<float>(), sin.data_ptr<float>());
  float* KC = kc.data_ptr<float>();
  float* VC = vc.data_ptr<float>();
  const float* K = k.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KVH; ++g) {
      const int64_t at = ((b * KVH + g) * S + pos[b]) * hd;
      std::memcpy(KC + at, K + (b * KVH + g) * hd, hd * sizeof(float));
      std::memcpy(VC + at, V + (b * KVH + g) * hd, hd * sizeof(float));
    }

  // attention: row b, head hh attends to its cached positions 0 .. pos[b]
  auto attn = at::empty({B, H * hd}, at::kFloat);
  const float* Q = q.data_ptr<float>();
  float* A = attn.data_ptr<float>();
  const float scale = 1.f / std::sqrt((float)hd);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, hh = i % H, g = hh / group_heads, n = pos[b] + 1;
      const float* qv = Q + (b * H + hh) * hd;
      const float* keys = KC + (b * KVH + g) * S * hd;
      const float* vals = VC + (b * KVH + g) * S * hd;
      p.resize(n);
      float mx = -INFINITY;
      for (int64_t t = 0; t < n; ++t) {
        p[t] = dot(qv, keys + t * hd, hd) * scale;
        mx = std::max(mx, p[t]);
      }
      float total = 0.f;
      for (int64_t t = 0; t < n; ++t) { p[t] = std::exp(p[t] - mx); total += p[t]; }
      float* out = A + (b * H + hh) * hd;
      for (int64_t j = 0; j < hd; ++j) out[j] = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        const float pt = p[t] / total;
        for (int64_t j = 0; j < hd; ++j) out[j] += pt * vals[t * hd + j];
      }
    }
  });

  auto x1 = x.add(linears(w, dims, 3, 1, attn)[0]);
  auto h2 = rms_norm(x1, ffn_norm, eps);
  auto gate_up = linears(w, dims, 4, 2, h2);
  auto &gate = gate_up[0], &up = gate_up[1];
  // ATen's SiLU, as the module path computes it: vectorized, where a scalar std::exp per element
  // cost ~10 us per block at SmolLM2's width
  at::silu_(gate).mul_(up);
  x1 += linears(w, dims, 6, 1, gate)[0];
  return x1;
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
}

at::Tensor DecodeStack::operator()(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                 std::vector<at::Tensor> kcs, std::vector<at::Tensor> vcs) const {
  check_on_cpu({x, positions, cos, sin}, "the decode step's input");
  check_on_cpu(kcs, "a K cache");
  check_on_cpu(vcs, "a V cache");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [B, D]");
  const size_t L = norms.size() / 2;
  TORCH_CHECK(kcs.size() == L && vcs.size() == L, "a K and a V cache per block");
  for (size_t l = 0; l < L; ++l)
    x = block(x, positions, cos, sin, norms[2 * l], norms[2 * l + 1], eps, w.data() + 21 * l, dims.data() + 14 * l,
              kcs[l], vcs[l], head_dim);
  return x;
}
