// Weight-only quantized linear layers for few-row (decode) inputs, with the dequantization fused into the dot
// product: y = x W^T, W read once, in its packed form, per call.
//
// As llama.cpp's CPU path does (ggml `quantize_row_q8_0` + `ggml_vec_dot_q4_1_q8_1` / `_q8_0_q8_0`), each row of
// x is first rounded to int8 in blocks of 32 with one float scale per block (dx = max|x| / 127), so a block's dot
// product is 32 int8 x int8 (or uint4 x int8) products summed in integers by AVX2's maddubs, then scaled once.
//
// Weight formats (model/quantize.py):
//   int4  nibbles (N, K/2) uint8, byte i of a row = w[2i] | w[2i+1] << 4;  dm (N, K/32, 2) float16:
//         w[n, k] = q[n, k] * d[n, g] + m[n, g], g = k / 32   (GGUF Q4_1; Q4_0 is m = -8 d)
//   int8  w (N, K) int8, scales (N,) bfloat16: w[n, k] = q[n, k] * s[n]   (symmetric, per output channel)
#include <vector>

#include "ops.h"

namespace ls {

constexpr int64_t QK = 32;  // weights (and activations) per quantization block

// x (M, K) float32 -> qx (M, K) int8, and per block the pair (dx, sx): dx its scale, sx = dx * sum(qx in block).
// `interleaved`: within each block store x[2i] at i and x[2i+1] at 16 + i, the order of an int4 row's low and
// high nibbles, so the kernel pairs them without shuffling.
static void quantize_rows_q8(const float* x, int64_t M, int64_t K, bool interleaved, int8_t* qx, float* dsx) {
  const int64_t nb = K / QK;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      float amax = 0.f;
      for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = qx + m * K + b * QK;
      int sum = 0;
      for (int64_t j = 0; j < QK; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * id));
        q[interleaved ? (j % 2) * 16 + j / 2 : j] = static_cast<int8_t>(v);
        sum += v;
      }
      dsx[2 * (m * nb + b)] = d;
      dsx[2 * (m * nb + b) + 1] = d * static_cast<float>(sum);
    }
  }
}

static inline float fp16_to_f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

#if LS_AVX2
// 32 int4 weights (16 bytes, low nibbles = even k) times 32 int8 activations (interleaved order) -> 8 x int32
static inline __m256i q4_block_dot(const uint8_t* wq, const int8_t* qx) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq));
  const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
}
// (d, m) of a block as float16 pair times (dx, sx) -> (d dx, m sx) in lanes 0, 1
static inline __m128 q4_block_scales(const uint16_t* dm, const float* dsx) {
  const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(dm)));
  return _mm_mul_ps(dmf, _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dsx))));
}
#endif

// One int4 row (nb blocks) against one quantized activation row:
// sum_b d_b dx_b sum_j q_j qx_j + m_b sx_b. Two blocks per iteration on independent accumulators (the FMA chain's
// latency, not the loads, would otherwise bound it).
static inline float dot_q4_q8(const uint8_t* wq, const uint16_t* dm, const int8_t* qx, const float* dsx, int64_t nb) {
#if LS_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  __m128 macc = _mm_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m128 s0 = q4_block_scales(dm + 2 * b, dsx + 2 * b);
    const __m128 s1 = q4_block_scales(dm + 2 * b + 2, dsx + 2 * b + 2);
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_block_dot(wq + b * 16, qx + b * QK)), _mm256_broadcastss_ps(s0), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_block_dot(wq + b * 16 + 16, qx + b * QK + QK)), _mm256_broadcastss_ps(s1), acc1);
    macc = _mm_add_ps(macc, _mm_add_ps(s0, s1));
  }
  for (; b < nb; ++b) {
    const __m128 s0 = q4_block_scales(dm + 2 * b, dsx + 2 * b);
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_block_dot(wq + b * 16, qx + b * QK)), _mm256_broadcastss_ps(s0), acc0);
    macc = _mm_add_ps(macc, s0);
  }
  return hsum(_mm256_add_ps(acc0, acc1)) + _mm_cvtss_f32(_mm_shuffle_ps(macc, macc, 1));
#else
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int s = 0;
    for (int64_t i = 0; i < 16; ++i) {
      s += (wq[b * 16 + i] & 15) * qx[b * QK + i];
      s += (wq[b * 16 + i] >> 4) * qx[b * QK + 16 + i];
    }
    total += fp16_to_f(dm[2 * b]) * dsx[2 * b] * static_cast<float>(s) + fp16_to_f(dm[2 * b + 1]) * dsx[2 * b + 1];
  }
  return total;
#endif
}

#if LS_AVX2
static inline __m256i q8_block_dot(const int8_t* w, const int8_t* qx) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  // |w| as unsigned times x carrying w's sign: maddubs needs one unsigned operand (w is in [-127, 127])
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), _mm256_set1_epi16(1));
}
#endif

// One int8 row against one quantized activation row (before the row's scale): sum_b dx_b sum_j w_j qx_j.
static inline float dot_q8_q8(const int8_t* w, const int8_t* qx, const float* dsx, int64_t nb) {
#if LS_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_block_dot(w + b * QK, qx + b * QK)), _mm256_set1_ps(dsx[2 * b]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_block_dot(w + b * QK + QK, qx + b * QK + QK)), _mm256_set1_ps(dsx[2 * b + 2]), acc1);
  }
  for (; b < nb; ++b)
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_block_dot(w + b * QK, qx + b * QK)), _mm256_set1_ps(dsx[2 * b]), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
#else
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int s = 0;
    for (int64_t i = 0; i < QK; ++i) s += w[b * QK + i] * qx[b * QK + i];
    total += dsx[2 * b] * static_cast<float>(s);
  }
  return total;
#endif
}

// Output rows per parallel task: enough to amortize the task, few enough to split the smallest matrices in two.
constexpr int64_t GRAIN = 32;

// y (M, N) = x (M, K) W^T for a weight of N rows: x rounded to int8 blocks once (`interleaved` for int4 rows),
// then `dot(n, qx_m, dsx_m)` for every output row n and input row m, rows of W split across threads.
template <typename RowDot>
static torch::Tensor few_row_linear(const torch::Tensor& x, int64_t N, bool interleaved, const RowDot& dot) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  std::vector<int8_t> qx(M * K);
  std::vector<float> dsx(2 * M * nb);
  quantize_rows_q8(x.data_ptr<float>(), M, K, interleaved, qx.data(), dsx.data());
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot(n, qx.data() + m * K, dsx.data() + 2 * m * nb);
  });
  return y;
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& dm) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "int4_linear: x (M, K) float32 contiguous");
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.is_contiguous() && dm.scalar_type() == at::kHalf && dm.is_contiguous(), "int4_linear: weight buffers");
  const int64_t K = x.size(1), N = nibbles.size(0), nb = K / QK;
  TORCH_CHECK(K % QK == 0 && nibbles.size(1) * 2 == K && dm.numel() == N * nb * 2, "int4_linear: shapes");
  const uint8_t* wp = nibbles.data_ptr<uint8_t>();
  const uint16_t* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  return few_row_linear(x, N, true, [&](int64_t n, const int8_t* qx, const float* dsx) {
    return dot_q4_q8(wp + n * (K / 2), dmp + n * nb * 2, qx, dsx, nb);
  });
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "int8_linear: x (M, K) float32 contiguous");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && scales.scalar_type() == at::kBFloat16, "int8_linear: weight buffers");
  const int64_t K = x.size(1), N = w.size(0), nb = K / QK;
  TORCH_CHECK(K % QK == 0 && w.size(1) == K && scales.numel() == N, "int8_linear: shapes");
  const int8_t* wp = w.data_ptr<int8_t>();
  const bf16* sp = scales.data_ptr<bf16>();
  return few_row_linear(x, N, false, [&](int64_t n, const int8_t* qx, const float* dsx) {
    return to_f(sp[n]) * dot_q8_q8(wp + n * K, qx, dsx, nb);
  });
}

}  // namespace ls

namespace ls {

// The whole weight as float32, for the many-row path (dequantize + GEMM): one pass instead of PyTorch's unpack,
// stack, multiply and add over temporaries. Bitwise what `Int4Linear.dequantize` / `Int8Linear.dequantize`
// compute (q * d + m and q * s, each product rounded before the sum).
torch::Tensor int4_dequantize(const torch::Tensor& nibbles, const torch::Tensor& dm) {
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.is_contiguous() && dm.scalar_type() == at::kHalf && dm.is_contiguous(), "int4_dequantize: buffers");
  const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2, nb = K / QK;
  TORCH_CHECK(K % QK == 0 && dm.numel() == N * nb * 2, "int4_dequantize: shapes");
  auto out = torch::empty({N, K}, nibbles.options().dtype(at::kFloat));
  const uint8_t* q = nibbles.data_ptr<uint8_t>();
  const uint16_t* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const float d = fp16_to_f(dmp[(n * nb + b) * 2]), m = fp16_to_f(dmp[(n * nb + b) * 2 + 1]);
        const uint8_t* qb = q + n * (K / 2) + b * (QK / 2);
        float* ob = o + n * K + b * QK;
        for (int64_t i = 0; i < QK / 2; ++i) {
          ob[2 * i] = static_cast<float>(qb[i] & 15) * d + m;
          ob[2 * i + 1] = static_cast<float>(qb[i] >> 4) * d + m;
        }
      }
  });
  return out;
}

torch::Tensor int8_dequantize(const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && scales.scalar_type() == at::kBFloat16, "int8_dequantize: buffers");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(scales.numel() == N, "int8_dequantize: shapes");
  auto out = torch::empty({N, K}, w.options().dtype(at::kFloat));
  const int8_t* q = w.data_ptr<int8_t>();
  const bf16* s = scales.data_ptr<bf16>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float sn = to_f(s[n]);
      for (int64_t k = 0; k < K; ++k) o[n * K + k] = static_cast<float>(q[n * K + k]) * sn;
    }
  });
  return out;
}

}  // namespace ls
