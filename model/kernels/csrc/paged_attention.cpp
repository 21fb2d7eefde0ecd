// Attention of decode rows (one new token each) straight over the paged KV pool (PagedAttention, Kwon et al.
// 2023): each (sequence, KV head) walks its block table, so no per-step gather of whole sequences, no padding
// to the longest context and no mask. Softmax(q k^T / sqrt(E)) v (Vaswani et al. 2017) with grouped-query
// heads (Ainslie et al. 2023): query head h reads KV head h / (H / K), as SDPA's enable_gqa does.
//
// The pools hold the activation dtype (float32, bfloat16) or, for float32 activations, a 16-bit cache (float16 as
// llama.cpp's default `--cache-type-k f16`, or bfloat16): each key and value was rounded once when written
// (paged_write, step_layers) and is widened exactly on load (load8), so every read of it, by any row in any step,
// sees the same number, and the arithmetic is the float32 cache's. T: q and out; C: the pools.
//
// An int8 cache (`--kv-cache-dtype int8`, float32 activations) holds each head's row of a token as E int8 quants and
// their float32 scale d, E + 4 bytes: llama.cpp's q8_0 (ggml-common.h `block_q8_0`; ggml-quants.c
// `quantize_row_q8_0_ref`: d = max|x| / 127, q = round(x / d)) with one scale per head row instead of per 32 values.
// A block keeps its rows' quants together, a head's bs rows in one run, and their scales after them, a head's
// together (ops.h `kv_slot`), not each scale beside its quants: a 68-byte row at 68-byte offsets straddled two cache
// lines more often than not, and a decode row's walk over a long history is bound by the lines it waits for. A score
// over an int8 cache is an integer dot product, as llama.cpp scores a q8_0 cache (ggml-cpu's flash attention converts
// the query to the cache's vec_dot_type, then `ggml_vec_dot_q8_0_q8_0`): each query is rounded to int8 once per step
// (`QuantizedQueries`, one scale per head row as the keys have), and a score is float(q_q . k_q) d_q d_k, the sum
// exact in int32 whatever the instructions (VNNI `vpdpbusd`, AVX2 `vpmaddubsw` or `vpmaddwd`, scalar) or their
// order, the float products in one order everywhere (`int_scores8`, `int_score1`). Widening each of a key's E quants
// to float and an FMA per value cost the kernel more than reading them did (it was compute-bound). Values stay in
// float: each is accumulated with weight p d_v (`weight`). So a row's numbers stay the same alone, in a tile or
// beside any other rows.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_telemetry.h"
#include "ops.h"
#include "simd.h"

namespace ls {

// An int8 cache's quants: exact in float.
static inline float to_f(int8_t x) { return static_cast<float>(x); }
#if LS_AVX2
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif
#if LS_ZMM
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// An int8 row's float32 scale, at p (ops.h kv_slot; unaligned where the block's quants are not whole words).
static inline float load_scale(const void* p) {
  float d;
  std::memcpy(&d, p, sizeof d);
  return d;
}

// An int8 row: n values x -> n quants and their scale d, d = max|x| times the float nearest 1/127 and each quant x / d
// rounded half to even, as model/kernels/kv_int8.py's `quantize` computes them (llama.cpp rounds halves away from
// zero). The cache's rows (store_kv_row) and the queries scored against them (QuantizedQueries) alike.
template <typename T>
static float round_row_int8(const T* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(to_f(x[i])));
  const float d = amax * static_cast<float>(1.0 / 127.0);
  for (int64_t i = 0; i < n; ++i) {
    const float v = d > 0.f ? to_f(x[i]) / d : 0.f;
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(v))));
  }
  return d;
}

// A step's queries over an int8 cache, each (already times the attention scale) rounded to int8 once: quants (Qn, E),
// scales (Qn,), and each query's 128 * sum of its quants, the offset an unsigned-by-signed product (vpdpbusd) adds
// when a key's quants are read as unsigned (k + 128).
struct QuantizedQueries {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> offset;
  int64_t E = 0;
  void quantize(const float* qf, int64_t Qn, int64_t e) {
    E = e;
    q.resize(Qn * E);
    d.resize(Qn);
    offset.resize(Qn);
    for (int64_t i = 0; i < Qn; ++i) {
      d[i] = round_row_int8(qf + i * E, E, q.data() + i * E);
      int32_t sum = 0;
      for (int64_t e2 = 0; e2 < E; ++e2) sum += q[i * E + e2];
      offset[i] = 128 * sum;
    }
  }
  const int8_t* row(int64_t i) const { return q.data() + i * E; }
};

static inline int32_t int_dot(const int8_t* a, const int8_t* b, int64_t E) {  // exact: |sum| <= 127^2 E
  int32_t s = 0;
  for (int64_t i = 0; i < E; ++i) s += static_cast<int32_t>(a[i]) * b[i];
  return s;
}

// Query i's score of a key of quants k and scale dk: the one float order every path uses (int_scores8 lane for lane).
static inline float int_score1(const QuantizedQueries& Q, int64_t i, const int8_t* k, float dk, int64_t E) {
  return static_cast<float>(int_dot(Q.row(i), k, E)) * Q.d[i] * dk;
}

// A value's weight: p, times the value's scale over an int8 cache (At::scaled), applied identically by every path so
// the numbers do not depend on which path ran. (A key's scale: int_score1, int_scores8.)
template <typename At>
static inline float weight(const float* p, const At& at, int64_t s) {
  if constexpr (At::scaled) return p[s] * at.vs(s);
  return p[s];
}
#if LS_AVX2
template <typename At>
static inline __m256 key_scales8(const At& at, int64_t s) {
  if (at.scales_run8(s)) return _mm256_loadu_ps(reinterpret_cast<const float*>(at.k_scale(s)));
  return _mm256_setr_ps(at.ks(s), at.ks(s + 1), at.ks(s + 2), at.ks(s + 3), at.ks(s + 4), at.ks(s + 5), at.ks(s + 6),
                        at.ks(s + 7));
}
#endif

template <typename T>
static inline float dot(const float* q, const T* k, int64_t E) {
  int64_t i = 0;
  float s = 0.f;
#if LS_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= E; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
  s = hsum(acc);
#endif
  for (; i < E; ++i) s += q[i] * to_f(k[i]);
  return s;
}

template <typename T>
static inline void axpy(float a, const T* v, float* acc, int64_t E) {  // acc += a * v
  int64_t i = 0;
#if LS_AVX2
  const __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= E; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(av, load8(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < E; ++i) acc[i] += a * to_f(v[i]);
}

#if LS_AVX2
// 8 vectors -> one vector of their 8 horizontal sums (lane j = sum of a[j])
static inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // (a0 a1 a2 a3 | same, upper halves)
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#if LS_AVX2
// 8 vectors of int32 -> one vector of their 8 horizontal sums (lane j = sum of a[j]); exact, so any order would do
[[gnu::always_inline]] static inline __m256i hsum8x8i(const __m256i* a) {
  const __m256i t0 = _mm256_hadd_epi32(a[0], a[1]), t1 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i t2 = _mm256_hadd_epi32(a[4], a[5]), t3 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

#if LS_ZMM
// Four vectors t[p] of two keys' 8 partial sums each (key 2p in lanes 0-7, 2p + 1 in 8-15) -> the 8 keys' sums
[[gnu::always_inline]] static inline __m256i hsum_key_pairs(const __m512i* t) {
  // 128-bit chunks: keys 0-3 (4 partial sums each) and keys 4-7
  const __m512i u0 = _mm512_add_epi32(_mm512_shuffle_i32x4(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i u1 = _mm512_add_epi32(_mm512_shuffle_i32x4(t[2], t[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(t[2], t[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // chunk c: (key c, key c + 4, key c, key c + 4) partial pairs, then whole sums in lanes 0 and 1
  const __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi32(u0, u1), _mm512_unpackhi_epi32(u0, u1));
  const __m512i w = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, w));
}
#endif

// out[u] lane j := Q's query i + u . the quants of position s + j, exactly, for NQ queries and 8 keys. Each key is
// loaded once for the NQ queries. With VNNI the key's quants are read as unsigned (x ^ 0x80 = k + 128: vpdpbusd
// multiplies unsigned by signed bytes) and the query's 128 * sum(q) taken off after; AVX2 alone multiplies |k| by q
// given k's sign (vpmaddubsw), or for a head size of 16s alone widens both to int16 (vpmaddwd); a head size the
// vectors do not divide, one key at a time. All give the same integers. LS_INT8_KV_WIDEN (a build define that only
// benchmarks/int8_kv_dot.py sets) makes an AVX2-alone build take the widening form for head sizes of 32s too: the
// A/B of the two forms on one host.
template <int NQ, typename At>
[[gnu::always_inline]] static inline void int_products8(const QuantizedQueries& Q, int64_t i, int64_t s, int64_t E, const At& at, __m256i* out) {
  const int8_t* k[8];
  for (int j = 0; j < 8; ++j) k[j] = at.k(s + j);
#if LS_ZMM
  if (E % 64 == 0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i t[NQ][4];
    for (int p = 0; p < 4; ++p) {
      __m512i a0[NQ], a1[NQ];
      for (int u = 0; u < NQ; ++u) a0[u] = a1[u] = _mm512_setzero_si512();
      for (int64_t e = 0; e < E; e += 64) {
        const __m512i k0 = _mm512_xor_si512(_mm512_loadu_si512(k[2 * p] + e), flip);
        const __m512i k1 = _mm512_xor_si512(_mm512_loadu_si512(k[2 * p + 1] + e), flip);
        for (int u = 0; u < NQ; ++u) {
          const __m512i qv = _mm512_loadu_si512(Q.row(i + u) + e);
          a0[u] = _mm512_dpbusd_epi32(a0[u], k0, qv);
          a1[u] = _mm512_dpbusd_epi32(a1[u], k1, qv);
        }
      }
      for (int u = 0; u < NQ; ++u)  // (lower half of key 2p's lanes + upper) | (the same of key 2p + 1's)
        t[u][p] = _mm512_add_epi32(_mm512_shuffle_i64x2(a0[u], a1[u], 0x44), _mm512_shuffle_i64x2(a0[u], a1[u], 0xEE));
    }
    for (int u = 0; u < NQ; ++u) out[u] = _mm256_sub_epi32(hsum_key_pairs(t[u]), _mm256_set1_epi32(Q.offset[i + u]));
    return;
  }
#endif
  __m256i d[NQ][8];
#if LS_VNNI
  if (E % 32 == 0) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j) {
      __m256i a[NQ];
      for (int u = 0; u < NQ; ++u) a[u] = _mm256_setzero_si256();
      for (int64_t e = 0; e < E; e += 32) {
        const __m256i kv = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[j] + e)), flip);
        for (int u = 0; u < NQ; ++u)
          a[u] = LS_DPBUSD(a[u], kv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Q.row(i + u) + e)));
      }
      for (int u = 0; u < NQ; ++u) d[u][j] = a[u];
    }
    for (int u = 0; u < NQ; ++u) out[u] = _mm256_sub_epi32(hsum8x8i(d[u]), _mm256_set1_epi32(Q.offset[i + u]));
    return;
  }
#elif !defined(LS_INT8_KV_WIDEN)
  if (E % 32 == 0) {  // AVX2 alone, 32 bytes at a time: |k| times q with k's sign (vpmaddubsw), as ggml's q8_0 dot
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 8; ++j) {
      __m256i a[NQ];
      for (int u = 0; u < NQ; ++u) a[u] = _mm256_setzero_si256();
      for (int64_t e = 0; e < E; e += 32) {
        const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[j] + e));
        const __m256i ak = _mm256_sign_epi8(kv, kv);  // |k| <= 127, read as unsigned
        for (int u = 0; u < NQ; ++u) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Q.row(i + u) + e));
          // pairs |k| q sign(k) + the next: at most 2 * 127 * 127 < 2^15, so vpmaddubsw never saturates
          const __m256i pairs = _mm256_maddubs_epi16(ak, _mm256_sign_epi8(qv, kv));
          a[u] = _mm256_add_epi32(a[u], _mm256_madd_epi16(pairs, ones));
        }
      }
      for (int u = 0; u < NQ; ++u) d[u][j] = a[u];
    }
    for (int u = 0; u < NQ; ++u) out[u] = hsum8x8i(d[u]);
    return;
  }
#endif
  if (E % 16 == 0) {
    for (int j = 0; j < 8; ++j) {
      __m256i a[NQ];
      for (int u = 0; u < NQ; ++u) a[u] = _mm256_setzero_si256();
      for (int64_t e = 0; e < E; e += 16) {
        const __m256i kv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k[j] + e)));
        for (int u = 0; u < NQ; ++u) {
          const __m256i qv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Q.row(i + u) + e)));
          a[u] = _mm256_add_epi32(a[u], _mm256_madd_epi16(kv, qv));
        }
      }
      for (int u = 0; u < NQ; ++u) d[u][j] = a[u];
    }
    for (int u = 0; u < NQ; ++u) out[u] = hsum8x8i(d[u]);
    return;
  }
  for (int u = 0; u < NQ; ++u) {
    alignas(32) int32_t x[8];
    for (int j = 0; j < 8; ++j) x[j] = int_dot(Q.row(i + u), k[j], E);
    out[u] = _mm256_load_si256(reinterpret_cast<const __m256i*>(x));
  }
}

// Scores of positions s .. s+7 for queries i .. i + NQ - 1 over an int8 cache: float(q_q . k_q) d_q d_k, lane for
// lane int_score1's products in its order.
template <int NQ, typename At>
[[gnu::always_inline]] static inline void int_scores8(const QuantizedQueries& Q, int64_t i, int64_t s, int64_t E, const At& at, __m256* out) {
  __m256i d[NQ];
  int_products8<NQ>(Q, i, s, E, at, d);
  const __m256 ks = key_scales8(at, s);
  for (int u = 0; u < NQ; ++u)
    out[u] = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d[u]), _mm256_set1_ps(Q.d[i + u])), ks);
}
#endif

#if LS_AVX2
// acc (NV * 8) = sum_s p[s] v(s), the accumulator held in registers across positions (E = 64 and 128)
template <typename T, int NV, typename At>
static inline void pv_in_registers(const float* p, int64_t len, const At& at, float* out) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < len; ++s) {
    const __m256 ps = _mm256_set1_ps(weight(p, at, s));
    const T* v = at.v(s);
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(ps, load8(v + 8 * i), acc[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}
#endif

#if LS_AVX2
// The scores of positions s .. s+7 for one query: eight dot products over E, each lane order fixed, reduced
// together (hsum8x8). The one float order of a score, for a decode row alone and for a row in a tile.
template <typename T, typename At>
static inline __m256 score8(const float* q, int64_t s, int64_t E, const At& at) {
  __m256 d[8];
  for (int j = 0; j < 8; ++j) {
    const T* k = at.k(s + j);
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
    for (int64_t i = 8; i < E; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a);
    d[j] = a;
  }
  return hsum8x8(d);
}
#endif

#if LS_AVX2
// Register tiles of attend_tile: NQ queries against the same keys (or values) share each key's (value's) load, so
// the kernel does an FMA per load or better instead of two loads per FMA (score8 reloads q for every key). Where the
// build has 32 vector registers (AVX-512VL) a score tile holds 3 queries x 8 keys (24 accumulators) and a value
// tile 3 queries x 8 vectors of the output; with AVX2's 16, 3 queries x 4 keys (12 accumulators, each key's vector
// an FMA's memory operand) and 3 x 4 vectors. Each (query, key) product chain and each (query, output lane) sum is
// the one score8 / the position loop computes, in the same order: tiling shares loads, never arithmetic. (4 x 4
// tiles for a group of 4 queries, Llama 3's G, were no faster from cache and slower from memory: not kept; on AVX2,
// 3-query tiles beat 2-query ones on long prefills: docs/performance.md#long-prompts-against-llama-server.) A
// group's queries go in tiles of SQ (VQ), and what is left in tiles of 3, 2 or 1 (`in_tiles`).
#if LS_ZMM
// 512-bit tiles (below): a score tile holds 4 queries x 8 keys as 4 x 4 registers of two keys each, a value tile 4
// queries x 64 output lanes; the same arithmetic again, each 256-bit half of a register the chain above computes.
constexpr int SQ = 4, SK = 8, VQ = 4, VV = 8;
#elif defined(__AVX512VL__)
constexpr int SQ = 3, SK = 8, VQ = 3, VV = 8;
#else
constexpr int SQ = 3, SK = 4, VQ = 3, VV = 4;
#endif

// Queries [i, qb) of a group in register tiles: f(std::integral_constant<int, n>) for each tile of n queries from i,
// whole tiles of N where what is left then still tiles, else a tile of 3 (three left: the default model's G = 3
// under 4-query tiles, whose third query ran alone, one key's latency-bound chain at a time) or of 2 (a tile of 3
// would leave one query of four to run alone: a decode row of Llama's G = 4 under 3-query tiles, two tiles of 2);
// and a query left alone a tile of its own (independent chains for its 8 keys, where score8 runs one key's chain at
// a time: an MHA model's every decode query, a GQA group's odd one).
template <int N, typename F>
static inline void in_tiles(int64_t& i, int64_t qb, F&& f) {
  while (qb - i >= 1) {
    const int64_t left = qb - i;
    if (left == N || left >= N + 2) {
      f(std::integral_constant<int, N>{});
      i += N;
    } else if (left == 3) {
      f(std::integral_constant<int, 3>{});
      i += 3;
    } else if (left >= 2) {
      f(std::integral_constant<int, 2>{});
      i += 2;
    } else {
      f(std::integral_constant<int, 1>{});
      i += 1;
    }
  }
}

// d[i][j0 + j] := score8's per-key lane sums of query i (q + i * E) and position s + j0 + j, j < NK
template <typename R, int NQ, int NK, typename At>
static inline void key_products(const float* q, int64_t s, int64_t E, const At& at, int j0, __m256 (&d)[NQ][8]) {
  const R* k[NK];
  for (int j = 0; j < NK; ++j) k[j] = at.k(s + j0 + j);
  __m256 a[NQ][NK];
  __m256 qv[NQ];
  for (int i = 0; i < NQ; ++i) qv[i] = _mm256_loadu_ps(q + i * E);
  for (int j = 0; j < NK; ++j) {
    const __m256 kv = load8(k[j]);
    for (int i = 0; i < NQ; ++i) a[i][j] = _mm256_mul_ps(qv[i], kv);
  }
  for (int64_t e = 8; e < E; e += 8) {
    for (int i = 0; i < NQ; ++i) qv[i] = _mm256_loadu_ps(q + i * E + e);
    for (int j = 0; j < NK; ++j) {
      const __m256 kv = load8(k[j] + e);
      for (int i = 0; i < NQ; ++i) a[i][j] = _mm256_fmadd_ps(qv[i], kv, a[i][j]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NK; ++j) d[i][j0 + j] = a[i][j];
}

#if LS_ZMM
// key_products of all 8 keys with 512-bit FMAs: register (i, p) holds query i's lane sums of keys 2p (its lower half)
// and 2p + 1 (its upper half), each half the chain key_products computes, the query's 8 elements in both halves.
// Half the FMAs for the same products (the AVX-512 units take 16 lanes an instruction); d as key_products leaves it.
template <typename R, int NQ, typename At>
static inline void key_products16(const float* q, int64_t s, int64_t E, const At& at, __m256 (&d)[NQ][8]) {
  const R* k[8];
  for (int j = 0; j < 8; ++j) k[j] = at.k(s + j);
  __m512 a[NQ][4];
  __m512 qv[NQ];
  for (int i = 0; i < NQ; ++i) qv[i] = twice8(_mm256_loadu_ps(q + i * E));
  for (int p = 0; p < 4; ++p) {
    const __m512 kv = load8x2(k[2 * p], k[2 * p + 1]);
    for (int i = 0; i < NQ; ++i) a[i][p] = _mm512_mul_ps(qv[i], kv);
  }
  for (int64_t e = 8; e < E; e += 8) {
    for (int i = 0; i < NQ; ++i) qv[i] = twice8(_mm256_loadu_ps(q + i * E + e));
    for (int p = 0; p < 4; ++p) {
      const __m512 kv = load8x2(k[2 * p] + e, k[2 * p + 1] + e);
      for (int i = 0; i < NQ; ++i) a[i][p] = _mm512_fmadd_ps(qv[i], kv, a[i][p]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int p = 0; p < 4; ++p) {
      d[i][2 * p] = lower8(a[i][p]);
      d[i][2 * p + 1] = upper8(a[i][p]);
    }
}
#endif

// Asks for the key (or value) row of position s, if s < end, into L2 ahead of its use. A head's rows are E elements out
// of every K * E, in blocks that lie anywhere in the pool, and the hardware prefetchers alone held one decode row's
// attention from memory to a fraction of its speed from cache. prefetcht1 64 positions ahead read best in
// benchmarks/attention_memory.py (prefetcht0 at 16-256 ahead read less;
// docs/performance.md#long-prompts-against-llama-server). An int8 row's scale is asked for too (its line: the scales of
// a few positions of the block). Always inlined: GCC left the int8 instantiation out of line, a call per position. A
// prefetch changes no number. An asm statement, not _mm_prefetch: GCC 12 deletes a __builtin_prefetch whose address
// needs a load (here the block table's entry), and the object code had none.
template <typename At>
[[gnu::always_inline]] static inline void prefetch_row(const At& at, int64_t s, int64_t end, int64_t E, bool keys) {
  if (s >= end) return;
  const char* row = reinterpret_cast<const char*>(keys ? at.k(s) : at.v(s));
  const int64_t bytes = E * static_cast<int64_t>(sizeof(*at.k(0)));
  for (int64_t off = 0; off < bytes; off += 64) asm volatile("prefetcht1 %0" : : "m"(row[off]));
  if constexpr (At::scaled) asm volatile("prefetcht1 %0" : : "m"(*(keys ? at.k_scale(s) : at.v_scale(s))));
}
constexpr int64_t PREFETCH_POSITIONS = 64;  // how far ahead of its use a row is asked for

// Scores of positions s .. s+7 for NQ queries (q + i * E): out[i] = score8(q + i * E, s, E, at), bitwise.
template <typename R, int NQ, int NK, typename At>
static inline void score8_tile(const float* q, int64_t s, int64_t E, const At& at, __m256* out) {
  __m256 d[NQ][8];
#if LS_ZMM
  key_products16<R, NQ>(q, s, E, at, d);
#else
  for (int j0 = 0; j0 < 8; j0 += NK) key_products<R, NQ, NK>(q, s, E, at, j0, d);
#endif
  for (int i = 0; i < NQ; ++i) out[i] = hsum8x8(d[i]);
}

// Queries [i, i + NQ) (len, sc rows of ld, running max mv): their scores of the groups of 8 in [b0, b1) that all
// of them have, by register tiles (tile(s, v): the NQ queries' scores of positions s .. s+7 into v); done[i + u] :=
// where that stopped.
template <int NQ, typename At, typename Tile>
static inline void score_tiles(const int64_t* len, int64_t i, int64_t b0, int64_t b1, int64_t E, const At& rows,
                               float* sc, int64_t ld, __m256* mv, int64_t* done, int64_t pf_end, Tile&& tile) {
  int64_t common = b1;
  for (int u = 0; u < NQ; ++u) common = std::min(common, len[i + u] / 8 * 8);
  for (int64_t s = b0; s < common; s += 8) {
    for (int j = 0; j < 8; ++j) prefetch_row(rows, s + PREFETCH_POSITIONS + j, pf_end, E, true);
    __m256 v[NQ];
    tile(s, v);
    for (int u = 0; u < NQ; ++u) {
      _mm256_storeu_ps(sc + (i + u) * ld + s, v[u]);
      mv[i + u] = _mm256_max_ps(mv[i + u], v[u]);
    }
  }
  for (int u = 0; u < NQ; ++u) done[i + u] = std::max(b0, common);
}

// acc[i] (E) += p[i][s] v(s) for s in [s0, s1), output lanes [e0, e0 + 8 NV), for NQ queries: per query and lane the
// position loop's FMAs in order (a value tile loads each value vector once for its NQ queries).
template <int NQ, int NV, typename At>
static inline void values_tile(const float* const* p, float* const* acc, int64_t s0, int64_t s1, int64_t e0, const At& at,
                               int64_t pf_end, int64_t E) {
#if LS_ZMM  // NV / 2 registers of 16 lanes per query: each lane's FMAs as below, in the same order
  constexpr int NW = NV / 2;
  __m512 w[NQ][NW];
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NW; ++v) w[i][v] = _mm512_loadu_ps(acc[i] + e0 + 16 * v);
  for (int64_t s = s0; s < s1; ++s) {
    prefetch_row(at, s + PREFETCH_POSITIONS, pf_end, E, false);
    const auto* vs = at.v(s) + e0;
    __m512 ps[NQ];
    for (int i = 0; i < NQ; ++i) ps[i] = _mm512_set1_ps(weight(p[i], at, s));
    for (int v = 0; v < NW; ++v) {
      const __m512 x = load16(vs + 16 * v);
      for (int i = 0; i < NQ; ++i) w[i][v] = _mm512_fmadd_ps(ps[i], x, w[i][v]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NW; ++v) _mm512_storeu_ps(acc[i] + e0 + 16 * v, w[i][v]);
#else
  __m256 r[NQ][NV];
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NV; ++v) r[i][v] = _mm256_loadu_ps(acc[i] + e0 + 8 * v);
  for (int64_t s = s0; s < s1; ++s) {
    prefetch_row(at, s + PREFETCH_POSITIONS, pf_end, E, false);  // the whole row (E), in the first lane pass
    const auto* vs = at.v(s) + e0;
    __m256 ps[NQ];
    for (int i = 0; i < NQ; ++i) ps[i] = _mm256_set1_ps(weight(p[i], at, s));
    for (int v = 0; v < NV; ++v) {
      const __m256 x = load8(vs + 8 * v);
      for (int i = 0; i < NQ; ++i) r[i][v] = _mm256_fmadd_ps(ps[i], x, r[i][v]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc[i] + e0 + 8 * v, r[i][v]);
#endif
}

// Queries [i, i + NQ) (probabilities in sc rows of ld, outputs in acc rows of E): acc += p[s] v(s) over the positions
// of [b0, b1) that all of them have, by value tiles of NV vectors; done[i + u] := where that stopped.
template <int NQ, int NV, typename At>
static inline void value_tiles(const float* sc, int64_t ld, float* acc, const int64_t* len, int64_t i, int64_t b0,
                               int64_t b1, int64_t E, const At& rows, int64_t* done, int64_t pf_end) {
  int64_t common = b1;
  const float* p[NQ];
  float* a[NQ];
  for (int u = 0; u < NQ; ++u) {
    common = std::min(common, len[i + u]);
    p[u] = sc + (i + u) * ld;
    a[u] = acc + (i + u) * E;
  }
  if (common > b0)
    for (int64_t e0 = 0; e0 < E; e0 += 8 * NV) values_tile<NQ, NV>(p, a, b0, common, e0, rows, e0 == 0 ? pf_end : 0, E);
  for (int u = 0; u < NQ; ++u) done[i + u] = std::max(b0, common);
}
#endif

// A query's scores from `first` on (a sliding window's first; 0: every score, as exp_and_sum asks):
// sc[s] := exp(sc[s] - mx) for s in [first, len) and 0 for s in [a, first), a = first rounded down to 8, the group
// holding `first` through the vector exp with its lanes below `first` zeroed; -> the sum over [a, len), 8-lane groups
// in order, then the tail. A function of (first, len) and the scores alone, whatever positions below `a` its tile
// computed.
static inline float exp_and_sum_window(float* sc, int64_t first, int64_t len, float mx) {
  int64_t s = first / 8 * 8;
  float sum = 0.f;
#if LS_AVX2
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  if (s < first && s + 8 <= len) {
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(s)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(first) - 1)));
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + s), m8)), keep);
    _mm256_storeu_ps(sc + s, e);
    sv = _mm256_add_ps(sv, e);
    s += 8;
  }
#if LS_ZMM
  const __m512 m16 = _mm512_set1_ps(mx);
  for (; s + 16 <= len; s += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + s), m16));
    _mm512_storeu_ps(sc + s, e);
    sv = _mm256_add_ps(_mm256_add_ps(sv, lower8(e)), upper8(e));
  }
#endif
  for (; s + 8 <= len; s += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + s), m8));
    _mm256_storeu_ps(sc + s, e);
    sv = _mm256_add_ps(sv, e);
  }
  sum = hsum(sv);
#endif
  for (; s < len; ++s) {
    sc[s] = s < first ? 0.f : std::exp(sc[s] - mx);
    sum += sc[s];
  }
  return sum;
}

// sc[s] := exp(sc[s] - mx) for s < len; -> their sum (8 lanes, then the tail in order): one order for every caller.
static inline float exp_and_sum(float* sc, int64_t len, float mx) { return exp_and_sum_window(sc, 0, len, mx); }

// The first position a query at context length `len` attends to under a sliding `window` (0: none): keys at
// positions <= p - window are not attended (transformers' `sliding_window_overlay`, p = len - 1).
static inline int64_t window_first(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

// One query head of one decode row over its context: scores (len) in `sc`, output (E) in `o`.
// k_at(s) / v_at(s): the pool row (of type C) of position s for this head's KV head. On return sc holds
// exp(score - max) and the function returns their sum, so sc[s] / sum is the softmax the output was weighted by
// (the telemetry reads it). `first`: a sliding window's first position (window_first); sc is 0 below it.
template <typename T, typename C, typename At>
static float attend_span(const float* q, int64_t len, int64_t E, At at, float* sc, T* o, std::vector<float>& acc);

template <typename At>
struct From {  // positions counted from `first`: a window's span as a context of its own
  At at;
  int64_t first;
  static constexpr bool scaled = At::scaled;
  auto k(int64_t s) const { return at.k(s + first); }
  auto v(int64_t s) const { return at.v(s + first); }
  float ks(int64_t s) const { return at.ks(s + first); }
  float vs(int64_t s) const { return at.vs(s + first); }
  const char* k_scale(int64_t s) const { return at.k_scale(s + first); }
  const char* v_scale(int64_t s) const { return at.v_scale(s + first); }
  bool scales_run8(int64_t s) const { return at.scales_run8(s + first); }
};

template <typename T, typename C, typename At>
static float attend_head(const float* q, int64_t first, int64_t len, int64_t E, At at, float* sc, T* o, std::vector<float>& acc) {
  if (first == 0) return attend_span<T, C>(q, len, E, at, sc, o, acc);
  const float sum = attend_span<T, C>(q, len - first, E, From<At>{at, first}, sc + first, o, acc);
  std::fill(sc, sc + first, 0.f);
  return sum;
}

template <typename T, typename C, typename At>
static float attend_span(const float* q, int64_t len, int64_t E, At at, float* sc, T* o, std::vector<float>& acc) {
  int64_t s = 0;
  float mx = -INFINITY;
  if constexpr (At::scaled) {  // an int8 cache: the query rounded once, integer products (as attend_tile)
    QuantizedQueries qi;
    qi.quantize(q, 1, E);
    for (; s < len; ++s) {
      sc[s] = int_score1(qi, 0, at.k(s), at.ks(s), E);
      mx = std::max(mx, sc[s]);
    }
  } else {
#if LS_AVX2
    if (E % 8 == 0) {
      __m256 mv = _mm256_set1_ps(-INFINITY);
      for (; s + 8 <= len; s += 8) {  // eight positions' dot products at a time, reduced together
        const __m256 v = score8<C>(q, s, E, at);
        _mm256_storeu_ps(sc + s, v);
        mv = _mm256_max_ps(mv, v);
      }
      mx = hmax(mv);
    }
#endif
    for (; s < len; ++s) {
      sc[s] = dot(q, at.k(s), E);
      mx = std::max(mx, sc[s]);
    }
  }
  const float sum = exp_and_sum(sc, len, mx);
  std::fill(acc.begin(), acc.begin() + E, 0.f);
#if LS_AVX2
  if (E == 64)
    pv_in_registers<C, 8>(sc, len, at, acc.data());
  else if (E == 128)
    pv_in_registers<C, 16>(sc, len, at, acc.data());
  else
#endif
    for (s = 0; s < len; ++s) axpy(weight(sc, at, s), at.v(s), acc.data(), E);
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < E; ++i) o[i] = from_f<T>(acc[i] * inv);
  return sum;
}

// Position s -> (block s / bs, row s % bs) by a shift and a mask where bs is a power of two (the default 16): a
// division by a block size known only at run time is a hardware divide per key, as costly as the key's dot product.
struct BlockOf {
  int64_t bs;
  int shift;  // log2(bs), or -1 where bs is not a power of two
  explicit BlockOf(int64_t b) : bs(b), shift((b & (b - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(b)) : -1) {}
  int64_t block(int64_t s) const { return shift >= 0 ? s >> shift : s / bs; }
  int64_t row(int64_t s) const { return shift >= 0 ? s & (bs - 1) : s % bs; }
};

template <typename T>
struct PoolRows {  // position s of one sequence, one KV head -> its K and V rows (and an int8 row's scale) in the pool
  const T* kp;
  const T* vp;
  const int64_t* table;
  BlockOf bo;
  // a block's elements; a position's stride and the head's offset in it: K * E and the KV head * E, or (an int8
  // cache's (head, position)-ordered rows, ops.h kv_slot) E and the KV head * bs * E
  int64_t block, stride, head;
  int64_t scales, sstride, shead;  // int8 (ops.h kv_slot): a block's scales at bs * K * E, bs * 4 a head, 4 a position
  static constexpr bool scaled = std::is_same_v<T, int8_t>;  // an int8 cache: rows have scales
  static PoolRows of(const T* kp, const T* vp, const int64_t* table, int64_t bs, int64_t K, int64_t kh, int64_t E) {
    if constexpr (scaled) return PoolRows{kp, vp, table, BlockOf(bs), bs * K * (E + 4), E, kh * bs * E, bs * K * E, 4, kh * bs * 4};
    return PoolRows{kp, vp, table, BlockOf(bs), bs * K * E, K * E, kh * E, 0, 0, 0};
  }
  // always inlined: called per position in the innermost loops, and where GCC chose not to (the int8 cache's
  // instantiations, whose scales call it once more per key and value) each call went through the PLT
  [[gnu::always_inline]] int64_t at(int64_t s) const { return table[bo.block(s)] * block + bo.row(s) * stride + head; }
  [[gnu::always_inline]] int64_t scale_at(int64_t s) const {
    return table[bo.block(s)] * block + scales + bo.row(s) * sstride + shead;
  }
  [[gnu::always_inline]] const T* k(int64_t s) const { return kp + at(s); }
  [[gnu::always_inline]] const T* v(int64_t s) const { return vp + at(s); }
  [[gnu::always_inline]] const char* k_scale(int64_t s) const { return reinterpret_cast<const char*>(kp + scale_at(s)); }
  [[gnu::always_inline]] const char* v_scale(int64_t s) const { return reinterpret_cast<const char*>(vp + scale_at(s)); }
  [[gnu::always_inline]] float ks(int64_t s) const {
    if constexpr (scaled) return load_scale(k_scale(s));
    return 1.f;
  }
  [[gnu::always_inline]] float vs(int64_t s) const {
    if constexpr (scaled) return load_scale(v_scale(s));
    return 1.f;
  }
  // whether positions s .. s + 7 have their scales in one run of 8 floats: they share a block (s a multiple of 8 and
  // the block's positions too), whose scales are (head, position)-ordered (ops.h kv_slot)
  [[gnu::always_inline]] bool scales_run8(int64_t s) const { return scaled && (s & 7) == 0 && (bo.bs & 7) == 0; }
};

#if LS_AVX2
template <typename At>
struct Widened {  // a block's rows widened to float32: position s (in [b0, b0 + BS)) -> its row; scales: src's
  const float* rows;
  int64_t b0, E;
  const At* src;
  static constexpr bool scaled = At::scaled;
  const float* k(int64_t s) const { return rows + (s - b0) * E; }
  const float* v(int64_t s) const { return rows + (s - b0) * E; }
  float ks(int64_t s) const { return src->ks(s); }
  float vs(int64_t s) const { return src->vs(s); }
  const char* k_scale(int64_t s) const { return src->k_scale(s); }
  const char* v_scale(int64_t s) const { return src->v_scale(s); }
  bool scales_run8(int64_t s) const { return src->scales_run8(s); }
};
template <typename X> struct IsWidened : std::false_type {};
template <typename At> struct IsWidened<Widened<At>> : std::true_type {};
#endif

#if LS_AVX2
// Several queries of one sequence against its keys, in groups that each read one KV head (the G query heads that
// share it, over up to TILE_ROWS rows of a prefill chunk): FlashAttention's point (Dao et al. 2022) that a key block
// is read from memory once per query tile, not once per query, without its arithmetic: every query's scores, max,
// exponentials, sum and weighted values are computed by exactly the operations `attend_head` does, in the same
// order (8-key groups then the scalar tail; the values accumulated position by position), only interleaved with
// the other queries' at the granularity of a block of positions. So a row's output is bitwise the same alone
// (decode) or in a tile (prefill), whatever its neighbours. The groups walk the positions together, block by block,
// so a thread reads its KV heads' parts of each pool row side by side rather than one head's E elements out of
// every K * E at a time (without the prefetch below, walking 8 heads one at a time read a fraction of what
// walking a pool of one head did; with it, the grouping's own share was not measured apart). qf (Qn, E) scaled
// queries; len (Qn,); first (Qn,) a sliding window's first position per query (window_first; 0: none); group
// (NG + 1,): queries [group[g], group[g + 1]) read `at[g]`; sc (Qn, ld) scores -> exp(score - max), sums (Qn,) their
// sums; acc (Qn, E) the unnormalised outputs.
//
// Under a sliding window a group's queries walk the positions from the earliest one's first rounded down to 8
// (`glo`): the keys no query of the group attends to are never read (their blocks may be back in the pool). A query
// whose own first is later gets scores there too, which its max ignores (taken over [first, len) alone), its sum
// never adds (exp_and_sum_window) and its values weigh by 0 (finite keys and values times 0 add nothing): its
// output is the same alone or in any tile.
// `Windowed` (a compile-time switch: the plain tile is the code it was before windows, instruction for instruction):
// some query's first is above 0.
template <bool Windowed, typename T, typename At>
static void attend_tile(const float* qf, const int64_t* len, const int64_t* first, int64_t Qn, int64_t E, const At* at,
                        const int64_t* group, int64_t NG, float* sc, int64_t ld, float* sums, float* acc) {
  const int64_t BS = E <= 64 ? 64 : 32;  // positions per block: its K (or V) rows stay in L1 across the tile's queries
  int64_t lmax = 0, lo = INT64_MAX;
  std::vector<int64_t> glen(NG, 0), glo(Windowed ? NG : 0, INT64_MAX);  // per group: its longest query, its first key
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t i = group[g]; i < group[g + 1]; ++i) {
      glen[g] = std::max(glen[g], len[i]);
      if constexpr (Windowed) glo[g] = std::min(glo[g], first[i] / 8 * 8);
    }
  for (int64_t g = 0; g < NG; ++g) {
    lmax = std::max(lmax, glen[g]);
    if constexpr (Windowed) lo = std::min(lo, glo[g]);
  }
  const int64_t b_first = Windowed ? lo / BS * BS : 0;  // the first block of positions any query reads
  // where group g's positions of the block at bb start (a window's first, rounded down to 8), and whether it has any
  const auto from = [&](int64_t g, int64_t bb) -> int64_t {
    if constexpr (Windowed) return std::max(bb, glo[g]);
    return bb;
  };
  const auto skips = [&](int64_t g, int64_t bb, int64_t b0) {
    if constexpr (Windowed) return b0 >= glen[g] || b0 >= bb + BS;
    return bb >= glen[g];
  };
  // A 16-bit or int8 cache (T not float) under a prefill tile: each block's key, then value, rows are widened once
  // into `wide` for all the group's queries (up to TILE_ROWS x G) instead of once per query; a decode row's G <= 4
  // queries widen on load as attend_head does (the scratch's store and reload cost more there). Widening is exact
  // (an int8 row's scale stays apart, applied where the unwidened rows apply it), so the numbers, and the
  // arithmetic on them, are the same either way. An int8 cache's keys are not widened (integer scores).
  const auto widens = [&](int64_t g) { return !std::is_same_v<T, float> && group[g + 1] - group[g] > 4; };
  std::vector<float> wide(std::is_same_v<T, float> ? 0 : BS * E);
  // rows [b0, b1) -> over `wide`, asking for the rows PREFETCH_POSITIONS ahead (below end): unasked, the widening's
  // loads waited on memory for a third of the kernel's time (perf, an AVX2 host, a 1B prefill chunk over 16k positions)
  const auto widened = [&](const At& rows, int64_t b0, int64_t b1, bool keys, int64_t end) {
    for (int64_t s = b0; s < b1; ++s) {
      prefetch_row(rows, s + PREFETCH_POSITIONS, end, E, keys);
      const T* src = keys ? rows.k(s) : rows.v(s);
      float* dst = wide.data() + (s - b0) * E;
      int64_t e = 0;
      for (; e + 8 <= E; e += 8) _mm256_storeu_ps(dst + e, load8(src + e));
      for (; e < E; ++e) dst[e] = to_f(src[e]);
    }
    return Widened<At>{wide.data(), b0, E, &rows};
  };
  QuantizedQueries qi;  // an int8 cache's queries, rounded once for every key they score
  if constexpr (std::is_same_v<T, int8_t>) qi.quantize(qf, Qn, E);
  std::vector<__m256> mv(Qn, _mm256_set1_ps(-INFINITY));
  std::vector<float> tail_max(Qn, -INFINITY);
  std::vector<int64_t> done(Qn);  // per query: where a block's register tiles stopped (its own loop goes on from there)
  // queries [qa, qb): their scores of positions [b0, bb + BS), bb = the block's start, b0 >= bb (a window's first)
  const auto scores = [&](int64_t bb, int64_t b0, int64_t qa, int64_t qb, const auto& rows) {
    using R = std::remove_cv_t<std::remove_pointer_t<decltype(rows.k(0))>>;
    constexpr bool ints = std::is_same_v<R, int8_t>;  // an int8 cache: integer products (QuantizedQueries)
    const int64_t b1 = bb + BS;
    const int64_t pf = IsWidened<std::decay_t<decltype(rows)>>::value ? 0 : len[qa];  // positions to prefetch
    int64_t i = qa;
    in_tiles<SQ>(i, qb, [&](auto n) {  // the first tile of the group asks for the rows ahead
      constexpr int NQ = decltype(n)::value;
      score_tiles<NQ>(len, i, b0, b1, E, rows, sc, ld, mv.data(), done.data(), i == qa ? pf : 0,
                      [&](int64_t s, __m256* v) {
                        if constexpr (ints)
                          int_scores8<NQ>(qi, i, s, E, rows, v);
                        else
                          score8_tile<R, NQ, SK>(qf + i * E, s, E, rows, v);
                      });
    });
    for (; i < qb; ++i) done[i] = b0;
    for (i = qa; i < qb; ++i) {
      const int64_t L = len[i], vec_end = L / 8 * 8;  // groups of 8 while s + 8 <= L, as attend_head
      if (b0 >= L) continue;
      const float* q = qf + i * E;
      float* si = sc + i * ld;
      for (int64_t s = done[i]; s < std::min(b1, vec_end); s += 8) {
        if (i == qa)  // a group too small for a tile: its first query asks for the keys
          for (int j = 0; j < 8; ++j) prefetch_row(rows, s + PREFETCH_POSITIONS + j, pf, E, true);
        __m256 v;
        if constexpr (ints)
          int_scores8<1>(qi, i, s, E, rows, &v);
        else
          v = score8<R>(q, s, E, rows);
        _mm256_storeu_ps(si + s, v);
        mv[i] = _mm256_max_ps(mv[i], v);
      }
      for (int64_t s = std::max(b0, vec_end); s < std::min(b1, L); ++s) {
        if constexpr (ints)
          si[s] = int_score1(qi, i, rows.k(s), rows.ks(s), E);
        else
          si[s] = dot(q, rows.k(s), E);
        tail_max[i] = std::max(tail_max[i], si[s]);
      }
    }
  };
  for (int64_t bb = b_first; bb < lmax; bb += BS)
    for (int64_t g = 0; g < NG; ++g) {
      const int64_t b0 = from(g, bb);
      if (skips(g, bb, b0)) continue;
      if constexpr (std::is_same_v<T, int8_t>)  // an int8 cache's keys are scored as stored (integer products)
        scores(bb, b0, group[g], group[g + 1], at[g]);
      else if (widens(g))
        scores(bb, b0, group[g], group[g + 1], widened(at[g], b0, std::min(bb + BS, glen[g]), true, glen[g]));
      else
        scores(bb, b0, group[g], group[g + 1], at[g]);
    }
  if constexpr (!Windowed) {
    for (int64_t i = 0; i < Qn; ++i) sums[i] = exp_and_sum(sc + i * ld, len[i], std::max(hmax(mv[i]), tail_max[i]));
  } else {
    for (int64_t g = 0; g < NG; ++g)
      for (int64_t i = group[g]; i < group[g + 1]; ++i) {
        float* si = sc + i * ld;
        float mx = -INFINITY;
        for (int64_t s = first[i]; s < len[i]; ++s) mx = std::max(mx, si[s]);
        sums[i] = exp_and_sum_window(si, first[i], len[i], mx);
        std::fill(si + glo[g], si + first[i] / 8 * 8, 0.f);  // the group's positions this query does not attend to
      }
  }
  std::fill(acc, acc + Qn * E, 0.f);
  const int64_t NV = E / 8;
  // queries [qa, qb): acc += p[s] v(s) for positions [b0, bb + BS), position by position (as axpy)
  const auto values = [&](int64_t bb, int64_t b0, int64_t qa, int64_t qb, const auto& rows) {
    const int64_t pf = IsWidened<std::decay_t<decltype(rows)>>::value ? 0 : len[qa];  // positions to prefetch
    int64_t i = qa;
    if (E % (8 * VV) == 0)
      in_tiles<VQ>(i, qb, [&](auto n) {
        value_tiles<decltype(n)::value, VV>(sc, ld, acc, len, i, b0, bb + BS, E, rows, done.data(), i == qa ? pf : 0);
      });
    for (; i < qb; ++i) done[i] = b0;
    for (i = qa; i < qb; ++i) {
      const int64_t end = std::min(bb + BS, len[i]);
      const float* p = sc + i * ld;
      float* a = acc + i * E;
      if (E == 64) {
        __m256 r[8];
        for (int v = 0; v < 8; ++v) r[v] = _mm256_loadu_ps(a + 8 * v);
        for (int64_t s = done[i]; s < end; ++s) {
          if (i == qa) prefetch_row(rows, s + PREFETCH_POSITIONS, pf, E, false);
          const __m256 ps = _mm256_set1_ps(weight(p, rows, s));
          const auto* vs = rows.v(s);
          for (int v = 0; v < 8; ++v) r[v] = _mm256_fmadd_ps(ps, load8(vs + 8 * v), r[v]);
        }
        for (int v = 0; v < 8; ++v) _mm256_storeu_ps(a + 8 * v, r[v]);
      } else {
        for (int64_t s = done[i]; s < end; ++s) {
          const __m256 ps = _mm256_set1_ps(weight(p, rows, s));
          const auto* vs = rows.v(s);
          for (int64_t v = 0; v < NV; ++v) _mm256_storeu_ps(a + 8 * v, _mm256_fmadd_ps(ps, load8(vs + 8 * v), _mm256_loadu_ps(a + 8 * v)));
        }
      }
    }
  };
  for (int64_t bb = b_first; bb < lmax; bb += BS)
    for (int64_t g = 0; g < NG; ++g) {
      const int64_t b0 = from(g, bb);
      if (skips(g, bb, b0)) continue;
      if (widens(g))
        values(bb, b0, group[g], group[g + 1], widened(at[g], b0, std::min(bb + BS, glen[g]), false, glen[g]));
      else
        values(bb, b0, group[g], group[g + 1], at[g]);
    }
}
#endif

// Rows of a prefill chunk attend over the same sequence's blocks: up to this many share a tile. Each tile reads its
// KV head's whole history once, so 16 rows read it half as often as 8 did (`benchmarks.prefill_attention` against
// a build with 8: docs/performance.md#long-prompts-against-llama-server); 32 was no better than 16 and holds twice
// the scores: TILE_ROWS x G x the context x 4 bytes a thread, 4 MB at 16k.
constexpr int64_t TILE_ROWS = 16;

// q (N, H, E) packed rows (token stride q_stride); k_pool, v_pool (NB, bs, K, E); rows (R,) which packed rows are
// decode rows; tables (R, W) their block ids; lens (R,) their context lengths; out (N, H, E): rows `rows` are
// written. Task idx = (row, query head): tasks [begin, end). `tel`: where the rows that asked for it record their
// softmax (attention_telemetry.h); null: nobody asked. Consecutive rows with the same block table (one sequence's
// prefill chunk) run as one tile (`attend_tile`), its queries grouped by KV head; a task's result is the same
// in any tile or alone, so neither the split between threads nor the neighbours change it. `window`: the model's
// sliding window (0: none; window_first); `scale`: the attention scale (0: 1/sqrt(E), else Granite's multiplier).
template <typename T, typename C>
static void decode_range(const T* q, int64_t q_stride, const C* kp, const C* vp, const int64_t* rows, const int64_t* tables,
                         const int64_t* lens, T* out, int64_t W, int64_t H, int64_t K, int64_t E, int64_t bs,
                         int64_t begin, int64_t end, const Telemetry* tel, int64_t window, double scale_) {
  const int64_t G = H / K;
  const float scale = scale_ > 0 ? static_cast<float>(scale_) : 1.f / std::sqrt(static_cast<float>(E));
#if LS_AVX2
  if (E % 8 == 0) {
    std::vector<float> qf, sc, acc, sums;
    std::vector<int64_t> qlen, qfirst, qtask, group{0};  // group: the tile's queries by KV head (attend_tile)
    std::vector<PoolRows<C>> ats;
    int64_t lmax = 0;
    for (int64_t idx = begin; idx < end;) {
      const int64_t r0 = idx / H, r_last = (end - 1) / H;
      int64_t r1 = r0 + 1;
      while (r1 <= r_last && r1 - r0 < TILE_ROWS && std::memcmp(tables + r1 * W, tables + r0 * W, W * sizeof(int64_t)) == 0) ++r1;
      const int64_t t_end = std::min(end, r1 * H);
      // One row's queries (a decode row) run as one tile over every KV head, block by block (attend_tile says why);
      // a prefill chunk's rows, one tile per KV head: up to TILE_ROWS x G queries share each key there, and their
      // scores (TILE_ROWS x G x the context) stay in cache between the scores' pass and the values'.
      const auto run = [&]() {  // the queries gathered so far, then a fresh tile
        const int64_t Qn = static_cast<int64_t>(qtask.size()), ld = std::max<int64_t>(lmax, 1);
        if (Qn > 0) {
          qf.resize(Qn * E);
          sc.resize(Qn * ld);
          acc.resize(Qn * E);
          sums.resize(Qn);
          for (int64_t i = 0; i < Qn; ++i) {
            const int64_t r = qtask[i] / H, h = qtask[i] % H;
            for (int64_t e = 0; e < E; ++e) qf[i * E + e] = to_f(q[rows[r] * q_stride + h * E + e]) * scale;
          }
          const bool windowed = std::any_of(qfirst.begin(), qfirst.end(), [](int64_t f) { return f > 0; });
          (windowed ? attend_tile<true, C, PoolRows<C>> : attend_tile<false, C, PoolRows<C>>)(
              qf.data(), qlen.data(), qfirst.data(), Qn, E, ats.data(), group.data(), static_cast<int64_t>(ats.size()),
              sc.data(), ld, sums.data(), acc.data());
          for (int64_t i = 0; i < Qn; ++i) {
            const int64_t r = qtask[i] / H, h = qtask[i] % H;
            T* o = out + (rows[r] * H + h) * E;
            const float inv = 1.f / sums[i];
            for (int64_t e = 0; e < E; ++e) o[e] = from_f<T>(acc[i * E + e] * inv);
            if (tel != nullptr && tel->slot[r] >= 0) {
              std::fill(sc.data() + i * ld, sc.data() + i * ld + qfirst[i] / 8 * 8, 0.f);  // keys it did not see
              tel->record(tel->slot[r], h, sc.data() + i * ld, qlen[i], sums[i]);
            }
          }
        }
        qtask.clear();
        qlen.clear();
        qfirst.clear();
        group.assign(1, 0);
        ats.clear();
        lmax = 0;
      };
      for (int64_t kh = 0; kh < K; ++kh) {  // the tile's queries, grouped by the KV head they read
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t h = kh * G; h < (kh + 1) * G; ++h)
            if (r * H + h >= idx && r * H + h < t_end) {
              qtask.push_back(r * H + h);
              qlen.push_back(lens[r]);
              qfirst.push_back(window_first(lens[r], window));
              lmax = std::max(lmax, lens[r]);
            }
        if (static_cast<int64_t>(qtask.size()) > group.back()) {
          group.push_back(static_cast<int64_t>(qtask.size()));
          ats.push_back(PoolRows<C>::of(kp, vp, tables + r0 * W, bs, K, kh, E));
        }
        if (r1 - r0 > 1) run();
      }
      run();
      idx = t_end;
    }
    return;
  }
#endif
  std::vector<float> qf(E), acc(E), scores;
  for (int64_t idx = begin; idx < end; ++idx) {
    const int64_t r = idx / H, h = idx % H, row = rows[r], len = lens[r];
    for (int64_t i = 0; i < E; ++i) qf[i] = to_f(q[row * q_stride + h * E + i]) * scale;
    scores.resize(len);
    const auto at = PoolRows<C>::of(kp, vp, tables + r * W, bs, K, h / G, E);
    const float sum = attend_head<T, C>(qf.data(), window_first(len, window), len, E, at, scores.data(),
                                        out + (row * H + h) * E, acc);
    if (tel != nullptr && tel->slot[r] >= 0) tel->record(tel->slot[r], h, scores.data(), len, sum);
  }
}

// One task per (row, query head): the 2-16 tasks of a small batch spread over every thread.
template <typename T, typename C>
static void decode_impl(const T* q, int64_t q_stride, const C* kp, const C* vp, const int64_t* rows, const int64_t* tables,
                        const int64_t* lens, T* out, int64_t R, int64_t W, int64_t H, int64_t K, int64_t E,
                        int64_t bs, const Telemetry* tel, int64_t window, double scale) {
  parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    decode_range<T, C>(q, q_stride, kp, vp, rows, tables, lens, out, W, H, K, E, bs, begin, end, tel, window, scale);
  });
}

// Calls f(T*, C*) with q's and the pools' element types: (float32, float32), (bfloat16, bfloat16), or float32
// activations over a 16-bit cache (float16, bfloat16) or an int8 one.
template <typename F>
static void with_types(ScalarType q, ScalarType pool, const char* who, F&& f) {
  if (q == kFloat && pool == kFloat)
    f(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (q == kBFloat16 && pool == kBFloat16)
    f(static_cast<bf16*>(nullptr), static_cast<bf16*>(nullptr));
  else if (q == kFloat && pool == kHalf)
    f(static_cast<float*>(nullptr), static_cast<f16*>(nullptr));
  else if (q == kFloat && pool == kBFloat16)
    f(static_cast<float*>(nullptr), static_cast<bf16*>(nullptr));
  else if (q == kFloat && pool == kChar)
    f(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
  else
    LS_CHECK(false, who, ": activations and cache float32/float32, bfloat16/bfloat16 or float32 over a 16-bit or int8 cache");
}

static void decode_dispatch(const View& q, const View& k_pool, const View& v_pool,
                            const View& rows, const View& tables, const View& lens,
                            const View& out, const Telemetry* tel, int64_t window, double scale) {
  LS_CHECK(window >= 0, "paged_decode_attention: window >= 0");
  LS_CHECK(q.stride(-1) == 1 && q.stride(-2) == q.size(-1) && k_pool.is_contiguous() && v_pool.is_contiguous() && out.is_contiguous(), "paged_decode_attention: contiguous");
  LS_CHECK(rows.scalar_type() == kLong && tables.scalar_type() == kLong && lens.scalar_type() == kLong, "paged_decode_attention: int64 metadata");
  LS_CHECK(tables.is_contiguous() && tables.dim() == 2 && rows.numel() == tables.size(0) && lens.numel() == tables.size(0), "paged_decode_attention: metadata shapes");
  const int64_t E = q.size(-1), H = q.size(-2), bs = k_pool.size(1), K = k_pool.size(2);
  LS_CHECK(k_pool.size(3) == kv_row_width(k_pool.scalar_type(), E) && H % K == 0 && k_pool.scalar_type() == v_pool.scalar_type() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "paged_decode_attention: shapes");
  const int64_t q_stride = q.stride(-3);  // q may be a view into the fused q/k/v output
  const int64_t R = tables.size(0), W = tables.size(1);
  with_types(q.scalar_type(), k_pool.scalar_type(), "paged_decode_attention", [&](auto* t, auto* c) {
    using T = std::remove_pointer_t<decltype(t)>;
    using C = std::remove_pointer_t<decltype(c)>;
    decode_impl<T, C>(q.data_ptr<T>(), q_stride, k_pool.data_ptr<C>(), v_pool.data_ptr<C>(), rows.data_ptr<int64_t>(),
                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), R, W, H, K, E, bs, tel,
                      window, scale);
  });
}

void paged_decode_attention(const View& q, const View& k_pool, const View& v_pool,
                            const View& rows, const View& tables, const View& lens,
                            const View& out, int64_t window, double scale) {
  decode_dispatch(q, k_pool, v_pool, rows, tables, lens, out, nullptr, window, scale);
}

// The same attention, and for the rows with slot[r] >= 0 what their softmax put where (attention_telemetry.h).
void paged_decode_attention_telemetry(const View& q, const View& k_pool, const View& v_pool,
                                      const View& rows, const View& tables, const View& lens,
                                      const View& out, const View& slot, const View& sink_len,
                                      const View& sink_mass, const View& top_pos, const View& top_prob,
                                      int64_t window, double scale) {
  const Telemetry tel = Telemetry::of(slot, sink_len, sink_mass, top_pos, top_prob, q.size(-2), tables.size(0));
  decode_dispatch(q, k_pool, v_pool, rows, tables, lens, out, &tel, window, scale);
}

void paged_attention_range(const View& q, const View& k_pool, const View& v_pool,
                           const View& rows, const View& tables, const View& lens,
                           const View& out, int64_t begin, int64_t end, const Telemetry* tel, int64_t window,
                           double scale) {
  const int64_t E = q.size(-1), H = q.size(-2), bs = k_pool.size(1), K = k_pool.size(2), W = tables.size(1);
  with_types(q.scalar_type(), k_pool.scalar_type(), "step_layers", [&](auto* t, auto* c) {
    using T = std::remove_pointer_t<decltype(t)>;
    using C = std::remove_pointer_t<decltype(c)>;
    decode_range<T, C>(q.data_ptr<T>(), q.stride(-3), k_pool.data_ptr<C>(), v_pool.data_ptr<C>(), rows.data_ptr<int64_t>(),
                       tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), W, H, K, E, bs, begin, end, tel,
                       window, scale);
  });
}

// Row `src` (n values of T) into a pool row of type `pool` at `dst`: copied, rounded once to a 16-bit cache, or
// quantized to an int8 one (n quants at dst.row, their float32 scale at dst.scale: kv_slot; round_row_int8, as the
// PyTorch path's writer, so either stores the same bytes).
template <typename T>
void store_kv_row(const KVSlot& dst, ScalarType pool, const T* src, int64_t n) {
  if (pool == dtype_of<T>()) {
    std::memcpy(dst.row, src, n * sizeof(T));
  } else if (pool == kChar) {
    const float d = round_row_int8(src, n, reinterpret_cast<int8_t*>(dst.row));
    std::memcpy(dst.scale, &d, sizeof d);
  } else if (pool == kHalf) {
    f16* d = reinterpret_cast<f16*>(dst.row);
    for (int64_t i = 0; i < n; ++i) d[i] = from_f<f16>(to_f(src[i]));
  } else {
    LS_CHECK(pool == kBFloat16, "paged_write: a float32, float16, bfloat16 or int8 cache");
    bf16* d = reinterpret_cast<bf16*>(dst.row);
    for (int64_t i = 0; i < n; ++i) d[i] = from_f<bf16>(to_f(src[i]));
  }
}
template void store_kv_row<float>(const KVSlot&, ScalarType, const float*, int64_t);
template void store_kv_row<bf16>(const KVSlot&, ScalarType, const bf16*, int64_t);

// Write this step's K and V into their pool slots.   k, v (N, K, E) (views into the fused q/k/v output);
// pools (NB, bs, K, E) (E + 4 for int8: kv_slot), slot = block * bs + offset; slots (N,)
void paged_write(const View& k, const View& v, const View& k_pool, const View& v_pool,
                 const View& slots) {
  LS_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "paged_write: k, v (N, K, E)");
  const int64_t N = slots.numel(), Kh = k.size(1), E = k.size(2), KE = Kh * E;
  LS_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && slots.scalar_type() == kLong && slots.is_contiguous(), "paged_write: pools and slots");
  LS_CHECK(k.scalar_type() == v.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(), "paged_write: dtype");
  LS_CHECK(k.size(0) == N && k_pool.dim() == 4 && k_pool.size(2) == Kh && k_pool.size(3) == kv_row_width(k_pool.scalar_type(), E) && v_pool.sizes() == k_pool.sizes(), "paged_write: shapes");
  const int64_t n_slots = k_pool.size(0) * k_pool.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) LS_CHECK(s[n] >= 0 && s[n] < n_slots, "paged_write: slot out of range");
  // k and v are strided views into the fused q/k/v output: copy each token's (K, E) rows, which are contiguous
  // (torch's reshape to (N, K E) is then a view); others are gathered into a contiguous copy first, as reshape would.
  std::vector<char> kcopy, vcopy;
  const auto token_rows = [&](const View& x, std::vector<char>& copy, int64_t& stride) -> char* {
    if ((Kh == 1 || x.stride(1) == E * x.stride(2)) && (KE == 1 || x.stride(2) == 1)) {
      stride = x.stride(0);
      return static_cast<char*>(x.data_ptr());
    }
    const int64_t el = x.element_size();
    copy.resize(N * KE * el);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < Kh; ++h)
        for (int64_t e = 0; e < E; ++e)
          std::memcpy(copy.data() + ((n * Kh + h) * E + e) * el,
                      static_cast<const char*>(x.data_ptr()) + (n * x.stride(0) + h * x.stride(1) + e * x.stride(2)) * el, el);
    stride = KE;
    return copy.data();
  };
  int64_t ks, vs;
  char* const kc = token_rows(k, kcopy, ks);
  char* const vc = token_rows(v, vcopy, vs);
  if (k.scalar_type() != k_pool.scalar_type()) {  // float32 rows into a 16-bit or int8 cache: rounded once, here
    LS_CHECK(k.scalar_type() == kFloat, "paged_write: only float32 rows go into a cache of another dtype");
    const float *kd = reinterpret_cast<const float*>(kc), *vd = reinterpret_cast<const float*>(vc);
    // a 16-bit token's K E values at once; an int8 cache's head by head, each row with its own scale
    const ScalarType t = k_pool.scalar_type();
    const int64_t heads = t == kChar ? Kh : 1, n_el = KE / heads, bs = k_pool.size(1);
    char* kp = static_cast<char*>(k_pool.data_ptr());
    char* vp = static_cast<char*>(v_pool.data_ptr());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < heads; ++h) {
        store_kv_row(kv_slot(kp, t, bs, heads, n_el, s[n], h), t, kd + n * ks + h * n_el, n_el);
        store_kv_row(kv_slot(vp, t, bs, heads, n_el, s[n], h), t, vd + n * vs + h * n_el, n_el);
      }
    return;
  }
  const size_t bytes = KE * k.element_size();
  char* kp = static_cast<char*>(k_pool.data_ptr());
  char* vp = static_cast<char*>(v_pool.data_ptr());
  const char* kd = kc;
  const char* vd = vc;
  const size_t el = k.element_size();
  for (int64_t n = 0; n < N; ++n) {
    std::memcpy(kp + s[n] * bytes, kd + n * ks * el, bytes);
    std::memcpy(vp + s[n] * bytes, vd + n * vs * el, bytes);
  }
}

}  // namespace ls
