// A GGUF matrix's blocks -> the served int4 / int6 / int8 layouts (qgemm.h), on every thread, with no float copy of the
// matrix: what model/loaders/gguf_blocks.py's `matrix_layer` does in PyTorch a chunk at a time, in one pass.
//
// Block layouts: ggml `ggml-common.h`. Dequantization: ggml `ggml-quants.c` (`dequantize_row_q4_0` ..
// `dequantize_row_q6_K`) in the `gguf` package's order of float operations (`gguf.quants`: e.g. Q4_K's
// (d sc) q - dmin m, each product rounded), so a weight is the float `gguf.quants.dequantize` gives. Requantization
// to int8: `model.quantize.int8_blocks` (ggml's `quantize_row_q8_0_ref`). Every float operation is the one the PyTorch
// path performs, in its order (and, as every kernel here, built with -ffp-contract=off: no FMA contraction), so both
// paths write the same bytes (tested).
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "qgemm.h"

namespace ls {
namespace {

// ggml_type ids (ggml.h) of the types converted here
enum GgmlType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}
inline uint16_t f2h(float x) { return half_from_float(x); }  // round to nearest even, as torch's .to(float16)

int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  return 0;
}
int64_t block_weights(int64_t type) { return type >= Q4_K ? 256 : 32; }

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (`get_scale_min_k4`; gguf.quants.Q4_K.get_scale_min).
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    mn = s[j + 4] & 0x3F;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// A Q6_K block's 256 6-bit q (0..63, q - 32 the weight's multiple of its sub-scale) in weight order. ggml's order
// (`dequantize_row_q6_K`): byte l of half h's ql / qh holds weights 128h + l, + 32, + 64, + 96.
void q6_k_values(const uint8_t* blk, uint8_t* q) {
#if LS_AVX2
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {  // (16-bit shifts: what crosses a byte is masked off)
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const auto top = [&](int shift) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(e, shift), m2), 4); };
    const auto store = [&](int at, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 128 * h + at), v); };
    store(0, _mm256_or_si256(_mm256_and_si256(lo, m4), top(0)));
    store(32, _mm256_or_si256(_mm256_and_si256(hi, m4), top(2)));
    store(64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4), top(4)));
    store(96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m4), top(6)));
  }
#else
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t lo = blk[64 * h + l], hi = blk[64 * h + l + 32], e = blk[128 + 32 * h + l];
      q[128 * h + l] = (lo & 15) | ((e & 3) << 4);
      q[128 * h + l + 32] = (hi & 15) | (((e >> 2) & 3) << 4);
      q[128 * h + l + 64] = (lo >> 4) | (((e >> 4) & 3) << 4);
      q[128 * h + l + 96] = (hi >> 4) | (((e >> 6) & 3) << 4);
    }
#endif
}

// One block of `type` -> its weights as float32 (gguf.quants' dequantize_blocks, operation for operation).
void dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case Q4_0: {  // {f16 d; u8 qs[16]}: d (q - 8)
      const float d = h2f(b);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>((b[2 + i] & 15) - 8);
        y[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {  // {f16 d; f16 m; u8 qs[16]}: d q + m
      const float d = h2f(b), m = h2f(b + 2);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>(b[4 + i] & 15) + m;
        y[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
      }
      return;
    }
    case Q5_0:    // {f16 d; u8 qh[4]; u8 qs[16]}: d (q - 16), q's fifth bit from qh
    case Q5_1: {  // {f16 d; f16 m; u8 qh[4]; u8 qs[16]}: d q + m
      const bool one = type == Q5_1;
      const float d = h2f(b), m = one ? h2f(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int i = 0; i < 32; ++i) {
        const int q = ((i < 16 ? qs[i] & 15 : qs[i - 16] >> 4)) | (((qh >> i) & 1) << 4);
        y[i] = one ? d * static_cast<float>(q) + m : d * static_cast<float>(q - 16);
      }
      return;
    }
    case Q8_0: {  // {f16 d; i8 qs[32]}
      const float d = h2f(b);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
      return;
    }
    case Q4_K:    // {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}: (d sc) q - dmin m per sub-block of 32
    case Q5_K: {  // {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: q's fifth bit j of qh[k]
      const bool five = type == Q5_K;
      const float d = h2f(b), dmin = h2f(b + 2);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int j = 0; j < 8; ++j) {  // sub-block j: nibbles (j even: low, odd: high) of qs[32 (j / 2) + k]
        int sc, mn;
        scale_min_k4(b + 4, j, sc, mn);
        const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
        for (int k = 0; k < 32; ++k) {
          int q = (qs[32 * (j / 2) + k] >> (4 * (j % 2))) & 15;
          if (five) q |= ((qh[k] >> j) & 1) << 4;
          y[32 * j + k] = dl * static_cast<float>(q) - ml;
        }
      }
      return;
    }
    case Q6_K: {  // {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}: (d sc) (q - 32) per 16 weights
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = h2f(b + 208);
      uint8_t q[256];
      q6_k_values(b, q);
      for (int k = 0; k < 16; ++k) {
        const float dl = d * static_cast<float>(sc[k]);
        for (int i = 0; i < 16; ++i) y[16 * k + i] = dl * static_cast<float>(static_cast<int>(q[16 * k + i]) - 32);
      }
      return;
    }
  }
  LS_CHECK(false, "gguf_convert: unsupported type ", type);
}

// A row of K float32 weights -> int8 q and float16 d per block of 32 (`int8_blocks`: d = max|w| / 127, q = round
// half away from zero of w (1 / d)). With AVX2 eight weights a vector, each the scalar loop's float operations
// (max is exact in any order; vmaxps(|w|, m) keeps m for a NaN w, as std::max(m, NaN); a NaN x takes neither sign's
// mask: 0), so both write the same bytes (tests/model/test_gguf_kquants.py): the scalar loop took most of a
// Q4_K_M file's load (its Q6_K matrices).
void int8_blocks_row(const float* w, int64_t K, int8_t* q, uint16_t* d) {
#if LS_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f), half = _mm256_set1_ps(0.5f), top = _mm256_set1_ps(127.f);
  const __m256 zero = _mm256_setzero_ps();
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' 128-bit lane interleave
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* g = w + b * QK;
    __m256 v[4], m = zero;
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(g + 8 * j);
      m = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), m);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.f, inv = db > 0.f ? 1.f / db : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i qi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 x = _mm256_mul_ps(v[j], vinv);
      const __m256 r = _mm256_min_ps(_mm256_floor_ps(_mm256_add_ps(_mm256_andnot_ps(sign, x), half)), top);
      const __m256 pos = _mm256_cmp_ps(x, zero, _CMP_GT_OQ), neg = _mm256_cmp_ps(x, zero, _CMP_LT_OQ);
      qi[j] = _mm256_cvttps_epi32(_mm256_or_ps(_mm256_and_ps(pos, r), _mm256_and_ps(neg, _mm256_xor_ps(r, sign))));
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), _mm256_permutevar8x32_epi32(p, order));
    d[b] = f2h(db);
  }
#else
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* g = w + b * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(g[i]));
    const float db = amax / 127.f, inv = db > 0.f ? 1.f / db : 0.f;
    for (int i = 0; i < QK; ++i) {
      const float x = g[i] * inv;
      const float r = std::floor(std::fabs(x) + 0.5f);
      q[b * QK + i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, x > 0.f ? r : x < 0.f ? -r : 0.f)));
    }
    d[b] = f2h(db);
  }
#endif
}

// One Q4_K row into row j of its group of 8 in the int4 layout with Q4_K's own scales (qgemm.h), byte moves only:
// `ob` the group's data (nb blocks of 128 bytes: byte (p, j, t) = the row's nibble pair 4p + t of the block), `ks`
// the group's scales (K/256 of 80 halves: D, Dmin, sc bytes, mn bytes). Nibble pair i of sub-block s packs weights i
// and i + 16: nibble s % 2 of bytes i and 16 + i of qs[32 (s / 2) ..]. With SSE2 a sub-block's 16 pairs at once (a
// byte at a time, this loop took most of a Q4_K_M file's load).
void q4_k_row_own_scales(const uint8_t* row, int64_t K, int64_t j, uint8_t* ob, uint16_t* ks) {
  for (int64_t B = 0; B < K / 256; ++B) {
    const uint8_t* b = row + B * 144;
    uint16_t* k = ks + B * 80;
    std::memcpy(k + j, b, 2);
    std::memcpy(k + 8 + j, b + 2, 2);
    uint8_t* bytes = reinterpret_cast<uint8_t*>(k + 16);
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      scale_min_k4(b + 4, s, sc, mn);
      bytes[8 * s + j] = static_cast<uint8_t>(sc);
      bytes[64 + 8 * s + j] = static_cast<uint8_t>(mn);
    }
    for (int s = 0; s < 8; ++s) {
      const uint8_t* q = b + 16 + 32 * (s / 2);
      uint8_t* o = ob + (8 * B + s) * 128 + 4 * j;
      uint8_t pairs[16];
#if LS_AVX2
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)), m = _mm_set1_epi8(0x0F);
      const __m128i v = s % 2 == 0 ? _mm_or_si128(_mm_and_si128(lo, m), _mm_slli_epi16(_mm_and_si128(hi, m), 4))
                                   : _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), m), _mm_andnot_si128(m, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs), v);
#else
      const int sh = 4 * (s % 2);
      for (int i = 0; i < 16; ++i) pairs[i] = static_cast<uint8_t>(((q[i] >> sh) & 15) | (((q[16 + i] >> sh) & 15) << 4));
#endif
      for (int p = 0; p < 4; ++p) std::memcpy(o + 32 * p, pairs + 4 * p, 4);
    }
  }
}

// 32 q of one row (weights 32s ..) into row j of its int6 block `ob` (qgemm.h): byte (p, j, t) of the first 128 the
// low nibbles of weights 4p + t and 16 + 4p + t; byte (h, j, t) of the next 64 their top 2 bits, weights 8h + t and
// 16 + 8h + t in its low 4 bits, 8h + 4 + t and 16 + 8h + 4 + t in its high 4.
void int6_block_row(const uint8_t* q, int64_t j, uint8_t* ob) {
  uint8_t pairs[16], tops[16];
#if LS_AVX2
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
  const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs),
                   _mm_or_si128(_mm_and_si128(a, m4), _mm_slli_epi16(_mm_and_si128(c, m4), 4)));
  const __m128i t = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), m2),
                                 _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(c, 4), m2), 2));  // (16,) 4 bits each
  _mm_storeu_si128(reinterpret_cast<__m128i*>(tops), _mm_or_si128(t, _mm_slli_epi16(_mm_srli_si128(t, 4), 4)));
#else
  uint8_t t[20] = {};
  for (int i = 0; i < 16; ++i) {
    pairs[i] = (q[i] & 15) | ((q[16 + i] & 15) << 4);
    t[i] = (q[i] >> 4) | ((q[16 + i] >> 4) << 2);
  }
  for (int i = 0; i < 16; ++i) tops[i] = t[i] | (t[i + 4] << 4);  // (bytes 0-3 and 8-11 are the ones kept)
#endif
  for (int p = 0; p < 4; ++p) std::memcpy(ob + 32 * p + 4 * j, pairs + 4 * p, 4);
  std::memcpy(ob + 128 + 4 * j, tops, 4);
  std::memcpy(ob + 160 + 4 * j, tops + 8, 4);
}

// Q6_K blocks {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} -> the int6 layout (qgemm.h), exact: q, sc and d moved.
void convert_q6_k(const View& raw, const View& order, const View& data, const View& scales) {
  const int64_t N = raw.size(0), K = raw.size(1) / 210 * 256, nb = K / QK;
  LS_CHECK(raw.size(1) % 210 == 0 && data.size(1) == nb && data.size(0) * 8 >= N && scales.dim() == 3 &&
                  scales.size(0) == data.size(0) && scales.size(1) * 8 == nb && scales.size(2) == 8,
              "gguf_convert: int6 takes Q6_K rows, data (N'/8, nb, 208), scales (N'/8, nb/8, 8)");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  const int64_t* ord = order.numel() ? order.data_ptr<int64_t>() : nullptr;
  uint8_t* out = static_cast<uint8_t*>(data.data_ptr());
  uint16_t* sc = reinterpret_cast<uint16_t*>(scales.data_ptr<f16>());
  const int64_t rb = raw.size(1), groups = (N + 7) / 8;
  parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    uint8_t q[256];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t n = 8 * g + j;
        const uint8_t* row = n < N ? src + (ord ? ord[n] : n) * rb : nullptr;
        for (int64_t B = 0; B < K / 256; ++B) {
          const uint8_t* blk = row ? row + B * 210 : nullptr;
          if (blk) {
            q6_k_values(blk, q);
            std::memcpy(&sc[(g * (nb / 8) + B) * 8 + j], blk + 208, 2);
          } else {
            std::memset(q, 0, sizeof q);
            sc[(g * (nb / 8) + B) * 8 + j] = 0;
          }
          for (int s = 0; s < 8; ++s) {  // block b = 8B + s of the layout
            uint8_t* ob = out + (g * nb + 8 * B + s) * 208;
            int6_block_row(q + 32 * s, j, ob);
            ob[192 + j] = blk ? blk[192 + 2 * s] : 0;
            ob[200 + j] = blk ? blk[192 + 2 * s + 1] : 0;
          }
        }
      }
  });
}

}  // namespace

// raw (N, row bytes) uint8: the file's rows; order (N,) int64: which file row each output row reads (q/k
// un-permuted), or empty; data/scales: the layer's buffers (model/loaders/gguf_blocks.py `buffer_shapes`), int4
// (uint8 data, scales (N'/8, nb, S, 8), S = 1: symmetric), int6 (uint8 data (N'/8, nb, 208): Q6_K only) or int8
// (int8 data). Rows past N in the last group of 8 are written as zeros; whole groups past it are the caller's.
void gguf_convert(const View& raw, int64_t type, const View& order, const View& data,
                  const View& scales) {
  const int64_t bb = block_bytes(type), bw = block_weights(type);
  LS_CHECK(bb > 0, "gguf_convert: unsupported type ", type);
  LS_CHECK(raw.dim() == 2 && raw.is_contiguous() && raw.scalar_type() == kByte, "gguf_convert: raw (N, row bytes) uint8");
  LS_CHECK(data.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == kHalf, "gguf_convert: buffers");
  const int64_t N = raw.size(0), K = raw.size(1) / bb * bw, nb = K / QK;
  LS_CHECK(raw.size(1) % bb == 0 && data.size(1) == nb && data.size(0) * 8 >= N, "gguf_convert: shapes");
  LS_CHECK(order.numel() == 0 || (order.numel() == N && order.scalar_type() == kLong && order.is_contiguous()), "gguf_convert: order");
  const int64_t* ord = order.numel() ? order.data_ptr<int64_t>() : nullptr;
  for (int64_t n = 0; ord != nullptr && n < N; ++n) LS_CHECK(ord[n] >= 0 && ord[n] < N, "gguf_convert: order out of range");
  if (data.scalar_type() == kByte && data.dim() == 3 && data.size(2) == 208) {
    LS_CHECK(type == Q6_K, "gguf_convert: int6 takes Q6_K only");
    convert_q6_k(raw, order, data, scales);
    return;
  }
  const bool int4 = data.scalar_type() == kByte;
  LS_CHECK(int4 ? (type == Q4_0 || type == Q4_1 || type == Q4_K) && data.size(2) == 128 : data.scalar_type() == kChar && data.size(2) == 256,
              "gguf_convert: int4 takes Q4_0, Q4_1 and Q4_K; int6 Q6_K; int8 takes any type here");
  // int4 with Q4_K's own scales (qgemm.h): (N'/8, nb/8, 80), D and Dmin per 256 weights, sc and mn bytes per 32
  const bool kq = int4 && scales.dim() == 3 && scales.size(2) == 80;
  LS_CHECK(!kq || (type == Q4_K && scales.size(0) == data.size(0) && scales.size(1) * 8 == nb),
              "gguf_convert: Q4_K's scales layout holds Q4_K only, (N'/8, nb/8, 80)");
  LS_CHECK(kq || (scales.size(0) == data.size(0) && scales.size(1) == nb &&
                     (int4 ? scales.dim() == 4 && (scales.size(2) == 1 || scales.size(2) == 2) && scales.size(3) == 8
                           : scales.dim() == 3 && scales.size(2) == 8)),
              "gguf_convert: scales (N'/8, nb, S, 8) for int4, (N'/8, nb, 8) for int8");
  const int64_t S = int4 && !kq ? scales.size(2) : 1;
  LS_CHECK(!int4 || kq || S == 2 || type == Q4_0, "gguf_convert: the symmetric layout holds Q4_0 only");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* out = static_cast<uint8_t*>(data.data_ptr());
  uint16_t* sc = reinterpret_cast<uint16_t*>(scales.data_ptr<f16>());
  const int64_t rb = raw.size(1), groups = (N + 7) / 8;
  parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> w(K);
    std::vector<int8_t> q(K);
    std::vector<uint16_t> d(nb);
    std::vector<uint8_t> qs(16 * nb);  // int4: a row's groups, byte i = weight i | weight i + 16 << 4
    std::vector<float> dm(2 * nb);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t n = 8 * g + j;
        const uint8_t* row = n < N ? src + (ord ? ord[n] : n) * rb : nullptr;
        if (int4) {
          if (row == nullptr) {
            std::fill(qs.begin(), qs.end(), 0);
            std::fill(dm.begin(), dm.end(), 0.f);
            for (int64_t B = 0; kq && B < K / 256; ++B) {
              uint16_t* ks = sc + (g * (nb / 8) + B) * 80;
              ks[j] = ks[8 + j] = 0;
              for (int s = 0; s < 8; ++s) reinterpret_cast<uint8_t*>(ks + 16)[8 * s + j] = reinterpret_cast<uint8_t*>(ks + 16)[64 + 8 * s + j] = 0;
            }
          } else if (kq) {
            q4_k_row_own_scales(row, K, j, out + g * nb * 128, sc + g * (nb / 8) * 80);
            continue;
          } else if (type == Q4_K) {  // float16 d sc, -(dmin m) per 32 (where joined with another int4 layout)
            for (int64_t B = 0; B < K / 256; ++B) {
              const uint8_t* b = row + B * 144;
              const float dd = h2f(b), dmin = h2f(b + 2);
              for (int s = 0; s < 8; ++s) {  // sub-block s: nibble s % 2 of qs[32 (s / 2) + k]
                int scale, mn;
                scale_min_k4(b + 4, s, scale, mn);
                const int64_t grp = 8 * B + s;
                dm[2 * grp] = dd * static_cast<float>(scale);
                dm[2 * grp + 1] = -(dmin * static_cast<float>(mn));
                const uint8_t* src_q = b + 16 + 32 * (s / 2);
                const int sh = 4 * (s % 2);
                for (int i = 0; i < 16; ++i)
                  qs[16 * grp + i] = static_cast<uint8_t>(((src_q[i] >> sh) & 15) | (((src_q[16 + i] >> sh) & 15) << 4));
              }
            }
          } else {
            const int64_t head = type == Q4_0 ? 2 : 4;
            for (int64_t b = 0; b < nb; ++b) {
              const uint8_t* blk = row + b * bb;
              const float dd = h2f(blk);
              dm[2 * b] = dd;
              dm[2 * b + 1] = type == Q4_0 ? -8 * dd : h2f(blk + 2);
              std::memcpy(&qs[16 * b], blk + head, 16);
            }
          }
          for (int64_t b = 0; b < nb; ++b) {
            uint8_t* ob = out + (g * nb + b) * 128;  // byte (p, j, t) = qs[b, 4p + t]
            for (int p = 0; p < 4; ++p) std::memcpy(ob + 32 * p + 4 * j, &qs[16 * b + 4 * p], 4);
            if (kq) continue;  // (the zeros of a padding row's scales written above)
            uint16_t* sb = sc + (g * nb + b) * 8 * S;
            sb[j] = f2h(dm[2 * b]);
            if (S == 2) sb[8 + j] = f2h(dm[2 * b + 1]);
          }
        } else {
          if (row == nullptr) {
            std::fill(q.begin(), q.end(), 0);
            std::fill(d.begin(), d.end(), 0);
          } else if (type == Q8_0 || type == Q4_0) {  // exact: the file's q (Q4_0: q - 8) and d
            for (int64_t b = 0; b < nb; ++b) {
              const uint8_t* blk = row + b * bb;
              std::memcpy(&d[b], blk, 2);
              for (int i = 0; i < 32; ++i)
                q[b * QK + i] = type == Q8_0 ? static_cast<int8_t>(blk[2 + i])
                                             : static_cast<int8_t>((i < 16 ? blk[2 + i] & 15 : blk[2 + i - 16] >> 4) - 8);
            }
          } else {
            for (int64_t B = 0; B < K / bw; ++B) dequantize_block(type, row + B * bb, w.data() + B * bw);
            int8_blocks_row(w.data(), K, q.data(), d.data());
          }
          for (int64_t b = 0; b < nb; ++b) {
            int8_t* ob = reinterpret_cast<int8_t*>(out) + (g * nb + b) * 256;  // byte (c, j, t) = q[32b + 4c + t]
            for (int c = 0; c < 8; ++c) std::memcpy(ob + 32 * c + 4 * j, &q[b * QK + 4 * c], 4);
            sc[(g * nb + b) * 8 + j] = d[b];
          }
        }
      }
  });
}

}  // namespace ls
