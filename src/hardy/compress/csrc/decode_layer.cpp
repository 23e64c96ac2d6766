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
#include "attention.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <atomic>
#include <thread>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// y = x / sqrt(mean(x^2) + eps) * w, rows of [B, D]
void rms_norm(const float* X, const float* W, int64_t B, int64_t D, float eps, float* Y) {
  for (int64_t b = 0; b < B; ++b) {
    const float r = 1.f / std::sqrt(kv_dot<KVType::F32>(X + b * D, X + b * D, D) / D + eps);
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

void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void add_bias(float* y, const float* bias, int64_t B, int64_t n) {
  if (bias)
    for (int64_t b = 0; b < B; ++b) add_into(y + b * n, bias, n);
}

// The threads of one call wait for each other between phases here, spinning: the stack's ~3 waits per
// block are microseconds apart. An OpenMP barrier sleeps in the kernel instead once libgomp manages more
// threads than there are CPUs, which it does as soon as a second thread (a server's engine thread) runs a
// parallel region beside the main thread's idle team: that made every decode step ~2.8x slower there.
struct SpinBarrier {
  std::atomic<int> arrived{0}, phase{0}, threads{1};

  void wait() {
    const int n = threads.load(std::memory_order_relaxed);
    if (n <= 1) return;
    const int p = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(p + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase.load(std::memory_order_acquire) == p; ++spins) {
      if (spins < (1 << 14)) pause();
      else std::this_thread::yield();  // a thread descheduled on a busy machine: let it run
    }
  }

  static void pause() {
#ifdef HARDY_AVX2
    _mm_pause();
#endif
  }
};

// The sizes of one call and the buffers every phase reads and writes (allocated before the region).
struct Step {
  int64_t B, D, hd;
  const int64_t* pos;
  const float *cos, *sin, *cos_local, *sin_local;
  float eps;
  float *x, *h, *q, *k, *v, *attn, *gate, *up, *proj;
  int8_t* codes;
  float *block_scales, *block_sums;
  float* xg;     // per thread: [B, most groups of any matrix]
  int64_t xg_stride;
  float* attn_scratch;  // per thread: a tile of keys as float, the chunk's weights and two numbers per head
  int64_t attn_scratch_stride, most_group_heads;
  float* partials;  // per (row, KV head, chunk) of a split row: weighted values, largest scores, sums
  const float* const* norms;  // per block: attention and FFN norm weights
  const BlockExtras* extras;       // per block
  // the paged KV cache: [blocks, layers, 2, kv heads, BLOCK, hd] of `kv_type`; row b's i-th block is table[b * width + i]
  uint8_t* pool;
  KVType kv_type;
  int64_t layers, kv_heads, block, width;
  const int32_t* table;
  bool gelu;
  float scale, softcap;
  // mixture-of-experts blocks (sized for the largest): R = B x top k (token, expert) pairs
  float* logits;                       // [B, experts]: router scores, then probabilities
  int64_t *pair_expert, *row_of, *token_of, *expert_first, *cursor;  // [R], [R], [R], [experts + 1], [experts]
  float* pair_weight;                  // [R]
  uint8_t* chosen;                     // [experts]
  int8_t *moe_codes, *mid_codes;       // [R, D], [R, F]: the pairs' quantized inputs, grouped by expert
  float *moe_scales, *moe_sums, *mid_scales, *mid_sums;
  float *moe_gate, *moe_up, *moe_down;  // [R, F], [R, F], [R, D]
  float* moe_xg;                        // per thread: [R, most groups of any matrix]
  int64_t moe_xg_stride;
  SpinBarrier* sync;  // between phases
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

// Where position t of row b keeps layer l's keys (kv = 0) or values (kv = 1) of KV head g.
inline const void* kv_at(const Step& s, int64_t l, int64_t b, int64_t t, int kv, int64_t g) {
  const int64_t blk = s.table[b * s.width + t / s.block];
  const int64_t index = ((((blk * s.layers + l) * 2 + kv) * s.kv_heads + g) * s.block + t % s.block) * s.hd;
  return s.pool + index * (s.kv_type == KVType::F32 ? 4 : 2);
}

// The positions row b attends to on a layer with `window` (0: all): [first, len), in chunks
// [first / ATTN_CHUNK, last chunk]; each (row, KV head, chunk) is one unit of work.
struct RowSpan {
  int64_t first, len, c0, chunks;
  int64_t begin(int64_t c) const { return std::max(first, c * ATTN_CHUNK); }  // chunk c's positions
  int64_t end(int64_t c) const { return std::min(len, (c + 1) * ATTN_CHUNK); }
};

inline RowSpan row_span(const Step& s, int64_t b, int64_t window) {
  const int64_t len = s.pos[b] + 1, first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t c0 = first / ATTN_CHUNK;
  return {first, len, c0, (len - 1) / ATTN_CHUNK - c0 + 1};
}

// What a unit costs the thread that takes it: its positions plus a fixed setup.
constexpr int64_t UNIT_SETUP = 16;

// One unit: the G query heads of KV head g, row b, chunk c. A row of one chunk writes its heads' outputs;
// a longer row's units leave partial results for merge_rows.
template <KVType T>
void attend_unit(const Step& s, int64_t l, int64_t H, const RowSpan& r, int64_t b, int64_t g, int64_t c,
                 float* partial, int tid) {
  const int64_t hd = s.hd, G = H / s.kv_heads;
  const int64_t t0 = r.begin(c), t1 = r.end(c);
  float* scratch = s.attn_scratch + tid * s.attn_scratch_stride;
  float *kbuf = scratch, *p = scratch + s.block * hd;
  float* stats = p + s.most_group_heads * ATTN_CHUNK;  // [2, G] when the unit writes outputs
  float* acc = r.chunks == 1 ? s.attn + (b * H + g * G) * hd : partial;
  float* mx = r.chunks == 1 ? stats : partial + G * hd;
  auto at = [&](int64_t t, int kv) { return kv_at(s, l, b, t, kv, g); };
  attend_chunk<T>(s.q + (b * H + g * G) * hd, G, hd, t0, t1, s.block, at, s.scale, s.softcap, kbuf, p, acc, mx,
                  mx + G, std::min(r.len, t1 + ATTN_CHUNK));
  if (r.chunks == 1)
    for (int64_t h = 0; h < G; ++h) {
      const float inv = 1.f / mx[G + h];
      for (int64_t j = 0; j < hd; ++j) acc[h * hd + j] *= inv;
    }
}

// Every split row's heads from their chunks: this thread's share of the (row, head) pairs.
void merge_rows(const Step& s, int64_t H, int64_t window, int tid, int n) {
  const int64_t hd = s.hd, G = H / s.kv_heads, unit = G * (hd + 2), pairs = s.B * H;
  int64_t first_unit = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    const RowSpan r = row_span(s, b, window);
    for (int64_t hh = 0; hh < H && r.chunks > 1; ++hh) {
      const int64_t i = b * H + hh;
      if (i < pairs * tid / n || i >= pairs * (tid + 1) / n) continue;
      const int64_t g = hh / G, h = hh % G;
      const float* P = s.partials + (first_unit + g * r.chunks) * unit;
      merge_chunks(P + h * hd, P + G * hd + h, P + G * hd + G + h, r.chunks, unit, hd, s.attn + i * hd);
    }
    if (r.chunks > 1) first_unit += s.kv_heads * r.chunks;
  }
}

// This thread's units of the layer's attention: units are taken in (row, KV head, chunk) order, a unit
// going to the thread its first unit of cost falls in; then, where a row was split, the merge.
template <KVType T>
void attention(const Step& s, int64_t l, int64_t H, int64_t window, int tid, int n) {
  const int64_t KVH = s.kv_heads, G = H / KVH, unit = G * (s.hd + 2);
  int64_t total = 0;
  bool split = false;
  for (int64_t b = 0; b < s.B; ++b) {
    const RowSpan r = row_span(s, b, window);
    total += KVH * (r.len - r.first + UNIT_SETUP * r.chunks);
    split = split || r.chunks > 1;
  }
  const int64_t lo = total * tid / n, hi = total * (tid + 1) / n;
  int64_t at = 0, first_unit = 0;
  for (int64_t b = 0; b < s.B && at < hi; ++b) {
    const RowSpan r = row_span(s, b, window);
    const int64_t row_cost = KVH * (r.len - r.first + UNIT_SETUP * r.chunks);
    if (at + row_cost > lo)
      for (int64_t g = 0, u = first_unit; g < KVH; ++g)
        for (int64_t c = r.c0; c < r.c0 + r.chunks; ++c, ++u) {
          if (at >= lo && at < hi)
            attend_unit<T>(s, l, H, r, b, g, c, r.chunks > 1 ? s.partials + u * unit : nullptr, tid);
          at += r.end(c) - r.begin(c) + UNIT_SETUP;
        }
    else
      at += row_cost;
    if (r.chunks > 1) first_unit += KVH * r.chunks;
  }
  if (!split) return;
  s.sync->wait();
  merge_rows(s, H, window, tid, n);
}

void attention_any(const Step& s, int64_t l, int64_t H, int64_t window, int tid, int n) {
  if (s.kv_type == KVType::BF16) attention<KVType::BF16>(s, l, H, window, tid, n);
  else if (s.kv_type == KVType::F16) attention<KVType::F16>(s, l, H, window, tid, n);
  else attention<KVType::F32>(s, l, H, window, tid, n);
}

// This thread's whole blocks of 32 of `blocks` contiguous ones quantized (blocks are independent).
void quantize_share(const float* x, int64_t blocks, int8_t* codes, float* scales, float* sums, int tid, int n) {
  const int64_t b0 = blocks * tid / n, b1 = blocks * (tid + 1) / n;
  if (b1 > b0) quantize_rows(x + b0 * QK, 1, (b1 - b0) * QK, codes + b0 * QK, scales + b0, sums + b0);
}

inline float gelu_tanh(float g) {
  const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2/pi)
  return 0.5f * g * (1.f + std::tanh(inner));
}

// gate = act(gate) * up and its quantization, on this thread's whole blocks of 32 of [B, F].
void gated_quantized(const Step& s, int64_t F, int tid, int n) {
  const int64_t blocks = s.B * F / QK, b0 = blocks * tid / n, b1 = blocks * (tid + 1) / n;
  for (int64_t i = b0 * QK; i < b1 * QK; ++i) {
    const float g = s.gate[i];
    s.gate[i] = (s.gelu ? gelu_tanh(g) : g / (1.f + std::exp(-g))) * s.up[i];
  }
  quantize_share(s.gate, blocks, s.codes, s.block_scales, s.block_sums, tid, n);
}

// --- mixture-of-experts blocks --------------------------------------------------------------------

// This thread's experts' router scores for every row (s.h: the normalized FFN input, in float).
void router_logits(const Step& s, const float* router, int64_t E, int tid, int n) {
  for (int64_t e = E * tid / n; e < E * (tid + 1) / n; ++e)
    for (int64_t b = 0; b < s.B; ++b) s.logits[b * E + e] = kv_dot<KVType::F32>(router + e * s.D, s.h + b * s.D, s.D);
}

// Thread 0: softmax, the top k of each row (ties to the lower expert, as hardy.model.moe routes),
// renormalized if asked; the pairs grouped by expert and their quantized input rows gathered.
void route_and_group(const Step& s, int64_t E, int64_t k, bool normalize) {
  const int64_t B = s.B, R = B * k, D = s.D, nb = D / QK;
  for (int64_t b = 0; b < B; ++b) {
    float* p = s.logits + b * E;
    float mx = -INFINITY, total = 0.f, kept = 0.f;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, p[e]);
    for (int64_t e = 0; e < E; ++e) { p[e] = std::exp(p[e] - mx); total += p[e]; }
    for (int64_t e = 0; e < E; ++e) p[e] /= total;
    std::fill(s.chosen, s.chosen + E, 0);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!s.chosen[e] && (best < 0 || p[e] > p[best])) best = e;
      s.chosen[best] = 1;
      s.pair_expert[b * k + j] = best;
      s.pair_weight[b * k + j] = p[best];
      kept += p[best];
    }
    if (normalize)
      for (int64_t j = 0; j < k; ++j) s.pair_weight[b * k + j] /= kept;
  }
  std::fill(s.expert_first, s.expert_first + E + 1, 0);
  for (int64_t i = 0; i < R; ++i) s.expert_first[s.pair_expert[i] + 1]++;
  for (int64_t e = 0; e < E; ++e) s.expert_first[e + 1] += s.expert_first[e];
  std::copy(s.expert_first, s.expert_first + E, s.cursor);
  for (int64_t i = 0; i < R; ++i) {  // pairs in token order: each expert's rows keep the tokens' order
    s.row_of[i] = s.cursor[s.pair_expert[i]]++;
    s.token_of[s.row_of[i]] = i / k;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = s.token_of[r];
    std::memcpy(s.moe_codes + r * D, s.codes + t * D, D);
    std::memcpy(s.moe_scales + r * nb, s.block_scales + t * nb, nb * sizeof(float));
    std::memcpy(s.moe_sums + r * nb, s.block_sums + t * nb, nb * sizeof(float));
  }
}

// This thread's share of the active experts' gate and up products (down = false) or down products
// (down = true), the bytes of all of them split evenly between the threads.
void expert_products(const Step& s, const QMatrix* X, int64_t E, bool down, int tid, int n) {
  const int first_m = down ? 2 : 0, count = down ? 1 : 2;
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e)
    if (s.expert_first[e + 1] > s.expert_first[e])
      for (int p = first_m; p < first_m + count; ++p) total += X[3 * e + p].tiles * X[3 * e + p].tile_bytes();
  const int64_t lo = total * tid / n, hi = total * (tid + 1) / n;
  float* xg = s.moe_xg + tid * s.moe_xg_stride;
  int64_t offset = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = s.expert_first[e], rows = s.expert_first[e + 1] - first;
    if (rows == 0) continue;
    for (int p = first_m; p < first_m + count; ++p) {
      const QMatrix& m = X[3 * e + p];
      const int64_t tb = m.tile_bytes(), size = m.tiles * tb;
      const int64_t begin = std::min(m.tiles, std::max<int64_t>(0, (lo - offset + tb - 1) / tb));
      const int64_t end = std::min(m.tiles, std::max<int64_t>(0, (hi - offset + tb - 1) / tb));
      offset += size;
      if (begin >= end) continue;
      const int64_t K = m.K, F = X[0].rows;
      const int8_t* codes = (down ? s.mid_codes : s.moe_codes) + first * K;
      const float* scales = (down ? s.mid_scales : s.moe_scales) + first * K / QK;
      const float* sums = (down ? s.mid_sums : s.moe_sums) + first * K / QK;
      if (m.w4) group_sums(m, rows, sums, xg);
      float* out = down ? s.moe_down + first * s.D : (p == 0 ? s.moe_gate : s.moe_up) + first * F;
      matrix_tiles(m, begin, end, rows, codes, scales, xg, out);
    }
  }
}

// The experts' activation on this thread's whole blocks of 32 of [R, F], quantized for the down products.
void expert_activation(const Step& s, int64_t R, int64_t F, int tid, int n) {
  const int64_t blocks = R * F / QK, b0 = blocks * tid / n, b1 = blocks * (tid + 1) / n;
  for (int64_t i = b0 * QK; i < b1 * QK; ++i) {
    const float g = s.moe_gate[i];
    s.moe_gate[i] = (s.gelu ? gelu_tanh(g) : g / (1.f + std::exp(-g))) * s.moe_up[i];
  }
  quantize_share(s.moe_gate, blocks, s.mid_codes, s.mid_scales, s.mid_sums, tid, n);
}

// Thread 0: each row's weighted sum of its experts' outputs into proj, in expert order (as the module
// path's index_add_ adds them).
void expert_sum(const Step& s, int64_t k) {
  const int64_t D = s.D;
  for (int64_t b = 0; b < s.B; ++b) {
    float* y = s.proj + b * D;
    std::fill(y, y + D, 0.f);
    int64_t order[64];
    for (int64_t j = 0; j < k; ++j) order[j] = b * k + j;
    std::sort(order, order + k, [&](int64_t a, int64_t c) { return s.pair_expert[a] < s.pair_expert[c]; });
    for (int64_t j = 0; j < k; ++j) {
      const float w = s.pair_weight[order[j]];
      const float* d = s.moe_down + s.row_of[order[j]] * D;
      for (int64_t i = 0; i < D; ++i) y[i] += d[i] * w;
    }
  }
}

// A shared expert every row goes through (Qwen2-MoE), after the routed experts' sum is in proj: its
// gate and up products on the FFN input (still in the Step's codes), the gated activation, the down
// product into attn (free until the next block), then proj += sigmoid(gate · h) · shared on thread 0
// (`gated`: the gate row G [D]; else the shared expert's output is added unscaled).
void shared_expert(const Step& s, const QMatrix* X, const float* G, bool gated, int tid, int n) {
  float* gate_up[2] = {s.gate, s.up};
  products(s, X, 2, gate_up, tid, n);
  s.sync->wait();
  gated_quantized(s, X[0].rows, tid, n);
  s.sync->wait();
  products(s, X + 2, 1, &s.attn, tid, n);
  s.sync->wait();
  if (tid == 0)
    for (int64_t b = 0; b < s.B; ++b) {
      const float g = gated ? 1.f / (1.f + std::exp(-kv_dot<KVType::F32>(G, s.h + b * s.D, s.D))) : 1.f;
      float* y = s.proj + b * s.D;
      const float* z = s.attn + b * s.D;
      for (int64_t i = 0; i < s.D; ++i) y[i] += g * z[i];
    }
  s.sync->wait();
}

// After the q/k/v products (thread 0): biases, per-head norms, rotary embedding, the cache write.
void prepare_attention(const Step& s, int64_t l, int64_t H) {
  const BlockExtras& e = s.extras[l];
  const int64_t B = s.B, hd = s.hd, KVH = s.kv_heads;
  add_bias(s.q, e.bq, B, H * hd);
  add_bias(s.k, e.bk, B, KVH * hd);
  add_bias(s.v, e.bv, B, KVH * hd);
  if (e.q_norm) rms_norm(s.q, e.q_norm, B * H, hd, s.eps, s.q);
  if (e.k_norm) rms_norm(s.k, e.k_norm, B * KVH, hd, s.eps, s.k);
  const float* cos = e.local_rope ? s.cos_local : s.cos;
  const float* sin = e.local_rope ? s.sin_local : s.sin;
  rope(s.q, B, H, hd, s.pos, cos, sin);
  rope(s.k, B, KVH, hd, s.pos, cos, sin);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KVH; ++g) {
      kv_store(s.kv_type, const_cast<void*>(kv_at(s, l, b, s.pos[b], 0, g)), s.k + (b * KVH + g) * hd, hd);
      kv_store(s.kv_type, const_cast<void*>(kv_at(s, l, b, s.pos[b], 1, g)), s.v + (b * KVH + g) * hd, hd);
    }
}

// The residual add of a sublayer's output (normalized first where the family has sandwich norms).
void residual(const Step& s, const float* post_norm) {
  if (post_norm) rms_norm(s.proj, post_norm, s.B, s.D, s.eps, s.proj);
  add_into(s.x, s.proj, s.B * s.D);
}

// One thread's part of every block; the barriers order the phases.
void run_blocks(const DecodeStack& st, const Step& s, int tid, int n) {
  const int64_t B = s.B, D = s.D, L = st.norms.size() / 4;
  for (int64_t l = 0; l < L; ++l) {
    const QMatrix* M = st.mats.data() + st.first_mat[l];
    const BlockExtras& e = s.extras[l];
    const int64_t experts = st.moe[4 * l];
    const int64_t H = M[0].rows / s.hd, F = M[4].rows;
    if (tid == 0) {
      if (l > 0) residual(s, s.extras[l - 1].post_ffn);  // the previous block's FFN residual
      rms_norm(s.x, s.norms[2 * l], B, D, s.eps, s.h);
      quantize_rows(s.h, B, D, s.codes, s.block_scales, s.block_sums);
    }
    s.sync->wait();
    float* qkv[3] = {s.q, s.k, s.v};
    products(s, M, 3, qkv, tid, n);
    s.sync->wait();
    if (tid == 0) prepare_attention(s, l, H);
    s.sync->wait();
    attention_any(s, l, H, e.window, tid, n);
    s.sync->wait();
    quantize_share(s.attn, B * M[3].K / QK, s.codes, s.block_scales, s.block_sums, tid, n);
    s.sync->wait();
    products(s, M + 3, 1, &s.proj, tid, n);
    s.sync->wait();
    if (tid == 0) {
      residual(s, e.post_attn);
      rms_norm(s.x, s.norms[2 * l + 1], B, D, s.eps, s.h);
      quantize_rows(s.h, B, D, s.codes, s.block_scales, s.block_sums);
    }
    s.sync->wait();
    if (experts > 0) {
      const int64_t k = st.moe[4 * l + 1];
      router_logits(s, st.routers[l].data_ptr<float>(), experts, tid, n);
      s.sync->wait();
      if (tid == 0) route_and_group(s, experts, k, st.moe[4 * l + 2] != 0);
      s.sync->wait();
      expert_products(s, M + 4, experts, false, tid, n);
      s.sync->wait();
      expert_activation(s, B * k, F, tid, n);
      s.sync->wait();
      expert_products(s, M + 4, experts, true, tid, n);
      s.sync->wait();
      if (tid == 0) expert_sum(s, k);
      s.sync->wait();
      if (st.moe[4 * l + 3]) shared_expert(s, M + 4 + 3 * experts, st.routers[l].data_ptr<float>() + experts * D,
                                           st.moe[4 * l + 3] == 2, tid, n);
      continue;
    }
    float* gate_up[2] = {s.gate, s.up};
    products(s, M + 4, 2, gate_up, tid, n);
    s.sync->wait();
    gated_quantized(s, F, tid, n);
    s.sync->wait();
    products(s, M + 6, 1, &s.proj, tid, n);
    s.sync->wait();
  }
  if (tid == 0 && L > 0) residual(s, s.extras[L - 1].post_ffn);
}

// A block's quantized matrices: q, k, v, o, then the MLP's three or every expert's three (and the
// shared expert's three); `m`: the block's four MoE numbers.
int64_t block_matrices(const int64_t* m) { return m[0] ? 4 + 3 * m[0] + (m[3] ? 3 : 0) : 7; }

const float* optional_weight(const at::Tensor& t, int64_t size, const char* what) {
  if (!t.defined() || t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == size, what,
              ": contiguous float32 of ", size, " values");
  return t.data_ptr<float>();
}

}  // namespace

DecodeStack::DecodeStack(std::vector<at::Tensor> norms_, std::vector<at::Tensor> w_, std::vector<int64_t> dims_,
                         std::vector<at::Tensor> extras_, std::vector<int64_t> windows_, std::vector<int64_t> local_,
                         std::vector<at::Tensor> routers_, std::vector<int64_t> moe_, double eps_, int64_t head_dim_,
                         bool gelu_, double scale_, double softcap_)
    : norms(std::move(norms_)), w(std::move(w_)), dims(std::move(dims_)), extras(std::move(extras_)),
      windows(std::move(windows_)), local(std::move(local_)), eps(eps_), head_dim(head_dim_), gelu(gelu_),
      scale(scale_), softcap(softcap_), routers(std::move(routers_)), moe(std::move(moe_)) {
  const size_t L = norms.size() / 4;
  TORCH_CHECK(norms.size() == 4 * L && extras.size() == 5 * L && windows.size() == L && local.size() == L &&
              routers.size() == L && moe.size() == 4 * L,
              "per block: four norms (two may be empty), five optional extras, a window, a router (may be empty), "
              "four MoE numbers");
  size_t total = 0;
  for (size_t l = 0; l < L; ++l) {
    const int64_t* m = moe.data() + 4 * l;
    TORCH_CHECK(m[0] >= 0 && (m[0] == 0 || (m[1] > 0 && m[1] <= m[0] && m[1] <= 64)) && m[3] >= 0 && m[3] <= 2 &&
                (m[0] > 0 || m[3] == 0), "experts >= 0, 1 <= top k <= min(experts, 64), a shared expert "
                "(0: none, 1: ungated, 2: gated) only in a mixture-of-experts block");
    first_mat.push_back(total);
    total += block_matrices(m);
  }
  TORCH_CHECK(w.size() == 3 * total && dims.size() == 2 * total,
              "per block: q, k, v, o and the MLP's or every expert's gate, up and down (three tensors, two sizes each)");
  check_on_cpu(w, "a block's quantized matrix");
  check_on_cpu(routers, "a router");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "an even head size");
  for (size_t i = 0; i < total; ++i) mats.push_back(quantized_matrix(w[3 * i], w[3 * i + 1], w[3 * i + 2], dims[2 * i], dims[2 * i + 1]));
  for (size_t l = 0; l < L; ++l) {
    const QMatrix* M = mats.data() + first_mat[l];
    const int64_t D = M[0].K, hd = head_dim, E = moe[4 * l], shared = moe[4 * l + 3];
    TORCH_CHECK(M[1].K == D && M[2].K == D && M[0].rows % hd == 0 && M[1].rows % hd == 0 &&
                M[1].rows == M[2].rows && M[3].K == M[0].rows && M[3].rows == D && (l == 0 || D == mats[0].K),
                "a block's attention matrices do not fit together (q, k, v, o)");
    for (int64_t x = 0; x < std::max<int64_t>(E, 1); ++x) {
      const QMatrix* X = M + 4 + 3 * x;
      TORCH_CHECK(X[0].K == D && X[1].K == D && X[0].rows == M[4].rows && X[1].rows == M[4].rows &&
                  M[4].rows % QK == 0 && X[2].K == M[4].rows && X[2].rows == D,
                  "a block's MLP or expert matrices do not fit together (gate, up, down)");
    }
    if (shared) {
      const QMatrix* X = M + 4 + 3 * E;
      TORCH_CHECK(X[0].K == D && X[1].K == D && X[1].rows == X[0].rows && X[0].rows % QK == 0 && X[2].K == X[0].rows &&
                  X[2].rows == D, "a block's shared expert matrices do not fit together (gate, up, down)");
    }
    if (E > 0)
      TORCH_CHECK(routers[l].scalar_type() == at::kFloat && routers[l].is_contiguous() && routers[l].dim() == 2 &&
                  routers[l].size(0) == E + (shared == 2) && routers[l].size(1) == D,
                  "a router: contiguous float32 [experts (+ 1: the shared expert's gate), D]");
    BlockExtras e;
    for (int j = 0; j < 2; ++j)
      TORCH_CHECK(optional_weight(norms[4 * l + j], D, "a block's norm"), "a block's attention and FFN norms");
    check_on_cpu({norms.begin() + 4 * l, norms.begin() + 4 * l + 4}, "a block's norm");
    check_on_cpu({extras.begin() + 5 * l, extras.begin() + 5 * l + 5}, "a block's bias or q/k norm");
    e.post_attn = optional_weight(norms[4 * l + 2], D, "a post-attention norm");
    e.post_ffn = optional_weight(norms[4 * l + 3], D, "a post-FFN norm");
    e.bq = optional_weight(extras[5 * l], M[0].rows, "a q bias");
    e.bk = optional_weight(extras[5 * l + 1], M[1].rows, "a k bias");
    e.bv = optional_weight(extras[5 * l + 2], M[2].rows, "a v bias");
    e.q_norm = optional_weight(extras[5 * l + 3], hd, "a q norm");
    e.k_norm = optional_weight(extras[5 * l + 4], hd, "a k norm");
    TORCH_CHECK(windows[l] >= 0, "a window of >= 0 positions");
    e.window = windows[l];
    e.local_rope = local[l] != 0;
    block_extras.push_back(e);
    norm_weights.push_back(norms[4 * l].data_ptr<float>());
    norm_weights.push_back(norms[4 * l + 1].data_ptr<float>());
  }
}

at::Tensor DecodeStack::operator()(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                                   at::Tensor cos_local, at::Tensor sin_local, at::Tensor pool,
                                   at::Tensor table) const {
  check_on_cpu({x, positions, cos, sin, cos_local, sin_local, pool, table}, "the decode step's input");
  const int64_t L = norms.size() / 4;
  if (L == 0) return x;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == mats[0].K,
              "x: contiguous float32 [B, model width]");
  const int64_t B = x.size(0), D = x.size(1), hd = head_dim;
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == B &&
              positions.is_contiguous(), "one int64 position per row");
  for (const auto* t : {&cos, &sin, &cos_local, &sin_local})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->sizes() == cos.sizes() &&
                t->size(1) == hd, "rotary tables: contiguous float32 [positions, head size]");
  TORCH_CHECK(pool.is_contiguous() && pool.dim() == 6 && pool.size(1) == L && pool.size(2) == 2 && pool.size(5) == hd,
              "the KV pool: contiguous [blocks, layers, 2, kv heads, block, head size]");
  const auto dtype = pool.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "a float32, bf16 or fp16 KV pool");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.size(0) == B && table.is_contiguous(),
              "an int32 block table [B, blocks per row]");
  const int64_t KVH = pool.size(3), block = pool.size(4), width = table.size(1), S = width * block;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* tab = table.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < S && pos[b] < cos.size(0), "position outside the cache or the rotary tables");
    for (int64_t i = 0; i <= pos[b] / block; ++i)
      TORCH_CHECK(tab[b * width + i] >= 0 && tab[b * width + i] < pool.size(0), "a block table entry outside the pool");
  }
  int64_t widest = D, groups = 1, kv_max = 0, experts = 0, top_k = 0, expert_ffn = QK, heads_max = KVH;
  for (int64_t l = 0; l < L; ++l) {
    const QMatrix* M = mats.data() + first_mat[l];
    const int64_t count = block_matrices(moe.data() + 4 * l);
    TORCH_CHECK(M[1].rows == KVH * hd && (M[0].rows / hd) % KVH == 0, "head counts do not match the KV pool");
    widest = std::max({widest, M[0].rows, M[4].rows});
    if (moe[4 * l + 3]) widest = std::max(widest, M[count - 3].rows);  // the shared expert's width
    kv_max = std::max(kv_max, M[1].rows);
    heads_max = std::max(heads_max, M[0].rows / hd);
    for (int64_t j = 0; j < count; ++j) groups = std::max(groups, M[j].groups);
    if (moe[4 * l]) {
      experts = std::max(experts, moe[4 * l]);
      top_k = std::max(top_k, moe[4 * l + 1]);
      expert_ffn = std::max(expert_ffn, M[4].rows);
    }
  }
  const int64_t R = B * top_k;

  const int threads = std::max(1, at::get_num_threads());
  auto out = x.clone();  // the residual stream, updated in place
  const int64_t group_heads = heads_max / KVH, scratch = block * hd + group_heads * (ATTN_CHUNK + 2);
  int64_t split_units = 0;  // every layer attending to all positions: the most partial results a layer leaves
  for (int64_t b = 0; b < B; ++b)
    if (pos[b] >= ATTN_CHUNK) split_units += KVH * (pos[b] / ATTN_CHUNK + 1);
  std::unique_ptr<float[]> partials(split_units ? new float[split_units * group_heads * (hd + 2)] : nullptr);
  std::vector<float> floats(B * (2 * D + 4 * widest + 2 * kv_max + 2 * widest / QK) + threads * (B * groups + scratch) +
                            B * experts + R + 2 * R * D / QK + 2 * R * expert_ffn / QK + 2 * R * expert_ffn + R * D +
                            threads * R * groups);
  std::vector<int8_t> codes(B * widest), moe_codes(R * (D + expert_ffn));
  std::vector<int64_t> ints(3 * R + 2 * experts + 1);
  std::vector<uint8_t> chosen(experts);
  Step s{B, D, hd, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), cos_local.data_ptr<float>(),
         sin_local.data_ptr<float>(), (float)eps};
  float* f = floats.data();
  auto take = [&](int64_t n) { float* p = f; f += n; return p; };
  s.x = out.data_ptr<float>();
  s.h = take(B * D);
  s.proj = take(B * D);
  s.q = take(B * widest);
  s.attn = take(B * widest);
  s.gate = take(B * widest);
  s.up = take(B * widest);
  s.k = take(B * kv_max);
  s.v = take(B * kv_max);
  s.block_scales = take(B * widest / QK);
  s.block_sums = take(B * widest / QK);
  s.xg_stride = B * groups;
  s.xg = take(threads * s.xg_stride);
  s.attn_scratch = take(threads * scratch);
  s.attn_scratch_stride = scratch;
  s.most_group_heads = group_heads;
  s.partials = partials.get();
  s.logits = take(B * experts);
  s.pair_weight = take(R);
  s.moe_scales = take(R * D / QK);
  s.moe_sums = take(R * D / QK);
  s.mid_scales = take(R * expert_ffn / QK);
  s.mid_sums = take(R * expert_ffn / QK);
  s.moe_gate = take(R * expert_ffn);
  s.moe_up = take(R * expert_ffn);
  s.moe_down = take(R * D);
  s.moe_xg_stride = R * groups;
  s.moe_xg = take(threads * s.moe_xg_stride);
  s.moe_codes = moe_codes.data();
  s.mid_codes = moe_codes.data() + R * D;
  s.pair_expert = ints.data();
  s.row_of = ints.data() + R;
  s.token_of = ints.data() + 2 * R;
  s.expert_first = ints.data() + 3 * R;
  s.cursor = ints.data() + 3 * R + experts + 1;
  s.chosen = chosen.data();
  s.codes = codes.data();
  s.norms = norm_weights.data();
  s.extras = block_extras.data();
  s.pool = static_cast<uint8_t*>(pool.data_ptr());
  s.kv_type = dtype == at::kFloat ? KVType::F32 : dtype == at::kBFloat16 ? KVType::BF16 : KVType::F16;
  s.layers = L;
  s.kv_heads = KVH;
  s.block = block;
  s.width = width;
  s.table = tab;
  s.gelu = gelu;
  s.scale = (float)scale;
  s.softcap = (float)softcap;
  SpinBarrier sync;
  s.sync = &sync;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // the team OpenMP gave: every thread stores the same size before its first wait
    sync.threads.store(omp_get_num_threads(), std::memory_order_relaxed);
    run_blocks(*this, s, omp_get_thread_num(), omp_get_num_threads());
  }
#else
  run_blocks(*this, s, 0, 1);
#endif
  return out;
}
