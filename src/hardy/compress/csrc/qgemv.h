// The fused quantized products (qgemv.cpp) and the fused decode layer (decode_layer.cpp), bound to
// Python in bindings.cpp. Only ATen's core tensor header here, not <torch/extension.h>: that one is
// ~80% of a file's compile time (measured: 42 of 51 s), and only the bindings need pybind.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define HARDY_AVX2 1
#endif

constexpr int64_t QK = 32;

// Where code j (< 32) of a block sits in its row's 32-bit word of fifth (or sixth) bits: byte j % 4,
// bit 2c + h for chunk c = (j % 16) / 4 and nibble h = j / 16 — where the tile loop reads it.
inline int fifth_bit_at(int j) { return 8 * (j % 4) + 2 * ((j % 16) / 4) + j / 16; }

inline float half_to_float(uint16_t h) {
#ifdef HARDY_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) { bits = sign; }
    else {  // subnormal
      int e = -1; uint32_t m = mant;
      do { e++; m <<= 1; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) { bits = sign | 0x7f800000u | (mant << 13); }
  else { bits = sign | ((exp + 127 - 15) << 23) | (mant << 13); }
  float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

// One quantized matrix as the kernels read it: pointers into the tensors of its owner, which keeps
// them alive. int4 (w4: GGUF Q4 nibbles) or int8 (w8) codes in tiles of 8 rows
// (hardy.compress.kernels.tile_codes), fp16 scales [tiles, groups, 8], and mins of the same shape on
// the asymmetric int4 grid (null on the symmetric grids).
// The 5-bit grid ((code − 16) · scale: GGUF Q5_0) is the int4 layout of the codes' low nibbles plus
// their fifth bits (high), one uint32 per row and block of 32 [tiles, blocks, 8], passed in the mins'
// place (int32 instead of fp16).
// The K-quant form (GGUF Q4_K, exact): the int4 codes with, per row and group of 32, a 6-bit scale sc
// and min m as bytes (`kscales`, uint8 [tiles, 2 x groups, 8]: sc then m of each group) and per
// super-block of 256 the fp16 factors d and dmin (`supers`, passed in the mins' place: fp16
// [tiles, 2 x super-blocks, 8]); the weight is code · (d·sc) − dmin·m, both products exact in fp32,
// as llama.cpp computes them: 148 bytes per row and super-block, the file's 144 plus the unpacked sc/m.
// Its 5-bit variant (GGUF Q5_K, exact) adds the 5-bit grid's plane of fifth bits (codes 0-31): the plane
// and d/dmin travel in the mins' place as one int32 tensor [tiles, blocks + super-blocks, 8] (each tile's
// plane, then its fp16 d/dmin pairs as above): 180 bytes per row and super-block against the file's 176.
constexpr int64_t K_GROUPS = 8;  // groups of 32 per super-block of 256
// The 6-bit K-quant form (GGUF Q6_K, exact): codes 0-63 as the int4 layout's low nibbles plus two planes of
// bits (the fifth and the sixth, each laid out as the 5-bit grid's), an int8 scale sc per 16 values
// (`k6scales`, int8 [tiles, 2 x blocks, 8]: each block's halves) and per super-block the fp16 d (held as
// fp32): w = (code − 32) · (d·sc). The planes and d travel in the mins' place as one int32 tensor
// [tiles, 2 x blocks + super-blocks, 8] (`high`, `high6`, `d6` point into it): 212 bytes per row and
// super-block against the file's 210.
struct QMatrix {
  const uint8_t* w4 = nullptr;
  const int8_t* w8 = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* mins = nullptr;
  const uint32_t* high = nullptr;  // 5-bit: the codes' fifth bits
  const uint8_t* kscales = nullptr;  // K-quant form: sc and m per group
  const uint16_t* supers = nullptr;  // K-quant form: d and dmin per super-block
  const int8_t* k6scales = nullptr;  // 6-bit K-quant form: sc per half block
  const uint32_t* high6 = nullptr;   // 6-bit K-quant form: the codes' sixth bits
  const float* d6 = nullptr;         // 6-bit K-quant form: d per super-block
  int64_t K = 0, rows = 0, tiles = 0, groups = 0, blocks_per_group = 0;
  int64_t high_stride = 0, super_stride = 0;  // uint32s of `high`, halves of `supers` per tile
  int64_t tile_bytes() const { return w4 ? (high ? 5 * K : 4 * K) : 8 * K; }
  const uint32_t* high_of(int64_t tile) const { return high ? high + tile * high_stride : nullptr; }
  const uint16_t* supers_of(int64_t tile) const { return supers + tile * super_stride; }
};
// Checks the tensors' layout (one message naming what is wrong) and points into them.
QMatrix quantized_matrix(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t group,
                         int64_t rows);
// x [T, K] -> int8 codes [T, K], a scale and the sum of the quantized values per block of 32 [T, K/32].
// Blocks are independent: any whole-block range of a row-major [T, K] can be quantized on its own.
void quantize_rows(const float* x, int64_t T, int64_t K, int8_t* codes, float* block_scales, float* block_sums);
// The per-group sums of the activations [T, groups] that an int4 matrix's offset term multiplies.
void group_sums(const QMatrix& m, int64_t T, const float* block_sums, float* xg);
// y[t, 8i .. 8i + 8) for the tiles i in [begin, end) and every activation row t < T (y is [T, rows]);
// xg from group_sums (unused by int8).
void matrix_tiles(const QMatrix& m, int64_t begin, int64_t end, int64_t T, const int8_t* codes,
                  const float* block_scales, const float* xg, float* y);

// These kernels read host memory through data pointers: a tensor elsewhere (CUDA, meta) is refused
// with one message instead of being read as if it were host memory.
void check_on_cpu(const std::vector<at::Tensor>& tensors, const char* what);

at::Tensor qgemv(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group, int64_t rows);
at::Tensor dequant_rows(at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group, at::Tensor rows);
void dequant_range(at::Tensor qweight, at::Tensor scales, at::Tensor mins, int64_t group, int64_t begin,
                   at::Tensor out);
std::vector<at::Tensor> q4_gguf_to_tiled(at::Tensor blocks, bool has_min, at::Tensor order);
std::vector<at::Tensor> q8_gguf_to_tiled(at::Tensor blocks, at::Tensor order);
std::vector<at::Tensor> q6k_to_tiled(at::Tensor blocks);  // the 6-bit K-quant form
std::vector<at::Tensor> q4k_to_tiled(at::Tensor blocks, at::Tensor order);
std::vector<at::Tensor> q5k_to_tiled(at::Tensor blocks, at::Tensor order);  // the 5-bit K-quant form
// The vector ISA this build's products use (the build flags decide: hardy.compress.kernels._isa).
bool built_with_avx2();
bool built_with_vnni();

std::vector<at::Tensor> qgemv_many(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                   const std::vector<int64_t>& dims);
// All transformer blocks of a model for one new token per row (decode_layer.cpp): built once with
// the blocks' weights and options, so a decode step passes only the activations and the paged KV cache.
// One block's optional parts (null / 0 where the family has none).
struct BlockExtras {
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;  // q/k/v biases (Qwen2)
  const float *q_norm = nullptr, *k_norm = nullptr;         // per-head RMSNorm weights (Qwen3, Gemma 3)
  const float *post_attn = nullptr, *post_ffn = nullptr;    // sandwich norms (Gemma)
  int64_t window = 0;                                       // sliding window (0: every earlier position)
  bool local_rope = false;                                  // the sliding layers' own rotary tables
};
struct DecodeStack {
  DecodeStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> w, std::vector<int64_t> dims,
              std::vector<at::Tensor> extras, std::vector<int64_t> windows, std::vector<int64_t> local,
              std::vector<at::Tensor> routers, std::vector<int64_t> moe, double eps, int64_t head_dim, bool gelu,
              double scale, double softcap);
  at::Tensor operator()(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor cos_local,
                        at::Tensor sin_local, at::Tensor pool, at::Tensor table) const;
  std::vector<at::Tensor> norms, w;  // per block: attention, FFN, post-attention, post-FFN norm; (4 + 3 x (experts or 1)
                                     // [+ 3: a shared expert]) x (qweight, scales, mins)
  std::vector<int64_t> dims;         // per block: as many (group, rows)
  std::vector<at::Tensor> extras;    // per block: q, k, v biases, q and k norms (empty where absent)
  std::vector<int64_t> windows, local;  // per block: sliding window (0: none), 1: the local rotary tables
  double eps;
  int64_t head_dim;
  bool gelu;             // GELU-tanh gate (Gemma) instead of SiLU
  double scale, softcap;  // the query scale; attention scores soft-capped at this (0: not)
  std::vector<at::Tensor> routers;   // per block: the router [experts, D] of a mixture-of-experts block (+ the shared
                                     // expert's gate as a last row), else empty
  std::vector<int64_t> moe;          // per block: experts (0: a dense block), top k, renormalize the k weights (1/0),
                                     // a shared expert (0: none, 1: added as it is, 2: scaled by sigmoid(gate · x))
  std::vector<QMatrix> mats;         // per block: q, k, v, o, then gate, up, down (of each expert in turn, then the shared one)
  std::vector<int64_t> first_mat;    // per block: its q's index in mats
  std::vector<BlockExtras> block_extras;
  std::vector<const float*> norm_weights;  // per block: attention and FFN norm
};

// A mixture-of-experts block's experts (moe.cpp): built once from every expert's gate, up and down
// matrices; a call takes the tokens, each token's k experts and weights, and returns the weighted sum.
struct MoEExperts {
  MoEExperts(std::vector<at::Tensor> w, std::vector<int64_t> dims, bool gelu);
  at::Tensor operator()(at::Tensor x, at::Tensor experts, at::Tensor weights) const;
  std::vector<at::Tensor> w;  // per expert: 3 x (qweight, scales, mins) for gate, up, down
  std::vector<int64_t> dims;  // per expert: 3 x (group, rows)
  bool gelu;
  int64_t n_experts = 0, dim = 0, ffn = 0;
  std::vector<QMatrix> mats;  // per expert: gate, up, down
};
