// Attention telemetry: what a decode row's softmax put on the sink tokens and on its top-k keys, read off the
// probabilities the decode kernel has just computed (paged_attention.cpp's attend_head leaves exp(score - max) and
// their sum), so nothing is recomputed and no T x T map exists. The quantities are /inspect's (model/probes):
// sink mass is the attention on the first `sink_len` keys (token 0 as Xiao et al. define the sink, or a kv_window's
// sink tokens), top-k the k largest weights, ties to the earlier key. A row that asked for none costs one compare.
#pragma once

#include "simd.h"

namespace ls {

struct Telemetry {
  const int64_t* slot;      // (R,) per decode row: its telemetry slot j, or -1
  const int64_t* sink_len;  // (Rt,) per slot: leading keys counted as sinks
  float* sink_mass;         // (Rt, H)
  int64_t* top_pos;         // (Rt, H, k) key positions (cache positions), -1 past a short context
  float* top_prob;          // (Rt, H, k)
  int64_t H, k;

  static Telemetry of(const View& slot, const View& sink_len, const View& sink_mass,
                      const View& top_pos, const View& top_prob, int64_t H, int64_t R) {
    LS_CHECK(slot.scalar_type() == kLong && sink_len.scalar_type() == kLong && top_pos.scalar_type() == kLong,
                "attention telemetry: int64 slots, sink lengths and positions");
    LS_CHECK(sink_mass.scalar_type() == kFloat && top_prob.scalar_type() == kFloat, "attention telemetry: float32 outputs");
    LS_CHECK(slot.is_contiguous() && sink_len.is_contiguous() && sink_mass.is_contiguous() && top_pos.is_contiguous() &&
                top_prob.is_contiguous(), "attention telemetry: contiguous");
    const int64_t Rt = sink_len.numel(), k = top_pos.dim() == 3 ? top_pos.size(2) : 0;
    LS_CHECK(slot.numel() == R && sink_mass.numel() == Rt * H && top_pos.numel() == Rt * H * k &&
                top_prob.numel() == Rt * H * k && k >= 1, "attention telemetry: shapes");
    const int64_t* s = slot.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) LS_CHECK(s[r] >= -1 && s[r] < Rt, "attention telemetry: slot out of range");
    return {s, sink_len.data_ptr<int64_t>(), sink_mass.data_ptr<float>(), top_pos.data_ptr<int64_t>(),
            top_prob.data_ptr<float>(), H, k};
  }

  // The same record for layer l of stacked buffers: sink_mass (L, Rt, H), top_pos / top_prob (L, Rt, H, k), with
  // `of` having checked layer 0's view (the caller checks the stacked shapes). Pointer offsets, no tensor ops.
  Telemetry layer(int64_t l, int64_t Rt) const {
    Telemetry t = *this;
    t.sink_mass += l * Rt * H;
    t.top_pos += l * Rt * H * k;
    t.top_prob += l * Rt * H * k;
    return t;
  }

  // e (len) = exp(score - max) of head h of the row in slot j, sum their sum: p = e / sum.
  void record(int64_t j, int64_t h, const float* e, int64_t len, float sum) const {
    const float inv = 1.f / sum;
    float s = 0.f;
    for (int64_t i = 0, n = std::min(sink_len[j], len); i < n; ++i) s += e[i];
    sink_mass[j * H + h] = s * inv;
    // top-k by insertion into a descending list; strictly greater displaces, so equal weights keep the earlier key
    int64_t* pos = top_pos + (j * H + h) * k;
    float* prob = top_prob + (j * H + h) * k;
    int64_t filled = 0;
    auto offer = [&](int64_t i) {
      const float v = e[i];
      if (filled == k && !(v > prob[k - 1])) return;
      int64_t at = filled < k ? filled++ : k - 1;
      while (at > 0 && v > prob[at - 1]) {
        prob[at] = prob[at - 1];
        pos[at] = pos[at - 1];
        --at;
      }
      prob[at] = v;
      pos[at] = i;
    };
    int64_t i = 0;
    for (; i < len && filled < k; ++i) offer(i);
#if LS_AVX2
    // once the list is full, 8 keys per compare: only a lane above the k-th weight is offered, in key order, so
    // the result is the scalar loop's
    for (; i + 8 <= len; i += 8) {
      int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), _mm256_set1_ps(prob[k - 1]), _CMP_GT_OQ));
      while (mask) {
        offer(i + __builtin_ctz(mask));
        mask &= mask - 1;
      }
    }
#endif
    for (; i < len; ++i) offer(i);
    for (int64_t i = 0; i < filled; ++i) prob[i] *= inv;
    for (int64_t i = filled; i < k; ++i) {
      prob[i] = 0.f;
      pos[i] = -1;
    }
  }
};

}  // namespace ls
