// The raw-pointer linear kernels every native path shares (quant_linear.cpp, float_linear.cpp), so that the modules'
// ops (bindings.cpp) and the fused step (step_layers.cpp) compute each output with one and the same sequence of
// float operations, whatever the number of rows, the tile a row falls in, or the thread that computes it.
//
// Batch invariance (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025): a row's result must not
// depend on the rows that share its step. Each kernel below fixes the reduction order of an output (m, n) once:
//   float  8 lanes accumulate x[m, k] w[n, k] over k = lane (mod 8) in order, one fixed horizontal sum, the k % 8
//          tail added last in order;
//   int8   one float lane per output: for each block in order, acc = fma(isum_b, d_b dx_b, acc) with isum_b the
//          block's exact integer dot product (32 products summed in int32);
//   int4   the same, then acc = fma(m_b, sx_b, acc) per block (the min term).
// Tiling (several rows and several outputs per inner loop) shares loads, never arithmetic, so the one-row kernel
// (decode) and the many-row kernel (prefill) are the same function and agree bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace ls {

constexpr int64_t QK = 32;  // weights (and activations) per quantization block
inline int64_t padded_blocks(int64_t nb) { return (nb + 7) / 8 * 8; }  // per-row activation scales: whole groups of 8
inline int64_t act_row_bytes(int64_t nb) { return (nb + 1) / 2 * 64; }  // int8 activations: whole pairs of blocks

enum class QFormat { Int4, Int8, Int6 };

// Weight formats (model/quantize/), blocks of 32 along K, nb = K / 32:
//   Int4  w[n, k] = q d[n, b] + m[n, b], b = k / 32 (GGUF Q4_1; Q4_0 is m = -8 d), 8 outputs interleaved:
//         data (N/8, nb, 4, 8, 4) uint8, byte (g, b, p, j, t) = q[8g + j, 32b + 4p + t] | q[8g + j, 32b + 16 + 4p + t] << 4
//         (one 32-byte vector per p: lane j holds output 8g + j's chunks p and p + 4 of block b);
//         scales (N/8, nb, 2, 8) float16: the 8 outputs' d, then their m; or, symmetric (GGUF Q4_0 as it is),
//         (N/8, nb, 1, 8): d alone, m = -8 d computed in float32 (exact: a float16 d times 8), so the same products
//         and sums as the (N/8, nb, 2, 8) layout holding m = float16(-8 d), 0.5 bits a weight less to read;
//         or K (GGUF Q4_K's own scales: d = D sc, m = -(Dmin mn) per block, D and Dmin float16 per 256 weights, sc
//         and mn 6-bit): scales (N/8, nb/8, 80) float16-sized, 160 bytes per 8 outputs and 256 weights: the 8
//         outputs' D, their Dmin, then sc as bytes (s, j) for sub-block s, then mn alike; d and m computed in float32
//         (exact: an 11-bit float times a 6-bit integer), 4.625 bits a weight
//   Int8  w[n, k] = q d[n, b] (GGUF Q8_0), 8 outputs interleaved: data (N/8, nb, 8, 8, 4) int8, byte (g, b, c, j, t)
//         = q[8g + j, 32b + 4c + t] (one 32-byte vector per chunk c of 4 weights); scales (N/8, nb, 8) float16.
//         N is padded with zero rows to a multiple of 8: the kernels compute whole groups (model/quantize/).
//   Int6  w[n, k] = (d[n, B] sc[n, k / 16]) (q - 32), q in [0, 63], B = k / 256 (GGUF Q6_K as the file holds it:
//         6.5625 bits a weight), 8 outputs interleaved: data (N/8, nb, 208) uint8, per block b: 128 bytes of q's low
//         nibbles laid out as Int4's (byte (p, j, t) = lo(q[32b + 4p + t]) | lo(q[32b + 16 + 4p + t]) << 4), 64
//         bytes of their top 2 bits (byte (h, j, t) holds, from bit 0 up, weights 8h + t, 16 + 8h + t, 8h + 4 + t,
//         16 + 8h + 4 + t of block b, output 8g + j: Int4's chunks 2h and 2h + 1, low then high nibble), then 16
//         int8 sub-scales (byte (half, j) = sc[8g + j, 2b + half]); scales (N/8, nb/8, 8) float16: d per 256 weights.
//         N is padded with zero rows to a multiple of 8.
struct QWeight {
  QFormat fmt;
  const uint8_t* data;
  const uint16_t* scales;
  int64_t N, K;
  bool sym = false;  // Int4 only: scales hold d alone (m = -8 d)
  bool kq = false;   // Int4 only: Q4_K's scales (D, Dmin per 256, sc and mn bytes per 32)
};

// Whether w's kernel takes the activations rounded per 256 (QActs' qk): Q4_K's scales and Int6 (Q6_K), as ggml's
// `ggml_vec_dot_q4_K_q8_K` / `_q6_K_q8_K`.
inline bool k_acts(const QWeight& w) { return w.kq || w.fmt == QFormat::Int6; }

// Int4 layouts as q4_tile takes them: per-block d and m (float16), or d alone (Q4_K's own scales: q4k_tile).
enum Q4Layout : int { Q4_ASYM = 0, Q4_SYM = 1 };

// Activations rounded to int8 in blocks of 32 as ggml's `quantize_row_q8_0` does (dx = max|x| / 127, q = round(x /
// dx), ties to even), one row at a time: q (row_bytes per row, pairs of blocks, zero past nb), dx and sx = dx * sum(q)
// (nbp floats per row, zero past nb); q in k order.
// For Q4_K and Q6_K weights (`k_acts`) the row is also rounded per 256 as ggml's `quantize_row_q8_K` does (one scale
// per 256 values, the scale of the weights' own d per 256): qk (row_bytes per row, in k order), dk = max|x| / 127 over
// the 256 (nbp / 8 floats per row), bk each 32-value block's sum of qk (nbp int16 per row, |sum| <= 32 x 127: Q4_K's
// mins) and hk each 16 values' (2 nbp int16 per row: Q6_K's sub-blocks, ggml's q8_K `bsums`); zero past nb. Null where
// no layer of the step needs them.
struct QActs {
  int8_t* q;
  float* dx;
  float* sx;
  int64_t row_bytes, nbp;
  int8_t* qk = nullptr;
  float* dk = nullptr;
  int16_t* bk = nullptr;
  int16_t* hk = nullptr;
};

// Row m of x (K values) rounded into a's row m (strides of a K-wide input), per 32 and, where a has the buffers and
// `k`, per 256 too.
template <typename T>
void quantize_act(const T* x, int64_t K, QActs a, int64_t m, bool k);

// The buffers of QActs for `rows` rows of inputs up to K wide (the q8_K rounding's only with `k`).
struct ActBuffers {
  std::vector<int8_t> q, qk;
  std::vector<float> dx, sx, dk;
  std::vector<int16_t> bk, hk;
  ActBuffers(int64_t rows, int64_t K, bool k)
      : q(rows * act_row_bytes(K / QK)), qk(k ? q.size() : 0), dx(rows * padded_blocks(K / QK)), sx(dx.size()),
        dk(k ? dx.size() / 8 : 0), bk(k ? dx.size() : 0), hk(k ? 2 * dx.size() : 0) {}
  // Strides of a K-wide input (a projection's own K, at most the buffers').
  QActs view(int64_t K) {
    const bool k = !qk.empty();
    return QActs{q.data(), dx.data(), sx.data(), act_row_bytes(K / QK), padded_blocks(K / QK),
                 k ? qk.data() : nullptr, k ? dk.data() : nullptr, k ? bk.data() : nullptr, k ? hk.data() : nullptr};
  }
};

// A quantized layer's two buffers (model/quantize/'s `native_buffers`: uint8 nibbles -> Int4, int8 -> Int8).
QWeight qweight_of(const View& data, const View& scales);

// Columns n in [n_begin, n_end) of y (M, ldy) float32 for rows m in [0, M): y[m, n] = sum_k xq[m, k] w[n, k].
void qgemm_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy);

// Columns n in [n_begin, n_end) of y (M, ldy) float32: y[m, n] = sum_k x[m, k] w[n, k] for x (M, K) and w (N, K) of
// one dtype T (float or bfloat16), accumulated in float32.
template <typename T>
void float_gemm_range(const T* x, int64_t M, const T* w, int64_t K, int64_t n_begin, int64_t n_end, float* y,
                      int64_t ldy);

// Columns c in [c0, c1) of y (n, ldy) float32: y[i, c] = sum_k t[i, k] bt[k, c], k = 0 .. r - 1 in order by fused
// multiply-adds (lora.cpp: LoRA's expanding product, bt (r, width) the B matrix transposed).
template <typename T>
void lora_expand_range(const T* t, int64_t n, const T* bt, int64_t r, int64_t width, int64_t c0, int64_t c1, float* y,
                       int64_t ldy);

// The thread's share of [0, n) in whole tiles of `tile` (static: the same split in every region of a step).
inline void split_range(int64_t n, int64_t tile, int tid, int nthreads, int64_t& begin, int64_t& end) {
  const int64_t tiles = (n + tile - 1) / tile, per = tiles / nthreads, extra = tiles % nthreads;
  const int64_t t0 = tid * per + (tid < extra ? tid : extra), t1 = t0 + per + (tid < extra ? 1 : 0);
  begin = std::min(n, t0 * tile);
  end = std::min(n, t1 * tile);
}

}  // namespace ls
