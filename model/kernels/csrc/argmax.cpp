// Greedy decoding's pick: each row's torch.argmax of nan_to_num(logits, nan=-inf), the first index of the maximum.
// Where the plain maximum is finite that is torch.argmax itself, found reading the row twice (the maximum, then its
// first index), from L2; a row with a NaN, an inf or only -inf (what the sampler must still answer without failing
// the batch) takes a scalar pass over nan_to_num's ordering: NaN below -inf, which ranks as -FLT_MAX, +inf as
// FLT_MAX. So the pick needs no check of its own afterwards, and no host read of the result on a device.
#include <cfloat>

#include "ops.h"
#include "simd.h"

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

// nan_to_num(x, nan=-inf)'s argmax, one scalar pass (a row argmax_row could not answer)
static int64_t argmax_row_nan_to_num(const float* x, int64_t V) {
  int64_t idx = 0;
  float best = 0.f;
  for (int64_t j = 0; j < V; ++j) {
    float v = x[j];
    v = std::isnan(v) ? -INFINITY : v == INFINITY ? FLT_MAX : v == -INFINITY ? -FLT_MAX : v;
    if (j == 0 || v > best) {
      best = v;
      idx = j;
    }
  }
  return idx;
}

int64_t greedy_pick_row(const float* x, int64_t V) {
  const int64_t i = argmax_row(x, V);
  return i >= 0 ? i : argmax_row_nan_to_num(x, V);
}

// logits (B, V) float32, contiguous -> (B,) int64: each row's pick
View argmax_rows(const View& logits, const Alloc& alloc) {
  LS_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == kFloat && logits.size(1) > 0,
              "argmax_rows: logits (B, V) float32, contiguous");
  const int64_t B = logits.size(0), V = logits.size(1);
  const View out = alloc(kLong, {B});
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  // rows in parallel (a batch's logits are read from memory once, by both cores' bandwidth); each row is one pass
  // of one thread, so the pick does not depend on the split
  parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = greedy_pick_row(x + r * V, V);
  });
  return out;
}

}  // namespace ls
