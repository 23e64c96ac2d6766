// GGUF blocks straight into the kernels' tiled layouts (qgemv.cpp reads them): Q4_0/Q4_1, Q8_0, and the
// K-quants Q4_K, Q5_K and Q6_K (exact, in the K-quant forms of qgemv.h; docs/quantization.md).
#include "qgemv.h"
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>

// The GGUF converters' shared pieces: their input is [source rows, blocks x bytes] on the CPU and every
// output row names a source row that exists (a tensor-parallel rank converts only its rows: fewer
// output rows than source rows); one row's bytes of a 32-value block (hardy's stored order: 16 for
// int4, 32 for int8) go to their places in the tile's 128 or 256, 4 bytes per 32-byte chunk.
// Returns the number of output rows.
static int64_t check_gguf_input(const at::Tensor& blocks, const at::Tensor& order, int64_t block_bytes,
                                const char* what) {
  check_on_cpu({blocks, order}, "a GGUF conversion");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) % block_bytes == 0 && order.scalar_type() == at::kLong && order.dim() == 1,
              what, ": contiguous uint8 [rows, blocks x ", block_bytes,
              " bytes] and one int64 source row per output row");
  const int64_t* ord = order.data_ptr<int64_t>();
  for (int64_t i = 0, n = order.numel(); i < n; ++i)
    TORCH_CHECK(ord[i] >= 0 && ord[i] < blocks.size(0), "source row out of range");
  return order.numel();
}

template <int Chunks = 4>
static inline void put_tiled(uint8_t* tile_block, int64_t lane, const uint8_t* bytes) {
  for (int c = 0; c < Chunks; ++c) std::memcpy(tile_block + 32 * c + 4 * lane, bytes + 4 * c, 4);
}

// GGUF Q4_0 / Q4_1 blocks (fp16 d [, fp16 m], 16 bytes of nibbles; `blocks` [rows, row bytes]) straight
// into the kernel's tiled int4 layout (tile_codes of hardy's stored layout, which is Q4_1's), output row
// i taken from source row order[i] (the q/k unpermutation) — one pass over the file's bytes instead
// of unpacking, re-laying and tiling in several. Q4_0 keeps its grid ((q - 8)·d: no mins, mins empty).
std::vector<at::Tensor> q4_gguf_to_tiled(at::Tensor blocks, bool has_min, at::Tensor order) {
  const int64_t B = has_min ? 20 : 18, rows = check_gguf_input(blocks, order, B, "q4_gguf_to_tiled");
  const int64_t nb = blocks.size(1) / B, K = nb * QK, tiles = (rows + 7) / 8;
  auto q = at::empty({tiles * 8, K / 2}, at::kByte);
  auto scales = at::empty({tiles, nb, 8}, at::kHalf);
  auto mins = has_min ? at::empty({tiles, nb, 8}, at::kHalf) : at::empty({0}, at::kHalf);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* Q = q.data_ptr<uint8_t>();
  uint16_t* S = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  uint16_t* M = has_min ? reinterpret_cast<uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  // tile by tile, so every write is sequential: block b of the tile gathers its 8 rows' bytes
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t tile = lo; tile < hi; ++tile) {
      const uint8_t* row[8];
      const int64_t valid = std::min<int64_t>(8, rows - tile * 8);
      for (int64_t lane = 0; lane < 8; ++lane) row[lane] = lane < valid ? src + ord[tile * 8 + lane] * nb * B : nullptr;
      uint8_t* out = Q + tile * 4 * K;
      for (int64_t b = 0; b < nb; ++b, out += 128) {
        uint16_t* s = S + (tile * nb + b) * 8;
        uint16_t* m = has_min ? M + (tile * nb + b) * 8 : nullptr;
        for (int64_t lane = 0; lane < 8; ++lane) {
          if (!row[lane]) {  // padding rows of the last tile: zero weights, scales and mins
            for (int c = 0; c < 4; ++c) std::memset(out + 32 * c + 4 * lane, 0, 4);
            s[lane] = 0;
            if (m) m[lane] = 0;
            continue;
          }
          const uint8_t* blk = row[lane] + b * B;
          std::memcpy(s + lane, blk, 2);
          if (has_min) std::memcpy(m + lane, blk + 2, 2);
          put_tiled(out, lane, blk + (has_min ? 4 : 2));
        }
      }
    }
  });
  return {q, scales, mins};
}

// GGUF Q8_0 blocks (fp16 d, 32 int8) straight into the kernel's tiled int8 layout: codes [rows rounded
// up to 8, K], fp16 scales [tiles, K/32, 8], output row i from source row order[i]; padding rows zero.
std::vector<at::Tensor> q8_gguf_to_tiled(at::Tensor blocks, at::Tensor order) {
  const int64_t rows = check_gguf_input(blocks, order, 34, "q8_gguf_to_tiled");
  const int64_t nb = blocks.size(1) / 34, K = nb * QK, tiles = (rows + 7) / 8;
  auto codes = at::zeros({tiles * 8, K}, at::kChar);
  auto scales = at::zeros({tiles, nb, 8}, at::kHalf);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* C = reinterpret_cast<uint8_t*>(codes.data_ptr<int8_t>());
  uint16_t* S = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {  // tile by tile: sequential writes
    for (int64_t tile = lo; tile < hi; ++tile)
      for (int64_t lane = 0; lane < std::min<int64_t>(8, rows - tile * 8); ++lane) {
        const uint8_t* row = src + ord[tile * 8 + lane] * nb * 34;
        for (int64_t b = 0; b < nb; ++b) {
          std::memcpy(S + (tile * nb + b) * 8 + lane, row + b * 34, 2);
          put_tiled<8>(C + tile * 8 * K + b * 256, lane, row + b * 34 + 2);
        }
      }
  });
  return {codes, scales};
}

// GGUF Q6_K super-blocks (ql[128], qh[64], int8 scales[16], fp16 d; 256 values each) into the 6-bit
// K-quant form (qgemv.h), rows in their order: each value's 6-bit code as llama.cpp's
// dequantize_row_q6_K reads it, split into the int4 layout's low nibbles and two bit planes; the 16
// scales and d copied (d widened to fp32, exactly) — nothing is rounded.
std::vector<at::Tensor> q6k_to_tiled(at::Tensor blocks) {
  check_on_cpu({blocks}, "a GGUF conversion");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) % 210 == 0, "q6k_to_tiled: contiguous uint8 [rows, super-blocks x 210]");
  const int64_t rows = blocks.size(0), nsb = blocks.size(1) / 210, nb = nsb * 8, K = nb * QK, tiles = (rows + 7) / 8;
  const int64_t aux_rows = 2 * nb + nsb;
  auto q = at::zeros({tiles * 8, K / 2}, at::kByte);
  auto scales = at::zeros({tiles, 2 * nb, 8}, at::kChar);
  auto aux = at::zeros({tiles, aux_rows, 8}, at::kInt);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* Q = q.data_ptr<uint8_t>();
  int8_t* SC = scales.data_ptr<int8_t>();
  uint32_t* A = reinterpret_cast<uint32_t*>(aux.data_ptr<int32_t>());
  at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
    uint8_t codes[256];
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t tile = r / 8, lane = r % 8;
      uint32_t* a = A + tile * aux_rows * 8 + lane;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* blk = src + (r * nsb + sb) * 210;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        for (int n = 0; n < 2; ++n)  // two halves of 128 values, as dequantize_row_q6_K walks them
          for (int l = 0; l < 32; ++l) {
            const uint8_t* L = ql + 64 * n;
            const uint8_t h = qh[32 * n + l];
            codes[128 * n + l] = (uint8_t)((L[l] & 0xF) | ((h >> 0) & 3) << 4);
            codes[128 * n + l + 32] = (uint8_t)((L[l + 32] & 0xF) | ((h >> 2) & 3) << 4);
            codes[128 * n + l + 64] = (uint8_t)((L[l] >> 4) | ((h >> 4) & 3) << 4);
            codes[128 * n + l + 96] = (uint8_t)((L[l + 32] >> 4) | ((h >> 6) & 3) << 4);
          }
        uint16_t dh;
        std::memcpy(&dh, blk + 208, 2);
        const float d = half_to_float(dh);
        std::memcpy(a + (2 * nb + sb) * 8, &d, 4);
        for (int j = 0; j < 8; ++j) {
          const int64_t b = sb * 8 + j;
          const uint8_t* c = codes + 32 * j;
          uint8_t stored[16];
          uint32_t five = 0, six = 0;
          for (int i = 0; i < 16; ++i) stored[i] = (uint8_t)((c[i] & 15) | ((c[i + 16] & 15) << 4));
          for (int i = 0; i < 32; ++i) {
            five |= (uint32_t)((c[i] >> 4) & 1) << fifth_bit_at(i);
            six |= (uint32_t)((c[i] >> 5) & 1) << fifth_bit_at(i);
          }
          put_tiled(Q + tile * 4 * K + b * 128, lane, stored);
          a[b * 8] = five;
          a[(nb + b) * 8] = six;
          SC[(tile * 2 * nb + 2 * b) * 8 + lane] = (int8_t)blk[192 + 2 * j];
          SC[(tile * 2 * nb + 2 * b + 1) * 8 + lane] = (int8_t)blk[192 + 2 * j + 1];
        }
      }
    }
  });
  return {q, scales, aux};
}

// GGUF Q4_K super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales/mins, 128 bytes of
// nibbles; 256 values) into the K-quant form of the tiled layout (qgemv.h), output row i taken from
// source row order[i]: the codes unchanged (re-paired into hardy's nibble order), each sub-block's
// 6-bit scale and min unpacked to a byte, d and dmin copied — nothing is rounded. Q5_K (`five`) is the
// same super-block with 32 bytes of fifth bits (qh) before the nibbles: bit g of qh[i] is the fifth bit
// of value i of sub-block g; its plane and d/dmin come back as one int32 tensor (qgemv.h).
static std::vector<at::Tensor> k_quant_to_tiled(const at::Tensor& blocks, const at::Tensor& order, bool five) {
  const int64_t B = five ? 176 : 144, rows = check_gguf_input(blocks, order, B, five ? "q5k_to_tiled" : "q4k_to_tiled");
  const int64_t nsb = blocks.size(1) / B, nb = nsb * 8, K = nb * QK, tiles = (rows + 7) / 8;
  auto q = at::zeros({tiles * 8, K / 2}, at::kByte);
  auto kscales = at::zeros({tiles, 2 * nb, 8}, at::kByte);
  // per tile: the fifth bits (Q5_K) [nb, 8] as uint32, then d/dmin [2 x nsb, 8] as fp16
  const int64_t plane = five ? nb * 8 : 0, tile_halves = 2 * plane + 2 * nsb * 8;
  auto aux = five ? at::zeros({tiles, nb + nsb, 8}, at::kInt) : at::zeros({tiles, 2 * nsb, 8}, at::kHalf);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  uint8_t* Q = q.data_ptr<uint8_t>();
  uint8_t* SK = kscales.data_ptr<uint8_t>();
  uint16_t* A = static_cast<uint16_t*>(aux.data_ptr());
  at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t tile = i / 8, lane = i % 8;
      uint32_t* H = reinterpret_cast<uint32_t*>(A + tile * tile_halves);
      uint16_t* D = A + tile * tile_halves + 2 * plane;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* blk = src + (ord[i] * nsb + sb) * B;
        std::memcpy(D + 2 * sb * 8 + lane, blk, 2);
        std::memcpy(D + (2 * sb + 1) * 8 + lane, blk + 2, 2);
        const uint8_t* sc = blk + 4;
        const uint8_t* qh = blk + 16;
        const uint8_t* qs = blk + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          int scale, mn;  // llama.cpp's get_scale_min_k4
          if (j < 4) {
            scale = sc[j] & 63;
            mn = sc[j + 4] & 63;
          } else {
            scale = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
            mn = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
          }
          const int64_t g = sb * 8 + j;
          SK[(tile * 2 * nb + 2 * g) * 8 + lane] = (uint8_t)scale;
          SK[(tile * 2 * nb + 2 * g + 1) * 8 + lane] = (uint8_t)mn;
          const uint8_t* chunk = qs + 32 * (j / 2);
          uint8_t stored[16];
          for (int b = 0; b < 16; ++b)
            stored[b] = (j % 2 == 0) ? (uint8_t)((chunk[b] & 0x0F) | ((chunk[b + 16] & 0x0F) << 4))
                                     : (uint8_t)((chunk[b] >> 4) | (chunk[b + 16] & 0xF0));
          put_tiled(Q + tile * 4 * K + g * 128, lane, stored);
          if (five) {
            uint32_t bits = 0;
            for (int v = 0; v < 32; ++v) bits |= (uint32_t)((qh[v] >> j) & 1) << fifth_bit_at(v);
            H[g * 8 + lane] = bits;
          }
        }
      }
    }
  });
  return {q, kscales, aux};
}

std::vector<at::Tensor> q4k_to_tiled(at::Tensor blocks, at::Tensor order) { return k_quant_to_tiled(blocks, order, false); }
std::vector<at::Tensor> q5k_to_tiled(at::Tensor blocks, at::Tensor order) { return k_quant_to_tiled(blocks, order, true); }
