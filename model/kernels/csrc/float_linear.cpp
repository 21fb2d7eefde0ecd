// Float linear layers (float32, bfloat16): y = x W^T for any number of rows with one reduction order per output.
//
// PyTorch's CPU GEMM (MKL / oneDNN) picks a different kernel, and so a different summation order, for one row (GEMV)
// than for several, and by the shape: on an AVX2 machine `F.linear(x[:1], w)` differed from
// `F.linear(x, w)[:1]` for every M > 1 tried in float32. A row's logits would then depend on how many rows share
// its step. Here every output is the dot product of its row and its weight row in 8 float32 lanes (lane l sums
// k = l mod 8 in order), one fixed horizontal sum, then the k % 8 tail in order: tiles of several rows and outputs
// share loads, never arithmetic, so decode and prefill agree bit for bit (qgemm.h). bfloat16 inputs are widened on
// load and accumulated in float32, as oneDNN's bfloat16 GEMM accumulates.
//
// Two tilings of that one order. For a few rows, each output's 8 lanes sit in one register and end in a horizontal
// sum (`f_tile`). For many rows the horizontal sums would cost as much as the multiply-adds when K is small (an LM
// head over a narrow model), so `p_tile` turns the tile around: a group of 8 (16 with 512-bit registers) outputs'
// weights is transposed once into a scratch buffer (k-major), and a register then holds one lane of the 8-lane order
// for 8 or 16 outputs. Each lane's chain is the same multiply-adds in the same order, and the horizontal sum's tree
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) becomes vertical adds: the same bits, with no per-output
// shuffles, and the transposition paid once for all the rows.
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "ops.h"
#include "simd.h"
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

// One register of float32 lanes: 8 (AVX2) or 16 (AVX-512) outputs side by side.
struct Lanes8 {
  using R = __m256;
  static constexpr int W = 8, MR = 3;  // 4 * MR accumulators and partial sums live at once, of 16 registers
  static R zero() { return _mm256_setzero_ps(); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R set1(float v) { return _mm256_set1_ps(v); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
};
#if LS_ZMM
struct Lanes16 {
  using R = __m512;
  static constexpr int W = 16, MR = 5;  // of 32 registers (6 rows spill)
  static R zero() { return _mm512_setzero_ps(); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R set1(float v) { return _mm512_set1_ps(v); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
};
using PackLanes = Lanes16;
#else
using PackLanes = Lanes8;
#endif

// wt (K8, W) <- w's rows n0 .. n0 + W (each K long), columns [0, K8), widened to float32: 8 x 8 blocks transposed in
// registers (unpack, shuffle, permute: the usual 24-shuffle transpose).
template <typename T, int W>
static void pack_group(const T* w, int64_t K, int64_t K8, int64_t n0, float* wt) {
  for (int h = 0; h < W; h += 8)
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = load8(w + (n0 + h + j) * K + k);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      const __m256 c[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                           _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                           _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                           _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      for (int j = 0; j < 8; ++j) store8(wt + (k + j) * W + h, c[j]);  // column k + j of the 8 rows
    }
}

// Lanes l and l + 4 of the 8-lane order for MR rows and one packed group: sum_k x[i, k] w[n, k] over k = l (mod 8)
// and over k = l + 4 (mod 8), each in order from zero, then added (the first add of the horizontal sum's tree).
template <class L, typename T, int MR>
static inline void lane_pair(const T* x, int64_t ldx, const float* wt, int64_t K8, int l, typename L::R* out) {
  typename L::R a[MR], b[MR];
  for (int i = 0; i < MR; ++i) a[i] = b[i] = L::zero();
  for (int64_t k = l; k < K8; k += 8) {
    const typename L::R w0 = L::load(wt + k * L::W), w1 = L::load(wt + (k + 4) * L::W);
    for (int i = 0; i < MR; ++i) {
      a[i] = L::fma(L::set1(to_f(x[i * ldx + k])), w0, a[i]);
      b[i] = L::fma(L::set1(to_f(x[i * ldx + k + 4])), w1, b[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i] = L::add(a[i], b[i]);
}

// y[i, n0 .. n0 + W) for MR rows from a packed group wt (K8, W); w (the unpacked rows) for the k % 8 tail.
template <class L, typename T, int MR>
static void p_tile(const T* x, int64_t ldx, const float* wt, const T* w, int64_t K, int64_t K8, int64_t n0, float* y,
                   int64_t ldy) {
  typename L::R u0[MR], t[MR], v[MR];
  lane_pair<L, T, MR>(x, ldx, wt, K8, 0, u0);
  lane_pair<L, T, MR>(x, ldx, wt, K8, 2, t);
  for (int i = 0; i < MR; ++i) u0[i] = L::add(u0[i], t[i]);
  lane_pair<L, T, MR>(x, ldx, wt, K8, 1, t);
  lane_pair<L, T, MR>(x, ldx, wt, K8, 3, v);
  for (int i = 0; i < MR; ++i) L::store(y + i * ldy + n0, L::add(u0[i], L::add(t[i], v[i])));
  if (K8 == K) return;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < L::W; ++j) {
      float s = y[i * ldy + n0 + j];
      for (int64_t k = K8; k < K; ++k) s += to_f(x[i * ldx + k]) * to_f(w[(n0 + j) * K + k]);
      y[i * ldy + n0 + j] = s;
    }
}

// The last M % MR rows of a group: one tile of that many rows.
template <class L, typename T, int R>
static void p_rest(const T* x, int64_t ldx, const float* wt, const T* w, int64_t K, int64_t K8, int64_t n0, int64_t r,
                   float* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (r == R) return p_tile<L, T, R>(x, ldx, wt, w, K, K8, n0, y, ldy);
    p_rest<L, T, R - 1>(x, ldx, wt, w, K, K8, n0, r, y, ldy);
  }
}

// Rows [0, M) of a packed group. `next` (or null): the next group's `bytes` of weights, asked for a share at each
// tile so that they stream from memory while this group computes.
template <class L, typename T>
static void p_rows(const T* x, int64_t ldx, const float* wt, const T* w, int64_t K, int64_t K8, int64_t n0, int64_t M,
                   float* y, int64_t ldy, const char* next, int64_t bytes) {
  constexpr int MR = L::MR;
  const int64_t tiles = (M + MR - 1) / MR, lines = (bytes + 63) / 64;
  for (int64_t t = 0, m = 0; m < M; ++t, m += MR) {
    if (next)
      for (int64_t l = t * lines / tiles; l < (t + 1) * lines / tiles; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    if (m + MR <= M)
      p_tile<L, T, MR>(x + m * ldx, ldx, wt, w, K, K8, n0, y + m * ldy, ldy);
    else
      p_rest<L, T, MR - 1>(x + m * ldx, ldx, wt, w, K, K8, n0, M - m, y + m * ldy, ldy);
  }
}
#endif

// The packed tiles from this many rows on (below, the transposition is not repaid), for rows up to this long (a
// longer row's horizontal sum is a small share of its multiply-adds, and its packed group no longer fits in L1).
constexpr int64_t PACKED_MIN_ROWS = 16, PACKED_MAX_K = 256;

// The blocking of x W^T over rows [0, M) and outputs [n_begin, n_end): each block's outputs are written where
// `sink.at(m0, rows, n0, width)` says ({pointer to row m0's output n0, row stride}), then `sink.done` is told of
// them. float_gemm_range's sink is y itself; the greedy pick's (below) a scratch tile it folds.
template <typename T, typename Sink>
static void gemm_blocks(const T* x, int64_t M, const T* w, int64_t K, int64_t n_begin, int64_t n_end, Sink& sink) {
#if LS_AVX2
  // Blocks of weight rows (kept in L2) times blocks of activation rows (kept in L1 / L2).
  constexpr int64_t NB = 32, MB = 48;
  constexpr int G = PackLanes::W;
  const int64_t K8 = K / 8 * 8;
  if (M >= PACKED_MIN_ROWS && K8 > 0 && K <= PACKED_MAX_K && n_end - n_begin >= G) {
    // packed groups of G outputs, each transposed once per block of rows; the last n % G outputs as below
    thread_local std::vector<float> wt;
    wt.resize(static_cast<size_t>(K8) * G);
    const int64_t n_packed = n_begin + (n_end - n_begin) / G * G;
    // a group is packed (and its weights read) once per block of rows: as many rows as fit 256 KB of activations
    const int64_t MBP = std::max<int64_t>(MB, 65536 / K);
    for (int64_t m0 = 0; m0 < M; m0 += MBP) {
      const int64_t m1 = std::min(M, m0 + MBP);
      for (int64_t n = n_begin; n < n_packed; n += G) {
        pack_group<T, G>(w, K, K8, n, wt.data());
        const char* next = n + G < n_packed ? reinterpret_cast<const char*>(w + (n + G) * K) : nullptr;
        const auto [y, ldy] = sink.at(m0, m1 - m0, n, G);
        // w from the group's first row: its outputs counted from the group's (y points at output n)
        p_rows<PackLanes, T>(x + m0 * K, K, wt.data(), w + n * K, K, K8, 0, m1 - m0, y, ldy, next,
                             G * K * static_cast<int64_t>(sizeof(T)));
        sink.done(m0, m1 - m0, n, G);
      }
    }
    if (n_packed == n_end) return;
    n_begin = n_packed;
  }
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t m1 = std::min(M, m0 + MB);
    for (int64_t nb0 = n_begin; nb0 < n_end; nb0 += NB) {
      const int64_t nb1 = std::min(n_end, nb0 + NB), W = nb1 - nb0;
      // with more than one row tile (4 rows or more), the row tiles of a block prefetch the next block's weights,
      // each its share of their columns
      const int64_t ahead = (m1 - m0 > 3 && nb1 + NB <= n_end) ? NB : 0;
      const int parts = static_cast<int>((m1 - m0 + 2) / 3);  // row tiles: 3 rows each, the last 1 or 2
      const T* wb = w + nb0 * K;  // the block's rows: its outputs counted from nb0
      const auto [y, ldy] = sink.at(m0, m1 - m0, nb0, W);
      int64_t m = m0;
      int part = 0;
      for (; m + 3 <= m1; m += 3) f_rows<T, 3>(x + m * K, K, wb, K, 0, W, y + (m - m0) * ldy, ldy, ahead, part++, parts);
      if (m + 2 == m1)  // two rows left (a step of 2 or 5 rows: a speculative row's drafts) share their loads too
        f_rows<T, 2>(x + m * K, K, wb, K, 0, W, y + (m - m0) * ldy, ldy, ahead, part, parts);
      else if (m < m1)
        f_rows<T, 1>(x + m * K, K, wb, K, 0, W, y + (m - m0) * ldy, ldy, ahead, part, parts);
      sink.done(m0, m1 - m0, nb0, W);
    }
  }
#else
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n0 = n_begin; n0 < n_end; n0 += 64) {
      const int64_t n1 = std::min(n_end, n0 + 64);
      const auto [y, ldy] = sink.at(m, 1, n0, n1 - n0);
      for (int64_t n = n0; n < n1; ++n) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += to_f(x[m * K + k]) * to_f(w[n * K + k]);
        y[n - n0] = s;
      }
      sink.done(m, 1, n0, n1 - n0);
    }
#endif
}

// y itself: block (m0, n0) at y + m0 ldy + n0
struct Into {
  float* y;
  int64_t ldy;
  std::pair<float*, int64_t> at(int64_t m0, int64_t, int64_t n0, int64_t) const { return {y + m0 * ldy + n0, ldy}; }
  void done(int64_t, int64_t, int64_t, int64_t) const {}
};

template <typename T>
void float_gemm_range(const T* x, int64_t M, const T* w, int64_t K, int64_t n_begin, int64_t n_end, float* y,
                      int64_t ldy) {
  Into into{y, ldy};
  gemm_blocks(x, M, w, K, n_begin, n_end, into);
}
template void float_gemm_range<float>(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);
template void float_gemm_range<bf16>(const bf16*, int64_t, const bf16*, int64_t, int64_t, int64_t, float*, int64_t);

// Greedy decoding's pick fused into a float32 LM head: each row's `argmax_rows` of x W^T without forming the logits.
// Written out, a step's logits are rows x vocabulary floats (tens of MB for a few hundred rows), stored a tile at a
// time at the vocabulary's stride, each line read for ownership first and then read again by the pick: for a narrow
// model that traffic, not the multiply-adds, sets the head's pace. Here each tile's outputs go to a scratch tile that
// stays in L1 and are folded into a running pick per row: the same tiles as float_gemm_range, so the same values,
// and per row the greatest value's first column, as argmax_rows picks it.
namespace {

// The running pick of M rows, 8 lanes a row (lane l: the columns = l mod 8, each lane fed in increasing column
// order, so a strict > keeps a value's first column): the lane's greatest value, its column, and whether it saw a NaN
// or an infinity (v - v is NaN then; or-ing the bits keeps a NaN a NaN).
struct Picks {
  std::vector<float> best, bad;
  std::vector<int32_t> col;

  void reset(int64_t M) {
    best.assign(M * 8, -INFINITY);
    bad.assign(M * 8, 0.f);
    col.assign(M * 8, -1);
  }

  // y (rows, W) at stride ldy: columns n0 .. n0 + W (n0 a multiple of 8) of rows m0 .. m0 + rows
  void fold(const float* y, int64_t ldy, int64_t m0, int64_t rows, int64_t W, int64_t n0) {
    for (int64_t i = 0; i < rows; ++i) {
      const float* r = y + i * ldy;
      float *b = best.data() + (m0 + i) * 8, *f = bad.data() + (m0 + i) * 8;
      int32_t* c = col.data() + (m0 + i) * 8;
      int64_t j = 0;
#if LS_AVX2
      __m256 vb = _mm256_loadu_ps(b), vf = _mm256_loadu_ps(f);
      __m256 vc = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      for (; j + 8 <= W; j += 8) {
        const __m256 v = _mm256_loadu_ps(r + j);
        vf = _mm256_or_ps(vf, _mm256_sub_ps(v, v));
        const __m256 gt = _mm256_cmp_ps(v, vb, _CMP_GT_OQ);
        vb = _mm256_blendv_ps(vb, v, gt);
        const __m256i at = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(n0 + j)));
        vc = _mm256_blendv_ps(vc, _mm256_castsi256_ps(at), gt);
      }
      _mm256_storeu_ps(b, vb);
      _mm256_storeu_ps(f, vf);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), _mm256_castps_si256(vc));
#endif
      for (; j < W; ++j) {
        const float v = r[j];
        const int64_t l = j % 8;
        if (!std::isfinite(v)) f[l] = NAN;
        else if (v > b[l]) {
          b[l] = v;
          c[l] = static_cast<int32_t>(n0 + j);
        }
      }
    }
  }

  // row i's pick over its lanes: the greatest value's first column; false where a lane saw a non-finite value
  bool pick(int64_t i, float& value, int64_t& column) const {
    value = -INFINITY;
    column = -1;
    for (int l = 0; l < 8; ++l) {
      const int64_t k = i * 8 + l;
      if (std::isnan(bad[k])) return false;
      if (col[k] >= 0 && (best[k] > value || (best[k] == value && col[k] < column))) {
        value = best[k];
        column = col[k];
      }
    }
    return true;
  }
};

// Rows [0, M) of x against w's rows [n_begin, n_end) (n_begin a multiple of 8), folded into `picks` (reset first):
// float_gemm_range's blocks, each into a scratch tile (as many rows as a block has, at most 1,024 x 16 floats)
// folded as soon as it is written.
struct Folding {
  Picks& picks;
  std::vector<float>& scratch;
  std::pair<float*, int64_t> at(int64_t, int64_t rows, int64_t, int64_t width) {
    scratch.resize(std::max<size_t>(scratch.size(), static_cast<size_t>(rows * width)));
    return {scratch.data(), width};
  }
  void done(int64_t m0, int64_t rows, int64_t n0, int64_t width) { picks.fold(scratch.data(), width, m0, rows, width, n0); }
};

void pick_range(const float* x, int64_t M, const float* w, int64_t K, int64_t n_begin, int64_t n_end, Picks& picks) {
  picks.reset(M);
  thread_local std::vector<float> scratch;
  Folding sink{picks, scratch};
  gemm_blocks(x, M, w, K, n_begin, n_end, sink);
}

}  // namespace

// x (M, K), w (N, K) float32 -> (M,) int64: argmax_rows(float_linear(x, w)). The columns go in blocks to the threads
// as they come for them (a thread the OS has put off does not hold the others up with a fixed half of the work); each
// block's picks are kept and merged in column order, so the answer does not depend on which thread took which block.
View float_linear_argmax(const View& x, const View& w, const Alloc& alloc) {
  LS_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && w.is_contiguous() &&
                  x.scalar_type() == kFloat && w.scalar_type() == kFloat && w.size(0) > 0,
              "float_linear_argmax: x (M, K), w (N, K) float32, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  constexpr int64_t BLOCK = 1024;  // columns a claim: a multiple of every tile's width
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  std::vector<float> best(blocks * M);
  std::vector<int64_t> col(blocks * M);
  std::atomic<int64_t> claimed{0};
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  parallel_for(0, num_threads(), 1, [&](int64_t, int64_t) {
    thread_local Picks picks;
    for (int64_t b; (b = claimed.fetch_add(1)) < blocks;) {
      pick_range(xp, M, wp, K, b * BLOCK, std::min(N, (b + 1) * BLOCK), picks);
      for (int64_t i = 0; i < M; ++i)
        if (!picks.pick(i, best[b * M + i], col[b * M + i])) col[b * M + i] = -1 - N;  // not finite
    }
  });
  const View out = alloc(kLong, {M});
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<float> row;
  for (int64_t i = 0; i < M; ++i) {
    float value = -INFINITY;
    int64_t column = -1;
    for (int64_t b = 0; b < blocks && column >= -1; ++b) {
      const float v = best[b * M + i];
      const int64_t c = col[b * M + i];
      if (c < -1) column = c;
      else if (c >= 0 && (column < 0 || v > value)) {
        value = v;
        column = c;
      }
    }
    if (column < 0) {  // a NaN or an infinity in the row: its logits formed and picked as argmax_rows picks
      row.resize(N);
      float_gemm_range(xp + i * K, 1, wp, K, 0, N, row.data(), N);
      column = greedy_pick_row(row.data(), N);
    }
    o[i] = column;
  }
  return out;
}

// x (M, K), w (N, K) of one dtype -> y (M, N) float32 (bindings.cpp rounds it once to that dtype)
View float_linear(const View& x, const View& w, const Alloc& alloc) {
  LS_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && w.is_contiguous(), "float_linear: x (M, K), w (N, K) contiguous");
  LS_CHECK(x.scalar_type() == w.scalar_type(), "float_linear: one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const View yf = alloc(kFloat, {M, N});
  float* yp = yf.data_ptr<float>();
  if (x.scalar_type() == kFloat) {
    parallel_for(0, N, 16, [&](int64_t b, int64_t e) { float_gemm_range(x.data_ptr<float>(), M, w.data_ptr<float>(), K, b, e, yp, N); });
    return yf;
  }
  LS_CHECK(x.scalar_type() == kBFloat16, "float_linear: float32 or bfloat16");
  parallel_for(0, N, 16, [&](int64_t b, int64_t e) { float_gemm_range(x.data_ptr<bf16>(), M, w.data_ptr<bf16>(), K, b, e, yp, N); });
  return yf;
}

}  // namespace ls
