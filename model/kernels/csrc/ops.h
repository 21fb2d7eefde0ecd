// The native ops, as bindings.cpp exposes them to Python and step_layers.cpp composes them.
#pragma once

#include <tuple>
#include <vector>

#include "simd.h"

namespace ls {
struct Telemetry;  // attention_telemetry.h
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gu);
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& ssin, int64_t n_rot);
// window: the model's sliding window (0: none); scale: the attention scale (0: 1/sqrt(E)).
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                            const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lens,
                            torch::Tensor& out, int64_t window = 0, double scale = 0.0);
void paged_decode_attention_telemetry(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                      const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lens,
                                      torch::Tensor& out, const torch::Tensor& slot, const torch::Tensor& sink_len,
                                      torch::Tensor& sink_mass, torch::Tensor& top_pos, torch::Tensor& top_prob,
                                      int64_t window = 0, double scale = 0.0);
void paged_write(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_pool, torch::Tensor& v_pool,
                 const torch::Tensor& slots);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& scales);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales);
torch::Tensor int4_dequantize(const torch::Tensor& nibbles, const torch::Tensor& scales);
torch::Tensor int8_dequantize(const torch::Tensor& w, const torch::Tensor& scales);
torch::Tensor int6_linear(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& scales);
torch::Tensor int6_dequantize(const torch::Tensor& data, const torch::Tensor& scales);
torch::Tensor round_activations(const torch::Tensor& x, int64_t block);
torch::Tensor argmax_rows(const torch::Tensor& logits);
torch::Tensor float_linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor float_linear_argmax(const torch::Tensor& x, const torch::Tensor& w);
int64_t greedy_pick_row(const float* x, int64_t V);  // argmax_rows' pick of one row
// One row (one head) of the elementwise ops, as the ops above apply them to every row: the fused step calls these.
template <typename T> void rms_norm_row(const T* x, const T* w, T* out, int64_t D, float eps);
template <typename T> void silu_mul_row(const T* gu, T* out, int64_t F);
template <typename T> void rope_head(T* x, const T* cos, const T* ssin, int64_t E);
// A pool's last dimension for heads of E: E values, or for an int8 cache E + 4 (a head's E quants and its float32
// scale's 4 bytes; where they lie in a block: kv_slot).
inline int64_t kv_row_width(at::ScalarType pool, int64_t E) { return pool == at::kChar ? E + 4 : E; }
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
inline KVSlot kv_slot(char* pool, at::ScalarType t, int64_t bs, int64_t K, int64_t E, int64_t slot, int64_t head) {
  if (t != at::kChar) return {pool + (slot * K + head) * E * static_cast<int64_t>(c10::elementSize(t)), nullptr};
  char* block = pool + slot / bs * bs * K * (E + 4);
  const int64_t i = head * bs + slot % bs;
  return {block + i * E, block + bs * K * E + i * 4};
}
// One row of n values into a KV pool row of dtype `pool` (the row's own dtype: copied; float16 / bfloat16 from
// float32: rounded once; int8: one head's row, its quants at dst and its scale at `scale`). paged_attention.cpp.
template <typename T>
void store_kv_row(const KVSlot& dst, at::ScalarType pool, const T* src, int64_t n);
// (row, head) tasks [begin, end) of paged_decode_attention, for a caller that splits them across its own threads.
void paged_attention_range(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lens,
                           torch::Tensor& out, int64_t begin, int64_t end, const Telemetry* tel = nullptr,
                           int64_t window = 0, double scale = 0.0);
torch::Tensor lora_expand(const torch::Tensor& t, const torch::Tensor& bt);
// One LoRA target of a block in step_layers (model/lora.py's LoRAPart): (group: which of the step's row lists it
// adapts, site: 0 wqkv, 1 wo, 2 w13, 3 w2, start, stop: the columns of the site's output it adds to, scale, A (r, in),
// B transposed (r, stop - start)), A and B in the activation dtype.
using LoRAPart = std::tuple<int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor>;
torch::Tensor step_layers(torch::Tensor h, const std::vector<std::vector<torch::Tensor>>& layers, double eps,
                            const torch::Tensor& cos, const torch::Tensor& ssin, torch::Tensor& k_pools,
                            torch::Tensor& v_pools, const torch::Tensor& slots, const torch::Tensor& rows,
                            const torch::Tensor& tables, const torch::Tensor& lens, int64_t H, int64_t K, int64_t E,
                            const std::vector<torch::Tensor>& edits, const std::vector<torch::Tensor>& telemetry,
                            const std::vector<std::vector<torch::Tensor>>& extras = {}, int64_t window = 0,
                            double scale = 0.0, double residual = 1.0, bool post_norm = false, int64_t qk_norm = 0,
                            const std::vector<torch::Tensor>& lora_rows = {},
                            const std::vector<std::vector<LoRAPart>>& lora = {});
void gguf_convert(const torch::Tensor& raw, int64_t type, const torch::Tensor& order, torch::Tensor& data,
                  torch::Tensor& scales);
void apply_edits(torch::Tensor& x, const torch::Tensor& ops, const torch::Tensor& bank);
void apply_site(torch::Tensor& x, const std::vector<torch::Tensor>& edits, int64_t site);
void read_site(const torch::Tensor& h, const std::vector<torch::Tensor>& edits, int64_t site);
}  // namespace ls
