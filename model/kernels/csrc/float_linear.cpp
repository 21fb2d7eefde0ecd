// Float linear layers (float32, bfloat16): y = x W^T for any number of rows with one reduction order per output.
//
// PyTorch's CPU GEMM (MKL / oneDNN) picks a different kernel, and so a different summation order, for one row (GEMV)
// than for several, and by the shape: on an AVX2 machine `F.linear(x[:1], w)` differed from
// `F.linear(x, w)[:1]` for every M > 1 tried in float32. A row's logits would then depend on how many rows share
// its step. Here every output is the dot product of its row and its weight row in 8 float32 lanes (lane l sums
// k = l mod 8 in order), one fixed horizontal sum, then the k % 8 tail in order: tiles of several rows and outputs
// share loads, never arithmetic, so decode and prefill agree bit for bit (qgemm.h). bfloat16 inputs are widened on
// load and accumulated in float32, as oneDNN's bfloat16 GEMM accumulates.
#include "ops.h"
#include "qgemm.h"

namespace ls {

#if LS_AVX2
// Prefetch: `ahead` > 0 asks for the rows of w `ahead` rows after this tile's own (the next block's), part `part` of
// `parts` of their columns, one 64-byte line of each of the NR rows every 16 * parts floats of the tile's own loop.
// Each of a block's `parts` row tiles asks for its share, so that the next block's weights stream from memory evenly
// while this block computes instead of after it (a few rows are compute-bound; with the whole next block asked for
// by the first row tile, the line fill buffers filled up and it waited on them, and memory and compute did not
// overlap).
template <typename T, int MR, int NR>
static inline void f_tile(const T* x, int64_t ldx, const T* w, int64_t K, int64_t n0, float* y, int64_t ldy,
                          int64_t ahead = 0, int part = 0, int parts = 1) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K / 8 * 8;
  // the next line to ask for (a column), the last one's end, and the loop's k at which to ask
  int64_t pf = (K * part / parts) & ~int64_t(15), next = 0;
  const int64_t pf_end = part + 1 == parts ? K : (K * (part + 1) / parts) & ~int64_t(15), step = 16 * parts;
  for (int64_t k = 0; k < K8; k += 8) {
    if (ahead && k == next && pf < pf_end) {
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + ahead + j) * K + pf), _MM_HINT_T0);
      pf += 16;
      next += step;
    }
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = load8(x + i * ldx + k);
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = load8(w + (n0 + j) * K + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s += to_f(x[i * ldx + k]) * to_f(w[(n0 + j) * K + k]);
      y[i * ldy + n0 + j] = s;
    }
}

template <typename T, int MR>
static void f_rows(const T* x, int64_t ldx, const T* w, int64_t K, int64_t n_begin, int64_t n_end, float* y, int64_t ldy,
                   int64_t ahead = 0, int part = 0, int parts = 1) {
  constexpr int NR = 4;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) f_tile<T, MR, NR>(x, ldx, w, K, n, y, ldy, ahead, part, parts);
  for (; n < n_end; ++n) f_tile<T, MR, 1>(x, ldx, w, K, n, y, ldy, ahead, part, parts);
}
#endif

template <typename T>
void float_gemm_range(const T* x, int64_t M, const T* w, int64_t K, int64_t n_begin, int64_t n_end, float* y,
                      int64_t ldy) {
#if LS_AVX2
  // Blocks of weight rows (kept in L2) times blocks of activation rows (kept in L1 / L2).
  constexpr int64_t NB = 32, MB = 48;
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t m1 = std::min(M, m0 + MB);
    for (int64_t nb0 = n_begin; nb0 < n_end; nb0 += NB) {
      const int64_t nb1 = std::min(n_end, nb0 + NB);
      // with more than one row tile (4 rows or more), the row tiles of a block prefetch the next block's weights,
      // each its share of their columns
      const int64_t ahead = (m1 - m0 > 3 && nb1 + NB <= n_end) ? NB : 0;
      const int parts = static_cast<int>((m1 - m0 + 2) / 3);  // row tiles: 3 rows each, the last 1 or 2
      int64_t m = m0;
      int part = 0;
      for (; m + 3 <= m1; m += 3) f_rows<T, 3>(x + m * K, K, w, K, nb0, nb1, y + m * ldy, ldy, ahead, part++, parts);
      if (m + 2 == m1)  // two rows left (a step of 2 or 5 rows: a speculative row's drafts) share their loads too
        f_rows<T, 2>(x + m * K, K, w, K, nb0, nb1, y + m * ldy, ldy, ahead, part, parts);
      else if (m < m1)
        f_rows<T, 1>(x + m * K, K, w, K, nb0, nb1, y + m * ldy, ldy, ahead, part, parts);
    }
  }
#else
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n_begin; n < n_end; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += to_f(x[m * K + k]) * to_f(w[n * K + k]);
      y[m * ldy + n] = s;
    }
#endif
}
template void float_gemm_range<float>(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);
template void float_gemm_range<bf16>(const bf16*, int64_t, const bf16*, int64_t, int64_t, int64_t, float*, int64_t);

// x (M, K), w (N, K) of one dtype -> y (M, N) in that dtype (float32 sums rounded once)
torch::Tensor float_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && w.is_contiguous(), "float_linear: x (M, K), w (N, K) contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "float_linear: one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto yf = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = yf.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) { float_gemm_range(x.data_ptr<float>(), M, w.data_ptr<float>(), K, b, e, yp, N); });
    return yf;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "float_linear: float32 or bfloat16");
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) { float_gemm_range(x.data_ptr<bf16>(), M, w.data_ptr<bf16>(), K, b, e, yp, N); });
  return yf.to(at::kBFloat16);
}

}  // namespace ls
