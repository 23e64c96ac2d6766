// A mixture-of-experts block's experts in one call: the (token, slot) pairs grouped by expert, each
// active expert's gate/up/down matrices read once for all of its tokens (in batched decode, rows that
// share an expert share the read), and the tiles of every active expert in one parallel region, so a
// step with 8 active experts keeps every thread busy instead of one expert at a time.
#include "qgemv.h"
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float gelu_tanh(float x) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.f + std::tanh(c * (x + 0.044715f * x * x * x)));
}

// Quantized activation rows (int8 codes, a scale and a sum per block of 32), quantized in parallel.
struct Rows {
  int64_t n = 0, K = 0;
  std::vector<int8_t> codes;
  std::vector<float> scales, sums;
  Rows(int64_t n, int64_t K) : n(n), K(K), codes(n * K), scales(n * K / QK), sums(n * K / QK) {}
  void quantize(const float* x) {
    at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
      quantize_rows(x + b * K, e - b, K, codes.data() + b * K, scales.data() + b * K / QK, sums.data() + b * K / QK);
    });
  }
};

// One matrix applied to a contiguous run of rows: tiles [0, tiles) of it, any split of them.
struct Task {
  const QMatrix* m;
  int64_t first_row, n;  // rows of the activations (and of the output)
  const Rows* in;
  const float* xg;        // group sums [n, groups] (int4)
  float* y;               // [n, m->rows]
};

void run(const std::vector<Task>& tasks) {
  int64_t total = 0;
  for (const auto& t : tasks) total += t.m->tiles;
  at::parallel_for(0, total, 4, [&](int64_t begin, int64_t end) {
    int64_t offset = 0;
    for (const auto& t : tasks) {
      const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + t.m->tiles);
      if (lo < hi) {
        const int64_t K = t.in->K;
        matrix_tiles(*t.m, lo - offset, hi - offset, t.n, t.in->codes.data() + t.first_row * K,
                     t.in->scales.data() + t.first_row * K / QK, t.xg, t.y);
      }
      offset += t.m->tiles;
    }
  });
}

std::vector<float> sums_for(const QMatrix& m, const Rows& in, int64_t first_row, int64_t n) {
  std::vector<float> xg(m.w4 ? n * m.groups : 0);
  if (m.w4) group_sums(m, n, in.sums.data() + first_row * in.K / QK, xg.data());
  return xg;
}

}  // namespace

MoEExperts::MoEExperts(std::vector<at::Tensor> w_, std::vector<int64_t> dims_, bool gelu_)
    : w(std::move(w_)), dims(std::move(dims_)), gelu(gelu_) {
  TORCH_CHECK(dims.size() % 6 == 0 && !dims.empty() && w.size() == 9 * (dims.size() / 6),
              "MoEExperts: three matrices (three tensors, two sizes each) per expert");
  check_on_cpu(w, "an expert");
  n_experts = static_cast<int64_t>(dims.size() / 6);
  for (int64_t e = 0; e < n_experts; ++e)
    for (int p = 0; p < 3; ++p)
      mats.push_back(quantized_matrix(w[9 * e + 3 * p], w[9 * e + 3 * p + 1], w[9 * e + 3 * p + 2],
                                      dims[6 * e + 2 * p], dims[6 * e + 2 * p + 1]));
  dim = mats[0].K;
  ffn = mats[0].rows;
  for (int64_t e = 0; e < n_experts; ++e) {
    const QMatrix &g = mats[3 * e], &u = mats[3 * e + 1], &d = mats[3 * e + 2];
    TORCH_CHECK(g.K == dim && u.K == dim && g.rows == ffn && u.rows == ffn && d.K == ffn && d.rows == dim,
                "MoEExperts: expert ", e, " has other shapes than expert 0");
  }
}

at::Tensor MoEExperts::operator()(at::Tensor x, at::Tensor experts, at::Tensor weights) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == dim && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: contiguous float32 [tokens, ", dim, "]");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == x.size(0) && experts.scalar_type() == at::kLong &&
                  experts.is_contiguous(), "experts: contiguous int64 [tokens, k]");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "weights: contiguous float32 [tokens, k]");
  check_on_cpu({x, experts, weights}, "the input");
  const int64_t T = x.size(0), k = experts.size(1), R = T * k;
  const int64_t* ex = experts.data_ptr<int64_t>();
  // group the pairs by expert (stable: a token's rows keep their order), and where each pair's row lands
  std::vector<int64_t> count(n_experts + 1, 0);
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(ex[i] >= 0 && ex[i] < n_experts, "expert index ", ex[i], " outside [0, ", n_experts, ")");
    count[ex[i] + 1]++;
  }
  std::partial_sum(count.begin(), count.end(), count.begin());  // count[e]: the first row of expert e
  std::vector<int64_t> row_of(R), next(count.begin(), count.end() - 1);
  std::vector<int64_t> token_of(R);
  for (int64_t i = 0; i < R; ++i) {
    row_of[i] = next[ex[i]]++;
    token_of[row_of[i]] = i / k;
  }
  // the tokens quantized once, their rows gathered per expert (codes, scales, sums: a copy, not a re-quantization)
  Rows tokens(T, dim), in(R, dim);
  tokens.quantize(x.data_ptr<float>());
  const int64_t nb = dim / QK;
  at::parallel_for(0, R, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = token_of[r];
      std::memcpy(in.codes.data() + r * dim, tokens.codes.data() + t * dim, dim);
      std::memcpy(in.scales.data() + r * nb, tokens.scales.data() + t * nb, nb * sizeof(float));
      std::memcpy(in.sums.data() + r * nb, tokens.sums.data() + t * nb, nb * sizeof(float));
    }
  });
  // gate and up of every active expert in one parallel region. The buffers of each phase are freed
  // before the next one's are taken: a 512-token prefill of 8 experts each (R = 4096 rows) otherwise
  // holds gate, up and the gathered inputs (~34 MB at Qwen3-30B-A3B's sizes) beside the down outputs.
  std::vector<float> gate(R * ffn), up(R * ffn);
  std::vector<std::vector<float>> xg;
  std::vector<Task> tasks;
  xg.reserve(3 * n_experts);
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t first = count[e], n = count[e + 1] - count[e];
    if (n == 0) continue;
    for (int p = 0; p < 2; ++p) {
      xg.push_back(sums_for(mats[3 * e + p], in, first, n));
      tasks.push_back({&mats[3 * e + p], first, n, &in, xg.back().data(), (p ? up : gate).data() + first * ffn});
    }
  }
  run(tasks);
  in = Rows(0, dim);
  // the activation, quantized for the down projections
  at::parallel_for(0, R * ffn, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) gate[i] = (gelu ? gelu_tanh(gate[i]) : silu(gate[i])) * up[i];
  });
  Rows mid(R, ffn);
  mid.quantize(gate.data());
  std::vector<float>().swap(gate);
  std::vector<float>().swap(up);
  std::vector<float> down(R * dim);
  tasks.clear();
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t first = count[e], n = count[e + 1] - count[e];
    if (n == 0) continue;
    xg.push_back(sums_for(mats[3 * e + 2], mid, first, n));
    tasks.push_back({&mats[3 * e + 2], first, n, &mid, xg.back().data(), down.data() + first * dim});
  }
  run(tasks);
  // each token's weighted sum, its experts added in index order (as the module path adds them)
  auto out = at::empty({T, dim}, at::kFloat);
  float* y = out.data_ptr<float>();
  std::fill(y, y + T * dim, 0.f);
  const float* wt = weights.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    std::vector<int64_t> slots(k);
    for (int64_t t = b; t < e; ++t) {
      std::iota(slots.begin(), slots.end(), 0);
      std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t c) { return ex[t * k + a] < ex[t * k + c]; });
      for (int64_t s : slots) {
        const float w_ = wt[t * k + s];
        const float* d = down.data() + row_of[t * k + s] * dim;
        for (int64_t j = 0; j < dim; ++j) y[t * dim + j] += d[j] * w_;
      }
    }
  });
  return out;
}
