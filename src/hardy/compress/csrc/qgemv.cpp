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
#include "tiles.h"
#include "dequant_tiles.h"
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
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
  if (int4 && scales.scalar_type() == at::kByte) {  // the K-quant forms (qgemv.h)
    const int64_t nsb = m.groups / K_GROUPS;
    const bool five = mins.scalar_type() == at::kInt;  // Q5_K: fifth bits, then d/dmin
    TORCH_CHECK(group == QK && m.groups % K_GROUPS == 0 && scales.is_contiguous() && scales.dim() == 3 &&
                scales.size(0) == m.tiles && scales.size(1) == 2 * m.groups && scales.size(2) == 8 &&
                (five || mins.scalar_type() == at::kHalf) && mins.is_contiguous() && mins.dim() == 3 &&
                mins.size(0) == m.tiles && mins.size(1) == (five ? m.groups + nsb : 2 * nsb) && mins.size(2) == 8,
                "K-quant form: group 32, whole super-blocks of 256, uint8 sc/m [tiles, 2 x groups, 8] and fp16 "
                "d/dmin [tiles, 2 x super-blocks, 8] (the 5-bit form: int32 fifth bits and d/dmin "
                "[tiles, blocks + super-blocks, 8])");
    m.w4 = qweight.data_ptr<uint8_t>();
    m.kscales = scales.data_ptr<uint8_t>();
    if (five) {
      m.high = reinterpret_cast<const uint32_t*>(mins.data_ptr<int32_t>());
      m.high_stride = (m.groups + nsb) * 8;
      m.supers = reinterpret_cast<const uint16_t*>(m.high + m.groups * 8);
      m.super_stride = 2 * m.high_stride;
    } else {
      m.supers = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
      m.super_stride = 2 * nsb * 8;
    }
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
    if (bits5) {
      m.high = reinterpret_cast<const uint32_t*>(mins.data_ptr<int32_t>());
      m.high_stride = (m.K / QK) * 8;
    }
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

// T rows through the plain int4 grid's tiles [begin, end), four rows per pass over a tile, then the rest.
template <bool HasMin>
void int4_rows(const QMatrix& m, int64_t begin, int64_t end, int64_t T, const int8_t* XQ, const float* DX,
               const float* xg, float* Y) {
  const int64_t K = m.K, nb = K / QK, G = m.groups, bpg = m.blocks_per_group, N = m.rows;
  for (int64_t i = begin; i < end; ++i) {
    const uint8_t* W = m.w4 + i * 4 * K;
    const uint16_t* S = m.scales + i * G * 8;
    const uint16_t* M = HasMin ? m.mins + i * G * 8 : nullptr;
    const int64_t valid = std::min<int64_t>(8, N - i * 8);
    int64_t t = 0;
    auto rows = [&](auto r) {
      q4_tile8_rows<HasMin, decltype(r)::value>(W, S, M, XQ + t * K, K, DX + t * nb, xg + t * G, nb, G, bpg,
                                                 Y + t * N + i * 8, N, valid);
      t += decltype(r)::value;
    };
    while (T - t >= 4) rows(std::integral_constant<int, 4>{});
    if (T - t == 3) rows(std::integral_constant<int, 3>{});
    else if (T - t == 2) rows(std::integral_constant<int, 2>{});
    else if (T - t == 1) rows(std::integral_constant<int, 1>{});
  }
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
    if (m.high) prefetch_start(m.high_of(begin), (end - begin) * m.high_stride * 4);
    if (m.kscales) {  // per tile: 16 bytes of sc/m per group, 16 halves of d/dmin per super-block
      const auto tile = m.high ? q4_tile8<true, true, true> : q4_tile8<true, false, true>;
      for (int64_t i = begin; i < end; ++i)
        for (int64_t t = 0; t < T; ++t)
          tile(W + i * 4 * K, nullptr, m.supers_of(i), XQ + t * K, DX + t * nb, xg + t * G, nb, G, bpg,
               Y + t * N + i * 8, std::min<int64_t>(8, N - i * 8), m.high_of(i), m.kscales + i * G * 16);
      return;
    }
    if (!m.high && T > 1) {  // several rows: each tile unpacked once for up to 4 of them
      if (m.mins) int4_rows<true>(m, begin, end, T, XQ, DX, xg, Y);
      else int4_rows<false>(m, begin, end, T, XQ, DX, xg, Y);
      return;
    }
    const auto tile = m.high ? q4_tile8<false, true> : m.mins ? q4_tile8<true> : q4_tile8<false>;
    for (int64_t i = begin; i < end; ++i)
      for (int64_t t = 0; t < T; ++t)
        tile(W + i * 4 * K, S + i * G * 8, m.mins ? m.mins + i * G * 8 : nullptr, XQ + t * K, DX + t * nb,
             xg + t * G, nb, G, bpg, Y + t * N + i * 8, std::min<int64_t>(8, N - i * 8), m.high_of(i), nullptr);
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
// values of a block share one scale (and min). The 4-bit K-quant form reads its sc/m bytes and d/dmin (qgemv.h); the 6-bit one has its own row.
static void dequant_row(const QMatrix& q, int64_t r, float* y) {
  if (q.k6scales) return dequant_row6(q, r, y);
  const int64_t K = q.K, nb = K / QK, G = q.groups;
  if (q.w4) {
    const uint16_t* M = q.kscales ? q.supers : q.mins;
    const uint32_t* H = q.high;
    const uint8_t* w = q.w4 + (r / 8) * 4 * K;
    const int64_t lane = r % 8, base = (r / 8) * G * 8 + lane;
    const uint8_t* sk = q.kscales ? q.kscales + (r / 8) * G * 16 : nullptr;
    const uint16_t* dk = q.kscales ? q.supers_of(r / 8) : nullptr;
    const uint32_t* h_tile = q.high_of(r / 8);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = b / q.blocks_per_group;
      const float s = sk ? k_scale(sk, dk, g, lane) : half_to_float(q.scales[base + g * 8]);
      const float m = sk ? k_min(sk, dk, g, lane) : M ? half_to_float(M[base + g * 8]) : 0.f;
      const float off = M ? 0.f : H ? 16.f : 8.f;
      const uint32_t h = H ? h_tile[b * 8 + lane] : 0;
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
    const int8_t* w = q.w8 + (r / 8) * 8 * K + 4 * (r % 8);
    const int64_t base = (r / 8) * G * 8 + r % 8;
    for (int64_t b = 0; b < nb; ++b) {
      const float s = half_to_float(q.scales[base + (b / q.blocks_per_group) * 8]);
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
  auto out = at::empty({n, K}, at::kFloat);
  const int64_t* R = rows.data_ptr<int64_t>();
  float* Y = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(R[i] >= 0 && R[i] < N, "row id out of range");
    dequant_row(q, R[i], Y + i * K);
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
  if (has_vector_dequant() && n > 0) {  // a tile at a time: its chunks transposed once for its 8 rows
    void* Y = out.data_ptr();
    at::parallel_for(begin / 8, (begin + n - 1) / 8 + 1, 2, [&](int64_t lo, int64_t hi) {
      for (int64_t tile = lo; tile < hi; ++tile) tile_rows(q, begin, n, tile, Y, bf16);
    });
    return;
  }
  float* F = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* B = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(bf16 ? K : 0);
    for (int64_t i = lo; i < hi; ++i) {
      float* y = bf16 ? row.data() : F + i * K;
      dequant_row(q, begin + i, y);
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
