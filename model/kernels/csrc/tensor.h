// What the kernels know of a tensor: plain C++, no PyTorch header. A View is a pointer, a dtype, sizes and strides
// (bindings.cpp, the one file that includes torch/extension.h, makes one of each torch tensor an op is given); the
// memory a kernel returns or needs for scratch comes from the caller (`Alloc`: in bindings.cpp, torch's allocator,
// so an output is a tensor that owns its memory); `parallel_for` and `num_threads` are PyTorch's own, reached
// through bindings.cpp, so the kernels run on the OpenMP threads PyTorch runs on, split as at::parallel_for splits.
// torch/extension.h alone takes longer to compile than any kernel file (docs/engine.md#kernels): every file but
// bindings.cpp includes this instead.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>  // Alloc
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

// TORCH_CHECK's contract: a failed check throws (pybind11 raises it in Python as RuntimeError, as it raises
// c10::Error), with the message alone.
#define LS_CHECK(cond, ...)                                           \
  do {                                                                \
    if (!(cond)) throw std::runtime_error(::ls::message(__VA_ARGS__)); \
  } while (0)

namespace ls {

inline void append(std::string& s, const char* a) { s += a; }
inline void append(std::string& s, const std::string& a) { s += a; }
template <typename I> inline void append(std::string& s, I a) { s += std::to_string(a); }
template <typename... A> std::string message(const A&... a) {
  std::string s;
  (append(s, a), ...);
  return s;
}

// The dtypes the kernels take, by PyTorch's names (c10::ScalarType); Other: any other (every kernel rejects it).
enum class ScalarType { Byte, Char, Short, Int, Long, Half, Float, Double, BFloat16, Bool, Other };
constexpr ScalarType kByte = ScalarType::Byte, kChar = ScalarType::Char, kShort = ScalarType::Short,
                     kInt = ScalarType::Int, kLong = ScalarType::Long, kHalf = ScalarType::Half,
                     kFloat = ScalarType::Float, kDouble = ScalarType::Double, kBFloat16 = ScalarType::BFloat16,
                     kBool = ScalarType::Bool;

inline int64_t element_size(ScalarType t) {
  switch (t) {
    case kByte: case kChar: case kBool: return 1;
    case kShort: case kHalf: case kBFloat16: return 2;
    case kInt: case kFloat: return 4;
    case kLong: case kDouble: return 8;
    default: return 0;
  }
}

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// bfloat16 as c10::BFloat16 stores and converts it: the top 16 bits of a float32; from float32 round to nearest
// even, NaN to 0x7FC0 (c10's round_to_nearest_even).
struct bf16 {
  uint16_t x;
  bf16() = default;
  template <typename I, typename = std::enable_if_t<std::is_integral_v<I>>> explicit bf16(I) = delete;  // (bits: .x)
  explicit bf16(float f) : x(std::isnan(f) ? uint16_t{0x7FC0}
                                          : static_cast<uint16_t>((f32_to_bits(f) + ((f32_to_bits(f) >> 16) & 1) + 0x7FFFu) >> 16)) {}
  explicit operator float() const { return f32_from_bits(static_cast<uint32_t>(x) << 16); }
};

// IEEE half as c10::Half converts it: F16C's conversions where the build has F16C, else the FP16 library's
// (Maratyszcza/FP16 fp16_ieee_from_fp32_value / fp16_ieee_to_fp32_value, which c10 carries); both round to nearest
// even and are exact the other way.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * f32_from_bits(15u << 23);
  const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return f32_from_bits(sign | (two_w < (1u << 27) ? f32_to_bits(denormalized) : f32_to_bits(normalized)));
#endif
}
inline uint16_t half_from_float(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  float base = (std::fabs(f) * f32_from_bits(239u << 23)) * f32_from_bits(17u << 23);
  const uint32_t w = f32_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}
struct f16 {
  uint16_t x;
  f16() = default;
  template <typename I, typename = std::enable_if_t<std::is_integral_v<I>>> explicit f16(I) = delete;  // (bits: .x)
  explicit f16(float f) : x(half_from_float(f)) {}
  explicit operator float() const { return half_to_float(x); }
};

template <typename T> constexpr ScalarType dtype_of();
template <> constexpr ScalarType dtype_of<float>() { return kFloat; }
template <> constexpr ScalarType dtype_of<double>() { return kDouble; }
template <> constexpr ScalarType dtype_of<bf16>() { return kBFloat16; }
template <> constexpr ScalarType dtype_of<f16>() { return kHalf; }
template <> constexpr ScalarType dtype_of<int64_t>() { return kLong; }
template <> constexpr ScalarType dtype_of<int32_t>() { return kInt; }
template <> constexpr ScalarType dtype_of<int16_t>() { return kShort; }
template <> constexpr ScalarType dtype_of<int8_t>() { return kChar; }
template <> constexpr ScalarType dtype_of<uint8_t>() { return kByte; }

// A tensor's memory as the kernels read it: the methods are torch::Tensor's of the same names, on a strided view.
struct View {
  static constexpr int MAX_DIM = 8;
  void* data = nullptr;
  ScalarType dtype = ScalarType::Other;
  int64_t ndim = 0;
  int64_t shape[MAX_DIM] = {};
  int64_t strides[MAX_DIM] = {};  // in elements
  int64_t owner = -1;             // which of the caller's allocations it is (Alloc), -1: an argument's

  int64_t dim() const { return ndim; }
  int64_t size(int64_t d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t stride(int64_t d) const { return strides[d < 0 ? d + ndim : d]; }
  std::vector<int64_t> sizes() const { return std::vector<int64_t>(shape, shape + ndim); }
  ScalarType scalar_type() const { return dtype; }
  int64_t element_size() const { return ls::element_size(dtype); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d = 0; d < ndim; ++d) n *= shape[d];
    return n;
  }
  // torch's rule: sizes of 1 have any stride, and an empty tensor is contiguous
  bool is_contiguous() const {
    if (numel() == 0) return true;
    int64_t expected = 1;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      if (shape[d] != 1 && strides[d] != expected) return false;
      expected *= shape[d];
    }
    return true;
  }
  void* data_ptr() const { return data; }
  template <typename T> T* data_ptr() const {
    LS_CHECK(dtype == dtype_of<T>(), "a kernel read a tensor as another dtype than its own");
    return static_cast<T*>(data);
  }
  // index i of the first dimension (torch's t[i]): the view of one fewer dimension
  View operator[](int64_t i) const {
    View v = *this;
    v.data = static_cast<char*>(data) + i * strides[0] * element_size();
    v.ndim = ndim - 1;
    for (int64_t d = 0; d < v.ndim; ++d) v.shape[d] = shape[d + 1], v.strides[d] = strides[d + 1];
    v.owner = -1;
    return v;
  }
  View narrow(int64_t d, int64_t start, int64_t length) const {
    View v = *this;
    v.data = static_cast<char*>(data) + start * strides[d] * element_size();
    v.shape[d] = length;
    v.owner = -1;
    return v;
  }
};

// Where a kernel's outputs and scratch come from: a new contiguous tensor of dtype t and these sizes, owned by the
// caller until the op returns (its `owner` says which).
using Alloc = std::function<View(ScalarType t, const std::vector<int64_t>& sizes)>;

// at::parallel_for(begin, end, grain, f) and at::get_num_threads(), defined in bindings.cpp; f is passed as a
// pointer to it and a function that calls it (no std::function: nothing is allocated per call).
using Body = void (*)(const void* f, int64_t begin, int64_t end);
void parallel_for(int64_t begin, int64_t end, int64_t grain, Body body, const void* f);
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_for(begin, end, grain, [](const void* p, int64_t b, int64_t e) { (*static_cast<const F*>(p))(b, e); }, &f);
}
int num_threads();

}  // namespace ls
