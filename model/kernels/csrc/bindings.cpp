// Python bindings of llamascope's native CPU kernels (model/kernels/__init__.py builds and loads them).
#include "simd.h"

namespace ls {
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gu);
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& ssin, int64_t n_rot);
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                            const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lens,
                            torch::Tensor& out);
void paged_write(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_pool, torch::Tensor& v_pool,
                 const torch::Tensor& slots);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& nibbles, const torch::Tensor& dm);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales);
torch::Tensor decode_layers(torch::Tensor h, const std::vector<std::vector<torch::Tensor>>& layers, double eps,
                            const torch::Tensor& cos, const torch::Tensor& ssin, torch::Tensor& k_pools,
                            torch::Tensor& v_pools, const torch::Tensor& slots, const torch::Tensor& rows,
                            const torch::Tensor& tables, const torch::Tensor& lens, int64_t H, int64_t K, int64_t E);
}  // namespace ls

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("avx2") = static_cast<bool>(LS_AVX2);
  m.def("rms_norm", &ls::rms_norm, "RMSNorm: x (M, D), w (D,) -> (M, D)");
  m.def("silu_mul", &ls::silu_mul, "silu(g) * u: (..., 2F) -> (..., F)");
  m.def("rope_", &ls::rope_, "RoPE in place on the first n_rot heads: x (N, heads, E), cos/signed sin (N, E)");
  m.def("paged_decode_attention", &ls::paged_decode_attention, "decode attention over the paged pool");
  m.def("paged_write", &ls::paged_write, "write k/v (N, K, E) into pool slots (N,)");
  m.def("int4_linear", &ls::int4_linear, "x (M, K) float32 @ int4 W (N, K)^T -> (M, N)");
  m.def("int8_linear", &ls::int8_linear, "x (M, K) float32 @ int8 W (N, K)^T -> (M, N)");
  m.def("decode_layers", &ls::decode_layers, "every block of a pure decode step: h (N, D) -> (N, D)");
}
