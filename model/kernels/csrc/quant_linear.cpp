// Weight-only quantized linear layers, y = x W^T with W read in its packed form, for any number of rows: decode's
// one row and prefill's hundreds run the same kernel, so a row's result never depends on its step (qgemm.h).
//
// As llama.cpp's CPU path does (ggml `quantize_row_q8_0` + `ggml_vec_dot_q4_1_q8_1` / `_q8_0_q8_0`), each row of
// x is first rounded to int8 in blocks of 32 with one float scale per block (dx = max|x| / 127), so a block's dot
// product is 32 int8 x int8 (or uint4 x int8) products summed exactly in integers by AVX2's maddubs, then scaled
// once. Many rows reuse each unpacked weight block from registers (the tiles of llamafile's tinyBLAS, Tunney 2024):
// prefill is a GEMM over the packed weights, never a float copy of them.
//
// Int4 and int8 weights are stored 8 output rows interleaved (qgemm.h; ggml-cpu's `repack.cpp` does the same for
// its Q4_0 8x8 GEMM): each 32-bit lane of one vector holds 4 weights of a different output, so one maddubs against
// 4 broadcast activation bytes advances 8 outputs at once and a block's integer sum lands whole in its output's
// lane; the float work is one convert and one FMA (two with int4's offset) per block for 8 outputs, not per output.
#include <type_traits>
#include <vector>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "ops.h"
#include "simd.h"
#include "qgemm.h"

namespace ls {

static inline float fp16_to_f(uint16_t h) { return half_to_float(h); }

// Int4: block b's d and m for output 8g + j (qgemm.h's three layouts), for the scalar paths: the vector paths' values.
static inline void q4_dm_scalar(const QWeight& w, int64_t nb, int64_t g, int64_t b, int64_t j, float& d, float& m) {
  if (w.kq) {
    const uint16_t* sb = w.scales + (g * (nb / 8) + b / 8) * 80;
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(sb + 16) + 8 * (b % 8) + j;
    d = fp16_to_f(sb[j]) * static_cast<float>(bytes[0]);
    m = -fp16_to_f(sb[8 + j]) * static_cast<float>(bytes[64]);  // = -(Dmin mn) exactly
    return;
  }
  const uint16_t* sb = w.scales + (g * nb + b) * (w.sym ? 8 : 16);
  d = fp16_to_f(sb[j]);
  m = w.sym ? -8.f * d : fp16_to_f(sb[8 + j]);
}

// Int6: q in [0, 63] of weight k of block wb for output lane j (qgemm.h's layout), for the scalar paths.
static inline int q6_value(const uint8_t* wb, int64_t j, int64_t k) {
  const int64_t half = k / 16, p = (k % 16) / 4, t = k % 4;
  const int lo = (wb[32 * p + 4 * j + t] >> (4 * half)) & 15;
  const int top = (wb[128 + 32 * (p / 2) + 4 * j + t] >> (2 * half + 4 * (p % 2))) & 3;
  return lo | top << 4;
}

// max |x| over block xb's 32 values
template <typename T>
static inline float block_amax(const T* xb) {
#if LS_AVX2
  __m256 mx = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(xb + 8 * i)));
  return hmax(mx);
#else
  float amax = 0.f;
  for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(to_f(xb[j])));
  return amax;
#endif
}

// Block xb's 32 values rounded to int8 in k order, q = round(x id) (ties to even), into q; the two 16-value halves'
// sums of q into h[0], h[1].
template <typename T>
static inline void round_block(const T* xb, float id, int8_t* q, int32_t* h) {
#if LS_AVX2
  const __m256 idv = _mm256_set1_ps(id);
  __m256i iv[4];
  for (int i = 0; i < 4; ++i)
    iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(load8(xb + 8 * i), idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // the halves' sums: lanes 0-3 of s the first 16 values', lanes 4-7 the last 16's (after the two adds below)
  const __m256i s2 = _mm256_add_epi32(_mm256_permute2x128_si256(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]), 0x20),
                                      _mm256_permute2x128_si256(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]), 0x31));
  __m256i s = _mm256_add_epi32(s2, _mm256_shuffle_epi32(s2, 0x4E));
  s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xB1));
  h[0] = _mm256_extract_epi32(s, 0);
  h[1] = _mm256_extract_epi32(s, 4);
  // int32 -> int8 in k order (ggml's quantize_row_q8_0 packing: packs interleave the 128-bit lanes; undo it)
  const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
  __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
#else
  h[0] = h[1] = 0;
  for (int64_t j = 0; j < QK; ++j) {
    const int v = static_cast<int>(std::nearbyint(to_f(xb[j]) * id));
    q[j] = static_cast<int8_t>(v);
    h[j / 16] += v;
  }
#endif
}

template <typename T>
void quantize_act(const T* x, int64_t K, QActs a, int64_t m, bool k) {
  const int64_t nb = K / QK, nbp = padded_blocks(nb), bytes = act_row_bytes(nb);
  int8_t* q = a.q + m * bytes;
  float *dx = a.dx + m * nbp, *sx = a.sx + m * nbp;
  std::fill(q + nb * QK, q + bytes, int8_t(0));
  for (int64_t b = nb; b < nbp; ++b) dx[b] = sx[b] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {  // per 32 (q8_0)
    const float d = block_amax(x + b * QK) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int32_t h[2];
    round_block(x + b * QK, id, q + b * QK, h);
    dx[b] = d;
    sx[b] = d * static_cast<float>(h[0] + h[1]);
  }
  if (!k || a.qk == nullptr) return;
  int8_t* qk = a.qk + m * bytes;  // per 256 (q8_K), the last super-block's blocks as far as nb
  float* dk = a.dk + m * (nbp / 8);
  int16_t *bk = a.bk + m * nbp, *hk = a.hk + 2 * m * nbp;
  std::fill(qk + nb * QK, qk + bytes, int8_t(0));
  std::fill(bk + nb, bk + nbp, int16_t(0));
  std::fill(hk + 2 * nb, hk + 2 * nbp, int16_t(0));
  for (int64_t B = 0; B < nbp / 8; ++B) {
    const int64_t b0 = 8 * B, b1 = std::min(nb, b0 + 8);
    float amax = 0.f;
    for (int64_t b = b0; b < b1; ++b) amax = std::max(amax, block_amax(x + b * QK));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    for (int64_t b = b0; b < b1; ++b) {
      int32_t h[2];
      round_block(x + b * QK, id, qk + b * QK, h);
      bk[b] = static_cast<int16_t>(h[0] + h[1]);
      hk[2 * b] = static_cast<int16_t>(h[0]), hk[2 * b + 1] = static_cast<int16_t>(h[1]);
    }
    dk[B] = b0 < nb ? d : 0.f;
  }
}
template void quantize_act<float>(const float*, int64_t, QActs, int64_t, bool);
template void quantize_act<bf16>(const bf16*, int64_t, QActs, int64_t, bool);

#if LS_AVX2
// One-row tiles (decode) stream every weight from memory once: ask for the lines PREFETCH_BLOCKS blocks ahead of the
// one being read, weights and scales (two streams a thread; 2 KB of int4 weights, 4 KB of int8, ahead). Where the
// hardware prefetchers alone keep one-row matmuls well under a plain read, 16 blocks ahead decoded fastest of 0, 8,
// 16 and 32 (`benchmarks.bench_decode` alternating them; docs/performance.md#native-cpu-kernels). A prefetch never
// faults: reading past a buffer's end is harmless.
constexpr int64_t PREFETCH_BLOCKS = 16;
static inline void prefetch_ahead(const uint8_t* wb, int64_t w_bytes, const uint16_t* sb, int64_t s_bytes) {
  const char* w = reinterpret_cast<const char*>(wb) + PREFETCH_BLOCKS * w_bytes;
  for (int64_t off = 0; off < w_bytes; off += 64) _mm_prefetch(w + off, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sb) + PREFETCH_BLOCKS * s_bytes, _MM_HINT_T0);
}

// ---- Int8 (Q8_0), 8 outputs interleaved ----------------------------------------------------------------------------

// One tile: rows m0 .. m0+MR times the 8 outputs of group g. Per output (one float lane), block after block in order:
// acc = fma(float(isum_b), d_b * dx_b, acc), isum_b the block's exact integer dot product (|w| as unsigned times x
// carrying w's sign: each maddubs lane adds 2 products of at most 127 x 127, widened to int32 at once). MR changes
// which loads are shared, nothing else.
template <int MR>
static inline void q8_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t g, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t rb = a.row_bytes, nbp = a.nbp;
  // Row m0 + i's block b at xq + i rb, its scale at dxp[i nbp]: pointers stepped a block at a time. Indexing a.q and
  // a.dx afresh per block and row recomputed index products every block and spilled more of them to the stack
  // (`python -m benchmarks.kernel_ab` compares two builds layer by layer; docs/performance.md#native-cpu-kernels);
  // the same outputs bit for bit.
  const int8_t* xq = a.q + m0 * rb;
  const float* dxp = a.dx + m0 * nbp;
  const uint8_t* wb = w.data + g * nb * 256;
  for (int64_t b = 0; b < nb; ++b, wb += 256, xq += QK, ++dxp) {
    if constexpr (MR <= 4) prefetch_ahead(wb, 256, w.scales + (g * nb + b) * 8, 16);
    __m256i s32[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) s32[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {  // chunk c: lane j holds weights 4c .. 4c+3 of output 8g + j
      const __m256i wc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      const __m256i aw = _mm256_sign_epi8(wc, wc);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = xq + i * rb + 4 * c;
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x)), wc);
#if LS_VNNI
        s32[i] = LS_DPBUSD(s32[i], aw, xs);  // the same exact int32 sums, one instruction
#else
        s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
#endif
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + (g * nb + b) * 8)));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]), _mm256_mul_ps(d, _mm256_broadcast_ss(dxp + i * nbp)), acc[i]);
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + (m0 + i) * ldy + 8 * g, acc[i]);
}

// Rows a wide tile takes: 8 where the build has 32 vector registers (AVX-512VL: 8 float and 8 integer accumulators
// stay in registers), else 4. A wider tile unpacks each weight vector, and loads each block's scales, once for more
// rows.
#if defined(__AVX512VL__)
constexpr int MR_WIDE = 8;
#else
constexpr int MR_WIDE = 4;
#endif

// Groups [g_begin, g_end) of 8 outputs for rows [0, M), as tiles of MR_WIDE rows, then of 4, then one tile of the
// 3, 2 or 1 rows left (`tile(std::integral_constant<int, MR>, m, g)`): rows in chunks whose int8 activations stay in
// L2 (128 rows x K bytes), each group's weights (K / 32 blocks of 160 or 288 bytes) kept in L1 across a chunk's
// tiles. The tiles of 2 and 3 rows serve the steps of a few rows (2-3 streams, or a speculative row of 1 + a few
// drafts): with only tiles of 4 and 1, each of those rows unpacked every weight again.
constexpr int64_t MB = 128;  // rows a chunk: their int8 activations stay in L2

// Rows [m0, m1) of group g (or of the pair g, g + 1 for a pair tile) as tiles of MR_WIDE, 4, then 3, 2 or 1 rows.
template <typename Tile>
static inline void row_tiles(int64_t m0, int64_t m1, int64_t g, const Tile& tile) {
  int64_t m = m0;
  for (; m + MR_WIDE <= m1; m += MR_WIDE) tile(std::integral_constant<int, MR_WIDE>{}, m, g);
  for (; m + 4 <= m1; m += 4) tile(std::integral_constant<int, 4>{}, m, g);
  switch (m1 - m) {
    case 3: tile(std::integral_constant<int, 3>{}, m, g); break;
    case 2: tile(std::integral_constant<int, 2>{}, m, g); break;
    case 1: tile(std::integral_constant<int, 1>{}, m, g); break;
    default: break;
  }
}

template <typename Tile>
static inline void many_rows(int64_t M, int64_t g_begin, int64_t g_end, const Tile& tile) {
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t m1 = std::min(M, m0 + MB);
    for (int64_t g = g_begin; g < g_end; ++g) row_tiles(m0, m1, g, tile);
  }
}

// The same with groups in pairs (`pair` takes groups g and g + 1 at once), an odd last group alone (`tile`).
template <typename Pair, typename Tile>
static inline void many_rows_paired(int64_t M, int64_t g_begin, int64_t g_end, const Pair& pair, const Tile& tile) {
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t m1 = std::min(M, m0 + MB);
    int64_t g = g_begin;
    for (; g + 1 < g_end; g += 2) row_tiles(m0, m1, g, pair);
    if (g < g_end) row_tiles(m0, m1, g, tile);
  }
}

#if LS_ZMM
// Two 32-byte halves (or two 16-byte halves) from two places as one vector: group g's in the low lanes, g + 1's high.
static inline __m512i join256(const uint8_t* lo, const uint8_t* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}
static inline __m512 halves16(const uint16_t* lo, const uint16_t* hi) {  // 8 + 8 float16 -> 16 float32 (exact)
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1));
}

// Pair tiles: groups g and g + 1 at once in 512-bit vectors (lanes 0-7: outputs 8g + j; lanes 8-15: 8(g + 1) + j),
// for many-row steps, where each activation broadcast, scale product and float op then serves 16 outputs instead of
// 8. Every lane runs the one-group tile's float operations in its order (the integer block sums are exact), so each
// output is the same bits whichever tile computed it: batch invariance and decode = prefill hold across the two.
// Int8: 512-bit vectors have no vpsignb, so x takes w's sign by a masked negation (|x| <= 127: exact).
template <int MR>
static inline void q8_pair_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t g, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  const uint8_t* w0 = w.data + g * nb * 256;
  const uint8_t* w1 = w0 + nb * 256;  // group g + 1
  const uint16_t* s0 = w.scales + g * nb * 8;
  const uint16_t* s1 = s0 + nb * 8;
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s32[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) s32[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i wc = join256(w0 + b * 256 + 32 * c, w1 + b * 256 + 32 * c);
      const __m512i aw = _mm512_abs_epi8(wc);
      const __mmask64 neg = _mm512_movepi8_mask(wc);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = a.q + (m0 + i) * a.row_bytes + b * QK + 4 * c;
        const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x));
        s32[i] = _mm512_dpbusd_epi32(s32[i], aw, _mm512_mask_sub_epi8(xb, neg, zero, xb));
      }
    }
    const __m512 d = halves16(s0 + b * 8, s1 + b * 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i]), _mm512_mul_ps(d, _mm512_set1_ps(a.dx[(m0 + i) * a.nbp + b])), acc[i]);
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + (m0 + i) * ldy + 8 * g, acc[i]);
}
#endif

// Rows from which the many-row tiles take groups in pairs where the build has 512-bit vectors. Below it a step's
// weights stream from memory and two streams a tile read slower than one (as for the one-row tiles above):
// `python -m benchmarks.ab ... gemm --rows 1 --stream-rows R` (weights from memory) put the crossover at 16 rows;
// from cache pairs gain from 2 rows on (docs/performance.md#native-cpu-kernels).
constexpr int64_t PAIR_ROWS = 16;

// Output columns [n_begin, n_end), whole groups of 8 (the buffers are padded to them; model/quantize/).
static void q8_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  const auto one = [&](auto mr, int64_t m, int64_t g) { q8_tile<decltype(mr)::value>(w, a, m, g, y, ldy); };
#if LS_ZMM
  if (M >= PAIR_ROWS) {
    const auto two = [&](auto mr, int64_t m, int64_t g) { q8_pair_tile<decltype(mr)::value>(w, a, m, g, y, ldy); };
    many_rows_paired(M, n_begin / 8, n_end / 8, two, one);
    return;
  }
#endif
  many_rows(M, n_begin / 8, n_end / 8, one);
}

// ---- Int4 (Q4_0 / Q4_1 / Q4_K), 8 outputs interleaved ----------------------------------------------------------

// Block b's d and m for the 8 outputs of group g (Q4_0 / Q4_1; Q4_K's tiles are q4k_tile's), and the scales' address
// to prefetch ahead with their bytes a block.
template <int L>
struct Q4Scales {
  inline void at(const QWeight& w, int64_t nb, int64_t g, int64_t b, __m256& d, __m256& m) {
    const uint16_t* sb = w.scales + (g * nb + b) * (L == Q4_SYM ? 8 : 16);
    d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
    m = L == Q4_SYM ? _mm256_mul_ps(d, _mm256_set1_ps(-8.f)) : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 8)));
  }
};
template <int L>
static inline const uint16_t* q4_scales_at(const QWeight& w, int64_t nb, int64_t g, int64_t b) {
  return w.scales + (g * nb + b) * (L == Q4_SYM ? 8 : 16);
}
constexpr int64_t q4_scale_bytes(int L) { return L == Q4_SYM ? 16 : 32; }

// One tile: rows m0 .. m0+MR of the activations times the 8 outputs of group g. Per output (one float lane) the
// float operations are, block after block in order: acc = fma(float(isum_b), d_b * dx_b, acc),
// acc = fma(m_b, sx_b, acc), where isum_b is the block's exact integer dot product; MR changes which loads are
// shared, nothing else. The int16 partial sums cannot saturate: one lane of maddubs adds 2 products of at most
// 15 x 127, and a block's 8 of them add 16 (30,480 < 32,767) before madd widens them.
// One group per tile, also for one row: a tile then reads one sequential stream of weights. Two groups a tile (two
// streams 2.3 KB apart, for two independent FMA chains) read one-row decode's weights from memory slower than one
// stream does (`python -m benchmarks.gemm`'s stream figures, `python -m benchmarks.ab ... bench_decode`).
// L: the scales' layout (qgemm.h); Q4_SYM: m = -8 d computed from d, the same float values as the stored m, so the
// same outputs bit for bit.
template <int MR, int L>
static inline void q4_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t g, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  Q4Scales<L> scales;
  __m256 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t rb = a.row_bytes, nbp = a.nbp;
  const int8_t* xq = a.q + m0 * rb;  // as q8_tile's
  const float* dxp = a.dx + m0 * nbp;
  const float* sxp = a.sx + m0 * nbp;
  const uint8_t* wb = w.data + g * nb * 128;
  for (int64_t b = 0; b < nb; ++b, wb += 128, xq += QK, ++dxp, ++sxp) {
    if constexpr (MR <= 4) prefetch_ahead(wb, 128, q4_scales_at<L>(w, nb, g, b), q4_scale_bytes(L));
    __m256i s16[MR];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // chunks 2h, 2h+1 (low nibbles) and 2h+4, 2h+5 (high nibbles)
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * h));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * h + 32));
      const __m256i l0 = _mm256_and_si256(r0, m4), h0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), m4);
      const __m256i l1 = _mm256_and_si256(r1, m4), h1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), m4);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = xq + i * rb + 8 * h;
        const auto bc = [&](int off) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x + off)); };
#if LS_VNNI
        __m256i t = h == 0 ? _mm256_setzero_si256() : s16[i];  // (int32 lanes here: dpbusd widens as it adds)
        t = LS_DPBUSD(LS_DPBUSD(t, l0, bc(0)), h0, bc(16));
        s16[i] = LS_DPBUSD(LS_DPBUSD(t, l1, bc(4)), h1, bc(20));
#else
        const __m256i t = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l0, bc(0)), _mm256_maddubs_epi16(h0, bc(16))),
                                           _mm256_add_epi16(_mm256_maddubs_epi16(l1, bc(4)), _mm256_maddubs_epi16(h1, bc(20))));
        s16[i] = h == 0 ? t : _mm256_add_epi16(s16[i], t);
#endif
      }
    }
    __m256 d, m;
    scales.at(w, nb, g, b, d, m);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#if LS_VNNI
      const __m256 isum = _mm256_cvtepi32_ps(s16[i]);
#else
      const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], _mm256_set1_epi16(1)));
#endif
      acc[i] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, _mm256_broadcast_ss(dxp + i * nbp)), acc[i]);
      acc[i] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(sxp + i * nbp), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + (m0 + i) * ldy + 8 * g, acc[i]);
}

#if LS_ZMM
// q4_tile for groups g and g + 1 at once (the pair tiles above).
template <int MR, int L>
static inline void q4_pair_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t g, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const uint8_t* w0 = w.data + g * nb * 128;
  const uint8_t* w1 = w0 + nb * 128;  // group g + 1
  Q4Scales<L> sc0, sc1;
  const auto join = [](__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
  };
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s32[MR];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i r0 = join256(w0 + b * 128 + 64 * h, w1 + b * 128 + 64 * h);
      const __m512i r1 = join256(w0 + b * 128 + 64 * h + 32, w1 + b * 128 + 64 * h + 32);
      // (a 32-bit shift then the nibble mask: each byte's high nibble, as q4_tile's 16-bit shift gives)
      const __m512i l0 = _mm512_and_si512(r0, m4), h0 = _mm512_and_si512(_mm512_srli_epi32(r0, 4), m4);
      const __m512i l1 = _mm512_and_si512(r1, m4), h1 = _mm512_and_si512(_mm512_srli_epi32(r1, 4), m4);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int8_t* x = a.q + (m0 + i) * a.row_bytes + b * QK + 8 * h;
        const auto bc = [&](int off) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + off)); };
        __m512i t = h == 0 ? _mm512_setzero_si512() : s32[i];
        t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t, l0, bc(0)), h0, bc(16));
        s32[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t, l1, bc(4)), h1, bc(20));
      }
    }
    __m256 d0, m0v, d1, m1v;  // each group's, as its one-group tile computes them
    sc0.at(w, nb, g, b, d0, m0v);
    sc1.at(w, nb, g + 1, b, d1, m1v);
    const __m512 d = join(d0, d1), m = join(m0v, m1v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int64_t r = (m0 + i) * a.nbp + b;
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i]), _mm512_mul_ps(d, _mm512_set1_ps(a.dx[r])), acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sx[r]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + (m0 + i) * ldy + 8 * g, acc[i]);
}
#endif

// Output columns [n_begin, n_end), whole groups of 8 (Int4 layers have out_features % 16 == 0).
template <int L>
static void q4_range_t(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  const auto one = [&](auto mr, int64_t m, int64_t g) { q4_tile<decltype(mr)::value, L>(w, a, m, g, y, ldy); };
#if LS_ZMM
  if (M >= PAIR_ROWS) {
    const auto two = [&](auto mr, int64_t m, int64_t g) { q4_pair_tile<decltype(mr)::value, L>(w, a, m, g, y, ldy); };
    many_rows_paired(M, n_begin / 8, n_end / 8, two, one);
    return;
  }
#endif
  many_rows(M, n_begin / 8, n_end / 8, one);
}

// ---- Int4 in Q4_K's own scales, on activations rounded per 256 (q8_K) -------------------------------------------

// A super-block's 6-bit mins of blocks 2p and 2p + 1 for the 8 outputs of a group (scb: its sc bytes, qgemm.h's K
// layout; the mins 64 bytes on), interleaved: bytes (2j, 2j + 1) = output j's pair, as q4k_tile's mp takes them.
static inline __m128i q4k_mn_pairs(const uint8_t* scb, int p) {
  return _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scb + 64 + 16 * p)),
                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scb + 72 + 16 * p)));
}

// One tile: rows m0 .. m0+MR times the 8 outputs of group g, a super-block of 256 weights (8 blocks, one D and Dmin,
// one activation scale dk) at a time, as ggml's `ggml_vec_dot_q4_K_q8_K`: each block's exact integer dot product
// times its 6-bit scale sc, summed over the 8 blocks in int32 (T), and the blocks' 6-bit mins mn times the
// activations' block sums bk, likewise (Mn). Per output (one float lane), super-block after super-block in order:
// acc = fma(float(T), D dk, acc), acc = fma(float(Mn), (-Dmin) dk, acc): two float FMAs per 256 weights where the
// per-32 activation scales of q4_tile need two per 32. |T| <= 256 x 15 x 127 x 63 < 2^31 (its conversion to float
// rounds above 2^24, the same way in every tile) and |Mn| <= 8 x 63 x 4,064 < 2^24. MR changes which loads are
// shared, nothing else: decode = prefill bit for bit. Without VNNI each half block's maddubs int16 pair sums (8
// products of at most 15 x 127 a lane: 15,240) go straight into vpmaddwd against sc (in both int16 of the output's
// lane), which widens and scales them in one instruction (ggml's `_mm256_madd_epi16(scale, p16)`).
// `python -m benchmarks.kernel_ab` compares it with q4_tile on per-32 activations layer by layer
// (docs/performance.md#native-cpu-kernels). The halves are not unrolled: GCC interleaved them and spilled the rows'
// T, and few-row steps ran slower.
template <int MR>
static inline void q4k_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t g, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t rb = a.row_bytes, nbp = a.nbp;
  const int8_t* xq = a.qk + m0 * rb;  // row m0 + i's super-block at xq + i rb, dk at dkp[i nbp / 8], bk at bkp[i nbp]
  const float* dkp = a.dk + m0 * (nbp / 8);
  const int16_t* bkp = a.bk + m0 * nbp;
  const uint8_t* wb = w.data + g * nb * 128;
  const uint16_t* sb = w.scales + g * (nb / 8) * 80;  // (qgemm.h's K layout: D, Dmin, sc bytes (s, j), mn bytes (s, j))
  for (int64_t B = 0; B < nb / 8; ++B, sb += 80, xq += 8 * QK, ++dkp, bkp += 8) {
    const uint8_t* scb = reinterpret_cast<const uint8_t*>(sb + 16);
    __m256i T[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) T[i] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s, wb += 128) {
      if constexpr (MR <= 4) prefetch_ahead(wb, 128, sb + 10 * s, 20);
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scb + 8 * s));  // block s's sc, output j
#if LS_VNNI
      const __m256i sc = _mm256_cvtepu8_epi32(sc8);
#else
      const __m256i sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));  // lane j: sc twice, as int16
#endif
      // each half of the block (q4_tile's chunks 2h, 2h+1, 2h+4, 2h+5) scaled into T apart: no partial sums live across
      // the halves (the halves not unrolled: GCC then interleaved them and spilled)
#pragma GCC unroll 1
      for (int h = 0; h < 2; ++h) {
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * h));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * h + 32));
        const __m256i l0 = _mm256_and_si256(r0, m4), h0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), m4);
        const __m256i l1 = _mm256_and_si256(r1, m4), h1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), m4);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = xq + i * rb + QK * s + 8 * h;
          const auto bc = [&](int off) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x + off)); };
#if LS_VNNI
          const __m256i t = LS_DPBUSD(LS_DPBUSD(LS_DPBUSD(LS_DPBUSD(_mm256_setzero_si256(), l0, bc(0)), h0, bc(16)), l1, bc(4)), h1, bc(20));
          T[i] = _mm256_add_epi32(T[i], _mm256_mullo_epi32(t, sc));
#else
          const __m256i t = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l0, bc(0)), _mm256_maddubs_epi16(h0, bc(16))),
                                             _mm256_add_epi16(_mm256_maddubs_epi16(l1, bc(4)), _mm256_maddubs_epi16(h1, bc(20))));
          T[i] = _mm256_add_epi32(T[i], _mm256_madd_epi16(t, sc));
#endif
        }
      }
    }
    // lane j of mp[p]: the int16 pair (mn of block 2p, of block 2p + 1) of output 8g + j, against (bk[2p], bk[2p + 1])
    __m256i mp[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) mp[p] = _mm256_cvtepu8_epi16(q4k_mn_pairs(scb, p));
    const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
    const __m256 nDmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 8))), _mm256_set1_ps(-0.f));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int16_t* bs = bkp + i * nbp;
      const auto pair = [&](int p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(bs + 2 * p)); };
      const __m256i mn = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(mp[0], pair(0)), _mm256_madd_epi16(mp[1], pair(1))),
                                          _mm256_add_epi32(_mm256_madd_epi16(mp[2], pair(2)), _mm256_madd_epi16(mp[3], pair(3))));
      const __m256 dk = _mm256_broadcast_ss(dkp + i * (nbp / 8));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[i]), _mm256_mul_ps(D, dk), acc[i]);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mn), _mm256_mul_ps(nDmin, dk), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + (m0 + i) * ldy + 8 * g, acc[i]);
}

#if LS_AMX
// AMX-INT8 (Intel SDM vol. 1, "Intel Advanced Matrix Extensions"; TDPBSUD in vol. 2): `tdpbsud` multiplies a tile
// of 16 rows of 64 signed activation bytes by a tile of 16 rows of 16 outputs x 4 unsigned weight bytes (the "VNNI
// layout": row r holds each output's weights 4r .. 4r+3) into 16 x 16 int32 sums, 16,384 multiply-adds in one
// instruction. Q4_K's T (q4k_tile) weighs each block's dot product by its 6-bit sc, which a sum over a tile cannot
// do, and q sc (up to 945) does not fit a byte; sc = 8 hi + lo (hi, lo < 8) does: the tiles take the weights q lo
// and q hi (at most 105 each, made as the weights are unpacked), and T = C_lo + 8 C_hi, the same integer as
// q4k_tile's sum of sc times each block's exact dot product. The float work per super-block is q4k_tile's, lane for
// lane (16 outputs a vector: groups g and g + 1, as the pair tiles): the same integers and the same float
// operations, so every output is the bits q4k_tile gives, and decode (one row, q4k_tile) = prefill (AMX) still holds.

// Linux hands out the tile registers' 8 KB of state only on request (Documentation/arch/x86/xstate.rst): once per
// process; refused (an old kernel, a hypervisor that hides it), the VNNI tiles serve.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// Palette 1's configuration (64 bytes), all eight tiles 16 rows x 64 bytes: 0-3 the 16 x 16 int32 sums C_lo and
// C_hi of two tiles of rows, 4 and 5 their activations (two blocks of 16 rows), 6 and 7 the weights times lo and
// times hi.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

constexpr int64_t AMX_ROWS = 16;  // rows a tile
// Rows from which a step takes AMX: below it each pair's weights, unpacked for fewer than two tiles of rows, cost more
// than the tiles save (`benchmarks.kernel_ab`, docs/performance.md#native-cpu-kernels).
constexpr int64_t AMX_MIN_ROWS = 32;

// Groups g and g + 1's weights as `tdpbsud`'s weight tiles, 2,048 bytes per two blocks into bb: the tile of the
// weights times lo (1,024 bytes: block 2t's 8 rows, then block 2t + 1's), then the tile times hi. Row p < 4 of a
// block holds the low nibbles of the Int4 layout's vector p (weights 4p + t), row p + 4 the high ones (16 + 4p + t);
// bytes 0-31 group g's 8 outputs, 32-63 group g + 1's. A 16-bit multiply scales both bytes of a lane exactly (each
// product < 256, and both bytes are one output's).
static inline void q4k_amx_unpack(const QWeight& w, int64_t g, uint8_t* bb) {
  const int64_t nb = w.K / QK;
  const uint8_t* w0 = w.data + g * nb * 128;
  const uint8_t* sc0 = reinterpret_cast<const uint8_t*>(w.scales + g * (nb / 8) * 80 + 16);
  const uint8_t* sc1 = sc0 + (nb / 8) * 160;  // group g + 1's
  const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi32(0x00070007);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t off = b / 8 * 160 + 8 * (b % 8);  // block b's sc bytes (qgemm.h's K layout), output j at + j
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc0 + off)),
                                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc1 + off))));
    const __m512i both = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));  // each output's sc in both int16 of its lane
    const __m512i lo = _mm512_and_si512(both, m3), hi = _mm512_and_si512(_mm512_srli_epi16(both, 3), m3);
    uint8_t* out = bb + b / 2 * 2048 + b % 2 * 512;
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i v = join256(w0 + b * 128 + 32 * p, w0 + (nb + b) * 128 + 32 * p);
      const __m512i q0 = _mm512_and_si512(v, m4), q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      _mm512_storeu_si512(out + 64 * p, _mm512_mullo_epi16(q0, lo));
      _mm512_storeu_si512(out + 64 * (p + 4), _mm512_mullo_epi16(q1, lo));
      _mm512_storeu_si512(out + 1024 + 64 * p, _mm512_mullo_epi16(q0, hi));
      _mm512_storeu_si512(out + 1024 + 64 * (p + 4), _mm512_mullo_epi16(q1, hi));
    }
  }
}

// One tile: rows m0 .. m0 + 16 R - 1 (R tiles of rows, 1 or 2) times outputs 8g .. 8g+15, on bb (q4k_amx_unpack's).
// Two tiles of rows share each weight tile's load. Per output, super-block after super-block, q4k_tile's two FMAs on
// the same T and Mn.
template <int R>
static void q4k_amx_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t g, const uint8_t* bb, float* y, int64_t ldy) {
  constexpr int ROWS = R * AMX_ROWS;
  const int64_t nb = w.K / QK, rb = a.row_bytes, nbp = a.nbp;
  const int8_t* xq = a.qk + m0 * rb;
  const uint16_t* s0 = w.scales + g * (nb / 8) * 80;
  const uint16_t* s1 = s0 + (nb / 8) * 80;  // group g + 1
  alignas(64) int32_t clo[ROWS][16], chi[ROWS][16];
  alignas(64) float acc[ROWS][16] = {};
  for (int64_t B = 0; B < nb / 8; ++B, s0 += 80, s1 += 80, bb += 4 * 2048) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (R == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const int8_t* x = xq + (8 * B + 2 * t) * QK;
      _tile_loadd(4, x, rb);
      _tile_loadd(6, bb + t * 2048, 64);
      _tile_loadd(7, bb + t * 2048 + 1024, 64);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 4, 7);
      if constexpr (R == 2) {
        _tile_loadd(5, x + AMX_ROWS * rb, rb);
        _tile_dpbsud(2, 5, 6);
        _tile_dpbsud(3, 5, 7);
      }
    }
    _tile_stored(0, clo, 64);
    _tile_stored(1, chi, 64);
    if constexpr (R == 2) {
      _tile_stored(2, clo[AMX_ROWS], 64);
      _tile_stored(3, chi[AMX_ROWS], 64);
    }
    const uint8_t* sc0 = reinterpret_cast<const uint8_t*>(s0 + 16);
    const uint8_t* sc1 = reinterpret_cast<const uint8_t*>(s1 + 16);
    // q4k_tile's mp, for both groups: lane j's int16 pair (mn of block 2p, of block 2p + 1)
    __m512i mp[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p)
      mp[p] = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(q4k_mn_pairs(sc0, p)), q4k_mn_pairs(sc1, p), 1));
    const __m512 D = halves16(s0, s1);
    const __m512 nDmin = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(halves16(s0 + 8, s1 + 8)), _mm512_set1_epi32(INT32_MIN)));
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; ++i) {
      const __m512i T = _mm512_add_epi32(_mm512_load_si512(clo[i]), _mm512_slli_epi32(_mm512_load_si512(chi[i]), 3));
      const int16_t* bs = a.bk + (m0 + i) * nbp + 8 * B;
      const auto pair = [&](int p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(bs + 2 * p)); };
      const __m512i mn = _mm512_add_epi32(_mm512_add_epi32(_mm512_madd_epi16(mp[0], pair(0)), _mm512_madd_epi16(mp[1], pair(1))),
                                          _mm512_add_epi32(_mm512_madd_epi16(mp[2], pair(2)), _mm512_madd_epi16(mp[3], pair(3))));
      const __m512 dk = _mm512_set1_ps(a.dk[(m0 + i) * (nbp / 8) + B]);
      __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(T), _mm512_mul_ps(D, dk), _mm512_load_ps(acc[i]));
      _mm512_store_ps(acc[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(mn), _mm512_mul_ps(nDmin, dk), r));
    }
  }
  for (int i = 0; i < ROWS; ++i) _mm512_storeu_ps(y + (m0 + i) * ldy + 8 * g, _mm512_load_ps(acc[i]));
}

// Groups [g_begin, g_end) for rows [0, M), M >= AMX_MIN_ROWS: rows in chunks of MB (the activations stay in L2), each
// pair of groups unpacked once a chunk, its 16-row tiles by AMX; the rows past the last whole tile and an odd last
// group by q4k_tile.
template <typename Tile>
static void q4k_amx_range(const QWeight& w, const QActs& a, int64_t M, int64_t g_begin, int64_t g_end, float* y, int64_t ldy,
                          const Tile& one) {
  static const TileConfig config;
  thread_local std::vector<uint8_t> bb;
  bb.resize(w.K / QK * 1024);
  _tile_loadconfig(&config);
  const int64_t whole = M / AMX_ROWS * AMX_ROWS;
  for (int64_t m0 = 0; m0 < whole; m0 += MB) {
    const int64_t m1 = std::min(whole, m0 + MB);
    int64_t g = g_begin;
    for (; g + 1 < g_end; g += 2) {
      q4k_amx_unpack(w, g, bb.data());
      int64_t m = m0;
      for (; m + 2 * AMX_ROWS <= m1; m += 2 * AMX_ROWS) q4k_amx_tile<2>(w, a, m, g, bb.data(), y, ldy);
      if (m < m1) q4k_amx_tile<1>(w, a, m, g, bb.data(), y, ldy);
    }
    if (g < g_end) row_tiles(m0, m1, g, one);
  }
  _tile_release();
  if (whole < M)
    for (int64_t g = g_begin; g < g_end; ++g) row_tiles(whole, M, g, one);
}
#endif

// Output columns [n_begin, n_end), whole groups of 8: one group a tile, or AMX from AMX_MIN_ROWS rows where the build
// and the kernel allow it. 512-bit pair tiles (as q6_range's) ran slower here, with `vpdpbusd` and `vpmulld` or with
// `vpmaddubsw` and `vpmaddwd` alike (`benchmarks.kernel_ab`, docs/performance.md#native-cpu-kernels): the tile's
// other work is per 256 weights, so a pair saves it little, and its integer multiply-adds are not faster 512 bits
// wide.
static void q4k_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  const auto one = [&](auto mr, int64_t m, int64_t g) { q4k_tile<decltype(mr)::value>(w, a, m, g, y, ldy); };
#if LS_AMX
  if (M >= AMX_MIN_ROWS && amx_permitted()) return q4k_amx_range(w, a, M, n_begin / 8, n_end / 8, y, ldy, one);
#endif
  many_rows(M, n_begin / 8, n_end / 8, one);
}

static void q4_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  if (w.kq)
    q4k_range(w, a, M, n_begin, n_end, y, ldy);
  else if (w.sym)
    q4_range_t<Q4_SYM>(w, a, M, n_begin, n_end, y, ldy);
  else
    q4_range_t<Q4_ASYM>(w, a, M, n_begin, n_end, y, ldy);
}
// ---- Int6 (Q6_K), 8 outputs interleaved -----------------------------------------------------------------------------

// One tile: rows m0 .. m0+MR times the 8 outputs of group g (qgemm.h's Int6 layout), on the activations rounded per
// 256 (q8_K), as ggml's `ggml_vec_dot_q6_K_q8_K`: each output's 16-weight halves summed apart (their sub-scales
// differ), s_half = sum q x over the half with q in [0, 63] unsigned, and T = sum over the super-block's 16 halves of
// sc (s - 32 X) in int32 (X: the half's activation sum, hk); per output (one float lane), super-block after
// super-block in order: acc = fma(float(T), d_B dk_B, acc): one float FMA per 256 weights where per-32 activation
// scales need one per 32. |T| <= 16 x 128 x 16 x 32 x 127 < 2^31, its float conversion rounding the same way in every
// tile. MR changes which loads are shared, nothing else: decode = prefill bit for bit. Each half's maddubs int16 pair
// sums (2 of at most 2 x 63 x 127: 32,004 < 32,767) go into vpmaddwd against sc (signed, in both int16 of the
// output's lane), which widens and scales them in one instruction, with VNNI too: vpdpbusd's int32 sums would need
// a vpmulld by each half's sub-scale, two micro-ops, twice a half (`benchmarks.kernel_ab` on a Q4_K_M file's Q6_K
// layers: the vpmaddwd form faster on an AVX-512 VNNI host; docs/performance.md#native-cpu-kernels). The offset 32
// (sc_lo X_lo + sc_hi X_hi) is one vpmaddwd of (sc_lo, sc_hi) against (X_lo, X_hi) and a shift.
template <int MR>
static inline void q6_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t g, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t rb = a.row_bytes, nbp = a.nbp;
  const int8_t* xq = a.qk + m0 * rb;  // as q4k_tile's, and the halves' sums at hkp[2 i nbp]
  const float* dkp = a.dk + m0 * (nbp / 8);
  const int16_t* hkp = a.hk + 2 * m0 * nbp;
  const uint8_t* wb = w.data + g * nb * 208;
  for (int64_t B = 0; B < nb / 8; ++B, ++dkp) {
    const uint16_t* db = w.scales + (g * (nb / 8) + B) * 8;
    __m256i T[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) T[i] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s, wb += 208, xq += QK, hkp += 2) {
      if constexpr (MR <= 4) prefetch_ahead(wb, 208, db, 2);
      const __m128i lo8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + 192));  // the halves' sc, output j
      const __m128i hi8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + 200));
      const __m256i sc_lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo8, lo8)), sc_hi = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(hi8, hi8));
#pragma GCC unroll 1
      for (int h = 0; h < 2; ++h) {  // Int4's chunks 2h, 2h+1 (low nibbles: the first half) and 2h+4, 2h+5 (the second)
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * h));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * h + 32));
        const __m256i t2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + 32 * h));
        // (16-bit shifts: the bits a shift carries across bytes fall outside the mask)
        const __m256i l0 = _mm256_or_si256(_mm256_and_si256(r0, m4), _mm256_and_si256(_mm256_slli_epi16(t2, 4), m30));
        const __m256i h0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(r0, 4), m4), _mm256_and_si256(_mm256_slli_epi16(t2, 2), m30));
        const __m256i l1 = _mm256_or_si256(_mm256_and_si256(r1, m4), _mm256_and_si256(t2, m30));
        const __m256i h1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(r1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(t2, 2), m30));
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = xq + i * rb + 8 * h;
          const auto bc = [&](int off) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x + off)); };
          const __m256i l = _mm256_add_epi16(_mm256_maddubs_epi16(l0, bc(0)), _mm256_maddubs_epi16(l1, bc(4)));
          const __m256i u = _mm256_add_epi16(_mm256_maddubs_epi16(h0, bc(16)), _mm256_maddubs_epi16(h1, bc(20)));
          T[i] = _mm256_add_epi32(T[i], _mm256_add_epi32(_mm256_madd_epi16(l, sc_lo), _mm256_madd_epi16(u, sc_hi)));
        }
      }
      const __m256i sc_both = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo8, hi8));  // lane j: (sc_lo, sc_hi) as int16
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {  // - 32 (sc_lo X_lo + sc_hi X_hi)
        const __m256i X = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(hkp + 2 * i * nbp));  // (X_lo, X_hi)
        T[i] = _mm256_sub_epi32(T[i], _mm256_slli_epi32(_mm256_madd_epi16(sc_both, X), 5));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db)));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[i]), _mm256_mul_ps(d, _mm256_broadcast_ss(dkp + i * (nbp / 8))), acc[i]);
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + (m0 + i) * ldy + 8 * g, acc[i]);
}

#if LS_ZMM
// q6_tile for groups g and g + 1 at once (the pair tiles above), each lane the one-group tile's operations in its
// order.
template <int MR>
static inline void q6_pair_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t g, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t rb = a.row_bytes, nbp = a.nbp;
  const int8_t* xq = a.qk + m0 * rb;  // as q6_tile's
  const float* dkp = a.dk + m0 * (nbp / 8);
  const int16_t* hkp = a.hk + 2 * m0 * nbp;
  const uint8_t* w0 = w.data + g * nb * 208;
  const uint8_t* w1 = w0 + nb * 208;  // group g + 1
  // 8 signed bytes of each group, each twice, as int16: lane j (g's) and 8 + j (g + 1's) hold (b[j], b[j])
  const auto twice = [](__m128i b0, __m128i b1) {
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(b0, b0)), _mm_unpacklo_epi8(b1, b1), 1));
  };
  const auto load8b = [](const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); };
  for (int64_t B = 0; B < nb / 8; ++B, ++dkp) {
    const uint16_t* db0 = w.scales + (g * (nb / 8) + B) * 8;
    const uint16_t* db1 = db0 + (nb / 8) * 8;
    __m512i T[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) T[i] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s, w0 += 208, w1 += 208, xq += QK, hkp += 2) {
      const __m128i lo0 = load8b(w0 + 192), hi0 = load8b(w0 + 200), lo1 = load8b(w1 + 192), hi1 = load8b(w1 + 200);
      const __m512i sc_lo = twice(lo0, lo1), sc_hi = twice(hi0, hi1);
#pragma GCC unroll 1
      for (int h = 0; h < 2; ++h) {
        const __m512i r0 = join256(w0 + 64 * h, w1 + 64 * h);
        const __m512i r1 = join256(w0 + 64 * h + 32, w1 + 64 * h + 32);
        const __m512i t2 = join256(w0 + 128 + 32 * h, w1 + 128 + 32 * h);
        const __m512i l0 = _mm512_or_si512(_mm512_and_si512(r0, m4), _mm512_and_si512(_mm512_slli_epi16(t2, 4), m30));
        const __m512i h0 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(r0, 4), m4), _mm512_and_si512(_mm512_slli_epi16(t2, 2), m30));
        const __m512i l1 = _mm512_or_si512(_mm512_and_si512(r1, m4), _mm512_and_si512(t2, m30));
        const __m512i h1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(r1, 4), m4), _mm512_and_si512(_mm512_srli_epi16(t2, 2), m30));
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const int8_t* x = xq + i * rb + 8 * h;
          const auto bc = [&](int off) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + off)); };
          const __m512i l = _mm512_add_epi16(_mm512_maddubs_epi16(l0, bc(0)), _mm512_maddubs_epi16(l1, bc(4)));
          const __m512i u = _mm512_add_epi16(_mm512_maddubs_epi16(h0, bc(16)), _mm512_maddubs_epi16(h1, bc(20)));
          T[i] = _mm512_add_epi32(T[i], _mm512_add_epi32(_mm512_madd_epi16(l, sc_lo), _mm512_madd_epi16(u, sc_hi)));
        }
      }
      const __m512i sc_both = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(  // lane j: (sc_lo, sc_hi) as int16
          _mm256_castsi128_si256(_mm_unpacklo_epi8(lo0, hi0)), _mm_unpacklo_epi8(lo1, hi1), 1));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {  // - 32 (sc_lo X_lo + sc_hi X_hi)
        const __m512i X = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(hkp + 2 * i * nbp));
        T[i] = _mm512_sub_epi32(T[i], _mm512_slli_epi32(_mm512_madd_epi16(sc_both, X), 5));
      }
    }
    const __m512 d = halves16(db0, db1);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(T[i]), _mm512_mul_ps(d, _mm512_set1_ps(dkp[i * (nbp / 8)])), acc[i]);
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + (m0 + i) * ldy + 8 * g, acc[i]);
}
#endif

static void q6_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  const auto one = [&](auto mr, int64_t m, int64_t g) { q6_tile<decltype(mr)::value>(w, a, m, g, y, ldy); };
#if LS_ZMM
  if (M >= PAIR_ROWS) {
    const auto two = [&](auto mr, int64_t m, int64_t g) { q6_pair_tile<decltype(mr)::value>(w, a, m, g, y, ldy); };
    many_rows_paired(M, n_begin / 8, n_end / 8, two, one);
    return;
  }
#endif
  many_rows(M, n_begin / 8, n_end / 8, one);
}
#else
// Scalar: the same sums (exact per block), the same order per output as the vector kernels. `block(g, j, b, xb, r,
// acc)` adds block b of output 8g + j against activations xb (row index r into dx / sx) to acc.
template <typename Block>
static void scalar_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy,
                         const Block& block) {
  const int64_t nb = w.K / QK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) acc = block(n / 8, n % 8, b, a.q + m * a.row_bytes + b * QK, m * a.nbp + b, acc);
      y[m * ldy + n] = acc;
    }
}

static void q8_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  scalar_range(w, a, M, n_begin, n_end, y, ldy, [&](int64_t g, int64_t j, int64_t b, const int8_t* xb, int64_t r, float acc) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(w.data) + (g * nb + b) * 256;  // (c, j, t)
    int s = 0;
    for (int64_t c = 0; c < 8; ++c)
      for (int64_t t = 0; t < 4; ++t) s += wb[32 * c + 4 * j + t] * xb[4 * c + t];
    return std::fma(static_cast<float>(s), fp16_to_f(w.scales[(g * nb + b) * 8 + j]) * a.dx[r], acc);
  });
}

// Block wb's exact integer dot product for output lane j against 32 int8 activations xb.
static inline int q4_block_dot(const uint8_t* wb, int64_t j, const int8_t* xb) {
  int s = 0;
  for (int64_t p = 0; p < 4; ++p)
    for (int64_t t = 0; t < 4; ++t) {
      const uint8_t byte = wb[32 * p + 4 * j + t];
      s += (byte & 15) * xb[4 * p + t] + (byte >> 4) * xb[16 + 4 * p + t];
    }
  return s;
}

// Scalar, on the activations rounded per 256 (q4k_tile's and q6_tile's order): `superblock(g, j, B, m, acc)` adds
// super-block B of output 8g + j against row m to acc.
template <typename Super>
static void scalar_super_range(const QWeight& w, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy,
                               const Super& superblock) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n_begin; n < n_end; ++n) {
      float acc = 0.f;
      for (int64_t B = 0; B < w.K / (8 * QK); ++B) acc = superblock(n / 8, n % 8, B, m, acc);
      y[m * ldy + n] = acc;
    }
}

// Q4_K's scales
static void q4k_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  scalar_super_range(w, M, n_begin, n_end, y, ldy, [&](int64_t g, int64_t j, int64_t B, int64_t m, float acc) {
    const uint16_t* sb = w.scales + (g * (nb / 8) + B) * 80;
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(sb + 16);
    int32_t T = 0, Mn = 0;
    for (int64_t s = 0; s < 8; ++s) {
      const int64_t b = 8 * B + s;
      T += bytes[8 * s + j] * q4_block_dot(w.data + (g * nb + b) * 128, j, a.qk + m * a.row_bytes + b * QK);
      Mn += bytes[64 + 8 * s + j] * a.bk[m * a.nbp + b];
    }
    const float dk = a.dk[m * (a.nbp / 8) + B];
    acc = std::fma(static_cast<float>(T), fp16_to_f(sb[j]) * dk, acc);
    return std::fma(static_cast<float>(Mn), -fp16_to_f(sb[8 + j]) * dk, acc);
  });
}

static void q4_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  if (w.kq) return q4k_range(w, a, M, n_begin, n_end, y, ldy);
  const int64_t nb = w.K / QK;
  scalar_range(w, a, M, n_begin, n_end, y, ldy, [&](int64_t g, int64_t j, int64_t b, const int8_t* xb, int64_t r, float acc) {
    const int s = q4_block_dot(w.data + (g * nb + b) * 128, j, xb);
    float d, m;
    q4_dm_scalar(w, nb, g, b, j, d, m);
    return std::fma(m, a.sx[r], std::fma(static_cast<float>(s), d * a.dx[r], acc));
  });
}

static void q6_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK;
  scalar_super_range(w, M, n_begin, n_end, y, ldy, [&](int64_t g, int64_t j, int64_t B, int64_t m, float acc) {
    int32_t T = 0;
    for (int64_t b = 8 * B; b < 8 * B + 8; ++b) {
      const uint8_t* wb = w.data + (g * nb + b) * 208;
      const int8_t* xb = a.qk + m * a.row_bytes + b * QK;
      for (int64_t half = 0; half < 2; ++half) {
        int s = 0;
        for (int64_t k = 16 * half; k < 16 * half + 16; ++k) s += (q6_value(wb, j, k) - 32) * xb[k];
        T += static_cast<int8_t>(wb[192 + 8 * half + j]) * s;
      }
    }
    const float d = fp16_to_f(w.scales[(g * (nb / 8) + B) * 8 + j]);
    return std::fma(static_cast<float>(T), d * a.dk[m * (a.nbp / 8) + B], acc);
  });
}
#endif

#if !LS_AMX
bool amx_permitted() { return false; }
#endif

Features features() { return {LS_AVX2 != 0, LS_VNNI != 0, LS_ZMM != 0, LS_AMX != 0}; }

void qgemm_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  if (w.fmt == QFormat::Int4)
    q4_range(w, a, M, n_begin, n_end, y, ldy);
  else if (w.fmt == QFormat::Int6)
    q6_range(w, a, M, n_begin, n_end, y, ldy);
  else
    q8_range(w, a, M, n_begin, n_end, y, ldy);
}

// ---- the ops as Python calls them -------------------------------------------------------------------------------

// Output columns per parallel task: enough to amortize the task, few enough to split the smallest matrices; tasks
// are whole groups of 8 (the interleaved layouts).
constexpr int64_t GRAIN = 32;

static QWeight as_qweight(const View& data, const View& scales, QFormat fmt) {
  LS_CHECK(data.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == kHalf, "quantized weight: contiguous buffers, float16 scales");
  LS_CHECK(data.scalar_type() == (fmt == QFormat::Int8 ? kChar : kByte), "quantized weight: dtype");
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<f16>());
  if (fmt == QFormat::Int4 && scales.dim() == 3) {  // nibbles (N/8, K/32, 128), Q4_K's scales (N/8, K/256, 80)
    LS_CHECK(data.dim() == 3 && data.size(2) == 128 && data.size(1) % 8 == 0 && scales.size(0) == data.size(0) &&
                scales.size(1) * 8 == data.size(1) && scales.size(2) == 80, "int4 weight (Q4_K scales): interleaved shapes");
    return QWeight{fmt, static_cast<const uint8_t*>(data.data_ptr()), sp, data.size(0) * 8, data.size(1) * QK, false, true};
  }
  if (fmt == QFormat::Int4) {  // nibbles (N/8, K/32, 128), scales (N/8, K/32, 2, 8) or symmetric (N/8, K/32, 1, 8)
    LS_CHECK(data.dim() == 3 && data.size(2) == 128 && scales.dim() == 4 && scales.size(0) == data.size(0) &&
                scales.size(1) == data.size(1) && (scales.size(2) == 2 || scales.size(2) == 1) && scales.size(3) == 8,
                "int4 weight: interleaved shapes");
    return QWeight{fmt, static_cast<const uint8_t*>(data.data_ptr()), sp, data.size(0) * 8, data.size(1) * QK,
                   scales.size(2) == 1};
  }
  if (fmt == QFormat::Int6) {  // data (N/8, K/32, 208) uint8, scales (N/8, K/256, 8)
    LS_CHECK(data.dim() == 3 && data.size(2) == 208 && data.size(1) % 8 == 0 && scales.dim() == 3 &&
                scales.size(0) == data.size(0) && scales.size(1) * 8 == data.size(1) && scales.size(2) == 8,
                "int6 weight: interleaved shapes");
    return QWeight{fmt, static_cast<const uint8_t*>(data.data_ptr()), sp, data.size(0) * 8, data.size(1) * QK};
  }
  // Int8: data (N/8, K/32, 256) int8, scales (N/8, K/32, 8) (qgemm.h)
  LS_CHECK(data.dim() == 3 && data.size(2) == 256 && scales.dim() == 3 && scales.size(0) == data.size(0) &&
              scales.size(1) == data.size(1) && scales.size(2) == 8, "int8 weight: interleaved shapes");
  return QWeight{fmt, static_cast<const uint8_t*>(data.data_ptr()), sp, data.size(0) * 8, data.size(1) * QK};
}

QWeight qweight_of(const View& data, const View& scales) {
  if (data.scalar_type() == kChar) return as_qweight(data, scales, QFormat::Int8);
  return as_qweight(data, scales, data.dim() == 3 && data.size(2) == 208 ? QFormat::Int6 : QFormat::Int4);
}

// x (M, K) float32 or bfloat16 -> y (M, N) float32
static View quantized_linear(const View& x, const QWeight& w, const Alloc& alloc) {
  LS_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == w.K, "quantized linear: x (M, K) contiguous");
  LS_CHECK(x.scalar_type() == kFloat || x.scalar_type() == kBFloat16, "quantized linear: float32 or bfloat16 x");
  const int64_t M = x.size(0), K = w.K;
  ActBuffers buffers(M, K, k_acts(w));
  const QActs a = buffers.view(K);
  parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (x.scalar_type() == kFloat)
        quantize_act(x.data_ptr<float>() + m * K, K, a, m, k_acts(w));
      else
        quantize_act(x.data_ptr<bf16>() + m * K, K, a, m, k_acts(w));
    }
  });
  const View y = alloc(kFloat, {M, w.N});
  float* yp = y.data_ptr<float>();
  parallel_for(0, w.N / 8, GRAIN / 8, [&](int64_t begin, int64_t end) { qgemm_range(w, a, M, 8 * begin, 8 * end, yp, w.N); });
  return y;
}

View int4_linear(const View& x, const View& nibbles, const View& scales, const Alloc& alloc) {
  return quantized_linear(x, as_qweight(nibbles, scales, QFormat::Int4), alloc);
}

View int8_linear(const View& x, const View& w, const View& scales, const Alloc& alloc) {
  return quantized_linear(x, as_qweight(w, scales, QFormat::Int8), alloc);
}

View int6_linear(const View& x, const View& data, const View& scales, const Alloc& alloc) {
  return quantized_linear(x, as_qweight(data, scales, QFormat::Int6), alloc);
}

// x (M, K) -> what the kernels multiply: x rounded to int8 blocks and back to float (q dx), per 32 (`block` 32: every
// layer but Q4_K's) or per 256 (`block` 256: Q4_K's), for tests and the PyTorch reference
// (`model.quantize.round_activations` computes the same).
View round_activations(const View& x, int64_t block, const Alloc& alloc) {
  LS_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == kFloat && x.size(1) % QK == 0, "round_activations: x (M, K) float32");
  LS_CHECK(block == QK || block == 8 * QK, "round_activations: block 32 or 256");
  const int64_t M = x.size(0), K = x.size(1);
  const bool k = block != QK;
  ActBuffers buffers(1, K, k);
  const View out = alloc(x.scalar_type(), x.sizes());
  for (int64_t m = 0; m < M; ++m) {
    quantize_act(x.data_ptr<float>() + m * K, K, buffers.view(K), 0, k);
    for (int64_t i = 0; i < K; ++i)
      out.data_ptr<float>()[m * K + i] = k ? static_cast<float>(buffers.qk[i]) * buffers.dk[i / block]
                                           : static_cast<float>(buffers.q[i]) * buffers.dx[i / block];
  }
  return out;
}

// The whole weight as float32 (the PyTorch fall-backs and tests), bitwise each layer's `reference_dequantize`:
// `block(g, b, j, ob)` writes block b of output 8g + j (QK floats at ob).
template <typename Block>
static View dequantize_weight(const QWeight& w, const Alloc& alloc, const Block& block) {
  const int64_t K = w.K, nb = K / QK;
  const View out = alloc(kFloat, {w.N, K});
  float* o = out.data_ptr<float>();
  parallel_for(0, w.N / 8, 2, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = 0; j < 8; ++j) block(g, b, j, o + (8 * g + j) * K + b * QK);
  });
  return out;
}

// q * d + m, each product rounded before the sum
View int4_dequantize(const View& nibbles, const View& scales, const Alloc& alloc) {
  const QWeight w = as_qweight(nibbles, scales, QFormat::Int4);
  const int64_t nb = w.K / QK;
  return dequantize_weight(w, alloc, [&](int64_t g, int64_t b, int64_t j, float* ob) {
    const uint8_t* qb = w.data + (g * nb + b) * 128;  // byte (p, j, t): k = 4p + t (low), 16 + 4p + t (high)
    float d, m;
    q4_dm_scalar(w, nb, g, b, j, d, m);
    for (int64_t p = 0; p < 4; ++p)
      for (int64_t t = 0; t < 4; ++t) {
        const uint8_t byte = qb[32 * p + 4 * j + t];
        ob[4 * p + t] = static_cast<float>(byte & 15) * d + m;
        ob[16 + 4 * p + t] = static_cast<float>(byte >> 4) * d + m;
      }
  });
}

// q * d
View int8_dequantize(const View& data, const View& scales, const Alloc& alloc) {
  const QWeight w = as_qweight(data, scales, QFormat::Int8);
  const int64_t nb = w.K / QK;
  const int8_t* q = reinterpret_cast<const int8_t*>(w.data);
  return dequantize_weight(w, alloc, [&](int64_t g, int64_t b, int64_t j, float* ob) {
    const float d = fp16_to_f(w.scales[(g * nb + b) * 8 + j]);
    for (int64_t c = 0; c < 8; ++c)
      for (int64_t t = 0; t < 4; ++t) ob[4 * c + t] = static_cast<float>(q[(g * nb + b) * 256 + 32 * c + 4 * j + t]) * d;
  });
}

// (d sc) (q - 32), as gguf.quants dequantizes Q6_K (each product rounded)
View int6_dequantize(const View& data, const View& scales, const Alloc& alloc) {
  const QWeight w = as_qweight(data, scales, QFormat::Int6);
  const int64_t nb = w.K / QK;
  return dequantize_weight(w, alloc, [&](int64_t g, int64_t b, int64_t j, float* ob) {
    const uint8_t* wb = w.data + (g * nb + b) * 208;
    const float d = fp16_to_f(w.scales[(g * (nb / 8) + b / 8) * 8 + j]);
    for (int64_t k = 0; k < QK; ++k) {
      const float dl = d * static_cast<float>(static_cast<int8_t>(wb[192 + 8 * (k / 16) + j]));
      ob[k] = dl * static_cast<float>(q6_value(wb, j, k) - 32);
    }
  });
}

}  // namespace ls
