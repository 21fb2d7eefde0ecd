// Greedy decoding's pick: the index of each row's largest logit, as torch.argmax returns it (the first index of
// the maximum; a NaN counts as larger than any number, so the first NaN wins), or -1 where that pick is not finite
// (a NaN, an inf, or a row of -inf: the sampler's fall-back decides those). One vectorized pass replaces
// torch.argmax and the sampler's gather and finiteness check after it, a noticeable share of a small model's decode
// step (docs/performance.md#native-cpu-kernels); this reads the row twice from L2.
#include "ops.h"

namespace ls {

static int64_t argmax_row(const float* x, int64_t V) {
  int64_t i = 0;
  float best = -INFINITY;
#if LS_AVX2
  __m256 mx = _mm256_set1_ps(-INFINITY);
  __m256 nan = _mm256_setzero_ps();  // lanes that saw a NaN
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  if (_mm256_movemask_ps(nan)) return -1;  // torch picks the first NaN: not finite
  best = hmax(mx);
#endif
  for (int64_t j = i; j < V; ++j)
    if (std::isnan(x[j])) return -1;  // (torch: the first NaN, not finite)
    else if (x[j] > best) best = x[j];
  if (!std::isfinite(best)) return -1;  // +inf, or a row of -inf
  int64_t j = 0;  // the first index holding the maximum
#if LS_AVX2
  const __m256 b = _mm256_set1_ps(best);
  for (; j + 8 <= V; j += 8) {
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), b, _CMP_EQ_OQ));
    if (m) return j + __builtin_ctz(m);
  }
#endif
  for (; j < V; ++j)
    if (x[j] == best) return j;
  return 0;
}

// logits (B, V) float32, contiguous -> (B,) int64: each row's pick, or -1
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits (B, V) float32, contiguous");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = torch::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) o[r] = argmax_row(x + r * V, V);
  return out;
}

}  // namespace ls
