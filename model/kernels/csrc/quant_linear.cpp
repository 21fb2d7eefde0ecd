// Weight-only quantized linear layers, y = x W^T with W read in its packed form, for any number of rows: decode's
// one row and prefill's hundreds run the same kernel, so a row's result never depends on its step (qgemm.h).
//
// As llama.cpp's CPU path does (ggml `quantize_row_q8_0` + `ggml_vec_dot_q4_1_q8_1` / `_q8_0_q8_0`), each row of
// x is first rounded to int8 in blocks of 32 with one float scale per block (dx = max|x| / 127), so a block's dot
// product is 32 int8 x int8 (or uint4 x int8) products summed exactly in integers by AVX2's maddubs, then scaled
// once. Many rows reuse each unpacked weight block from registers (the tiles of llamafile's tinyBLAS, Tunney 2024):
// prefill is a GEMM over the packed weights, never a float copy of them.
#include <vector>

#include "ops.h"
#include "qgemm.h"

namespace ls {

static inline float fp16_to_f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Where element j of block b lands in its row's int8 activations (QActs): pairs of blocks, nibble order for Int4.
static inline int64_t act_pos(int64_t b, int64_t j, QFormat fmt) {
  return fmt == QFormat::Int4 ? (b / 2) * 64 + (j % 2) * 32 + (b % 2) * 16 + j / 2 : b * QK + j;
}

template <typename T>
void quantize_act_row(const T* x, int64_t K, QFormat fmt, int8_t* q, float* dx, float* sx) {
  const int64_t nb = K / QK, nbp = padded_blocks(nb), bytes = act_row_bytes(nb);
  std::fill(q + nb * QK, q + bytes, int8_t(0));
  for (int64_t b = nb; b < nbp; ++b) dx[b] = sx[b] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const T* xb = x + b * QK;
#if LS_AVX2
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(xb + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    const float d = hmax(mx) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i iv[4];
    for (int i = 0; i < 4; ++i)
      iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    const int sum = _mm_cvtsi128_si32(s);
    // int32 -> int8 in k order (ggml's quantize_row_q8_0 packing: packs interleave the 128-bit lanes; undo it)
    const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
    __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (fmt == QFormat::Int8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), p8);
    } else {  // evens then odds within each 16-byte lane, then [evens 0-15 | evens 16-31 | odds 0-15 | odds 16-31]
      const __m256i deint = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                             0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
      p8 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p8, deint), 0xD8);
      int8_t* g = q + (b / 2) * 64 + (b % 2) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(g), _mm256_castsi256_si128(p8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(g + 32), _mm256_extracti128_si256(p8, 1));
    }
#else
    float amax = 0.f;
    for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(to_f(xb[j])));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int64_t j = 0; j < QK; ++j) {
      const int v = static_cast<int>(std::nearbyint(to_f(xb[j]) * id));
      q[act_pos(b, j, fmt)] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
  }
}
template void quantize_act_row<float>(const float*, int64_t, QFormat, int8_t*, float*, float*);
template void quantize_act_row<bf16>(const bf16*, int64_t, QFormat, int8_t*, float*, float*);

#if LS_AVX2
// One tile: rows m0 .. m0+MR of the activations times weight rows n0 .. n0+NR. Per output the float operations are,
// in order: acc = fma(float(p_g), [d dx of block 2g] x4 | [of 2g+1] x4, acc) for each pair of blocks g, then
// hsum(acc) (+ hsum of the min term for Int4); MR and NR change which loads are shared, nothing else.
template <QFormat F, int MR, int NR>
static inline void q_tile(const QWeight& w, const QActs& a, int64_t m0, int64_t n0, float* y, int64_t ldy) {
  const int64_t nb = w.K / QK, nbp = padded_blocks(nb), ng = (nb + 1) / 2;
  const int64_t wrow = F == QFormat::Int4 ? w.K / 2 : w.K, srow = F == QFormat::Int4 ? 2 * nbp : nbp;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  // which of the two block scales each int32 lane of a pair's dot product takes
  const __m256i idx = F == QFormat::Int4 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) : _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1);
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const bool pair = 2 * g + 1 < nb;
    for (int j = 0; j < NR; ++j) {
      const uint8_t* wp = w.data + (n0 + j) * wrow + g * (F == QFormat::Int4 ? 32 : 64);
      const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(w.scales + (n0 + j) * srow + 2 * g)));
      __m256i w0, w1;  // Int4: low and high nibbles of both blocks; Int8: |block 2g|, |block 2g+1|
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();  // Int8: the weights' signs
      if (F == QFormat::Int4) {
        const __m256i raw = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp))
                                 : _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)), 0);
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        w0 = _mm256_and_si256(raw, m4);
        w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      } else {
        s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
        s1 = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32)) : _mm256_setzero_si256();
        w0 = _mm256_sign_epi8(s0, s0);
        w1 = _mm256_sign_epi8(s1, s1);
      }
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = a.q + (m0 + i) * a.row_bytes + g * 64;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
        __m256i p;  // exact int32 partial sums: Int4 lanes 0-3 block 2g, 4-7 block 2g+1; Int8 lanes 0,1,4,5 / 2,3,6,7
#if LS_VNNI
        // AVX-VNNI's dpbusd: each int32 lane += its 4 u8 x s8 products, exactly: the very int32 sums of the
        // maddubs + madd pairs below (no intermediate saturates there either), one instruction instead of two.
        if (F == QFormat::Int4) {
          p = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w0, x0), w1, x1);
        } else {
          const __m256i p0 = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w0, _mm256_sign_epi8(x0, s0));
          const __m256i p1 = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w1, _mm256_sign_epi8(x1, s1));
          p = _mm256_hadd_epi32(p0, p1);
        }
#else
        if (F == QFormat::Int4) {
          // uint4 x int8 pairs summed to int16 (at most 4 * 15 * 127), then to int32
          p = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)), ones);
        } else {  // |w| as unsigned times x carrying w's sign (|w|, |x| <= 127: no int16 saturation)
          const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_sign_epi8(x0, s0)), ones);
          const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_sign_epi8(x1, s1)), ones);
          p = _mm256_hadd_epi32(p0, p1);
        }
#endif
        const __m128 dxs = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.dx + (m0 + i) * a.nbp + 2 * g)));
        const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(dw, dxs)), idx);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float out = hsum(acc[i][j]);
      if (F == QFormat::Int4) {  // + sum_b m_b sx_b, in 8 lanes over the blocks
        const uint16_t* mw = w.scales + (n0 + j) * srow + nbp;
        const float* sx = a.sx + (m0 + i) * a.nbp;
        __m256 macc = _mm256_setzero_ps();
        for (int64_t c = 0; c < nbp; c += 8)
          macc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + c))), _mm256_loadu_ps(sx + c), macc);
        out += hsum(macc);
      }
      y[(m0 + i) * ldy + n0 + j] = out;
    }
}

template <QFormat F, int MR>
static void q_rows(const QWeight& w, const QActs& a, int64_t m0, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  constexpr int NR = MR == 1 ? 8 : 2;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) q_tile<F, MR, NR>(w, a, m0, n, y, ldy);
  for (; n < n_end; ++n) q_tile<F, MR, 1>(w, a, m0, n, y, ldy);
}

template <QFormat F>
static void q_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  constexpr int64_t NB = 64;  // weight rows per pass over the activations: a few KB, kept in L1 across the rows
  for (int64_t nb0 = n_begin; nb0 < n_end; nb0 += NB) {
    const int64_t nb1 = std::min(n_end, nb0 + NB);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) q_rows<F, 4>(w, a, m, nb0, nb1, y, ldy);
    for (; m + 2 <= M; m += 2) q_rows<F, 2>(w, a, m, nb0, nb1, y, ldy);
    for (; m < M; ++m) q_rows<F, 1>(w, a, m, nb0, nb1, y, ldy);
  }
}
#else
// Scalar: the same sums (exact per block), the same order per output.
template <QFormat F>
static void q_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  const int64_t K = w.K, nb = K / QK, nbp = padded_blocks(nb);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n_begin; n < n_end; ++n) {
      const int8_t* xq = a.q + m * a.row_bytes;
      float acc = 0.f, macc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int s = 0;
        float d;
        if (F == QFormat::Int4) {
          const uint8_t* wb = w.data + n * (K / 2) + b * 16;
          for (int64_t j = 0; j < QK; ++j) s += ((wb[j / 2] >> (4 * (j % 2))) & 15) * xq[act_pos(b, j, F)];
          d = fp16_to_f(w.scales[n * 2 * nbp + b]);
          macc += fp16_to_f(w.scales[n * 2 * nbp + nbp + b]) * a.sx[m * a.nbp + b];
        } else {
          const int8_t* wb = reinterpret_cast<const int8_t*>(w.data) + n * K + b * QK;
          for (int64_t j = 0; j < QK; ++j) s += wb[j] * xq[act_pos(b, j, F)];
          d = fp16_to_f(w.scales[n * nbp + b]);
        }
        acc += static_cast<float>(s) * (d * a.dx[m * a.nbp + b]);
      }
      y[m * ldy + n] = acc + macc;
    }
}
#endif

void qgemm_range(const QWeight& w, const QActs& a, int64_t M, int64_t n_begin, int64_t n_end, float* y, int64_t ldy) {
  if (w.fmt == QFormat::Int4)
    q_range<QFormat::Int4>(w, a, M, n_begin, n_end, y, ldy);
  else
    q_range<QFormat::Int8>(w, a, M, n_begin, n_end, y, ldy);
}

// ---- the ops as Python calls them -------------------------------------------------------------------------------

// Output columns per parallel task: enough to amortize the task, few enough to split the smallest matrices.
constexpr int64_t GRAIN = 32;

static QWeight as_qweight(const torch::Tensor& data, const torch::Tensor& scales, QFormat fmt) {
  TORCH_CHECK(data.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf, "quantized weight: contiguous buffers, float16 scales");
  const int64_t N = data.size(0), K = fmt == QFormat::Int4 ? data.size(1) * 2 : data.size(1), nbp = padded_blocks(K / QK);
  TORCH_CHECK(K % QK == 0 && scales.numel() == N * nbp * (fmt == QFormat::Int4 ? 2 : 1), "quantized weight: shapes");
  TORCH_CHECK(data.scalar_type() == (fmt == QFormat::Int4 ? at::kByte : at::kChar), "quantized weight: dtype");
  return QWeight{fmt, static_cast<const uint8_t*>(data.data_ptr()), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), N, K};
}

QWeight qweight_of(const torch::Tensor& data, const torch::Tensor& scales) {
  return as_qweight(data, scales, data.scalar_type() == at::kByte ? QFormat::Int4 : QFormat::Int8);
}

// x (M, K) float32 or bfloat16 -> y (M, N) float32
static torch::Tensor quantized_linear(const torch::Tensor& x, const QWeight& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == w.K, "quantized linear: x (M, K) contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quantized linear: float32 or bfloat16 x");
  const int64_t M = x.size(0), K = w.K, nb = K / QK;
  std::vector<int8_t> q(M * act_row_bytes(nb));
  std::vector<float> dx(M * padded_blocks(nb)), sx(M * padded_blocks(nb));
  const QActs a{q.data(), dx.data(), sx.data(), act_row_bytes(nb), padded_blocks(nb)};
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (x.scalar_type() == at::kFloat)
        quantize_act_row(x.data_ptr<float>() + m * K, K, w.fmt, a.q + m * a.row_bytes, a.dx + m * a.nbp, a.sx + m * a.nbp);
      else
        quantize_act_row(x.data_ptr<bf16>() + m * K, K, w.fmt, a.q + m * a.row_bytes, a.dx + m * a.nbp, a.sx + m * a.nbp);
    }
  });
  auto y = torch::empty({M, w.N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.N, GRAIN, [&](int64_t begin, int64_t end) { qgemm_range(w, a, M, begin, end, yp, w.N); });
  return y;
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& scales) {
  return quantized_linear(x, as_qweight(nibbles, scales, QFormat::Int4));
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  return quantized_linear(x, as_qweight(w, scales, QFormat::Int8));
}

// x (M, K) -> what the kernels multiply: x rounded to int8 blocks and back to float (q dx), for tests and the
// PyTorch reference (`model.quantize.round_activations` computes the same).
torch::Tensor round_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) % QK == 0, "round_activations: x (M, K) float32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  std::vector<int8_t> q(act_row_bytes(nb));
  std::vector<float> dx(padded_blocks(nb)), sx(padded_blocks(nb));
  auto out = torch::empty_like(x);
  for (int64_t m = 0; m < M; ++m) {
    quantize_act_row(x.data_ptr<float>() + m * K, K, QFormat::Int8, q.data(), dx.data(), sx.data());
    for (int64_t k = 0; k < K; ++k) out.data_ptr<float>()[m * K + k] = static_cast<float>(q[k]) * dx[k / QK];
  }
  return out;
}

// The whole weight as float32 (the PyTorch fall-backs and tests): bitwise `Int4Linear.reference_dequantize` /
// `Int8Linear.reference_dequantize` (q * d + m and q * d, each product rounded before the sum).
torch::Tensor int4_dequantize(const torch::Tensor& nibbles, const torch::Tensor& scales) {
  const QWeight w = as_qweight(nibbles, scales, QFormat::Int4);
  const int64_t N = w.N, K = w.K, nb = K / QK, nbp = padded_blocks(nb);
  auto out = torch::empty({N, K}, nibbles.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const float d = fp16_to_f(w.scales[n * 2 * nbp + b]), m = fp16_to_f(w.scales[n * 2 * nbp + nbp + b]);
        const uint8_t* qb = w.data + n * (K / 2) + b * (QK / 2);
        float* ob = o + n * K + b * QK;
        for (int64_t i = 0; i < QK / 2; ++i) {
          ob[2 * i] = static_cast<float>(qb[i] & 15) * d + m;
          ob[2 * i + 1] = static_cast<float>(qb[i] >> 4) * d + m;
        }
      }
  });
  return out;
}

torch::Tensor int8_dequantize(const torch::Tensor& data, const torch::Tensor& scales) {
  const QWeight w = as_qweight(data, scales, QFormat::Int8);
  const int64_t N = w.N, K = w.K, nbp = padded_blocks(K / QK);
  auto out = torch::empty({N, K}, data.options().dtype(at::kFloat));
  const int8_t* q = reinterpret_cast<const int8_t*>(w.data);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k) o[n * K + k] = static_cast<float>(q[n * K + k]) * fp16_to_f(w.scales[n * nbp + k / QK]);
  });
  return out;
}

}  // namespace ls
