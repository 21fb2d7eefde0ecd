// LoRA's expanding product (model/features/lora/adapters.py): y = t B^T for a low-rank t (n, r) and B stored transposed, bt (r, out).
//
// With r of 8 to 64, float_linear's order (8 lanes, a horizontal sum per output) would spend more on the sums than on
// the multiply-adds. Here each output is summed over k = 0 .. r - 1 in order, one fused multiply-add a step, and the
// outputs sit side by side in a register: no horizontal work, and an output's arithmetic is the same in a vector lane
// and in the scalar tail (std::fma), so a row's result depends on nothing but its own row, whatever the rows beside
// it or the columns a thread takes.
#include <cmath>

#include "ops.h"
#include "simd.h"
#include "qgemm.h"

namespace ls {

template <typename T>
void lora_expand_range(const T* t, int64_t n, const T* bt, int64_t r, int64_t width, int64_t c0, int64_t c1, float* y,
                       int64_t ldy) {
  int64_t c = c0;
#if LS_AVX2
  constexpr int MR = 4;  // rows a tile: each loaded run of 16 of bt's columns feeds 4 rows' 2 registers
  for (; c + 16 <= c1; c += 16) {
    int64_t i = 0;
    for (; i + MR <= n; i += MR) {
      __m256 acc[MR][2];
      for (int a = 0; a < MR; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
      for (int64_t k = 0; k < r; ++k) {
        const __m256 b0 = load8(bt + k * width + c), b1 = load8(bt + k * width + c + 8);
        for (int a = 0; a < MR; ++a) {
          const __m256 x = _mm256_set1_ps(to_f(t[(i + a) * r + k]));
          acc[a][0] = _mm256_fmadd_ps(x, b0, acc[a][0]);
          acc[a][1] = _mm256_fmadd_ps(x, b1, acc[a][1]);
        }
      }
      for (int a = 0; a < MR; ++a) {
        _mm256_storeu_ps(y + (i + a) * ldy + c, acc[a][0]);
        _mm256_storeu_ps(y + (i + a) * ldy + c + 8, acc[a][1]);
      }
    }
    for (; i < n; ++i) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int64_t k = 0; k < r; ++k) {
        const __m256 x = _mm256_set1_ps(to_f(t[i * r + k]));
        a0 = _mm256_fmadd_ps(x, load8(bt + k * width + c), a0);
        a1 = _mm256_fmadd_ps(x, load8(bt + k * width + c + 8), a1);
      }
      _mm256_storeu_ps(y + i * ldy + c, a0);
      _mm256_storeu_ps(y + i * ldy + c + 8, a1);
    }
  }
#endif
  for (; c < c1; ++c)
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.f;
      for (int64_t k = 0; k < r; ++k) s = std::fma(to_f(t[i * r + k]), to_f(bt[k * width + c]), s);
      y[i * ldy + c] = s;
    }
}
template void lora_expand_range<float>(const float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
template void lora_expand_range<bf16>(const bf16*, int64_t, const bf16*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);

// t (n, r), bt (r, out) of one dtype -> (n, out) float32
View lora_expand(const View& t, const View& bt, const Alloc& alloc) {
  LS_CHECK(t.dim() == 2 && bt.dim() == 2 && t.size(1) == bt.size(0) && t.is_contiguous() && bt.is_contiguous() &&
              t.scalar_type() == bt.scalar_type(), "lora_expand: t (n, r), bt (r, out) contiguous, one dtype");
  const int64_t n = t.size(0), r = t.size(1), width = bt.size(1);
  const View y = alloc(kFloat, {n, width});
  float* yp = y.data_ptr<float>();
  if (t.scalar_type() == kFloat)
    parallel_for(0, width, 64, [&](int64_t b, int64_t e) { lora_expand_range(t.data_ptr<float>(), n, bt.data_ptr<float>(), r, width, b, e, yp, width); });
  else {
    LS_CHECK(t.scalar_type() == kBFloat16, "lora_expand: float32 or bfloat16");
    parallel_for(0, width, 64, [&](int64_t b, int64_t e) { lora_expand_range(t.data_ptr<bf16>(), n, bt.data_ptr<bf16>(), r, width, b, e, yp, width); });
  }
  return y;
}

}  // namespace ls
