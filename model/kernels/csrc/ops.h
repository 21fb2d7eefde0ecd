// The native ops, as bindings.cpp exposes them to Python and step_layers.cpp composes them: over Views (tensor.h),
// an op that returns a tensor makes it with `alloc` and returns its View.
#pragma once

#include <tuple>
#include <vector>

#include "tensor.h"

namespace ls {
struct Telemetry;  // attention_telemetry.h
// What this build's instruction-set flags turned on (simd.h's LS_AVX2, LS_VNNI, LS_ZMM, LS_AMX), for bindings.cpp,
// which is compiled without them (one object for every build: model/kernels/extension.py).
struct Features {
  bool avx2, vnni, zmm, amx;
};
Features features();
// Whether the many-row Q4_K steps run on AMX tiles: a build with them (simd.h's LS_AMX) on a kernel that grants the
// process their state (asked once, on the first call).
bool amx_permitted();
View rms_norm(const View& x, const View& w, double eps, const Alloc& alloc);
View silu_mul(const View& gu, const Alloc& alloc);
void rope_(const View& x, const View& cos, const View& ssin, int64_t n_rot);
// window: the model's sliding window (0: none); scale: the attention scale (0: 1/sqrt(E)).
void paged_decode_attention(const View& q, const View& k_pool, const View& v_pool,
                            const View& rows, const View& tables, const View& lens,
                            const View& out, int64_t window = 0, double scale = 0.0);
void paged_decode_attention_telemetry(const View& q, const View& k_pool, const View& v_pool,
                                      const View& rows, const View& tables, const View& lens,
                                      const View& out, const View& slot, const View& sink_len,
                                      const View& sink_mass, const View& top_pos, const View& top_prob,
                                      int64_t window = 0, double scale = 0.0);
void paged_write(const View& k, const View& v, const View& k_pool, const View& v_pool,
                 const View& slots);
View int4_linear(const View& x, const View& nibbles, const View& scales, const Alloc& alloc);
View int8_linear(const View& x, const View& w, const View& scales, const Alloc& alloc);
View int4_dequantize(const View& nibbles, const View& scales, const Alloc& alloc);
View int8_dequantize(const View& w, const View& scales, const Alloc& alloc);
View int6_linear(const View& x, const View& data, const View& scales, const Alloc& alloc);
View int6_dequantize(const View& data, const View& scales, const Alloc& alloc);
View round_activations(const View& x, int64_t block, const Alloc& alloc);
View argmax_rows(const View& logits, const Alloc& alloc);
View float_linear(const View& x, const View& w, const Alloc& alloc);
View float_linear_argmax(const View& x, const View& w, const Alloc& alloc);
int64_t greedy_pick_row(const float* x, int64_t V);  // argmax_rows' pick of one row
// One row (one head) of the elementwise ops, as the ops above apply them to every row: the fused step calls these.
template <typename T> void rms_norm_row(const T* x, const T* w, T* out, int64_t D, float eps);
template <typename T> void silu_mul_row(const T* gu, T* out, int64_t F);
template <typename T> void rope_head(T* x, const T* cos, const T* ssin, int64_t E);
// A pool's last dimension for heads of E: E values, or for an int8 cache E + 4 (a head's E quants and its float32
// scale's 4 bytes; where they lie in a block: kv_slot).
inline int64_t kv_row_width(ScalarType pool, int64_t E) { return pool == kChar ? E + 4 : E; }
// Where head `head`'s row of slot `slot` (block slot / bs, position slot % bs) lies in a pool of bs positions a block
// and K heads of E: a float cache's rows are (slot, head)-ordered rows of E values. An int8 cache's block is its
// bs * K rows of E quants (head, position)-ordered, then their bs * K float32 scales in the same order
// (model/kernels/kv_int8.py): a row of 64 quants is one aligned cache line, and a walk over one head's positions
// reads its bs rows as one run of bs * E bytes and its bs scales as another, where (position, head)-ordered rows
// put each of its lines K * E bytes from the last.
struct KVSlot {
  char* row;
  char* scale;  // an int8 row's scale; null for a float cache
};
inline KVSlot kv_slot(char* pool, ScalarType t, int64_t bs, int64_t K, int64_t E, int64_t slot, int64_t head) {
  if (t != kChar) return {pool + (slot * K + head) * E * static_cast<int64_t>(element_size(t)), nullptr};
  char* block = pool + slot / bs * bs * K * (E + 4);
  const int64_t i = head * bs + slot % bs;
  return {block + i * E, block + bs * K * E + i * 4};
}
// One row of n values into a KV pool row of dtype `pool` (the row's own dtype: copied; float16 / bfloat16 from
// float32: rounded once; int8: one head's row, its quants at dst and its scale at `scale`). paged_attention.cpp.
template <typename T>
void store_kv_row(const KVSlot& dst, ScalarType pool, const T* src, int64_t n);
// (row, head) tasks [begin, end) of paged_decode_attention, for a caller that splits them across its own threads.
void paged_attention_range(const View& q, const View& k_pool, const View& v_pool,
                           const View& rows, const View& tables, const View& lens,
                           const View& out, int64_t begin, int64_t end, const Telemetry* tel = nullptr,
                           int64_t window = 0, double scale = 0.0);
View lora_expand(const View& t, const View& bt, const Alloc& alloc);
// One LoRA target of a block in step_layers (model/features/lora/adapters.py's LoRAPart): (group: which of the step's row lists it
// adapts, site: 0 wqkv, 1 wo, 2 w13, 3 w2, start, stop: the columns of the site's output it adds to, scale, A (r, in),
// B transposed (r, stop - start)), A and B in the activation dtype.
using LoRAPart = std::tuple<int64_t, int64_t, int64_t, int64_t, double, View, View>;
// h: the residual stream, updated in place (bindings.cpp passes a contiguous copy of the caller's)
void step_layers(const View& h, const std::vector<std::vector<View>>& layers, double eps, const View& cos,
                 const View& ssin, const View& k_pools, const View& v_pools, const View& slots, const View& rows,
                 const View& tables, const View& lens, int64_t H, int64_t K, int64_t E, const std::vector<View>& edits,
                 const std::vector<View>& telemetry, const std::vector<std::vector<View>>& extras, int64_t window,
                 double scale, double residual, bool post_norm, int64_t qk_norm, const std::vector<View>& lora_rows,
                 const std::vector<std::vector<LoRAPart>>& lora, const Alloc& alloc);
void gguf_convert(const View& raw, int64_t type, const View& order, const View& data,
                  const View& scales);
void apply_edits(const View& x, const View& ops, const View& bank);
void apply_clamps(const View& x, const View& ops, const View& params, const View& bank,
                  const std::vector<View>& encoders);
// A block's sites as model/interventions.py's SITES numbers them (the tables' site k = SITES_PER_BLOCK layer + site).
enum Site : int64_t { ATTENTION_OUTPUT, RESID_MID, MLP_NORMALIZED, MLP_INPUT, MLP_OUTPUT, BLOCK_OUTPUT, SITES_PER_BLOCK };
// Whether the table has work at `site` (edits, clamps or reads): a step's other sites keep the fused residual add.
bool site_touched(const std::vector<View>& edits, int64_t site);
void apply_site(const View& x, const std::vector<View>& edits, int64_t site);
void read_site(const View& h, const std::vector<View>& edits, int64_t site);
// The reads at `site` of h's rows normalized without a gain, x / rms(x) (rms_norm_row with a gain of ones).
void read_normalized(const View& h, const std::vector<View>& edits, int64_t site, double eps);
}  // namespace ls
