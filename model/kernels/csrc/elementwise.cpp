// Fused elementwise ops of a LLaMA block: RMSNorm, SiLU-gated product, in-place RoPE.
// Each replaces a chain of 4-8 eager torch ops (and their temporaries) with one pass over the row, rounding the
// intermediates to the activation dtype where the torch chain does, so float32 agrees with it to rounding order
// and bfloat16 to one ulp.
#include "ops.h"
#include "simd.h"

namespace ls {

// RMSNorm (Zhang & Sennrich 2019) as model/transformer.py's RMSNorm: statistics in float32, the normalized row
// cast to the activation dtype, then the gain in that dtype.   x (M, D), w (D,) -> (M, D)
template <typename T>
void rms_norm_row(const T* xr, const T* w, T* orow, int64_t D, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#if LS_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) {
    __m256 v = load8(xr + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum(acc);
#endif
  for (; i < D; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  i = 0;
#if LS_AVX2
  const __m256 rv = _mm256_set1_ps(r);
  for (; i + 8 <= D; i += 8) {
    __m256 n = round_to8<T>(_mm256_mul_ps(load8(xr + i), rv));
    store8(orow + i, _mm256_mul_ps(load8(w + i), n));
  }
#endif
  for (; i < D; ++i) orow[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(xr[i]) * r));
}
template void rms_norm_row<float>(const float*, const float*, float*, int64_t, float);
template void rms_norm_row<bf16>(const bf16*, const bf16*, bf16*, int64_t, float);

template <typename T>
static void rms_norm_impl(const T* x, const T* w, T* out, int64_t M, int64_t D, float eps) {
  parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) rms_norm_row(x + m * D, w, out + m * D, D, eps);
  });
}

View rms_norm(const View& x, const View& w, double eps, const Alloc& alloc) {
  LS_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(), "rms_norm: contiguous x, w of one dtype");
  const int64_t D = x.size(-1), M = x.numel() / D;
  LS_CHECK(w.numel() == D, "rms_norm: weight size");
  const View out = alloc(x.scalar_type(), x.sizes());
  if (x.scalar_type() == kFloat)
    rms_norm_impl<float>(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), M, D, static_cast<float>(eps));
  else if (x.scalar_type() == kBFloat16)
    rms_norm_impl<bf16>(x.data_ptr<bf16>(), w.data_ptr<bf16>(), out.data_ptr<bf16>(), M, D, static_cast<float>(eps));
  else
    LS_CHECK(false, "rms_norm: float32 or bfloat16");
  return out;
}

// SwiGLU's gate (Shazeer 2020): silu(g) * u over the fused gate/up projection's output.   gu (M, 2F) -> (M, F)
// One row at a time, every element through the same exp8 (the tail padded into a vector), so an element's value
// never depends on how rows are split across threads.
template <typename T>
void silu_mul_row(const T* g, T* o, int64_t F) {
  const T* u = g + F;
  int64_t f = 0;
#if LS_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  auto silu_mul8 = [&](__m256 gv, __m256 uv) {
    __m256 s = round_to8<T>(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
    return _mm256_mul_ps(s, uv);
  };
  for (; f + 8 <= F; f += 8) store8(o + f, silu_mul8(load8(g + f), load8(u + f)));
  if (f < F) {
    float gb[8] = {0}, ub[8] = {0}, ob[8];
    for (int64_t i = f; i < F; ++i) gb[i - f] = to_f(g[i]), ub[i - f] = to_f(u[i]);
    _mm256_storeu_ps(ob, silu_mul8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub)));
    for (int64_t i = f; i < F; ++i) o[i] = from_f<T>(ob[i - f]);
  }
#else
  for (; f < F; ++f) {
    const float gv = to_f(g[f]);
    o[f] = from_f<T>(round_to<T>(gv / (1.f + std::exp(-gv))) * to_f(u[f]));
  }
#endif
}
template void silu_mul_row<float>(const float*, float*, int64_t);
template void silu_mul_row<bf16>(const bf16*, bf16*, int64_t);

template <typename T>
static void silu_mul_impl(const T* gu, T* out, int64_t M, int64_t F) {
  parallel_for(0, M, std::max<int64_t>(1, 2048 / F), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) silu_mul_row(gu + m * 2 * F, out + m * F, F);
  });
}

View silu_mul(const View& gu, const Alloc& alloc) {
  LS_CHECK(gu.is_contiguous() && gu.size(-1) % 2 == 0, "silu_mul: contiguous (..., 2F)");
  const int64_t F = gu.size(-1) / 2, M = gu.numel() / (2 * F);
  auto sizes = gu.sizes();
  sizes.back() = F;
  const View out = alloc(gu.scalar_type(), sizes);
  if (gu.scalar_type() == kFloat)
    silu_mul_impl<float>(gu.data_ptr<float>(), out.data_ptr<float>(), M, F);
  else if (gu.scalar_type() == kBFloat16)
    silu_mul_impl<bf16>(gu.data_ptr<bf16>(), out.data_ptr<bf16>(), M, F);
  else
    LS_CHECK(false, "silu_mul: float32 or bfloat16");
  return out;
}

// RoPE (Su et al. 2021) in the rotate-half layout, in place on the first `n_rot` heads of each token:
// x' = x * cos + swap_halves(x) * signed_sin, with model/transformer.py's `rotary_tables` (signed_sin =
// cat(-sin_lo, sin_hi)).   x (N, n_heads, E) rows of the fused q/k/v output; cos, signed_sin (N, E)
template <typename T>
void rope_head(T* xr, const T* c, const T* s, int64_t E) {
  const int64_t half = E / 2;
  float buf[1024];
  for (int64_t i = 0; i < E; ++i) buf[i] = to_f(xr[i]);
  int64_t i = 0;
#if LS_AVX2
  if (half % 8 == 0) {
    for (; i < E; i += 8) {
      const int64_t j = i < half ? i + half : i - half;
      __m256 a = round_to8<T>(_mm256_mul_ps(_mm256_loadu_ps(buf + i), load8(c + i)));
      __m256 b = round_to8<T>(_mm256_mul_ps(_mm256_loadu_ps(buf + j), load8(s + i)));
      store8(xr + i, _mm256_add_ps(a, b));
    }
  }
#endif
  for (; i < E; ++i) {
    const int64_t j = i < half ? i + half : i - half;
    xr[i] = from_f<T>(round_to<T>(buf[i] * to_f(c[i])) + round_to<T>(buf[j] * to_f(s[i])));
  }
}
template void rope_head<float>(float*, const float*, const float*, int64_t);
template void rope_head<bf16>(bf16*, const bf16*, const bf16*, int64_t);

template <typename T>
static void rope_impl(T* x, const T* cos, const T* ssin, int64_t N, int64_t n_heads, int64_t n_rot, int64_t E) {
  parallel_for(0, N * n_rot, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t n = idx / n_rot, h = idx % n_rot;
      rope_head(x + (n * n_heads + h) * E, cos + n * E, ssin + n * E, E);
    }
  });
}

void rope_(const View& x, const View& cos, const View& ssin, int64_t n_rot) {
  LS_CHECK(x.is_contiguous() && cos.is_contiguous() && ssin.is_contiguous(), "rope_: contiguous tensors");
  LS_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == ssin.scalar_type(), "rope_: one dtype");
  const int64_t E = x.size(-1), n_heads = x.size(-2), N = x.numel() / (n_heads * E);
  LS_CHECK(E % 2 == 0 && E <= 1024 && n_rot <= n_heads && cos.numel() == N * E && ssin.numel() == N * E, "rope_: shapes");
  if (x.scalar_type() == kFloat)
    rope_impl<float>(x.data_ptr<float>(), cos.data_ptr<float>(), ssin.data_ptr<float>(), N, n_heads, n_rot, E);
  else if (x.scalar_type() == kBFloat16)
    rope_impl<bf16>(x.data_ptr<bf16>(), cos.data_ptr<bf16>(), ssin.data_ptr<bf16>(), N, n_heads, n_rot, E);
  else
    LS_CHECK(false, "rope_: float32 or bfloat16");
}

}  // namespace ls
