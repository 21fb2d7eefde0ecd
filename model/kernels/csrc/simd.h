// AVX2 helpers shared by the kernels: loads/stores of float32 and bfloat16 lanes, horizontal sums, exp.
// Every kernel also has a scalar path (tails, and machines built without AVX2).
#pragma once

#include <cmath>
#include <cstdint>

#include "tensor.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LS_AVX2 1
#else
#define LS_AVX2 0
#endif
// VNNI: the quantized kernels' integer block dot products in one `vpdpbusd` per 32 bytes (u8 x s8, 4 products
// summed into each int32 lane, no saturation) instead of maddubs + madd. Two encodings of the same 256-bit
// instruction, built where the CPU has one (model/kernels/__init__.py): AVX-VNNI (VEX, -mavxvnni) or AVX512-VNNI
// with AVX512-VL (EVEX, -mavx512vnni -mavx512vl). Same int32 sums, so the same results.
#if LS_AVX2 && defined(__AVXVNNI__)
#define LS_VNNI 1
#define LS_DPBUSD(acc, u8, s8) _mm256_dpbusd_avx_epi32(acc, u8, s8)
#elif LS_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LS_VNNI 1
#define LS_DPBUSD(acc, u8, s8) _mm256_dpbusd_epi32(acc, u8, s8)
#else
#define LS_VNNI 0
#endif
// 512-bit vectors where the build has AVX512-VNNI and -BW: the quantized kernels'
// many-row tiles take two groups of 8 outputs at once (quant_linear.cpp). Elsewhere vectors stay 256 bits wide
// (-mprefer-vector-width=256).
#if LS_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LS_ZMM 1
#else
#define LS_ZMM 0
#endif
// AMX-INT8 tiles (with the 512-bit vectors above) where the CPU has them: Q4_K's many-row steps (quant_linear.cpp).
#if LS_ZMM && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define LS_AMX 1
#else
#define LS_AMX 0
#endif

namespace ls {

// bf16, f16 (tensor.h): f16 is IEEE half, a 16-bit KV cache's type (paged_attention.cpp), never an activation dtype

// Scalar conversions (torch's own, tensor.h: bfloat16 and half round to nearest even).
inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }
inline float to_f(f16 x) { return static_cast<float>(x); }
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }
// Rounding an intermediate to the activation dtype, as a chain of torch ops in that dtype does.
template <typename T> inline float round_to(float x) { return to_f(from_f<T>(x)); }

#if LS_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m256i i = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(i, 16));
}
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }  // F16C: exact
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// float32 -> bfloat16, round to nearest even (NaN is not produced by these kernels' finite inputs).
inline __m256 round_bf16(__m256 v) {
  __m256i i = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  i = _mm256_add_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(i, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store8(bf16* p, __m256 v) {
  __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
template <typename T> inline __m256 round_to8(__m256 v) { return v; }
template <> inline __m256 round_to8<bf16>(__m256 v) { return round_bf16(v); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x), Cephes' expf polynomial (relative error ~1e-7 over the float range), inputs clamped to [-88.4, 88.4].
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#if LS_ZMM
// 16 lanes: what the 8-lane helpers above compute, lane for lane (AVX512F only: the build adds VL, BW and VNNI).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m512i i = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(i, 16));
}
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 join8(__m256 lo, __m256 hi) {  // (lo | hi)
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline __m512 twice8(__m256 v) { return join8(v, v); }
// join8(load8(lo), load8(hi)) for 8 elements at each of two places, widened in one 512-bit conversion where the
// dtype needs one (the same exact values: fewer instructions in the loops that widen two keys at a time)
inline __m512 load8x2(const float* lo, const float* hi) { return join8(load8(lo), load8(hi)); }
inline __m256i load16x2(const void* lo, const void* hi) {  // 16 bytes at each place, lo's in the low half
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}
inline __m512 load8x2(const bf16* lo, const bf16* hi) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16x2(lo, hi)), 16));
}
inline __m512 load8x2(const f16* lo, const f16* hi) { return _mm512_cvtph_ps(load16x2(lo, hi)); }
inline __m256 lower8(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 upper8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// exp8 on 16 lanes, operation for operation (floor is a rounding to -inf either way: exact).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

}  // namespace ls
