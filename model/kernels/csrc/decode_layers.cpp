// Every block of a pure decode step (each sequence adds one token) in one call: the composition of
// model/transformer.py's `Block.forward` over the native ops, with no Python between them.
//
// The Python modules run the very same ops (rms_norm, the linear layers, rope_, paged_write,
// paged_decode_attention, silu_mul) one module call at a time; at the default model's size that per-call cost
// (about 20 calls and 10 microseconds each per block) is a third of a quantized decode step, so the engine's
// decode steps come here instead. Prefill and mixed steps, inspection and tensor-parallel ranks keep the modules.
#include "ops.h"

namespace ls {

// y = x W^T for W as model/quantize.py's `apply_linear` sees it: a float weight (N, K) (b empty), int4
// (a = nibbles uint8, b = dm float16) or int8 (a = weight int8, b = scales), the quantized ones through the
// few-row kernels on float32 activations, as `QuantLinear.forward` does up to its `kernel_row_limit`.
static torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b) {
  const bool quantized = a.scalar_type() == at::kByte || a.scalar_type() == at::kChar;
  if (!quantized) return at::linear(x, a);
  // float32 activations for the kernels; no conversion calls at all when they already are (the float32 model)
  const bool as_is = x.scalar_type() == at::kFloat && x.is_contiguous();
  const torch::Tensor xf = as_is ? x : x.to(at::kFloat).contiguous();
  torch::Tensor y = a.scalar_type() == at::kByte ? int4_linear(xf, a, b) : int8_linear(xf, a, b);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// hidden[slot[r]] = h[rows[r]] for the decode rows r with a telemetry slot: the residual stream after a block.
static void keep_rows(const torch::Tensor& h, const torch::Tensor& rows, const torch::Tensor& slot, torch::Tensor hidden) {
  const int64_t* s = slot.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < slot.numel(); ++r)
    if (s[r] >= 0) hidden[s[r]].copy_(h[rw[r]]);
}

// h (N, D) the residual stream of N decode rows; layers: per block [attention_norm, ffn_norm, wqkv a, b, wo a, b,
// w13 a, b, w2 a, b]; cos, ssin (N, E) `rotary_tables`; k_pools, v_pools (L, NB, bs, K, E); the step's slots
// (N,) and decode metadata as `PagedKVCache.set_step` builds them (rows = 0..N-1); edits: the step's
// interventions table (empty: none; interventions.cpp), applied at the block's three sites as `Block.forward`
// hands them to its attention context; telemetry: empty (off), or model/engine/telemetry.py's [slot (N,),
// sink_len (Rt,), sink_mass (L, Rt, H), top_pos (L, Rt, H, k), top_prob (L, Rt, H, k), hidden (L, Rt, D)]: the
// attention telemetry of the rows with slot >= 0, and their residual stream after each block.
// -> h after every block (N, D)
torch::Tensor decode_layers(torch::Tensor h, const std::vector<std::vector<torch::Tensor>>& layers, double eps,
                            const torch::Tensor& cos, const torch::Tensor& ssin, torch::Tensor& k_pools,
                            torch::Tensor& v_pools, const torch::Tensor& slots, const torch::Tensor& rows,
                            const torch::Tensor& tables, const torch::Tensor& lens, int64_t H, int64_t K, int64_t E,
                            const std::vector<torch::Tensor>& edits, const std::vector<torch::Tensor>& telemetry) {
  TORCH_CHECK(telemetry.empty() || telemetry.size() == 6, "decode_layers: telemetry is empty or 6 tensors");
  TORCH_CHECK(h.dim() == 2 && k_pools.size(0) == static_cast<int64_t>(layers.size()), "decode_layers: shapes");
  const int64_t N = h.size(0);
  h = h.clone();  // the residual stream is updated in place from here on; the caller's tensor stays as it was
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& w = layers[l];
    TORCH_CHECK(w.size() == 10, "decode_layers: 10 tensors per block");
    torch::Tensor k_pool = k_pools[l], v_pool = v_pools[l];
    // attention: h + wo(attend(rope(wqkv(norm(h)))))
    auto qkv = linear(rms_norm(h, w[0], eps), w[2], w[3]).view({N, H + 2 * K, E});  // (N, H + 2K, E)
    rope_(qkv, cos, ssin, H + K);
    auto q = qkv.narrow(1, 0, H), k = qkv.narrow(1, H, K), v = qkv.narrow(1, H + K, K);
    paged_write(k, v, k_pool, v_pool, slots);
    auto att = torch::empty({N, H, E}, h.options());
    if (telemetry.empty()) {
      paged_decode_attention(q, k_pool, v_pool, rows, tables, lens, att);
    } else {
      torch::Tensor sink = telemetry[2][l], pos = telemetry[3][l], prob = telemetry[4][l];
      paged_decode_attention_telemetry(q, k_pool, v_pool, rows, tables, lens, att, telemetry[0], telemetry[1], sink, pos, prob);
    }
    auto a = linear(att.view({N, H * E}), w[4], w[5]);
    apply_site(a, edits, 3 * l);  // attention_output
    h.add_(a);
    // feed-forward: h + w2(silu(w1 x) * w3 x), x = norm(h)
    auto m = linear(silu_mul(linear(rms_norm(h, w[1], eps), w[6], w[7])), w[8], w[9]);
    apply_site(m, edits, 3 * l + 1);  // mlp_output
    h.add_(m);
    apply_site(h, edits, 3 * l + 2);  // block_output
    read_site(h, edits, l);
    if (!telemetry.empty()) keep_rows(h, rows, telemetry[0], telemetry[5][l]);
  }
  return h;
}

}  // namespace ls
