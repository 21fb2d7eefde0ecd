// Python bindings of llamascope's native CPU kernels (model/kernels/__init__.py builds and loads them): the one file
// that includes PyTorch's headers. Each op's tensors become Views (tensor.h: pointer, dtype, sizes, strides) for the
// plain C++ kernels, and the tensors an op returns are made here (`Made`), by torch's allocator.
#include <torch/extension.h>

#include "ops.h"

namespace ls {

void parallel_for(int64_t begin, int64_t end, int64_t grain, Body body, const void* f) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { body(f, b, e); });
}
int num_threads() { return at::get_num_threads(); }

}  // namespace ls

namespace {

ls::ScalarType scalar_type(at::ScalarType t) {
  switch (t) {
    case at::kByte: return ls::kByte;
    case at::kChar: return ls::kChar;
    case at::kShort: return ls::kShort;
    case at::kInt: return ls::kInt;
    case at::kLong: return ls::kLong;
    case at::kHalf: return ls::kHalf;
    case at::kFloat: return ls::kFloat;
    case at::kDouble: return ls::kDouble;
    case at::kBFloat16: return ls::kBFloat16;
    case at::kBool: return ls::kBool;
    default: return ls::ScalarType::Other;
  }
}

at::ScalarType torch_type(ls::ScalarType t) {
  switch (t) {
    case ls::kByte: return at::kByte;
    case ls::kChar: return at::kChar;
    case ls::kShort: return at::kShort;
    case ls::kInt: return at::kInt;
    case ls::kLong: return at::kLong;
    case ls::kHalf: return at::kHalf;
    case ls::kFloat: return at::kFloat;
    case ls::kDouble: return at::kDouble;
    case ls::kBFloat16: return at::kBFloat16;
    case ls::kBool: return at::kBool;
    default: TORCH_CHECK(false, "no torch dtype for a kernel's output");
  }
}

ls::View view(const torch::Tensor& t) {
  TORCH_CHECK(t.dim() <= ls::View::MAX_DIM, "native kernels: at most ", ls::View::MAX_DIM, " dimensions");
  ls::View v;
  v.data = t.data_ptr();
  v.dtype = scalar_type(t.scalar_type());
  v.ndim = t.dim();
  for (int64_t d = 0; d < v.ndim; ++d) v.shape[d] = t.size(d), v.strides[d] = t.stride(d);
  return v;
}

std::vector<ls::View> views(const std::vector<torch::Tensor>& ts) {
  std::vector<ls::View> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(view(t));
  return out;
}

std::vector<std::vector<ls::View>> views(const std::vector<std::vector<torch::Tensor>>& ts) {
  std::vector<std::vector<ls::View>> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(views(t));
  return out;
}

// The tensors an op makes (its outputs and scratch), alive until the op returns; `alloc` is the kernels' Alloc.
struct Made {
  std::vector<torch::Tensor> tensors;
  ls::Alloc alloc = [this](ls::ScalarType t, const std::vector<int64_t>& sizes) {
    tensors.push_back(torch::empty(sizes, torch::TensorOptions().dtype(torch_type(t))));
    ls::View v = view(tensors.back());
    v.owner = static_cast<int64_t>(tensors.size()) - 1;
    return v;
  };
  torch::Tensor operator[](const ls::View& v) const { return tensors.at(v.owner); }
};

using Tensor = torch::Tensor;
using LoRAPart = std::tuple<int64_t, int64_t, int64_t, int64_t, double, Tensor, Tensor>;  // ls::LoRAPart's tensors

}  // namespace

// Every op runs without the GIL (its arguments are converted before, its result after): a decode step's kernels
// hold the engine thread for most of the step, and the HTTP server's event loop (another thread of the process)
// formats and sends the previous token's chunk meanwhile instead of waiting for the step to end
// (benchmarks/http_overhead.py). Nothing below touches a Python object.
using nogil = py::call_guard<py::gil_scoped_release>;

// The module's init, hidden: Python imports a build by its file's name (llamascope_kernels_avx2_<hash>), and each
// build's module.cpp defines PyInit_<that name>, which calls this one. So this file is compiled once for every build
// (model/kernels/extension.py), and builds loaded side by side (benchmarks/kernel_ab.py) each reach their own init.
#undef PYBIND11_PLUGIN_IMPL
#define PYBIND11_PLUGIN_IMPL(name) extern "C" __attribute__((visibility("hidden"))) PyObject* ls_init_##name()

PYBIND11_MODULE(module, m) {
  const ls::Features f = ls::features();
  m.attr("avx2") = f.avx2;
  m.attr("vnni") = f.vnni;
  m.attr("zmm") = f.zmm;
  m.attr("amx") = f.amx;
  m.def("amx_permitted", &ls::amx_permitted, "whether this process may use the AMX tiles a build with them has");
  m.def("rms_norm", [](const Tensor& x, const Tensor& w, double eps) { Made m; return m[ls::rms_norm(view(x), view(w), eps, m.alloc)]; }, nogil(), "RMSNorm: x (M, D), w (D,) -> (M, D)");
  m.def("silu_mul", [](const Tensor& gu) { Made m; return m[ls::silu_mul(view(gu), m.alloc)]; }, nogil(), "silu(g) * u: (..., 2F) -> (..., F)");
  m.def("rope_", [](Tensor& x, const Tensor& cos, const Tensor& ssin, int64_t n_rot) { ls::rope_(view(x), view(cos), view(ssin), n_rot); }, nogil(), "RoPE in place on the first n_rot heads: x (N, heads, E), cos/signed sin (N, E)");
  // window: the model's sliding window (0: none); scale: the attention scale (0: 1/sqrt(E))
  m.def("paged_decode_attention", [](const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, const Tensor& rows, const Tensor& tables,
           const Tensor& lens, Tensor& out, int64_t window, double scale) {
          ls::paged_decode_attention(view(q), view(k_pool), view(v_pool), view(rows), view(tables), view(lens), view(out),
                                     window, scale);
        }, nogil(), "decode attention over the paged pool",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("rows"), py::arg("tables"), py::arg("lens"),
        py::arg("out"), py::arg("window") = 0, py::arg("scale") = 0.0);
  m.def("paged_decode_attention_telemetry", [](const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, const Tensor& rows, const Tensor& tables,
           const Tensor& lens, Tensor& out, const Tensor& slot, const Tensor& sink_len, Tensor& sink_mass,
           Tensor& top_pos, Tensor& top_prob, int64_t window, double scale) {
          ls::paged_decode_attention_telemetry(view(q), view(k_pool), view(v_pool), view(rows), view(tables), view(lens),
                                               view(out), view(slot), view(sink_len), view(sink_mass), view(top_pos),
                                               view(top_prob), window, scale);
        }, nogil(),
        "decode attention over the paged pool, recording sink mass and top-k keys of the rows that ask",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("rows"), py::arg("tables"), py::arg("lens"),
        py::arg("out"), py::arg("slot"), py::arg("sink_len"), py::arg("sink_mass"), py::arg("top_pos"),
        py::arg("top_prob"), py::arg("window") = 0, py::arg("scale") = 0.0);
  m.def("paged_write", [](const Tensor& k, const Tensor& v, Tensor& k_pool, Tensor& v_pool, const Tensor& slots) {
          ls::paged_write(view(k), view(v), view(k_pool), view(v_pool), view(slots));
        }, nogil(), "write k/v (N, K, E) into pool slots (N,)");
  m.def("int4_linear", [](const Tensor& x, const Tensor& w, const Tensor& s) { Made m; return m[ls::int4_linear(view(x), view(w), view(s), m.alloc)]; }, nogil(), "x (M, K) float32/bfloat16 @ int4 W (N, K)^T -> (M, N) float32");
  m.def("int8_linear", [](const Tensor& x, const Tensor& w, const Tensor& s) { Made m; return m[ls::int8_linear(view(x), view(w), view(s), m.alloc)]; }, nogil(), "x (M, K) float32/bfloat16 @ int8 (Q8_0 blocks) W (N, K)^T -> (M, N) float32");
  m.def("int6_linear", [](const Tensor& x, const Tensor& w, const Tensor& s) { Made m; return m[ls::int6_linear(view(x), view(w), view(s), m.alloc)]; }, nogil(), "x (M, K) float32/bfloat16 @ int6 (Q6_K blocks) W (N, K)^T -> (M, N) float32");
  m.def("float_linear", [](const Tensor& x, const Tensor& w) {
          Made m;
          const Tensor y = m[ls::float_linear(view(x), view(w), m.alloc)];  // float32 sums, rounded once to x's dtype
          return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
        }, nogil(), "x (M, K) @ W (N, K)^T in one dtype, one reduction order for any M");
  m.def("round_activations", [](const Tensor& x, int64_t block) { Made m; return m[ls::round_activations(view(x), block, m.alloc)]; }, nogil(), "x (M, K) float32 rounded to int8 blocks of `block` (32, or 256 for Q4_K) as the kernels round it");
  m.def("int4_dequantize", [](const Tensor& w, const Tensor& s) { Made m; return m[ls::int4_dequantize(view(w), view(s), m.alloc)]; }, nogil(), "int4 W -> (N, K) float32");
  m.def("int8_dequantize", [](const Tensor& w, const Tensor& s) { Made m; return m[ls::int8_dequantize(view(w), view(s), m.alloc)]; }, nogil(), "int8 W -> (N, K) float32");
  m.def("int6_dequantize", [](const Tensor& w, const Tensor& s) { Made m; return m[ls::int6_dequantize(view(w), view(s), m.alloc)]; }, nogil(), "int6 W -> (N, K) float32");
  m.def("lora_expand", [](const Tensor& t, const Tensor& bt) { Made m; return m[ls::lora_expand(view(t), view(bt), m.alloc)]; }, nogil(), "LoRA's B product: t (n, r) @ bt (r, out) -> (n, out) float32, each output summed over r in order by fused multiply-adds");
  m.def("float_linear_argmax", [](const Tensor& x, const Tensor& w) { Made m; return m[ls::float_linear_argmax(view(x), view(w), m.alloc)]; }, nogil(), "argmax_rows(float_linear(x, W)) for float32, the logits never formed -> (M,)");
  m.def("argmax_rows", [](const Tensor& logits) { Made m; return m[ls::argmax_rows(view(logits), m.alloc)]; }, nogil(), "greedy: each row's torch.argmax of logits (B, V) float32, -1 where not finite -> (B,)");
  m.def("step_layers", [](const Tensor& h, const std::vector<std::vector<Tensor>>& layers, double eps, const Tensor& cos,
           const Tensor& ssin, Tensor& k_pools, Tensor& v_pools, const Tensor& slots, const Tensor& rows,
           const Tensor& tables, const Tensor& lens, int64_t H, int64_t K, int64_t E, const std::vector<Tensor>& edits,
           const std::vector<Tensor>& telemetry, const std::vector<std::vector<Tensor>>& extras, int64_t window,
           double scale, double residual, bool post_norm, int64_t qk_norm, const std::vector<Tensor>& lora_rows,
           const std::vector<std::vector<LoRAPart>>& lora) {
          // the residual stream is updated in place: a contiguous copy, the caller's tensor stays as it was
          const Tensor out = h.clone().contiguous();
          std::vector<std::vector<ls::LoRAPart>> parts;
          for (const auto& block : lora) {
            parts.emplace_back();
            for (const auto& [g, site, start, stop, sc, A, B] : block)
              parts.back().emplace_back(g, site, start, stop, sc, view(A), view(B));
          }
          Made m;
          ls::step_layers(view(out), views(layers), eps, view(cos), view(ssin), view(k_pools), view(v_pools), view(slots),
                          view(rows), view(tables), view(lens), H, K, E, views(edits), views(telemetry), views(extras),
                          window, scale, residual, post_norm, qk_norm, views(lora_rows), parts, m.alloc);
          return out;
        }, nogil(), "every block of a step whose rows all attend over the paged pool: h (N, D) -> (N, D)",
        py::arg("h"), py::arg("layers"), py::arg("eps"), py::arg("cos"), py::arg("ssin"), py::arg("k_pools"),
        py::arg("v_pools"), py::arg("slots"), py::arg("rows"), py::arg("tables"), py::arg("lens"), py::arg("H"),
        py::arg("K"), py::arg("E"), py::arg("edits"), py::arg("telemetry"),
        py::arg("extras") = std::vector<std::vector<torch::Tensor>>{}, py::arg("window") = 0, py::arg("scale") = 0.0,
        py::arg("residual") = 1.0, py::arg("post_norm") = false, py::arg("qk_norm") = 0,
        py::arg("lora_rows") = std::vector<torch::Tensor>{}, py::arg("lora") = std::vector<std::vector<LoRAPart>>{});
  m.def("gguf_convert", [](const Tensor& raw, int64_t type, const Tensor& order, Tensor& data, Tensor& scales) {
          ls::gguf_convert(view(raw), type, view(order), view(data), view(scales));
        }, nogil(), "a GGUF matrix's rows (N, row bytes) -> an int4 / int8 layer's buffers");
  m.def("apply_edits", [](Tensor& x, const Tensor& ops, const Tensor& bank) { ls::apply_edits(view(x), view(ops), view(bank)); }, nogil(), "interventions: each op row (Q, 4) of x (N, D) gets its entry from bank (V, D)");
  m.def("apply_clamps", [](Tensor& x, const Tensor& ops, const Tensor& params, const Tensor& bank, const std::vector<Tensor>& encoders) { ls::apply_clamps(view(x), view(ops), view(params), view(bank), views(encoders)); }, nogil(), "feature clamps: each op row (Qc, 4) of x (N, D), its parameters (Qc, 7) float64, its vectors in bank (V, D), the TopK / GroupMax encoders [W_enc^T (F, D), b_enc (F,), ...]");
}
