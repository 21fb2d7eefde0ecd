// Python bindings of llamascope's native CPU kernels (model/kernels/__init__.py builds and loads them).
#include "ops.h"
#include "qgemm.h"

// Every op runs without the GIL (its arguments are converted before, its result after): a decode step's kernels
// hold the engine thread for most of the step, and the HTTP server's event loop (another thread of the process)
// formats and sends the previous token's chunk meanwhile instead of waiting for the step to end
// (benchmarks/http_overhead.py). Nothing below touches a Python object.
using nogil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("avx2") = static_cast<bool>(LS_AVX2);
  m.attr("vnni") = static_cast<bool>(LS_VNNI);
  m.attr("zmm") = static_cast<bool>(LS_ZMM);
  m.attr("amx") = static_cast<bool>(LS_AMX);
  m.def("amx_permitted", &ls::amx_permitted, "whether this process may use the AMX tiles a build with them has");
  m.def("rms_norm", &ls::rms_norm, nogil(), "RMSNorm: x (M, D), w (D,) -> (M, D)");
  m.def("silu_mul", &ls::silu_mul, nogil(), "silu(g) * u: (..., 2F) -> (..., F)");
  m.def("rope_", &ls::rope_, nogil(), "RoPE in place on the first n_rot heads: x (N, heads, E), cos/signed sin (N, E)");
  // window: the model's sliding window (0: none); scale: the attention scale (0: 1/sqrt(E))
  m.def("paged_decode_attention", &ls::paged_decode_attention, nogil(), "decode attention over the paged pool",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("rows"), py::arg("tables"), py::arg("lens"),
        py::arg("out"), py::arg("window") = 0, py::arg("scale") = 0.0);
  m.def("paged_decode_attention_telemetry", &ls::paged_decode_attention_telemetry, nogil(),
        "decode attention over the paged pool, recording sink mass and top-k keys of the rows that ask",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("rows"), py::arg("tables"), py::arg("lens"),
        py::arg("out"), py::arg("slot"), py::arg("sink_len"), py::arg("sink_mass"), py::arg("top_pos"),
        py::arg("top_prob"), py::arg("window") = 0, py::arg("scale") = 0.0);
  m.def("paged_write", &ls::paged_write, nogil(), "write k/v (N, K, E) into pool slots (N,)");
  m.def("int4_linear", &ls::int4_linear, nogil(), "x (M, K) float32/bfloat16 @ int4 W (N, K)^T -> (M, N) float32");
  m.def("int8_linear", &ls::int8_linear, nogil(), "x (M, K) float32/bfloat16 @ int8 (Q8_0 blocks) W (N, K)^T -> (M, N) float32");
  m.def("int6_linear", &ls::int6_linear, nogil(), "x (M, K) float32/bfloat16 @ int6 (Q6_K blocks) W (N, K)^T -> (M, N) float32");
  m.def("float_linear", &ls::float_linear, nogil(), "x (M, K) @ W (N, K)^T in one dtype, one reduction order for any M");
  m.def("round_activations", &ls::round_activations, nogil(), "x (M, K) float32 rounded to int8 blocks of `block` (32, or 256 for Q4_K) as the kernels round it");
  m.def("int4_dequantize", &ls::int4_dequantize, nogil(), "int4 W -> (N, K) float32");
  m.def("int8_dequantize", &ls::int8_dequantize, nogil(), "int8 W -> (N, K) float32");
  m.def("int6_dequantize", &ls::int6_dequantize, nogil(), "int6 W -> (N, K) float32");
  m.def("lora_expand", &ls::lora_expand, nogil(), "LoRA's B product: t (n, r) @ bt (r, out) -> (n, out) float32, each output summed over r in order by fused multiply-adds");
  m.def("float_linear_argmax", &ls::float_linear_argmax, nogil(), "argmax_rows(float_linear(x, W)) for float32, the logits never formed -> (M,)");
  m.def("argmax_rows", &ls::argmax_rows, nogil(), "greedy: each row's torch.argmax of logits (B, V) float32, -1 where not finite -> (B,)");
  m.def("step_layers", &ls::step_layers, nogil(), "every block of a step whose rows all attend over the paged pool: h (N, D) -> (N, D)",
        py::arg("h"), py::arg("layers"), py::arg("eps"), py::arg("cos"), py::arg("ssin"), py::arg("k_pools"),
        py::arg("v_pools"), py::arg("slots"), py::arg("rows"), py::arg("tables"), py::arg("lens"), py::arg("H"),
        py::arg("K"), py::arg("E"), py::arg("edits"), py::arg("telemetry"),
        py::arg("extras") = std::vector<std::vector<torch::Tensor>>{}, py::arg("window") = 0, py::arg("scale") = 0.0,
        py::arg("residual") = 1.0, py::arg("post_norm") = false, py::arg("qk_norm") = 0,
        py::arg("lora_rows") = std::vector<torch::Tensor>{}, py::arg("lora") = std::vector<std::vector<ls::LoRAPart>>{});
  m.def("gguf_convert", &ls::gguf_convert, nogil(), "a GGUF matrix's rows (N, row bytes) -> an int4 / int8 layer's buffers");
  m.def("apply_edits", &ls::apply_edits, nogil(), "interventions: each op row (Q, 4) of x (N, D) gets its entry from bank (V, D)");
}
